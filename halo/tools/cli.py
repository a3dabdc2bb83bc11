"""The ``halo`` command: ``halo demo`` (exactness and speed on a synthetic global field), ``halo check`` (is my
model, converted, the unsharded model?), ``halo bench``.

Ranks come from :mod:`halo.launch` (local gloo processes, or this process under ``torchrun``). The command sits
on top of everything: ``demo``, ``check`` and ``bench`` import ``launch``; only the thin entry points
``halo/__main__.py`` and ``halo/cli.py`` import this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..launch import default_backend

__all__ = ["main"]


def _grid(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"grid must be HxW, e.g. 721x1440, got {text!r}") from exc
    if h < 3 or w < 4 or w % 2:
        raise argparse.ArgumentTypeError(f"grid needs H >= 3 and an even W >= 4 (pole rolls by W/2), got {h}x{w}")
    return h, w


def _mesh(text: str) -> tuple[int, int]:
    try:
        ph, pw = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"mesh must be PHxPW, e.g. 2x2, got {text!r}") from exc
    if ph < 1 or pw < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, got {text!r}")
    return ph, pw


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
    demo.add_argument("--mesh", type=_mesh, default=None, help="PHxPW: shard latitude over PH ranks and longitude "
                      "over PW (a latitude x longitude mesh of PH*PW ranks; overrides --nproc)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    demo.add_argument("--data", default=None, help="a netCDF/HDF5/zarr file (time, [level,] lat, lon): each rank "
                      "reads its rows, and the demo runs a short sharded rollout with RMSE/ACC against the file")
    demo.add_argument("--variables", default=None, help="with --data: comma-separated variables (default all)")
    demo.add_argument("--leads", type=int, default=3, help="with --data: rollout steps (default 3)")

    check = sub.add_parser("check", help="is a model, converted, the same as unsharded? every module, fwd + bwd",
                           description="Build MODULE:FACTORY (a model, unconverted), run it unsharded and "
                                       "converted on --nproc ranks on one random input of --shape, and compare "
                                       "every module's output and the gradients (halo.check_equivalence). Exit "
                                       "status 1 if they differ, naming the first module that does.")
    check.add_argument("target", help="MODULE:FACTORY, e.g. mypkg.models:build_unet (called with no arguments)")
    check.add_argument("--shape", required=True, help="input shape B,C,H,W (e.g. 2,3,73,144)")
    check.add_argument("--nproc", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    check.add_argument("--boundary", default=None, help="latitude boundary for the converted convs (e.g. pole); "
                       "the unsharded reference is then the model with each conv's latitude padding filled the "
                       "same way (halo.check.boundary_reference), unless --reference is given")
    check.add_argument("--reference", default=None, metavar="MODULE:FACTORY", help="the unsharded model to compare "
                       "with: FACTORY(model) is called with the model the target built and returns the reference "
                       "(its parameters are set from the model's where names agree)")
    check.add_argument("--mesh", type=_mesh, default=None, help="PHxPW: check on a latitude x longitude mesh of "
                       "PH*PW ranks instead (overrides --nproc)")
    check.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    check.add_argument("--rtol", type=float, default=None, help="tolerance relative to each tensor's max |value| "
                       "(default 1e-9 in float64, 1e-4 in float32)")
    check.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    check.add_argument("--timeout", type=float, default=600.0)

    bench = sub.add_parser("bench", help="halo bandwidth, DomainConv2d overhead, scaling, pack kernels",
                           description="Run the benchmarks; each prints a table, appends CSV rows to --out "
                                       "and draws a PNG.")
    bench.add_argument("--quick", action="store_true", help="few sizes and repetitions (tens of seconds)")
    bench.add_argument("--nproc", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    bench.add_argument("--out", default=None, help="output folder (default benchmarks/out in the repo, "
                       "else ./benchmarks_out)")
    bench.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    bench.add_argument("--only", default="bandwidth,conv,scaling,pack",
                       help="comma-separated subset of bandwidth,conv,scaling,pack,mesh,mesh-patch (default all but "
                            "the mesh ones)")
    bench.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark before ranks are killed")
    bench.add_argument("--mesh", type=_mesh, default=None, help="PHxPW: also time the demo step on PH*PW ranks as "
                       "latitude rows vs as a latitude x longitude mesh (halo.tools.benchmarks.mesh2d)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``halo`` console script and of ``python -m halo``."""
    args = _parser().parse_args(argv)
    if args.backend is None:
        args.backend = default_backend()
    if args.command == "demo" and args.data:
        from .demo_data import run_data_demo

        return run_data_demo(args)
    if args.command == "demo":
        if args.quick and args.grid == (721, 1440):
            args.grid = (91, 180)
        if args.quick:
            args.steps = min(args.steps, 2)
        from .demo import run_demo

        return run_demo(args)
    if args.command == "check":
        from .check import run_check

        return run_check(args)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
