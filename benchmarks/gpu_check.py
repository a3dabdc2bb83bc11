"""One CUDA GPU: what a steady step of a converted model asks of the device, and what the layers cost there.

Part of ``benchmarks/gpu_check.sh`` (the kernels' tests and bandwidth run before it). One process, one rank (one GPU
cannot hold an NCCL group of several ranks): the demo model is converted with the pole boundary, so every halo
exchange still runs (its rows come across the pole from the rank itself), every layer resolves its plan, and the
GroupNorm takes its domain path's plan. Checks, each bounded in time and reported even if another fails:

=============  ===================================================================================================
check          passes when
=============  ===================================================================================================
sync-free      a steady training step (forward, loss, backward, SGD step) runs under
               ``torch.cuda.set_sync_debug_mode("error")`` without raising (no device-to-host read, no blocking
               host-to-device copy), and :class:`halo.testing.HostWorkCounter` counts no read and no tensor built
               from Python data
cuda-graph     the step's forward and backward are captured in a CUDA graph and a replay gives the eager
               step's output and input gradient (bitwise)
compile        ``torch.compile(model, fullgraph=True)`` with inductor compiles once and gives the eager output
               and gradients to 1e-2 relative (bf16) / 1e-4 (fp32)
conv           HaloConv2d (compute-then-patch, pole boundary) vs nn.Conv2d fwd + bwd on the same local shape,
               3x3, bf16, CUDA events: the ratio (the layer's own overhead on a GPU: the strips, the pack and
               assemble kernels, Python), reported, not judged
=============  ===================================================================================================

Writes ``gpu_check.json`` and a table to ``--out``. Exit status 1 if a check fails. ``--device cpu`` runs what can
run without a GPU (a dry run of the script itself).

    python benchmarks/gpu_check.py [--out DIR] [--device cuda] [--grid 721x1440]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _init(device: torch.device) -> None:
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="halo_gpu_check_"), "store"), 1)
    if device.type == "cuda" and dist.is_nccl_available():
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _model(device: torch.device, dtype: torch.dtype, grid: tuple[int, int]) -> tuple[Any, Any, Any, Any]:
    import halo
    from halo.demo import DemoNet, make_field, pole_boundary
    from halo.nn import convert_to_domain_parallel

    h, w = grid
    manager = halo.initialize_domain_parallel(1, 1)
    torch.manual_seed(0)
    net = DemoNet(4, 32, grid).to(device, dtype)
    model = convert_to_domain_parallel(copy.deepcopy(net), manager, boundary=pole_boundary(h))
    field = make_field(h, w, 4, 0).to(device, dtype)
    return model, manager, field, field.roll(max(1, w // 72), dims=-1)


def check_sync_free(device: torch.device, grid: tuple[int, int]) -> dict:
    from halo.reduce import domain_mean, sync_domain_gradients
    from halo.testing import HostWorkCounter

    model, manager, x, y = _model(device, torch.float32, grid)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        domain_mean((model(x) - y) ** 2).backward()
        sync_domain_gradients(model, manager)
        opt.step()

    for _ in range(3):
        step()
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            out["sync_debug"] = "no sync"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    else:
        out["sync_debug"] = "skipped: no CUDA"
    with HostWorkCounter(keep_stacks=True) as counter:
        step()
    out["counts"] = counter.summary()
    out["where"] = {k: v[:3] for k, v in counter.where.items() if k in ("read", "from_data")}
    out["ok"] = counter.counts.get("read", 0) == 0 and counter.counts.get("from_data", 0) == 0
    return out


def check_cuda_graph(device: torch.device, grid: tuple[int, int]) -> dict:
    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA"}
    model, _, x, y = _model(device, torch.float32, grid)
    xs = x.clone().requires_grad_(True)

    def fwd_bwd() -> torch.Tensor:
        xs.grad = None
        out = model(xs)
        ((out - y) ** 2).mean().backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on a side stream, as capture wants
            eager = fwd_bwd().detach().clone()
            eager_grad = xs.grad.detach().clone()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for p in model.parameters():
        p.grad = None
    with torch.cuda.graph(graph):
        captured = fwd_bwd()
    captured_grad = xs.grad
    graph.replay()
    torch.cuda.synchronize()
    return {"ok": bool(torch.equal(captured, eager) and torch.equal(captured_grad, eager_grad)),
            "max_diff_out": float((captured - eager).abs().max()),
            "max_diff_grad": float((captured_grad - eager_grad).abs().max())}


def check_compile(device: torch.device, grid: tuple[int, int]) -> dict:
    import torch._dynamo

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _, x, y = _model(device, dtype, grid)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    torch._dynamo.utils.counters.clear()
    res = {}
    for name, fn in (("eager", model), ("compiled", compiled), ("compiled again", compiled)):
        xi = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        out = fn(xi)
        ((out.float() - y.float()) ** 2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        res[name] = (out.detach().float(), xi.grad.float(), time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    errs = {"out": rel(res["compiled"][0], res["eager"][0]), "grad": rel(res["compiled"][1], res["eager"][1]),
            "again": rel(res["compiled again"][0], res["eager"][0])}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"ok": max(errs.values()) < tol and graphs == 1, "errors": errs, "graphs": graphs,
            "first_call_s": round(res["compiled"][2], 2), "second_call_s": round(res["compiled again"][2], 4)}


def bench_conv(device: torch.device, grid: tuple[int, int], channels: tuple[int, ...]) -> dict:
    import halo
    from halo.nn import HaloConv2d

    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA (CPU ratios: benchmarks/conv_overhead.py)"}
    halo.initialize_domain_parallel(1, 1)
    h, w = grid
    rows = {}
    for c in channels:
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(c, c, 3, padding=(1, 1), padding_mode="circular").to(device, torch.bfloat16)
        layer = HaloConv2d(conv, boundary="pole")
        x = torch.randn(1, c, h, w, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(1, c, h, w, device=device, dtype=torch.bfloat16)

        def run(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor = x, g: torch.Tensor = g) -> None:
            x.grad = None
            fn(torch.nn.functional.gelu(x)).backward(g)

        times: dict[str, list[float]] = {"plain": [], "halo": []}
        for i in range(25):
            for name, fn in (("plain", conv), ("halo", layer)) if i % 2 else (("halo", layer), ("plain", conv)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(fn)
                end.record()
                end.synchronize()
                if i >= 5:
                    times[name].append(start.elapsed_time(end))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows[c] = {"plain_ms": round(med["plain"], 3), "halo_ms": round(med["halo"], 3),
                   "ratio": round(med["halo"] / med["plain"], 3)}
    return {"ok": True, "grid": f"{h}x{w}", "dtype": "bfloat16", "channels": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/out")))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--grid", default="721x1440")
    parser.add_argument("--channels", default="64,256")
    a = parser.parse_args(argv)
    device = torch.device(a.device if a.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    grid = tuple(int(v) for v in a.grid.lower().split("x"))
    _init(device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    checks = {"sync-free": lambda: check_sync_free(device, grid), "cuda-graph": lambda: check_cuda_graph(device, grid),
              "compile": lambda: check_compile(device, grid),
              "conv": lambda: bench_conv(device, grid, tuple(int(c) for c in a.channels.split(",")))}
    status = 0
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - every check reports, the others still run
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report[name] = res
        status |= not res.get("ok", False)
        print(f"{name:>11}: {'ok' if res.get('ok') else 'FAILED'} "
              f"{json.dumps({k: v for k, v in res.items() if k not in ('trace', 'where')}, default=str)}",
              flush=True)
        if not res.get("ok") and "trace" in res:
            print(res["trace"], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
