"""Compute-then-patch for a conv on a latitude x longitude block: the exchange of both axes behind the conv.

A block ``x`` (``(B, C, h, w)``: H sharded over the mesh's first axis, W over the second) of a stride-1 conv with
symmetric padding ``p = d(k-1)/2`` per axis needs the padded window ``(h + 2p_h) x (w + 2p_w)``: the block, two
bands of ``p_h`` halo rows (top / bottom, corners included) and two of ``p_w`` halo columns (left / right, the
block's rows only). The conv is linear in its input, so it is the sum of the convs of these five regions, each
embedded in zeros; only the block's own is large::

    post the H exchange (T, Bt: p_h rows x w) and the W exchange (L, R: h rows x p_w)     # two groups, at once
    y = conv(x, zero padding (p_h, p_w))               # exact but for a border of p rows / columns
    wait H; wait W
    post the corner exchange: the W exchange of [T; Bt] # the corners are the W neighbours' T / Bt rows
    y[:, :, :, :p_w]  += conv([L | 0], w[..., :j_w])   (and R): the kernel columns that reach a halo column
    wait corners
    y[:, :, :p_h]     += conv([[TL | T | TR]; 0], w[..., :j_h, :])   (and the bottom band): kernel rows

(``j = ceil(p / d)`` kernel rows or columns reach a halo row from the ``p`` border rows, and ``(j-1)d`` zero rows
complete the strip; as ``halo.nn.conv``'s 1-D patch.) The corners come from the padded field whichever axis is
padded first (padding along H and along W are Kronecker factors ``P_h (x) I`` and ``I (x) P_w``, which commute),
so the corner exchange is the W plan itself, run on the ``2 p_h`` halo rows. It is the second of two hops (a
diagonal neighbour's rows travel H, then W), waited on after the W strips' convs, which hide it.

Backward is the adjoint of each step, in reverse: the band strips' backward (small), their corner gradients
posted back along W at once; the column strips' backward meanwhile; the corner gradients that come back are added
to the band rows' gradients, which are posted back along H, and the column strips' gradients along W; torch's
backward of the main conv runs while they travel; what arrives is added into the main conv's own input gradient
in place. No copy of the block or of its gradient either way. Deterministic (the exchanger's adjoint; no atomics).

Across a pole with W sharded the H exchanger is a :class:`~halo.exchange.PoleExchanger`: its halo rows across the
pole are the mirrored rows rolled by W/2 by the W ranks (a second exchange, on the W group, posted with the H
exchange where the mirrored rows are the block's own); the corners are still the W exchange of the band rows (the
roll along W and the W padding are both circulant along W: they commute).

Messages between two ranks of a group are told apart by their order alone, so the exchanges of one group are posted
in one order on every rank: the W exchange is waited on before the corner exchange is posted, and the corner
adjoint before the W adjoint; a pole's roll (W group) goes before the W exchange (or, where it waits for the H
rows, after it), and its adjoint before the W adjoint, alike on every rank of a W line (they share their latitude
position). The H and W exchanges run on different groups and overlap.

Where it applies (:func:`patch_2d_applies`, group-wide numbers only): stride 1 on both axes, symmetric padding
with ``2p = d(k-1)`` per axis (``p`` of one axis may be 0: that axis is not exchanged), blocks of at least ``p``
rows and columns, balanced splits, an even number of longitudes across a pole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..dist.comm import comm_group
from ..exchange import Exchanger, PoleExchanger, exchange_spec, exchanger_id, get_exchanger, pole_step
from ..plan.partition import POLE_MODES, check_boundary, offsets, split_sizes

__all__ = ["PatchPlan2d", "corner_exchanger_id", "patch_2d_applies", "patch_conv_2d", "plan_patch_2d"]

#: Suffix of the corner exchange's op name: its spec is the W exchange's but for the name (an exchanger of its own,
#: with its own buffers).
CORNERS = " (corners)"


@dataclasses.dataclass(frozen=True)
class PatchPlan2d:
    """Compute-then-patch of one conv on one rank of a latitude x longitude mesh: exchanger ids of the H halo rows
    (``ex_h``), of the W halo columns (``ex_w``) and of the corners (``ex_c``: the W exchange of the H halo rows);
    -1 for an axis with ``p = 0`` (and for the corners when either is). ``pad``: ``(p_h, p_w)``."""

    ex_h: int
    ex_w: int
    ex_c: int
    pad: tuple[int, int]


# -- plan (pure in agreed values: every rank takes the same path, or raises the same error) --------------------------

def _axis_pad(kernel: int, dilation: int, what: str, op: str) -> int:
    total = dilation * (kernel - 1)
    if kernel < 1 or dilation < 1 or total % 2:
        raise ValueError(f"{op}: compute-then-patch needs a symmetric padding d(k-1)/2 along {what}; kernel {kernel} "
                         f"with dilation {dilation} has none (use pad-then-conv)")
    return total // 2


def patch_2d_applies(sizes: tuple[Sequence[int], Sequence[int]], kernel: Sequence[int], stride: Sequence[int],
                     dilation: Sequence[int], pads: Sequence[tuple[int, int]], boundaries: tuple[str, str]) -> bool:
    """Whether a conv on a latitude x longitude mesh can compute-then-patch (else pad-then-conv): decided from
    agreed numbers only (``sizes``: the extents of this rank's H line and W line), so every rank decides alike.

    Stride 1 and symmetric padding ``p = d(k-1)/2`` on both axes (so the output block is the input block), some
    ``p > 0``, blocks of at least ``p`` rows and columns (a halo from the next rank alone), balanced splits (a
    block split puts other rows where the strips expect the block's edges), and an even W across a pole (rolled by
    W/2; W sharded or whole alike).
    """
    ps = []
    for a in range(2):
        (before, after), k, d = pads[a], kernel[a], dilation[a]
        if stride[a] != 1 or before != after or 2 * before != d * (k - 1):
            return False
        if min(sizes[a]) < before or list(sizes[a]) != split_sizes(sum(sizes[a]), len(sizes[a])):
            return False
        ps.append(before)
    if not any(ps) or boundaries[1] in POLE_MODES:
        return False
    return boundaries[0] not in POLE_MODES or sum(sizes[1]) % 2 == 0


def _needs(sizes: Sequence[int], p: int) -> tuple[tuple[int, int], ...]:
    offs = offsets(sizes)
    return tuple((offs[r] - p, offs[r + 1] + p) for r in range(len(sizes)))


def plan_patch_2d(groups: tuple[Any, Any], sizes: tuple[Sequence[int], Sequence[int]], kernel: Sequence[int],
                  dilation: Sequence[int], boundaries: tuple[str, str], op: str = "patch_conv_2d") -> PatchPlan2d:
    """The exchangers of :func:`patch_conv_2d` on this rank. ``groups``: the mesh's H and W axis groups;
    ``sizes``: the extents of this rank's H line and W line (agreed); ``boundaries``: what fills rows / columns
    beyond the domain (H, W). Pure in its agreed arguments: a case it cannot patch raises the same ``ValueError``
    on every rank (check :func:`patch_2d_applies` first to fall back to pad-then-conv instead)."""
    bh, bw = check_boundary(boundaries[0]), check_boundary(boundaries[1])
    cg_h, cg_w = comm_group(groups[0]), comm_group(groups[1])
    ph = _axis_pad(kernel[0], dilation[0], "H", op)
    pw = _axis_pad(kernel[1], dilation[1], "W", op)
    for what, s, p in (("rows", sizes[0], ph), ("columns", sizes[1], pw)):
        if min(s) < p:
            raise ValueError(f"{op}: compute-then-patch needs blocks of at least {p} {what}, got extents {tuple(s)} "
                             f"(use pad-then-conv)")
    if bw in POLE_MODES:
        raise ValueError(f"{op}: a pole boundary is a latitude's (H); got {bw!r} along W")
    if bh in POLE_MODES and sum(sizes[1]) % 2:
        raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, "
                         f"got W={sum(sizes[1])}")
    ex_h = exchanger_id(cg_h, 2, sizes[0], _needs(sizes[0], ph), bh, f"{op} (H)") if ph else -1
    if ex_h >= 0:  # across a pole with W sharded: the rows across it rolled by W/2 by the W ranks
        ex_h = pole_step(ex_h, groups[1], tuple(sizes[1]), 3)
    ex_w = exchanger_id(cg_w, 3, sizes[1], _needs(sizes[1], pw), bw, f"{op} (W)") if pw else -1
    ex_c = exchanger_id(cg_w, 3, sizes[1], _needs(sizes[1], pw), bw, f"{op}{CORNERS}") if ph and pw else -1
    return PatchPlan2d(ex_h, ex_w, ex_c, (ph, pw))


def corner_exchanger_id(ex_w: int) -> int:
    """The corner exchange that goes with W exchange ``ex_w`` (its spec under the name ``op + CORNERS``)."""
    spec = exchange_spec(ex_w)
    return exchanger_id(comm_group(spec.group), spec.dim, spec.sizes, spec.needs, spec.boundary, spec.op + CORNERS)


# -- strips ------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Geometry:
    """The kernel's reach: ``p`` per axis, ``j`` (kernel rows / columns reaching a halo row / column), ``extra``
    (the ``(j-1)d`` zero rows / columns completing a strip), the kernel size, dilation and groups."""

    p: tuple[int, int]
    j: tuple[int, int]
    extra: tuple[int, int]
    k: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @staticmethod
    def of(weight: torch.Tensor, pad: tuple[int, int], dilation: tuple[int, int], groups: int) -> _Geometry:
        k = (weight.shape[-2], weight.shape[-1])
        j = tuple(-(-p // d) if p else 0 for p, d in zip(pad, dilation, strict=True))
        extra = tuple(max(jj - 1, 0) * d for jj, d in zip(j, dilation, strict=True))
        return _Geometry(tuple(pad), j, extra, k, tuple(dilation), groups)

    def kernel_part(self, weight: torch.Tensor, axis: int, side: int) -> torch.Tensor:
        """The kernel rows (``axis`` 0) or columns (1) that reach the halo of ``side`` (0: before, 1: after)."""
        j = self.j[axis]
        return weight.narrow(2 + axis, 0 if side == 0 else self.k[axis] - j, j)

    def strip_padding(self, axis: int) -> tuple[int, int]:
        """A band strip (H) has no padding; a column strip (W) is zero-padded by ``p_h`` in H, as the main conv."""
        return (0, 0) if axis == 0 else (self.p[0], 0)

    def conv(self, strip: torch.Tensor, weight: torch.Tensor, axis: int, side: int) -> torch.Tensor:
        """A strip's share of the border of the output (no bias)."""
        return F.conv2d(strip, self.kernel_part(weight, axis, side), None, 1, self.strip_padding(axis),
                        self.dilation, self.groups)

    def conv_backward(self, g: torch.Tensor, strip: torch.Tensor, weight: torch.Tensor, axis: int, side: int,
                      need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The adjoint of :meth:`conv`: gradients of the strip and of the kernel part it used."""
        g_strip, g_w, _ = torch.ops.aten.convolution_backward(
            g, strip, self.kernel_part(weight, axis, side), None, [1, 1], list(self.strip_padding(axis)),
            list(self.dilation), False, [0, 0], self.groups, [need_x, need_w, False])
        return g_strip, g_w

    def border(self, y: torch.Tensor, axis: int, side: int) -> torch.Tensor:
        """The ``p`` first (side 0) or last rows (axis 0) / columns (axis 1) of the output."""
        p, n = self.p[axis], y.shape[2 + axis]
        return y.narrow(2 + axis, 0 if side == 0 else n - p, p)

    def halo_of(self, strip: torch.Tensor, axis: int, side: int) -> torch.Tensor:
        """The halo rows / columns of a strip (or of its gradient): the inverse of :meth:`band` / :meth:`column`."""
        return strip.narrow(2 + axis, 0 if side == 0 else self.extra[axis], self.p[axis])

    def band(self, rows: torch.Tensor, corners: tuple[torch.Tensor, torch.Tensor] | None, side: int) -> torch.Tensor:
        """The strip of a band of halo rows: ``[left corner | rows | right corner]`` (no corners: ``p_w = 0``), with
        ``(j_h - 1) d_h`` zero rows on the block's side (a fresh tensor: saved for backward)."""
        strip = rows.contiguous() if corners is None else torch.cat([corners[0], rows, corners[1]], 3)
        return self._zero_extend(strip, 2, self.extra[0], side)

    def column(self, cols: torch.Tensor, side: int) -> torch.Tensor:
        """The strip of a column of halo columns: ``(j_w - 1) d_w`` zero columns on the block's side."""
        return self._zero_extend(cols.contiguous(), 3, self.extra[1], side)

    @staticmethod
    def _zero_extend(t: torch.Tensor, dim: int, extra: int, side: int) -> torch.Tensor:
        """``t`` with ``extra`` zero rows along ``dim`` after it (``side`` 0) or before it (1)."""
        if not extra:
            return t
        shape = list(t.shape)
        shape[dim] = extra
        zeros = t.new_zeros(shape)
        return torch.cat([t, zeros] if side == 0 else [zeros, t], dim)


def _live(ex: Exchanger | PoleExchanger | None) -> tuple[bool, bool]:
    """Per side, whether the exchanger fills any halo row with data (else zeros beyond the domain: no strip). The
    same on every rank of the other axis's group (they share this axis's position), so they agree on the corners."""
    if ex is None:
        return False, False
    return tuple(any(i >= 0 for i in side.rows) for side in ex.sides)


def _exchangers(plan: PatchPlan2d) -> tuple[Exchanger | PoleExchanger | None, Exchanger | None, Exchanger | None]:
    return tuple(get_exchanger(i) if i >= 0 else None for i in (plan.ex_h, plan.ex_w, plan.ex_c))


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)


# -- the autograd Function -----------------------------------------------------------------------------------------

class _PatchConv2dFn(torch.autograd.Function):
    """:func:`patch_conv_2d` (module docstring): forward and its exact adjoint."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, dilation, groups):
        # A plain alias: the block's rows are read by this layer's own exchanges, not by a user's op on a field
        # (halo.guard watches the field itself; the 1-D patch hands its exchange ``x.detach()`` alike).
        x = x.detach()
        geo = _Geometry.of(weight, plan.pad, dilation, groups)
        ex_h, ex_w, ex_c = _exchangers(plan)
        pend_h = ex_h.start(x) if ex_h is not None else None
        pend_w = ex_w.start(x) if ex_w is not None else None
        y = F.conv2d(x, weight, bias, 1, geo.p, geo.dilation, groups)
        rows = ex_h.halos(x, pend_h) if ex_h is not None else (None, None)
        cols = ex_w.halos(x, pend_w) if ex_w is not None else (None, None)
        live_h, live_w = _live(ex_h), _live(ex_w)
        bands = [rows[s] for s in range(2) if live_h[s]]
        pend_c = None
        if ex_c is not None and bands:  # after the W wait: one message on the W group at a time
            band_rows = _cat(bands, 2)
            pend_c = ex_c.start(band_rows)
        strips: list[torch.Tensor | None] = [None] * 4  # top, bottom, left, right
        for side in range(2):
            if live_w[side]:
                strips[2 + side] = geo.column(cols[side], side)
                geo.border(y, 1, side).add_(geo.conv(strips[2 + side], weight, 1, side))
        corners = ex_c.halos(band_rows, pend_c) if pend_c is not None else None
        at = 0
        for side in range(2):
            if live_h[side]:
                pair = None if corners is None else tuple(t.narrow(2, at, geo.p[0]) for t in corners)
                at += geo.p[0]
                strips[side] = geo.band(rows[side], pair, side)
                geo.border(y, 0, side).add_(geo.conv(strips[side], weight, 0, side))
        ctx.geo, ctx.exchangers, ctx.has_bias = geo, (ex_h, ex_w, ex_c), bias is not None
        ctx.live = tuple(s is not None for s in strips)
        ctx.save_for_backward(x, weight, *[s for s in strips if s is not None])
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, *saved = ctx.saved_tensors
        geo = ctx.geo
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        strips = iter(saved)
        strips = [next(strips) if live else None for live in ctx.live]
        ex_h, ex_w, ex_c = ctx.exchangers
        gw_parts: list[tuple[int, int, torch.Tensor]] = []
        g_bands, corner_grads = _band_grads(geo, gy, strips, weight, need_x, need_w, gw_parts)
        pend_c = g_rows = None
        if need_x and ex_c is not None and g_bands:  # the corners' gradients go back along W first
            g_rows = _cat([g.narrow(3, geo.p[1], g.shape[3] - 2 * geo.p[1]) for g in g_bands], 2)
            pend_c = ex_c.start_adjoint(_cat([c[0] for c in corner_grads], 2), _cat([c[1] for c in corner_grads], 2),
                                        g_rows)
        g_cols = [None, None]
        for side in range(2):
            if strips[2 + side] is not None:
                g_strip, g_w = geo.conv_backward(geo.border(gy, 1, side), strips[2 + side], weight, 1, side,
                                                 need_x, need_w)
                if need_x:
                    g_cols[side] = geo.halo_of(g_strip, 1, side)
                if need_w:
                    gw_parts.append((1, side, g_w))
        pend_h = pend_w = None
        if need_x:
            halo_rows = _halo_row_grads(geo, ex_c, pend_c, g_bands, g_rows,
                                        tuple(s is not None for s in strips[:2]))
            pend_h = ex_h.start_adjoint(*halo_rows, x) if ex_h is not None else None
            pend_w = ex_w.start_adjoint(g_cols[0], g_cols[1], x) if ex_w is not None else None
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            gy, x, weight, [weight.shape[0]] if ctx.has_bias else None, [1, 1], list(geo.p), list(geo.dilation),
            False, [0, 0], geo.groups, [need_x, need_w, need_b and ctx.has_bias])
        for axis, side, g_w in gw_parts:
            geo.kernel_part(grad_w, axis, side).add_(g_w)
        if pend_w is not None:  # what the neighbours sent back lands on this rank's own rows, in place
            ex_w.finish_adjoint(pend_w, grad_x, grad_x)
        if pend_h is not None:
            ex_h.finish_adjoint(pend_h, grad_x, grad_x)
        return grad_x, grad_w, grad_b if ctx.has_bias else None, None, None, None


def _band_grads(geo: _Geometry, gy: torch.Tensor, strips: list, weight: torch.Tensor, need_x: bool, need_w: bool,
                gw_parts: list) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The band strips' backward: per live band (in order), the gradient of its halo rows with corners
    (``p_h x (w + 2 p_w)``, or ``w`` wide without corners) and its corners' gradients; kernel parts' gradients
    appended to ``gw_parts``."""
    g_bands, corner_grads = [], []
    for side in range(2):
        if strips[side] is None:
            continue
        g_strip, g_w = geo.conv_backward(geo.border(gy, 0, side), strips[side], weight, 0, side, need_x, need_w)
        if need_w:
            gw_parts.append((0, side, g_w))
        if need_x:
            g = geo.halo_of(g_strip, 0, side)
            g_bands.append(g)
            pw, width = geo.p[1], g.shape[3]
            if pw:  # a band has corners exactly when W is exchanged too
                corner_grads.append((g.narrow(3, 0, pw), g.narrow(3, width - pw, pw)))
    return g_bands, corner_grads


def _halo_row_grads(geo: _Geometry, ex_c: Exchanger | None, pend_c: dict | None, g_bands: list,
                    g_rows: torch.Tensor | None, live: tuple[bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """The H halo rows' gradients ``(top, bottom)`` (``None``: no band): the band rows' own, plus (with corners) the
    corner gradients the W neighbours sent back, added in place into ``g_rows`` (this call's own tensor)."""
    if pend_c is not None:
        ex_c.finish_adjoint(pend_c, g_rows, g_rows)
        parts = iter([g_rows.narrow(2, i * geo.p[0], geo.p[0]) for i in range(len(g_bands))])
    else:
        parts = iter(g_bands)
    return tuple(next(parts) if lv else None for lv in live)


# -- public ------------------------------------------------------------------------------------------------------------

def patch_conv_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ex_h: int, ex_w: int,
                  pad: tuple[int, int], dilation: Sequence[int], groups: int, ex_c: int | None = None) -> torch.Tensor:
    """``F.conv2d`` of the unsharded field (padded by the exchanges' boundary modes), restricted to this rank's
    block ``x`` (``(B, C, h, w)``), by compute-then-patch (module docstring); forward and backward exact.

    ``ex_h`` / ``ex_w``: the exchangers of the H halo (dim 2, rows ``[start - p_h, stop + p_h)``) and of the W halo
    (dim 3, columns likewise), -1 where that axis's ``p`` is 0; ``ex_c``: the corner exchange
    (:func:`plan_patch_2d` makes all three; ``None``: derived from ``ex_w``). Stride 1; ``pad = (p_h, p_w)`` with
    ``2p = d(k-1)`` per axis. The weight and bias gradients are this block's share (sum them over the domain).
    """
    dilation = (int(dilation[0]), int(dilation[1]))
    pad = (int(pad[0]), int(pad[1]))
    if x.dim() != 4:
        raise ValueError(f"patch_conv_2d: expected a batched (B, C, h, w) block, got shape {tuple(x.shape)}")
    for a, (p, ex, what) in enumerate(zip(pad, (ex_h, ex_w), ("H", "W"), strict=True)):
        if 2 * p != dilation[a] * (weight.shape[2 + a] - 1):
            raise ValueError(f"patch_conv_2d: padding {p} along {what} is not d(k-1)/2 for kernel "
                             f"{weight.shape[2 + a]}, dilation {dilation[a]}")
        if (ex >= 0) != (p > 0):
            raise ValueError(f"patch_conv_2d: exchanger {ex} along {what} with padding {p}: an axis is exchanged "
                             f"exactly when its padding is positive")
        if x.shape[2 + a] < p:
            raise ValueError(f"patch_conv_2d: a block of {x.shape[2 + a]} along {what} is thinner than its halo {p}")
    if ex_c is None:
        ex_c = corner_exchanger_id(ex_w) if min(pad) > 0 else -1
    if (ex_c >= 0) != (min(pad) > 0):
        raise ValueError(f"patch_conv_2d: corner exchanger {ex_c} with padding {pad}: the corners are exchanged "
                         f"exactly when both axes are")
    return _PatchConv2dFn.apply(x, weight, bias, PatchPlan2d(ex_h, ex_w, ex_c, pad), dilation, groups)
