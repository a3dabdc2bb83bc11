"""Bandwidth of the halo pack/unpack kernels against the torch reference and a plain copy, in one run.

For activations ``(1, C, H, W)`` of 1 MB .. 1 GB (bf16, C = 64, W = 2H), halo widths 1-4, contiguous and
channels_last, along H (the latitude split):

=============  ======================================================================  ====================
op             what is timed                                                           bytes moved
=============  ======================================================================  ====================
pack           ``pack(x, H, [(0, w), (H - w, w)])``: both sides, one buffer            2 x buffer
unpack         ``unpack(x, lo, hi, H, out)`` into a preallocated extended buffer       2 x out
pack_adjoint   ``pack_adjoint(grad, H, both sides, buf, out)``, preallocated ``out``   2 x grad + buffer
=============  ======================================================================  ====================

Outputs are preallocated so that the kernels' bandwidth is measured, not the allocator: on CPU a fresh
buffer of this size costs page faults worth ~10x the copy (the CUDA caching allocator reuses memory).

``copy`` is ``dst.copy_(src)`` of the op's output bytes (contiguous): the floor each op is measured
against (``frac_copy`` = op GB/s / copy GB/s). CUDA: cuda events, warmup, median of repetitions. Without a
GPU the torch reference and the copy are timed on CPU (sizes capped at 64 MB); Triton's interpreter is a
correctness tool, not a performance path, and is not timed. Results: a table on stdout, rows appended to
``OUT/pack_kernels.csv``, a plot ``OUT/pack_kernels.png`` (if matplotlib imports).

    python benchmarks/pack_kernels.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from halo import kernels as hk
from halo.tools.bench import append_csv, default_out

__all__ = ["main", "measure"]

MB = 2**20
CHANNELS = 64
FIELDS = ["device", "torch", "triton", "date", "op", "layout", "dtype", "bytes", "width", "impl", "time_us",
          "gb_s", "frac_copy"]


def _time(fn: Callable[[], object], device: torch.device, budget_s: float, max_reps: int) -> float:
    """Median seconds per call: warm up, then repeat until ``budget_s`` or ``max_reps``."""
    for _ in range(3):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < 5 or (spent < budget_s and len(times) < max_reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        times.append(t)
        spent += t
    return statistics.median(times)


def _activation(nbytes: int, layout: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``(1, C, H, 2H)`` activation of about ``nbytes`` bytes."""
    elems = nbytes // torch.empty((), dtype=dtype).element_size()
    h = max(8, int((elems / CHANNELS / 2) ** 0.5))
    x = torch.randn(1, CHANNELS, h, 2 * h, device=device).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def measure(op: str, x: torch.Tensor, width: int, impl: str, budget_s: float, max_reps: int
            ) -> tuple[float, int]:
    """(seconds per call, bytes moved) for ``op`` on activation ``x`` with halo ``width`` by ``impl``."""
    h = x.shape[2]
    ranges = [(0, width), (h - width, width)]
    buf = hk.pack(x, 2, ranges, impl="reference")
    lo, hi = buf[:width], buf[width:]
    ext = hk.unpack(x, lo, hi, 2, impl="reference")  # the preallocated extended buffer unpack writes into
    grad_out = torch.empty_like(x)
    calls: dict[str, tuple[Callable[[str], object], torch.Tensor, int]] = {  # op: (call, output, elems moved)
        "pack": (lambda i: hk.pack(x, 2, ranges, out=buf, impl=i), buf, 2 * buf.numel()),
        "unpack": (lambda i: hk.unpack(x, lo, hi, 2, ext, impl=i), ext, 2 * ext.numel()),
        "pack_adjoint": (lambda i: hk.pack_adjoint(x, 2, ranges, buf, out=grad_out, impl=i), x,
                         2 * x.numel() + buf.numel()),
    }
    call, result, elems = calls[op]
    if impl == "copy":  # the same bytes as the op's output, contiguous to contiguous
        src = result.reshape(-1).clone()
        dst = torch.empty_like(src)
        moved = 2 * src.numel() * src.element_size()
        return _time(lambda: dst.copy_(src), x.device, budget_s, max_reps), moved
    return _time(lambda: call(impl), x.device, budget_s, max_reps), elems * x.element_size()


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    ops = [op for op in ("pack", "unpack", "pack_adjoint") if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    width = min(int(r["width"]) for r in rows)
    for ax, op in zip(axes[0], ops, strict=True):
        for impl in ("triton", "reference", "copy"):
            for layout, style in (("contiguous", "-"), ("channels_last", "--")):
                pts = sorted((int(r["bytes"]) / MB, float(r["gb_s"])) for r in rows if r["op"] == op
                             and r["impl"] == impl and r["layout"] == layout and int(r["width"]) == width)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{impl} {layout}")
        ax.set(xscale="log", xlabel="activation MB", ylabel="GB/s", title=f"{op} (halo width {width})")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"halo pack kernels on {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few sizes and widths (seconds on a CPU)")
    out = default_out()  # the checkout's benchmarks/out, else ./benchmarks_out (never the installed package)
    parser.add_argument("--out", type=Path, default=out, help=f"output folder ({out})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        name, impls = torch.cuda.get_device_name(), ["triton", "reference", "copy"]
        sizes = [1, 64] if args.quick else [1, 4, 16, 64, 256, 1024]
        if not hk.HAS_TRITON:
            print(f"triton not importable ({hk.TRITON_IMPORT_ERROR}): timing the reference only")
            impls.remove("triton")
    else:
        name, impls = "cpu", ["reference", "copy"]
        sizes = [1, 4] if args.quick else [1, 4, 16, 64]
        print("no CUDA device: timing the torch reference and a plain copy on CPU, activations capped at "
              "64 MB (Triton's interpreter is not timed)")
    widths = [1, 4] if args.quick else [1, 2, 3, 4]
    budget, max_reps = (0.05, 10) if args.quick else (0.3, 50)
    meta = {"device": name, "torch": torch.__version__, "dtype": args.dtype,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "triton": getattr(sys.modules.get("triton"), "__version__", "none")}
    rows: list[dict] = []
    print(f"{'op':<13}{'layout':<14}{'MB':>6}{'w':>3}  {'impl':<10}{'time us':>10}{'GB/s':>9}{'of copy':>9}")
    for op in ("pack", "unpack", "pack_adjoint"):
        for layout in ("contiguous", "channels_last"):
            for size in sizes:
                x = _activation(size * MB, layout, dtype, device)
                for width in widths:
                    timed = {impl: measure(op, x, width, impl, budget, max_reps) for impl in impls}
                    copy_gbs = timed["copy"][1] / timed["copy"][0] / 1e9
                    for impl, (sec, moved) in timed.items():
                        gbs = moved / sec / 1e9
                        rows.append(dict(meta, op=op, layout=layout, bytes=x.numel() * x.element_size(),
                                         width=width, impl=impl, time_us=f"{sec * 1e6:.2f}",
                                         gb_s=f"{gbs:.2f}", frac_copy=f"{gbs / copy_gbs:.3f}"))
                        print(f"{op:<13}{layout:<14}{size:>6}{width:>3}  {impl:<10}{sec * 1e6:>10.1f}"
                              f"{gbs:>9.1f}{gbs / copy_gbs:>9.2f}")
                del x
    append_csv(args.out / "pack_kernels.csv", [{k: row[k] for k in FIELDS} for row in rows])
    _plot(rows, args.out / "pack_kernels.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
