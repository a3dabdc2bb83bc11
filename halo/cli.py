"""The ``halo`` command: ``halo demo`` (exactness and speed on a synthetic global field), ``halo bench``.

Two ways to get ranks, chosen by the environment:

==========================================  =====================================================================
launch                                      ranks
==========================================  =====================================================================
``halo demo --nproc 4`` (plain process)     ``--nproc`` CPU processes with gloo, from ``halo.testing.run_on_ranks``
``torchrun --nproc_per_node=8 -m halo ...`` this process is one rank (``RANK``/``WORLD_SIZE`` set): NCCL and
                                            ``cuda:LOCAL_RANK`` when GPUs are visible (or ``--backend``), else gloo
==========================================  =====================================================================

A rank function is ``fn(rank, world, *args) -> result``; :func:`launch` returns every rank's result in rank order
on the process that prints (the parent, or rank 0 under torchrun; other torchrun ranks get ``None``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["main", "launch", "under_torchrun", "rank_device"]


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


def _grid(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"grid must be HxW, e.g. 721x1440, got {text!r}") from exc
    if h < 3 or w < 4 or w % 2:
        raise argparse.ArgumentTypeError(f"grid needs H >= 3 and an even W >= 4 (pole rolls by W/2), got {h}x{w}")
    return h, w


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halo", description="halo: exact domain parallelism for weather models")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="sharded vs unsharded model on a synthetic global field: error, time, PNG",
                          description="Shard a synthetic global lat-lon field along latitude, run a small "
                                      "convolutional model forward and backward sharded and unsharded, and "
                                      "compare. Exit status 1 if they differ beyond the tolerance.")
    demo.add_argument("--grid", type=_grid, default=(721, 1440), help="HxW lat-lon grid (default 721x1440)")
    demo.add_argument("--channels", type=int, default=4, help="field channels (default 4)")
    demo.add_argument("--hidden", type=int, default=8, help="hidden channels of the model (default 8)")
    demo.add_argument("--nproc", type=int, default=4, help="CPU ranks when not under torchrun (default 4)")
    demo.add_argument("--steps", type=int, default=5, help="timed steps each, sharded and unsharded (default 5)")
    demo.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    demo.add_argument("--quick", action="store_true", help="a small grid (91x180) and 2 steps: seconds")
    demo.add_argument("--out", default="halo_demo_out", help="folder for the PNG (default ./halo_demo_out)")
    demo.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl under torchrun "
                      "with GPUs, else gloo")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")

    bench = sub.add_parser("bench", help="halo bandwidth, HaloConv2d overhead, scaling, pack kernels",
                           description="Run the benchmarks; each prints a table, appends CSV rows to --out "
                                       "and draws a PNG.")
    bench.add_argument("--quick", action="store_true", help="few sizes and repetitions (tens of seconds)")
    bench.add_argument("--nproc", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    bench.add_argument("--out", default=None, help="output folder (default benchmarks/out in the repo, "
                       "else ./benchmarks_out)")
    bench.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    bench.add_argument("--only", default="bandwidth,conv,scaling,pack",
                       help="comma-separated subset of bandwidth,conv,scaling,pack (default all)")
    bench.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark before ranks are killed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``halo`` console script and of ``python -m halo``."""
    args = _parser().parse_args(argv)
    if args.backend is None:
        args.backend = default_backend()
    if args.command == "demo":
        if args.quick and args.grid == (721, 1440):
            args.grid = (91, 180)
        if args.quick:
            args.steps = min(args.steps, 2)
        from .demo import run_demo

        return run_demo(args)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
