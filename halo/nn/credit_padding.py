"""NCAR CREDIT CrossFormer's two steps that are not layers, on H-shards: its padding object and its final resize.

CREDIT's CrossFormer (``credit.models.crossformer``; ``credit.models.wxformer.crossformer`` since miles-credit 2026.2)
pads the *global* field with a plain object, ``TensorPadding`` (``pad`` / ``unpad``: across the poles or mirrored in
latitude, circular in longitude), and ends with ``F.interpolate`` to the image size. Neither is a module, so the
converter's walk over modules cannot replace them: :func:`swap_tensor_padding` (called by
``convert_to_domain_parallel`` on a latitude split) puts :class:`TensorPadding` in the padding object's place and runs
the resize as :func:`halo.nn.halo_interpolate` in a forward hook; :func:`unswap_tensor_padding` (called by
``revert_domain_parallel``) undoes both. halo's support of CREDIT's *models* sits with the layers (its CrossFormer
attention in ``halo.nn.longrange``, its Swin in ``halo.nn.swinv2``); CREDIT's *API* (``halo.compat.credit``) sits
above and re-exports :class:`TensorPadding` (``halo.nn.convert`` does too, where it lived before).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..dist.mesh import GroupRef, group_attribute
from ..exchange import exchange
from ..plan.plans import Site, carry, resolve
from .pad import pad_plan
from .upsample import halo_interpolate

__all__ = ["CROSSFORMER_MODULES", "TensorPadding", "is_crossformer", "swap_tensor_padding", "unswap_tensor_padding"]


class TensorPadding:
    """CREDIT's ``TensorPadding`` (``credit.models.crossformer``; a plain object with ``pad`` / ``unpad``) on H-shards.

    ``pad`` pads the *global* field ``(..., lat, lon)`` by ``pad_lat`` rows (``"earth"``: across the poles, rows
    0, 1, ... mirrored and rolled by half the longitudes, as CREDIT's flip of its rolled field; ``"mirror"``:
    reflected) and ``pad_lon`` columns (circular; W is whole on each rank); the result is the balanced split of the
    padded field, so the layers after it see the same rows as on one device. ``unpad`` crops back, re-split. Both
    are exact and differentiable (halo exchanges); with one rank (or no torch.distributed) they are CREDIT's code.
    """

    group = group_attribute()  # (a GroupRef: the model pickles and deep-copies with the padding in it)

    def __init__(self, mode: str = "earth", pad_lat: Any = (40, 40), pad_lon: Any = (40, 40), *,
                 group: Any | None = None, **kwargs: Any) -> None:
        if mode not in ("earth", "mirror"):
            raise ValueError(f"TensorPadding: mode must be 'earth' or 'mirror', got {mode!r}")
        self.mode, self.pad_NS, self.pad_WE, self.group = mode, tuple(pad_lat), tuple(pad_lon), group
        self._sites = (Site(), Site())

    def _rows(self, x: torch.Tensor, top: int, bottom: int, boundary: str, site: Site, op: str) -> torch.Tensor:
        plan = resolve(x, self.group, op, pad_plan, (x.dim() - 2, top, bottom, boundary, op), site=site)
        if plan.plain:
            return self._local_rows(x, top, bottom)
        out = exchange(x, plan.ex, plan.rows, x.dim() - 2)
        carry(out, x)
        return out

    def _local_rows(self, x: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        """One rank: CREDIT's own arithmetic (and its crop for negative amounts)."""
        if top < 0 or bottom < 0:
            return x[..., -top:x.shape[-2] + bottom, :]
        if self.mode == "mirror":
            return torch.nn.functional.pad(x, (0, 0, top, bottom, 0, 0)[:2 * (x.dim() - 2)], mode="reflect")
        xroll = torch.roll(x, shifts=int(x.shape[-1] // 2), dims=-1)
        return torch.cat([torch.flip(xroll[..., :top, :], (-2,)), x,
                          torch.flip(xroll[..., x.shape[-2] - bottom:, :], (-2,))], dim=-2)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self.pad_NS
        left, right = self.pad_WE
        op = f"TensorPadding.pad ({self.mode})"
        if self.mode == "mirror" and (left > 0 or right > 0):  # CREDIT's order: longitude first
            x = torch.nn.functional.pad(x, (left, right, 0, 0, 0, 0)[:2 * (x.dim() - 2)], mode="circular")
        if top > 0 or bottom > 0:
            x = self._rows(x, top, bottom, "pole_centered" if self.mode == "earth" else "reflect", self._sites[0], op)
        if self.mode == "earth" and (left > 0 or right > 0):
            x = torch.nn.functional.pad(x, (left, right, 0, 0, 0, 0)[:2 * (x.dim() - 2)], mode="circular")
        return x

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self.pad_NS
        left, right = self.pad_WE
        if top > 0 or bottom > 0:
            x = self._rows(x, -top, -bottom, "zeros", self._sites[1], f"TensorPadding.unpad ({self.mode})")
        if left > 0 or right > 0:
            x = x[..., :, left:x.shape[-1] - right]
        return x


#: Where NCAR CREDIT defines its CrossFormer (miles-credit 2026.2 moved it under credit.models.wxformer).
CROSSFORMER_MODULES = ("credit.models.crossformer", "credit.models.wxformer.crossformer")


def is_crossformer(module: nn.Module) -> bool:
    """``module`` is CREDIT's CrossFormer model (or a subclass), by where its class is defined and what it holds."""
    kind = type(module)
    return any(k.__module__.startswith(CROSSFORMER_MODULES) and k.__name__ == "CrossFormer"
               for k in kind.__mro__) and all(hasattr(module, a) for a in (
                   "use_interp", "image_height", "image_width", "use_post_block"))


def _interp_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """CrossFormer's last step, ``F.interpolate(x, size=(image_height, image_width), mode="bilinear")`` of its
    ``(B, C, H, W)`` result before the ``unsqueeze(2)``, as :func:`halo.nn.halo_interpolate` on the shards."""
    site = module.__dict__["_halo_interp_site"]
    y = halo_interpolate(output.squeeze(2), size=(module.image_height, module.image_width), mode="bilinear",
                         group=module.__dict__["_halo_interp_group"].group, site=site)
    return y.unsqueeze(2)


def swap_tensor_padding(model: nn.Module, group: Any | None) -> None:
    """Make CREDIT's objects in ``model`` domain-parallel (the converter calls this; ``revert_domain_parallel``
    undoes it): ``TensorPadding`` objects held by its modules become :class:`TensorPadding`, and a CrossFormer's final
    ``F.interpolate`` to the image size (``interp=True``, no post block) runs as ``halo_interpolate`` in a forward hook
    (its ``use_interp`` is set to False meanwhile: CREDIT's own call would resize each shard to the whole image)."""
    for module in model.modules():
        if is_crossformer(module) and module.use_interp and not module.use_post_block \
                and "_halo_interp" not in module.__dict__:
            module.__dict__["_halo_interp_site"] = Site()
            module.__dict__["_halo_interp_group"] = GroupRef(group)  # (pickles as the default group, as layers')
            module.__dict__["_halo_interp"] = module.register_forward_hook(_interp_hook)
            module.use_interp = False
        for name, value in list(vars(module).items()):
            kind = type(value)
            if kind.__name__ == "TensorPadding" and kind.__module__.startswith("credit.") \
                    and hasattr(value, "pad_NS") and hasattr(value, "pad_WE"):
                twin = TensorPadding(value.mode, value.pad_NS, value.pad_WE, group=group)
                twin._halo_original = value
                module.__dict__[name] = twin


def unswap_tensor_padding(model: nn.Module) -> None:
    """Undo :func:`swap_tensor_padding` (``revert_domain_parallel`` calls this)."""
    for module in model.modules():
        handle = module.__dict__.pop("_halo_interp", None)
        if handle is not None:
            handle.remove()
            module.use_interp = True
            module.__dict__.pop("_halo_interp_site", None)
            module.__dict__.pop("_halo_interp_group", None)
        for name, value in list(vars(module).items()):
            if isinstance(value, TensorPadding) and hasattr(value, "_halo_original"):
                module.__dict__[name] = value._halo_original
