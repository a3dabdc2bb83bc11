"""The first GPU run, prepared to inform: one part per call, each result written as soon as the part ends.

Run by ``benchmarks/gpu_check.sh`` (each part under its own ``timeout``, cut to what is left of the script's 6.5
minutes; a killed part loses only its unfinished checks)::

    python3 benchmarks/gpu_check.py --part kernels|pack|step|nccl2|conv [--out DIR] [--dry-run]

======  =========================================================================================================
part    what it measures / checks
======  =========================================================================================================
kernels every Triton kernel (pack, unpack, pack_adjoint, Philox draws, dropout) against its torch reference at
        FIXED shapes (no hypothesis on the device: every new shape is a cold compile), bf16 and float32; offsets
        beyond 2**31 elements; the dry run: two shapes through Triton's interpreter
pack    the production pack / unpack paths (``halo.kernels.pack``, ``unpack``, a whole 1-rank pole
        ``halo_exchange``) at 181x1440 and 721x1440, 64 / 256 channels, bf16, against ``copy_`` and ``F.pad`` of the
        same shard: 50 back-to-back calls (device time per call from CUDA events; host microseconds per call apart)
        and one CUDA graph of 50 calls (device time per call of a replay)
step    the demo model (converted, 1 rank, pole boundary, 181x360): 16 steady training steps (two periods of the
        every-8th replicated-state check) each under ``torch.cuda.set_sync_debug_mode("warn")`` (syncs recorded per
        step) and ``HostWorkCounter`` (no read, no tensor from data); the whole
        step (forward + backward) captured in one CUDA graph vs eager (``cudnn.deterministic``, a tolerance);
        per-module ``torch.cuda.make_graphed_callables`` vs eager; bf16 autocast vs the unsharded reference under the
        same autocast; inductor on a channels_last input vs eager
nccl2   two ranks on the one GPU with real NCCL (a different ``NCCL_HOSTID`` per rank, ``NCCL_IB_DISABLE=1``,
        sockets on loopback) running the demo model at 181x360: halo's gloo host groups made by the mesh (NCCL
        alone), the torch-version paths (``new_group(sort_ranks=False)``: torch 2.11's and >= 2.12's, the older one
        simulated on a newer torch), ``check_equivalence`` on CUDA (float64), 16 sync-free steady steps (p2p
        exchanges, GroupNorm and loss all-reduces, the replicated-state check at steps 8 and 16), and the forward +
        backward with its p2p messages captured in a CUDA graph vs eager
conv    DomainConv2d (compute-then-patch, pole boundary, 1 rank) vs ``nn.Conv2d`` fwd + bwd at 181 and 721 rows x 1440,
        bf16, 64 / 256 channels, eager and graph-replayed (device time per call; the ratio reported, not judged)
======  =========================================================================================================

Each part writes ``gpu_check_<part>.json`` to ``--out`` (and appends it to ``gpu_check.jsonl``; the shell script
packs ``--out`` into one archive); exit status 1 if a check of the part failed. ``--dry-run``: every part on the CPU
(gloo, tiny sizes, float32, Triton's interpreter); what needs CUDA reports ``"skipped: no CUDA"`` — what CI runs
(``tests/test_gpu_check_dryrun.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

NO_CUDA = "skipped: no CUDA"
PARTS = ("kernels", "pack", "step", "nccl2", "conv")
SIZES = {"hidden": 32, "warm": 3}  # the demo model's width and warm-up steps (smaller in a dry run)


# -- plumbing ---------------------------------------------------------------------------------------------------

def _write(out: Path, part: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_check_{part}.json").write_text(json.dumps(result, indent=1, default=str))
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps({"part": part, **result}, default=str) + "\n")


#: where the running part writes its report so far after each check (main sets it): a part killed at its budget
#: keeps the checks that finished (``gpu_check_<part>.partial.json`` in the archive)
PARTIAL: dict[str, Any] = {"path": None}


def _checked(name: str, fn: Callable[[], dict], report: dict) -> None:
    """Run one check; its result (or its error) into ``report[name]``: every check reports, the others still run."""
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - t0, 2)
    report[name] = res
    shown = {k: v for k, v in res.items() if k not in ("trace", "where")}
    print(f"  {name:>18}: {'ok' if res.get('ok') else 'FAILED'} {json.dumps(shown, default=str)[:1500]}", flush=True)
    if not res.get("ok") and "trace" in res:
        print(res["trace"], flush=True)
    if PARTIAL["path"] is not None:
        PARTIAL["path"].write_text(json.dumps(report, indent=1, default=str))


def _device(dry: bool) -> Any:
    import torch

    if dry or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _init_one(device: Any) -> None:
    """A one-rank process group (NCCL with ``device_id`` on CUDA, else gloo): every halo exchange still runs."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="halo_gpu_check_"), "store"), 1)
    if device.type == "cuda" and dist.is_nccl_available():
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], n: int, device: Any, *, graph: bool = True) -> dict:
    """``fn`` ``n`` times back to back: device ms per call (CUDA events; wall time on the CPU) and host us per call
    (launch time); then, on CUDA, one graph of ``n`` calls replayed: device ms per call."""
    import torch

    for _ in range(3):
        fn()
    _sync(device)
    res: dict[str, Any] = {"calls": n}
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        res["eager_device_ms"] = round(start.elapsed_time(end) / n, 4)
    else:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t0
        res["eager_wall_ms"] = round(host * 1e3 / n, 4)
    res["eager_host_us"] = round(host * 1e6 / n, 1)
    if not graph:
        return res
    if device.type != "cuda":
        res["graph"] = NO_CUDA
        return res
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    g.replay()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    res["graph_device_ms"] = round(start.elapsed_time(end) / n, 4)
    res["graph_replay_host_us"] = round(host * 1e6, 1)
    del g
    return res


# -- part: the Triton kernels at fixed shapes ------------------------------------------------------------------------

#: (shape, layout, dim, ranges): the cases an exchange makes and the edges; fixed (no hypothesis: each new shape is a
#: cold Triton compile, ~1 s on the device), 2 dtypes, about 30 compiles in all
KERNEL_CASES = (
    ((2, 5, 9, 7), "contiguous", -2, ((0, 2), (7, 2))),  # both halo sides of H
    ((2, 5, 9, 7), "channels_last", -2, ((0, 1), (8, 1))),
    ((2, 3, 4, 5, 6), "channels_last", 2, ((0, 4), (1, 2))),  # 5-D, channels_last_3d
    ((2, 3, 11, 5), "contiguous", 2, tuple((k, 2) for k in range(10))),  # > MAX_RANGES: chunked launches
    ((1, 64, 181, 1440), "contiguous", -2, ((0, 1), (180, 1))),  # a production shard's halo rows
)


def _layout(x: Any, layout: str) -> Any:
    import torch

    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def _bitwise(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))


def part_kernels(dry: bool) -> dict:
    """Every Triton kernel (pack, unpack, pack_adjoint, Philox draws and dropout) against its torch reference at
    fixed shapes: compiled on CUDA, through Triton's interpreter on CPU (the dry run, tiny shapes only); plus, on a
    GPU with the memory, offsets beyond 2**31 elements (int64 program offsets)."""
    import torch

    import halo.kernels as hk
    from halo.kernels import reference as ref

    if not hk.HAS_TRITON:
        return {"triton": {"ok": False, "error": f"triton is not importable: {hk.TRITON_IMPORT_ERROR}"}}
    device = _device(dry)
    cases = KERNEL_CASES[:2] if dry else KERNEL_CASES  # the interpreter: ~ms per program
    dtypes = (torch.bfloat16,) if dry else (torch.bfloat16, torch.float32)
    report: dict[str, Any] = {"device": str(device), "interpreter": device.type == "cpu"}
    gen = torch.Generator().manual_seed(0)
    for i, (shape, layout, dim, ranges) in enumerate(cases):
        def run(shape: tuple = shape, layout: str = layout, dim: int = dim, ranges: tuple = ranges) -> dict:
            res: dict[str, Any] = {"shape": shape, "layout": layout}
            for dt in dtypes:
                x = _layout(torch.randn(shape, generator=gen).to(device, dt), layout)
                want = ref.pack(x, dim, ranges)
                got = hk.pack(x, dim, ranges, impl="triton")
                lo, hi = want[:1], want[1:2]
                unpacked = hk.unpack(x, lo, hi, dim, impl="triton")
                buf = torch.randn(want.shape, generator=gen).to(device, dt)
                adj, adj_ref = hk.pack_adjoint(x, dim, ranges, buf, impl="triton"), ref.pack_adjoint(x, dim, ranges,
                                                                                                    buf)
                eps = torch.finfo(dt).eps
                res[str(dt)] = {
                    "pack": _bitwise(got, want), "unpack": _bitwise(unpacked, ref.unpack(x, lo, hi, dim)),
                    "unpack_strides": unpacked.stride() == ref.unpack(x, lo, hi, dim).stride(),
                    "pack_adjoint": bool(torch.allclose(adj.float(), adj_ref.float(), rtol=eps, atol=16 * eps))}
            res["ok"] = all(all(v.values()) for k, v in res.items() if k.startswith("torch."))
            return res

        _checked(f"copies {i}", run, report)

    def philox() -> dict:
        key = torch.tensor(123456789, dtype=torch.int64, device=device)
        n, run_, stride, offset = (96, 12, 40, 7) if dry else (1 << 20, 1440, 2880, 1440)
        got = hk.bits(key, n, run_, stride, offset, 3, 1, impl="triton")
        want = hk.bits(key, n, run_, stride, offset, 3, 1, impl="reference")
        res: dict[str, Any] = {"bits": _bitwise(got, want)}
        for dt in dtypes:
            x = torch.randn(n, generator=gen).to(device, dt)
            res[f"dropout {dt}"] = _bitwise(hk.dropout(x, key, run_, stride, offset, 3, 1 << 22, 2.0, impl="triton"),
                                            hk.dropout(x, key, run_, stride, offset, 3, 1 << 22, 2.0,
                                                       impl="reference"))
        res["ok"] = all(res.values())
        return res

    _checked("philox", philox, report)

    def beyond_int32() -> dict:
        if device.type != "cuda":
            return {"ok": True, "skipped": NO_CUDA}
        cols, rows = 1024, 2**31 // 1024 + 8
        if torch.cuda.mem_get_info()[0] < 3 * rows * cols * 2 + 2**31:
            return {"ok": False, "error": "needs ~16 GB of free GPU memory"}
        x = torch.arange(rows, device=device, dtype=torch.int32).remainder_(127).to(torch.uint8)
        x = x[:, None].expand(-1, cols).contiguous()
        buf = hk.pack(x, 0, [(rows - 3, 3), (0, 1)])
        ok = bool(torch.equal(buf[:3], x[-3:]) and torch.equal(buf[3:], x[:1]))
        out = hk.unpack(x, buf[:2], buf[2:], 0)
        ok = ok and bool(torch.equal(out[-2:], buf[2:]) and torch.equal(out[2:-2], x) and torch.equal(out[:2], buf[:2]))
        del out, x, buf
        torch.cuda.empty_cache()
        return {"ok": ok, "elements": rows * cols}

    _checked("offsets > 2**31", beyond_int32, report)
    return report


# -- part: pack / unpack ----------------------------------------------------------------------------------------

def part_pack(dry: bool) -> dict:
    import torch
    import torch.nn.functional as F

    import halo
    from halo import kernels

    device = _device(dry)
    _init_one(device)
    halo.initialize_domain_parallel(1, 1)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows_list, chans, width, n = ((7,), (4,), 16, 5) if dry else ((181, 721), (64, 256), 1440, 50)
    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "width": width}
    for h in rows_list:
        for c in chans:
            x = torch.randn(1, c, h, width, device=device, dtype=dtype)
            send = torch.empty(2, 1, c, width, device=device, dtype=dtype)
            ext = torch.empty(1, c, h + 2, width, device=device, dtype=dtype)
            lo, hi = send[:1], send[1:]
            same = torch.empty_like(x)
            ops = {
                "pack 2 rows": lambda x=x, send=send, h=h: kernels.pack(x, -2, [(0, 1), (h - 1, 1)], out=send),
                "unpack into padded": lambda x=x, lo=lo, hi=hi, ext=ext: kernels.unpack(x, lo, hi, -2, ext),
                "halo_exchange pole": lambda x=x: halo.halo_exchange(x, 1, boundary="pole"),
                "copy_": lambda x=x, same=same: same.copy_(x),
                "F.pad": lambda x=x: F.pad(x, (0, 0, 1, 1)),
            }

            def run(ops: dict = ops, mb: float = x.numel() * x.element_size() / 2**20) -> dict:
                rows: dict[str, Any] = {"ok": True, "shard_mb": round(mb, 2)}
                for name, fn in ops.items():  # one failing op (e.g. its capture) does not hide the others
                    try:
                        rows[name] = time_calls(fn, n, device)
                    except Exception as exc:  # noqa: BLE001 - reported
                        rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                        rows["ok"] = False
                return rows

            _checked(f"{h}x{width} c{c}", run, report)
    return report


# -- part: one-rank steady step -----------------------------------------------------------------------------------

def _demo(device: Any, dtype: Any, grid: tuple[int, int]) -> tuple:
    import copy

    import torch

    import halo
    from halo.check import boundary_reference
    from halo.nn import convert_to_domain_parallel
    from halo.tools.demo import DemoNet, make_field, pole_boundary

    h, w = grid
    manager = halo.get_domain_parallel_manager()
    if manager is None:
        import torch.distributed as dist

        manager = halo.initialize_domain_parallel(dist.get_world_size(), dist.get_world_size())
    torch.manual_seed(0)
    net = DemoNet(4, SIZES["hidden"], grid).to(device, dtype)
    boundary = pole_boundary(h)
    model = convert_to_domain_parallel(copy.deepcopy(net), manager, boundary=boundary)
    ref = boundary_reference(copy.deepcopy(net), boundary)
    field = make_field(h, w, 4, 0).to(device, dtype)
    return net, model, ref, manager, field, field.roll(max(1, w // 72), dims=-1), boundary


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


#: steady steps checked for host syncs: two periods of the replicated-state check (every 8th forward by default,
#: :func:`halo.plan.replicated.check_every`), so a sync that only that check makes is among them
STEADY_STEPS = 16


def steady_steps(step: Callable[[], None], cuda: bool, n: int = STEADY_STEPS) -> dict:
    """``step()`` ``n`` times after the warm-up, each under :class:`halo.testing.HostWorkCounter` (reads of a tensor
    into Python, tensors from Python data, agreements, c10d calls) and, on CUDA, ``set_sync_debug_mode("warn")``
    with its warnings recorded per step (``"error"`` would stop at the first sync and hide the steps after it).
    ``ok``: no step read a tensor, built one from data, or synchronised."""
    import warnings

    import torch

    from halo.testing import HostWorkCounter

    per_step, syncs, where = [], {}, {}
    for i in range(1, n + 1):
        if cuda:
            torch.cuda.synchronize()
        with HostWorkCounter(keep_stacks=True) as counter, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        hits = [str(w.message)[:300] for w in caught if "synchroniz" in str(w.message).lower()]
        if hits:
            syncs[i] = hits[:2]
        counts = dict(counter.counts)
        per_step.append(counts)
        for key in ("read", "from_data"):
            if counts.get(key) and key not in where:
                where[key] = {"step": i, "stacks": counter.where[key][:3]}
    bad = [i for i, c in enumerate(per_step, 1) if c.get("read", 0) or c.get("from_data", 0)]
    return {"ok": not bad and not syncs, "steps": n, "steps_with_host_reads": bad,
            "cuda_syncs": syncs if cuda else NO_CUDA, "sync_debug": ("no sync" if not syncs else "synced")
            if cuda else NO_CUDA, "per_step": per_step, "where": where}


def check_sync_free(device: Any, grid: tuple[int, int]) -> dict:
    import torch

    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.shard import shard

    _, model, _, manager, x, y, _ = _demo(device, torch.float32, grid)
    x, y = shard(x, group=manager.domain_group), shard(y, group=manager.domain_group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        domain_mean((model(x) - y) ** 2).backward()
        sync_domain_gradients(model, manager)
        opt.step()

    for _ in range(SIZES["warm"]):
        step()
    return steady_steps(step, device.type == "cuda")


def check_step_graph(device: Any, grid: tuple[int, int]) -> dict:
    """The whole forward + backward in one CUDA graph vs eager, cudnn deterministic: equal to 1e-6 relative."""
    import torch

    if device.type != "cuda":
        return {"ok": True, "skipped": NO_CUDA}
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    _, model, _, _, x, y, _ = _demo(device, torch.float32, grid)
    xs = x.clone().requires_grad_(True)

    def fwd_bwd() -> Any:
        xs.grad = None
        out = model(xs)
        ((out - y) ** 2).mean().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up on a side stream, as capture wants
            eager = fwd_bwd().detach().clone()
            eager_grad = xs.grad.detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd()
    captured_grad = xs.grad
    graph.replay()
    torch.cuda.synchronize()
    errs = {"out": _rel(captured, eager), "grad": _rel(captured_grad, eager_grad)}
    return {"ok": max(errs.values()) <= 1e-6, "errors": errs, "bitwise": bool(torch.equal(captured, eager))}


def check_graphed_callables(device: Any, grid: tuple[int, int]) -> dict:
    """Every child module of the converted model graphed with ``make_graphed_callables`` (one shared memory pool:
    the case where a module could be handed a buffer another saved for backward) vs eager: out, input and
    parameter gradients to 1e-5 relative."""
    import torch

    if device.type != "cuda":
        return {"ok": True, "skipped": NO_CUDA}
    torch.backends.cudnn.deterministic = True
    _, model, _, _, x, y, _ = _demo(device, torch.float32, grid)
    names = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    samples: dict[str, tuple] = {}
    hooks = [getattr(model, n).register_forward_hook(
        lambda m, args, out, n=n: samples.setdefault(n, tuple(a.detach().clone().requires_grad_(True)
                                                              for a in args)))
        for n in names]
    xs = x.clone().requires_grad_(True)

    def fwd_bwd() -> tuple:
        xs.grad = None
        model.zero_grad(set_to_none=True)
        out = model(xs)
        ((out - y) ** 2).mean().backward()
        return out.detach().clone(), xs.grad.clone(), [p.grad.clone() for p in model.parameters()]

    eager = fwd_bwd()
    for h in hooks:
        h.remove()
    mods = tuple(getattr(model, n) for n in names)
    graphed = torch.cuda.make_graphed_callables(mods, tuple(samples[n] for n in names))
    for n, g in zip(names, graphed, strict=True):
        setattr(model, n, g)
    fwd_bwd()
    got = fwd_bwd()
    errs = {"out": _rel(got[0], eager[0]), "input_grad": _rel(got[1], eager[1]),
            "param_grads": max(_rel(a, b) for a, b in zip(got[2], eager[2], strict=True))}
    return {"ok": max(errs.values()) <= 1e-5, "errors": errs, "graphed": names}


def check_autocast(device: Any, grid: tuple[int, int]) -> dict:
    """bf16 autocast: converted (1 rank) vs the unsharded reference under the same autocast, out and grads."""
    import torch

    _, model, ref, _, x, y, _ = _demo(device, torch.float32, grid)
    res = {}
    for name, m in (("ref", ref), ("halo", model)):
        xi = x.clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = m(xi)
        ((out.float() - y) ** 2).mean().backward()
        res[name] = (out.detach().float(), xi.grad.float(), [p.grad.float() for p in m.parameters()])
    errs = {"out": _rel(res["halo"][0], res["ref"][0]), "input_grad": _rel(res["halo"][1], res["ref"][1]),
            "param_grads": max(_rel(a, b) for a, b in zip(res["halo"][2], res["ref"][2], strict=True))}
    return {"ok": max(errs.values()) <= 3e-2, "errors": errs, "tol": "3e-2 (bf16: 8 bits, a few roundings deep)"}


def check_inductor_channels_last(device: Any, grid: tuple[int, int], dry: bool) -> dict:
    """``torch.compile(fullgraph=True)`` (inductor on CUDA; aot_eager in a dry run) on a channels_last input vs
    eager: out and input gradient to 1e-4 relative (fp32), one graph."""
    import torch
    import torch._dynamo

    _, model, _, _, x, y, _ = _demo(device, torch.float32, grid)
    x = x.contiguous(memory_format=torch.channels_last)
    backend = "aot_eager" if dry or device.type != "cuda" else "inductor"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    torch._dynamo.utils.counters.clear()
    res = {}
    for name, fn in (("eager", model), ("compiled", compiled), ("again", compiled)):
        xi = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        out = fn(xi)
        ((out - y) ** 2).mean().backward()
        _sync(device)
        res[name] = (out.detach(), xi.grad, time.perf_counter() - t0, out.is_contiguous(
            memory_format=torch.channels_last))
        model.zero_grad(set_to_none=True)
    errs = {"out": _rel(res["compiled"][0], res["eager"][0]), "grad": _rel(res["compiled"][1], res["eager"][1]),
            "again": _rel(res["again"][0], res["eager"][0])}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"ok": max(errs.values()) <= 1e-4 and graphs == 1, "backend": backend, "errors": errs, "graphs": graphs,
            "out_channels_last": {"eager": res["eager"][3], "compiled": res["compiled"][3]},
            "first_call_s": round(res["compiled"][2], 2), "second_call_s": round(res["again"][2], 4)}


def part_step(dry: bool) -> dict:
    device = _device(dry)
    _init_one(device)
    grid = (9, 16) if dry else (181, 360)
    report: dict[str, Any] = {"device": str(device), "grid": grid}
    _checked("sync-free", lambda: check_sync_free(device, grid), report)
    _checked("whole-step graph", lambda: check_step_graph(device, grid), report)
    _checked("graphed callables", lambda: check_graphed_callables(device, grid), report)
    _checked("autocast bf16", lambda: check_autocast(device, grid), report)
    if dry:  # compiling takes long on a CPU; test_compile.py covers aot_eager and inductor there
        report["compile cl"] = {"ok": True, "skipped": "dry run (inductor on CUDA only)"}
    else:
        _checked("compile cl", lambda: check_inductor_channels_last(device, grid, dry), report)
    return report


# -- part: two NCCL ranks on one GPU ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_nccl2(dry: bool, out: Path, timeout: float) -> dict:
    """Start two rank processes (env://) and collect what each wrote."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), NCCL_HOSTID=f"halo-gpu-check-{rank}", NCCL_IB_DISABLE="1",
                   NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
        log = open(out / f"nccl2_rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, __file__, "--rank-worker", "--out", str(out)] + (["--dry-run"] if dry else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("killed (timeout)")
    for log in logs:
        log.close()
    report: dict[str, Any] = {"workers": {"ok": codes == [0, 0], "exit_codes": codes}}
    for rank in range(2):
        f = out / f"nccl2_rank{rank}.json"
        report[f"rank{rank}"] = json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result"}
    for name in report["rank0"]:
        if isinstance(report["rank0"][name], dict):
            both = [report[f"rank{r}"].get(name, {}) for r in range(2)]
            print(f"  {name:>18}: {'ok' if all(b.get('ok') for b in both) else 'FAILED'} "
                  f"{json.dumps(both, default=str)[:1500]}", flush=True)
    return report


def rank_worker(dry: bool, out: Path) -> int:
    """One of the two ranks of ``nccl2``: writes ``nccl2_rank<r>.json`` after every check (a kill keeps them)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import halo
    from halo.dist.comm import comm_group
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.shard import shard

    cuda = not dry and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    grid = (9, 16) if dry else (181, 360)
    warm = SIZES["warm"]
    report: dict[str, Any] = {"backend": dist.get_backend(), "device": str(device), "grid": grid}
    path = out / f"nccl2_rank{rank}.json"

    def record(name: str, fn: Callable[[], dict]) -> None:
        _checked(name, fn, report)
        path.write_text(json.dumps(report, indent=1, default=str))

    manager = halo.initialize_domain_parallel(2, 2)

    def host_group() -> dict:
        cg = comm_group(manager.domain_group)
        table = halo.dist.comm.gather_words([rank, 7], cg, "gpu check")
        return {"ok": table.tolist() == [[0, 7], [1, 7]], "separate_host": cg.host is not cg.group,
                "mesh_device_type": manager.device_mesh.device_type}

    record("host group", host_group)

    def torch_paths() -> dict:
        """halo's torch-version paths, on this torch and (on a newer one) as torch 2.11 has them:
        ``halo.dist.comm.new_group(ranks, sort_ranks=False)`` makes ascending groups everywhere; a descending one is a
        group whose rank 0 is global rank 1 on torch >= 2.12, and refused on every rank (before any collective)
        on 2.11, which lacks ``sort_ranks``."""
        from halo.dist import comm

        native = comm.HAS_SORT_RANKS
        res: dict[str, Any] = {"torch": torch.__version__, "has_sort_ranks": native}
        up = comm.new_group([0, 1], sort_ranks=False)
        res["ascending"] = dist.get_group_rank(up, rank) == rank

        def descending() -> str:
            try:
                down = comm.new_group([1, 0], sort_ranks=False)
            except ValueError as exc:
                return "refused" if "sort_ranks" in str(exc) else f"refused, unclear: {exc}"
            return "made" if dist.get_group_rank(down, 1) == 0 else "made, wrong order"

        res["descending"] = descending()
        ok = res["ascending"] and res["descending"] == ("made" if native else "refused")
        if native:  # the 2.11 path on this torch too
            comm.HAS_SORT_RANKS = False
            try:
                res["descending as torch 2.11"] = descending()
            finally:
                comm.HAS_SORT_RANKS = native
            ok = ok and res["descending as torch 2.11"] == "refused"
        res["paths"] = ["torch >= 2.12", "torch 2.11 (simulated)"] if native else ["torch 2.11"]
        res["ok"] = bool(ok)
        return res

    record("torch version paths", torch_paths)

    def equivalence() -> dict:
        from halo.check import boundary_reference
        from halo.tools.demo import DemoNet, make_field, pole_boundary

        h, w = grid
        torch.manual_seed(0)
        net = DemoNet(4, 8 if dry else 16, grid).to(device)
        boundary = pole_boundary(h)
        rep = halo.check_equivalence(net, make_field(h, w, 4, 0).to(device),
                                     reference=boundary_reference(net, boundary),
                                     convert_kwargs={"boundary": boundary}, dtype=torch.float64)
        bad = rep.first_mismatch
        return {"ok": rep.ok, "checks": len(rep.checks), "first_mismatch": None if bad is None else str(bad)}

    record("check_equivalence", equivalence)

    _, model, _, _, x, y, _ = _demo(device, torch.float32, grid)
    xs, ys = shard(x, group=manager.domain_group), shard(y, group=manager.domain_group)

    def sync_free() -> dict:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            domain_mean((model(xs) - ys) ** 2).backward()
            sync_domain_gradients(model, manager)
            opt.step()

        for _ in range(warm):
            step()
        return steady_steps(step, cuda)

    record("sync-free step", sync_free)

    def p2p_graph() -> dict:
        if not cuda:
            return {"ok": True, "skipped": NO_CUDA}
        torch.backends.cudnn.deterministic = True
        xi = xs.clone().requires_grad_(True)

        def fwd_bwd() -> Any:
            xi.grad = None
            out = model(xi)
            domain_mean((out - ys) ** 2).backward()
            return out

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager = fwd_bwd().detach().clone()
                eager_grad = xi.grad.detach().clone()
        torch.cuda.current_stream().wait_stream(side)
        for p in model.parameters():
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fwd_bwd()
        graph.replay()
        torch.cuda.synchronize()
        errs = {"out": _rel(captured, eager), "grad": _rel(xi.grad, eager_grad)}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        return {"ok": max(errs.values()) <= 1e-6, "errors": errs, "replay_ms": round(start.elapsed_time(end) / 10, 3)}

    record("p2p in a CUDA graph", p2p_graph)
    dist.destroy_process_group()
    return 0 if all(v.get("ok") for v in report.values() if isinstance(v, dict)) else 1


# -- part: DomainConv2d vs nn.Conv2d -----------------------------------------------------------------------------------

def part_conv(dry: bool) -> dict:
    import torch

    from halo.nn import DomainConv2d

    device = _device(dry)
    _init_one(device)
    import halo

    halo.initialize_domain_parallel(1, 1)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows_list, chans, width, n = ((9,), (4,), 16, 3) if dry else ((181, 721), (64, 256), 1440, 20)
    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "width": width}
    for h in rows_list:
        for c in chans:
            def run(h: int = h, c: int = c) -> dict:
                torch.manual_seed(0)
                conv = torch.nn.Conv2d(c, c, 3, padding=(1, 1), padding_mode="circular").to(device, dtype)
                layer = DomainConv2d(conv, boundary="pole")
                x = torch.randn(1, c, h, width, device=device, dtype=dtype, requires_grad=True)
                g = torch.randn(1, c, h, width, device=device, dtype=dtype)
                res: dict[str, Any] = {"ok": True}
                for name, fn in (("nn.Conv2d", conv), ("DomainConv2d", layer)):
                    def call(fn: Any = fn) -> None:
                        x.grad = None
                        fn(x).backward(g)

                    res[name] = time_calls(call, n, device)
                key = "eager_device_ms" if device.type == "cuda" else "eager_wall_ms"
                res["ratio_eager"] = round(res["DomainConv2d"][key] / res["nn.Conv2d"][key], 3)
                if device.type == "cuda":
                    res["ratio_graph"] = round(res["DomainConv2d"]["graph_device_ms"]
                                               / res["nn.Conv2d"]["graph_device_ms"], 3)
                return res

            _checked(f"{h}x{width} c{c}", run, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=PARTS)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/out")))
    parser.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU, tiny sizes")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, help="nccl2: seconds for the two ranks (default: the part's budget "
                        "from gpu_check.sh, GPU_CHECK_PART_BUDGET, less 10 s; else 65)")
    a = parser.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        SIZES.update(hidden=8, warm=1)
    if a.rank_worker:
        return rank_worker(a.dry_run, a.out)
    if a.part is None:
        parser.error("--part is required")
    print(f"== gpu_check part {a.part}{' (dry run)' if a.dry_run else ''} ==", flush=True)
    PARTIAL["path"] = a.out / f"gpu_check_{a.part}.partial.json"
    t0 = time.perf_counter()
    if a.part == "nccl2":
        budget = os.environ.get("GPU_CHECK_PART_BUDGET")
        timeout = a.timeout if a.timeout is not None else (max(5.0, float(budget) - 10) if budget else 65.0)
        report = part_nccl2(a.dry_run, a.out, timeout)
    else:
        report = {"kernels": part_kernels, "pack": part_pack, "step": part_step, "conv": part_conv}[a.part](a.dry_run)
    report["part_seconds"] = round(time.perf_counter() - t0, 1)
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write(a.out, a.part, report)
    PARTIAL["path"].unlink(missing_ok=True)  # (the whole report is written)
    failed = [k for k, v in _flat(report) if not v.get("ok", True)]
    print(f"== part {a.part}: {'ok' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"({report['part_seconds']} s) ==", flush=True)
    return 1 if failed else 0


def _flat(report: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """Every check's result in a part's report (the nccl2 part nests one report per rank)."""
    found = []
    for k, v in report.items():
        if isinstance(v, dict) and "ok" in v:
            found.append((prefix + k, v))
        elif isinstance(v, dict) and k.startswith("rank"):
            found.extend(_flat(v, f"{k}/"))
    return found


if __name__ == "__main__":
    sys.exit(main())
