"""How ranks are had: this process under ``torchrun``, or local CPU processes (gloo) started from here.

==========================================  =====================================================================
launch                                      ranks
==========================================  =====================================================================
``halo demo --nproc 4`` (plain process)     ``--nproc`` CPU processes with gloo, from ``halo.testing.run_on_ranks``
``torchrun --nproc_per_node=8 -m halo ...`` this process is one rank (``RANK``/``WORLD_SIZE`` set): NCCL and
                                            ``cuda:LOCAL_RANK`` when GPUs are visible (or ``--backend``), else gloo
==========================================  =====================================================================

A rank function is ``fn(rank, world, *args) -> result``; :func:`launch` returns every rank's result in rank order
on the process that prints (the parent, or rank 0 under torchrun; other torchrun ranks get ``None``). The tools
(``halo demo``, ``halo bench``, the benchmark scripts) use this; nothing in the library does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["default_backend", "is_printer", "launch", "rank_device", "under_torchrun"]


def under_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` (or other env://) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """``nccl`` under torchrun with CUDA visible, else ``gloo``."""
    import torch

    return "nccl" if under_torchrun() and torch.cuda.is_available() else "gloo"


def rank_device(backend: str) -> Any:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` for NCCL, else the CPU."""
    import torch

    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_env_group(backend: str, timeout_s: float) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        device_id = rank_device(backend) if backend == "nccl" else None
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return dist.get_rank(), dist.get_world_size()


def launch(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo",
           timeout: float = 600.0) -> list[Any] | None:
    """Run ``fn(rank, world, *args)`` on every rank; every rank's result (rank order) where it is printed.

    Under torchrun the current process group (created here if needed) is used and ``nproc`` is ignored;
    results reach rank 0 through ``gather_object`` and other ranks get ``None``. Otherwise ``nproc`` gloo
    ranks, one intra-op thread each (ranks share the cores fairly), killed after ``timeout`` seconds.
    """
    if under_torchrun():
        import torch.distributed as dist

        rank, world = _init_env_group(backend, timeout)
        result = fn(rank, world, *args)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    from .testing import run_on_ranks

    return run_on_ranks(fn, nproc, *args, backend=backend, timeout=timeout, threads=1)


def is_printer() -> bool:
    """Whether this process prints results (the parent, or global rank 0 under torchrun)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"
