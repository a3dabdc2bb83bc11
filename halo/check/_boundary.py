"""The unsharded twin of a model converted with a boundary torch's layers do not have (``"pole"``, ...), in plain
torch: what :func:`halo.check.check_equivalence` compares with when ``reference=boundary_reference(model, b)``.

Split out of :mod:`halo.check`, which re-exports :func:`boundary_reference` (users call ``halo.check.
boundary_reference``; ``halo check --boundary B`` does). Plain torch on one process: no communication.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.partition import check_boundary

__all__ = ["boundary_reference"]


def boundary_reference(model: nn.Module, boundary: str) -> nn.Module:
    """The unsharded twin of ``convert_to_domain_parallel(model, boundary=boundary)``, in plain torch: a copy of
    ``model`` whose ``nn.Conv2d`` layers fill their latitude padding (dim -2) with ``boundary`` (``"pole"``: rows
    mirrored across the pole, the pole row not repeated, and rolled by half the longitudes; ``"pole_centered"``:
    the same with the edge row repeated; ``"zeros"``, ``"reflect"``, ``"replicate"``, ``"symmetric"``,
    ``"circular"``/``"periodic"`` as their names say), then pad longitude by their own ``padding_mode`` — the order
    halo's exchange uses (the pole roll is by half the unpadded longitudes). Module names and parameters are the
    model's, so :func:`check_equivalence` matches every module. Give it as ``reference=``; ``halo check --boundary
    B`` does. Transposed convs read no rows outside their input: unchanged, as the converter leaves them."""
    boundary = check_boundary(boundary)
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        if isinstance(mod, nn.Conv2d) and not isinstance(mod, nn.ConvTranspose2d):
            pads = _conv_pads(mod)
            if pads[0] == (0, 0):
                continue
            mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
            mod.padding, mod.padding_mode = (0, 0), "zeros"
            mod._reversed_padding_repeated_twice = [0, 0, 0, 0]
            mod.register_forward_pre_hook(_BoundaryPad(pads, boundary, mode))
    return ref


def _conv_pads(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[int, int]]:
    """(before, after) along H and W of ``conv``'s padding (``'same'``: torch's split, the extra row after)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0), (0, 0)
        out = []
        for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out[0], out[1]
    ph, pw = conv.padding
    return (ph, ph), (pw, pw)


class _BoundaryPad:
    """A forward pre-hook: pad H of the conv's input with the boundary, then W with the conv's own mode."""

    def __init__(self, pads: tuple, boundary: str, w_mode: str) -> None:
        self.pads, self.boundary, self.w_mode = pads, boundary, w_mode

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        (top, bottom), (left, right) = self.pads
        x = _pad_rows(args[0], top, bottom, self.boundary)
        if left or right:
            x = F.pad(x, (left, right, 0, 0), mode=self.w_mode)
        return (x, *args[1:])


def _pad_rows(x: torch.Tensor, before: int, after: int, boundary: str) -> torch.Tensor:
    if boundary in ("zeros", "reflect", "replicate", "circular"):
        mode = "constant" if boundary == "zeros" else boundary
        return F.pad(x, (0, 0, before, after), mode=mode)
    n = x.shape[-2]
    k = 1 if boundary == "pole" else 0  # "pole": the pole row is on the grid and is not repeated
    shift = x.shape[-1] // 2 if boundary.startswith("pole") else 0
    north = x.narrow(-2, k, before).flip(-2).roll(shift, -1)
    south = x.narrow(-2, n - k - after, after).flip(-2).roll(shift, -1)
    return torch.cat([north, x, south], dim=-2)
