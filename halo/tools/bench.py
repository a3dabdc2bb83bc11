"""``halo bench``: run the benchmarks in :mod:`halo.tools.benchmarks`, plus the helpers they share.

=======================  =====================================  ===============================================
``--only`` name          module (script: ``benchmarks/<file>``)  compares, in one run
=======================  =====================================  ===============================================
``bandwidth``            ``halo_bandwidth``                     halo_exchange vs raw send/recv of packed buffers
                                                                (the wire), naive slice + cat, a shard copy
``conv``                 ``conv_overhead``                      DomainConv2d fwd + bwd vs nn.Conv2d, same local shape
``scaling``              ``scaling``                            the demo model's step on 1..N ranks
``pack``                 ``pack_kernels``                       pack/unpack kernels vs torch reference vs copy
``mesh``                 ``mesh2d``                             the demo step on P ranks as latitude rows vs as a
                                                                ``--mesh PHxPW`` latitude x longitude mesh
``mesh-patch``           ``mesh2d_patch``                       one conv on blocks: compute-then-patch vs
                         (``benchmarks/mesh2d.py --patch``)     pad-then-conv vs rows, same bytes
=======================  =====================================  ===============================================

Timing rule for distributed steps (docs/design.md, "Performance model"): every iteration starts after a barrier,
each rank times it, and the iteration's time is the **max over ranks** (the step is done when the slowest rank
is); reports give the median over iterations. A single rank's time of a step that waits on a peer is noise.

The benchmarks ``halo bench`` runs are modules of the package (``halo.tools.benchmarks``), so the command works
from an installed wheel as from a checkout; ``benchmarks/<file>.py`` in the repository are their script forms.
Ranks import them by module name (:func:`rank_entry`). Results go to the checkout's ``benchmarks/out`` when there
is a checkout, else to ``./benchmarks_out`` (never into the installed package).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["BENCHMARKS", "LoadWatch", "append_csv", "benchmark_parser", "checkout_dir", "default_out", "gather_times",
           "load_benchmark", "median", "paired_ratio", "plot_panels", "print_table", "rank_entry", "run_bench",
           "run_meta", "run_watched", "time_iterations"]

BENCHMARKS = {"bandwidth": "halo_bandwidth", "conv": "conv_overhead", "scaling": "scaling", "pack": "pack_kernels",
              "mesh": "mesh2d", "mesh-patch": "mesh2d_patch"}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over iterations of ``num[i] / den[i]``: two impls timed in the same iterations, so a change of the
    machine's load hits both sides of each ratio (far steadier than a ratio of medians on a shared machine)."""
    return median([a / b for a, b in zip(num, den, strict=True)])


def gather_times(times: Sequence[float], group: Any = None) -> list[float]:
    """Per-iteration max over the ranks of ``group`` of the local ``times`` (same count on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(times)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(list(times), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def time_iterations(fns: dict[str, Callable[[], Any]], iters: int, group: Any = None, device: Any = None,
                    warmup: int = 2) -> dict[str, list[float]]:
    """Interleaved timing: each iteration runs every ``fn`` once, each after a barrier; returns, per name,
    the per-iteration max over ranks (seconds). Interleaving keeps slow drift (other load) out of ratios, and the
    order rotates from one iteration to the next, so that no ``fn`` always runs first (measured on a 2-core VM: the
    second of two equal convs ran ~5 % slower than the first, every time)."""
    import torch.distributed as dist

    cuda = device is not None and torch.device(device).type == "cuda"
    local: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(warmup + iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            if dist.is_initialized():
                dist.barrier(group)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                local[name].append(time.perf_counter() - t0)
    return {name: gather_times(ts, group) for name, ts in local.items()}


def run_meta(backend: str, world: int, device: Any = None) -> dict[str, Any]:
    """What every CSV row carries: device, backend, world size, versions, date, host load."""
    if device is not None and torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    triton = sys.modules.get("triton")
    if triton is None:
        try:
            import triton
        except ImportError:
            triton = None
    return {"device": name, "backend": backend, "world": world, "torch": torch.__version__,
            "triton": getattr(triton, "__version__", "none"), "threads": torch.get_num_threads(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load1": f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""}


class LoadWatch:
    """``with LoadWatch(own=2) as watch:`` samples the machine's 1-minute load average every second while a
    benchmark runs (a daemon thread); ``watch.warning()`` is the text to print with its numbers when the load
    was high for the cores (None otherwise). ``own``: the benchmark's own busy processes (its ranks, one thread
    each), part of the load it measures."""

    def __init__(self, own: int = 1, interval: float = 1.0) -> None:
        self.own, self.interval = own, interval
        self.cores = os.cpu_count() or 1
        self.samples: list[float] = []
        self._stop: Any = None

    #: the watches running now (innermost last): :func:`plot_panels` notes a busy machine under its plots
    active: list[LoadWatch] = []

    @staticmethod
    def load() -> float | None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def __enter__(self) -> LoadWatch:
        import threading

        self._stop = threading.Event()

        def sample() -> None:
            while True:
                value = self.load()
                if value is not None:
                    self.samples.append(value)
                if self._stop.wait(self.interval):
                    return

        self._thread = threading.Thread(target=sample, daemon=True, name="halo-bench-load")
        self._thread.start()
        LoadWatch.active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in LoadWatch.active:
            LoadWatch.active.remove(self)
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        value = self.load()
        if value is not None:
            self.samples.append(value)

    @property
    def peak(self) -> float | None:
        return max(self.samples) if self.samples else None

    def busy(self) -> bool:
        """More runnable work than the cores, or than this run's own ranks where they are more: others competed."""
        return self.peak is not None and self.peak > max(self.cores, self.own) + 0.5

    def short(self) -> str:
        return (f"measured on a busy machine: load average up to {self.peak:.1f} on {self.cores} cores "
                f"({self.own} of it the run's own ranks); times likely inflated")

    def warning(self) -> str | None:
        if not self.busy():
            return None
        return (f"WARNING: the load average reached {self.peak:.1f} (1 min; {self.samples[0]:.1f} at the start) on "
                f"{self.cores} cores while this ran, {self.own} of it this run's own ranks: other work "
                f"competed for the cores, so these times are likely inflated and the ratios noisier than on a quiet "
                f"machine; rerun when `uptime` shows a load below {self.cores}")


def run_watched(fn: Callable[[], int], own: int) -> int:
    """``fn()`` under a :class:`LoadWatch` (a script's ``main``): its plots get the note, and a busy machine's
    warning is printed after its tables. ``own``: the script's own ranks."""
    from ..launch import is_printer, under_torchrun

    if under_torchrun():
        own = int(os.environ.get("LOCAL_WORLD_SIZE", str(own)))
    with LoadWatch(own=own) as watch:
        rc = fn()
    if is_printer() and watch.warning():
        print(watch.warning(), flush=True)
    return rc


def append_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Append ``rows`` (a header when the file is new); a file whose header differs gets a sibling file."""
    if not rows:
        return path
    fields = list(rows[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
        if header and header != fields:
            path = path.with_name(f"{path.stem}_v{abs(hash(tuple(fields))) % 10**6}{path.suffix}")
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {path} (+{len(rows)} rows)")
    return path


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    """A fixed-width table of ``columns`` of ``rows`` on stdout."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def plot_panels(path: Path, panels: list[dict[str, Any]], title: str, footnote: str | None = None) -> Path | None:
    """Line plots side by side. A panel: ``title, xlabel, ylabel, series {label: [(x, y), ...]}``, optional
    ``logx``/``logy``, ``hline`` (a reference level), ``xticks`` (the ticks, e.g. integer rank counts) and
    ``notes`` (``(x, y, text)`` annotations). ``footnote``: a line under the panels (a load warning). Returns None
    (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return None
    watch = LoadWatch.active[-1] if LoadWatch.active else None
    if footnote is None and watch is not None and watch.busy():
        footnote = watch.short()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, pts in panel["series"].items():
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, marker="o", ms=3, label=label)
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="k", lw=0.8, ls="--")
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"],
               xscale="log" if panel.get("logx") else "linear", yscale="log" if panel.get("logy") else "linear")
        if panel.get("xticks") is not None:  # e.g. rank counts: integers only
            ax.set_xticks(list(panel["xticks"]))
        for x, y, text in panel.get("notes", ()):  # a point that needs a word (above its own ceiling, ...)
            ax.annotate(text, (x, y), xytext=(8, -28), textcoords="offset points", fontsize=7,
                        arrowprops={"arrowstyle": "->", "lw": 0.6}, bbox={"fc": "lightyellow", "ec": "0.5"})
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if footnote:
        fig.text(0.01, 0.01, footnote, fontsize=7, color="firebrick", ha="left", va="bottom", wrap=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1) if footnote else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def checkout_dir() -> Path | None:
    """The repository checkout this package runs from (an editable install or ``PYTHONPATH``), else None (a
    wheel: ``site-packages`` has no ``pyproject.toml`` beside ``halo/``)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "benchmarks").is_dir() else None


def load_benchmark(name: str) -> ModuleType:
    """The benchmark module ``name`` (a value of :data:`BENCHMARKS`, e.g. ``"scaling"``), imported by name."""
    if name not in BENCHMARKS.values():
        raise ValueError(f"unknown benchmark module {name!r}: expected one of {sorted(BENCHMARKS.values())}")
    return importlib.import_module(f"{__package__}.benchmarks.{name}")


def rank_entry(rank: int, world: int, name: str, fn_name: str, *args: Any) -> Any:
    """A picklable rank function: benchmark module ``name``'s ``fn_name(rank, world, *args)``."""
    return getattr(load_benchmark(name), fn_name)(rank, world, *args)


def default_out() -> Path:
    """``benchmarks/out`` of the checkout, else ``./benchmarks_out`` (an installed package is no place for CSVs)."""
    root = checkout_dir()
    return root / "benchmarks" / "out" if root is not None else Path("benchmarks_out")


def benchmark_parser(doc: str | None, nproc_help: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark script shares: ``--quick``, ``--nproc``, ``--backend``, ``--out``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=2, help=nproc_help)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--out", type=Path, default=default_out())
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """Run the selected benchmarks in order; non-zero if one of them failed (the others still run)."""
    from ..launch import is_printer, under_torchrun

    out = Path(args.out) if args.out else default_out()
    opts = {"quick": args.quick, "nproc": args.nproc, "out": out, "backend": args.backend,
            "timeout": args.timeout, "mesh": getattr(args, "mesh", None)}
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if opts["mesh"] and "mesh" not in names:
        names.append("mesh")  # --mesh PHxPW: also compare rows with blocks on PH*PW ranks
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"halo bench: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    status = 0
    if is_printer() and LoadWatch.load() is not None:
        print(f"load average now: {LoadWatch.load():.2f} (1 min) on {os.cpu_count()} cores", flush=True)
    warnings: list[str] = []
    for name in names:
        if is_printer():
            print(f"\n=== {name}: halo.tools.benchmarks.{BENCHMARKS[name]} ===", flush=True)
        t0 = time.perf_counter()
        own = 1 if name == "pack" else (int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun()
                                        else args.nproc)
        with LoadWatch(own=own) as watch:
            try:
                if name == "pack":
                    if is_printer():  # a single-process benchmark: rank 0 only under torchrun
                        rc = load_benchmark("pack_kernels").main((["--quick"] if args.quick else [])
                                                                 + ["--out", str(out)])
                    else:
                        rc = 0
                else:
                    rc = load_benchmark(BENCHMARKS[name]).run(opts)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other benchmarks
                print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
                rc = 1
        status |= int(bool(rc))
        if is_printer():
            warning = watch.warning()
            if warning:
                print(f"{name}: {warning}", flush=True)
                warnings.append(f"{name}: load up to {watch.peak:.1f} on {watch.cores} cores")
            print(f"--- {name}: {'ok' if not rc else 'FAILED'} in {time.perf_counter() - t0:.1f} s", flush=True)
    if is_printer() and warnings:
        print(f"\nWARNING: numbers taken on a busy machine ({'; '.join(warnings)}): compare them with care",
              flush=True)
    if under_torchrun():
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    return status
