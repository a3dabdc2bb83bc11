"""How ranks are had: this process under ``torchrun``, or local CPU processes (gloo) started from here.

==========================================  =====================================================================
launch                                      ranks
==========================================  =====================================================================
``halo demo --nproc 4`` (plain process)     ``--nproc`` CPU processes with gloo, from ``halo.testing.run_on_ranks``
``torchrun --nproc_per_node=8 -m halo ...`` this process is one rank (``RANK``/``WORLD_SIZE`` set): NCCL and
                                            ``cuda:<local rank>`` when GPUs are visible (or ``--backend``), else
                                            gloo; ``device_id=`` given to ``init_process_group``
==========================================  =====================================================================

A rank function is ``fn(rank, world, *args) -> result``; :func:`launch` returns every rank's result in rank order
on the process that prints (the parent, or rank 0 under torchrun; other torchrun ranks get ``None``). The tools
(``halo demo``, ``halo bench``, the benchmark scripts) use this; nothing in the library does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

__all__ = ["LOCAL_RANK_VARS", "RANK_VARS", "default_backend", "init_from_env", "is_printer", "launch", "local_rank",
           "rank_device", "under_torchrun"]


def under_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` (or other env://) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """``nccl`` under torchrun with CUDA visible, else ``gloo``."""
    import torch

    return "nccl" if under_torchrun() and torch.cuda.is_available() else "gloo"


# Where launchers put this process's rank on its node, first match wins: torchrun, Slurm's srun, Open MPI, MPICH /
# Intel MPI (Hydra), MVAPICH2, Cray PALS (mpiexec on HPE), PMIx.
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID", "PMIX_LOCAL_RANK")
# ... and its global rank, for ``rank % devices`` where no launcher says the local rank.
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID")


def local_rank(env: Mapping[str, str] | None = None, device_count: int | None = None) -> int:
    """This process's rank on its node, from the launcher's environment (``LOCAL_RANK_VARS``, first set wins),
    else its global rank (``RANK_VARS``) modulo ``device_count`` (default: the visible CUDA devices), else 0.

    Without this, a job started by ``srun`` or ``mpirun`` (no ``LOCAL_RANK``) would put every rank on ``cuda:0``.
    A value that is not a non-negative integer raises ``ValueError`` naming the variable."""
    env = os.environ if env is None else env

    def read(name: str) -> int:
        text = env[name].strip()
        if not text.isdigit():
            raise ValueError(f"{name}={env[name]!r}: expected a non-negative integer (this process's rank)")
        return int(text)

    for name in LOCAL_RANK_VARS:
        if env.get(name, "").strip():
            return read(name)
    for name in RANK_VARS:
        if env.get(name, "").strip():
            if device_count is None:
                import torch

                device_count = torch.cuda.device_count()
            return read(name) % max(1, device_count)
    return 0


def rank_device(backend: str) -> Any:
    """The device this rank computes on: ``cuda:<local rank>`` (:func:`local_rank`, modulo the visible devices) for
    NCCL, made the current device; else the CPU."""
    import torch

    if backend == "nccl":
        count = torch.cuda.device_count()
        index = local_rank(device_count=count) % max(1, count)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _attempt_store(timeout: timedelta) -> tuple[Any, int, int] | None:
    """Under torchelastic's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``, what ``torchrun`` sets): a client of
    the agent's TCPStore with this attempt's own key prefix, and this rank and the world size; else ``None``.

    torchrun keeps one TCPStore server for every restart of a job and its workers connect to it without a prefix
    per attempt (``torch.distributed.rendezvous``: "a new TCPStore for every retry", which the agent no longer
    makes), so a restarted rank can read the address its dead peer of the previous attempt published and fail
    in gloo's ``connectFullMesh`` ("Connection refused"), or meet stale counters of a store barrier and wait.
    Keys under ``halo/attempt_<TORCHELASTIC_RESTART_COUNT>/`` are every attempt's own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"halo/attempt_{attempt}", store), rank, world


def init_from_env(backend: str | None = None, *, timeout: float = 600.0,
                  connect_timeout: float = 120.0) -> tuple[int, int]:
    """``init_process_group`` for a rank of a ``torchrun`` (env://) launch that comes back after every restart or
    fails within ``connect_timeout`` seconds naming what it could not reach; returns ``(rank, world)``.

    Under ``torchrun`` each restart gets its own keys in the agent's store (``_attempt_store``: without them a
    restarted rank may connect to its dead peer's old address). Joining (the store, every peer's gloo connection)
    is bounded by ``connect_timeout``; then the group's collectives get ``timeout``. ``backend``: default
    :func:`default_backend`. A no-op returning the current rank and size when a group exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    # device_id binds the group to this rank's GPU: NCCL communicators are made eagerly (and subgroups split
    # from them), so the first op on a group need not include every member (a halo exchange posts nothing on
    # a rank without messages), and no op guesses the device.
    device_id = rank_device(backend) if backend == "nccl" else None
    bound = timedelta(seconds=min(connect_timeout, timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    who = f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} (restart {attempt})"
    try:
        own = _attempt_store(bound)
        if own is None:
            dist.init_process_group(backend, timeout=bound, device_id=device_id)
        else:
            store, rank, world = own
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=bound,
                                    device_id=device_id)
    except Exception as exc:  # noqa: BLE001 - one clear error; torchrun restarts the job or reports it
        raise RuntimeError(f"halo.launch: {who} could not join the {backend} process group within "
                           f"{bound.total_seconds():.0f} s (store {where}): {type(exc).__name__}: {exc}") from exc
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_pg_timeout is not None and timeout > bound.total_seconds():
        set_pg_timeout(timedelta(seconds=timeout), None)
    return dist.get_rank(), dist.get_world_size()


def _init_env_group(backend: str, timeout_s: float) -> tuple[int, int]:
    return init_from_env(backend, timeout=timeout_s, connect_timeout=min(timeout_s, 120.0))


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
