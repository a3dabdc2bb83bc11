"""Neighbourhood attention (NATTEN's semantics) on an H-shard: the same numbers as on the whole field.

Each query ``(i, j)`` attends to a ``k x k`` neighbourhood of keys that is *clamped inside the domain*: near an
edge the window slides inwards rather than reading padding, so every query sees exactly ``k x k`` real keys.
With dilation ``d`` the window takes every ``d``-th row of the query's residue class ``i mod d`` (NATTEN's
"dilated" neighbourhoods). The rules are NATTEN's own (``get_window_start`` / ``get_pb_start`` of its kernels),
per axis, for an extent ``L``, kernel ``k`` (odd), ``n = k // 2``::

    d = 1:  start(i) = max(i - n, 0) + (i + n >= L) * (L - i - n - 1)
            pb(i)    = n + (i < n) * (n - i) + (i + n >= L) * (L - i - 1 - n)
    d > 1:  the same rules inside the residue class of i: with p = i // d and L_c the class's length
            (ceil((L - i mod d) / d)), start(i) = start_1(p, L_c) * d + i mod d and pb(i) = pb_1(p, L_c)

    window rows of query row i:   start(i) + d * a,  a = 0 .. k-1
    relative positional bias:     attn[.., i, j, a, b] += rpb[head, pb(i) + a, pb(j) + b]   (rpb: (heads, 2k-1, 2k-1))

NATTEN refuses extents shorter than ``k * d`` (every residue class must hold a whole window); so does halo, on
every rank alike. Layouts are NATTEN's: a module takes ``(B, H, W, C)``; the functional form per-head
``(B, heads, H, W, head_dim)``; H is sharded (the balanced split).

Sharded form. Query row ``i`` on rank ``r`` reads key/value rows ``[start(i), start(i) + d(k-1)]``; rank ``r``
needs the union of those over its rows ``[o0, o1)``: ``[min start(i), max start(i) + d(k-1) + 1)`` — up to
``(k-1)d`` rows beyond its shard next to the domain's edges (a clamped window reaches further inwards), possibly
from ranks beyond its neighbours when shards are thin. One planned exchange (:func:`halo.exchange.exchanger_id`
with these per-rank needs; every row is inside the domain, so no boundary fill is ever used) brings the keys and
values together (concatenated along the features), then each rank attends with *global* row indices mapped into
its extended rows. Backward: torch's autograd of the local attention, then the exchange's exact adjoint (the key
and value gradients of halo rows go back to their owners and are added). Parameter gradients (``qkv``, ``rpb``,
``proj``) on each rank are the contribution of its query rows: their sum over the domain group is the unsharded
gradient (``halo.sync_domain_gradients``).

Not covered: causal neighbourhoods (NATTEN's ``is_causal``), attention dropout in training (the module raises;
NATTEN's fused kernels do not apply it either), W sharded on a 2-D mesh, NATTEN < 0.15's zero padding of inputs
smaller than the window (refused like newer NATTEN).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..context import place
from ..dist.comm import CommGroup
from ..exchange import exchange, exchanger_id
from ..plan.partition import offsets
from ..plan.plans import Site, carry, device_tensor, resolve
from .base import DomainLayer, adopt
from .registry import public

__all__ = [
    "DomainNeighborhoodAttention2D",
    "neighborhood_attention",
    "neighborhood_attention_reference",
    "neighborhood_row_plan",
    "pb_start",
    "window_start",
]


# -- NATTEN's window rules (pure ints) ----------------------------------------------------------------------

def _start_1(i: int, length: int, n: int) -> int:
    return max(i - n, 0) + (i + n >= length) * (length - i - n - 1)


def _pb_1(i: int, length: int, n: int) -> int:
    return n + (i < n) * (n - i) + (i + n >= length) * (length - i - 1 - n)


def window_start(index: int, length: int, kernel: int, dilation: int = 1) -> int:
    """First key index of query ``index``'s window along an axis of ``length`` (NATTEN's ``get_window_start``)."""
    n = kernel // 2
    if dilation <= 1:
        return _start_1(index, length, n)
    phase, p = index % dilation, index // dilation
    length_c = (length - phase + dilation - 1) // dilation  # the residue class's length
    return _start_1(p, length_c, n) * dilation + phase


def pb_start(index: int, length: int, kernel: int, dilation: int = 1) -> int:
    """First index into the ``2k - 1`` relative-position table for query ``index`` (NATTEN's ``get_pb_start``)."""
    n = kernel // 2
    if dilation <= 1:
        return _pb_1(index, length, n)
    phase, p = index % dilation, index // dilation
    length_c = (length - phase + dilation - 1) // dilation
    return _pb_1(p, length_c, n)


def _check_axis(length: int, kernel: int, dilation: int, axis: str, op: str) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{op}: kernel size along {axis} must be an odd positive int (NATTEN's rule), got {kernel}")
    if dilation < 1:
        raise ValueError(f"{op}: dilation along {axis} must be a positive int, got {dilation}")
    if length < kernel * dilation:
        raise ValueError(f"{op}: the field has {length} positions along {axis}, fewer than kernel size x dilation "
                         f"= {kernel} x {dilation} = {kernel * dilation}; NATTEN requires at least that many "
                         f"(every dilation class must hold a whole window)")


@functools.lru_cache(maxsize=256)
def _axis_maps(length: int, kernel: int, dilation: int, lo: int, rows: tuple[int, int]
               ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Key index (relative to ``lo``) and bias index of every query in ``[rows[0], rows[1])`` and window tap."""
    keys, bias = [], []
    for i in range(*rows):
        s, p = window_start(i, length, kernel, dilation), pb_start(i, length, kernel, dilation)
        keys.append(tuple(s - lo + a * dilation for a in range(kernel)))
        bias.append(tuple(p + a for a in range(kernel)))
    return tuple(keys), tuple(bias)


def neighborhood_row_plan(sizes: Sequence[int], kernel: int, dilation: int = 1, op: str = "neighborhood_attention"
                          ) -> tuple[tuple[int, int], ...]:
    """Every rank's needed key/value rows ``(lo, hi)`` along the sharded axis (global indices, inside the domain)
    for queries on the balanced shards ``sizes`` (group order)."""
    length = sum(sizes)
    _check_axis(length, kernel, dilation, "H", op)
    offs = offsets(sizes)
    needs = []
    for r in range(len(sizes)):
        starts = [window_start(i, length, kernel, dilation) for i in range(offs[r], offs[r + 1])]
        needs.append((min(starts), max(starts) + dilation * (kernel - 1) + 1) if starts else (offs[r], offs[r]))
    return tuple(needs)


# -- the local computation ----------------------------------------------------------------------------------

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, rows_pb: torch.Tensor,
            cols: torch.Tensor, cols_pb: torch.Tensor, rpb: torch.Tensor | None) -> torch.Tensor:
    """Neighbourhood attention of queries ``q`` (B, heads, n, W, d) on keys/values ``k``, ``v`` (B, heads, m, W, d):
    query row ``a`` reads key rows ``rows[a]``, column ``b`` key columns ``cols[b]`` (index maps (n, kh), (W, kw));
    ``rows_pb``/``cols_pb``: the bias table's indices."""
    kh, kw = rows.shape[1], cols.shape[1]
    ri, ci = rows[:, :, None, None], cols[None, None, :, :]  # (n, kh, 1, 1), (1, 1, W, kw)
    kg = k[:, :, ri, ci]  # (B, heads, n, kh, W, kw, d)
    attn = torch.einsum("bnhwd,bnhawcd->bnhwac", q, kg)
    if rpb is not None:
        attn = attn + rpb[:, rows_pb[:, None, :, None], cols_pb[None, :, None, :]].unsqueeze(0)
    shape = attn.shape
    attn = attn.reshape(*shape[:4], kh * kw).softmax(dim=-1).reshape(shape)
    return torch.einsum("bnhwac,bnhawcd->bnhwd", attn, v[:, :, ri, ci])


def _pair(value: Any, name: str) -> tuple[int, int]:
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or any(isinstance(p, bool) or not isinstance(p, int) for p in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return int(pair[0]), int(pair[1])


def _maps(length: int, kernel: int, dilation: int, lo: int, rows: tuple[int, int], device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    keys, bias = _axis_maps(length, kernel, dilation, lo, rows)
    return device_tensor(keys, torch.int64, device), device_tensor(bias, torch.int64, device)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rpb: torch.Tensor | None,
               kernel: tuple[int, int], op: str) -> None:
    if q.dim() != 5 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{op}: expected q, k, v of one shape (B, heads, H, W, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    want = (q.shape[1], 2 * kernel[0] - 1, 2 * kernel[1] - 1)
    if rpb is not None and tuple(rpb.shape) != want:
        raise ValueError(f"{op}: rpb must have shape (heads, 2*kh-1, 2*kw-1) = {want}, got {tuple(rpb.shape)}")


@public
def neighborhood_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
                                     rpb: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """NATTEN's 2-D neighbourhood attention on the whole field (one process): ``softmax(q*scale . k + rpb) . v``
    over each query's clamped ``kh x kw`` window (module docstring), as NATTEN's unfused path (``na2d_qk`` with
    ``rpb``, softmax, ``na2d_av``) computes it. ``q``, ``k``, ``v``: ``(B, heads, H, W, head_dim)``; ``rpb``:
    ``(heads, 2kh-1, 2kw-1)`` or ``None``. Returns ``(B, heads, H, W, head_dim)``."""
    op = "neighborhood_attention_reference"
    kernel, dil = _pair(kernel_size, "kernel_size"), _pair(dilation, "dilation")
    _check_qkv(q, k, v, rpb, kernel, op)
    height, width = q.shape[2], q.shape[3]
    _check_axis(height, kernel[0], dil[0], "H", op)
    _check_axis(width, kernel[1], dil[1], "W", op)
    rows, rows_pb = _maps(height, kernel[0], dil[0], 0, (0, height), q.device)
    cols, cols_pb = _maps(width, kernel[1], dil[1], 0, (0, width), q.device)
    return _attend(q * scale if scale != 1.0 else q, k, v, rows, rows_pb, cols, cols_pb, rpb)


# -- sharded ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NAPlan:
    """A neighbourhood-attention call as planned for this rank: the global height, this rank's query rows, the
    first key row it holds after the exchange (``lo``) and the exchange (``ex`` -1: one rank, nothing to send)."""

    height: int
    rows: tuple[int, int]
    lo: int
    ex: int
    ext: int


def _na_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], kernel: int, dilation: int, op: str) -> NAPlan:
    (sizes,) = extents
    needs = neighborhood_row_plan(sizes, kernel, dilation, op)
    offs = offsets(sizes)
    me = cg.index
    lo, hi = needs[me]
    ex = -1 if cg.size == 1 else exchanger_id(cg, 2, sizes, needs, "zeros", op)
    return NAPlan(offs[-1], (offs[me], offs[me + 1]), lo, ex, hi - lo)


def _sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: tuple[int, int], dil: tuple[int, int],
             rpb: torch.Tensor | None, scale: float, group: Any, site: Site | None, op: str) -> torch.Tensor:
    same = q.dim() == 5 and k.shape == q.shape and v.shape == q.shape
    # What is exchanged: keys and values in one message. Ranks whose q, k, v disagree in shape hand the agreement
    # a tensor of another rank (6 dims), so that every rank raises (never one alone).
    probe = torch.cat([k, v], dim=-1) if same else q.unsqueeze(0)
    plan = resolve(probe, group, op, _na_plan, (kernel[0], dil[0], op), site=site, spec=(2 if same else 3,))
    _check_qkv(q, k, v, rpb, kernel, op)  # after the agreement: the same verdict on every rank
    width = q.shape[3]
    _check_axis(width, kernel[1], dil[1], "W", op)  # W is agreed equal on every rank
    kv = probe if plan.ex < 0 else exchange(probe, plan.ex, plan.ext, 2)
    ke, ve = kv.chunk(2, dim=-1)
    rows, rows_pb = _maps(plan.height, kernel[0], dil[0], plan.lo, plan.rows, q.device)
    cols, cols_pb = _maps(width, kernel[1], dil[1], 0, (0, width), q.device)
    return _attend(q * scale if scale != 1.0 else q, ke, ve, rows, rows_pb, cols, cols_pb, rpb)


def _input_ok(cg: CommGroup, extents: tuple[tuple[int, ...], ...], name: str, channels: int) -> None:
    """Nothing to plan; called with agreed extents only, after the ranks' shapes were found to agree."""
    return None


@public
def neighborhood_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int | Sequence[int],
                           dilation: int | Sequence[int] = 1, rpb: torch.Tensor | None = None, scale: float = 1.0,
                           *, group: Any | None = None) -> torch.Tensor:
    """:func:`neighborhood_attention_reference` on H-shards: ``q``, ``k``, ``v`` are this rank's rows
    ``(B, heads, H_r, W, head_dim)`` of the balanced split along dim 2; returns this rank's output rows.

    One exchange brings the key/value rows this rank's windows reach (module docstring); the first call under an
    epoch (``halo.plan.plans``) agrees on every rank's shapes, so a bad shape or a field smaller than the window raises
    the same ``ValueError`` on every rank. ``rpb`` is replicated; its gradient on each rank is that rank's share.
    """
    kernel, dil = _pair(kernel_size, "kernel_size"), _pair(dilation, "dilation")
    out = _sharded(q, k, v, kernel, dil, rpb, scale, group, None, "neighborhood_attention")
    carry(out, q)
    return out


@public
class DomainNeighborhoodAttention2D(DomainLayer, nn.Module):
    """``natten.NeighborhoodAttention2D`` on an H-shard ``(B, H_r, W, C)`` (module docstring): same attributes
    (``qkv``, ``rpb``, ``proj``, ``attn_drop``, ``proj_drop``, ``num_heads``, ``head_dim``, ``scale``,
    ``kernel_size``, ``dilation``), so a NATTEN checkpoint loads, and the same numbers as NATTEN's unfused path.

    Build it like NATTEN's (``dim, num_heads, kernel_size, dilation=1, rel_pos_bias=False, qkv_bias=True,
    qk_scale=None, attn_drop=0.0, proj_drop=0.0``; NATTEN < 0.15's ``bias=`` is the same as ``rel_pos_bias``), or
    wrap an existing one (``DomainNeighborhoodAttention2D(natten_module)``: its Parameters are shared).
    """

    def __init__(self, dim: Any, num_heads: int | None = None, kernel_size: int | Sequence[int] | None = None,
                 dilation: int | Sequence[int] = 1, rel_pos_bias: bool = False, qkv_bias: bool = True,
                 qk_scale: float | None = None, attn_drop: float = 0.0, proj_drop: float = 0.0, *,
                 bias: bool | None = None, group: Any | None = None) -> None:
        super().__init__()
        if isinstance(dim, nn.Module):
            self._adopt(dim)
        else:
            if num_heads is None or kernel_size is None:
                raise TypeError("DomainNeighborhoodAttention2D(dim, num_heads, kernel_size, ...) needs num_heads "
                                "and kernel_size")
            self.num_heads = num_heads
            self.head_dim = dim // num_heads
            self.scale = qk_scale or self.head_dim ** -0.5
            self.kernel_size = _pair(kernel_size, "kernel_size")
            self.dilation = _pair(dilation, "dilation")
            self.is_causal = (False, False)
            self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
            if rel_pos_bias or bias:
                self.rpb = nn.Parameter(torch.zeros(num_heads, 2 * self.kernel_size[0] - 1,
                                                    2 * self.kernel_size[1] - 1))
                nn.init.trunc_normal_(self.rpb, std=0.02, mean=0.0, a=-2.0, b=2.0)
            else:
                self.register_parameter("rpb", None)
            self.attn_drop_rate = attn_drop
            self.attn_drop = nn.Dropout(attn_drop)
            self.proj = nn.Linear(dim, dim)
            self.proj_drop = nn.Dropout(proj_drop)
        self.halo_init(group)

    def _adopt(self, m: nn.Module) -> None:
        name = type(self).__name__
        missing = [a for a in ("qkv", "proj", "num_heads", "kernel_size", "dilation", "scale") if not hasattr(m, a)]
        if missing:
            raise TypeError(f"{name} wraps a natten.NeighborhoodAttention2D; {type(m).__name__} lacks {missing}")
        causal = getattr(m, "is_causal", False)
        if any(causal) if isinstance(causal, (tuple, list)) else causal:
            raise ValueError(f"{name}: causal neighbourhood attention (is_causal={causal}) is not supported")
        stride = getattr(m, "stride", 1)
        if any(s != 1 for s in (stride if isinstance(stride, (tuple, list)) else (stride,))):
            raise ValueError(f"{name}: strided neighbourhood attention (stride={stride}) is not supported")
        adopt(self, m, name=name)  # shares Parameters; keeps names (state_dict keys unchanged)
        if "rpb" not in m._parameters and not hasattr(m, "rpb"):  # NATTEN >= 0.20: no relative position bias
            self.register_parameter("rpb", None)
        if not hasattr(m, "attn_drop"):  # NATTEN >= 0.20: no attention dropout
            self.attn_drop = nn.Dropout(0.0)
        self.kernel_size = _pair(m.kernel_size, "kernel_size")
        self.dilation = _pair(m.dilation, "dilation")
        self.__dict__.setdefault("head_dim", m.qkv.in_features // m.num_heads)
        self.__dict__.setdefault("attn_drop_rate", getattr(getattr(m, "attn_drop", None), "p", 0.0))

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, has_bias={self.rpb is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if self.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in (self.attn_drop, self.proj_drop)):
            raise ValueError(f"{name}: dropout in training (attn_drop={self.attn_drop.p}, proj_drop="
                             f"{self.proj_drop.p}) is not supported on H-shards; set them to 0 or call eval()")
        # Agree on every rank's input first (recorded once per epoch), so that a bad input raises on every rank.
        resolve(x, self.group, name, _input_ok, (name, self.qkv.in_features), site=self._halo_site, spec=(min(
            1, x.dim() - 1),))
        if x.dim() != 4 or x.shape[-1] != self.qkv.in_features:  # the same on every rank (agreed)
            raise ValueError(f"{name} expected a (B, H, W, C={self.qkv.in_features}) input sharded on H; got shape "
                             f"{tuple(x.shape)}")
        b, h, w, c = x.shape
        qkv = self.qkv(x).reshape(b, h, w, 3, self.num_heads, self.head_dim).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        y = _sharded(q, k, v, self.kernel_size, self.dilation, self.rpb, self.scale, self.group, self._halo_site,
                     name)
        y = y.permute(0, 2, 3, 1, 4).reshape(b, h, w, c)
        out = self.proj_drop(self.proj(y))
        carry(out, x)
        place(out, 1)  # channels-last: the sharded rows are dim 1
        return out
