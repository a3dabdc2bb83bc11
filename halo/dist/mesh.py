"""Process groups for domain parallelism: a ``DomainMesh`` over torch's ``DeviceMesh``.

The world is laid out as a mesh ``(dp, *domain_axes)`` in row-major order: the domain axes vary fastest, so the
ranks of one domain group are a contiguous block and data-parallel groups are strided::

    world 8, one domain axis of 2        mesh [[0, 1], [2, 3], [4, 5], [6, 7]]   axes ("dp", "domain")
        domain groups  [0,1] [2,3] [4,5] [6,7]        dp groups  [0,2,4,6] [1,3,5,7]

    world 8, domain axes (2, 2)          mesh [[[0,1],[2,3]], [[4,5],[6,7]]]      axes ("dp", "domain_h", "domain_w")
        domain_h groups [0,2] [1,3] [4,6] [5,7]   domain_w groups [0,1] [2,3] ...   domain groups [0..3] [4..7]

A mesh has k domain axes (:attr:`DomainMesh.axes`, one :class:`DomainAxis` each): the tensor dim the axis
splits (``shard_dims``, latitude ``-2`` first) and whether it is ``periodic`` (longitude: the first and last rank
of that axis are neighbours; latitude: not), plus the data-parallel axis ``"dp"``. Latitude only is a one-axis mesh;
latitude x longitude a two-axis one (halo's layers take these two; the mesh itself takes any k). The NCAR CREDIT
``DomainParallelManager`` is a facade over a one-axis mesh: every attribute it has answers from that mesh (no second
code path for groups). The default manager lives in the current :mod:`halo.context` (``"mesh"``), a convenience
with an explicit reset, never the only way in: every function that communicates also takes a ``group`` or mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import context
from .comm import create_host_groups, first_ops, set_default_group

__all__ = [
    "DomainAxis",
    "DomainMesh",
    "DomainParallelManager",
    "device_type_for",
    "dp_coordinate",
    "initialize_domain_parallel",
    "get_domain_parallel_manager",
    "destroy_domain_parallel",
    "mesh_2d",
    "mesh_coords",
    "mesh_layout",
    "resolve_group",
]


def device_type_for(backend: str, cuda_available: bool | None = None) -> str:
    """The ``DeviceMesh`` device type of a job whose default backend is ``backend`` (``dist.get_backend()``): the
    device the collectives run on, not the backend's name. ``"nccl"`` -> ``"cuda"``; a multi-backend string
    (``"cpu:gloo,cuda:nccl"``) -> its first non-CPU device where that device is available (``cuda_available``:
    default ``torch.cuda.is_available()``), else ``"cpu"``; ``"gloo"`` -> ``"cpu"``."""
    b = str(backend).lower().replace(" ", "")
    pairs = [part.split(":", 1) for part in b.split(",") if ":" in part]
    if not pairs:
        return "cuda" if b == "nccl" else "cpu"
    for dev, _ in pairs:
        if dev == "cpu":
            continue
        if dev == "cuda":
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
            if cuda_available:
                return "cuda"
            continue
        import torch

        module = getattr(torch, dev, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return dev
    return "cpu"


@dataclasses.dataclass
class _MeshState:
    """The default manager (``initialize_domain_parallel``), and the data-parallel coordinate of the members of each
    domain and domain-axis group a mesh made under this context (weak keys: a destroyed group drops out)."""

    manager: DomainParallelManager | None = None
    dp_coords: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)


def _state() -> _MeshState:
    return context.state("mesh", _MeshState)


def dp_coordinate(group: Any) -> int | None:
    """The data-parallel coordinate of the members of ``group``, a domain group or domain-axis group of a
    :class:`DomainMesh` (or of the manager's mesh); ``None`` for a group no mesh made (or one made before the
    context was reset: ``halo.random`` then keys its stream on the group's ranks, which differ between replicas)."""
    return _state().dp_coords.get(group) if group is not None else None


@dataclasses.dataclass(frozen=True)
class DomainAxis:
    """One domain axis of a :class:`DomainMesh`: its name in the ``DeviceMesh``, its number of ranks, the tensor dim
    it splits and whether its first and last ranks are neighbours (longitude: yes; latitude: no)."""

    name: str
    size: int
    dim: int
    periodic: bool


def _blocks(layout: np.ndarray, axis: int) -> list[list[int]]:
    """The groups along ``axis`` of ``layout`` (each its global ranks in order), in row-major order of the rest."""
    moved = np.moveaxis(layout, axis, -1)
    return [[int(r) for r in block] for block in moved.reshape(-1, layout.shape[axis])]


def mesh_layout(world_size: int, domain_shape: Sequence[int]) -> np.ndarray:
    """The rank layout ``(dp, *domain_shape)`` of a world, without touching torch.distributed.

    Raises ``ValueError`` (with the numbers) if a size is not positive or the domain does not divide the world.
    """
    domain_shape = tuple(int(s) for s in domain_shape)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not domain_shape or any(s <= 0 for s in domain_shape):
        raise ValueError(f"domain sizes must be positive, got {domain_shape}")
    domain_size = math.prod(domain_shape)
    if world_size % domain_size:
        raise ValueError(
            f"world_size ({world_size}) must be divisible by the domain-parallel size "
            f"{' x '.join(map(str, domain_shape))} = {domain_size}"
        )
    return np.arange(world_size).reshape(world_size // domain_size, *domain_shape)


class DomainMesh:
    """A ``(dp, *domain_axes)`` mesh of process groups for one process in an initialised world.

    Args:
        domain_shape: ranks along each domain axis, e.g. ``(4,)`` (latitude) or ``(2, 4)`` (latitude x longitude);
            any number of axes (halo's layers take one or two).
        shard_dims: the tensor dim each domain axis shards; default ``(-2,)`` / ``(-2, -1)`` (required for more
            than two axes).
        periodic: per domain axis, whether the first and last ranks are neighbours (longitude).
        axis_names: names of the domain axes in the ``DeviceMesh``; default ``("domain",)``,
            ``("domain_h", "domain_w")`` or ``("domain_0", ...)``. The data-parallel axis is always ``"dp"``.
        world_size: expected world size; checked against the initialised process group.
        device_type: ``DeviceMesh`` device type; default from the devices the job's backend runs on
            (:func:`device_type_for`): ``"cuda"`` for ``nccl`` and for ``"cpu:gloo,cuda:nccl"`` with a GPU
            visible, else ``"cpu"`` (what FSDP2 on this mesh places its shards on).

    Every rank of the world must construct the mesh (group creation is collective), in the same order. With NCCL
    alone the mesh also makes the gloo host group of each of its groups here (``halo.dist.comm``), and, where
    ``init_process_group`` was not given ``device_id=``, runs one tiny all-reduce on each of its NCCL groups: without a
    bound device the first NCCL op on a group must include every member, and a halo exchange posts nothing on a rank
    that has no messages.
    """

    def __init__(
        self,
        domain_shape: Sequence[int] | int,
        *,
        shard_dims: Sequence[int] | None = None,
        periodic: Sequence[bool] | bool = False,
        axis_names: Sequence[str] | None = None,
        world_size: int | None = None,
        device_type: str | None = None,
    ) -> None:
        if isinstance(domain_shape, int):
            domain_shape = (domain_shape,)
        self.domain_shape = tuple(int(s) for s in domain_shape)
        n_axes = len(self.domain_shape)
        if n_axes < 1 or (n_axes > 2 and shard_dims is None):
            raise ValueError(f"a domain mesh has at least one domain axis, and shard_dims= names the dim of each "
                             f"beyond two, got domain_shape={self.domain_shape}, shard_dims={shard_dims}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
                "(torchrun sets the environment), or use halo.testing.run_on_ranks for local CPU ranks"
            )
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(
                f"world_size={world_size} differs from the initialised process group's world size {actual}"
            )
        self.world_size = actual
        layout = mesh_layout(actual, self.domain_shape)
        self.shard_dims = tuple(shard_dims) if shard_dims is not None else (-2, -1)[:n_axes]
        if isinstance(periodic, bool):
            periodic = (periodic,) * n_axes
        self.periodic = tuple(bool(p) for p in periodic)
        self.axis_names = tuple(axis_names) if axis_names is not None else (
            ("domain",) if n_axes == 1 else ("domain_h", "domain_w") if n_axes == 2 else
            tuple(f"domain_{a}" for a in range(n_axes)))
        for name, got in (("shard_dims", self.shard_dims), ("periodic", self.periodic),
                          ("axis_names", self.axis_names)):
            if len(got) != n_axes:
                raise ValueError(f"{name} needs one entry per domain axis ({n_axes}), got {got}")
        if len(set(self.shard_dims)) != n_axes:
            raise ValueError(f"shard_dims must be distinct, got {self.shard_dims}")
        if "dp" in self.axis_names or len(set(self.axis_names)) != n_axes:
            raise ValueError(f"axis_names must be distinct and not 'dp', got {self.axis_names}")

        if device_type is None:
            device_type = device_type_for(dist.get_backend())
        self.layout = layout
        self.device_mesh = DeviceMesh(device_type, layout, mesh_dim_names=("dp", *self.axis_names))
        self.rank = dist.get_rank()
        self.coords = tuple(int(c) for c in np.argwhere(layout == self.rank)[0])

        # One group spanning all domain axes (reductions over the whole domain). With one axis it is the
        # DeviceMesh's own group; with two, create the flattened blocks here, every rank every block in order.
        if n_axes == 1:
            self._domain_group = self.device_mesh.get_group(self.axis_names[0])
        else:
            self._domain_group = None
            for block in layout.reshape(layout.shape[0], -1):
                group = dist.new_group([int(r) for r in block])
                if self.rank in block:
                    self._domain_group = group
        self._prepare_groups()

    def _prepare_groups(self) -> None:
        """The host groups of every group of the mesh (every block of every kind, in one order, on every rank:
        collective) and, for NCCL without a bound device, a first op on each group that includes every member."""
        groups = [self.dp_group] + [self.axis_group(a) for a in range(len(self.domain_shape))]
        kinds = [_blocks(self.layout, 0)] + [_blocks(self.layout, 1 + a) for a in range(len(self.domain_shape))]
        if len(self.domain_shape) > 1:
            groups.append(self._domain_group)
            kinds.append([[int(r) for r in block] for block in self.layout.reshape(self.layout.shape[0], -1)])
        for blocks, group in zip(kinds, groups, strict=True):
            create_host_groups(blocks, group)
        coords = _state().dp_coords
        for group in groups[1:]:  # the groups one sample's shards share: their members' data-parallel coordinate
            coords[group] = self.coords[0]
        first_ops(groups)  # one order on every rank; each kind of group partitions the world

    @property
    def axes(self) -> tuple[DomainAxis, ...]:
        """The domain axes in order (latitude first): name, ranks, the dim each splits, periodic or not."""
        return tuple(DomainAxis(*a) for a in zip(self.axis_names, self.domain_shape, self.shard_dims, self.periodic,
                                                 strict=True))

    # -- groups -------------------------------------------------------------------------------------------
    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel group (same shard, different samples): hand it to DDP / FSDP2."""
        return self.device_mesh.get_group("dp")

    @property
    def domain_group(self) -> dist.ProcessGroup:
        """All ranks that share one sample (every domain axis): reductions over the whole field."""
        return self._domain_group

    def axis_group(self, axis: int | str = 0) -> dist.ProcessGroup:
        """The group along one domain axis, ranks in shard order: halo exchange along that axis."""
        return self.device_mesh.get_group(self.axis_names[self._axis(axis)])

    def axis_ranks(self, axis: int | str = 0) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in shard order."""
        index = list(self.coords)
        index[1 + self._axis(axis)] = slice(None)
        return [int(r) for r in self.layout[tuple(index)]]

    # -- positions ----------------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_size(self) -> int:
        return self.layout.shape[0]

    def axis_rank(self, axis: int | str = 0) -> int:
        return self.coords[1 + self._axis(axis)]

    def axis_size(self, axis: int | str = 0) -> int:
        return self.domain_shape[self._axis(axis)]

    @property
    def domain_rank(self) -> int:
        """Position in the flattened domain group (row-major over the domain axes)."""
        return int(np.ravel_multi_index(self.coords[1:], self.domain_shape))

    @property
    def domain_size(self) -> int:
        return math.prod(self.domain_shape)

    def neighbors(self, axis: int | str = 0) -> tuple[int | None, int | None]:
        """``(prev, next)`` global ranks along ``axis``; ``None`` at a non-periodic edge."""
        a = self._axis(axis)
        ranks = self.axis_ranks(a)
        i, n = self.coords[1 + a], len(ranks)
        if self.periodic[a]:
            return ranks[(i - 1) % n], ranks[(i + 1) % n]
        return (ranks[i - 1] if i > 0 else None), (ranks[i + 1] if i < n - 1 else None)

    def _axis(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"unknown domain axis {axis!r}; this mesh has {self.axis_names}")
            return self.axis_names.index(axis)
        if not -len(self.domain_shape) <= axis < len(self.domain_shape):
            raise ValueError(f"domain axis {axis} out of range for {len(self.domain_shape)} axes")
        return axis % len(self.domain_shape)

    def __deepcopy__(self, memo: dict) -> DomainMesh:
        return self  # process groups are not copied: a deep copy of a model keeps using the same mesh

    def __reduce__(self) -> tuple:
        return (_no_mesh, ())  # pickled as None (torch.save of a converted model): pass mesh= again after loading

    def __repr__(self) -> str:
        return (f"DomainMesh(world={self.world_size}, dp={self.dp_size}, domain={self.domain_shape}, "
                f"rank={self.rank}, coords={self.coords}, shard_dims={self.shard_dims}, periodic={self.periodic})")


class DomainParallelManager:
    """NCAR CREDIT's manager: a facade over a one-axis :class:`DomainMesh` ``(dp, domain)``.

    Domain groups are contiguous blocks of ``domain_parallel_size`` ranks; data-parallel groups are strided.
    ``device_mesh`` has axes ``("dp", "domain")``; ``mesh`` is the underlying :class:`DomainMesh`, and every
    attribute here (CREDIT's names, its private ones included) is read from it: one description of the groups.
    """

    def __init__(self, world_size: int, domain_parallel_size: int, shard_dim: int = -2) -> None:
        mesh_layout(world_size, (domain_parallel_size,))  # validates the numbers before any collective
        self.mesh = DomainMesh((domain_parallel_size,), shard_dims=(shard_dim,), world_size=world_size)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def domain_parallel_size(self) -> int:
        return self.mesh.domain_size

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.dp_size

    @property
    def shard_dim(self) -> int:
        """The tensor dim the domain axis splits (``-2``: latitude)."""
        return self.mesh.shard_dims[0]

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.device_mesh

    @property
    def domain_group(self) -> dist.ProcessGroup:
        """Process group for halo exchange and domain reductions."""
        return self.mesh.domain_group

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """Process group for gradient averaging across samples."""
        return self.mesh.dp_group

    @property
    def domain_rank(self) -> int:
        return self.mesh.axis_rank(0)

    @property
    def domain_world_size(self) -> int:
        return self.domain_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_world_size(self) -> int:
        return self.data_parallel_size

    @property
    def is_first_domain_rank(self) -> bool:
        """True on the northern edge of the domain."""
        return self.domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        """True on the southern edge of the domain."""
        return self.domain_rank == self.domain_parallel_size - 1

    def neighbor_ranks(self) -> tuple[int | None, int | None]:
        """``(prev_rank, next_rank)`` as global ranks, ``None`` where there is no neighbour."""
        return self.mesh.neighbors(0)

    # CREDIT's private attributes, which its trainers read: the same values under the same names.
    @property
    def _domain_group_idx(self) -> int:
        """Which domain group this rank is in (global rank // domain_parallel_size)."""
        return self.mesh.dp_rank

    @property
    def _domain_rank(self) -> int:
        return self.domain_rank

    @property
    def _dp_rank(self) -> int:
        return self.dp_rank

    @property
    def _domain_group(self) -> dist.ProcessGroup:
        return self.domain_group

    @property
    def _dp_group(self) -> dist.ProcessGroup:
        return self.data_parallel_group

    def __repr__(self) -> str:
        return (f"DomainParallelManager(world_size={self.world_size}, domain_parallel_size="
                f"{self.domain_parallel_size}, shard_dim={self.shard_dim}, rank={self.mesh.rank})")


logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    if name == "_MANAGER":  # CREDIT's name for the module's manager
        return _state().manager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def initialize_domain_parallel(world_size: int, domain_parallel_size: int,
                               shard_dim: int = -2) -> DomainParallelManager:
    """Create a :class:`DomainParallelManager` and make it the default used when no group is passed (in the
    current :mod:`halo.context`)."""
    manager = _state().manager = DomainParallelManager(world_size, domain_parallel_size, shard_dim)
    set_default_group(manager.domain_group)  # what group=None means in halo.dist.comm, one tier down
    logger.info("DomainParallelManager: rank=%d, domain_rank=%d/%d, dp_rank=%d/%d, shard_dim=%d", manager.mesh.rank,
                manager.domain_rank, domain_parallel_size, manager.dp_rank, manager.dp_world_size, shard_dim)
    return manager


def get_domain_parallel_manager() -> DomainParallelManager | None:
    """The default manager, or ``None`` if none is initialised."""
    return _state().manager


def destroy_domain_parallel() -> None:
    """Forget the default manager (its process groups stay valid for anyone holding them)."""
    _state().manager = None
    set_default_group(None)


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the default manager's domain group; a clear error if there is neither."""
    if group is not None:
        return group
    manager = _state().manager
    if manager is None:
        raise RuntimeError(
            "no process group given and no domain-parallel manager initialised: pass group=..., or call "
            "halo.initialize_domain_parallel(world_size, domain_parallel_size) on every rank first"
        )
    return manager.domain_group


@functools.lru_cache(maxsize=64)
def mesh_coords(shape: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """``(h, w)`` of every member of a latitude x longitude mesh's domain group, in group order (row-major)."""
    return tuple(divmod(i, shape[1]) for i in range(shape[0] * shape[1]))


def _no_mesh() -> None:
    return None


def mesh_2d(mesh: Any) -> DomainMesh | None:
    """``mesh`` if it is a :class:`DomainMesh` with two domain axes (latitude x longitude), else ``None``."""
    return mesh if isinstance(mesh, DomainMesh) and len(mesh.domain_shape) == 2 else None


class GroupRef:
    """A process group held by a module: shared, not copied, by ``copy.deepcopy`` (an EMA copy of a model keeps
    working: a group cannot be copied and names the same ranks anyway), and pickled as ``None`` — the default
    group — so ``torch.save(model)`` works and a loaded model uses the manager initialised where it is loaded."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> GroupRef:
        return self

    def __reduce__(self) -> tuple:
        return (GroupRef, (None,))


def group_attribute(doc: str = "The domain group (``None``: the initialised manager's).") -> property:
    """A module attribute ``group`` stored in a :class:`GroupRef` (see there for why)."""

    def get(self: object) -> dist.ProcessGroup | None:
        ref = self.__dict__.get("_group_ref")
        return None if ref is None else ref.group

    def set_(self: object, value: dist.ProcessGroup | None) -> None:
        self.__dict__["_group_ref"] = GroupRef(value)

    return property(get, set_, doc=doc)
