"""ColossalAI-style process-group initializers: same names, signatures and group layouts, our own code.

ColossalAI (``colossalai.legacy.context``) builds its hybrid-parallel process groups with a family of
``ProcessGroupInitializer`` classes. This module re-implements that family so that code written against it
runs on ``halo``. Each initializer has two halves:

* ``layout()``: pure arithmetic, no ``torch.distributed``. Every group of every mode the initializer creates,
  in creation order, each group's global ranks in local-rank order (``group[i]`` has local rank ``i``).
* ``init_dist_group()``: calls ``torch.distributed.new_group`` for every group of the layout, in that order,
  on every rank (torch requires all ranks to create every group), and returns this rank's
  ``(local_rank, group_world_size, process_group, ranks_in_group, mode)``: one tuple, or a list of tuples for
  the initializers that make several kinds of group (Pipeline, Sequence, 2D, 2.5D, 3D), as ColossalAI does.

Rank layout. ColossalAI's context has ``world = dp * pp * tp`` with the tensor-parallel index fastest::

    rank = d * (pp * tp) + p * tp + t

DATA groups stride by ``pp * tp``; PIPELINE groups stride by ``tp`` inside one data block; TENSOR, 1D and
SEQUENCE groups are contiguous blocks of ``tp``; MODEL groups contiguous blocks of ``pp * tp``; SEQUENCE_DP
groups contiguous blocks of ``world / pp``. Inside each tensor block the 2D, 2.5D and 3D modes view the ``tp``
ranks as a grid, first coordinate fastest: ``t = i + q*j`` (2D, ``q*q = tp``), ``t = i + q*j + q*q*k``
(2.5D, ``q*q*depth = tp``), ``t = i + d*j + d*d*k`` (3D, ``d**3 = tp``). World 8, dp 2, tp 4, 2D::

    PARALLEL_2D_ROW  [[0, 1], [2, 3], [4, 5], [6, 7]]    # vary i: contiguous pairs
    PARALLEL_2D_COL  [[0, 2], [1, 3], [4, 6], [5, 7]]    # vary j: stride q

World 8, tp 8, 2.5D with depth 2 (q = 2); the creation order is ColossalAI's loop order, not sorted::

    PARALLEL_2P5D_COL  [[0, 2], [4, 6], [1, 3], [5, 7]]  # vary j; loops i, then k
    PARALLEL_2P5D_ROW  [[0, 1], [4, 5], [2, 3], [6, 7]]  # vary i; loops j, then k
    PARALLEL_2P5D_DEP  [[0, 4], [2, 6], [1, 5], [3, 7]]  # vary k; loops i, then j
    PARALLEL_2P5D_XZ   [[0, 2, 4, 6], [1, 3, 5, 7]]      # vary (k, j), j fastest; loop i

Differences from ColossalAI, on purpose:

* No CPU group. ColossalAI >= 0.3 returns a 6-tuple with a gloo ``cpu_group`` in position 3; we return the
  5-tuple above (the pre-0.3 shape), as a :class:`GroupInfo`. If you need a gloo group next to an NCCL one,
  create it yourself with ``new_group(info.ranks_in_group, backend="gloo")`` (on every rank, in order). (With
  NCCL alone, ``init_dist_group`` does make halo's own gloo host groups of its groups, for halo's agreements.)
* No global side effects: ColossalAI records ``summa_dim``, ``tesseract_dim``/``tesseract_dep`` and
  ``depth_3d`` in a process-wide ``tensor_parallel_env``; here they are attributes of the initializer.
* Invalid sizes raise ``ValueError`` naming the rule and the numbers, at construction (ColossalAI asserts, or
  builds wrong groups). Each initializer checks what its layout needs, e.g. that its sizes divide the world
  size; ColossalAI's context always has ``world == dp * pp * tp``, which passes every check.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, ClassVar, NamedTuple

import torch.distributed as dist

from .comm import create_host_groups, first_ops

__all__ = [
    "GroupInfo",
    "Initializer_1D",
    "Initializer_2D",
    "Initializer_2p5D",
    "Initializer_3D",
    "Initializer_Data",
    "Initializer_Model",
    "Initializer_Pipeline",
    "Initializer_Sequence",
    "Initializer_Sequence_DP",
    "Initializer_Tensor",
    "ParallelMode",
    "ProcessGroupInitializer",
]


class ParallelMode(Enum):
    """The parallel modes of ColossalAI, with ColossalAI's string values."""

    GLOBAL = "global"
    DATA = "data"
    MODEL = "model"  # pipeline x tensor: for amp and gradient clipping in hybrid parallel
    PIPELINE = "pipe"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"
    PARALLEL_1D = "1d"
    PARALLEL_2D_ROW = "2d_row"
    PARALLEL_2D_COL = "2d_col"
    PARALLEL_3D_INPUT = "3d_input"
    PARALLEL_3D_WEIGHT = "3d_weight"
    PARALLEL_3D_OUTPUT = "3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"
    PARALLEL_2P5D_ROW = "2p5d_row"
    PARALLEL_2P5D_COL = "2p5d_col"
    PARALLEL_2P5D_DEP = "2p5d_dep"
    PARALLEL_2P5D_XZ = "2p5d_xz"


Layout = dict[ParallelMode, list[list[int]]]


class GroupInfo(NamedTuple):
    """This rank's view of one mode's group; unpacks like ColossalAI's (pre-0.3) 5-tuple."""

    local_rank: int
    group_world_size: int
    process_group: Any  # torch.distributed.ProcessGroup
    ranks_in_group: list[int]
    mode: ParallelMode


def _grid_groups(
    world_size: int, block: int, dims: Sequence[int], loops: Sequence[int], members: Sequence[int]
) -> list[list[int]]:
    """Groups of a grid laid over every block of ``block`` consecutive ranks.

    Inside a block, grid coordinate ``c`` sits at offset ``sum(c[a] * prod(dims[:a]))`` (axis 0 fastest).
    There is one group per block and per value of the ``loops`` axes (first listed = outermost loop); a group
    runs over the ``members`` axes (first listed = outermost, last = fastest).
    """
    strides = [math.prod(dims[:a]) for a in range(len(dims))]
    groups = []
    for base in range(0, world_size, block):
        for fixed in itertools.product(*(range(dims[a]) for a in loops)):
            offset = base + sum(c * strides[a] for c, a in zip(fixed, loops, strict=True))
            groups.append(
                [
                    offset + sum(c * strides[a] for c, a in zip(free, members, strict=True))
                    for free in itertools.product(*(range(dims[a]) for a in members))
                ]
            )
    return groups


def _require_divides(what: str, size: int, world_size: int) -> None:
    if world_size % size:
        raise ValueError(f"{what} ({size}) must divide the world size ({world_size})")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _config_get(config: Any, *keys: str) -> Any:
    """``config[k1][k2]...`` for mappings, ``config.k1.k2...`` for other objects; ``None`` if missing."""
    for key in keys:
        if config is None:
            return None
        config = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return config


class ProcessGroupInitializer(abc.ABC):
    """An object that knows the parallel sizes and builds one family of process groups.

    Args:
        rank: global rank of this process, ``0 <= rank < world_size``.
        world_size: size of the default process group.
        config: the run's configuration (a dict or any object); only 2.5D reads it (for ``depth``).
        data_parallel_size: the data-parallel size, ``>= 1``.
        pipeline_parallel_size: the pipeline-parallel size, ``>= 1``.
        tensor_parallel_size: the tensor-parallel size, ``>= 1``.
    """

    #: Whether ``init_dist_group`` returns a list of tuples (ColossalAI's choice for this initializer).
    returns_list: ClassVar[bool] = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: Any,
        data_parallel_size: int,
        pipeline_parallel_size: int,
        tensor_parallel_size: int,
    ) -> None:
        self.world_size = _positive_int("world_size", world_size)
        self.data_parallel_size = _positive_int("data_parallel_size", data_parallel_size)
        self.pipeline_parallel_size = _positive_int("pipeline_parallel_size", pipeline_parallel_size)
        self.tensor_parallel_size = _positive_int("tensor_parallel_size", tensor_parallel_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        self.rank = rank
        self.config = config
        self._check()

    def _check(self) -> None:
        """Raise ``ValueError`` if the sizes do not fit this initializer; set derived sizes (override)."""
        return None

    @abc.abstractmethod
    def layout(self) -> Layout:
        """Every group of every mode, in creation order; each group lists global ranks in local-rank order."""

    def init_dist_group(self) -> GroupInfo | list[GroupInfo]:
        """Create all groups of :meth:`layout`. Collective: every rank of the world must call it.

        Returns this rank's :class:`GroupInfo`, or a list of them (one per mode, in layout order) for the
        initializers whose ``returns_list`` is true.
        """
        if not dist.is_initialized():
            raise RuntimeError("init_dist_group needs torch.distributed.init_process_group to have run")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise ValueError(
                f"initializer was built for rank {self.rank} of {self.world_size}, but this process is "
                f"rank {dist.get_rank()} of {dist.get_world_size()}"
            )
        infos = []
        for mode, groups in self.layout().items():
            mine = None
            for ranks in groups:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine = GroupInfo(ranks.index(self.rank), len(ranks), group, ranks, mode)
            if mine is None:  # cannot happen: every layout partitions the world
                raise RuntimeError(f"rank {self.rank} is in no {mode} group")
            # With NCCL alone, halo's gloo host groups of these groups, made here in the same order on every rank
            # (halo.dist.comm: never lazily by the members), each in its device group's (sorted) order.
            create_host_groups([sorted(ranks) for ranks in groups], mine.process_group)
            first_ops([mine.process_group])  # NCCL without a bound device: a first op with every member
            infos.append(mine)
        return infos if self.returns_list else infos[0]


class Initializer_Data(ProcessGroupInitializer):
    """DATA groups: ``dp`` ranks each, with stride ``s = world / dp``; group ``i`` is ``[i, i + s, ...]``."""

    def _check(self) -> None:
        _require_divides("data parallel size", self.data_parallel_size, self.world_size)

    def layout(self) -> Layout:
        dp = self.data_parallel_size
        stride = self.world_size // dp
        return {ParallelMode.DATA: _grid_groups(self.world_size, self.world_size, (stride, dp), (0,), (1,))}


class Initializer_Pipeline(ProcessGroupInitializer):
    """PIPELINE groups: in each block of ``world / dp`` ranks, ``pp`` ranks with stride ``world / (dp * pp)``.

    Returns a list (of one tuple), as ColossalAI does.
    """

    returns_list = True

    def _check(self) -> None:
        dp, pp = self.data_parallel_size, self.pipeline_parallel_size
        _require_divides("data parallel size", dp, self.world_size)
        _require_divides("pipeline parallel size", pp, self.world_size // dp)

    def layout(self) -> Layout:
        block = self.world_size // self.data_parallel_size
        pp = self.pipeline_parallel_size
        return {ParallelMode.PIPELINE: _grid_groups(self.world_size, block, (block // pp, pp), (0,), (1,))}


class _Blocks(ProcessGroupInitializer):
    """Groups that are contiguous blocks of ``_block_size()`` ranks, in ascending order."""

    mode: ClassVar[ParallelMode]
    what: ClassVar[str]

    def _block_size(self) -> int:
        return self.tensor_parallel_size

    def _check(self) -> None:
        _require_divides(self.what, self._block_size(), self.world_size)

    def layout(self) -> Layout:
        size = self._block_size()
        return {self.mode: _grid_groups(self.world_size, size, (size,), (), (0,))}


class Initializer_Tensor(_Blocks):
    """TENSOR groups: contiguous blocks of ``tp`` ranks."""

    mode = ParallelMode.TENSOR
    what = "tensor parallel size"


class Initializer_1D(_Blocks):
    """PARALLEL_1D groups: contiguous blocks of ``tp`` ranks (the TENSOR groups under another mode)."""

    mode = ParallelMode.PARALLEL_1D
    what = "tensor parallel size"


class Initializer_Model(_Blocks):
    """MODEL groups: contiguous blocks of ``pp * tp`` ranks (all stages and tensor shards of one replica)."""

    mode = ParallelMode.MODEL
    what = "model parallel size (pipeline x tensor)"

    def _block_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size


class Initializer_Sequence_DP(_Blocks):
    """SEQUENCE_DP groups (gradient all-reduce under sequence parallelism): blocks of ``world / pp`` ranks.

    ColossalAI means them as "all ranks of one pipeline stage", which they are only when ``pp == 1`` or
    ``dp == 1``: PIPELINE groups put data parallelism outermost. We build the blocks as ColossalAI does.
    """

    mode = ParallelMode.SEQUENCE_DP
    what = "data group size (world / pipeline parallel size)"

    def _check(self) -> None:
        _require_divides("pipeline parallel size", self.pipeline_parallel_size, self.world_size)

    def _block_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size


class Initializer_Sequence(ProcessGroupInitializer):
    """SEQUENCE groups (contiguous blocks of ``tp`` ranks), then SEQUENCE_DP groups; returns a list of two."""

    returns_list = True

    def _check(self) -> None:
        _require_divides("sequence (tensor) parallel size", self.tensor_parallel_size, self.world_size)
        _require_divides("pipeline parallel size", self.pipeline_parallel_size, self.world_size)

    def layout(self) -> Layout:
        args = (self.rank, self.world_size, self.config, self.data_parallel_size, self.pipeline_parallel_size)
        (seq,) = Initializer_Tensor(*args, self.tensor_parallel_size).layout().values()
        seq_dp = Initializer_Sequence_DP(*args, self.tensor_parallel_size).layout()
        return {ParallelMode.SEQUENCE: seq, **seq_dp}


class Initializer_2D(ProcessGroupInitializer):
    """2D (SUMMA) groups, a ``q x q`` grid per tensor block, ``t = i + q*j``: ROW varies i, COL varies j.

    Returns ``[ROW, COL]``. ``summa_dim`` is ``q``.
    """

    returns_list = True

    def _check(self) -> None:
        tp = self.tensor_parallel_size
        self.summa_dim = math.isqrt(tp)
        if self.summa_dim**2 != tp:
            raise ValueError(f"2D tensor parallel size must be a perfect square, got {tp}")
        _require_divides("tensor parallel size", tp, self.world_size)

    def layout(self) -> Layout:
        tp, q = self.tensor_parallel_size, self.summa_dim
        return {
            ParallelMode.PARALLEL_2D_ROW: _grid_groups(self.world_size, tp, (q, q), (1,), (0,)),
            ParallelMode.PARALLEL_2D_COL: _grid_groups(self.world_size, tp, (q, q), (0,), (1,)),
        }


class Initializer_2p5D(ProcessGroupInitializer):
    """2.5D (Tesseract) groups, a ``q x q x depth`` grid per tensor block, ``t = i + q*j + q*q*k``.

    COL varies j, ROW varies i, DEP varies k, XZ varies (k, j) with j fastest. Returns
    ``[COL, ROW, DEP, XZ]``: ColossalAI's order, which is not the 2D one. ``depth`` defaults to
    ``config["parallel"]["tensor"]["depth"]`` (mapping or attribute access), where ColossalAI's context keeps
    it. ``tesseract_dim`` is ``q``.
    """

    returns_list = True

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: Any,
        data_parallel_size: int,
        pipeline_parallel_size: int,
        tensor_parallel_size: int,
        depth: int | None = None,
    ) -> None:
        if depth is None:
            depth = _config_get(config, "parallel", "tensor", "depth")
            if depth is None:
                raise ValueError("2.5D needs depth=..., or config['parallel']['tensor']['depth']")
        self.tesseract_dep = _positive_int("2.5D depth", depth)
        sizes = (data_parallel_size, pipeline_parallel_size, tensor_parallel_size)
        super().__init__(rank, world_size, config, *sizes)

    def _check(self) -> None:
        tp, depth = self.tensor_parallel_size, self.tesseract_dep
        self.tesseract_dim = q = math.isqrt(tp // depth)
        if q * q * depth != tp:
            raise ValueError(
                f"2.5D tensor parallel size must be q*q*depth for an integer q, got {tp} with depth {depth}"
            )
        _require_divides("tensor parallel size", tp, self.world_size)

    def layout(self) -> Layout:
        tp, q, d = self.tensor_parallel_size, self.tesseract_dim, self.tesseract_dep

        def groups(loops: tuple[int, ...], members: tuple[int, ...]) -> list[list[int]]:
            return _grid_groups(self.world_size, tp, (q, q, d), loops, members)  # axes i, j, k

        return {
            ParallelMode.PARALLEL_2P5D_COL: groups((0, 2), (1,)),
            ParallelMode.PARALLEL_2P5D_ROW: groups((1, 2), (0,)),
            ParallelMode.PARALLEL_2P5D_DEP: groups((0, 1), (2,)),
            ParallelMode.PARALLEL_2P5D_XZ: groups((0,), (2, 1)),
        }


class Initializer_3D(ProcessGroupInitializer):
    """3D groups, a ``d x d x d`` cube per tensor block, ``t = i + d*j + d*d*k``.

    INPUT varies j, WEIGHT i, OUTPUT k, INPUT_X_WEIGHT (j, i), OUTPUT_X_WEIGHT (k, i), last listed fastest.
    Returns ``[INPUT, WEIGHT, OUTPUT, INPUT_X_WEIGHT, OUTPUT_X_WEIGHT]``. ``depth`` is ``d``.
    """

    returns_list = True

    def _check(self) -> None:
        tp = self.tensor_parallel_size
        guess = round(tp ** (1 / 3))
        self.depth = next((d for d in (guess - 1, guess, guess + 1) if d > 0 and d**3 == tp), 0)
        if not self.depth:
            raise ValueError(f"3D tensor parallel size must be a perfect cube, got {tp}")
        _require_divides("tensor parallel size", tp, self.world_size)

    def layout(self) -> Layout:
        tp, d = self.tensor_parallel_size, self.depth

        def groups(loops: tuple[int, ...], members: tuple[int, ...]) -> list[list[int]]:
            return _grid_groups(self.world_size, tp, (d, d, d), loops, members)  # axes i, j, k

        return {
            ParallelMode.PARALLEL_3D_INPUT: groups((0, 2), (1,)),
            ParallelMode.PARALLEL_3D_WEIGHT: groups((2, 1), (0,)),
            ParallelMode.PARALLEL_3D_OUTPUT: groups((0, 1), (2,)),
            ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: groups((2,), (1, 0)),
            ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: groups((1,), (2, 0)),
        }
