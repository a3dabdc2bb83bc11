"""NCAR CREDIT's domain-parallel API under CREDIT's names, signatures and conventions, computed by halo.

For a trainer written against ``credit.domain_parallel`` and ``credit.parallel.domain``: change the imports to
``from halo.compat.credit import ...`` and the same calls work, exact where CREDIT is not (uneven shards, strided /
dilated / ``same`` / circular convolutions, GroupNorm gradients, pole boundaries; CREDIT refuses uneven shards and
its converter keeps layers halo converts).

=======================================  ==============================================================================
CREDIT                                   here
=======================================  ==============================================================================
``DomainParallelManager``,               halo's manager (same groups, attributes, ``_domain_group_idx`` ...);
``initialize_domain_parallel``,          ``_MANAGER`` and ``logger`` as in CREDIT's manager module
``get_domain_parallel_manager``
``convert_to_domain_parallel(model,      halo's converter; ``custom_converters={Type: factory(module)}`` (CREDIT's one-
manager, shard_dim, custom_converters)``  argument factories); records the manager for ``get_domain_manager``
``shard_tensor``, ``gather_tensor``,     balanced splits (uneven too), autograd-aware; the rows of each split are
``shard_batch``, ``shard_spatial``,      remembered for the gradient convention below
``gather_spatial``
``shard_lat_weights(w, target_h)``       this rank's rows of global latitude weights (uneven too)
``sync_domain_gradients(model,           CREDIT's convention: each rank's loss is the *mean over its own rows*, and the
manager)``                               gradients are averaged over the domain group: exact for even shards; for
                                         uneven ones multiply the loss by ``domain_loss_scale()`` (``P n_r / N``)
``get_domain_manager``, ``get_raw_model`` through DDP / FSDP wrappers
``DomainParallelConv2d/Conv3d/           halo's layers under CREDIT's names and constructors (``halo_width`` too);
ConvTranspose2d/ConvTranspose3d/         ``HaloExchange(halo_width, dim)``; ``DomainParallelPeriodicConv2d`` (circular
GroupNorm``, ``HaloExchange``,           in longitude, reflect in latitude); helpers ``_needs_halo_conv2d`` ...
``DomainParallelPeriodicConv2d``
``credit.models.crossformer.             ``TensorPadding`` (same constructor, ``pad`` / ``unpad``): CrossFormer's
TensorPadding``                          "earth" (across the poles, rolled by W/2) and "mirror" padding of the *global*
                                         field on its H-shards; ``convert_to_domain_parallel`` swaps a model's CREDIT
                                         instances
=======================================  ==============================================================================

The convention differs from halo's own (``halo.parallel.domain_mean`` counts every row once and
``halo.parallel.sync_domain_gradients`` *sums* over the domain group): use one or the other, not both. Mixing them is
refused on every rank (it would be off by exactly the domain size): halo's sync refuses gradients of a loss that went
through no halo domain reduction (CREDIT's per-shard mean), and this module's sync refuses gradients of a halo domain
loss (``halo.parallel.marks``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import context
from ..dist.mesh import DomainParallelManager, get_domain_parallel_manager, initialize_domain_parallel
from ..nn import DomainConv2d, DomainConv3d, DomainConvTranspose2d, DomainConvTranspose3d, DomainGroupNorm
from ..nn.credit_padding import TensorPadding
from ..nn.registry import is_pointwise_conv
from ..plan.partition import split_offsets, split_sizes
from ..plan.plans import Site

__all__ = [
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm",
    "DomainParallelManager",
    "DomainParallelPeriodicConv2d",
    "HaloExchange",
    "TensorPadding",
    "convert_to_domain_parallel",
    "domain_loss_scale",
    "gather_spatial",
    "gather_tensor",
    "get_domain_manager",
    "get_domain_parallel_manager",
    "get_raw_model",
    "initialize_domain_parallel",
    "shard_batch",
    "shard_lat_weights",
    "shard_spatial",
    "shard_tensor",
    "sync_domain_gradients",
]

logger = logging.getLogger(__name__)


def _manager(manager: DomainParallelManager | None) -> DomainParallelManager | None:
    manager = manager if manager is not None else get_domain_parallel_manager()
    return manager if manager is not None and manager.domain_parallel_size > 1 else None


@dataclasses.dataclass
class _CreditState:
    """The splits this rank made (``shard_*``): all rows -> its rows, one per distinct extent (at most
    :data:`_MAX_EXTENTS`: a trainer shards a handful); with one extent, its split gives the loss's scale in CREDIT's
    convention, with several the scale needs the loss's own tensor."""

    rows: dict[int, int] = dataclasses.field(default_factory=dict)


_MAX_EXTENTS = 64


def _rows() -> dict[int, int]:
    return context.state("credit", _CreditState).rows


def _remember(local: int, total: int) -> None:
    rows = _rows()
    if total not in rows and len(rows) < _MAX_EXTENTS:
        rows[total] = local


# -- CREDIT's layer names: halo's layers, with CREDIT's constructor and ``halo_width`` -------------------------------

def _h(v: Any, index: int) -> int:
    return v if isinstance(v, int) else v[index]


def _needs_halo_conv2d(conv: nn.Module) -> bool:
    """CREDIT's rule: a Conv2d reads other rows when its kernel spans more than one along H."""
    return _h(conv.kernel_size, 0) > 1


def _needs_halo_conv3d(conv: nn.Module) -> bool:
    return _h(conv.kernel_size, 1) > 1  # (T, H, W)


def _needs_halo_conv_transpose2d(conv: nn.Module) -> bool:
    return _h(conv.kernel_size, 0) > _h(conv.stride, 0)


def _needs_halo_conv_transpose3d(conv: nn.Module) -> bool:
    return _h(conv.kernel_size, 1) > _h(conv.stride, 1)


class _CreditWidth:
    """CREDIT's ``halo_width``: the rows a shard needs from each neighbour (the padding along H; 0 for a transposed
    conv whose windows do not overlap)."""

    @property
    def halo_width(self) -> int:
        if isinstance(self, nn.modules.conv._ConvTransposeNd) and self.kernel_size[-2] <= self.stride[-2]:
            return 0
        pad = self.padding
        if isinstance(pad, str):
            return 0 if pad == "valid" else (self.dilation[-2] * (self.kernel_size[-2] - 1) + 1) // 2
        return int(pad[-2])


def _credit_layer(halo_cls: type, name: str) -> type:
    def __init__(self, module: nn.Module, shard_dim: int = -2, *, group: Any | None = None) -> None:
        if shard_dim not in (-2, 3):  # CREDIT passes 3 for H of (B, C, T, H, W)
            raise ValueError(f"{name}: halo shards H (dim -2), got shard_dim={shard_dim}")
        halo_cls.__init__(self, module, group=group)

    return type(name, (_CreditWidth, halo_cls), {"__init__": __init__, "__doc__": f"CREDIT's ``{name}``: "
                                                 f"halo's ``{halo_cls.__name__}`` (exact on any split)."})


DomainParallelConv2d = _credit_layer(DomainConv2d, "DomainParallelConv2d")
DomainParallelConv3d = _credit_layer(DomainConv3d, "DomainParallelConv3d")
DomainParallelConvTranspose2d = _credit_layer(DomainConvTranspose2d, "DomainParallelConvTranspose2d")
DomainParallelConvTranspose3d = _credit_layer(DomainConvTranspose3d, "DomainParallelConvTranspose3d")


class DomainParallelGroupNorm(DomainGroupNorm):
    """CREDIT's ``DomainParallelGroupNorm``: halo's ``DomainGroupNorm`` (exact gradients on any split)."""

    def __init__(self, module: nn.GroupNorm, *, group: Any | None = None) -> None:
        DomainGroupNorm.__init__(self, module, group=group)


class HaloExchange(nn.Module):
    """CREDIT's ``HaloExchange(halo_width, dim=-2)``: the shard with ``halo_width`` rows of each neighbour (zeros
    beyond the domain), differentiable — :func:`halo.halo_exchange`."""

    def __init__(self, halo_width: int, dim: int = -2) -> None:
        super().__init__()
        self.halo_width, self.dim = int(halo_width), dim
        self._halo_site = Site()  # a halo layer: the converter leaves it as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..exchange import halo_exchange

        if self.halo_width == 0:
            return x
        return halo_exchange(x, self.halo_width, self.dim, boundary="zeros")


class DomainParallelPeriodicConv2d(nn.Module):
    """CREDIT's ``DomainParallelPeriodicConv2d`` for its ``PeriodicConv2d`` (circular padding in longitude, reflect
    in latitude, then an unpadded conv): the rows come from the neighbours, reflected at the domain's edges.
    ``conv`` is the wrapped module's own conv (state-dict keys unchanged)."""

    def __init__(self, module: nn.Module, shard_dim: int = -2) -> None:
        super().__init__()
        self.conv = module.conv
        self.padding = int(module.padding)
        self.halo_exchange = HaloExchange(self.padding, shard_dim)
        self._halo_site = Site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from ..exchange import halo_exchange

        p = self.padding
        x = F.pad(x, (p, p, 0, 0), mode="circular")
        return self.conv(halo_exchange(x, p, -2, boundary="reflect") if p else x)


def __getattr__(name: str) -> Any:
    if name == "_MANAGER":  # CREDIT's name for the module's manager: the current one, never a copy
        return get_domain_parallel_manager()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def convert_to_domain_parallel(model: nn.Module, manager: DomainParallelManager | None = None, shard_dim: int = -2,
                               custom_converters: dict[type, Callable[[nn.Module], nn.Module]] | None = None,
                               **kwargs: Any) -> nn.Module:
    """CREDIT's signature on halo's converter: ``custom_converters`` map a type to ``factory(module)``; the layers
    it converts are CREDIT's names (``DomainParallelConv2d`` ...: halo's layers)."""
    from ..nn import convert_to_domain_parallel as convert

    manager = manager if manager is not None else get_domain_parallel_manager()
    if shard_dim != -2:
        raise ValueError(f"convert_to_domain_parallel: halo's layers shard latitude (shard_dim=-2), got {shard_dim}")
    layers = {cls.__name__: cls for cls in (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                                            DomainParallelConvTranspose3d, DomainParallelGroupNorm)}

    def conv_like(name):
        return lambda m, ctx: m if is_pointwise_conv(m) and "Transpose" not in name else layers[name](
            m, group=ctx.group)

    custom: dict[type, Any] = {
        nn.Conv2d: conv_like("DomainParallelConv2d"), nn.Conv3d: conv_like("DomainParallelConv3d"),
        nn.ConvTranspose2d: conv_like("DomainParallelConvTranspose2d"),
        nn.ConvTranspose3d: conv_like("DomainParallelConvTranspose3d"),
        nn.GroupNorm: lambda m, ctx: layers["DomainParallelGroupNorm"](m, group=ctx.group),
    }
    custom.update({kind: (None if fn is None else (lambda m, ctx, fn=fn: fn(m))) for kind, fn in
                   (custom_converters or {}).items()})
    convert(model, manager, custom_converters=custom, **kwargs)
    model._domain_parallel_manager = manager
    return model


def shard_tensor(x: torch.Tensor, dim: int = -2, manager: DomainParallelManager | None = None) -> torch.Tensor:
    """This rank's rows of ``x`` (the balanced split: uneven sizes are fine)."""
    from ..shard import shard

    manager = _manager(manager)
    if manager is None:
        return x
    n = x.shape[dim]
    _remember(split_sizes(n, manager.domain_parallel_size)[manager.domain_rank], n)
    return shard(x, dim=dim, group=manager.domain_group)


def gather_tensor(x: torch.Tensor, dim: int = -2, manager: DomainParallelManager | None = None) -> torch.Tensor:
    """The whole tensor from every rank's rows (any split)."""
    from ..shard import gather

    manager = _manager(manager)
    return x if manager is None else gather(x, dim=dim, group=manager.domain_group)


def shard_batch(batch: dict, spatial_dims_5d: int = -2, spatial_dims_4d: int = -2,
                manager: DomainParallelManager | None = None) -> dict:
    """Every 4-d and 5-d tensor of a batch dict sharded along its spatial dim; the rest unchanged."""
    if _manager(manager) is None:
        return batch
    out = {}
    for key, val in batch.items():
        if isinstance(val, torch.Tensor) and val.dim() in (4, 5):
            out[key] = shard_tensor(val, dim=spatial_dims_5d if val.dim() == 5 else spatial_dims_4d, manager=manager)
        else:
            out[key] = val
    return out


def shard_spatial(tensor: torch.Tensor, manager: DomainParallelManager | None) -> torch.Tensor:
    """CREDIT's trainer helper: this rank's rows along dim -2 (uneven too: CREDIT refuses them)."""
    return tensor if manager is None else shard_tensor(tensor, dim=-2, manager=manager)


def gather_spatial(tensor: torch.Tensor, manager: DomainParallelManager | None) -> torch.Tensor:
    """Inverse of :func:`shard_spatial` (the whole field on every domain rank)."""
    return tensor if manager is None else gather_tensor(tensor, dim=-2, manager=manager)


def shard_lat_weights(weights: torch.Tensor, target_h: int) -> torch.Tensor:
    """``weights`` (global latitude weights) narrowed to this rank's rows when ``target_h`` is a shard's height."""
    weights_h = weights.shape[-2]
    if weights_h == target_h:
        return weights
    manager = _manager(None)
    if manager is None:
        raise ValueError(f"Latitude weights height ({weights_h}) does not match target height ({target_h}).")
    offs = split_offsets(weights_h, manager.domain_parallel_size)
    r = manager.domain_rank
    if offs[r + 1] - offs[r] != target_h:
        raise ValueError(f"Latitude weights shard height ({offs[r + 1] - offs[r]} of {weights_h} rows on domain rank "
                         f"{r}) does not match target height ({target_h}).")
    return weights.narrow(-2, offs[r], target_h).contiguous()


def get_domain_manager(model: nn.Module) -> DomainParallelManager | None:
    """The manager recorded by :func:`convert_to_domain_parallel`, through ``.module`` wrappers (DDP, FSDP1)."""
    m: Any = model
    while m is not None:
        if hasattr(m, "_domain_parallel_manager"):
            return m._domain_parallel_manager
        m = getattr(m, "module", None)
    return None


def get_raw_model(model: nn.Module) -> nn.Module:
    m = model
    while hasattr(m, "module"):
        m = m.module
    return m


def domain_loss_scale(manager: DomainParallelManager | None = None, like: torch.Tensor | None = None,
                      dim: int = -2) -> float:
    """What makes CREDIT's convention exact on uneven shards: multiply each rank's mean-over-its-rows loss by this,
    ``P * n_r / N`` for the split of the tensor the loss is over; 1.0 for even shards or one rank.

    ``like``: that tensor (the prediction or the target shard), whose rows along ``dim`` give ``n_r`` and whose
    global extent ``N`` is agreed across the domain group (recorded once per shape: no message in a steady step).
    Without it, the split of the fields sharded with ``shard_*``, when they all had the same extent; after fields of
    several extents (a static field, latitude weights of another height) it is ambiguous which one the loss is over
    (the scale differs between them), and every rank raises the same ``ValueError`` naming the extents.
    """
    manager = _manager(manager)
    if manager is None:
        return 1.0
    if like is not None:
        from ..plan.plans import shard_sizes

        sizes = shard_sizes(like, dim, manager.domain_group, op="domain_loss_scale")
        return manager.domain_parallel_size * sizes[manager.domain_rank] / sum(sizes)
    rows = _rows()
    if not rows:
        return 1.0
    if len(rows) > 1:
        raise ValueError(
            f"domain_loss_scale: fields of {len(rows)} different extents were sharded "
            f"({', '.join(f'{t} rows' for t in sorted(rows))}), so which split the loss is over is ambiguous (the "
            f"scale P * n_r / N differs between them); pass the tensor the loss is over: "
            f"domain_loss_scale(manager, like=prediction)")
    ((total, local),) = rows.items()
    return manager.domain_parallel_size * local / total


def sync_domain_gradients(model: nn.Module | Iterable[torch.Tensor], manager: DomainParallelManager | None) -> None:
    """CREDIT's convention (module docstring): average the gradients over the domain group, each rank's loss being
    the mean over its own rows (times :func:`domain_loss_scale` on uneven shards). DTensor gradients (FSDP2 on the
    dp mesh) are averaged as their local shards."""
    from ..parallel.reduce import local_grad
    from ..parallel.reduce import sync_domain_gradients as domain_sum

    manager = _manager(manager)
    if manager is None:
        return
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    # halo's bucketed sum (the same gradients everywhere); CREDIT's convention: gradients of a halo domain loss
    # (counted once, summed) are refused here, as halo's own sync refuses CREDIT's per-shard losses
    domain_sum(params, domain_group=manager.domain_group, _convention="credit")
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local_grad(p.grad).div_(manager.domain_parallel_size)
