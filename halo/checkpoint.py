"""Checkpoints that never mix: ``torch.distributed.checkpoint`` (DCP) into a new directory per save, complete only
once every rank's files are in.

Saving again into one DCP ``checkpoint_id`` can leave a loadable mix: a rank that dies before writing its file
leaves the older save's file (and ``.metadata``) in place, and ``dcp.load`` then returns old and new weights
together. Here every :func:`save` writes a fresh directory ``<root>/step-<step>-<id>``; after every rank's DCP
save returned, the ranks confirm (a bounded agreement on the host group) and group rank 0 writes the marker
``halo_complete.json`` (written to a temporary name and renamed: atomic), then every rank confirms the marker.
:func:`latest` and :func:`load` only ever see directories with a marker, so a save a rank died in is skipped and
the previous complete checkpoint is loaded.

Waits: halo's own agreements (the save's id, the confirmations, the choice of checkpoint on load) are bounded by
``halo.set_timeout`` and raise :class:`halo.HaloCommError` naming the ranks; the collectives inside DCP's own
save and load are bounded by the process group's timeout (DCP takes no other). A failed DCP call on any rank
makes the save raise on every rank, without a marker.

DCP deduplicates replicated tensors (a domain-parallel model's parameters are the same on every rank of a domain
group: one copy is written) and reshards on load (a checkpoint saved on 4 ranks loads on 2 or on 1: halo keeps
the unsharded ``state_dict``, invariant 6).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch.distributed as dist

from .comm import CommGroup, HaloCommError, comm_group, gather_words

__all__ = ["Checkpoint", "MARKER", "complete", "latest", "load", "save"]

MARKER = "halo_complete.json"
_NAME = re.compile(r"^step-(\d{10,})-([0-9a-f]{16})$")


class Checkpoint(NamedTuple):
    """A complete checkpoint: its step, directory and when its save completed (``time.time_ns()`` of rank 0)."""

    step: int
    path: Path
    saved_ns: int


def _group(process_group: Any | None) -> CommGroup:
    if not (dist.is_available() and dist.is_initialized()):
        return comm_group(None)  # one process
    return comm_group(process_group if process_group is not None else dist.group.WORLD)


def _agree(words: list[int], cg: CommGroup, what: str) -> np.ndarray:
    if cg.size == 1:
        return np.asarray([words], dtype=np.int64)
    return gather_words(words, cg, what)


def _dir_name(step: int, ident: int) -> str:
    return f"step-{step:010d}-{ident:016x}"


def _read_marker(path: Path) -> Checkpoint | None:
    m = _NAME.match(path.name)
    if m is None:
        return None
    try:
        with open(path / MARKER, encoding="utf-8") as f:
            marker = json.load(f)
        step, saved = int(marker["step"]), int(marker["saved_ns"])
        ident = int(marker["id"], 16)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no marker (a save that did not complete), or not one of ours
    if step != int(m.group(1)) or ident != int(m.group(2), 16):
        return None
    return Checkpoint(step, path, saved)


def complete(root: str | os.PathLike) -> list[Checkpoint]:
    """Every complete checkpoint under ``root``, oldest save first (incomplete saves are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [c for c in (_read_marker(p) for p in root.iterdir() if p.is_dir()) if c is not None]
    return sorted(found, key=lambda c: (c.saved_ns, c.step, c.path.name))


def latest(root: str | os.PathLike, step: int | None = None) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (the one whose save completed last; ``step=``: the newest of
    that step), or ``None``. A directory without its marker (a rank died while saving) is never returned."""
    found = [c for c in complete(root) if step is None or c.step == step]
    return found[-1] if found else None


def save(state: dict[str, Any], root: str | os.PathLike, step: int, *, process_group: Any | None = None,
         storage_writer: Any | None = None) -> Checkpoint:
    """Save ``state`` (what ``torch.distributed.checkpoint.save`` takes: a dict of tensors, state dicts or
    ``Stateful`` objects) as step ``step`` under ``root``, in a new directory; complete only when every rank's part
    is in (module docstring). Every rank of ``process_group`` (default: the world) calls it with the same ``step``
    (else the same ``ValueError`` on every rank). Returns the complete checkpoint; raises on every rank if any rank
    failed (no marker is written: :func:`latest` keeps returning the previous one)."""
    import torch.distributed.checkpoint as dcp

    step = int(step)
    if step < 0:
        raise ValueError(f"halo.checkpoint.save: step must be >= 0, got {step}")
    cg = _group(process_group)
    what = f"halo.checkpoint.save(step {step})"
    ident = secrets.randbits(62) | 1 if cg.index == 0 else 0
    table = _agree([step, ident], cg, f"{what}: agreeing on the save")
    steps = {int(s) for s in table[:, 0]}
    if len(steps) > 1:
        raise ValueError(f"{what}: the ranks save different steps: "
                         f"{', '.join(f'{cg.describe(j)}: {int(table[j, 0])}' for j in range(cg.size))}")
    root = Path(root)
    path = root / _dir_name(step, int(table[0, 1]))
    failed: BaseException | None = None
    try:
        kwargs: dict[str, Any] = {"checkpoint_id": path}
        if storage_writer is not None:
            kwargs["storage_writer"] = storage_writer
        if cg.size > 1:
            kwargs["process_group"] = process_group
        elif not dist.is_initialized():
            kwargs["no_dist"] = True  # one process
        dcp.save(state, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every rank learns that this save failed
        failed = exc
    try:
        status = _agree([0 if failed is None else 1], cg, f"{what}: confirming every rank's files")
    except HaloCommError as exc:
        if failed is not None:
            raise HaloCommError(f"{exc} (this rank's DCP save had failed too: {type(failed).__name__}: "
                                f"{failed})") from failed
        raise
    bad = [j for j in range(cg.size) if status[j, 0]]
    if bad:
        raise RuntimeError(f"{what}: the save into {path} failed on {', '.join(cg.describe(j) for j in bad)}"
                           f"{f' ({type(failed).__name__}: {failed})' if failed is not None else ' (see its error)'};"
                           f" no marker written, the previous complete checkpoint stays the latest") from failed
    saved = time.time_ns()
    wrote: BaseException | None = None
    if cg.index == 0:
        try:
            tmp = path / f".{MARKER}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"step": step, "id": f"{int(table[0, 1]):016x}", "saved_ns": saved, "world": cg.size,
                           "ranks": list(cg.ranks)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / MARKER)  # atomic: the marker is whole or absent
        except OSError as exc:
            wrote = exc
    done = _agree([0 if wrote is None else 1, saved], cg, f"{what}: confirming the marker")
    if done[0, 0]:
        raise RuntimeError(f"{what}: {cg.describe(0)} could not write the marker of {path}"
                           f"{f': {wrote}' if wrote is not None else ''}; the checkpoint is not complete") from wrote
    return Checkpoint(step, path, int(done[0, 1]))


def load(state: dict[str, Any], root: str | os.PathLike, *, step: int | None = None,
         process_group: Any | None = None) -> Checkpoint:
    """Load the newest complete checkpoint under ``root`` (``step=``: the newest of that step) into ``state`` in
    place (``torch.distributed.checkpoint.load``). Group rank 0 chooses, every rank loads the same one (bounded
    agreement); ``FileNotFoundError`` on every rank when there is none. Returns the checkpoint loaded."""
    import torch.distributed.checkpoint as dcp

    cg = _group(process_group)
    what = "halo.checkpoint.load"
    words = [0, 0, 0]
    if cg.index == 0:
        found = latest(root, step)
        if found is not None:
            m = _NAME.match(found.path.name)
            words = [1, found.step, int(m.group(2), 16)] if m is not None else words
    chosen = _agree(words, cg, f"{what}: choosing the checkpoint")[0]
    if not chosen[0]:
        raise FileNotFoundError(f"{what}: no complete checkpoint under {root}"
                                f"{f' for step {step}' if step is not None else ''} (a save without its marker "
                                f"{MARKER} did not complete)")
    path = Path(root) / _dir_name(int(chosen[1]), int(chosen[2]))
    mine = _read_marker(path)
    seen = _agree([int(mine is not None)], cg, f"{what}: checking {path}")
    missing = [j for j in range(cg.size) if not seen[j, 0]]
    if missing:
        raise FileNotFoundError(f"{what}: {path} (chosen by {cg.describe(0)}) is not visible as complete on "
                                f"{', '.join(cg.describe(j) for j in missing)}: is {root} on a file system every "
                                f"rank shares?")
    kwargs: dict[str, Any] = {"checkpoint_id": path}
    if cg.size > 1:
        kwargs["process_group"] = process_group
    elif not dist.is_initialized():
        kwargs["no_dist"] = True  # one process (DCP reshards a save of any number of ranks)
    dcp.load(state, **kwargs)
    return mine if mine is not None else Checkpoint(int(chosen[1]), path, 0)
