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

What a state holds (:func:`save`, :func:`load`; a dict of named entries, each restored by the one mechanism that
can restore it, so a resumed job continues bitwise where the saved one was):

==============================================  ============================================================
entry                                           saved / restored with
==============================================  ============================================================
``nn.Module`` (plain, converted, DDP, FSDP2,    ``get_model_state_dict`` / ``set_model_state_dict`` (names
HSDP)                                           without the wrapper's prefixes; FSDP2's shards as DTensors)
``torch.optim.Optimizer``                       ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
                                                with the module in the state that holds its parameters: keyed
                                                by parameter names (flat), so it loads into a *fresh*
                                                optimizer, another wrapping, another number of ranks
a tensor, a dict with tensors                   DCP itself, loaded in place (``model.state_dict()``, as before)
an object with ``state_dict``/``load_state_dict``  its ``state_dict()``, pickled; restored by ``load_state_dict``
(LR scheduler, GradScaler, sampler, ...)
plain Python data (a step, an epoch)            pickled; written back into the dict on load
halo's RNG state (``rng=True``, the default)    :func:`halo.random.get_rng_state` of every rank (key
                                                :data:`RNG_KEY`)
==============================================  ============================================================

Anything else is refused with a ``TypeError`` naming the entry (an optimizer without its module beside it, as in
``{"model": model.state_dict(), "optim": optimizer}``, whose state would not be restored; a module or optimizer
nested inside a dict; an object without ``load_state_dict``). A pickled object is kept once when every rank holds
the same bytes (it then loads on any number of ranks), once per rank otherwise (it then loads only on as many
ranks: a load on another number raises, naming it). Every check runs before any byte is written or read and is
agreed by every rank (one bounded all-gather of a flag and a digest of the entries): a bad step, different
entries, or an entry refused on one rank only give the same error on every rank.

DCP deduplicates replicated tensors (a domain-parallel model's parameters are the same on every rank of a domain
group: one copy is written) and reshards on load (a checkpoint saved on 4 ranks loads on 2 or on 1: halo keeps
the unsharded ``state_dict``, invariant 6).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .dist.comm import CommGroup, HaloCommError, comm_group, gather_words

__all__ = ["Checkpoint", "MARKER", "RNG_KEY", "complete", "latest", "load", "save"]

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


# -- what a state holds: each top-level entry is restored by the one mechanism that can restore it ----------------

#: the key under which every save keeps each rank's halo RNG state (``halo.random.get_rng_state``); not a user key
RNG_KEY = "halo.rng"
_KINDS = ("model", "optim", "tensors", "object")
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _plain(obj: Any) -> bool:
    """A value pickled as it is (a step, an epoch, a config): plain Python data, tensors inside containers."""
    if isinstance(obj, _PLAIN) or isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, _PLAIN) and _plain(v) for k, v in obj.items())
    return False


def _hidden_stateful(obj: Any, where: str) -> tuple[str, Any] | None:
    """Where an object with its own state (a module, an optimizer) sits nested inside a dict, and the object: DCP
    calls ``state_dict`` only at the top level (or pickles it), so a load would not restore it."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if _stateful(v) or isinstance(v, torch.nn.Module):
                return f"{where}[{k!r}]", v
            found = _hidden_stateful(v, f"{where}[{k!r}]")
            if found:
                return found
    return None


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(_has_tensor(v) for v in obj)


def _kind(key: Any, value: Any) -> str:
    """How entry ``key`` is saved and restored (module docstring), or a ``TypeError`` naming it."""
    if not isinstance(key, str) or not key or key == RNG_KEY or "@" in key:
        raise TypeError(f"state key {key!r}: expected a non-empty str without '@', not {RNG_KEY!r} (halo keeps the "
                        f"RNG state there)")
    if isinstance(value, torch.nn.Module):
        return "model"
    if isinstance(value, torch.optim.Optimizer):
        return "optim"
    if isinstance(value, torch.Tensor):
        return "tensors"
    if isinstance(value, dict) and not _stateful(value):
        hidden = _hidden_stateful(value, key)
        if hidden:
            raise TypeError(f"state[{key!r}]{hidden[0][len(key):]} is a {_type_name(hidden[1])} inside a dict: put "
                            f"it at the top level of the state (its own key) so that it is restored, not pickled")
        if _has_tensor(value):
            return "tensors"  # a state dict (model.state_dict()): DCP loads its tensors in place, as before
    if _stateful(value) or _plain(value):
        return "object"
    raise TypeError(f"state[{key!r}] is a {_type_name(value)}: halo.checkpoint cannot restore it (expected a module, "
                    f"an optimizer, a tensor, a dict of tensors, an object with state_dict() and load_state_dict(), "
                    f"or plain Python data)")


def _module_of(key: str, opt: torch.optim.Optimizer, state: dict[str, Any]) -> str:
    """The key of the module in ``state`` that holds every parameter of optimizer ``state[key]``: the optimizer's
    state is saved keyed by that module's parameter names (``get_optimizer_state_dict``), which is what lets it load
    into a fresh optimizer, another wrapping (DDP, FSDP2) or another number of ranks."""
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    for k, v in state.items():
        if isinstance(v, torch.nn.Module) and mine <= {id(p) for p in v.parameters()}:
            return k
    modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    raise TypeError(f"state[{key!r}] is a {_type_name(opt)} but no module in the state holds all its parameters "
                    f"(modules: {modules or 'none'}): its state is keyed by parameter names, so pass the model "
                    f"itself beside it, e.g. {{'model': model, {key!r}: optimizer}} (not model.state_dict())")


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # flat optimizer keys (state.<param fqn>.exp_avg): DCP reshards them like the model's own entries
    return StateDictOptions(flatten_optimizer_state_dict=True)


class _Prepared(NamedTuple):
    kinds: dict[str, str]
    dcp_state: dict[str, Any]
    objects: dict[str, bytes]  # save: each object's pickled state (plain values, state_dict()s, the RNG)
    pairs: dict[str, str]  # optimizer key -> its module's key


def _prepare(state: dict[str, Any], op: str, *, rng: bool, loading: bool) -> _Prepared:
    """This rank's entries as DCP sees them (module docstring), or the ``TypeError`` naming what cannot be
    restored. On load the optimizer's state is made now (``get_optimizer_state_dict`` steps a fresh optimizer
    with zero gradients and lr 0), so that DCP has tensors to load into."""
    if not isinstance(state, dict):
        raise TypeError(f"{op}: state must be a dict of named entries, got {_type_name(state)}")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    kinds = {k: _kind(k, v) for k, v in state.items()}
    pairs = {k: _module_of(k, v, state) for k, v in state.items() if kinds[k] == "optim"}
    dcp_state: dict[str, Any] = {}
    objects: dict[str, bytes] = {}
    for k, v in state.items():
        if kinds[k] == "model":
            dcp_state[k] = get_model_state_dict(v, options=_options())
        elif kinds[k] == "optim":
            fresh = not v.state
            dcp_state[k] = get_optimizer_state_dict(state[pairs[k]], v, options=_options())
            if fresh and not loading:
                # torch's helper made the state of an optimizer that has none by stepping it once with zero
                # gradients at lr 0: undo it, or saving before the first step would change the training (Adam's
                # first step would be its second); the checkpoint holds no state for it, as the optimizer
                v.state.clear()
                dcp_state[k] = {n: t for n, t in dcp_state[k].items() if not n.startswith("state.")}
        elif kinds[k] == "tensors":
            dcp_state[k] = v
        elif not loading:
            objects[k] = _pickle(v.state_dict() if _stateful(v) else v)
    if rng and not loading:
        from .random import get_rng_state

        objects[RNG_KEY] = _pickle(get_rng_state())
    return _Prepared(kinds, dcp_state, objects, pairs)


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _digest(data: bytes | str) -> int:
    raw = data.encode() if isinstance(data, str) else data
    return int(np.frombuffer(hashlib.blake2b(raw, digest_size=8).digest(), dtype=np.int64)[0])


def _signature(kinds: dict[str, str], pairs: dict[str, str], extra: str = "") -> int:
    return _digest(json.dumps([sorted(kinds.items()), sorted(pairs.items()), extra]))


def _same_everywhere(failed: BaseException | None, sig: int, table: np.ndarray, col: int, cg: CommGroup, what: str,
                     describe: Any) -> None:
    """Raise on every rank alike when a rank failed to prepare (its error, naming it) or the ranks' entries differ
    (their keys, per rank): the slow path, only taken on an error; ``table[:, col]`` the failure flags, ``col + 1``
    the signatures."""
    bad = [j for j in range(cg.size) if table[j, col]]
    if bad:
        errs = _agree_objects(None if failed is None else (type(failed).__name__, _text(failed)), cg, what)
        j = bad[0]
        kind, msg = errs[j]
        cls = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": KeyError}.get(kind, RuntimeError)
        also = f" (and {', '.join(cg.describe(b) for b in bad[1:])})" if bad[1:] else ""
        raise cls(f"{what}: {cg.describe(j)}{also}: {msg}") from failed
    if len({int(s) for s in table[:, col + 1]}) > 1:
        seen = _agree_objects(describe(), cg, what)
        raise ValueError(f"{what}: the ranks pass different states: "
                         f"{'; '.join(f'{cg.describe(j)}: {seen[j]}' for j in range(cg.size))}")


def _text(exc: BaseException) -> str:
    """An error's message as written (``str`` of a ``KeyError`` is its repr, quotes and all)."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _agree_objects(obj: Any, cg: CommGroup, what: str) -> list[Any]:
    if cg.size == 1:
        return [obj]
    from .dist.comm import all_gather_object

    return all_gather_object(obj, cg, what)


def _read_contents(path: Path) -> dict[str, Any]:
    with open(path / MARKER, encoding="utf-8") as f:
        return json.load(f)


def save(state: dict[str, Any], root: str | os.PathLike, step: int, *, process_group: Any | None = None,
         storage_writer: Any | None = None, rng: bool = True) -> Checkpoint:
    """Save the training state ``state`` as step ``step`` under ``root``, in a new directory; complete only when
    every rank's part is in (module docstring).

    ``state`` maps names to what to restore: a model (``nn.Module``: plain, converted, DDP, FSDP2/HSDP, saved with
    ``get_model_state_dict``), its optimizers (saved with ``get_optimizer_state_dict``, keyed by parameter names, so
    they load into a fresh optimizer, another wrapping or another number of ranks), LR schedulers, GradScalers,
    samplers, any object with ``state_dict()``/``load_state_dict()``, plain values (the step, the epoch), tensors and
    dicts of tensors (``model.state_dict()``, loaded in place as before). ``rng=True`` also keeps every rank's halo
    RNG state (:func:`halo.random.get_rng_state`). Anything else is refused (``TypeError`` naming the entry), on
    every rank alike, as are a bad or different ``step`` and different entries on different ranks. Returns the
    complete checkpoint; raises on every rank if any rank failed (no marker is written: :func:`latest` keeps
    returning the previous one)."""
    import torch.distributed.checkpoint as dcp

    cg = _group(process_group)
    what = "halo.checkpoint.save"  # until the ranks agree on the step, no message names this rank's own
    failed: BaseException | None = None
    prepared = _Prepared({}, {}, {}, {})
    try:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or int(step) < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        prepared = _prepare(state, "halo.checkpoint.save", rng=rng, loading=False)
    except (TypeError, ValueError, KeyError) as exc:
        failed = exc
    step_word = int(step) if failed is None else -1
    sig = _signature(prepared.kinds, prepared.pairs, f"rng={rng}")
    ident = secrets.randbits(62) | 1 if cg.index == 0 else 0
    table = _agree([step_word, ident, int(failed is not None), sig], cg, f"{what}: agreeing on the save")
    _same_everywhere(failed, sig, table, 2, cg, what, lambda: sorted(prepared.kinds.items()))
    steps = {int(s) for s in table[:, 0]}
    if len(steps) > 1:
        raise ValueError(f"{what}: the ranks save different steps: "
                         f"{', '.join(f'{cg.describe(j)}: {int(table[j, 0])}' for j in range(cg.size))}")
    step = int(step)
    what = f"halo.checkpoint.save(step {step})"
    # One copy of an object every rank holds alike (the usual case: any number of ranks loads it), one per rank
    # where they differ (restored only on as many ranks).
    names = sorted(prepared.objects)
    digests = _agree([_digest(prepared.objects[k]) for k in names], cg, f"{what}: comparing objects") if names \
        else np.zeros((cg.size, 0), dtype=np.int64)
    layout = {k: "replicated" if len({int(d) for d in digests[:, i]}) == 1 else "per-rank" for i, k in enumerate(names)}
    dcp_state = dict(prepared.dcp_state)
    for k in names:
        dcp_state[k if layout[k] == "replicated" else f"{k}@rank{cg.index}"] = io.BytesIO(prepared.objects[k])
    root = Path(root)
    path = root / _dir_name(step, int(table[0, 1]))
    failed = None
    try:
        kwargs: dict[str, Any] = {"checkpoint_id": path}
        if storage_writer is not None:
            kwargs["storage_writer"] = storage_writer
        if cg.size > 1:
            kwargs["process_group"] = process_group
        elif not dist.is_initialized():
            kwargs["no_dist"] = True  # one process
        dcp.save(dcp_state, **kwargs)
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
            counts = {k: len(state[k].state) for k in prepared.pairs}
            tmp = path / f".{MARKER}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"step": step, "id": f"{int(table[0, 1]):016x}", "saved_ns": saved, "world": cg.size,
                           "ranks": list(cg.ranks), "kinds": prepared.kinds, "objects": layout,
                           "optimizer_states": counts}, f)
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


def _check_against(contents: dict[str, Any], kinds: dict[str, str], cg: CommGroup, rng: bool) -> None:
    """What this load asks for against what the checkpoint holds (its marker, read alike by every rank): the same
    ``KeyError``/``ValueError`` on every rank, before DCP reads a byte."""
    held = contents.get("kinds")
    if held is None:  # a checkpoint written before halo kept the whole state: tensors only, loaded as before
        refused = [k for k, kind in kinds.items() if kind != "tensors"]
        if refused:
            raise ValueError(f"it holds state dicts only (saved before halo.checkpoint kept optimizers and objects); "
                             f"cannot restore {refused} from it")
        return
    missing = [k for k in kinds if k not in held]
    if missing:
        raise KeyError(f"it holds {sorted(held)}, not {missing}")
    compatible = {"model": {"model", "tensors"}, "tensors": {"model", "tensors"}, "optim": {"optim"},
                  "object": {"object"}}
    wrong = [f"{k!r} (saved as {held[k]}, asked as {kinds[k]})" for k in kinds if held[k] not in compatible[kinds[k]]]
    if wrong:
        raise ValueError(f"entries of another kind: {', '.join(wrong)}")
    world = int(contents.get("world", cg.size))
    objects = contents.get("objects", {})
    per_rank = [k for k in [*kinds, *([RNG_KEY] if rng else [])] if objects.get(k) == "per-rank"]
    if per_rank and world != cg.size:
        raise ValueError(f"{per_rank} differed between the {world} ranks that saved it (one copy per rank) and "
                         f"cannot be restored on {cg.size} ranks; load on {world} ranks"
                         f"{', or pass rng=False' if RNG_KEY in per_rank else ''}")


def load(state: dict[str, Any], root: str | os.PathLike, *, step: int | None = None,
         process_group: Any | None = None, rng: bool = True) -> Checkpoint:
    """Load the newest complete checkpoint under ``root`` (``step=``: the newest of that step) into ``state`` in
    place: models and optimizers through ``set_model_state_dict``/``set_optimizer_state_dict`` (a fresh optimizer
    gets its moments and step; any wrapping and number of ranks), objects through ``load_state_dict``, plain values
    written back into ``state``; ``rng=True``: every rank's halo RNG state too, where the save kept it. Group rank 0
    chooses, every rank loads the same one (bounded agreement); ``FileNotFoundError`` on every rank when there is
    none. An entry the checkpoint does not hold, holds as another kind, or cannot give this number of ranks raises
    on every rank alike, as do different ``state`` keys or ``step=`` on different ranks. Returns the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    cg = _group(process_group)
    what = "halo.checkpoint.load"
    failed: BaseException | None = None
    prepared = _Prepared({}, {}, {}, {})
    try:
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0):
            raise ValueError(f"step must be None or an int >= 0, got {step!r}")
        prepared = _prepare(state, what, rng=rng, loading=True)
    except (TypeError, ValueError, KeyError) as exc:
        failed = exc
    sig = _signature(prepared.kinds, prepared.pairs, f"rng={rng} step={step if failed is None else None}")
    words = [0, 0, 0]
    if cg.index == 0 and failed is None:
        found = latest(root, step)
        if found is not None:
            m = _NAME.match(found.path.name)
            words = [1, found.step, int(m.group(2), 16)] if m is not None else words
    table = _agree([*words, int(failed is not None), sig], cg, f"{what}: choosing the checkpoint")
    _same_everywhere(failed, sig, table, 3, cg, what,
                     lambda: f"{sorted(prepared.kinds.items())}, step={step!r}, rng={rng}")
    chosen = table[0]
    if not chosen[0]:
        raise FileNotFoundError(f"{what}: no complete checkpoint under {root}"
                                f"{f' for step {step}' if step is not None else ''} (a save without its marker "
                                f"{MARKER} did not complete)")
    path = Path(root) / _dir_name(int(chosen[1]), int(chosen[2]))
    mine = _read_marker(path)
    contents: dict[str, Any] = {}
    problem: BaseException | None = None
    if mine is not None:
        try:
            contents = _read_contents(path)
            _check_against(contents, prepared.kinds, cg, rng)
            for k in prepared.pairs:
                want = contents.get("optimizer_states", {}).get(k)
                if want and not state[k].state:
                    raise ValueError(f"optimizer {k!r} has no state to load {want} entries into: its parameters "
                                     f"have gradients, so torch's get_optimizer_state_dict did not make it; call "
                                     f"optimizer.zero_grad(set_to_none=True) before loading")
        except (OSError, ValueError, KeyError) as exc:
            problem = exc
    seen = _agree([int(mine is not None), int(problem is not None)], cg, f"{what}: checking {path}")
    missing = [j for j in range(cg.size) if not seen[j, 0]]
    if missing:
        raise FileNotFoundError(f"{what}: {path} (chosen by {cg.describe(0)}) is not visible as complete on "
                                f"{', '.join(cg.describe(j) for j in missing)}: is {root} on a file system every "
                                f"rank shares?")
    if seen[:, 1].any():
        j = int(np.flatnonzero(seen[:, 1])[0])
        errs = _agree_objects(None if problem is None else (type(problem).__name__, _text(problem)), cg, what)
        cls = {"KeyError": KeyError, "ValueError": ValueError}.get(errs[j][0], RuntimeError)
        raise cls(f"{what}: {path}: {errs[j][1]} (seen by {cg.describe(j)})") from problem
    objects = contents.get("objects", {})
    wanted = [k for k, kind in prepared.kinds.items() if kind == "object"] + \
        ([RNG_KEY] if rng and RNG_KEY in objects else [])
    dcp_state = dict(prepared.dcp_state)
    stateless = [k for k in prepared.pairs if contents.get("optimizer_states", {}).get(k) == 0]
    for k in stateless:  # saved before its first step (or stateless, as plain SGD): param groups only
        dcp_state[k] = {n: t for n, t in dcp_state[k].items() if not n.startswith("state.")}
    stored = {k: k if objects.get(k) == "replicated" else f"{k}@rank{cg.index}" for k in wanted}
    for k in wanted:
        dcp_state[stored[k]] = io.BytesIO()
    kwargs: dict[str, Any] = {"checkpoint_id": path}
    if cg.size > 1:
        kwargs["process_group"] = process_group
    elif not dist.is_initialized():
        kwargs["no_dist"] = True  # one process (DCP reshards a save of any number of ranks)
    dcp.load(dcp_state, **kwargs)
    for k, kind in prepared.kinds.items():
        if kind == "model":
            set_model_state_dict(state[k], dcp_state[k], options=_options())
        elif kind == "optim":
            opt = state[k]
            loaded = dcp_state[k]
            if k in stateless:  # torch's unflattening needs state entries: the fresh one's, dropped below
                loaded = {**prepared.dcp_state[k], **loaded}
            set_optimizer_state_dict(state[prepared.pairs[k]], opt, loaded, options=_options())
            if k in stateless:
                opt.state.clear()  # as it was saved: no state (the fresh one's was made for DCP to load into)
            want = contents.get("optimizer_states", {}).get(k)
            if want is not None and len(opt.state) != int(want):
                raise RuntimeError(f"{what}: optimizer {k!r} holds {len(opt.state)} state entries after the load, "
                                   f"the checkpoint {int(want)}")
    for k in wanted:
        value = torch.load(io.BytesIO(dcp_state[stored[k]].getvalue()), weights_only=False)
        if k == RNG_KEY:
            from .random import set_rng_state

            set_rng_state(value)
        elif _stateful(state[k]):
            state[k].load_state_dict(value)
        else:
            state[k] = value
    return mine if mine is not None else Checkpoint(int(chosen[1]), path, 0)
