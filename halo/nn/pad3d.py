"""3-d padding modules on an H-shard of a ``(B, C, D, H, W)`` field: the output is the balanced split of the padded
global field.

``nn.ZeroPad3d``, ``nn.ConstantPad3d`` (any value), ``nn.ReflectionPad3d``, ``nn.ReplicationPad3d`` and
``nn.CircularPad3d`` pad ``(left, right, top, bottom, front, back)``: W, H and D (levels: a field of pressure levels
x latitude x longitude). Along D (never sharded) and W (unless a latitude x longitude mesh shards it) each rank pads
as the module does. Along H the padded field has ``N + top + bottom`` rows; rank ``r`` holds rows ``[o0, o1)`` of
its balanced split, which are the input's virtual rows ``[o0 - top, o1 - top)`` (:func:`halo.plan.geometry.pad_needs`,
the row arithmetic every padding shares): one planned exchange whose boundary is the padding mode fetches exactly
those, whichever ranks own them. The three modes that copy values pad each dim independently (out ``[d, h, w]`` is in
``[f(d), g(h), k(w)]``), so padding H by the exchange and D and W locally is the 3-d pad; a constant fills every
padded position with its value, in any order. Forward is a copy of values, bitwise the padded field's; backward is
the exchange's exact adjoint (rows copied several times get their gradients summed). A negative padding crops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import cast_as_torch
from ..dist.comm import CommGroup
from .base import DomainLayer
from .pad import PadPlan, pad_plan
from .registry import converts

__all__ = ["PADDING_3D", "DomainPad3d"]

#: torch's 3-d padding modules and the boundary that fills their H rows beyond the domain.
PADDING_3D: dict[type, str] = {nn.ZeroPad3d: "zeros", nn.ConstantPad3d: "zeros", nn.ReflectionPad3d: "reflect",
                               nn.ReplicationPad3d: "replicate", nn.CircularPad3d: "circular"}

_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _axis(cg: CommGroup, sizes: tuple[int, ...], dim: int, before: int, after: int, boundary: str,
          op: str) -> PadPlan:
    """One sharded axis (H; W on a mesh): the padding's rows of this rank by one exchange (:func:`pad_plan`)."""
    return pad_plan(cg, (sizes,), dim, before, after, boundary, op)


def _example(kind: type) -> tuple[nn.Module, tuple[int, ...]]:
    """The modes matrix's case: every side padded differently, a field of 3 levels x 23 rows x 7 columns."""
    padding = (1, 2, 2, 1, 1, 0)
    return (kind(padding, 0.5) if kind is nn.ConstantPad3d else kind(padding)), (2, 3, 3, 23, 7)


@converts(*PADDING_3D, axes=2, example=_example)
class DomainPad3d(DomainLayer, nn.Module):
    """A torch 3-d padding module on an H-shard (module docstring); ``DomainPad3d(nn.ReflectionPad3d(1))``."""

    def __init__(self, pad: nn.Module, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__()
        kind = type(pad)
        if kind not in PADDING_3D:
            raise TypeError(f"DomainPad3d wraps one of {', '.join(k.__name__ for k in PADDING_3D)}, "
                            f"got {kind.__name__}")
        self.value = float(getattr(pad, "value", 0.0))
        self.padding = tuple(int(p) for p in pad.padding)
        self.boundary = PADDING_3D[kind]
        self.kind = kind.__name__
        self.halo_init(group, mesh, "DomainPad3d")

    def extra_repr(self) -> str:
        value = f", value={self.value}" if self.value else ""
        return f"{self.kind}, padding={self.padding}{value}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = f"DomainPad3d({self.kind})"
        left, right, top, bottom, front, back = self.padding
        x = cast_as_torch("pad", x)  # torch's dtype under autocast (halo.autocast)
        plans = self.axis_plans(x, op, _axis, (self.boundary, op), per_axis=((top, bottom), (left, right)))
        if x.dim() not in (4, 5):  # after the agreement (the number of dims is agreed): every rank raises alike
            raise ValueError(f"{op}: expected a (B, C, D, H, W) or (C, D, H, W) shard, got shape {tuple(x.shape)}")
        out = self.exchange_axes(x, plans)
        exchanged = {p.dim - x.dim(): p for p in plans if not p.plain}  # -2 (H), and -1 (W) on a mesh
        constant = self.boundary == "zeros"
        pads = []  # F.pad's amounts, last dim first: (W), (H), (D)
        for d, (a, b) in ((-1, (left, right)), (-2, (top, bottom)), (-3, (front, back))):
            plan = exchanged.get(d)
            if plan is None:  # not sharded along d: padded here as the module pads it
                pads += [a, b]
            elif constant and self.value != 0 and (plan.lead or plan.trail):  # exchanged zeros: the value instead
                out = out.narrow(d, plan.lead, out.shape[d] - plan.lead - plan.trail)
                pads += [plan.lead, plan.trail]
            else:  # the exchange brought the boundary's rows (or zeros) already
                pads += [0, 0]
        if any(pads):
            out = F.pad(out, pads, value=self.value) if constant else F.pad(out, pads, mode=_MODE[self.boundary])
        return self.finish(out, x)


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloPad3d = DomainPad3d
