"""One call that sets up domain x data parallelism: ``halo.parallelize(model, manager, data_parallel=...)``.

It converts the model for the domain group and wraps it for data parallelism, choosing the mesh and the gradient
scaling so that after ``loss.backward()`` and ``halo.parallel.sync_domain_gradients(model)`` every rank holds the
gradient of the mean loss over the global batch (each rank's loss being its rows' share, as
``halo.parallel.domain_mean`` makes it):

==============  ==================================================================  ==============================
``data_parallel``  wrapping                                                          ``sync_domain_gradients(model)``
==============  ==================================================================  ==============================
``"none"``      converted only                                                      domain sum, then dp mean
``"ddp"``       ``DistributedDataParallel`` over the dp group (its mean)            domain sum
``"fsdp"``      FSDP2 ``fully_shard`` on ``device_mesh["dp"]`` (its mean)           domain sum of the local shards
``"hsdp"``      FSDP2 on a (replicate, shard) mesh of the dp ranks                  domain sum of the local shards
``"fsdp-all"``  FSDP2 over every rank (dp x domain flattened), the gradient         nothing (FSDP's reduce-scatter
                divide factor set to the dp size (gloo: FSDP's mean x the domain    is already sum x mean)
                size, in ``sync_domain_gradients``: gloo has no PREMUL_SUM)
==============  ==================================================================  ==============================

Before wrapping, :func:`halo.plan.replicated.check_replicated` checks that every rank of each domain group holds the
same parameters and buffers (one small all-gather; an error on every rank naming the first tensor that differs).

``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` (bf16 parameters, fp32 reductions) for the FSDP modes. Wrap
sub-modules yourself first (``fully_shard(block, mesh=...)`` on the mesh :func:`data_parallel_mesh` returns) for
per-block sharding; this call shards the root.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..dist.mesh import DomainMesh, DomainParallelManager, get_domain_parallel_manager
from ..plan.replicated import check_replicated

__all__ = ["DATA_PARALLEL", "data_parallel_mesh", "parallelize"]

DATA_PARALLEL = ("none", "ddp", "fsdp", "hsdp", "fsdp-all")


def _domain_mesh(target: DomainParallelManager | DomainMesh | None, op: str) -> DomainMesh:
    """The :class:`DomainMesh` behind a manager (its facade) or a mesh; ``None``: the initialised manager's."""
    if target is None:
        target = get_domain_parallel_manager()
        if target is None:
            raise RuntimeError(f"{op} needs a manager or a mesh: call halo.initialize_domain_parallel first")
    if isinstance(target, DomainParallelManager):
        return target.mesh
    if isinstance(target, DomainMesh):
        return target
    raise TypeError(f"{op}: takes a halo.DomainParallelManager or a halo.DomainMesh (its dp axis is the data-parallel "
                    f"group), got {type(target).__module__}.{type(target).__qualname__}")


def data_parallel_mesh(manager: DomainParallelManager | DomainMesh, data_parallel: str,
                       hsdp_shards: int | None = None) -> Any:
    """The ``DeviceMesh`` FSDP2 shards over in mode ``data_parallel`` (module docstring); ``manager``: a manager or
    a :class:`halo.DomainMesh`."""
    from torch.distributed.device_mesh import DeviceMesh

    dm = _domain_mesh(manager, "data_parallel_mesh")
    mesh = dm.device_mesh
    if data_parallel == "fsdp":
        return mesh["dp"]
    device = mesh.device_type
    layout = torch.as_tensor(dm.layout).reshape(dm.dp_size, dm.domain_size)
    if data_parallel == "fsdp-all":
        return DeviceMesh(device, layout.reshape(-1), mesh_dim_names=("dp_domain",))
    if data_parallel == "hsdp":
        shards = hsdp_shards or dm.dp_size
        if dm.dp_size % shards:
            raise ValueError(f"hsdp: hsdp_shards={shards} must divide the data-parallel size {dm.dp_size}")
        full = layout.reshape(dm.dp_size // shards, shards, dm.domain_size)
        return DeviceMesh(device, full, mesh_dim_names=("replicate", "shard", "domain"))["replicate", "shard"]
    raise ValueError(f"no FSDP mesh for data_parallel={data_parallel!r}")


def parallelize(model: nn.Module, manager: DomainParallelManager | DomainMesh | None = None, *,
                data_parallel: str = "fsdp", mp_policy: Any | None = None, hsdp_shards: int | None = None,
                mesh: DomainMesh | None = None, **convert_kwargs: Any) -> nn.Module:
    """Convert ``model`` for the domain group and wrap it for data parallelism (module docstring); returns the
    model to train (the DDP wrapper, or the FSDP2-sharded model itself). ``convert_kwargs`` go to
    ``convert_to_domain_parallel`` (``boundary=``, ``grid=``, ``custom_converters=``). ``manager``: a manager or a
    ``DomainMesh`` (one axis: latitude rows; two: latitude x longitude; its dp axis is the data-parallel group);
    ``mesh=``: the old keyword for a mesh in its place."""
    from ..nn import convert_to_domain_parallel

    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"parallelize: data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if mesh is not None:
        if manager is not None:
            raise ValueError("parallelize: pass a manager or a mesh once (in the second position), not both")
        manager = mesh
    dm = _domain_mesh(manager, "parallelize")
    if mp_policy is not None and not data_parallel.endswith("sdp") and data_parallel != "fsdp-all":
        raise ValueError(f"parallelize: mp_policy applies to the FSDP modes, not {data_parallel!r}")
    convert_to_domain_parallel(model, manager if manager is not None else dm, **convert_kwargs)
    # Every rank of a domain group must start from the same weights (a model built after torch.manual_seed(rank)
    # would train silently wrong): the same error on every rank, naming the first differing tensor.
    check_replicated(model, dm.domain_group, op="parallelize")
    wrapped: nn.Module = model
    if data_parallel == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=dm.dp_group)
    elif data_parallel != "none":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = data_parallel_mesh(dm, data_parallel, hsdp_shards)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
        if data_parallel == "fsdp-all":  # reduce-scatter sums over all ranks: divide by dp only (sum over domain)
            import torch.distributed as dist

            if "gloo" in str(dist.get_backend()).lower():
                # gloo has no PREMUL_SUM (what a divide factor uses for float32): FSDP divides by every rank, and
                # sync_domain_gradients multiplies by the domain size
                model.__dict__["_halo_grad_scale"] = float(dm.domain_size)
            else:
                model.set_gradient_divide_factor(float(dm.dp_size))
    for m in {id(model): model, id(wrapped): wrapped}.values():
        m.__dict__["_halo_data_parallel"] = data_parallel
        m.__dict__["_halo_groups"] = (dm.domain_group, dm.dp_group if dm.dp_size > 1 else None)
    return wrapped
