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

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import CommGroup
from ..exchange import exchange, exchanger_id
from ..mesh import group_attribute
from ..partition import split_offsets
from ..plans import Site, carry, resolve, shard_sizes
from ._mesh2d import mesh_of, resolve_2d, set_mesh
from .pool import check_output_rows

__all__ = ["PADDING_MODULES", "HaloPad2d", "halo_pad", "pad_like"]

#: torch's 2-d padding modules and the boundary that fills their H rows beyond the domain.
PADDING_MODULES: dict[type, str] = {nn.ZeroPad2d: "zeros", nn.ConstantPad2d: "zeros", nn.ReflectionPad2d: "reflect",
                                    nn.ReplicationPad2d: "replicate"}
if hasattr(nn, "CircularPad2d"):
    PADDING_MODULES[nn.CircularPad2d] = "circular"

_W_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


class PadPlan(NamedTuple):
    """A padding call as planned for this rank: the exchange of its output rows (``plain``: one rank); ``lead``
    and ``trail``: how many of them lie above / below the input (padding rows)."""

    plain: bool
    ex: int = -1
    rows: int = 0
    lead: int = 0
    trail: int = 0


def pad_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int, top: int, bottom: int, boundary: str,
              op: str) -> PadPlan:
    (sizes,) = extents
    if cg.size == 1:
        return PadPlan(True)
    n = sum(sizes)
    m = n + top + bottom
    check_output_rows(op, m, n, cg.size, f", padding (top {top}, bottom {bottom})")
    offs = split_offsets(m, cg.size)
    needs = tuple((offs[r] - top, offs[r + 1] - top) for r in range(cg.size))
    lo, hi = needs[cg.index]
    rows = hi - lo
    lead = min(rows, max(0, -lo))
    trail = min(rows - lead, max(0, hi - n))
    return PadPlan(False, exchanger_id(cg, dim, sizes, needs, boundary, op), rows, lead, trail)


class HaloPad2d(nn.Module):
    """A torch 2-d padding module on an H-shard (module docstring); ``HaloPad2d(nn.ReflectionPad2d(2))``."""

    group = group_attribute()

    def __init__(self, pad: nn.Module, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__()
        kind = type(pad)
        if kind not in PADDING_MODULES:
            raise TypeError(f"HaloPad2d wraps one of {', '.join(k.__name__ for k in PADDING_MODULES)}, got "
                            f"{kind.__name__}")
        self.value = float(getattr(pad, "value", 0.0))
        self.padding = tuple(int(p) for p in pad.padding)
        self.boundary = PADDING_MODULES[kind]
        self.kind = kind.__name__
        self.group = group
        self._halo_site = Site()
        set_mesh(self, mesh, "HaloPad2d")

    def extra_repr(self) -> str:
        value = f", value={self.value}" if self.value else ""
        return f"{self.kind}, padding={self.padding}{value}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = mesh_of(self)
        if mesh is not None:
            return _pad_2d(x, self.padding, self.boundary, self.value, mesh, self._halo_site, f"HaloPad2d({self.kind})")
        return halo_pad(x, self.padding, self.boundary, self.value, group=self.group, site=self._halo_site,
                        op=f"HaloPad2d({self.kind})")


def halo_pad(x: torch.Tensor, padding: tuple[int, int, int, int], boundary: str = "zeros", value: float = 0.0, *,
             group: Any | None = None, site: Site | None = None, op: str = "halo_pad") -> torch.Tensor:
    """``F.pad(x, padding)`` of the global field on its H-shard (module docstring): ``padding`` is ``(left, right,
    top, bottom)`` in global rows; ``boundary`` ``"zeros"`` (with ``value``), ``"reflect"``, ``"replicate"`` or
    ``"circular"``. The output is the balanced split of the padded field."""
    left, right, top, bottom = (int(p) for p in padding)
    plan = resolve(x, group, op, pad_plan, (x.dim() - 2, top, bottom, boundary, op), site=site)
    if x.dim() not in (3, 4):  # after the agreement (the number of dims is agreed): on every rank alike
        raise ValueError(f"{op}: expected a (B, C, H, W) or (C, H, W) shard, got shape {tuple(x.shape)}")
    if plan.plain:
        if boundary == "zeros":
            return F.pad(x, (left, right, top, bottom), value=value)
        return F.pad(x, (left, right, top, bottom), mode=_W_MODE[boundary])
    out = exchange(x, plan.ex, plan.rows, x.dim() - 2)
    if boundary == "zeros" and value != 0:  # the padding rows take the value, as W's columns do
        inner = out.narrow(-2, plan.lead, plan.rows - plan.lead - plan.trail)
        out = F.pad(inner, (left, right, plan.lead, plan.trail), value=value)
    elif left or right:  # W is not sharded: pad it as the module does
        out = F.pad(out, (left, right, 0, 0), mode=_W_MODE[boundary])
    carry(out, x)
    return out


def _pad_plan_2d(cg: CommGroup, extents: tuple[tuple[int, ...], ...], groups: tuple, pads: tuple[int, int, int, int],
                 boundary: str, op: str) -> tuple[PadPlan, PadPlan]:
    from ..comm import comm_group

    left, right, top, bottom = pads
    return (pad_plan(comm_group(groups[0]), (extents[0],), 2, top, bottom, boundary, f"{op} (H)"),
            pad_plan(comm_group(groups[1]), (extents[1],), 3, left, right, boundary, f"{op} (W)"))


def _pad_2d(x: torch.Tensor, padding: tuple[int, int, int, int], boundary: str, value: float, mesh: Any,
            site: Site | None, op: str) -> torch.Tensor:
    """A padding module on a block of a latitude x longitude mesh: H over the H ranks, then W over the W ranks (each
    the one-axis plan: the output is the padded field's balanced split along both); a constant's value as torch."""
    left, right, top, bottom = (int(p) for p in padding)
    plans = resolve_2d(x, mesh, op, _pad_plan_2d, ((left, right, top, bottom), boundary, op), site)
    if x.dim() != 4:  # after the agreement (the number of dims is agreed): on every rank alike
        raise ValueError(f"{op}: expected a (B, C, H, W) block, got shape {tuple(x.shape)}")
    out, lead, trail = x, [0, 0], [0, 0]
    for k, (plan, (a, b)) in enumerate(zip(plans, ((top, bottom), (left, right)), strict=True)):
        d = 2 + k
        if plan.plain:  # one rank along this axis: torch's pad of it (zeros here, the value below)
            flat = (0, 0, a, b) if d == 2 else (a, b, 0, 0)
            out = F.pad(out, flat, mode=_W_MODE[boundary]) if boundary != "zeros" else F.pad(out, flat)
            lead[k], trail[k] = max(a, 0), max(b, 0)
        else:
            out = exchange(out, plan.ex, plan.rows, d)
            lead[k], trail[k] = plan.lead, plan.trail
    if boundary == "zeros" and value != 0:  # the padding rows and columns take the value
        inner = out[..., lead[0]:out.shape[-2] - trail[0], lead[1]:out.shape[-1] - trail[1]]
        out = F.pad(inner, (lead[1], trail[1], lead[0], trail[0]), value=value)
    carry(out, x)
    return out


def pad_like(x: torch.Tensor, ref: torch.Tensor, *, group: Any | None = None) -> torch.Tensor:
    """Zero-pad (or crop) ``x`` to ``ref``'s global H and W, centred as a U-Net's skip connection does it
    (Pytorch-UNet's ``Up``: ``F.pad(x1, [dX // 2, dX - dX // 2, dY // 2, dY - dY // 2])``), with ``dY`` and ``dX``
    the differences of the *global* sizes. On one rank it is that ``F.pad``; on shards, exactly its split."""
    h_x = sum(shard_sizes(x, -2, group, op="pad_like"))
    h_ref = sum(shard_sizes(ref, -2, group, op="pad_like"))
    dy, dx = h_ref - h_x, int(ref.shape[-1]) - int(x.shape[-1])
    return halo_pad(x, (dx // 2, dx - dx // 2, dy // 2, dy - dy // 2), group=group, op="pad_like")
