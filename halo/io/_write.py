"""All-or-nothing writes of a field's rows, rank by rank, into one zarr array: :func:`write_rows`.

Each rank writes the rows it holds (no gather); the rows of a chunk that straddles two ranks are sent to the rank
that holds the chunk's first row, which writes the chunk whole (no two ranks ever write one chunk). What makes a
step all-or-nothing (the run id recorded first, the step's marker last) is :mod:`halo.io._steps`.

Split out of :mod:`halo.io` (which re-exports :func:`write_rows`; users import it from there). :func:`rank_block`
is how both the reads and the writes cut the grid over the ranks: public within the package, not part of halo's
API.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..dist import transport
from ..dist.comm import CommGroup, comm_group
from ..dist.mesh import mesh_2d
from ..plan.partition import split_offsets
from ._steps import MAX_DIMS, NP_NAMES, STORABLE, agree_words, mark_complete, mark_incomplete, pad_words, start_run

__all__ = ["rank_block", "write_rows"]


def rank_block(group: Any | None, mesh: Any | None, w: int) -> tuple[int | None, int, slice]:
    """``(parts along H, this rank's H index, its longitudes)`` of a grid ``w`` longitudes wide: over the rows of
    ``group`` (``parts`` ``None``: H over the whole group, every longitude) or the blocks of a latitude x longitude
    ``mesh`` (both balanced splits, as ``halo.shard_2d`` cuts them)."""
    if mesh is None:
        return None, 0, slice(0, w)
    if mesh_2d(mesh) is None:
        raise ValueError(f"halo.io: mesh= takes a DomainMesh with two domain axes, got {mesh!r}")
    if group is not None:
        raise ValueError("halo.io: pass group= (latitude rows) or mesh= (latitude x longitude blocks), not both")
    offs = split_offsets(w, mesh.axis_size(1))
    j = mesh.axis_rank(1)
    return mesh.axis_size(0), mesh.axis_rank(0), slice(offs[j], offs[j + 1])


def _describe(row: np.ndarray) -> str:
    nd, nl, code = int(row[0]), int(row[1]), int(row[2])
    shape = "more than 8 dims" if nd < 0 else tuple(int(v) for v in row[9:9 + nd])
    index = "more than 8 dims" if nl < 0 else tuple(int(v) for v in row[17:17 + nl])
    dtype = NP_NAMES[code] if code >= 0 else "a dtype zarr cannot store"
    return f"shape {shape}, index {index}, dtype {dtype}{', resume=True' if row[8] else ''}"


def _owned(start: int, stop: int, chunk: int, n: int) -> tuple[int, int]:
    """The rows ``[a, b)`` of the chunks whose first row lies in ``[start, stop)`` (this rank writes them)."""
    k0, k1 = -(-start // chunk), -(-stop // chunk)
    return (k0 * chunk, min(k1 * chunk, n)) if stop > start and k1 > k0 else (0, 0)


def _meet(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r1 > r0 and c1 > c0 else None


def write_rows(store: str | os.PathLike, name: str, local: torch.Tensor, shape: tuple[int, ...],
               index: tuple[int, ...] | int = (), *, group: Any | None = None, mesh: Any | None = None,
               resume: bool = False) -> None:
    """Write this rank's rows of one step of a field into a zarr array shared by the domain group, all or nothing.

    ``local``: this rank's ``(..., H_r, W)`` rows of a field whose whole array has ``shape`` (leading dims, e.g.
    ``(time, channel, H, W)``); ``index``: the step, where along the leading dims this field goes (``(t,)`` writes
    ``array[t, :, rows, :]``). Every rank of the group calls it for the same step; ``halo.gather`` is never
    needed. With ``mesh=`` (a latitude x longitude ``DomainMesh``) each rank writes its block.

    What a reader can count on (:func:`halo.io.complete_steps`, :func:`halo.io.read_step`):

    - **All or nothing per step.** After every rank's rows are in the store (a bounded confirmation on the host
      group), group rank 0 writes the step's marker: the run id, in ``halo_steps/<name>`` of the store. A step a
      rank died in (or that failed on any rank) has no marker of this run and is never reported complete; the
      complete steps before it are intact. Once it returns on any rank, the step is complete (a second bounded
      confirmation: a marker rank 0 could not write raises the same ``RuntimeError`` on every rank).
    - **A rewrite is never half complete.** Writing a step again that is complete (the same run, or the first
      steps of a job resumed with ``resume=True``) first marks it incomplete (group rank 0, confirmed by every rank
      before any rank writes a byte): a rank that dies or fails in the rewrite leaves it not complete, never listed
      complete with rows of two writes.
    - **Runs never mix.** A process's first call for ``(store, name)`` starts a new run: a fresh run id is recorded
      before any of its rows are written, so the steps an older run wrote into the same store are no longer
      reported complete (they are overwritten step by step). ``resume=True`` continues the store's last run
      instead (a restarted job that keeps the steps written before the restart).
    - **Agreed, checked.** Every rank's ``shape``, ``index``, dtype and rows are agreed on before anything is
      written: a difference (one rank's ``T=5`` vs the others' ``T=6``), a wrong shard shape or a dtype zarr cannot
      store (bfloat16: convert first) raises the same ``ValueError``/``TypeError`` on every rank. An existing
      array of another shape or dtype is refused on every rank (never resized, never a dropped channel).
    - **Bounded.** Every wait (the agreements, the boundary rows, the confirmation) is bounded by
      ``halo.set_timeout`` (else the process group's timeout): a dead or stalled peer gives
      :class:`halo.HaloCommError` naming the ranks, on every survivor.

    Chunks: ``ceil(H / P_h)`` rows by ``ceil(W / P_w)`` columns, one step per chunk along the leading index dims
    (721 rows on 4 ranks: 181-row chunks, 4 chunk files per step and channel block). With a balanced split not every
    rank's first row is on a chunk boundary (rows 0, 181, 361, 541): each chunk is written whole by the rank that
    holds its first row, after the rank holding the chunk's other rows sent them (a few rows, bounded waits), so no
    two ranks ever write one chunk. An existing array keeps its own latitude/longitude chunks.
    """
    import zarr

    index = (index,) if isinstance(index, (int, np.integer)) else tuple(int(i) for i in index)
    shape = tuple(int(s) for s in shape)
    what = f"halo.io.write_rows({name!r}, index {index})"
    h, w = (shape[-2], shape[-1]) if len(shape) >= 2 else (0, 0)
    parts_h, index_h, cols = rank_block(group, mesh, w)
    cg = comm_group(group if mesh is None else mesh.domain_group)
    if parts_h is None:
        parts_h, index_h = cg.size, cg.index
    offs = split_offsets(h, parts_h)
    rows = (offs[index_h], offs[index_h + 1])
    code = STORABLE.index(local.dtype) if local.dtype in STORABLE else -1
    words = [len(shape) if len(shape) <= MAX_DIMS else -1, len(index) if len(index) <= MAX_DIMS else -1, code,
             local.ndim if local.ndim <= MAX_DIMS else -1, rows[0], rows[1], cols.start, cols.stop, int(resume),
             *pad_words(shape), *pad_words(index), *pad_words(local.shape)]
    table = agree_words(words, cg, what)
    _check_agreed(table, cg, what, local.dtype)
    lead = len(index)
    run = start_run(store, name, shape, local.dtype, lead, table, cg, what, resume)
    me = cg.index
    failed: BaseException | None = None
    if index in run.done:  # a rewrite of a step that is (or may be) complete: not complete before its first byte
        if me == 0:
            try:
                mark_incomplete(store, name, index)
            except Exception as exc:  # noqa: BLE001 - every rank learns that the step could not be unmarked
                failed = exc
        _confirm(failed, cg, what, "marking the step incomplete before it is rewritten", "marking the step "
                 "incomplete", "nothing of it was rewritten, it is still complete")
        run.done.discard(index)

    # -- this rank's rows, and the boundary rows of the chunks it writes whole ------------------------------------
    blocks = [tuple(int(v) for v in row[4:8]) for row in table]
    ch, cw = run.chunks
    regions = [(*_owned(b[0], b[1], ch, h), *_owned(b[2], b[3], cw, w)) for b in blocks]
    mine = blocks[me]
    data = np.ascontiguousarray(local.detach().cpu().numpy())
    lead_shape = tuple(data.shape[:-2])
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    received: list[tuple[tuple[int, int, int, int], torch.Tensor]] = []
    if cg.size > 1:
        for j in range(cg.size):
            if j == me:
                continue
            out = _meet(mine, regions[j])
            if out is not None:
                piece = torch.from_numpy(np.ascontiguousarray(
                    data[..., out[0] - mine[0]:out[1] - mine[0], out[2] - mine[2]:out[3] - mine[2]]))
                sends.append((j, piece))
            inc = _meet(blocks[j], regions[me])
            if inc is not None:
                buf = torch.empty((*lead_shape, inc[1] - inc[0], inc[3] - inc[2]), dtype=local.dtype)
                recvs.append((j, buf))
                received.append((inc, buf))
        transport.wait(transport.post(cg, f"{what}: boundary rows", sends, recvs, host=True))
    region = regions[me]
    failed = None
    try:
        if region[1] > region[0] and region[3] > region[2]:
            block = np.empty((*lead_shape, region[1] - region[0], region[3] - region[2]), dtype=data.dtype)
            own = _meet(mine, region)
            pieces = [(own, data[..., own[0] - mine[0]:own[1] - mine[0], own[2] - mine[2]:own[3] - mine[2]])] \
                if own is not None else []
            pieces += [(inc, buf.numpy()) for inc, buf in received]
            for (r0, r1, c0, c1), values in pieces:
                block[..., r0 - region[0]:r1 - region[0], c0 - region[2]:c1 - region[2]] = values
            arr = zarr.open_array(store, path=name, mode="r+")
            arr[(*index, ..., slice(region[0], region[1]), slice(region[2], region[3]))] = block
    except Exception as exc:  # noqa: BLE001 - every rank learns that this step failed
        failed = exc
    _confirm(failed, cg, what, "confirming every rank's rows", "the write",
             "this step is not marked complete, the store's complete steps are unchanged")
    run.done.add(index)  # every rank's rows are in: from here on the step may be marked complete
    failed = None
    if me == 0:
        try:
            mark_complete(store, name, index, run.run)  # last: the step is complete
        except Exception as exc:  # noqa: BLE001 - every rank learns that the step is not marked
            failed = exc
    _confirm(failed, cg, what, "marking the step complete", "marking the step complete",
             "its rows are in the store but the step is not reported complete")


def _confirm(failed: BaseException | None, cg: CommGroup, what: str, doing: str, act: str, outcome: str) -> None:
    """Every rank learns whether ``act`` failed on any rank (one bounded agreement) and raises the same error: a
    write that returns on one rank returns on all, with the step complete."""
    status = agree_words([0 if failed is None else 1], cg, f"{what}: {doing}")
    bad = [j for j in range(cg.size) if status[j, 0]]
    if bad:
        text = (f"{what}: {act} failed on {', '.join(cg.describe(j) for j in bad)}"
                f"{f' ({type(failed).__name__}: {failed})' if failed is not None else ' (see its error)'}; "
                f"{outcome}")
        raise RuntimeError(text) from failed


def _check_agreed(table: np.ndarray, cg: CommGroup, what: str, dtype: torch.dtype) -> None:
    """The same checks, on the same table, on every rank: the same error everywhere."""
    ref = table[0]
    for j in range(1, cg.size):
        if not np.array_equal(np.r_[table[j, :3], table[j, 8:25]], np.r_[ref[:3], ref[8:25]]):
            raise ValueError(f"{what}: the group's ranks disagree: {cg.describe(0)} writes {_describe(ref)}, "
                             f"{cg.describe(j)} writes {_describe(table[j])}; every rank must write the same step "
                             f"of the same array")
    nd, nl, code = int(ref[0]), int(ref[1]), int(ref[2])
    shape = tuple(int(v) for v in ref[9:9 + nd]) if nd >= 0 else ()
    index = tuple(int(v) for v in ref[17:17 + nl]) if nl >= 0 else ()
    if nd < 2:
        raise ValueError(f"{what}: shape needs at most {MAX_DIMS} dims ending in (H, W), got "
                         f"{'more' if nd < 0 else shape}")
    if nl < 0 or nl > nd - 2:
        raise ValueError(f"{what}: index {index} has more dims than the leading dims of shape {shape}")
    if any(s < 0 for s in shape) or any(not 0 <= i < s for i, s in zip(index, shape, strict=False)):
        raise ValueError(f"{what}: index {index} out of range for shape {shape}")
    if code < 0:
        raise TypeError(f"{what}: zarr/numpy cannot store {dtype}; convert first (e.g. local.float())")
    bad = []
    for j in range(cg.size):
        r0, r1, c0, c1 = (int(v) for v in table[j, 4:8])
        want = (*shape[nl:-2], r1 - r0, c1 - c0)
        got = tuple(int(v) for v in table[j, 25:25 + int(table[j, 3])]) if table[j, 3] >= 0 else "more than 8 dims"
        if got != want:
            bad.append(f"{cg.describe(j)} holds rows {r0}..{r1} and columns {c0}..{c1} of {shape[-2:]}, so expects "
                       f"{want}, got {got}")
    if bad:
        raise ValueError(f"{what}: wrong shard shape: {'; '.join(bad)}")
