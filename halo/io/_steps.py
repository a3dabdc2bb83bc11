"""The runs and step markers of a zarr store written by :func:`halo.io.write_rows`: what makes a write
all-or-nothing, and what a reader trusts (:func:`complete_steps`, :func:`read_step`).

Each written array ``name`` has a marker array ``halo_steps/<name>`` with one int64 per step (the leading index dims)
and an attribute ``run``: the id of the run that writes the store now. A process's first write of ``(store, name)``
records a fresh run id *before* any of its rows are written (so every step an older run wrote stops being
complete), and a step's marker is set to the run id *after* every rank's rows are in. A step is complete when its
marker equals the current run: a step a rank died in, one being written, or one of an older run never is.

Split out of :mod:`halo.io` (which re-exports :func:`complete_steps` and :func:`read_step`; users import them from
there). :mod:`halo.io._write` writes the rows; the other public names here (:class:`Run`, :func:`start_run`,
:func:`mark_complete`, :func:`agree_words`, :func:`pad_words`, the dtype tables) are what it uses, public within
the package, not part of halo's API.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import context
from ..dist.comm import CommGroup, gather_words

__all__ = ["MAX_DIMS", "NP_NAMES", "STEPS", "STORABLE", "Run", "agree_words", "complete_steps", "hash_words",
           "mark_complete", "mark_incomplete", "pad_words", "read_step", "start_run"]

#: the dtypes zarr stores as numpy does, and their numpy names (a dtype travels as its index here)
STORABLE = (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
            torch.uint8, torch.bool)
NP_NAMES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
MAX_DIMS = 8  # dims of a shape or an index that the agreement's fixed-size words carry
STEPS = "halo_steps"  # the zarr group holding one marker array per written array: the run id of each complete step


@dataclass(frozen=True)
class Run:
    """This process's run of one array: its id, and the shape, dtype, index dims and (lat, lon) chunks agreed;
    ``done``: the steps this run may have marked complete (every rank's rows were in; with ``resume=True``, the
    steps complete when it resumed), the same set on every rank: a rewrite of one of them is marked incomplete
    before its first byte is written."""

    run: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    lead: int
    chunks: tuple[int, int]
    done: set = field(default_factory=set, compare=False)


@dataclass
class _IOState:
    """What the writers remember (the :mod:`halo.context` slot ``"io"``): ``runs``, (store, name, group ranks) ->
    the run this process writes, created (or resumed) at its first ``write_rows`` call. One entry per array
    written; a :func:`halo.context.reset` starts new runs (as a new process would)."""

    runs: dict = field(default_factory=dict)


def _state() -> _IOState:
    return context.state("io", _IOState)


def pad_words(values: Sequence[int], fill: int = -1) -> list[int]:
    """``values`` as :data:`MAX_DIMS` ints (cut, or filled with ``fill``): fixed-size words for the agreement."""
    values = [int(v) for v in values][:MAX_DIMS]
    return values + [fill] * (MAX_DIMS - len(values))


def agree_words(words: Sequence[int], cg: CommGroup, what: str) -> np.ndarray:
    """Every rank's words in group order (bounded by ``halo.set_timeout``; one process: its own row)."""
    if cg.size == 1:
        return np.asarray([list(words)], dtype=np.int64)
    return gather_words(words, cg, what)


def hash_words(values: Any) -> int:
    """A signed 63-bit digest of ``repr(values)``: one agreement word."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little", signed=True) >> 1


def _store_key(store: Any) -> Any:
    return os.path.abspath(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else id(store)


def start_run(store: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype, lead: int, table: np.ndarray,
              cg: CommGroup, what: str, resume: bool) -> Run:
    """This process's run of ``(store, name)``: made (rank 0 creates or checks the array, records a fresh run id)
    and agreed at the first call; checked against the call after that. ``table``: every rank's agreed words
    (:func:`halo.io._write.write_rows`), of which the row and column ranges (words 4..7) set the chunks."""
    key = (_store_key(store), name, cg.ranks)
    runs = _state().runs
    known = runs.get(key)
    if known is not None:  # the same on every rank: the same error everywhere
        if (known.shape, known.dtype, known.lead) != (shape, dtype, lead):
            raise ValueError(f"{what}: this run writes {name!r} with shape {known.shape}, dtype {known.dtype}, "
                             f"{known.lead} index dims; got shape {shape}, dtype {dtype}, {lead} index dims")
        return known
    rows = sorted({(int(r[4]), int(r[5])) for r in table})
    cols = sorted({(int(r[6]), int(r[7])) for r in table})
    ch = max(1, -(-shape[-2] // len(rows)))
    cw = max(1, -(-shape[-1] // len(cols)))
    words = [0] * (6 + MAX_DIMS)
    failed: BaseException | None = None
    if cg.index == 0:
        try:
            words = _open_or_create(store, name, shape, np.dtype(NP_NAMES[STORABLE.index(dtype)]), lead, (ch, cw),
                                    resume)
        except Exception as exc:  # noqa: BLE001 - every rank learns that the store could not be opened
            failed, words = exc, [9] + [0] * (5 + MAX_DIMS)
    got = agree_words(words, cg, f"{what}: opening the store")[0]
    status = int(got[0])
    if status == 9:
        raise RuntimeError(f"{what}: {cg.describe(0)} could not open or create the array in {store}"
                           f"{f': {type(failed).__name__}: {failed}' if failed is not None else ' (see its error)'}"
                           ) from failed
    if status in (1, 2):
        nd = int(got[4])
        old = tuple(int(v) for v in got[6:6 + nd])
        old_dtype = NP_NAMES[int(got[5])] if got[5] >= 0 else "another dtype"
        if status == 1:
            raise ValueError(f"{what}: {store} already has an array {name!r} of shape {old}, dtype {old_dtype}; this "
                             f"write is shape {shape}, dtype {NP_NAMES[STORABLE.index(dtype)]}: refused (never "
                             f"resized, nothing dropped); write to another name or store, or delete it first")
        raise ValueError(f"{what}: {store}'s array {name!r} is chunked {old} along its leading dims; write_rows "
                         f"needs one step per chunk along the {lead} index dims and whole leading dims after them "
                         f"(a step's chunks are written whole); write to another name or store")
    if status == 3:
        raise ValueError(f"{what}: resume=True but {store} has no run of {name!r} recorded by write_rows to resume")
    run = Run(int(got[1]), shape, dtype, lead, (int(got[2]), int(got[3])))
    if resume:  # the steps the resumed run completed: every rank reads the markers once (after rank 0 checked them)
        run.done.update(complete_steps(store, name))
        # ... and every rank has read them before rank 0 may unmark one (a rank reading after it would skip the
        # unmarking the others wait in); the same set everywhere, checked
        digest = hash_words(sorted(run.done))
        seen = agree_words([digest], cg, f"{what}: the resumed run's complete steps")[:, 0]
        if (seen != digest).any():
            raise RuntimeError(f"{what}: the ranks read different complete steps of the resumed run of {name!r} in "
                               f"{store} (is another process writing it?); group ranks "
                               f"{[j for j in range(cg.size) if seen[j] != seen[0]]} differ from group rank 0")
    runs[key] = run
    return run


def _open_or_create(store: Any, name: str, shape: tuple[int, ...], npdtype: np.dtype, lead: int,
                    chunks: tuple[int, int], resume: bool) -> list[int]:
    """On group rank 0: create (or check) the array and its step markers, record the run. The words agreed on:
    ``[status, run id, lat chunk, lon chunk, existing ndim, existing dtype, *existing shape or chunks]``."""
    import zarr

    root = zarr.open_group(store, mode="a")
    want = (*([1] * lead), *shape[lead:-2], *chunks)
    if name in root:
        arr = root[name]
        old_dtype = NP_NAMES.index(str(np.dtype(arr.dtype))) if str(np.dtype(arr.dtype)) in NP_NAMES else -1
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != npdtype:
            return [1, 0, 0, 0, len(arr.shape), old_dtype, *pad_words(arr.shape, 0)]
        if tuple(arr.chunks[:-2]) != want[:-2]:
            return [2, 0, 0, 0, len(arr.chunks) - 2, old_dtype, *pad_words(arr.chunks[:-2], 0)]
        chunks = tuple(int(c) for c in arr.chunks[-2:])
    else:
        root.create_array(name, shape=shape, chunks=want, dtype=npdtype, fill_value=0)
    steps = root.require_group(STEPS)
    marks = steps[name] if name in steps else None
    if marks is not None and tuple(marks.shape) != shape[:lead]:
        marks = None  # the steps of another layout: none of them is complete for this run
    if resume:
        run = int(marks.attrs.get("run", 0)) if marks is not None else 0
        if not run:
            return [3] + [0] * (5 + MAX_DIMS)
    else:
        if marks is None:
            marks = steps.create_array(name, shape=shape[:lead], chunks=(1,) * lead, dtype="int64", fill_value=0,
                                       overwrite=True)
        run = secrets.randbits(62) | 1
        marks.attrs["run"] = run  # before any row of this run: the older run's steps stop being complete
    return [0, run, chunks[0], chunks[1], 0, 0, *([0] * MAX_DIMS)]


def mark_complete(store: Any, name: str, index: tuple[int, ...], run: int) -> None:
    """Step ``index`` of ``name`` is complete for ``run`` (group rank 0, after every rank's rows are in)."""
    import zarr

    marks = zarr.open_array(store, path=f"{STEPS}/{name}", mode="r+")
    marks[index] = run


def mark_incomplete(store: Any, name: str, index: tuple[int, ...]) -> None:
    """Step ``index`` of ``name`` is not complete (group rank 0, before a complete step is rewritten)."""
    import zarr

    marks = zarr.open_array(store, path=f"{STEPS}/{name}", mode="r+")
    marks[index] = 0


def _markers(store: Any, name: str) -> tuple[Any, int]:
    import zarr

    root = zarr.open_group(store, mode="r")
    if name not in root:
        raise ValueError(f"halo.io: no array {name!r} in {store} (it has {sorted(root.array_keys())})")
    if STEPS not in root or name not in root[STEPS]:
        raise ValueError(f"halo.io: {store}'s array {name!r} has no step markers: it was not written by "
                         f"halo.io.write_rows (or by a version without them), so no step is known to be complete")
    marks = root[STEPS][name]
    return marks, int(marks.attrs.get("run", 0))


def complete_steps(store: str | os.PathLike, name: str) -> list[tuple[int, ...]]:
    """The steps (``index`` tuples of :func:`halo.io.write_rows`) of ``name`` that the store's current run wrote
    completely, in order. A step a rank died in, one still being written, or one of an older run is not listed."""
    marks, run = _markers(store, name)
    values = np.asarray(marks[...])
    return [tuple(int(i) for i in ix) for ix in np.argwhere(values == run)] if run else []


def read_step(store: str | os.PathLike, name: str, index: tuple[int, ...] | int = ()) -> np.ndarray:
    """Step ``index`` of ``name`` (the whole field: every rank's rows), only if it is complete for the store's
    current run (else ``ValueError``); a step overwritten while it was read raises too."""
    import zarr

    index = (index,) if isinstance(index, (int, np.integer)) else tuple(int(i) for i in index)
    marks, run = _markers(store, name)
    if len(index) != marks.ndim:
        raise ValueError(f"halo.io: {name!r} is written in steps of {marks.ndim} index dims, got index {index}")

    def complete() -> bool:
        return bool(run) and int(marks[index if index else ()]) == run

    if not complete():
        raise ValueError(f"halo.io: step {index} of {name!r} in {store} is not complete (a rank died or failed "
                         f"while writing it, it is being written, or an older run wrote it); complete steps: "
                         f"{complete_steps(store, name)}")
    values = np.asarray(zarr.open_array(store, path=name, mode="r")[index])
    now = _markers(store, name)
    if now[1] != run or int(now[0][index if index else ()]) != run:
        raise ValueError(f"halo.io: step {index} of {name!r} in {store} was rewritten while it was read")
    return values
