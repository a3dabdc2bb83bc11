"""Convolutions on an H-shard that compute exactly what the unsharded layer computes, forward and backward.

=========================  ==========================  =====================================================
layer                      input (local shard)         H rows this rank needs (global "virtual" rows)
=========================  ==========================  =====================================================
``DomainConv2d``             ``(B, C, H_r, W)``          ``[o0*s - p_top, (o1-1)*s - p_top + d*(k-1) + 1)``
``DomainConv3d``             ``(B, C, D, H_r, W)``       same on H; D and W are local
``DomainConvTranspose2d``    ``(B, C, H_r, W)``          ``i`` with ``i*s - p + j*d in [o0, o1)`` for a ``j < k``
=========================  ==========================  =====================================================

``[o0, o1)`` is this rank's part of the balanced split of the *output* extent ``M``, so every activation is the
balanced split of its own global extent and layers chain (a stride-2 conv feeds the next layer without a
re-split; ``gather`` always works). The needed rows follow from the geometry alone — no halo-width heuristic —
so a halo may be asymmetric, reach past a neighbour into further ranks, or be negative (trimmed). Rows
beyond the domain are filled by the exchange's boundary mode: the conv's ``padding_mode`` by default
(``zeros`` is exactly conv zero padding), or ``boundary=`` (e.g. ``"pole"`` for latitude on a global grid).
The unsharded axes (W, and D for 3-d) are padded locally as the wrapped conv would.

Gradients: the input gradient is exact (the exchange's backward is its adjoint); weight and bias gradients on
each rank are the contribution of its output rows, so their *sum over the domain group* is the unsharded
gradient (each output row is computed by exactly one rank). Sum them as for any domain-parallel parameter.

Two ways to run the local conv (see docs/design.md):
  * compute-then-patch (the default where it applies: stride 1 in H, symmetric padding ``p = d(k-1)/2``, shards
    of at least ``p`` rows; ``_PatchConvFn``): post the exchange of the halo rows, convolve the shard itself with
    zero H padding while they travel, then add the halo rows' taps to the ``p`` top and bottom output rows (a
    small conv of the halo rows with the kernel rows that reach them: the conv is linear in its input).
    Backward: the strips' adjoint first, so the halo gradients travel while torch's backward of the main conv
    runs; what comes back is added into the conv's own input gradient in place. No copy of the activation or of
    its gradient; the one sync point per direction hides behind the conv.
  * pad-then-conv (strided, dilated-asymmetric, transposed, and ``overlap=False``): exchange into an extended
    shard (a buffer the exchange reuses; the interior copied while the halo rows travel), conv with no H
    padding. One copy of the shard each way.

On a latitude x longitude mesh the plan is per axis (:meth:`DomainLayer.axis_plans`: each axis's rows from its own
kernel, stride, dilation and padding, one agreement for both): the same two ways, on both axes — compute-then-patch
of the block (:mod:`halo.nn.patch2d`: the H and W exchanges behind the block's conv, the corners a second W hop),
or pad-then-conv (H, then W of the H-extended block: corners right). Across a pole with W sharded the H exchange
is a :func:`halo.exchange.pole_step` (the mirrored rows rolled by W/2 by the W ranks), either way. Under
``torch.compile`` both forms of compute-then-patch are plain ops around one custom op a conv (the 1-D
``halo::exchange_halos``; the 2-d ``halo::exchange_halos_2d``: rows, columns and corners, the rows across a pole
rolled), whose adjoint autograd chains for the backward (:meth:`_HaloConvNd._patch_compiled`,
:meth:`_HaloConvNd._patch_compiled_2d`).

Measured with benchmarks/conv_overhead.py (2 gloo ranks, 361 x 720 split in two, 3x3, fp32, fwd + bwd inside a
converted model, input from an activation; 2-core VM, 2026-11-30; benchmarks/RESULTS.md): compute-then-patch
1.00-1.14x a plain conv of the same local shape at 32 channels (median of 8 runs 1.07), 0.98-1.12x at 64 (median
1.06), of which the layer's own work is 2-3 %; pad-then-conv 1.04-1.23x.
``overlap=None`` (the default) takes compute-then-patch where it applies on a shard of at least
:data:`PATCH_MIN_ELEMENTS` elements, pad-then-conv below it (one conv and no strips: fewer launches where the
shard's copy is cheap); ``overlap=True`` compute-then-patch wherever it applies, ``False`` pad-then-conv. The two
paths send the same messages (the exchanger's forward, then its adjoint), so ranks whose shards fall on either
side of the threshold may take different ones. A circular W padding (longitude) goes through
:class:`_CircularPadFn` (one copy each way) instead of ``F.pad``, whose backward costs ~8x a copy on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import policy_device, result_dtype
from ..dist.comm import CommGroup
from ..exchange import exchange_halos, exchange_halos_2d, exchanger_id, get_exchanger
from ..kernels.reference import alloc_like as kernels_alloc_like
from ..plan.geometry import conv_row_plan, conv_transpose_row_plan
from ..plan.partition import check_boundary, split_sizes
from .base import AxisPlan, DomainLayer, adopt
from .patch2d import corner_exchanger_id, patch_conv_2d
from .registry import converts, pointwise_conv

__all__ = [
    "DomainConv2d",
    "DomainConv3d",
    "DomainConvTranspose2d",
    "conv_row_plan",
    "conv_transpose_row_plan",
    "PATCH_MIN_ELEMENTS",
    "patch_pays",
]

_MODE_BOUNDARY = {"zeros": "zeros", "circular": "circular", "reflect": "reflect", "replicate": "replicate"}

#: Default of ``overlap=None``: compute-then-patch where it applies, chosen by benchmarks/conv_overhead.py
#: (module docstring), on shards of at least ``PATCH_MIN_ELEMENTS[device type]`` elements (the conv's input on
#: this rank, batch included; 0 where not listed). On CPU (``benchmarks/vs_credit.py``, ``halo-pad`` against
#: ``halo-patch``, 2 gloo ranks, 8 channels, 2026-12-03, quiet): pad-then-conv is 6 % faster at 16 Ki elements a
#: rank (32 x 128), compute-then-patch 7 % faster at 64 Ki (91 x 180) and 18 % from 181 x 360 up. Not yet
#: measured on a GPU, which therefore patches everywhere it applies. ``HALO_PATCH_MIN_ELEMENTS`` overrides it for
#: every device (the test suite sets 0, so that its tiny shapes run the path large fields take).
OVERLAP_DEFAULT = True
PATCH_MIN_ELEMENTS: dict[str, int] = {"cpu": 1 << 15}
_PATCH_MIN_ENV = os.environ.get("HALO_PATCH_MIN_ELEMENTS")


def patch_pays(x: torch.Tensor) -> bool:
    """Whether ``overlap=None`` takes compute-then-patch for input ``x`` (where it applies): its size against
    :data:`PATCH_MIN_ELEMENTS` of its device (a local choice: both paths send the same messages)."""
    least = int(_PATCH_MIN_ENV) if _PATCH_MIN_ENV is not None else PATCH_MIN_ELEMENTS.get(x.device.type, 0)
    return x.numel() >= least


# -- pure row arithmetic (no process group: every rank computes the same plan for the whole group) ----------

# (conv_row_plan, conv_transpose_row_plan: halo.plan.geometry, re-exported here)


def _pads(conv: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """``(before, after)`` padding per spatial dim; ``'same'`` as torch: ``d(k-1)//2`` before, the rest after."""
    if conv.padding == "valid":
        return [(0, 0)] * len(conv.kernel_size)
    if conv.padding == "same":
        out = []
        for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(p, p) for p in conv.padding]


def _crop_rows(y: torch.Tensor, t0: int, t1: int, dim: int = -2) -> torch.Tensor:
    """Rows ``[t0, t1)`` of ``y`` along ``dim``, zeros where that range leaves ``[0, len)``.

    Always slices ``y`` (possibly to zero rows), so the result stays in ``y``'s autograd graph: every rank must
    run the exchange's backward, whose adjoint messages its peers wait for.
    """
    length = y.shape[dim]
    a, b = min(max(t0, 0), length), min(max(t1, 0), length)
    b = max(a, b)
    before, after = max(0, min(t1, 0) - t0), max(0, t1 - max(t0, length))
    part = y.narrow(dim, a, b - a)
    if not (before or after):
        return part
    return F.pad(part, (0, 0, before, after) if dim % y.dim() == y.dim() - 2 else (before, after))


# -- wrapping an existing module ----------------------------------------------------------------------------

class _HaloConvMixin(DomainLayer):
    """Shared construction, configuration and (deep)copy behaviour of the halo conv layers."""

    _base: type[nn.modules.conv._ConvNd]
    _spatial: int

    def __init__(self, conv: Any, *args: Any, group: Any | None = None, boundary: str | None = None,
                 overlap: bool | None = None, mesh: Any | None = None, **kwargs: Any) -> None:
        name = type(self).__name__
        if isinstance(conv, nn.Module):
            if args or kwargs:
                raise TypeError(f"{name}(conv, ...) takes only group=, boundary=, overlap=, mesh= besides the "
                                f"module; got extra arguments {args} {sorted(kwargs)}")
            adopt(self, conv, self._base, name)
        else:
            super().__init__(conv, *args, **kwargs)  # built like the nn layer: fresh parameters
        if boundary is not None:
            boundary = check_boundary(boundary)
        self.boundary, self.overlap = boundary, overlap
        self.halo_init(group, mesh, name)
        if self.halo_axes > 1 and self._spatial != 2:
            raise ValueError(f"{name}: a latitude x longitude mesh is supported by the 2-d layers only; shard only "
                             f"latitude (a one-axis mesh) for 3-d convolutions")

    @property
    def h_boundary(self) -> str:
        """What fills H rows beyond the domain: ``boundary`` if given, else the conv's ``padding_mode``."""
        return self.boundary or _MODE_BOUNDARY[self.padding_mode]

    def to_conv(self) -> nn.Module:
        """The plain layer (same Parameters, no halo): the reverse of wrapping, e.g. for unsharded inference."""
        plain = self._base.__new__(self._base)
        nn.Module.__init__(plain)
        for key, value in self.__dict__.items():
            if key not in ("_group_ref", "boundary", "overlap", "_halo_site", "_halo_mesh"):
                plain.__dict__[key] = copy.copy(value) if isinstance(value, dict | set | list) else value
        return plain

    def extra_repr(self) -> str:
        extra = f", boundary={self.boundary!r}" if self.boundary else ""
        extra += f", overlap={self.overlap}" if self.overlap is not None else ""
        return super().extra_repr() + extra

    @property
    def w_boundary(self) -> str:
        """What fills W columns beyond the domain on a latitude x longitude mesh: the conv's ``padding_mode``."""
        return _MODE_BOUNDARY[self.padding_mode]

    def _plans(self, x: torch.Tensor, make: Any, extra: tuple, per_axis: tuple) -> tuple:
        """This call's plan per sharded axis (H; then W on a mesh), agreed on (or recalled) *before* any shape
        check, so that the checks after it fail identically on every rank and none waits alone (invariant 4: the
        agreement itself refuses a tensor without a dim -2 on every rank)."""
        plans = self.axis_plans(x, type(self).__name__, make, extra, per_axis)
        self._check_input(x)
        return plans

    def _shape_names(self) -> str:
        return "B, C, D, H, W" if self._spatial == 3 else "B, C, H, W"

    def _check_input(self, x: torch.Tensor) -> None:
        name, nd = type(self).__name__, self._spatial
        if x.dim() not in (nd + 1, nd + 2):
            raise ValueError(f"{name}: expected a {nd + 2}-d ({self._shape_names()}) or unbatched {nd + 1}-d "
                             f"input sharded on H (dim -2), got {x.dim()}-d shape {tuple(x.shape)}")
        if x.shape[-nd - 1] != self.in_channels:
            raise ValueError(f"{name}: expected {self.in_channels} input channels (dim {-nd - 1}), got "
                             f"{x.shape[-nd - 1]} in shape {tuple(x.shape)}")


@dataclasses.dataclass(frozen=True)
class ConvPlan(AxisPlan):
    """One axis of a conv call as planned for this rank (:class:`halo.nn.base.AxisPlan`: ``plain``, or the exchange
    and its extended rows) and ``patch``: compute-then-patch's halo width ``p`` along it (0: pad-then-conv);
    ``corners``: on the W axis of a mesh, the exchanger of the corners (:func:`halo.nn.patch2d.corner_exchanger_id`,
    planned once here rather than looked up per call), else -1; ``live``: with ``patch``, the sides (0 before, 1
    after) whose halo rows come from some rank (not all beyond the domain), which a compiled forward convolves."""

    patch: int = 0
    corners: int = -1
    live: tuple[int, ...] = ()


def _conv_axis(cg: CommGroup, sizes: tuple[int, ...], dim: int, kernel: int, stride: int, dilation: int,
               pad: tuple[int, int], boundary: str, tensor_dim: int, w_axis: bool, padding_mode: str,
               overlap: bool, name: str) -> ConvPlan:
    """One sharded axis of a conv (the per-axis geometry of :meth:`DomainLayer.axis_plans`): the rows of
    ``tensor_dim`` (of the batched input) this rank needs, from the axis's kernel, stride, dilation and padding."""
    if cg.size == 1 and boundary == _MODE_BOUNDARY[padding_mode]:
        return ConvPlan(True, dim=tensor_dim)  # one rank along the axis: the conv pads it itself
    _, needs = conv_row_plan(sizes, kernel, stride, dilation, pad, op=name)
    pt, pb = pad
    # Compute-then-patch applies to a stride-1 conv whose output rows are its input rows (symmetric padding
    # p = d(k-1)/2) on shards of at least p rows; decided from group-wide numbers only, so every rank takes the
    # same path. Its exchange is pad-then-conv's (rows [start - p, stop + p)), of which it uses the halos alone.
    # Only on the balanced split: a block split (granularity=) puts other rows where the patch expects its edges.
    patch = pt if (overlap and stride == 1 and pt == pb > 0 and 2 * pt == dilation * (kernel - 1)
                   and min(sizes) >= pt and list(sizes) == split_sizes(sum(sizes), cg.size)) else 0
    lo, hi = needs[cg.index]
    ex = exchanger_id(cg, tensor_dim, sizes, needs, boundary, name)
    sides = get_exchanger(ex).sides if patch else ()
    live = tuple(k for k, side in enumerate(sides) if not all(i < 0 for i in side.rows))
    return ConvPlan(False, ex, hi - lo, tensor_dim, patch, corner_exchanger_id(ex) if patch and w_axis else -1, live)


class _PatchConvFn(torch.autograd.Function):
    """Compute-then-patch: the conv of the shard with zero H padding, plus the halo rows' share of the ``p`` top
    and bottom output rows; no copy of the shard or of its gradient, communication behind the conv.

    Forward on rank r (``p = d(k-1)/2``, ``n`` rows)::

        post the exchange of the halo rows (the rank's edge rows go to its neighbours)
        y = conv(x, zero H padding p)        # exact but for the p first and last rows, which read zeros
        t = conv(batch-stack([halo_top | 0 (2p rows)], [0 (2p rows) | halo_bottom]), w)  # one launch, both sides
        y[:p] += t[top];  y[n-p:] += t[bottom]    # the halo rows' taps only: the conv is linear in its input

    Backward (the exact adjoint): the strips' backward first (small, one launch), giving the halo rows' gradients,
    which are posted to their owners at once; then torch's backward of the main conv gives ``grad_x`` (this call's own,
    contiguous), ``grad_w`` and ``grad_b``; what the neighbours sent back (posted just as early on their side,
    so nobody waits for a peer's big computation) is added into ``grad_x`` in place. ``xp`` is ``x`` padded along
    the other spatial dims as the wrapped conv pads them (``x`` itself when the conv pads them with zeros); ``x``
    (detached) is what is exchanged.
    """

    @staticmethod
    def forward(ctx, xp, x, weight, bias, layer, ex_id, p, live):
        ex = get_exchanger(ex_id)
        pending = ex.start(x)
        y = layer._conv_main(xp, weight, bias, p)
        halos = ex.halos(x, pending)
        n = y.shape[-2]
        # The sides with a neighbour (beyond the domain: zeros, nothing to add), both strips in one conv (stacked
        # along the batch dim, with the whole kernel: one launch per layer, not one per side).
        strips = layer._strips([halos[side] for side in live], live, p) if live else None
        if strips is not None:
            b = halos[0].shape[0]
            taps = layer._conv(strips, layer._main_padding(0), weight, None)
            for i, side in enumerate(live):
                y.narrow(-2, 0 if side == 0 else n - p, p).add_(taps.narrow(0, i * b, b))
        ctx.layer, ctx.ex, ctx.p, ctx.live = layer, ex, p, live
        ctx.has_bias, ctx.halo_shape = bias is not None, halos[0].shape
        ctx.save_for_backward(xp, weight, *(() if strips is None else (strips,)))
        return y

    @staticmethod
    def backward(ctx, gy):
        xp, weight, *saved = ctx.saved_tensors
        layer, ex, p = ctx.layer, ctx.ex, ctx.p
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        n = gy.shape[-2]
        grads: list[torch.Tensor | None] = [None, None]
        grad_w_strips = None
        # The strips first (small, one launch): the halo rows' gradients then travel while the main conv's backward
        # runs.
        if ctx.live:
            (strips,) = saved
            g_taps = torch.cat([gy.narrow(-2, 0 if side == 0 else n - p, p) for side in ctx.live], 0)
            g_strips, grad_w_strips, _ = torch.ops.aten.convolution_backward(
                g_taps, strips, weight, None, list(layer.stride), layer._main_padding(0), list(layer.dilation),
                False, [0] * layer._spatial, layer.groups, [need_x, need_w, False])
            if need_x:
                b = ctx.halo_shape[0]
                for i, side in enumerate(ctx.live):
                    grads[side] = layer._strip_halo_grad(g_strips.narrow(0, i * b, b), side, p, ctx.halo_shape)
        pending = ex.start_adjoint(grads[0], grads[1], layer._interior(xp)) if need_x else None
        grad_xp, grad_w, grad_b = torch.ops.aten.convolution_backward(
            gy, xp, weight, [weight.shape[0]] if ctx.has_bias else None, list(layer.stride),
            layer._main_padding(p), list(layer.dilation), False, [0] * layer._spatial, layer.groups,
            [need_x, need_w, need_b and ctx.has_bias])
        if grad_w_strips is not None and need_w:
            grad_w.add_(grad_w_strips)
        if pending is not None:  # what the neighbours sent back is added into this rank's own rows, in place
            interior = layer._interior(grad_xp)
            ex.finish_adjoint(pending, interior, interior)
        return grad_xp, None, grad_w, grad_b if ctx.has_bias else None, None, None, None, None


_OWN = object()  # "the layer's own bias"


def _keep_channels_last(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y`` (a crop of the local conv's output: a view, dense in no format) channels_last where torch's conv gives
    channels_last (a channels_last input or weight), as ``nn.ConvTranspose2d`` does; otherwise ``y`` as it is."""
    fmt = torch.channels_last if y.dim() == 4 else torch.channels_last_3d
    if not any(t.is_contiguous(memory_format=fmt) and not t.is_contiguous() for t in (x, weight)):
        return y
    return y.contiguous(memory_format=fmt)


def autocast_dtype(x: torch.Tensor, op: str = "conv2d", weight: torch.Tensor | None = None) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts a conv's inputs to (asked of torch: :func:`halo.autocast.result_dtype`,
    on the device whose policy applies), ``None`` where autocast is off there or leaves the conv alone (float64)."""
    if not torch.is_autocast_enabled(policy_device(x)):
        return None
    dtype = result_dtype(op, x, weight)
    return None if dtype == torch.float64 else dtype


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` cast as autocast casts a lower-precision op's argument: floating tensors but float64, to ``dtype``."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def _no_autocast(x: torch.Tensor, dtype: torch.dtype | None) -> Any:
    """Autocast off on ``x``'s device (where it was on: ``dtype`` given), else a no-op context."""
    import contextlib

    return torch.autocast(x.device.type, enabled=False) if dtype is not None else contextlib.nullcontext()


class _CircularPadFn(torch.autograd.Function):
    """``F.pad(x, (a, b), mode="circular")`` along one dim ``d`` (longitude wraps), with a lean adjoint: forward one
    copy into a fresh tensor, backward one copy of the interior gradient plus the two wrapped edges added back.
    (torch's circular pad builds its backward from slices of a zero-filled tensor: ~8x the time on a CPU.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, d: int, a: int, b: int) -> torch.Tensor:
        n = x.shape[d]
        shape = list(x.shape)
        shape[d] = n + a + b
        out = kernels_alloc_like(x, shape)
        out.narrow(d, a, n).copy_(x)
        if a:
            out.narrow(d, 0, a).copy_(x.narrow(d, n - a, a))
        if b:
            out.narrow(d, a + n, b).copy_(x.narrow(d, 0, b))
        ctx.args = d, a, b, n
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        d, a, b, n = ctx.args
        gx = g.narrow(d, a, n).clone(memory_format=torch.preserve_format)
        if a:
            gx.narrow(d, n - a, a).add_(g.narrow(d, 0, a))
        if b:
            gx.narrow(d, 0, b).add_(g.narrow(d, a + n, b))
        return gx, None, None, None


def _circular_pad(t: torch.Tensor, pads: Sequence[tuple[int, int]], skip: tuple[int, ...]) -> torch.Tensor:
    """``t`` padded circularly along its last ``len(pads)`` dims by ``pads[i] = (before, after)``, but the dims in
    ``skip`` (indices into ``pads``); torch's own op where a pad exceeds its dim (which torch then refuses)."""
    nd = len(pads)
    if torch.compiler.is_compiling() or any(max(a, b) > t.shape[t.dim() - nd + i]
                                            for i, (a, b) in enumerate(pads) if i not in skip):
        flat: list[int] = []
        for i in reversed(range(nd)):  # F.pad lists the last dim first
            flat += [0, 0] if i in skip else list(pads[i])
        return F.pad(t, flat, mode="circular")
    for i, (a, b) in enumerate(pads):
        if i not in skip and (a or b):
            t = _CircularPadFn.apply(t, t.dim() - nd + i, a, b)
    return t


class _HaloConvNd(_HaloConvMixin):
    """Forward of DomainConv2d / DomainConv3d: H (dim -2) exchanged, the other spatial dims padded locally."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = tuple(_pads(self))
        nd, name = self._spatial, type(self).__name__
        overlap = OVERLAP_DEFAULT if self.overlap is None else bool(self.overlap)
        # Per sharded axis (H, then W on a mesh): its kernel, stride, dilation, padding, boundary, tensor dim.
        per_axis = tuple((self.kernel_size[i], self.stride[i], self.dilation[i], pads[i], boundary, nd + a, a == 1)
                         for a, (i, boundary) in enumerate(((nd - 2, self.h_boundary), (nd - 1, self.w_boundary))))
        plans = self._plans(x, _conv_axis, (self.padding_mode, overlap, name), per_axis)
        skip = tuple(plan.dim - 2 for plan in plans if not plan.plain)  # the spatial dims exchanged
        if not skip:
            return self._base.forward(self, x)
        unbatched = x.dim() == nd + 1
        xb = x.unsqueeze(0) if unbatched else x
        cast = autocast_dtype(xb, f"conv{nd}d", self.weight)
        xb = _cast(xb, cast)  # what autocast's conv would cast to, before the exchange (half the bytes)
        plan = plans[0]
        # A mesh axis of one rank (plain: the conv pads it itself) leaves the H axis alone exchanged: the 1-D path.
        h_only = not plan.plain and all(p.plain for p in plans[1:])
        compiling = torch.compiler.is_compiling()
        if len(plans) == 2 and all(p.patch and not p.plain for p in plans):
            # Compute-then-patch on both axes (halo.nn.patch2d): the block's conv while rows and columns travel
            # (compiled: plain ops and halo::exchange_halos_2d).
            weight, bias = _cast(self.weight, cast), _cast(self.bias, cast)
            with _no_autocast(xb, cast):
                if compiling:
                    y = self._patch_compiled_2d(xb, weight, bias, plans)
                else:
                    y = patch_conv_2d(xb, weight, bias, plan.ex, plans[1].ex, (plan.patch, plans[1].patch),
                                      self.dilation, self.groups, ex_c=plans[1].corners)
        elif h_only and plan.patch and not plan.rolled and (self.overlap is not None or patch_pays(xb)):
            # The Function computes in the dtype torch's conv would under autocast: its inputs are cast here, by
            # autograd-visible casts (so every gradient comes back in its input's own dtype), and autocast is off
            # inside, so its forward and backward convs see one dtype (as torch's own conv under autocast).
            weight, bias = _cast(self.weight, cast), _cast(self.bias, cast)
            with _no_autocast(xb, cast):
                if torch.compiler.is_compiling():  # the same arithmetic as plain ops and halo::exchange_halos
                    y = self._patch_compiled(xb, weight, bias, plan)
                else:
                    y = _PatchConvFn.apply(self._pad_other(xb), xb.detach(), weight, bias, self, plan.ex,
                                           plan.patch, plan.live)
        else:
            y = self._conv(self._pad_other(self.exchange_axes(xb, plans), skip), self._main_padding(0, skip),
                           _cast(self.weight, cast), _cast(self.bias, cast))  # (as autocast casts them)
        return self.finish(y.squeeze(0) if unbatched else y, x)

    def _patch_compiled(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        plan: ConvPlan) -> torch.Tensor:
        """Compute-then-patch as a compiled graph sees it (``_PatchConvFn``'s arithmetic): the conv of the shard
        with zero H padding ``p``, plus the conv of the halo strips (``halo::exchange_halos``: the ``p`` rows from
        each neighbour, the edge rows alone sent) added onto the ``p`` first and last output rows. Plain torch ops
        but the exchange, so autograd gives the backward (the halo rows' gradients go back through the op's
        adjoint) and the compiler fuses the additions; no extended copy of the shard either way."""
        p = plan.patch
        y = self._conv_main(self._pad_other(x), weight, bias, p)
        halos = exchange_halos(x, plan.ex, (p, p), plan.dim)  # every rank posts (its peers wait for its rows)
        if not plan.live:
            return y
        strips = self._strips([halos.narrow(-2, side * p, p) for side in plan.live], plan.live, p)
        taps = self._conv(strips, self._main_padding(0), weight, None)
        n, b = y.shape[-2], x.shape[0]
        for i, side in enumerate(plan.live):  # out of place, zero-extended: no clone of the gradient in backward
            y = y + F.pad(taps.narrow(0, i * b, b), (0, 0, 0, n - p) if side == 0 else (0, 0, n - p, 0))
        return y

    def _patch_compiled_2d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           plans: tuple) -> torch.Tensor:
        """Compute-then-patch of a latitude x longitude block as a compiled graph sees it (:mod:`halo.nn.patch2d`'s
        arithmetic, in the form of :meth:`_patch_compiled`): the conv of the block with zero padding ``(p_h, p_w)``,
        plus the convs of the halo bands (``p_h`` rows, the corners included) and of the halo columns (``p_w``
        columns, the block's rows only) added onto the output's border. One ``halo::exchange_halos_2d`` gives the
        rows, the columns and the corners (the W exchange of the rows: a diagonal neighbour's rows travel H, then W,
        as in pad-then-conv; across a pole the rows are the pole step's, rolled), in patch2d's order and sync points.
        Per axis its live sides stacked along the batch dim with the whole kernel (one launch per axis): a band is
        ``p_h`` halo rows and ``2 p_h`` zero rows (``2p = d(k-1)``), a column strip ``p_w`` columns and ``2 p_w``
        zeros, zero-padded by ``p_h`` in H like the main conv (the corners are the bands'). Autograd gives the
        backward (the op's adjoint); no extended copy of the block either way."""
        (ph, pw), (live_h, live_w) = (plans[0].patch, plans[1].patch), (plans[0].live, plans[1].live)
        y = F.conv2d(x, weight, bias, 1, (ph, pw), self.dilation, self.groups)
        rows, cols, corners = exchange_halos_2d(x, plans[0].ex, plans[1].ex, plans[1].corners, (ph, pw))
        b, (n, m) = x.shape[0], y.shape[-2:]
        if live_h:
            bands = torch.cat([corners.narrow(3, 0, pw), rows, corners.narrow(3, pw, pw)], 3)
            zeros = bands.new_zeros((b, bands.shape[1], 2 * ph, bands.shape[3]))
            strips = torch.cat([torch.cat([bands.narrow(2, side * ph, ph), zeros] if side == 0 else
                                          [zeros, bands.narrow(2, side * ph, ph)], 2) for side in live_h], 0)
            taps = F.conv2d(strips, weight, None, 1, 0, self.dilation, self.groups)
            for i, side in enumerate(live_h):  # out of place, zero-extended (as the 1-D form)
                y = y + F.pad(taps.narrow(0, i * b, b), (0, 0, 0, n - ph) if side == 0 else (0, 0, n - ph, 0))
        if live_w:
            zeros = cols.new_zeros((*cols.shape[:3], 2 * pw))
            strips = torch.cat([torch.cat([cols.narrow(3, side * pw, pw), zeros] if side == 0 else
                                          [zeros, cols.narrow(3, side * pw, pw)], 3) for side in live_w], 0)
            taps = F.conv2d(strips, weight, None, 1, (ph, 0), self.dilation, self.groups)
            for i, side in enumerate(live_w):
                y = y + F.pad(taps.narrow(0, i * b, b), (0, m - pw) if side == 0 else (m - pw, 0))
        return y

    def _conv(self, x: torch.Tensor, padding: Sequence[int], weight: torch.Tensor | None = None,
              bias: Any = _OWN) -> torch.Tensor:
        fn = F.conv3d if self._spatial == 3 else F.conv2d
        return fn(x, self.weight if weight is None else weight, self.bias if bias is _OWN else bias, self.stride,
                  tuple(padding), self.dilation, self.groups)

    def _skip(self, skip: tuple[int, ...] | None) -> tuple[int, ...]:
        return (self._spatial - 2,) if skip is None else skip

    def _other_padded_by_conv(self, skip: tuple[int, ...] | None = None) -> bool:
        """Whether the conv itself pads the spatial dims not in ``skip`` (the exchanged ones; default H) (zeros,
        symmetric), else ``F.pad`` does."""
        pads, skip = _pads(self), self._skip(skip)
        return self.padding_mode == "zeros" and all(a == b for i, (a, b) in enumerate(pads) if i not in skip)

    def _pad_other(self, t: torch.Tensor, skip: tuple[int, ...] | None = None) -> torch.Tensor:
        """``t`` padded along the spatial dims not in ``skip`` as the wrapped conv pads them (``t`` itself if the
        conv does)."""
        if self._other_padded_by_conv(skip):
            return t
        pads, skip = _pads(self), self._skip(skip)
        if self.padding_mode == "circular":
            return _circular_pad(t, pads, skip)
        flat: list[int] = []
        for i in reversed(range(self._spatial)):  # F.pad lists the last dim first
            flat += [0, 0] if i in skip else list(pads[i])
        return F.pad(t, flat, mode="constant" if self.padding_mode == "zeros" else self.padding_mode)

    def _interior(self, t: torch.Tensor) -> torch.Tensor:
        """The view of ``t`` (padded by :meth:`_pad_other`) that holds the unpadded tensor."""
        if self._other_padded_by_conv():
            return t
        pads, h = _pads(self), self._spatial - 2
        for i, (a, b) in enumerate(pads):
            if i != h:
                d = i - self._spatial
                t = t.narrow(d, a, t.shape[d] - a - b)
        return t

    def _main_padding(self, p: int, skip: tuple[int, ...] | None = None) -> list[int]:
        """The conv's own padding: ``p`` along H (compute-then-patch's zero rows) when ``skip`` is the default,
        0 along every dim in ``skip``, the layer's padding (or 0 where :meth:`_pad_other` padded) elsewhere."""
        pads, h = _pads(self), self._spatial - 2
        by_conv = self._other_padded_by_conv(skip)
        skip = self._skip(skip)
        return [(p if i == h else 0) if i in skip else (a if by_conv else 0) for i, (a, _) in enumerate(pads)]

    def _conv_main(self, xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, p: int) -> torch.Tensor:
        return self._conv(xp, self._main_padding(p), weight, bias)

    def _strips(self, halos: Sequence[torch.Tensor], sides: Sequence[int], p: int) -> torch.Tensor:
        """The input of the boundary strips, stacked along the batch dim: per side, its ``p`` halo rows and ``2p``
        zero rows on the shard's side (``(k-1)d = 2p``: the whole kernel then sees exactly the halo rows' taps on
        the ``p`` boundary output rows), padded along the other dims as the main conv pads them
        (``_PatchConvFn``)."""
        parts = []
        for halo, side in zip(halos, sides, strict=True):
            zeros = halo.new_zeros((*halo.shape[:-2], 2 * p, halo.shape[-1]))
            parts.append(torch.cat([halo, zeros] if side == 0 else [zeros, halo], dim=-2))
        return self._pad_other(parts[0] if len(parts) == 1 else torch.cat(parts, 0))

    def _strip_halo_grad(self, g_strip: torch.Tensor, side: int, p: int, halo_shape: torch.Size) -> torch.Tensor:
        """The halo rows' gradient from the padded strip's: undo the other-dim padding (its exact adjoint), keep
        the ``p`` halo rows."""
        if not self._other_padded_by_conv():  # F.pad's adjoint, by autograd on the small strip
            shape = (*halo_shape[:-2], 3 * p, halo_shape[-1])
            with torch.enable_grad():
                t = g_strip.new_zeros(shape).requires_grad_(True)
                (g_strip,) = torch.autograd.grad(self._pad_other(t), t, g_strip)
        return g_strip.narrow(-2, 0 if side == 0 else g_strip.shape[-2] - p, p)


@converts(nn.Conv2d, axes=2, keep=pointwise_conv, takes=("group", "boundary", "mesh"), functional=(F.conv2d,),
          example=lambda kind: (kind(3, 4, 3, padding=1), (2, 3, 23, 7)))
class DomainConv2d(_HaloConvNd, nn.Conv2d):
    """``nn.Conv2d`` on an H-shard ``(B, C, H_r, W)``; equals the unsharded conv, forward and backward.

    ``DomainConv2d(conv)`` shares ``conv``'s Parameters (state_dict keys unchanged); ``DomainConv2d(3, 8, 3,
    padding=1, ...)`` builds a fresh one with ``nn.Conv2d``'s arguments. Keywords: ``group`` (the domain group;
    default the manager's), ``boundary`` (fills H beyond the domain; default from ``padding_mode``),
    ``overlap`` (compute-then-patch where it applies; ``None``: the measured default, by size: ``patch_pays``).
    Output: ``(B, C_out, M_r, W_out)``, ``M_r`` this rank's part of the balanced split of the output rows.
    """

    _base, _spatial = nn.Conv2d, 2


@converts(nn.Conv3d, keep=pointwise_conv, takes=("group", "boundary"), functional=(F.conv3d,),
          example=lambda kind: (kind(2, 3, 3, padding=1), (2, 2, 3, 23, 7)))
class DomainConv3d(_HaloConvNd, nn.Conv3d):
    """``nn.Conv3d`` on ``(B, C, D, H_r, W)`` sharded on H (dim -2); D and W are local. As :class:`DomainConv2d`."""

    _base, _spatial = nn.Conv3d, 3


class _HaloConvTransposeNd(_HaloConvMixin):
    """The transposed convs on an H-shard (H: dim -2 of a 2-d or 3-d field)."""

    def __init__(self, conv: Any, *args: Any, group: Any | None = None, boundary: str | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("overlap") is not None:
            raise TypeError(f"{type(self).__name__} has no overlap option (it always exchanges, then convolves)")
        if boundary not in (None, "zeros"):
            raise ValueError(f"{type(self).__name__}: boundary must be None or 'zeros' (a transposed conv reads "
                             f"no rows outside its input), got {boundary!r}")
        super().__init__(conv, *args, group=group, boundary=boundary, **kwargs)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        name, nd = type(self).__name__, self._spatial
        if self.padding_mode != "zeros":
            raise ValueError(f"{name}: only padding_mode 'zeros' is supported (as nn.{self._base.__name__}), got "
                             f"{self.padding_mode!r}")
        size = None if output_size is None else tuple(int(v) for v in output_size)
        per_axis = tuple((self.kernel_size[i], self.stride[i], self.dilation[i], self.padding[i],
                          self.output_padding[i], i, nd + a) for a, i in enumerate((nd - 2, nd - 1)))
        plans = self._plans(x, _transpose_axis_plan, (size, nd, name), per_axis)
        if all(plan.plain for plan in plans):
            return self._base.forward(self, x, output_size)
        unbatched = x.dim() == nd + 1
        cast = autocast_dtype(x, f"conv_transpose{nd}d", self.weight)
        xb = _cast(x.unsqueeze(0) if unbatched else x, cast)  # as autocast would, before exchanging
        ext = self.exchange_axes(xb, plans)
        # An exchanged axis: no padding (the crop below takes this rank's output rows); the others (whole on this
        # rank) as torch pads them.
        skip = tuple(plan.dim - 2 for plan in plans if not plan.plain)
        padding = [0 if i in skip else self.padding[i] for i in range(nd)]
        out_pad = [0 if i in skip else _output_padding(
            xb.shape[2 + i], None if size is None else size[len(size) - nd + i], self.kernel_size[i], self.stride[i],
            self.dilation[i], self.padding[i], self.output_padding[i], name) for i in range(nd)]
        fused = all(plan.fused for plan in plans if not plan.plain)
        fn = F.conv_transpose2d if nd == 2 else F.conv_transpose3d
        y = fn(ext, _cast(self.weight, cast), _cast(self.bias, cast) if fused else None, self.stride,
               tuple(padding), tuple(out_pad), self.groups, self.dilation)
        for plan in plans:
            if not plan.plain:
                y = _crop_rows(y, plan.t0, plan.t1, plan.dim)
        if not fused and self.bias is not None:  # in the conv's output dtype (bf16 under autocast)
            y = y + self.bias.to(y.dtype).view(-1, *([1] * nd))
        y = _keep_channels_last(y, xb, self.weight)
        return self.finish(y.squeeze(0) if unbatched else y, x)


@converts(nn.ConvTranspose2d, axes=2, functional=(F.conv_transpose2d,),
          example=lambda kind: (kind(3, 2, 3, stride=2, padding=1), (2, 3, 23, 7)))
class DomainConvTranspose2d(_HaloConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on an H-shard; equals the unsharded layer, forward and backward.

    Runs ``conv_transpose2d`` on the rows that reach this rank's output rows, with no H padding, and crops
    (zero-extending where only ``output_padding`` or bias reaches). ``output_size`` in ``forward`` is the
    *global* output size. ``padding_mode`` must be ``zeros`` (torch's rule), so ``boundary`` may only be
    ``None`` or ``"zeros"``: rows outside the input are zeros by definition of the transposed conv.
    """

    _base, _spatial = nn.ConvTranspose2d, 2


@converts(nn.ConvTranspose3d, functional=(F.conv_transpose3d,),
          example=lambda kind: (kind(2, 2, 3, stride=2, padding=1), (2, 2, 3, 23, 7)))
class DomainConvTranspose3d(_HaloConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on ``(B, C, D, H_r, W)`` sharded on H (dim -2): as :class:`DomainConvTranspose2d`
    (Pangu's patch recovery, 3-d U-Net decoders)."""

    _base, _spatial = nn.ConvTranspose3d, 3


@dataclasses.dataclass(frozen=True)
class ConvTransposePlan(AxisPlan):
    """One axis of a transposed conv as planned for this rank (:class:`halo.nn.base.AxisPlan`), the local output
    rows ``[t0, t1)`` to keep along it, and whether the bias can go into the conv (``fused``) or must also land on
    zero-extended rows."""

    t0: int = 0
    t1: int = 0
    fused: bool = True


def _output_padding(n: int, size: int | None, k: int, s: int, d: int, p: int, given: int, name: str) -> int:
    """The output padding along one axis of global input extent ``n``: ``given``, or what makes the output ``size``
    long (torch's ``_output_padding``, per axis: every axis's rule depends on its own extent alone)."""
    if size is None:
        return given
    least = (n - 1) * s - 2 * p + d * (k - 1) + 1
    if not least <= size <= least + s - 1:
        raise ValueError(f"{name}: requested an output size of {size} along an axis of {n} input rows, but valid "
                         f"sizes range from {least} to {least + s - 1}")
    return size - least


def _transpose_axis_plan(cg: CommGroup, sizes: tuple[int, ...], dim: int, k: int, s: int, d: int, p: int,
                         output_padding: int, spatial: int, tensor_dim: int, output_size: tuple[int, ...] | None,
                         nd: int, name: str) -> ConvTransposePlan:
    """One sharded axis of a transposed conv (the per-axis geometry of :meth:`DomainLayer.axis_plans`)."""
    if output_size is not None and len(output_size) not in (nd, nd + 1, nd + 2):
        raise ValueError(f"{name}: output_size must have {nd} or {nd + 2} elements, got {len(output_size)}")
    if cg.size == 1:
        return ConvTransposePlan(True, dim=tensor_dim)
    size = None if output_size is None else output_size[len(output_size) - nd + spatial]
    op_pad = _output_padding(sum(sizes), size, k, s, d, p, output_padding, name)
    ex, rows, t0, t1, fused = _transpose_axis(cg, sizes, k, s, d, p, op_pad, tensor_dim, name)
    return ConvTransposePlan(False, ex, rows, tensor_dim, t0, t1, fused)


def _transpose_axis(cg: CommGroup, sizes: tuple[int, ...], k: int, s: int, d: int, p: int, op_pad: int, dim: int,
                    name: str) -> tuple[int, int, int, int, bool]:
    """One sharded axis of a transposed conv: ``(exchanger id, extended rows, t0, t1, fused)``."""
    out_sizes, needs = conv_transpose_row_plan(sizes, k, s, d, p, op_pad, op=name)
    ex = exchanger_id(cg, dim, sizes, needs, "zeros", name)
    lo, hi = needs[cg.index]
    # Local output row t is global row lo*s - p + t; this rank's rows are [o0, o1).
    o0 = sum(out_sizes[:cg.index])
    t0 = o0 + p - lo * s
    t1 = t0 + out_sizes[cg.index]
    length = (hi - lo - 1) * s + d * (k - 1) + 1
    fused = t0 >= 0 and t1 <= length  # else bias must also land on the zero-extended rows
    return ex, hi - lo, t0, t1, fused


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloConv2d = DomainConv2d
HaloConv3d = DomainConv3d
HaloConvTranspose2d = DomainConvTranspose2d
HaloConvTranspose3d = DomainConvTranspose3d
