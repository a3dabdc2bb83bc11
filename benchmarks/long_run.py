"""Long runs at a fixed shape: memory stays flat, time stays flat, bits repeat; and the cost of validation.

Three parts, in one launch on ``--nproc`` ranks (gloo on CPU by default):

===========  ==========================================================================================
part         what is measured
===========  ==========================================================================================
validation   per call, interleaved: ``halo_exchange`` of a shard ``halo.shard`` made (``planned``: after the
             first call no agreement), of a shard the program sliced itself (``unplanned``: one small agreement
             of host data per call, then the exchange), the agreement alone (``agree``: gather + checks, no
             exchange) and a raw ``all_gather`` of the same int64 row on the host group (``gather floor``)
exchange     ``--steps`` (10,000) steps of ``halo_exchange`` forward + backward of a shard ``halo.shard`` made
             (the default path: buffers reused, no agreement): RSS, time per step, every step's output and
             gradient compared bitwise with the first step's
conv         ``--conv-steps`` (1,000) steps of a converted one-conv model forward + backward (a training step:
             one entry agreement per step), if ``halo.nn`` imports: RSS, time per step, bitwise repeat
===========  ==========================================================================================

Time per step is the max over ranks (docs/design.md, "Performance model"); ``slowdown`` compares the medians of the
last and the first 10 % of the steps. After every step a baseline runs and is timed the same way (exchange: the
same messages on the bare wire, forward and backward, plus one shard copy; conv: ``nn.Conv2d`` forward +
backward on a shard of the same size); ``slowdown vs baseline`` is the median of the per-step ratios step /
baseline over the last 10 % divided by that over the first 10 %, so that a machine whose load changes during the
run (a shared CPU) does not pass for halo slowing down.

RSS (resident set size, from ``/proc/self/statm``) is taken after the first 10 % (warm: allocator pools and
plans exist), every 1 % of the steps and at the end; ``rss growth`` is the largest growth over the ranks,
``rss MB/1k steps`` the largest least-squares slope after warm-up (a leak is a steady slope; the allocator's
arenas move RSS by a few MB either way). ``digest`` is a SHA-256 of the first
step's output and gradient, per rank: equal digests across runs are run-to-run bitwise determinism, and
``steps differing`` counts steps whose bits differ from the first step's. Results: a table, rows appended to
``OUT/long_run.csv``, a plot ``OUT/long_run.png``.

    python benchmarks/long_run.py [--quick] [--nproc 2] [--steps 10000] [--conv-steps 1000]
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from halo.tools.bench import (
    append_csv,
    benchmark_parser,
    gather_times,
    median,
    plot_panels,
    print_table,
    rank_entry,
    run_meta,
    time_iterations,
)

__all__ = ["main", "run"]

SHAPE = (2, 16, 90, 180)  # global (B, C, H, W) of the exchange run: a 1 MB float32 shard on each of 2 ranks
CONV_SHAPE = (1, 16, 90, 128)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    return full.tensor_split(world, dim=-2)[rank].contiguous()


def _validation(full: torch.Tensor, world: int, rank: int, group: Any, reps: int,
                device: Any) -> dict[str, float]:
    import torch.distributed as dist

    from halo import shard
    from halo.dist.comm import comm_group
    from halo.exchange import halo_exchange
    from halo.plan.agree import ROW_WORDS, Meta, Spec, agree, needs_grad

    info = comm_group(group)
    x = shard(full, group=group)
    local = _shard(full, world, rank)
    words = torch.zeros(ROW_WORDS, dtype=torch.int64)
    table = [torch.empty_like(words) for _ in range(info.size)]

    fns: dict[str, Callable[[], Any]] = {
        "planned": lambda: halo_exchange(x, 1, group=group),
        "unplanned": lambda: halo_exchange(local, 1, group=group),
        "agree": lambda: agree(Meta.of(local, (Spec.of(-2, 1, "zeros"),), needs_grad(local)), info, "bench"),
        "gather floor": lambda: dist.all_gather(table, words, group=info.host),
    }
    times = time_iterations(fns, reps, group, device, warmup=5)
    return {name: median(ts) for name, ts in times.items()}


def _long(step: Callable[[], tuple[torch.Tensor, ...]], baseline: Callable[[], Any], steps: int,
          group: Any) -> dict[str, Any]:
    """Run ``step`` ``steps`` times; time, RSS and bitwise equality with the first step's result.

    ``baseline`` (the same work without halo: the wire, a plain conv) runs after every step and is timed too,
    so that a change of machine load over the run is not read as a slowdown of halo.
    """
    first = tuple(t.detach().clone() for t in step())
    digest = _digest(*first)
    times, base, rss, differ = [], [], [], 0
    warm = max(1, steps // 10)
    rss_warm = _rss_mb()
    for i in range(steps):
        if i == warm:
            rss_warm = _rss_mb()
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        baseline()
        base.append(time.perf_counter() - t0)
        differ += not all(torch.equal(a, b) for a, b in zip(out, first, strict=True))
        if i % max(1, steps // 100) == 0:
            rss.append((i, _rss_mb()))
    rss.append((steps, _rss_mb()))
    times, base = gather_times(times, group), gather_times(base, group)
    tenth = max(1, steps // 10)
    return {"times": times, "rss": rss, "rss_warm": rss_warm, "rss_end": rss[-1][1], "differ": differ,
            "digest": digest, "first": median(times[:tenth]), "last": median(times[-tenth:]),
            "base_first": median(base[:tenth]), "base_last": median(base[-tenth:]),
            "ratio_first": median([t / b for t, b in zip(times[:tenth], base[:tenth], strict=True)]),
            "ratio_last": median([t / b for t, b in zip(times[-tenth:], base[-tenth:], strict=True)]),
            "slope": _slope([p for p in rss if p[0] >= warm])}


def _slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares growth of RSS in MB per 1,000 steps (a leak is a steady slope; allocator noise is not)."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] / 1000 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def long_run_rank(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    import torch.distributed as dist

    import halo
    from halo.dist.comm import abandoned
    from halo.exchange import halo_exchange
    from halo.launch import rank_device

    device = rank_device(cfg["backend"])
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(2024)
    out: dict[str, Any] = {"meta": run_meta(cfg["backend"], world, device)}

    out["validation"] = {}
    for shape in cfg["validation_shapes"]:
        out["validation"][shape] = _validation(torch.randn(shape, generator=gen).to(device), world, rank, group,
                                               cfg["reps"], device)

    x = halo.shard(torch.randn(SHAPE, generator=gen).to(device), group=group).requires_grad_(True)
    weight = torch.randn(x.shape[:-2] + (x.shape[-2] + 4, x.shape[-1]), generator=gen).to(device)

    def exchange_step() -> tuple[torch.Tensor, ...]:
        x.grad = None
        ext = halo_exchange(x, 2, group=group, boundary="circular")
        ext.backward(weight)
        return ext, x.grad

    peer = (rank + 1) % world
    send, recv = (torch.randn(4, *x.shape[:-2], x.shape[-1]).to(device) for _ in range(2))

    def wire_and_copy() -> None:
        """The floor of one step: the same message both ways, forward and backward, plus a shard copy."""
        for _ in range(2):
            ops = [dist.P2POp(dist.isend, send, group=group, group_peer=peer),
                   dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        x.detach().clone()

    out["exchange"] = _long(exchange_step, wire_and_copy, cfg["steps"], group)
    out["abandoned"] = abandoned()

    if cfg["conv_steps"]:
        try:
            from halo.nn import convert_to_domain_parallel
        except ImportError as exc:
            out["conv"] = f"skipped: halo.nn does not import ({exc})"
            return out
        torch.manual_seed(0)
        manager = halo.initialize_domain_parallel(world, world)
        conv = convert_to_domain_parallel(
            torch.nn.Sequential(torch.nn.Conv2d(CONV_SHAPE[1], CONV_SHAPE[1], 3, padding=1)).to(device), manager)
        xc = _shard(torch.randn(CONV_SHAPE, generator=gen), world, rank).to(device).requires_grad_(True)

        def conv_step() -> tuple[torch.Tensor, ...]:
            conv.zero_grad(set_to_none=True)
            xc.grad = None
            y = conv(xc)
            y.square().mean().backward()
            return y, xc.grad, conv[0].weight.grad

        plain = torch.nn.Conv2d(CONV_SHAPE[1], CONV_SHAPE[1], 3, padding=1).to(device)

        def plain_conv() -> None:
            """The floor: nn.Conv2d forward + backward on a shard of the same size, no exchange."""
            plain.zero_grad(set_to_none=True)
            xp = xc.detach().requires_grad_(True)
            plain(xp).square().mean().backward()

        out["conv"] = _long(conv_step, plain_conv, cfg["conv_steps"], group)
    return out


def _rows(results: list[dict], cfg: dict) -> tuple[list[dict], list[dict]]:
    meta = results[0]["meta"]
    rows, table = [], []
    for shape, t in results[0]["validation"].items():
        shard_kb = torch.Size(shape).numel() * 4 / len(results) / 2**10
        row = {"part": "validation", "shape": "x".join(map(str, shape)), "shard KB": f"{shard_kb:.0f}",
               **{f"{k} us": f"{v * 1e6:.0f}" for k, v in t.items()},
               "agreement cost us": f"{(t['unplanned'] - t['planned']) * 1e6:.0f}"}
        table.append(row)
        rows.append(dict(meta, **row))
    for part, steps in (("exchange", cfg["steps"]), ("conv", cfg["conv_steps"])):
        res = results[0].get(part)
        if isinstance(res, str) or res is None:
            if res:
                print(f"{part}: {res}")
            continue
        growth = max(r[part]["rss_end"] - r[part]["rss_warm"] for r in results)
        row = {"part": part, "steps": steps, "first 10% us": f"{res['first'] * 1e6:.0f}",
               "last 10% us": f"{res['last'] * 1e6:.0f}", "slowdown": f"{res['last'] / res['first']:.3f}",
               "baseline first us": f"{res['base_first'] * 1e6:.0f}",
               "baseline last us": f"{res['base_last'] * 1e6:.0f}",
               "slowdown vs baseline": f"{res['ratio_last'] / res['ratio_first']:.3f}",
               "rss warm MB": f"{max(r[part]['rss_warm'] for r in results):.1f}",
               "rss end MB": f"{max(r[part]['rss_end'] for r in results):.1f}", "rss growth MB": f"{growth:.2f}",
               "rss MB/1k steps": f"{max(r[part]['slope'] for r in results):+.3f}",
               "steps differing": sum(r[part]["differ"] for r in results),
               "digest": "/".join(r[part]["digest"] for r in results)}
        table.append(row)
        rows.append(dict(meta, **row))
    fields = list(dict.fromkeys(k for r in rows for k in r))  # one CSV header for both kinds of row
    return [{k: r.get(k, "") for k in fields} for r in rows], table


def _plot(results: list[dict], path: Path) -> None:
    panels = []
    for part in ("exchange", "conv"):
        res = results[0].get(part)
        if not isinstance(res, dict):
            continue
        t = res["times"]
        k = max(1, len(t) // 100)
        smooth = [(i, median(t[i:i + k]) * 1e6) for i in range(0, len(t) - k + 1, k)]
        panels.append({"title": f"{part}: time per step (median of {k})", "xlabel": "step", "ylabel": "us",
                       "series": {"max over ranks": smooth}})
        panels.append({"title": f"{part}: RSS", "xlabel": "step", "ylabel": "MB",
                       "series": {f"rank {r}": out[part]["rss"] for r, out in enumerate(results)}})
    if panels:
        meta = results[0]["meta"]
        plot_panels(path, panels, f"halo long run on {meta['device']}, {meta['backend']}, {meta['world']} ranks")


def run(opts: dict, *, steps: int | None = None, conv_steps: int | None = None, reps: int | None = None) -> int:
    from halo.launch import is_printer, launch

    quick = opts["quick"]
    cfg = {"backend": opts["backend"], "steps": steps if steps is not None else (1000 if quick else 10000),
           "conv_steps": conv_steps if conv_steps is not None else (100 if quick else 1000),
           "reps": reps or (50 if quick else 300),
           "validation_shapes": [(1, 8, 32, 64), SHAPE]}
    results = launch(rank_entry, opts["nproc"], "long_run", "long_run_rank", cfg, backend=opts["backend"],
                     timeout=opts["timeout"])
    if not is_printer():
        return 0
    rows, table = _rows(results, cfg)
    print_table([r for r in table if r["part"] == "validation"],
                ["shape", "shard KB", "planned us", "unplanned us", "agreement cost us", "agree us",
                 "gather floor us"])
    print()
    print_table([r for r in table if r["part"] != "validation"],
                ["part", "steps", "first 10% us", "last 10% us", "slowdown", "baseline first us", "baseline last us",
                 "slowdown vs baseline", "rss warm MB", "rss end MB",
                 "rss growth MB", "rss MB/1k steps", "steps differing", "digest"])
    if any(r["abandoned"] for r in results):
        print(f"abandoned message buffers: {[r['abandoned'] for r in results]} (expected none)")
    append_csv(Path(opts["out"]) / "long_run.csv", rows)
    _plot(results, Path(opts["out"]) / "long_run.png")
    bad = any(r[p]["differ"] for r in results for p in ("exchange", "conv") if isinstance(r.get(p), dict))
    return int(bad)


def main(argv: Sequence[str] | None = None) -> int:
    from halo.launch import default_backend

    parser = benchmark_parser(__doc__)
    parser.add_argument("--steps", type=int, default=None, help="exchange steps (default 10000)")
    parser.add_argument("--conv-steps", type=int, default=None, help="DomainConv2d steps (default 1000; 0: none)")
    parser.add_argument("--reps", type=int, default=None, help="validation timing repetitions")
    parser.add_argument("--timeout", type=float, default=1800.0)
    a = parser.parse_args(argv)
    opts = {"quick": a.quick, "nproc": a.nproc, "backend": a.backend or default_backend(), "out": a.out,
            "timeout": a.timeout}
    return run(opts, steps=a.steps, conv_steps=a.conv_steps, reps=a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
