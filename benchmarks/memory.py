"""Memory per rank of a converted model against the unsharded model's divided by P (issue 33, item 4).

    python benchmarks/memory.py [--ranks 2 3 4] [--models unet swin] [--quick] [--out benchmarks/out]

Domain parallelism exists to divide activation memory by P. For one training step (forward, a domain-mean loss,
backward) of each model, every rank reports:

``saved``   the bytes autograd saved for backward: the distinct storages packed by
            ``torch.autograd.graph.saved_tensors_hooks`` during the forward, parameters left out (replicated).
``peak``    the peak of the bytes allocated during the step above what was allocated before it (on CPU the sum of
            the profiler's memory events, ``profile_memory=True``, in time order; on CUDA ``max_memory_allocated``
            minus the bytes allocated at the start), plus what the exchangers' buffer pools held from the step
            before (``pooled``: allocated before the step, so not in the first term, but held through it). The
            parameters' gradients are allocated in the step but are replicated (they do not scale with P), so the
            ratio is taken on ``peak - grads``.

against the unsharded model run in the same process (one rank, no halo). The ratios (max over ranks):
``saved / (unsharded / P)`` and ``(peak - grads) / ((unsharded peak - grads) / P)``; ``ideal`` is the share of
rows of the rank with the most (a balanced split of 96 rows over 3 ranks is exact; 64 rows of whole 8-row Swin
windows over 3 ranks are 24 + 24 + 16, i.e. 1.125 x 1/P), and ``+halo`` that share with the halo rows of one 3x3
conv on each side (what the goal allows: within 1.1 x unsharded/P plus the halo rows).

Models: ``unet``, a small conv U-Net (two 3x3 convs, a stride-2 conv, a 3x3 conv, bilinear upsampling, a skip
concatenation, two 3x3 convs; float32, 1 x 4 x 96 x 128); ``swin``, timm's ``SwinTransformerStage`` (2 blocks,
dim 32, 2 heads, 8 x 8 windows, shifted; channels-last 1 x 64 x 64 x 32), sharded by whole windows. Rows go to
``--out``/memory.csv with the device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


class TinyUNet(nn.Module):
    """Encoder (two 3x3 convs), a stride-2 conv down, a 3x3 conv, bilinear upsampling, the skip concatenated, a
    decoder of two 3x3 convs."""

    def __init__(self, c: int = 4, w: int = 16) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(c, w, 3, padding=1), nn.GELU(), nn.Conv2d(w, w, 3, padding=1), nn.GELU())
        self.down = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1)
        self.mid = nn.Sequential(nn.GELU(), nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.GELU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec = nn.Sequential(nn.Conv2d(3 * w, w, 3, padding=1), nn.GELU(), nn.Conv2d(w, c, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc(x)
        return self.dec(torch.cat([a, self.up(self.mid(self.down(a)))], 1))


def _timm_stage():
    """timm's SwinTransformerStage; torchvision's two op schemas defined first where its compiled ops do not load
    beside this torch (as ``tests/_thirdparty.py`` does: no kernel, never called by these models)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import _thirdparty

        _thirdparty._torchvision_schemas()
    finally:
        sys.path.pop(0)
    from timm.models.swin_transformer import SwinTransformerStage

    return SwinTransformerStage(32, 32, (64, 64), depth=2, downsample=False, num_heads=2, window_size=8)


#: name -> (builder, full input shape, sharded dim, split granularity, rows of halo per side of its widest conv)
MODELS = {
    "unet": (TinyUNet, (1, 4, 96, 128), -2, 1, 1),
    "swin": (_timm_stage, (1, 64, 64, 32), 1, 8, 0),
}


def _input(name: str, quick: bool) -> torch.Tensor:
    shape = MODELS[name][1]
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def measure(model: nn.Module, x: torch.Tensor, loss_fn) -> dict:
    """One step's saved-for-backward bytes and peak allocated bytes (module docstring), on ``x``'s device."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, storage.nbytes())
        return t

    model.zero_grad(set_to_none=True)
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        loss_fn(out).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x)
            loss_fn(out).backward()
        events = sorted((e for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                        key=lambda e: e.start_ns())
        now = peak = 0
        for e in events:
            now += e.nbytes()
            peak = max(peak, now)
    del out
    return {"saved": sum(saved.values()), "peak": peak, "grads": _param_bytes(model)}


def _sharded(rank: int, world: int, name: str, quick: bool) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean

    torch.set_num_threads(1)
    manager = halo.initialize_domain_parallel(world, world)
    build, _, dim, granularity, _ = MODELS[name]
    torch.manual_seed(0)
    model = convert_to_domain_parallel(build(), manager)
    full = _input(name, quick)
    x = halo.shard(full, dim, granularity=granularity) if granularity > 1 else halo.shard(full, dim)
    rows = x.shape[dim]
    from halo.exchange import _registry as exchange_registry

    measure(model, x, lambda y: domain_mean(y * y))  # warm-up: plans learned, buffers pooled, first-call guard
    retained = exchange_registry.pooled_bytes()  # held by the exchangers' pools from the step before
    got = measure(model, x, lambda y: domain_mean(y * y))
    got.update(rows=rows, retained=retained, peak=got["peak"] + retained)
    return got


def _unsharded(name: str, quick: bool) -> dict:
    torch.set_num_threads(1)
    build = MODELS[name][0]
    torch.manual_seed(0)
    model = build()
    x = _input(name, quick)
    measure(model, x, lambda y: (y * y).mean())
    return measure(model, x, lambda y: (y * y).mean())


def run(ranks: list[int], models: list[str], quick: bool, out: Path | None) -> list[dict]:
    from halo.testing import run_on_ranks

    rows = []
    for name in models:
        ref = _unsharded(name, quick)
        _, shape, dim, _, halo_rows = MODELS[name]
        n = shape[dim]
        for world in ranks:
            per_rank = run_on_ranks(_sharded, world, name, quick, timeout=600)
            most = max(r["rows"] for r in per_rank)
            worst = max(per_rank, key=lambda r: r["peak"] - r["grads"])
            saved = max(r["saved"] for r in per_rank)
            ideal = most / n * world  # x (unsharded / P)
            rows.append({
                "model": name, "P": world, "rows": "+".join(str(r["rows"]) for r in per_rank),
                "unsharded_saved": ref["saved"], "saved_max": saved,
                "saved_ratio": round(saved / (ref["saved"] / world), 3),
                "unsharded_peak": ref["peak"], "peak_max": worst["peak"], "grads": ref["grads"],
                "peak_ratio": round((worst["peak"] - worst["grads"]) / ((ref["peak"] - ref["grads"]) / world), 3),
                "ideal": round(ideal, 3), "ideal_halo": round((most + 2 * halo_rows) / n * world, 3),
                "pooled_max": max(r["retained"] for r in per_rank),
            })
            print(_line(rows[-1]), flush=True)
    if out is not None:
        _write(rows, out)
    return rows


_COLUMNS = ("model", "P", "rows", "unsharded_saved", "saved_max", "saved_ratio", "unsharded_peak", "peak_max",
            "grads", "peak_ratio", "ideal", "ideal_halo", "pooled_max")


def _line(row: dict) -> str:
    return " | ".join(str(row[c]) for c in _COLUMNS)


def _write(rows: list[dict], out: Path) -> None:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory.csv"
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*_COLUMNS, *meta])
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**row, **meta})
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    print(" | ".join(_COLUMNS))
    rows = run(args.ranks, args.models, args.quick, args.out)
    return 0 if all(math.isfinite(r["peak_ratio"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
