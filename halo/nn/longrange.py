"""Long-range attention on H-shards: regroup the rows across ranks (an all-to-all), attend locally, regroup back.

Attention whose token groups span the whole latitude range cannot run on a shard: CrossFormer's *long-distance*
attention (NCAR CREDIT's WXFormer, ``credit.models.crossformer.Attention(attn_type="long")``) groups the tokens
that lie ``H / window`` rows apart, ``"b d (l1 h) (l2 w) -> (b h w) d l1 l2"`` with ``l1 = l2 = window``: group
``(h, w)`` takes rows ``h, h + H/window, h + 2H/window, ...``, one from every part of the field. Axial attention
over H needs whole columns. Both become local after a *regroup*: a permutation of the global rows along the
sharded dim, from the balanced split of the rows to a split in which every rank holds whole groups.

``regroup(x, plan)`` is that permutation as an autograd Function. Forward: each rank packs the rows each peer
gets into one contiguous buffer (one ``index_select``), the ranks exchange them through ``halo.dist.transport``
(``post_rows`` / ``wait``: gloo has no ``all_to_all``; one point-to-point message per pair that shares rows,
bounded waits naming the peers), and each rank places what arrives (one ``index_copy_``). A permutation's
adjoint is its inverse, so the backward is the same code with the plan reversed: the gradient rows travel back to
where the rows came from (dot-product tested). Nothing is summed or duplicated: forward and backward are exact copies.

``DomainCrossFormerAttention`` is CREDIT's ``Attention`` with the same parameters and attribute names
(``norm``, ``to_qkv``, ``to_out``, ``dpb``, ``heads``, ``scale``, ``attn_type``, ``window_size``,
``rel_pos_indices``), so state_dict keys stay:

* ``"short"``: windows of ``window_size`` consecutive rows, ``"b d (h s1) (w s2) -> (b h w) d s1 s2"``: local on
  every rank when each rank's rows are a multiple of the window (then no window straddles two ranks); otherwise a
  regroup moves the rows to the split of whole windows (windows balanced over the ranks: the identity on global
  rows; with fewer windows than ranks the last ranks hold none), the windows attend locally and the inverse regroup
  restores the split. A height that is not a multiple of the window (CREDIT's rearrange refuses it too) raises the
  same error on every rank, naming the sizes.
* ``"long"``: the prenorm (pointwise), a regroup to ranks holding whole groups ``h`` (groups split balanced over
  the ranks; all ``window`` rows of each; fewer groups than ranks: the last ranks hold none), the attention of
  CREDIT on the local groups, the output projection (pointwise), the inverse regroup. ``H`` and ``W`` must be
  multiples of the window (CREDIT's rearrange requires it): an error on every rank otherwise.

Axial attention over H: :func:`rows_to_columns` regroups H-shards ``(..., H_r, W)`` into W-shards ``(..., H, W_s)``
(every rank holds whole columns: attention along H is local), :func:`columns_to_rows` goes back; both are regroups
of the flattened ``H * W`` positions (index maps of ``H_r * W`` entries, made once per plan).

Parameter gradients on each rank are the contribution of its groups (the dynamic position bias MLP is evaluated
on every rank for its own groups): their sum over the domain group is the unsharded gradient. Dropout of the
attention weights in training is refused (it would need sharding-invariant draws keyed on the groups).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..context import place
from ..dist.comm import CommGroup, comm_group
from ..dist.transport import post_rows, wait
from ..plan.partition import offsets, split_sizes
from ..plan.plans import carry, device_tensor, resolve
from .base import DomainLayer, adopt
from .registry import public

__all__ = [
    "DomainCrossFormerAttention",
    "RegroupPlan",
    "columns_to_rows",
    "crossformer_attention_reference",
    "long_range_plan",
    "regroup",
    "regroup_plan",
    "rows_to_columns",
]


# -- the plan: a permutation of global rows, from one split to another ------------------------------------------

@dataclasses.dataclass(frozen=True)
class RegroupPlan:
    """One rank's part of a row permutation along ``dim``. ``sends[k] = (peer, local input rows)`` and
    ``recvs[k] = (peer, local output rows)``, both in the order of the output positions (so a sender's and a
    receiver's lists pair up); ``rows_in`` / ``rows_out``: this rank's extents before and after. ``group`` is the
    process group (``None``: one process)."""

    group: Any
    dim: int
    rows_in: int
    rows_out: int
    sends: tuple[tuple[int, tuple[int, ...]], ...]
    recvs: tuple[tuple[int, tuple[int, ...]], ...]
    op: str
    me: int = 0
    # Derived once (not per call): the rows to pack and to place, message sizes, this rank's own rows.
    send_index: tuple[int, ...] = ()
    recv_index: tuple[int, ...] = ()
    send_counts: tuple[tuple[int, int], ...] = ()
    recv_counts: tuple[tuple[int, int], ...] = ()
    own_src: tuple[int, ...] = ()
    own_dst: tuple[int, ...] = ()

    @staticmethod
    def make(group: Any, dim: int, rows_in: int, rows_out: int, sends: tuple, recvs: tuple, op: str,
             me: int) -> RegroupPlan:
        def moved(pairs: tuple) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
            index = tuple(i for q, rows in pairs if q != me for i in rows)
            counts = tuple((q, len(rows)) for q, rows in pairs if q != me)
            return index, counts, next((rows for q, rows in pairs if q == me), ())

        (si, sc, src), (ri, rc, dst) = moved(sends), moved(recvs)
        return RegroupPlan(group, dim, rows_in, rows_out, sends, recvs, op, me, si, ri, sc, rc, src, dst)

    def inverse(self) -> RegroupPlan:
        """The reverse permutation (the adjoint): what was received is sent back, and placed where it came from."""
        return RegroupPlan(self.group, self.dim, self.rows_out, self.rows_in, self.recvs, self.sends,
                           f"{self.op} (backward)", self.me, self.recv_index, self.send_index, self.recv_counts,
                           self.send_counts, self.own_dst, self.own_src)


def regroup_plan(cg: CommGroup, dim: int, sizes_in: Sequence[int], sizes_out: Sequence[int],
                 source: Sequence[int], op: str = "regroup") -> RegroupPlan:
    """This rank's plan of the permutation ``out[p] = in[source[p]]`` of global rows along ``dim``: the input is
    split over the ranks as ``sizes_in``, the output as ``sizes_out`` (group order, contiguous blocks each).

    A pure function of its arguments: every rank computes the same permutation (it raises alike on every rank)."""
    total = sum(sizes_in)
    if sum(sizes_out) != total or len(source) != total or sorted(source) != list(range(total)):
        raise ValueError(f"{op}: not a permutation of {total} rows (sizes in {list(sizes_in)}, out "
                         f"{list(sizes_out)}, {len(source)} sources)")
    off_in, off_out = offsets(sizes_in), offsets(sizes_out)
    me = cg.index

    def owner(g: int, offs: list[int]) -> int:
        r = 0
        while offs[r + 1] <= g:
            r += 1
        return r

    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    for s in range(len(sizes_out)):
        for p in range(off_out[s], off_out[s + 1]):
            g = source[p]
            r = owner(g, off_in)
            if r == me:
                sends.setdefault(s, []).append(g - off_in[me])
            if s == me:
                recvs.setdefault(r, []).append(p - off_out[me])
    return RegroupPlan.make(cg.group, dim, sizes_in[me], sizes_out[me],
                            tuple((q, tuple(v)) for q, v in sorted(sends.items())),
                            tuple((q, tuple(v)) for q, v in sorted(recvs.items())), op, me)


# -- the messages ------------------------------------------------------------------------------------------------

def _run(x: torch.Tensor, plan: RegroupPlan) -> torch.Tensor:
    """Apply ``plan`` to ``x`` (no autograd): pack, post every message, place own rows while they travel, wait,
    place the received rows. Returns a tensor with ``plan.rows_out`` rows along ``plan.dim``.

    Runs with torch-function handling off: the result is a field split along ``plan.dim`` as any other, and the
    guard of functional ops (``halo.guard``), which follows H through the row moves in here, must not take the
    regrouped rows for a different layout."""
    with torch._C.DisableTorchFunction():
        return _run_plain(x, plan)


def _run_plain(x: torch.Tensor, plan: RegroupPlan) -> torch.Tensor:
    dim = plan.dim
    xm = x.movedim(dim, 0)
    rest = tuple(xm.shape[1:])
    out = xm.new_empty((plan.rows_out, *rest))
    device = x.device
    cg = comm_group(plan.group) if plan.group is not None else None
    send = xm.index_select(0, device_tensor(plan.send_index, torch.int64, device)) if plan.send_index else None
    recv = xm.new_empty((len(plan.recv_index), *rest)) if plan.recv_index else None
    posted = post_rows(cg, plan.op, send, plan.send_counts, recv, plan.recv_counts) if cg is not None else None
    if plan.own_src:
        out.index_copy_(0, device_tensor(plan.own_dst, torch.int64, device),
                        xm.index_select(0, device_tensor(plan.own_src, torch.int64, device)))
    if posted is not None:
        wait(posted)
    if recv is not None:
        out.index_copy_(0, device_tensor(plan.recv_index, torch.int64, device), recv)
    return out.movedim(0, dim)


class _RegroupFn(torch.autograd.Function):
    """Forward: the permutation. Backward: the inverse permutation (a permutation's exact adjoint)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: RegroupPlan) -> torch.Tensor:
        ctx.plan = plan
        return _run(x, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _run(grad, ctx.plan.inverse()), None


@public
def regroup(x: torch.Tensor, plan: RegroupPlan) -> torch.Tensor:
    """Permute the global rows of the H-sharded ``x`` along ``plan.dim`` as planned (:func:`regroup_plan`), with
    autograd; its backward is the inverse permutation. Every rank of the plan's group must call it (and run its
    backward) with the plan made from the same agreed sizes."""
    if x.shape[plan.dim] != plan.rows_in:
        raise ValueError(f"{plan.op}: the plan expects {plan.rows_in} rows along dim {plan.dim}, got "
                         f"{x.shape[plan.dim]} in shape {tuple(x.shape)}")
    out = _RegroupFn.apply(x, plan)
    carry(out, x)
    return out


# -- axial attention over H: rows <-> columns ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _AxialPlan:
    regroup: RegroupPlan
    height: int  # global H
    rows: int  # this rank's rows (H-shards)
    cols: int  # this rank's columns (W-shards)


def _columns_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], width: int, op: str) -> _AxialPlan:
    """The regroup of :func:`rows_to_columns` on the ``(..., H * W)`` view: rank ``s`` gets columns ``[w0, w1)`` of
    every row, column-major (``(W_s, H)``, transposed afterwards)."""
    (sizes,) = extents
    height = sum(sizes)
    if width < cg.size:
        raise ValueError(f"{op}: {width} columns cannot be split over {cg.size} ranks (a rank would get none)")
    cols = split_sizes(width, cg.size)
    c_off = offsets(cols)
    source = [h * width + w for s in range(cg.size) for w in range(c_off[s], c_off[s + 1]) for h in range(height)]
    plan = regroup_plan(cg, -1, [n * width for n in sizes], [n * height for n in cols], source, op)
    return _AxialPlan(plan, height, sizes[cg.index], cols[cg.index])


def _rows_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], height: int, op: str) -> _AxialPlan:
    (cols,) = extents
    fwd = _columns_plan(cg, (tuple(split_sizes(height, cg.size)),), sum(cols), op)
    return dataclasses.replace(fwd, regroup=dataclasses.replace(fwd.regroup.inverse(), op=op))


@public
def rows_to_columns(x: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """From H-shards ``(..., H_r, W)`` to W-shards ``(..., H, W_s)`` (``W`` split balanced over the group): every
    rank then holds whole columns, so attention (or any op) along H is local: axial attention over H. A regroup
    (autograd: its backward is the inverse regroup). Inverse: :func:`columns_to_rows`."""
    op = "rows_to_columns"
    width = x.shape[-1] if x.dim() >= 2 else 0
    plan = resolve(x, group, op, _columns_plan, (width, op), spec=(-2,))
    flat = regroup(x.flatten(-2), plan.regroup)  # (..., W_s * H), column-major
    out = flat.unflatten(-1, (plan.cols, plan.height)).transpose(-1, -2)
    place(out, -1)  # now sharded along W: the guard must refuse ops along W and let those along H pass
    return out


@public
def columns_to_rows(y: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """The inverse of :func:`rows_to_columns`: from W-shards ``(..., H, W_s)`` back to the balanced H-shards
    ``(..., H_r, W)``."""
    op = "columns_to_rows"
    height = y.shape[-2] if y.dim() >= 2 else 0
    plan = resolve(y, group, op, _rows_plan, (height, op), spec=(-1,))
    flat = regroup(y.transpose(-1, -2).flatten(-2), plan.regroup)  # (..., H_r * W), row-major
    out = flat.unflatten(-1, (plan.rows, -1))
    place(out, -2)
    return out


# -- CrossFormer ---------------------------------------------------------------------------------------------------

def long_range_plan(cg: CommGroup, dim: int, sizes: Sequence[int], window: int, op: str = "long-range attention"
                    ) -> RegroupPlan:
    """The regroup of CrossFormer's long-distance attention: global row ``t * (H / window) + h`` (``t < window``)
    goes to the rank holding group ``h`` (groups split balanced), at local row ``(h - h0) * window + t``."""
    height = sum(sizes)
    if window < 1 or height % window:
        raise ValueError(f"{op}: the field has {height} rows along H, not a multiple of window_size={window} "
                         f"(CrossFormer's long-distance rearrange needs whole groups)")
    groups = height // window
    per = split_sizes(groups, cg.size)
    source = [t * groups + h for h in range(groups) for t in range(window)]
    return regroup_plan(cg, dim, sizes, [n * window for n in per], source, op)


@dataclasses.dataclass(frozen=True)
class _CFPlan:
    forward: RegroupPlan | None  # the regroup before the attention (long: the groups; short: whole windows)
    short: bool = False


def _cf_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], attn_type: str, window: int, width: int,
             op: str) -> _CFPlan:
    (sizes,) = extents
    if width % window:
        raise ValueError(f"{op}: the field has {width} columns along W, not a multiple of window_size={window}")
    if attn_type == "short":
        if all(n % window == 0 for n in sizes):  # every window on one rank: local, no messages
            return _CFPlan(None, True)
        return _CFPlan(_whole_windows_plan(cg, sizes, window, op), True)
    return _CFPlan(long_range_plan(cg, -2, sizes, window, op))


def _whole_windows_plan(cg: CommGroup, sizes: Sequence[int], window: int, op: str) -> RegroupPlan:
    """Short-distance windows on shards that are not whole windows (a conv's balanced split of 6 rows over 2 ranks
    is 3 + 3, windows of 2): move the rows to the split of whole windows (windows balanced over the ranks, 4 + 2;
    with fewer windows than ranks the last ranks hold none), the identity on the global rows; the attention then
    runs locally and the inverse regroup restores the split."""
    height = sum(sizes)
    if height % window:
        raise ValueError(f"{op}: short-distance attention takes windows of {window} rows, but the field has {height} "
                         f"rows along H, not a multiple of window_size={window} (the shards hold {list(sizes)}; "
                         f"CREDIT's rearrange needs whole windows too)")
    blocks = [window * n for n in split_sizes(height // window, cg.size)]
    return regroup_plan(cg, -2, sizes, blocks, list(range(height)), op)


def _short_windows(x: torch.Tensor, w: int) -> torch.Tensor:
    """``"b d (h s1) (w s2) -> (b h w) d s1 s2"``."""
    b, d, hh, ww = x.shape
    return x.reshape(b, d, hh // w, w, ww // w, w).permute(0, 2, 4, 1, 3, 5).reshape(b * (hh // w) * (ww // w), d, w, w)


def _short_back(y: torch.Tensor, b: int, hh: int, ww: int, w: int) -> torch.Tensor:
    """``"(b h w) d s1 s2 -> b d (h s1) (w s2)"``."""
    d = y.shape[1]
    return y.reshape(b, hh // w, ww // w, d, w, w).permute(0, 3, 1, 4, 2, 5).reshape(b, d, hh, ww)


def _long_groups(x: torch.Tensor, w: int) -> torch.Tensor:
    """Regrouped rows ``(h, l1)`` and CREDIT's columns ``(l2 w)``: ``"b d (h l1) (l2 w) -> (b h w) d l1 l2"``."""
    b, d, hh, ww = x.shape
    return x.reshape(b, d, hh // w, w, w, ww // w).permute(0, 2, 5, 1, 3, 4).reshape(b * (hh // w) * (ww // w), d, w, w)


def _long_back(y: torch.Tensor, b: int, hh: int, ww: int, w: int) -> torch.Tensor:
    d = y.shape[1]
    return y.reshape(b, hh // w, ww // w, d, w, w).permute(0, 3, 1, 4, 5, 2).reshape(b, d, hh, ww)


def _attend(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CREDIT's ``Attention.forward`` between the rearranges, on groups ``x`` (N, dim, w, w) already normalised:
    qkv, heads, scaled dot products plus the dynamic position bias, softmax, values, output projection."""
    n, _, w, _ = x.shape
    heads = m.heads
    q, k, v = m.to_qkv(x).chunk(3, dim=1)
    dh = q.shape[1] // heads
    q, k, v = (t.reshape(n, heads, dh, w * w).transpose(-1, -2) for t in (q, k, v))  # b (h d) x y -> b h (x y) d
    q = q * m.scale
    sim = q @ k.transpose(-1, -2)
    pos = torch.arange(-w, w + 1, device=x.device)
    rel_pos = torch.stack(torch.meshgrid(pos, pos, indexing="ij")).reshape(2, -1).t().to(x.dtype)
    sim = sim + m.dpb(rel_pos)[m.rel_pos_indices]
    out = sim.softmax(dim=-1) @ v
    out = out.transpose(-1, -2).reshape(n, heads * dh, w, w)  # b h (x y) d -> b (h d) x y
    return m.to_out(out)


def crossformer_attention_reference(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CREDIT's ``Attention(attn_type, window_size)`` forward on the whole field ``(B, dim, H, W)`` (one process),
    written with reshapes (no einops); ``m`` holds CREDIT's submodules."""
    b, d, hh, ww = x.shape
    w = m.window_size
    x = m.norm(x)
    if m.attn_type == "short":
        return _short_back(_attend(m, _short_windows(x, w)), b, hh, ww, w)
    # "b d (l1 h) (l2 w) -> (b h w) d l1 l2" and back
    g = x.reshape(b, d, w, hh // w, w, ww // w).permute(0, 3, 5, 1, 2, 4).reshape(-1, d, w, w)
    y = _attend(m, g)
    return y.reshape(b, hh // w, ww // w, -1, w, w).permute(0, 3, 4, 1, 5, 2).reshape(b, -1, hh, ww)


def _empty_unguarded(g: torch.Tensor) -> Any:
    """A rank that holds no windows or groups (fewer of them than ranks) attends on an empty batch, still in the
    graph so that its backward joins the inverse regroup's messages; with no rows there is nothing for the guard of
    functional ops to follow (and its row arithmetic assumes rows), so torch-function handling is off for it."""
    return torch._C.DisableTorchFunction() if g.shape[-2] == 0 else contextlib.nullcontext()


@public
class DomainCrossFormerAttention(DomainLayer, nn.Module):
    """CREDIT's CrossFormer ``Attention`` (short or long distance) on an H-shard ``(B, dim, H_r, W)`` (module
    docstring): the same numbers, the same state_dict keys. Wraps an existing module (its Parameters and buffers
    are shared)."""

    #: for ``halo.check_equivalence``: the output is a field (compared), the submodules see windows or regrouped rows
    _halo_check = "children"

    def __init__(self, attention: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        need = ("attn_type", "window_size", "heads", "scale", "norm", "to_qkv", "to_out", "dpb", "rel_pos_indices")
        missing = [a for a in need if not hasattr(attention, a)]
        if missing:
            raise TypeError(f"{name} wraps credit.models.crossformer.Attention; {type(attention).__name__} lacks "
                            f"{missing}")
        if attention.attn_type not in ("short", "long"):
            raise ValueError(f"{name}: attn_type must be 'short' or 'long', got {attention.attn_type!r}")
        adopt(self, attention, name=name)  # shares Parameters; keeps names (state_dict keys unchanged)
        self.halo_init(group)

    def extra_repr(self) -> str:
        return f"attn_type={self.attn_type!r}, window_size={self.window_size}, heads={self.heads}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        drop = getattr(self, "dropout", None)
        if self.training and isinstance(drop, nn.Dropout) and drop.p > 0:
            raise ValueError(f"{name}: attention dropout in training (p={drop.p}) is not supported on H-shards; set "
                             f"it to 0 or call eval()")
        w = self.window_size
        width = x.shape[-1] if x.dim() else 0
        plan = resolve(x, self.group, name, _cf_plan, (self.attn_type, w, width, name), site=self._halo_site)
        if x.dim() != 4:  # after the agreement: every rank has the same number of dims
            raise ValueError(f"{name}: expected a (B, dim, H, W) shard, got shape {tuple(x.shape)}")
        b, _, hh, ww = x.shape
        y = self.norm(x)
        if plan.short:
            g = y if plan.forward is None else regroup(y, plan.forward)
            with _empty_unguarded(g):
                out = _short_back(_attend(self, _short_windows(g, w)), b, g.shape[-2], ww, w)
            out = out if plan.forward is None else regroup(out, plan.forward.inverse())
        else:
            g = regroup(y, plan.forward)
            with _empty_unguarded(g):
                z = _long_back(_attend(self, _long_groups(g, w)), b, g.shape[-2], ww, w)
            out = regroup(z, plan.forward.inverse())
        carry(out, x)
        place(out, -2)
        return out
