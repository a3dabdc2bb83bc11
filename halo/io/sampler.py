"""Sampling in a data-parallel x domain job: every rank of a domain group gets the same samples.

In a job of ``dp`` domain groups of ``P`` ranks each, the ``P`` ranks of one domain group hold shards of *one*
sample: they must read the same index at every step, and the ``dp`` groups must share the dataset between them.
``torch.utils.data.DistributedSampler(dataset)`` with its defaults splits the dataset over the *whole world*
(``dp x P`` replicas): the ranks of one domain group then read different samples and the model trains on fields
stitched from several, with no error. The right split is over the data-parallel axis only::

    sampler = halo.DomainSampler(dataset)  # the default manager's dp size and rank; or mesh=
    loader = DataLoader(dataset, sampler=sampler, batch_size=..., num_workers=..., pin_memory=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # every rank, the same epoch: agreed (a mismatch is refused on every rank)
        for batch in loader: ...

:class:`DomainSampler` is ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)`` (its shuffle, seed,
drop_last and padding semantics unchanged) built from the mesh, plus an agreement: at construction and at every
``set_epoch`` every rank of the world checks that it has the same dataset length, seed, shuffle, drop_last and
epoch as the others (one small host all-gather per epoch; a difference raises the same ``ValueError`` on every
rank, a rank that never calls raises :class:`halo.HaloCommError` naming it within ``halo.set_timeout``).
:func:`data_parallel_sampler_args` gives the two numbers for a sampler of your own.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ..dist.comm import comm_group
from ..dist.mesh import get_domain_parallel_manager
from ._steps import agree_words

__all__ = ["DomainSampler", "data_parallel_sampler_args"]


def _mesh_of(manager: Any | None, mesh: Any | None) -> Any | None:
    """The :class:`halo.DomainMesh` of ``mesh`` / ``manager`` / the default manager (``None``: no
    torch.distributed, one process)."""
    if manager is not None and mesh is not None:
        raise ValueError("halo.DomainSampler: pass manager= or mesh=, not both")
    if mesh is not None:
        return mesh
    if manager is None:
        manager = get_domain_parallel_manager()
    if manager is not None:
        return manager.mesh
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("halo.DomainSampler: no manager= or mesh= given and no domain-parallel manager initialised: "
                         f"with {dist.get_world_size()} ranks the data-parallel size is unknown; call "
                         "halo.initialize_domain_parallel(world_size, domain_parallel_size) first or pass mesh=")
    return None


def data_parallel_sampler_args(manager: Any | None = None, *, mesh: Any | None = None) -> dict[str, int]:
    """``{"num_replicas": dp_size, "rank": dp_rank}`` of ``manager`` / ``mesh`` (default: the default manager; one
    process: ``1, 0``): the arguments of ``torch.utils.data.DistributedSampler`` that split a dataset over the
    data-parallel groups only, so that the ranks of a domain group read the same samples. (Its defaults, the whole
    world, give each rank of a domain group a different sample.)"""
    m = _mesh_of(manager, mesh)
    return {"num_replicas": 1, "rank": 0} if m is None else {"num_replicas": int(m.dp_size), "rank": int(m.dp_rank)}


class DomainSampler(DistributedSampler):
    """``DistributedSampler`` over the data-parallel axis of a domain mesh (module docstring).

    Args:
        dataset: a sized dataset (``len(dataset)`` the same on every rank: agreed).
        manager: a :class:`halo.DomainParallelManager` (default: the initialised one).
        mesh: a :class:`halo.DomainMesh` instead of ``manager``.
        shuffle: as ``DistributedSampler``: a permutation seeded by ``seed + epoch``, the same on every rank.
        seed: the permutation's seed (with the epoch).
        drop_last: as ``DistributedSampler``: without it the indices are padded by wrapping so every replica gets
            ``ceil(len / dp)``, with it cut to ``floor(len / dp)``.

    Every rank of one domain group iterates the same indices; the ``dp`` groups get disjoint shares that together
    cover the dataset (with ``drop_last=False``, the few padding indices repeat the first ones).
    """

    def __init__(self, dataset: Sized, *, manager: Any | None = None, mesh: Any | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        args = data_parallel_sampler_args(manager, mesh=mesh)
        super().__init__(dataset, shuffle=shuffle, seed=int(seed), drop_last=drop_last, **args)
        self._world = comm_group(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
        self._agree("construction")

    def set_epoch(self, epoch: int) -> None:
        """The epoch (the shuffle's seed is ``seed + epoch``): call it on every rank before each epoch, with the same
        value; agreed over the world (a mismatch raises the same ``ValueError`` on every rank)."""
        super().set_epoch(int(epoch))
        self._agree("set_epoch")

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of the data position: the epoch and the seed (``halo.checkpoint.save`` takes the
        sampler itself). Resuming at an epoch boundary continues the same permutation sequence."""
        return {"epoch": int(self.epoch), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`: the seed must be this sampler's (a different one would change the order of
        every later epoch), the epoch is set as :meth:`set_epoch` sets it (agreed over the world)."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"halo.DomainSampler.load_state_dict: the checkpoint's sampler was seeded {state['seed']}"
                             f", this one {self.seed}: build the sampler with seed={state['seed']}")
        self.set_epoch(int(state["epoch"]))

    def _agree(self, when: str) -> None:
        cg = self._world
        if cg is None or cg.size == 1:
            return
        names = ("len(dataset)", "seed", "shuffle", "drop_last", "epoch", "dp size")
        mine = [len(self.dataset), self.seed, int(self.shuffle), int(self.drop_last), self.epoch, self.num_replicas]
        table = agree_words(mine, cg, f"halo.DomainSampler {when}")
        for j in range(cg.size):
            diff = [f"{n} {int(table[0, k])} vs {int(table[j, k])}" for k, n in enumerate(names)
                    if table[j, k] != table[0, k]]
            if diff:
                raise ValueError(f"halo.DomainSampler ({when}): the ranks disagree: {cg.describe(0)} and "
                                 f"{cg.describe(j)} differ in {', '.join(diff)}; every rank must sample the same "
                                 f"dataset with the same seed, shuffle, drop_last and epoch (else the ranks of a "
                                 f"domain group read different samples)")
