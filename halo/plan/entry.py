"""A converted model's entry: the global grid it runs on, each rank's share of it, and the sample the ranks hold.

Why. A layer sees only its own rank's rows; nothing in a local shape says whether it is a share of a field, the
whole field (every rank passing it), a shard along the wrong dim (W, or H of a ``(B, H, W, C)`` tensor) or a shard
of another sample than its peers'. Each of these ran silently wrong. So a converted model knows its grid ``(H, W)``
and every call checks, on every rank, that every field it is given is its share on every sharded axis (H, and W
on a latitude x longitude mesh) with the unsharded dims equal to the grid's.

Where the grid comes from, in order:

==============================  ====================================================================================
``grid=(H, W)`` declared        fixed (``halo.nn.root.set_grid`` changes it: an agreed call on every rank, e.g. for an
                                evaluation at another resolution). The check is local, no communication: a rank
                                whose input is wrong raises at once (expected vs got); its peers, in the first
                                exchange, within the timeout naming it (:func:`halo.set_timeout`).
a ``halo.shard`` output         its spec (global shape, sharded dims, group: :class:`FieldSpec`) names the grid.
the first call's agreement      every rank's extents, gathered with the entry's words (no extra collective): their
                                sums, if they are the balanced split on every sharded axis; re-learned alike on
                                every rank when a later call's agreed extents add up to another grid.
==============================  ====================================================================================

Steady calls. Once the ranks have agreed, a call whose inputs look to this rank exactly as at the last agreed call
(the same digest of every input's shape, dtype, device and grad flag and of every plain argument, the same train /
eval mode, its previous backward run, its field this rank's share of the known grid) reuses that agreement's epoch
with no collective (:func:`steady_epoch`); every :func:`halo.plan.replicated.check_every`-th such call agrees again
(the samples compared, the ranks' call counts checked). A call that changed on every rank (a new grid, new dtypes,
``eval()``) agrees at once. A change on some ranks only (a rank given a wrong shape; a grid whose shares change on
some ranks only: 45 -> 44 rows is 23 + 22 -> 22 + 22) is not seen by the peers, which skip: every rank raises
:class:`halo.HaloCommError` within :func:`halo.set_timeout` (the changed one naming what changed), never a result
computed with the old plans. Declare ``grid=``, pass ``halo.shard`` outputs (their spec names the grid), or call
``halo.nn.root.set_grid`` on every rank when the grid changes.

A whole field on every rank is told from a legitimately ``P`` times taller grid by: a grid already known (declared,
a spec, an earlier call) whose every sharded extent each rank holds in full; else, where the inputs are on the host
(a CPU tensor, on a call that learns: never on the steady path), a fingerprint of each rank's input: the same
non-constant values on every rank of a ``P > 1`` group are the same field, not shares of one. A ``(B, H, W, C)``
tensor cannot be told from a ``(B, C, H, W)`` one of other sizes unless the grid is known: declare ``grid=``.

Samples. An input may carry ``halo_sample_key`` (an int or str, set by a data loader); a ``halo.shard`` output of a
CPU tensor carries a fingerprint of the whole field it was cut from. Both ride on the entry agreement: ranks of a
domain group holding different samples are refused on every rank. No device tensor is read for them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..dist.comm import CommGroup
from ..dist.transport import all_gather_object
from .partition import split_problem, split_sizes

__all__ = ["ENTRY_WORDS", "KEY_ATTR", "EntryView", "FieldSpec", "KnownGrid", "Steady", "agreed", "changed",
           "fingerprint", "forget_grid", "judge", "key_digest", "known_grid", "set_spec", "since_agreed", "spec_of",
           "steady_epoch", "view"]

_SPEC_ATTR = "_halo_field"  # a shard's spec rides on the tensor (PhysicsNeMo keeps its ShardTensor spec likewise)
KEY_ATTR = "halo_sample_key"
_GRID = "_halo_grid"  # the converted model's known grid, in its __dict__
_CALLS = "_halo_entry_calls"  # a declared-grid model's calls that carried a sample to compare, in its __dict__
_STEADY = "_halo_steady"  # the last agreed call as this rank saw it (:class:`Steady`), in the model's __dict__
_SAMPLE = 4  # elements per dim of a fingerprint's strided subsample (at most 4**ndim values read)


@dataclass(frozen=True)
class FieldSpec:
    """What a ``halo.shard`` / ``scatter`` output is a share of: the global shape, the sharded dims (non-negative),
    the group's global ranks and the ranks per sharded dim, and a fingerprint of the whole field (0: none)."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    ranks: tuple[int, ...]
    parts: tuple[int, ...]
    fingerprint: int = 0


def spec_of(t: Any) -> FieldSpec | None:
    """The :class:`FieldSpec` ``t`` carries (a ``halo.shard`` output), or ``None``."""
    return getattr(t, _SPEC_ATTR, None) if isinstance(t, torch.Tensor) else None


def set_spec(t: torch.Tensor, spec: FieldSpec | None) -> None:
    """Record on ``t`` the field it is a share of (``None``: nothing known)."""
    setattr(t, _SPEC_ATTR, spec)


def _digest(data: bytes) -> int:
    """A nonzero 63-bit digest (0 means "none" in the entry's words)."""
    return (int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1) or 1


def fingerprint(t: torch.Tensor, device_ok: bool = False) -> tuple[int, bool]:
    """``(digest, constant)`` of a strided subsample of ``t`` (at most ``4**ndim`` values, its shape included);
    ``(0, True)`` where it is not read: a tensor off the host (unless ``device_ok``: one small copy, for calls that
    learn, never on the steady path), an empty one, or a dtype numpy cannot hold."""
    if t.numel() == 0 or (t.device.type != "cpu" and not device_ok):
        return 0, True
    sub = t.detach()
    for d, n in enumerate(sub.shape):  # a strided view: nothing is copied but the few values read below
        sub = sub[(slice(None),) * d + (slice(None, None, max(1, n // _SAMPLE)),)]
    if sub.device.type != "cpu":
        sub = sub.to("cpu", copy=True)  # (a learning call only: a few hundred values)
    if sub.dtype in (torch.bfloat16, torch.float16):
        sub = sub.view(torch.int16)
    try:
        values = np.ascontiguousarray(sub.resolve_conj().resolve_neg().numpy())
    except (TypeError, RuntimeError):
        return 0, True
    constant = bool(values.size == 0 or (values.reshape(-1) == values.reshape(-1)[0]).all())
    return _digest(repr(tuple(t.shape)).encode() + str(values.dtype).encode() + values.tobytes()), constant


def key_digest(key: Any) -> int:
    return 0 if key is None else _digest(repr((type(key).__name__, key)).encode())


# -- the model's grid ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KnownGrid:
    """A converted model's global grid ``(H, W)`` and where it came from (``declared``, ``spec``, ``learned``)."""

    grid: tuple[int, int]
    source: str


def forget_grid(module: torch.nn.Module) -> None:
    """Drop what ``module`` learned of its grid (``halo.nn.set_grid``: the next call learns it again)."""
    module.__dict__.pop(_GRID, None)
    module.__dict__.pop(_STEADY, None)


@dataclass(frozen=True)
class Steady:
    """The last agreed call of a converted model as this rank saw it: what a steady call must match to reuse its
    epoch without agreeing (``token``: the :mod:`halo.context` it was agreed in; ``calls``: calls since then)."""

    token: object
    digest: bytes
    training: bool
    epoch: int
    calls: int
    shape: tuple[int, ...] | None  # the field's local extents (dims -2, -1), for the error that names a change


def steady_epoch(module: torch.nn.Module, seen: EntryView, token: object) -> int | None:
    """The epoch of the last agreed call if this call may reuse it without agreeing (module docstring, "Steady
    calls"), else ``None``: agree. Every rank decides alike when the ranks make the same calls with inputs that
    change alike; :func:`since_agreed` names the calls counted, which the agreement compares."""
    from .replicated import check_every

    last = module.__dict__.get(_STEADY)
    if last is None or not seen.settled or last.token is not token or last.digest != seen.digest \
            or last.training != module.training:
        return None
    pending = module.__dict__.get("_halo_backward_pending")
    if pending is not None and pending[0]:  # its previous forward's backward did not run here (planner's hint)
        return None
    every = check_every()
    if every and (last.calls + 1) % every == 0:  # the every-n-th: agree (samples compared, counts checked)
        return None
    module.__dict__[_STEADY] = dataclass_replace(last, calls=last.calls + 1)
    return last.epoch


def since_agreed(module: torch.nn.Module, token: object) -> int:
    """Calls since the last agreed one, this one included (0: none agreed in this context): the same on every rank
    that made the same calls; ranks that do not match entered this agreement at different calls."""
    last = module.__dict__.get(_STEADY)
    return 0 if last is None or last.token is not token else last.calls + 1


def agreed(module: torch.nn.Module, seen: EntryView, token: object, epoch: int) -> None:
    """Remember this agreed call (:func:`steady_epoch` matches later calls against it)."""
    module.__dict__[_STEADY] = Steady(token, seen.digest, module.training, epoch, 0, seen.hw)


def changed(module: torch.nn.Module, seen: EntryView, token: object) -> str | None:
    """What changed on this rank since the last agreed call (for an agreement that timed out), or ``None``."""
    last = module.__dict__.get(_STEADY)
    if last is None or last.token is not token:
        return None
    if last.training != module.training:
        what = f"the model went to {'train' if module.training else 'eval'}() mode"
    elif last.shape != seen.hw:
        what = f"its field's local extents (dims -2, -1) went from {last.shape} to {seen.hw}"
    elif last.digest != seen.digest:
        what = "its inputs changed (a shape, dtype, device, requires_grad or a plain argument)"
    else:
        return None
    return (f"on this rank {what} since the model's last agreed call, {last.calls + 1} calls ago; peers whose "
            f"inputs did not change skip the entry's agreement (steady calls run no host collective), so a change "
            f"on some ranks only is not seen by the others: give every rank its share of the same inputs; for a new "
            f"grid, call halo.nn.root.set_grid(model, None) on every rank first, pass halo.shard outputs, or "
            f"declare grid=")


def _sample_check_due(module: torch.nn.Module) -> bool:
    """With a declared grid the entry needs no agreement of its own: the samples the ranks hold (their keys, the
    fingerprint ``halo.shard`` took) are compared at the first call that carries one and then every
    :func:`halo.plan.replicated.check_every` such calls (default 8; the same count on every rank, as ranks make the same
    calls), so a sampler that splits a domain group is named within that many steps at 1/8 of an all-gather a step."""
    from .replicated import check_every

    n = module.__dict__.get(_CALLS, 0)
    module.__dict__[_CALLS] = n + 1
    every = check_every()
    return n == 0 or bool(every) and n % every == 0


def known_grid(module: torch.nn.Module) -> KnownGrid | None:
    """The grid the converted model ``module`` runs on (declared, or learned from its calls), or ``None``."""
    config = module.__dict__.get("_halo_root")
    if config is not None and config.grid is not None:
        return KnownGrid(config.grid, "declared")
    return module.__dict__.get(_GRID)


# -- what one rank brings to the entry ---------------------------------------------------------------------------

#: the entry's words per rank after plans' own: problem, rest digest, h, w, fingerprint, sample key, spec H, spec W,
#: the spec's whole-field fingerprint
ENTRY_WORDS = 9


@dataclass
class EntryView:
    """One rank's inputs as the entry sees them: the digest of everything (the epoch's key), the words it gathers,
    and what the slow path (errors only) reports."""

    digest: bytes
    words: list[int]
    report: dict
    local_only: bool  # the check was local (declared grid, no sample to compare): nothing to gather
    settled: bool = False  # a learned (or spec) grid, and the field is this rank's share of it, with no problem
    hw: tuple[int, ...] | None = None  # the primary field's local extents (dims -2, -1)


def _parts(config: Any, size: int) -> tuple[int, ...]:
    return tuple(config.mesh_shape) if getattr(config, "w_sharded", False) and config.mesh_shape else (size,)


def _share(grid: tuple[int, int], parts: tuple[int, ...], index: int) -> tuple[int, int]:
    """This rank's ``(rows, columns)`` of ``grid`` (balanced split on each sharded axis)."""
    if len(parts) == 2:
        i, j = divmod(index, parts[1])
        return split_sizes(grid[0], parts[0])[i], split_sizes(grid[1], parts[1])[j]
    return split_sizes(grid[0], parts[0])[index], grid[1]


def _touches(shape: tuple[int, ...], grid: tuple[int, int], share: tuple[int, int]) -> bool:
    """Whether an input of ``shape`` is a field of ``grid`` (one this rank must hold its share of): its last dim is
    the grid's or the share's width, or (3+ dims) one of its last two dims or its third-last (H of a
    ``(B, H, W, C)`` tensor) is one of the grid's or the share's extents."""
    if len(shape) < 2:
        return False
    if len(shape) == 2:
        return shape[-1] in (grid[1], share[1])
    extents = {*grid, *share}
    return shape[-1] in extents or shape[-2] in extents or shape[-3] == grid[0]


def _describe(shape: tuple[int, ...]) -> tuple:
    """``shape`` with the extents of dims -2 and -1 replaced by ``-1``: H is sharded; W too on a mesh, and on one
    axis a W that differs across ranks (a flattened H x W, a shape changed on one rank) is left to the layers'
    agreements, which name the layer (and the guard, which names the op)."""
    return (*shape[:-2], -1, -1)


def _axes(parts: tuple[int, ...]) -> str:
    return f"{parts[0]} ranks" if len(parts) == 1 else f"a {parts[0]}x{parts[1]} latitude x longitude mesh"


def _share_str(share: tuple[int, int], parts: tuple[int, ...]) -> str:
    if len(parts) == 2:
        return f"its block of {share[0]} rows x {share[1]} columns"
    return f"{share[0]} rows x {share[1]} columns"


def _spec_problem(spec: FieldSpec, shape: tuple[int, ...], cg: CommGroup, parts: tuple[int, ...]) -> str | None:
    """What is wrong with a ``halo.shard`` output fed to this model: sharded along other dims or another group."""
    nd = len(shape)
    want = (nd - 2,) if len(parts) == 1 else (nd - 2, nd - 1)
    if spec.dims != want or spec.ranks != cg.ranks:
        got = ", ".join(str(d - nd) for d in spec.dims)
        need = ", ".join(str(d - nd) for d in want)
        return (f"its input of shape {shape} is a shard (halo.shard) along dim {got} over global ranks "
                f"{list(spec.ranks)}, but the model shards dims {need} over its domain group (global ranks "
                f"{list(cg.ranks)}, {_axes(parts)}): shard the field along dim -2"
                + (" and -1 (halo.shard_2d)" if len(parts) == 2 else " (halo.shard(x))")
                + " over the model's domain group; a (B, H, W, C) tensor must be permuted to (B, C, H, W) first")
    return None


def view(args: Any, kwargs: Any, module: torch.nn.Module, config: Any, cg: CommGroup, op: str) -> EntryView:
    """This rank's side of the entry (module docstring). With a declared grid and no sample to compare, the
    geometry is checked here, locally, and a wrong input raises at once (expected vs got)."""
    parts = _parts(config, cg.size)
    known = known_grid(module)
    declared = config.grid
    share = _share(known.grid, parts, cg.index) if known is not None else None
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [(k, t) for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    # The primary field: the first that touches the known grid, else the first with 3+ dims, else 2.
    primary = None
    if known is not None:
        primary = next((t for _, t in tensors if _touches(tuple(t.shape), known.grid, share)), None)
    if primary is None:
        primary = next((t for _, t in tensors if t.dim() >= 3), None)
    if primary is None:
        primary = next((t for _, t in tensors if t.dim() == 2), None)
    problem: str | None = None
    keys: set = set()
    hw = tuple(primary.shape[-2:]) if primary is not None else None
    spec_grid, spec_fp = (0, 0), 0
    full: list[Any] = [torch.is_grad_enabled()]
    rest: list[Any] = []
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            key = getattr(leaf, KEY_ATTR, None)
            if key is not None:
                keys.add(key if isinstance(key, (int, str)) and not isinstance(key, bool) else repr(key))
            is_field = hw is not None and (leaf is primary or (
                _touches(shape, known.grid, share) if known is not None
                else leaf.dim() >= 2 and (shape[-1] in hw or shape[-2] in hw)))
            if is_field and problem is None:
                spec = spec_of(leaf)
                if declared is not None and shape[-2:] != share:  # (a learned grid may change: judge() decides)
                    how = f"grid={known.grid}"
                    problem = (f"the model runs on the grid {known.grid} ({how}) "
                               f"over {_axes(parts)}, so {cg.describe()} expects {_share_str(share, parts)} along dims "
                               f"-2, -1 of input {k}, got shape {shape}")
                elif shape[-2:] != hw:
                    problem = (f"input {k} of shape {shape} is a field (it shares an extent with input 0's "
                               f"{hw}) but holds {shape[-2:]} along dims -2, -1 where the first field holds {hw}: "
                               f"every field input must be this rank's share of the same grid")
                elif spec is not None:
                    problem = _spec_problem(spec, shape, cg, parts)
                    if problem is None:
                        sg = (spec.shape[-2], spec.shape[-1])
                        if declared is not None and sg != tuple(declared):
                            problem = (f"input {k} is a shard (halo.shard) of a field of shape {spec.shape}, but the "
                                       f"model was converted with grid={tuple(declared)}")
                        spec_grid, spec_fp = sg, spec_fp or spec.fingerprint
            if is_field:
                full_shape = (*shape[:-2], *declared) if declared is not None and shape[-2:] == share else shape
                rest.append((_describe(shape), str(leaf.dtype), leaf.device.type, leaf.requires_grad))
            else:
                full_shape = shape
                rest.append((shape, str(leaf.dtype), leaf.device.type, leaf.requires_grad))
            full.append((full_shape, str(leaf.dtype), leaf.device.type, leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            full.append(leaf)
            rest.append(leaf)
        else:
            full.append(type(leaf).__qualname__)
            rest.append(type(leaf).__qualname__)
    if problem is not None and len(parts) == 2 and "expects" in problem:
        problem += " (halo.shard_2d)"
    elif problem is not None and "expects" in problem:
        problem += ("; pass this rank's rows of the grid (halo.shard), not the whole field or a shard along "
                    "another dim" + (", or convert without grid=" if declared else ""))
    digest = hashlib.blake2b(repr(full).encode(), digest_size=16).digest()
    key_list = sorted(keys, key=repr)
    if len(key_list) > 1:
        problem = problem or f"its inputs carry different sample keys {key_list} (halo_sample_key)"
    local_only = declared is not None and (not keys and not spec_fp or not _sample_check_due(module))
    if cg.size == 1 or local_only:
        if problem is not None:
            raise ValueError(f"{op}: {problem}")
        return EntryView(digest, [], {}, True)
    fp = 0
    if primary is not None and spec_grid == (0, 0) and (share is None or hw != share):  # a call that learns
        value, constant = fingerprint(primary)
        fp = 0 if constant else value
    h, w = hw if hw is not None else (-1, -1)
    words = [int(problem is not None), _digest(repr(rest).encode()), h, w, fp,
             key_digest(key_list[0] if key_list else None), *spec_grid, spec_fp]
    report = {"problem": problem, "rest": rest,
              "key": key_list[0] if key_list else f"field fingerprint {spec_fp:#x}" if spec_fp else None}
    settled = (known is not None and known.source != "declared" and problem is None and hw == share
               and (spec_grid == (0, 0) or spec_grid == known.grid))
    return EntryView(digest, words, report, False, settled, hw)


# -- the verdict: a pure function of every rank's words (the same error, or none, on every rank) ------------------

def _first_difference(reports: Sequence[dict]) -> tuple[int, int, Any, Any]:
    ref = reports[0]["rest"]
    for r, rep in enumerate(reports[1:], 1):
        mine = rep["rest"]
        if len(mine) != len(ref):
            return r, -1, f"{len(ref)} inputs", f"{len(mine)} inputs"
        for k, (a, b) in enumerate(zip(ref, mine, strict=True)):
            if a != b:
                return r, k, a, b
    return 0, -1, None, None


def _show(entry: Any) -> str:
    if isinstance(entry, tuple) and len(entry) == 4:
        shape, dtype, device, grad = entry
        dims = ", ".join("[sharded]" if s == -1 else str(s) for s in shape)
        return f"a tensor of shape ({dims}) {dtype.removeprefix('torch.')} on {device}" + \
            (" that requires grad" if grad else "")
    return repr(entry)


def _sharded_elsewhere(reports: Sequence[dict]) -> bool:
    """Whether the ranks' inputs differ only along one dim before the last two, and there by the balanced split of
    their sum: fields in another layout (NATTEN's, AFNO's, a Swin stage's ``(B, H, W, C)``, sharded along H at
    dim 1), which the model's layers take as such and check themselves. Every rank reads the same reports."""
    rests = [rep["rest"] for rep in reports]
    if any(len(rest) != len(rests[0]) for rest in rests):
        return False
    found = False
    for entries in zip(*rests, strict=True):
        if all(e == entries[0] for e in entries):
            continue
        if not all(isinstance(e, tuple) and len(e) == 4 and e[1:] == entries[0][1:] for e in entries):
            return False
        shapes = [e[0] for e in entries]
        if any(len(s) != len(shapes[0]) or len(s) < 3 for s in shapes):
            return False
        dims = {d for d in range(len(shapes[0])) if any(s[d] != shapes[0][d] for s in shapes)}
        if len(dims) != 1 or not 1 <= next(iter(dims)) < len(shapes[0]) - 2:
            return False
        (d,) = dims
        sizes = [s[d] for s in shapes]
        if sizes != split_sizes(sum(sizes), len(sizes)):
            return False
        found = True
    return found


def judge(table: np.ndarray, mine: EntryView, module: torch.nn.Module, config: Any, cg: CommGroup,
          op: str) -> None:
    """Check every rank's entry words (``table[r]``: rank ``r``'s :data:`ENTRY_WORDS`) and learn the grid: the same
    ``ValueError`` on every rank, or none. The slow path (gathering every rank's report) runs on errors only."""
    n = cg.size
    problem, rest, hs, ws, fps, keys = (table[:, i] for i in range(6))
    spec_h, spec_w, spec_fp = table[:, 6], table[:, 7], table[:, 8]

    def others(rs: Sequence[int]) -> str:
        return f"group ranks {list(rs)} (global {[cg.ranks[r] for r in rs]})"

    slow = bool(problem.any() or (rest != rest[0]).any() or (keys != keys[0]).any()
                or len({int(f) for f in spec_fp if f}) > 1)
    if slow:
        reports = all_gather_object(mine.report, cg, op)
        bad = [r for r in range(n) if reports[r]["problem"] is not None]
        if bad:
            r = bad[0]
            also = f" (and {others(bad[1:])})" if len(bad) > 1 else ""
            raise ValueError(f"{op}: on {cg.describe(r)}{also}: {reports[r]['problem']}")
        r, k, a, b = _first_difference(reports)
        if r and _sharded_elsewhere(reports):
            return  # fields in another layout (channels-last (B, H, W, C), sharded along dim 1): the layers check
        if r:
            what = f"input {k}" if k >= 0 else "the number of inputs"
            if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 4:
                aspect = "shape" if a[0] != b[0] else "dtype" if a[1] != b[1] else "device" if a[2] != b[2] \
                    else "requires_grad"
                what = f"the {aspect} of input {k}"
            raise ValueError(f"{op}: the ranks of the domain group disagree on {what}: {cg.describe(0)} passes "
                             f"{_show(a)}, {cg.describe(r)} passes {_show(b)}; every rank must pass its share of the "
                             f"same inputs (only the sharded extents may differ)")
        shown = [reports[q]["key"] for q in range(n)]
        odd = [q for q in range(1, n) if shown[q] != shown[0]]
        raise ValueError(
            f"{op}: ranks {','.join(str(q) for q in [0, *odd])} of the domain group are looking at different "
            f"samples: keys {shown} (halo_sample_key, or the fingerprint of the field halo.shard cut) on group ranks "
            f"0..{n - 1}; every rank of a domain group must hold a share of the same sample: sample with halo's "
            f"data-parallel sampler / DistributedSampler(num_replicas=dp_size, rank=dp_rank)")
    if hs[0] < 0:
        return  # no field among the inputs (the same on every rank: the rest digests agree)
    parts = _parts(config, n)
    known = known_grid(module)
    if len(parts) == 2:
        ph, pw = parts
        for r in range(n):
            i, j = divmod(r, pw)
            if hs[r] != hs[i * pw] or ws[r] != ws[j]:
                q = i * pw if hs[r] != hs[i * pw] else j
                raise ValueError(f"{op}: the ranks' blocks do not tile one grid: {cg.describe(q)} holds "
                                 f"{hs[q]} x {ws[q]}, {cg.describe(r)} holds {hs[r]} x {ws[r]}; on a {ph}x{pw} mesh "
                                 f"ranks in one mesh row hold the same rows, in one column the same columns")
        lines = ([int(hs[i * pw]) for i in range(ph)], [int(ws[j]) for j in range(pw)])
    else:
        if (ws != ws[0]).any():
            return  # W differs across ranks: not a field of one grid; the layers refuse it, naming the op
        lines = ([int(h) for h in hs], None)
    for axis, sizes in enumerate(lines):
        if sizes is None:
            continue
        bad = split_problem(sizes, "rows" if axis == 0 else "columns")
        if bad is not None:
            raise ValueError(f"{op}: the inputs are not the shares of any one grid along dim {axis - 2} "
                             f"(group ranks' extents {sizes}): {bad}")
    grid = (sum(lines[0]), int(ws[0]) if lines[1] is None else sum(lines[1]))
    if known is not None and n > 1 and not spec_h[0]:  # (a shard's spec names its grid: no doubt to resolve)
        whole_h = parts[0] > 1 and all(int(h) == known.grid[0] for h in hs)
        whole_w = len(parts) == 2 and parts[1] > 1 and all(int(w) == known.grid[1] for w in ws)
        if whole_h or whole_w:
            what = "rows" if whole_h and not whole_w else "columns" if not whole_h else "rows and columns"
            raise ValueError(
                f"{op}: every rank of the domain group holds all {what} of the model's grid {known.grid} "
                f"({known.source}): the whole field (or, on a mesh, a shard along one axis only) on every rank; "
                f"expected each rank's share ({_share_str(_share(known.grid, parts, 0), parts)} on "
                f"{cg.describe(0)}), got {int(hs[0])} x {int(ws[0])}: pass halo.shard(field) "
                f"{'(halo.shard_2d) ' if len(parts) == 2 else ''}/ halo.scatter, not the whole field (for a new "
                f"grid whose shares are these, call halo.nn.root.set_grid(model, None) on every rank first, or pass "
                f"halo.shard outputs: their spec names the grid)")
    if n > 1 and not spec_h[0] and all(fps) and (fps == fps[0]).all():
        raise ValueError(
            f"{op}: every rank of the domain group holds the same values ({int(hs[0])} x {int(ws[0])} along dims -2, "
            f"-1; the same fingerprint of a strided subsample): the whole field on every rank, not its shares of "
            f"one; pass halo.shard(field) / halo.scatter (or declare grid= if these really are shares of a "
            f"{grid} grid with the same values)")
    if spec_h[0] and (int(spec_h[0]), int(spec_w[0])) != grid:
        raise ValueError(f"{op}: the inputs are shards (halo.shard) of a {int(spec_h[0])} x {int(spec_w[0])} field, "
                         f"but the ranks' shares add up to {grid[0]} x {grid[1]}")
    if config.grid is not None:
        return
    source = "taken from halo.shard's spec" if spec_h[0] else "learned"
    if known is None or known.grid != grid:
        module.__dict__[_GRID] = KnownGrid(grid, source)
