"""Halo exchange time and bandwidth over message size, against its floors, as users get it by default.

Each rank holds a shard ``(1, C, rows, W)`` of a field split by ``halo.shard`` and exchanges ``width`` rows with
both neighbours (zeros beyond the first and last rank, so edge ranks have one message). The message to one
neighbour is ``width x C x W x dtype size`` bytes, swept from 1 KB (GPU: to 256 MB; CPU: to 16 MB, capped to
keep a run within memory and minutes). Per size, layout (contiguous / channels_last) and dtype, timed
interleaved (the order rotating):

============  =======================================================================================
impl          what one call does
============  =======================================================================================
wire          ``batch_isend_irecv`` of already-packed contiguous buffers of the same bytes, wait: the
              in-place form's floor
floor         the wire, then one copy of the shard into a buffer that already exists: the out-of-place
              form's floor (docs/design.md, "Performance model")
exchange      ``halo_exchange(x, width)``, default path: ``x`` came from ``halo.shard``, so after the first
              call no agreement is made; the extended output goes into a buffer the exchange reuses
unplanned     the same on a shard the program sliced itself (halo cannot know its global extent): + one
              small agreement of host data per call
inplace       ``halo_exchange_(ext, width)`` on ``ext = halo_exchange(x, width)``: fills the halo rows only
naive         slice rows, ``.contiguous()``, isend/irecv, ``torch.cat([north, x, south])``
copy          the copy of the shard alone
============  =======================================================================================

``exch/floor`` = exchange / floor (goal <= 1.05), ``inplace/wire`` (goal <= 1.05), each the median over iterations
of the two impls' times in the same iteration (paired); every iteration's time is the max over ranks, tables give
medians. GB/s counts the bytes an interior rank receives (2 messages; 1 with 2 ranks).

    python benchmarks/halo_bandwidth.py [--quick] [--nproc 2] [--rows 4] [--width 1] [--sizes 1K,1M]
    torchrun --nproc_per_node=8 benchmarks/halo_bandwidth.py --backend nccl
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from halo.tools.bench import (
    append_csv,
    benchmark_parser,
    median,
    paired_ratio,
    plot_panels,
    print_table,
    rank_entry,
    run_meta,
    run_watched,
    time_iterations,
)

__all__ = ["main", "run"]

KB, MB = 2**10, 2**20
CPU_SIZES = [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB]
GPU_SIZES = CPU_SIZES + [64 * MB, 256 * MB]
IMPLS = ("wire", "floor", "exchange", "unplanned", "inplace", "naive", "copy")


def _shape(msg_bytes: int, width: int, dtype: torch.dtype, rows: int) -> tuple[int, int, int, int]:
    """A ``(1, C, rows, W)`` shard whose ``width``-row message is ``msg_bytes``: W the largest even divisor of
    the row's elements up to 1440 (1024 for power-of-two sizes), C the rest."""
    elems = max(2, msg_bytes // (width * torch.empty((), dtype=dtype).element_size()))
    w = next(d for d in range(min(1440, elems), 1, -1) if elems % d == 0 and d % 2 == 0)
    return 1, elems // w, max(rows, width), w


def _impls(x: torch.Tensor, local: torch.Tensor, width: int, group: Any) -> dict[str, Callable[[], Any]]:
    """``x``: this rank's shard as ``halo.shard`` made it; ``local``: the same values in a tensor halo did not make."""
    import torch.distributed as dist

    from halo.dist.comm import comm_group
    from halo.exchange import halo_exchange, halo_exchange_

    info = comm_group(group)
    me, n = info.index, x.shape[-2]
    peers = [q for q in (me - 1, me + 1) if 0 <= q < info.size]
    rest = (x.shape[0], x.shape[1], x.shape[3])
    # wire: one packed (dim-major) contiguous buffer per neighbour and direction, as the exchange sends
    sends = {q: torch.randn(width, *rest, device=x.device).to(x.dtype) for q in peers}
    recvs = {q: torch.empty(width, *rest, device=x.device, dtype=x.dtype) for q in peers}

    def post(send: dict, recv: dict) -> None:
        ops = [dist.P2POp(dist.isend, send[q], group=group, group_peer=q) for q in send]
        ops += [dist.P2POp(dist.irecv, recv[q], group=group, group_peer=q) for q in recv]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def naive() -> torch.Tensor:
        edge = {me - 1: x.narrow(-2, 0, width), me + 1: x.narrow(-2, n - width, width)}
        got = {q: torch.empty_like(edge[q], memory_format=torch.contiguous_format) for q in peers}
        post({q: edge[q].contiguous() for q in peers}, got)
        zero = torch.zeros_like(edge[me - 1])
        return torch.cat([got.get(me - 1, zero), x, got.get(me + 1, zero)], dim=-2)

    ext = halo_exchange(x, width, -2, group=group)  # a buffer of the extended shape that keeps x's epoch
    out = torch.empty_like(ext)

    def floor() -> None:
        post(sends, recvs)
        out.narrow(-2, width, n).copy_(x)

    return {"wire": lambda: post(sends, recvs), "floor": floor,
            "exchange": lambda: halo_exchange(x, width, -2, group=group),
            "unplanned": lambda: halo_exchange(local, width, -2, group=group),
            "inplace": lambda: halo_exchange_(ext, width, -2, group=group), "naive": naive,
            "copy": lambda: out.narrow(-2, width, n).copy_(x)}


def _check(x: torch.Tensor, fns: dict[str, Callable[[], Any]]) -> None:
    """exchange, unplanned, naive and inplace must agree (the benchmark times the right thing)."""
    want = fns["exchange"]().clone()
    for name in ("unplanned", "naive", "inplace"):
        got = fns[name]()
        if not torch.equal(got.float(), want.float()):
            raise RuntimeError(f"halo_bandwidth: {name} differs from halo_exchange for shape {tuple(x.shape)}")


def bandwidth_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    """One rank: time every impl for every case; returns rows (rank 0) or []."""
    import torch.distributed as dist

    from halo import shard
    from halo.launch import rank_device

    device = rank_device(cfg["backend"])
    group = dist.group.WORLD
    meta = run_meta(cfg["backend"], world, device)
    rows: list[dict] = []
    neighbours = min(2, world - 1)
    cases = len(cfg["dtypes"]) * len(cfg["layouts"]) * len(cfg["sizes"])
    began, case = time.perf_counter(), 0
    for dtype_name in cfg["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for layout in cfg["layouts"]:
            for size in cfg["sizes"]:
                case += 1
                if rank == 0:  # progress: a full CPU run takes about a minute
                    print(f"  bandwidth: case {case}/{cases}: {dtype_name}, {layout}, {size / KB:.0f} KB messages "
                          f"({time.perf_counter() - began:.0f} s so far)", flush=True)
                shape = _shape(size, cfg["width"], dtype, cfg["rows"])
                full = torch.randn((shape[0], shape[1], shape[2] * world, shape[3]),
                                   generator=torch.Generator().manual_seed(size)).to(device, dtype)
                if layout == "channels_last":
                    full = full.contiguous(memory_format=torch.channels_last)
                x = shard(full, group=group)  # as users make shards: halo knows its global extent
                del full
                local = x.clone()  # the same values, in a tensor halo did not make
                fns = _impls(x, local, cfg["width"], group)
                _check(x, fns)
                reps = cfg["reps"] if x.numel() * x.element_size() < 32 * MB else max(3, cfg["reps"] // 2)
                times = time_iterations(fns, reps, group, device)
                msg = cfg["width"] * shape[1] * shape[3] * x.element_size()
                wire = median(times["wire"])
                paired = {"exch/floor": paired_ratio(times["exchange"], times["floor"]),
                          "inplace/wire": paired_ratio(times["inplace"], times["wire"]),
                          "unplanned/floor": paired_ratio(times["unplanned"], times["floor"])}
                for impl in IMPLS:
                    t = median(times[impl])
                    rows.append(dict(meta, dtype=dtype_name, layout=layout, width=cfg["width"], rows=shape[2],
                                     channels=shape[1], lon=shape[3], msg_bytes=msg,
                                     shard_bytes=x.numel() * x.element_size(), impl=impl,
                                     time_us=f"{t * 1e6:.1f}", gb_s=f"{neighbours * msg / t / 1e9:.3f}",
                                     ratio_wire=f"{t / wire:.2f}", reps=reps,
                                     **{k.replace("/", "_per_"): f"{v:.3f}" for k, v in paired.items()}))
                del x, local, fns
    return rows if rank == 0 else []


def _summary(rows: list[dict]) -> list[dict]:
    """One line per case: the impls side by side."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["dtype"], r["layout"], int(r["msg_bytes"])), {})[r["impl"]] = r
    out = []
    for (dtype, layout, msg), by in cases.items():
        us = {k: float(v["time_us"]) for k, v in by.items()}
        out.append({"dtype": dtype, "layout": layout, "msg KB": f"{msg / KB:.0f}",
                    "shard KB": f"{int(by['wire']['shard_bytes']) / KB:.0f}",
                    **{f"{k} us": f"{us[k]:.0f}" for k in IMPLS},
                    "wire GB/s": by["wire"]["gb_s"], "exch GB/s": by["exchange"]["gb_s"],
                    "exch/floor": by["exchange"]["exch_per_floor"],
                    "inplace/wire": by["exchange"]["inplace_per_wire"],
                    "unplanned/floor": by["exchange"]["unplanned_per_floor"],
                    "naive/floor": f"{us['naive'] / us['floor']:.2f}"})
    return out


def _plot(rows: list[dict], path: Path) -> None:
    first = rows[0]
    sel = [r for r in rows if r["dtype"] == first["dtype"] and r["layout"] == "contiguous"] or rows
    gbs = {impl: [(int(r["msg_bytes"]) / MB, float(r["gb_s"])) for r in sel if r["impl"] == impl]
           for impl in IMPLS if impl != "copy"}
    floors = {(r["dtype"], r["layout"], r["msg_bytes"]): float(r["time_us"]) for r in rows if r["impl"] == "floor"}
    ratio = {f"{d} {lay}": [(int(r["msg_bytes"]) / MB, float(r["time_us"]) / floors[(d, lay, r["msg_bytes"])])
                            for r in rows if r["impl"] == "exchange" and r["dtype"] == d and r["layout"] == lay]
             for d in dict.fromkeys(r["dtype"] for r in rows) for lay in dict.fromkeys(r["layout"] for r in rows)}
    us = {impl: [(int(r["msg_bytes"]) / MB, float(r["time_us"])) for r in sel if r["impl"] == impl]
          for impl in IMPLS}
    plot_panels(path, [
        {"title": f"bandwidth ({first['dtype']}, contiguous)", "xlabel": "message MB", "ylabel": "GB/s",
         "series": gbs, "logx": True, "logy": True},
        {"title": "halo_exchange / its floor (goal 1.05)", "xlabel": "message MB", "ylabel": "ratio",
         "series": ratio, "logx": True, "hline": 1.05},
        {"title": "time per call (max over ranks, median)", "xlabel": "message MB", "ylabel": "us",
         "series": us, "logx": True, "logy": True},
    ], f"halo exchange on {first['device']}, {first['backend']}, {first['world']} ranks, shard rows "
       f"{first['rows']}, width {first['width']}")


def run(opts: dict, *, sizes: Sequence[int] | None = None, rows: int = 4, width: int = 1,
        dtypes: Sequence[str] | None = None, reps: int | None = None) -> int:
    """Run on ``opts['nproc']`` CPU ranks (or the torchrun world); print, append CSV, plot."""
    from halo.launch import is_printer, launch

    gpu = opts["backend"] == "nccl"
    quick = opts["quick"]
    if sizes is None:
        sizes = [4 * KB, MB] if quick else (GPU_SIZES if gpu else CPU_SIZES)
    if not gpu and is_printer() and max(sizes) > 16 * MB:
        print("note: on CPU, messages above 16 MB are slow to allocate and time; consider --sizes up to 16M")
    if not gpu and is_printer() and not quick:
        print("CPU/gloo: messages capped at 16 MB (GPU runs go to 256 MB)")
    cfg = {"backend": opts["backend"], "sizes": list(sizes), "rows": rows, "width": width,
           "dtypes": list(dtypes or (["float32"] if quick else ["float32", "bfloat16"])),
           "layouts": ["contiguous", "channels_last"], "reps": reps or (5 if quick else (30 if gpu else 15))}
    results = launch(rank_entry, opts["nproc"], "halo_bandwidth", "bandwidth_rank", cfg,
                     backend=opts["backend"], timeout=opts["timeout"])
    if not is_printer():
        return 0
    table = results[0]
    summary = _summary(table)
    print_table(summary, ["dtype", "layout", "msg KB", "shard KB", "wire us", "floor us", "exchange us",
                          "exch/floor", "inplace us", "inplace/wire", "unplanned us", "unplanned/floor",
                          "naive/floor", "copy us", "exch GB/s"])
    append_csv(Path(opts["out"]) / "halo_bandwidth.csv", table)
    _plot(table, Path(opts["out"]) / ("halo_bandwidth.png" if rows == 4 else f"halo_bandwidth_rows{rows}.png"))
    return 0


def _size(text: str) -> int:
    units = {"K": KB, "M": MB, "G": 2**30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    from halo.launch import default_backend

    parser = benchmark_parser(__doc__)
    parser.add_argument("--sizes", default=None, help="message sizes, e.g. 1K,64K,1M,16M")
    parser.add_argument("--rows", type=int, default=4, help="shard rows (default 4: halo-dominated)")
    parser.add_argument("--width", type=int, default=1, help="halo rows per side")
    parser.add_argument("--dtypes", default=None, help="e.g. float32,bfloat16")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0)
    a = parser.parse_args(argv)
    opts = {"quick": a.quick, "nproc": a.nproc, "backend": a.backend or default_backend(), "out": a.out,
            "timeout": a.timeout}
    sizes = [_size(s) for s in a.sizes.split(",")] if a.sizes else None
    return run_watched(lambda: run(opts, sizes=sizes, rows=a.rows, width=a.width, reps=a.reps,
                                   dtypes=a.dtypes.split(",") if a.dtypes else None), own=a.nproc)


if __name__ == "__main__":
    raise SystemExit(main())
