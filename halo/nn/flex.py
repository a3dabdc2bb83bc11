"""``flex_attention`` over the global tokens of shards: :func:`domain_flex_attention`.

``torch.nn.attention.flex_attention.flex_attention(q, k, v, score_mod, block_mask)`` runs its body as one
higher-order op the guard cannot see into, so on a field's tokens it is refused (each rank would attend over its own
keys only). :func:`domain_flex_attention` has its semantics on the *global* tokens, where the token dim (dim -2 of
``(B, heads, N_local, d)``) is split over the domain group in rank order (a field's row-major tokens, as
:func:`halo.nn.ring.ring_sdpa` takes them; counts may be uneven): every rank's keys and values are gathered
(:func:`halo.nn.ring.gather_tokens`, whose backward is the reduce-scatter, its exact adjoint), and this rank's query
rows are scored against all of them as flex_attention's own eager path scores them (torch's ``math_attention``):
``q @ K^T * scale`` in float64 for float64 inputs (float32 otherwise), ``score_mod(score, b, h, q_idx, kv_idx)`` and
the block mask's ``mask_mod(b, h, q_idx, kv_idx)`` applied through ``torch.vmap`` with **global** query positions
(this rank's first query row added to ``q_idx``), a safe softmax (a row with no key left gives 0), then ``@ V``.
Everything is differentiable by autograd, tensors a ``score_mod`` captures (a bias table) included: each rank's
gradient is the contribution of its query rows, summed over the domain group by the gradient sync like every other
parameter's. So it trains on CPU too, where torch's flex_attention has no backward.

Memory: all ranks' K and V (the gathered variant) and the scores of this rank's rows against every key, ``1/P`` of
the unsharded dense scores; no fused kernel (flex_attention's compiled kernels do not take a key set other than the
block mask's). ``block_mask`` must be built for the global lengths (``create_block_mask(mask_mod, B, H, L, N)``);
only its ``mask_mod`` is read (its block sparsity is an optimisation of the same mask). Refused, alike on every rank:
``kernel_options``, a block mask of other lengths, key and value token counts that differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..plan.plans import carry, resolve
from .registry import public
from .ring import gather_tokens, place_like

__all__ = ["domain_flex_attention"]


def _rows(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
    """This rank's first query row and the global query count (agreed extents of dim -2)."""
    (sizes,) = extents
    return sum(sizes[:cg.index]), sum(sizes)


def _over_bhqk(fn: Callable, score: bool) -> Callable:
    """``fn`` mapped over ``(b, h, q_idx, kv_idx)`` (and the score tensor's dims, for a ``score_mod``): four nested
    ``torch.vmap``, innermost over the keys, as flex_attention's eager path maps it."""
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=((0,) if score else ()) + dims, out_dims=0)
    return fn


def _indexing() -> Any:
    """torch's context that turns ``tensor[index_tensor]`` in a ``score_mod`` into an index op (as flex_attention's
    eager path runs it), or a null context where a torch release lacks it."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # pragma: no cover - every supported torch has it
        import contextlib

        return contextlib.nullcontext()
    return TransformGetItemToIndex()


@public
def domain_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          score_mod: Callable | None = None, block_mask: Any | None = None,
                          scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                          kernel_options: dict | None = None, *, group: Any | None = None) -> Any:
    """``flex_attention`` over the global tokens of shards (module docstring): this rank's query rows of the output
    (and of the log-sum-exp with ``return_lse``, natural log as flex_attention's). ``group``: the domain group
    (default: the initialised manager's)."""
    op = "domain_flex_attention"
    if kernel_options:
        raise ValueError(f"{op}: kernel_options={kernel_options!r} tune flex_attention's compiled kernels, which "
                         f"this exact form does not run; leave them out")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: expected {name} of shape (B, heads, tokens, d), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    first, total_q = resolve(query, group, f"{op} (queries)", _rows, spec=(-2,), allow_empty=True, split=False)
    keys = gather_tokens(key, group=group)
    values = gather_tokens(value, group=group)
    if keys.shape[-2] != values.shape[-2]:  # (agreed shapes: alike on every rank)
        raise ValueError(f"{op}: {keys.shape[-2]} key tokens but {values.shape[-2]} value tokens over the group")
    n_keys = keys.shape[-2]
    if block_mask is not None:
        lengths = tuple(int(s) for s in getattr(block_mask, "seq_lengths", ()))
        if lengths != (total_q, n_keys):
            raise ValueError(f"{op}: the block mask must be built for the global lengths, (Q_LEN, KV_LEN) = "
                             f"({total_q}, {n_keys}) over the group: create_block_mask(mask_mod, B, H, {total_q}, "
                             f"{n_keys}) (a mask of a shard's lengths would mask by the shard's positions)")
    hq, hkv = query.shape[1], keys.shape[1]
    if hq != hkv:
        if not enable_gqa or hq % hkv:
            raise ValueError(f"{op}: {hq} query heads and {hkv} key heads need enable_gqa=True and a multiple "
                             f"(got enable_gqa={enable_gqa})")
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(work) @ keys.to(work).transpose(-2, -1)) * scale
    b, h, m, n = scores.shape
    dev = scores.device
    bi, hi = torch.arange(b, device=dev), torch.arange(h, device=dev)
    qi, ki = torch.arange(first, first + m, device=dev), torch.arange(n, device=dev)
    with _indexing():
        if score_mod is not None:
            scores = _over_bhqk(score_mod, True)(scores, bi, hi, qi, ki).to(work)
        if block_mask is not None:
            keep = _over_bhqk(block_mask.mask_mod, False)(bi, hi, qi, ki)
            scores = torch.where(keep, scores, torch.tensor(-math.inf, dtype=work, device=dev))
    probs = torch._safe_softmax(scores, dim=-1) if hasattr(torch, "_safe_softmax") else \
        torch.nan_to_num(scores.softmax(-1), nan=0.0)
    out = probs.to(query.dtype) @ values.to(query.dtype)
    carry(out, query)
    place_like(out, query, 2)
    if not return_lse:
        return out
    lse = scores.logsumexp(dim=-1)
    lse = torch.where(torch.isneginf(scores).all(dim=-1), torch.tensor(-math.inf, dtype=work, device=dev), lse)
    return out, lse
