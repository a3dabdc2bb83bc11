"""Attention over all tokens on shards: ``F.scaled_dot_product_attention`` with the token dim split over a group.

``ring_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, *, group)`` has the semantics of
``torch.nn.functional.scaled_dot_product_attention`` on the *global* tokens, where the token dim (dim -2 of
``q``, ``k``, ``v``: ``(B, heads, N_local, d)``) is split over the ranks of ``group``: rank order is global token
order, counts may be uneven and a rank may hold none. Each rank gets its own query rows of the output.

Two exact schemes, one choice (``variant=``):

``"ring"``      K and V (packed into one contiguous buffer ``(.., n, d + d_v)``) travel around the ring, rank ``r``
                sending to ``r + 1`` and receiving from ``r - 1`` (point-to-point through
                :mod:`halo.dist.transport`, bounded waits naming the peer); the next block is in flight while the
                current one is used. An online softmax (running max ``m`` and sum ``l``) combines the blocks:
                ``out = sum_o exp(S_o - m) V_o / l``, ``lse = m + log l``; exact in float64 (the reordering of a
                sum, not an approximation). Memory: this rank's q, k, v, out and two K/V blocks; the scores of one
                block ``(.., n_q, n_o)`` at a time: ~1/P of the unsharded attention's, no field gathered.
``"gathered"``  an all-gather of K/V (padded to the largest count), local SDPA on all keys; backward: the
                reduce-scatter of dK/dV (the all-gather's exact adjoint). Memory: all keys and the scores
                ``(.., n_q, N)`` on every rank. Cheaper for small sizes (fewer messages, one fused SDPA).
``"auto"``      (default) ``"gathered"`` where all ranks' K/V together take at most :data:`GATHER_MAX_BYTES`,
                else ``"ring"``: measured in ``benchmarks/ring.py`` (``benchmarks/RESULTS.md``). Decided from agreed
                sizes: the same on every rank.

Backward of the ring (the exact adjoint, FlashAttention-2's): with ``D = rowsum(dO * O)`` and the saved ``lse``,
every block gives ``P_o = exp(S_o - lse)``, ``dV_o += P_o^T dO``, ``dS_o = P_o * (dO V_o^T - D)``,
``dQ += dS_o K_o * scale``, ``dK_o += dS_o^T Q * scale``. The K/V blocks travel the ring again with their dK/dV
accumulators beside them (one buffer); after ``P - 1`` hops a final hop takes each accumulator back to its owner.
A float ``attn_mask`` that requires grad gets ``dS`` (local: each rank holds its query rows of the mask).
bf16 / fp16 inputs run the ring in fp32 (its sums, and its messages: twice the bytes) and return their dtype;
autocast is off inside the ring (invariant 5).

Masks and positions are global: ``attn_mask`` has the global key dim ``N`` (or 1) and as query dim this rank's
rows ``n_q``, the global ``L`` (each rank then takes its own rows) or 1; boolean (True = attend) or additive. Key
block ``o`` uses the mask's columns ``[off_o, off_o + n_o)``. ``is_causal`` uses global positions (query ``i``
attends to keys ``j <= i``, top-left aligned as SDPA's). A query row with no key left gives 0 (as SDPA).
``dropout_p > 0`` is refused (each rank would draw its own pattern). Every rank's shapes are agreed on first
(:func:`halo.plan.plans.resolve`), so bad input raises the same error on every rank, never a hang.

The token order of a rank's keys does not matter (attention without position terms is permutation-equivariant in
the keys): on a latitude x longitude mesh, where a rank's tokens are not contiguous in global order, the ring over
all domain ranks is still exact for the queries it holds; masks and ``is_causal`` need global positions and are
refused there by the layers (this function takes the rank order as the token order).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..context import place
from ..dist.comm import CommGroup, comm_group
from ..dist.transport import all_gather, post, reduce_scatter, wait
from ..plan.partition import offsets
from ..plan.plans import Site, carry, resolve, state
from .registry import public

__all__ = [
    "GATHER_MAX_BYTES",
    "place_like",
    "RingPlan",
    "VARIANTS",
    "choose_variant",
    "gather_tokens",
    "latitude_only",
    "ring_sdpa",
    "ring_shift",
]

VARIANTS = ("auto", "ring", "gathered")

#: ``variant="auto"`` gathers K/V when all ranks' K and V together take at most this many bytes (measured on a
#: 2-core VM, CPU gloo: benchmarks/RESULTS.md, "Global attention"; the gathered form's scores ``(.., n_q, N)`` grow
#: with N while the ring's stay one block).
GATHER_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """One rank's view of a sharded attention call: every rank's query and key counts (group order) and offsets,
    this rank's index, the group (``None``: one process) and the scheme chosen."""

    group: Any
    size: int
    index: int
    q_sizes: tuple[int, ...]
    k_sizes: tuple[int, ...]
    q_off: tuple[int, ...]
    k_off: tuple[int, ...]
    variant: str
    op: str

    @property
    def nxt(self) -> int:
        return (self.index + 1) % self.size

    @property
    def prv(self) -> int:
        return (self.index - 1) % self.size

    def owner(self, step: int) -> int:
        """The rank whose K/V block this rank holds after ``step`` hops."""
        return (self.index - step) % self.size


def place_like(out: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    """Tell a watching guard (a converted model's first call) that ``out`` holds its tokens at ``dim`` with ``x``'s
    rows (tokens of a field: its rows times the columns merged after them), so that ``out`` and ``x`` pair up in a
    residual sum as the unsharded tensors do."""
    guard = state().guard
    if guard is None:
        return
    known = guard.dims.get(x)
    rows = known[1] if known is not None and known[0] >= 0 else None
    place(out, dim, rows)


def choose_variant(variant: str, total_keys: int, row_bytes: int) -> str:
    """``"ring"`` or ``"gathered"`` for ``variant`` (``"auto"``: by the bytes of all ranks' K/V, ``total_keys`` rows
    of ``row_bytes`` each, against :data:`GATHER_MAX_BYTES`)."""
    if variant not in VARIANTS:
        raise ValueError(f"ring_sdpa: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant != "auto":
        return variant
    return "gathered" if total_keys * row_bytes <= GATHER_MAX_BYTES else "ring"


def _q_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(extents[0])


def _kv_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], q_sizes: tuple[int, ...], variant: str,
             row_bytes: int, op: str) -> RingPlan:
    (k_sizes,) = extents
    chosen = "local" if cg.size == 1 else choose_variant(variant, sum(k_sizes), row_bytes)
    return RingPlan(cg.group, cg.size, cg.index, tuple(q_sizes), tuple(k_sizes), tuple(offsets(q_sizes)),
                    tuple(offsets(k_sizes)), chosen, op)


def _mask_rows(cg: CommGroup, extents: tuple[tuple[int, ...], ...], q_sizes: tuple[int, ...], keys: int,
               op: str) -> str:
    """How each rank's mask rows read (agreed: the same verdict on every rank): ``"local"`` (this rank's query
    rows), ``"global"`` (all ``L`` rows: take ours) or ``"broadcast"`` (1 row)."""
    (rows,) = extents
    total = sum(q_sizes)
    kinds = []
    for r, (m, n) in enumerate(zip(rows, q_sizes, strict=True)):
        if m == n:
            kinds.append("local")
        elif m == total:
            kinds.append("global")
        elif m == 1:
            kinds.append("broadcast")
        else:
            raise ValueError(f"{op}: attn_mask on rank {r} has {m} query rows; expected that rank's {n} query rows, "
                             f"all {total} global rows, or 1 (mask rows per rank {list(rows)}, query rows "
                             f"{list(q_sizes)})")
    return kinds[cg.index]


# -- the messages -------------------------------------------------------------------------------------------------

def _hop(plan: RingPlan, send: torch.Tensor, recv_rows: int, what: str, reverse: bool = False
         ) -> tuple[Any, torch.Tensor]:
    """Post ``send`` to the next rank (the previous where ``reverse``) and a receive of ``recv_rows`` rows (dim -2)
    from the other side; returns (posted, receive buffer). Wait with :func:`halo.dist.transport.wait`."""
    to, frm = (plan.prv, plan.nxt) if reverse else (plan.nxt, plan.prv)
    shape = (*send.shape[:-2], recv_rows, send.shape[-1])
    recv = send.new_empty(shape)
    cg = comm_group(plan.group)
    posted = post(cg, what, [(to, send)], [(frm, recv)])
    return posted, recv


class _ShiftFn(torch.autograd.Function):
    """Forward: each rank's block to the next rank (the last's to the first). Backward: the gradient back to the
    previous rank (the inverse shift: a permutation's exact adjoint)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        ctx.plan = plan
        with torch._C.DisableTorchFunction():
            posted, recv = _hop(plan, x.contiguous(), plan.k_sizes[plan.prv], f"{plan.op} (shift)")
            wait(posted)
        return recv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        with torch._C.DisableTorchFunction():
            posted, recv = _hop(plan, grad.contiguous(), plan.k_sizes[plan.index], f"{plan.op} (shift, backward)",
                                reverse=True)
            wait(posted)
        return recv, None


def ring_shift(x: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """One hop of the ring that :func:`ring_sdpa` runs: each rank's ``x`` (rows along dim -2, uneven counts
    allowed) goes to the next rank of ``group``; returns the previous rank's. Autograd: the backward sends the
    gradient back (the exact adjoint). Every rank of ``group`` must call it."""
    op = "ring_shift"
    sizes = resolve(x, group, op, _q_plan, spec=(-2,), allow_empty=True, split=False)
    cg = comm_group(group)
    plan = RingPlan(cg.group, cg.size, cg.index, sizes, sizes, tuple(offsets(sizes)), tuple(offsets(sizes)), "ring",
                    op)
    if cg.size == 1:
        return x
    out = _ShiftFn.apply(x, plan)
    carry(out, x)
    return out


class _GatherFn(torch.autograd.Function):
    """Forward: every rank's rows (dim -2) in group order on every rank (an all-gather, padded to the largest
    count). Backward: the sum over ranks of the gradient of each rank's rows, to that rank (a reduce-scatter: the
    exact adjoint of the all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        ctx.plan = plan
        sizes, width = plan.k_sizes, max(plan.k_sizes)
        with torch._C.DisableTorchFunction():
            padded = x.new_zeros((*x.shape[:-2], width, x.shape[-1]))
            padded.narrow(-2, 0, x.shape[-2]).copy_(x)
            chunks = [torch.empty_like(padded) for _ in sizes]
            all_gather(chunks, padded, comm_group(plan.group), f"{plan.op} (all-gather of K/V)")
            return torch.cat([c.narrow(-2, 0, n) for c, n in zip(chunks, sizes, strict=True)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        sizes, width = plan.k_sizes, max(plan.k_sizes)
        with torch._C.DisableTorchFunction():
            chunks = []
            for o, n in enumerate(sizes):
                c = grad.new_zeros((*grad.shape[:-2], width, grad.shape[-1]))
                c.narrow(-2, 0, n).copy_(grad.narrow(-2, plan.k_off[o], n))
                chunks.append(c)
            mine = grad.new_empty(chunks[0].shape)
            reduce_scatter(mine, chunks, comm_group(plan.group), f"{plan.op} (reduce-scatter of dK/dV)")
            return mine.narrow(-2, 0, sizes[plan.index]).contiguous(), None


def gather_tokens(x: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """Every rank's rows of ``x`` (dim -2, uneven counts allowed) in group order, on every rank: the gathered
    variant's all-gather, with autograd (backward: the reduce-scatter, its exact adjoint)."""
    op = "gather_tokens"
    sizes = resolve(x, group, op, _q_plan, spec=(-2,), allow_empty=True, split=False)
    cg = comm_group(group)
    if cg.size == 1:
        return x
    plan = RingPlan(cg.group, cg.size, cg.index, sizes, sizes, tuple(offsets(sizes)), tuple(offsets(sizes)),
                    "gathered", op)
    out = _GatherFn.apply(x, plan)
    carry(out, x)
    return out


# -- the ring's math ----------------------------------------------------------------------------------------------

def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
            plan: RingPlan, o: int) -> torch.Tensor:
    """``q k^T * scale`` of this rank's queries and key block ``o``, masked (the mask's columns of block ``o``;
    causal by global positions)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        part = mask.narrow(-1, plan.k_off[o], plan.k_sizes[o]) if mask.shape[-1] != 1 else mask
        s = s.masked_fill(~part, -math.inf) if part.dtype == torch.bool else s + part
    if causal:
        qi = torch.arange(plan.q_off[plan.index], plan.q_off[plan.index] + q.shape[-2], device=q.device)
        kj = torch.arange(plan.k_off[o], plan.k_off[o] + k.shape[-2], device=q.device)
        s = s.masked_fill(kj[None, :] > qi[:, None], -math.inf)
    return s


def _skipped(plan: RingPlan, o: int, nq: int, causal: bool) -> bool:
    """Block ``o`` holds no key any of this rank's queries attends to (empty, or wholly above the causal diagonal)."""
    if nq == 0 or plan.k_sizes[o] == 0:
        return True
    return causal and plan.k_off[o] > plan.q_off[plan.index] + nq - 1


def _finite(m: torch.Tensor) -> torch.Tensor:
    """``m`` with -inf (rows that attend to nothing yet) as 0, so that ``exp(s - m)`` stays 0 rather than NaN."""
    return m.masked_fill(torch.isinf(m), 0.0)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, o: int, mask: torch.Tensor | None,
           causal: bool) -> bool:
    """Whether block ``o`` runs on torch's fused CPU kernel (flash attention with its log-sum-exp, forward and
    backward): no mask on it (no attn_mask; causal only where the whole block is below the diagonal), 4-d
    ``(B, heads, n, d)`` tensors of equal leading dims and head sizes, on the CPU. Otherwise the block's scores are
    computed explicitly (``_scores``)."""
    if mask is not None or q.device.type != "cpu" or q.dim() != 4 or k.shape[:2] != q.shape[:2] \
            or v.shape[-1] != q.shape[-1] or q.dtype not in (torch.float32, torch.float64):
        return False
    return not causal or plan.k_off[o] + plan.k_sizes[o] - 1 <= plan.q_off[plan.index]


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float, plan: RingPlan, o: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries on key block ``o`` alone: its output and log-sum-exp ``(.., n_q, 1)``
    (-inf and 0 for a row with no key in the block)."""
    if _fused(q, k, v, plan, o, mask, causal):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        return out, lse.unsqueeze(-1).to(q.dtype)
    s = _scores(q, k, mask, causal, scale, plan, o)
    m = _finite(s.amax(-1, keepdim=True))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / total.masked_fill(total == 0, 1.0)
    return out, m + torch.log(total)


def _ring_forward(q: torch.Tensor, kv: torch.Tensor, d: int, mask: torch.Tensor | None, causal: bool, scale: float,
                  plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' outputs combined by their log-sum-exps: ``lse = log(sum_o exp(lse_o))``,
    ``out = sum_o exp(lse_o - lse) out_o`` (the online softmax, one block at a time)."""
    nq, dv = q.shape[-2], kv.shape[-1] - d
    lead = torch.broadcast_shapes(q.shape[:-2], kv.shape[:-2])
    out = q.new_zeros((*lead, nq, dv))
    lse = q.new_full((*lead, nq, 1), -math.inf)
    cur = kv
    for step in range(plan.size):
        o = plan.owner(step)
        posted = None
        if step < plan.size - 1:  # the next block travels while this one is used
            posted, nxt = _hop(plan, cur, plan.k_sizes[plan.owner(step + 1)], plan.op)
        if not _skipped(plan, o, nq, causal):
            out_b, lse_b = _block_forward(q, cur[..., :d], cur[..., d:], mask, causal, scale, plan, o)
            new = torch.logaddexp(lse, lse_b)
            base = _finite(new)
            out = out * torch.exp(lse - base) + out_b * torch.exp(lse_b - base)
            lse = new
        if posted is not None:
            wait(posted)
            cur = nxt
    return out, lse


def _ring_backward(q: torch.Tensor, kv: torch.Tensor, d: int, mask: torch.Tensor | None, causal: bool,
                   scale: float, plan: RingPlan, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   mask_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    nq, width = q.shape[-2], kv.shape[-1]
    big = torch.broadcast_shapes(q.shape[:-2], kv.shape[:-2])
    delta = (dout * out).sum(-1, keepdim=True)
    base = _finite(lse)
    dq = torch.zeros_like(q) if q.shape[:-2] == big else q.new_zeros((*big, *q.shape[-2:]))
    dmask = q.new_zeros((*big, nq, plan.k_off[-1])) if mask_grad else None
    # What travels: the block's K/V (sent on at once, while this rank computes with it) and its dK/dV
    # accumulators (sent on after this rank added its part; the last hop takes them home). Two messages per hop
    # between the same pair, posted in the same order on both sides.
    cur = kv.expand(*big, *kv.shape[-2:]).contiguous()
    grads = kv.new_zeros((*big, *kv.shape[-2:]))
    lse_fused = None
    for step in range(plan.size):
        o = plan.owner(step)
        ahead = None
        if step < plan.size - 1:
            ahead, nxt = _hop(plan, cur, plan.k_sizes[plan.owner(step + 1)], f"{plan.op} (backward)")
        if not _skipped(plan, o, nq, causal):
            k, v = cur[..., :d], cur[..., d:width]
            if _fused(q, k, v, plan, o, mask, causal):
                if lse_fused is None:
                    lse_fused = lse.squeeze(-1).float() if q.dtype == torch.float32 else lse.squeeze(-1)
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout, q, k, v, out, lse_fused, 0.0, False, scale=scale)  # P from the global lse and out
                dq = dq + gq
                grads[..., :d] += gk
                grads[..., d:] += gv
            else:
                s = _scores(q, k, mask, causal, scale, plan, o)
                p = torch.exp(s - base)
                dp = torch.matmul(dout, v.transpose(-1, -2))
                ds = p * (dp - delta)
                dq = dq + torch.matmul(ds, k) * scale
                grads[..., :d] += torch.matmul(ds.transpose(-1, -2), q) * scale
                grads[..., d:] += torch.matmul(p.transpose(-1, -2), dout)
                if dmask is not None:
                    dmask.narrow(-1, plan.k_off[o], plan.k_sizes[o]).copy_(ds)
        rows = plan.k_sizes[plan.owner(step + 1)] if step < plan.size - 1 else plan.k_sizes[plan.index]
        posted, grads = _hop(plan, grads, rows, f"{plan.op} (backward, dK/dV)")
        if ahead is not None:
            wait(ahead)
            cur = nxt
        wait(posted)
    return dq, grads, dmask


class _RingFn(torch.autograd.Function):
    """Ring attention (module docstring): forward the online softmax over the K/V blocks passed around the ring;
    backward its exact adjoint, dK/dV accumulated along the ring and brought home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, d: int, causal: bool,
                scale: float, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
        with torch._C.DisableTorchFunction(), torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, kv, d, mask, causal, scale, plan)
        ctx.save_for_backward(q, kv, mask, out, lse)
        ctx.args = (d, causal, scale, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
        q, kv, mask, out, lse = ctx.saved_tensors
        d, causal, scale, plan = ctx.args
        mask_grad = mask is not None and ctx.needs_input_grad[2]
        with torch._C.DisableTorchFunction(), torch.autocast(q.device.type, enabled=False):
            dq, dkv, dmask = _ring_backward(q, kv, d, mask, causal, scale, plan, out, lse, dout.contiguous(),
                                            mask_grad)
            dq = dq.sum_to_size(q.shape)
            dkv = dkv.sum_to_size(kv.shape)
            if dmask is not None:
                dmask = dmask.sum_to_size(mask.shape)
        return dq, dkv, dmask, None, None, None, None


# -- the public function ------------------------------------------------------------------------------------------

def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"{op}: q, k, v must have the same number of dims (>= 2), got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: expected k (..., n, d) and v (..., n, d_v) with the same n and q's d; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


@public
def ring_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, *,
              group: Any | None = None, variant: str = "auto", sites: Sequence[Site] | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)`` on the global tokens,
    with the token dim (dim -2 of ``q``, ``k``, ``v``) split over ``group`` in rank order (module docstring).

    Args:
        q: this rank's queries ``(..., n_q, d)``; leading dims and ``d`` equal on every rank; counts may differ
            (and be 0).
        k: this rank's keys ``(..., n_k, d)``.
        v: this rank's values ``(..., n_k, d_v)``.
        attn_mask: boolean (True attends) or additive, broadcastable to ``(..., rows, N)`` with ``N`` the global
            key count (or 1) and ``rows`` this rank's ``n_q``, the global ``L`` (this rank's rows are taken) or 1.
        dropout_p: must be 0 (a draw per rank would differ from the unsharded model's).
        is_causal: query ``i`` attends to keys ``j <= i`` in global positions; not together with ``attn_mask``.
        scale: default ``1 / sqrt(d)``.
        group: the group the tokens are split over (default: the domain group).
        variant: ``"auto"``, ``"ring"`` or ``"gathered"``.
        sites: for layers: three :class:`halo.plan.plans.Site` (q, k/v, mask) whose agreements are recorded.

    Returns:
        this rank's output rows ``(..., n_q, d_v)``. Every rank of ``group`` must call it (and its backward).
    """
    op = "ring_sdpa"
    if dropout_p:
        raise ValueError(f"{op}: dropout_p={dropout_p} is not supported on shards (each rank would draw its own "
                         f"pattern: different from the unsharded model); pass 0.0 (in eval, or for the layer: "
                         f"set its attention dropout to 0)")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: give attn_mask or is_causal=True, not both (as F.scaled_dot_product_attention)")
    if variant not in VARIANTS:
        raise ValueError(f"{op}: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    sq, skv, smask = sites if sites is not None else (None, None, None)
    same = q.dim() >= 2 and k.dim() == q.dim() and v.dim() == q.dim() and k.shape[:-1] == v.shape[:-1] \
        and q.shape[-1] == k.shape[-1] and q.dtype == k.dtype == v.dtype
    q_sizes = resolve(q, group, op, _q_plan, site=sq, spec=(-2,), allow_empty=True, split=False)
    # K and V in one buffer: what the ring sends. A rank whose k, v do not fit hands the agreement a tensor of
    # another rank of dims, so that every rank raises (never one alone).
    kv = torch.cat([k, v], dim=-1) if same else q.unsqueeze(0)
    d = q.shape[-1]
    row_bytes = kv.element_size() * kv.shape[-1] * (math.prod(kv.shape[:-2]) if kv.dim() > 2 else 1)
    plan = resolve(kv, group, op, _kv_plan, (q_sizes, variant, row_bytes, op), site=skv, spec=(-2,),
                   allow_empty=True, split=False)
    _check_local(q, k, v, op)  # after the agreements: the same verdict on every rank
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    mask = attn_mask
    if mask is not None:
        if mask.dim() < 2:
            mask = mask.reshape(1, -1) if mask.dim() == 1 else mask.reshape(1, 1)
        rows = resolve(mask, group, f"{op} (attn_mask)", _mask_rows, (q_sizes, plan.k_off[-1], op), site=smask,
                       spec=(-2,), allow_empty=True, split=False)
        if mask.shape[-1] not in (1, plan.k_off[-1]):
            raise ValueError(f"{op}: attn_mask's last dim must be the global key count {plan.k_off[-1]} (or 1), got "
                             f"shape {tuple(attn_mask.shape)}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise ValueError(f"{op}: attn_mask must be boolean or floating point, got {mask.dtype}")
        if rows == "global":
            mask = mask.narrow(-2, plan.q_off[plan.index], q.shape[-2])
        if mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
    if plan.variant == "local":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    elif plan.variant == "gathered":
        full = _GatherFn.apply(kv, plan)
        if is_causal:
            qi = torch.arange(plan.q_off[plan.index], plan.q_off[plan.index] + q.shape[-2], device=q.device)
            kj = torch.arange(plan.k_off[-1], device=q.device)
            mask = kj[None, :] <= qi[:, None]
        out = F.scaled_dot_product_attention(q, full[..., :d], full[..., d:], attn_mask=mask, scale=scale)
    else:
        low = q.dtype in (torch.float16, torch.bfloat16)  # invariant 5: the blocks' sums in fp32, sent in fp32
        if low:
            mask = mask.float() if mask is not None and mask.is_floating_point() else mask
            out, _ = _RingFn.apply(q.float(), kv.float(), mask, d, bool(is_causal), float(scale), plan)
            out = out.to(q.dtype)
        else:
            out, _ = _RingFn.apply(q, kv, mask, d, bool(is_causal), float(scale), plan)
    carry(out, q)
    place_like(out, q, -2)
    return out


def latitude_only(make: Callable[[nn.Module, Any], nn.Module],
                  what: str = "attention over all tokens") -> Callable[[nn.Module, Any], nn.Module]:
    """A converter ``fn(module, ctx)`` that refuses a latitude x longitude mesh (a rank's tokens are then not
    contiguous in the global order, which the ring and the gathered form need), naming the class, and otherwise is
    ``make``: the one refusal of every layer of attention over all tokens."""

    def convert(m: nn.Module, ctx: Any) -> nn.Module:
        mesh = getattr(ctx, "mesh", None)
        if mesh is not None and len(getattr(mesh, "domain_shape", (1, 1))) == 2:
            kind = type(m)
            raise ValueError(f"{kind.__module__}.{kind.__name__}: halo converts {what} on latitude rows only, not "
                             f"on a latitude x longitude mesh (a rank's tokens are then not contiguous in the global "
                             f"order); convert on latitude rows")
        return make(m, ctx)

    return convert
