"""Padding modules on an H-shard: the output is the balanced split of the padded global field.

``nn.ZeroPad2d``, ``nn.ConstantPad2d`` (any value), ``nn.ReflectionPad2d``, ``nn.ReplicationPad2d`` and
``nn.CircularPad2d`` pad ``(left, right, top, bottom)``. Along W (not sharded) each rank pads as the module does.
Along H the padded field has ``N + top + bottom`` rows; rank ``r`` holds rows ``[o0, o1)`` of its balanced split,
which are the input's virtual rows ``[o0 - top, o1 - top)``: one planned exchange whose boundary is the padding
mode (``zeros``, ``reflect``, ``replicate``, ``circular``) fetches exactly those, whichever ranks own them (the
shards move by ``top`` rows, so a rank's output generally holds rows of its neighbours). Forward is a copy of
rows, bitwise the padded field's; backward is the exchange's exact adjoint (rows copied several times, as
``replicate`` copies the edge, get their gradients summed in a fixed order). A negative padding crops, as in torch.
A constant pad's rows beyond the domain take its value: the rank's rows of the padded field that lie outside the
input are known from the plan, and the rank pads its inner rows with the value as torch would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import cast_as_torch
from ..dist.comm import CommGroup
from ..exchange import exchanger_id
from ..plan.geometry import check_output_rows, pad_needs
from ..plan.plans import Site, shard_sizes
from .base import AxisPlan, DomainLayer, exchange_axes, finish, run_axes
from .registry import converts, public

__all__ = ["PADDING_MODULES", "DomainPad2d", "halo_pad", "pad_like"]

#: torch's 2-d padding modules and the boundary that fills their H rows beyond the domain.
PADDING_MODULES: dict[type, str] = {nn.ZeroPad2d: "zeros", nn.ConstantPad2d: "zeros", nn.ReflectionPad2d: "reflect",
                                    nn.ReplicationPad2d: "replicate"}
if hasattr(nn, "CircularPad2d"):
    PADDING_MODULES[nn.CircularPad2d] = "circular"

_W_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


@dataclasses.dataclass(frozen=True)
class PadPlan(AxisPlan):
    """One axis of a padding call as planned for this rank: the exchange of its output rows (``plain``: one rank
    along the axis); ``lead`` and ``trail``: how many of them lie before / after the input (padding rows)."""

    lead: int = 0
    trail: int = 0


def pad_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int, top: int, bottom: int, boundary: str,
              op: str) -> PadPlan:
    (sizes,) = extents
    if cg.size == 1:
        return PadPlan(True, dim=dim)
    n = sum(sizes)
    m = n + top + bottom
    check_output_rows(op, m, n, cg.size, f", padding (top {top}, bottom {bottom})")
    needs = pad_needs(n, cg.size, top, bottom)
    lo, hi = needs[cg.index]
    rows = hi - lo
    lead = min(rows, max(0, -lo))
    trail = min(rows - lead, max(0, hi - n))
    return PadPlan(False, exchanger_id(cg, dim, sizes, needs, boundary, op), rows, dim, lead, trail)


def _pad_axis(cg: CommGroup, sizes: tuple[int, ...], dim: int, before: int, after: int, boundary: str,
              op: str) -> PadPlan:
    """One axis (H rows, or W columns on a mesh) of :func:`pad_plan` (the per-axis geometry of the base)."""
    return pad_plan(cg, (sizes,), dim, before, after, boundary, op)


def _example(kind: type) -> tuple[nn.Module, tuple[int, ...]]:
    """The modes matrix's case (``@converts(example=)``): every side padded differently, 23 x 7."""
    return (kind((1, 2, 2, 1), 0.5) if kind is nn.ConstantPad2d else kind((1, 2, 2, 1))), (2, 3, 23, 7)


@converts(*PADDING_MODULES, axes=2, example=_example)
class DomainPad2d(DomainLayer, nn.Module):
    """A torch 2-d padding module on an H-shard (module docstring); ``DomainPad2d(nn.ReflectionPad2d(2))``."""

    def __init__(self, pad: nn.Module, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__()
        kind = type(pad)
        if kind not in PADDING_MODULES:
            raise TypeError(f"DomainPad2d wraps one of {', '.join(k.__name__ for k in PADDING_MODULES)}, got "
                            f"{kind.__name__}")
        self.value = float(getattr(pad, "value", 0.0))
        self.padding = tuple(int(p) for p in pad.padding)
        self.boundary = PADDING_MODULES[kind]
        self.kind = kind.__name__
        self.halo_init(group, mesh, "DomainPad2d")

    def extra_repr(self) -> str:
        value = f", value={self.value}" if self.value else ""
        return f"{self.kind}, padding={self.padding}{value}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _pad(x, self.padding, self.boundary, self.value, self.group, self.halo_mesh, self._halo_site,
                    f"DomainPad2d({self.kind})")


@public
def halo_pad(x: torch.Tensor, padding: tuple[int, int, int, int], boundary: str = "zeros", value: float = 0.0, *,
             group: Any | None = None, site: Site | None = None, op: str = "halo_pad",
             mesh: Any | None = None) -> torch.Tensor:
    """``F.pad(x, padding)`` of the global field on its H-shard (module docstring): ``padding`` is ``(left, right,
    top, bottom)`` in global rows; ``boundary`` ``"zeros"`` (with ``value``), ``"reflect"``, ``"replicate"`` or
    ``"circular"``. The output is the balanced split of the padded field (along H and W: of a block of ``mesh``,
    a :class:`halo.DomainMesh` with two domain axes, where given)."""
    return _pad(x, padding, boundary, value, group, mesh, site, op)


def _pad(x: torch.Tensor, padding: tuple[int, int, int, int], boundary: str, value: float, group: Any | None,
         mesh: Any | None, site: Site | None, op: str) -> torch.Tensor:
    """Padding on latitude rows (``mesh`` ``None``) or on a block of a latitude x longitude mesh: each sharded axis
    is one planned exchange whose boundary is the padding mode (the output is the padded field's balanced split
    along it); an axis that is not sharded (W on latitude rows, or one rank along an axis) is padded as torch does.
    A constant's value fills the padding rows and columns in one ``F.pad`` at the end."""
    left, right, top, bottom = (int(p) for p in padding)
    x = cast_as_torch("pad", x)  # torch's dtype under autocast (halo.autocast)
    plans = run_axes(x, op, _pad_axis, (boundary, op), group=group, mesh=mesh, site=site,
                     per_axis=((top, bottom), (left, right)))
    if len(plans) > 1 and x.dim() != 4:  # a mesh block; after the agreement (the number of dims is agreed)
        raise ValueError(f"{op}: expected a (B, C, H, W) block, got shape {tuple(x.shape)}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{op}: expected a (B, C, H, W) or (C, H, W) shard, got shape {tuple(x.shape)}")
    out = exchange_axes(x, plans)
    crops, fills = [], []  # per axis (H, W): rows cropped before the value's F.pad, and the F.pad's amounts
    for k, (a, b) in enumerate(((top, bottom), (left, right))):
        plan = plans[k] if k < len(plans) else None
        if plan is not None and not plan.plain:  # exchanged: its padding rows hold zeros or the boundary's rows
            edge = (plan.lead, plan.trail) if boundary == "zeros" and value != 0 else (0, 0)
            crops.append(edge)
            fills.append(edge)
        elif boundary == "zeros":  # not sharded here: the constant's F.pad below pads it
            crops.append((0, 0))
            fills.append((a, b))
        else:  # not sharded here: pad it as the module does
            if a or b:
                out = F.pad(out, (0, 0, a, b) if k == 0 else (a, b, 0, 0), mode=_W_MODE[boundary])
            crops.append((0, 0))
            fills.append((0, 0))
    if any(crops[0] + crops[1]):
        (h0, h1), (w0, w1) = crops
        out = out[..., h0:out.shape[-2] - h1, w0:out.shape[-1] - w1]
    if any(fills[0] + fills[1]):
        out = F.pad(out, (*fills[1], *fills[0]), value=value)
    return finish(out, x)


@public
def pad_like(x: torch.Tensor, ref: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """Zero-pad (or crop) ``x`` to ``ref``'s global H and W, centred as a U-Net's skip connection does it
    (Pytorch-UNet's ``Up``: ``F.pad(x1, [dX // 2, dX - dX // 2, dY // 2, dY - dY // 2])``), with ``dY`` and ``dX``
    the differences of the *global* sizes. On one rank it is that ``F.pad``; on shards, exactly its split."""
    h_x = sum(shard_sizes(x, -2, group, op="pad_like"))
    h_ref = sum(shard_sizes(ref, -2, group, op="pad_like"))
    dy, dx = h_ref - h_x, int(ref.shape[-1]) - int(x.shape[-1])
    return halo_pad(x, (dx // 2, dx - dx // 2, dy // 2, dy - dy // 2), group=group, op="pad_like")


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloPad2d = DomainPad2d
