"""Sharding-invariant dropout against torch's own dropout on the same shard, forward + backward, in one run.

One process (dropout sends nothing: the cost is the draw). A shard ``(B, C, h, W)`` of a field ``(B, C, H, W)``
(on CPU 1 x 32 x 181 x 720, a quarter of a 721-row field; on CUDA 4 x 64 x 181 x 1440, bf16), timed interleaved:

===========  ==============================================================================================
impl         one call ``y = f(x); y.backward(g)``
===========  ==============================================================================================
torch        ``F.dropout(x, 0.1)``: torch's stream, a mask per shard (the baseline)
halo         ``halo.nn.DomainDropout(0.1)`` as a converted model holds it (its plan recalled; the key's draw
             and the fused Philox kernel on CUDA, the torch reference of the same bits on CPU; the backward
             draws the mask again instead of storing it)
drop-path    ``halo.nn.DomainDropPath(0.1)`` (per-sample draws: a few elements) against timm's recipe
             ``x * bernoulli`` on the same tensor (``torch-path``)
===========  ==============================================================================================

``ratio`` = the median over iterations of impl / baseline in the same iteration.

    python benchmarks/dropout.py [--quick] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from halo.tools.bench import append_csv, default_out, median, paired_ratio, print_table, run_meta, time_iterations

__all__ = ["main"]


def _step(fn, x: torch.Tensor, g: torch.Tensor):
    def run() -> None:
        x.grad = None
        fn(x).backward(g)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=default_out())
    args = parser.parse_args(argv)
    from halo.nn import DomainDropout, DomainDropPath

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    shape = (4, 64, 181, 1440) if cuda else (1, 32, 181, 720)
    dtype = torch.bfloat16 if cuda else torch.float32
    iters = (10 if args.quick else 30) if cuda else (5 if args.quick else 15)
    x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device=dev, dtype=dtype)
    drop, path = DomainDropout(0.1), DomainDropPath(0.1)

    def torch_path(t: torch.Tensor) -> torch.Tensor:
        keep = t.new_empty((t.shape[0],) + (1,) * (t.dim() - 1)).bernoulli_(0.9)
        return t * keep.div_(0.9)

    fns = {"torch": _step(lambda t: F.dropout(t, 0.1), x, g), "halo": _step(drop, x, g),
           "torch-path": _step(torch_path, x, g), "drop-path": _step(path, x, g)}
    times = time_iterations(fns, iters, device=dev)
    meta = run_meta("none", 1, dev)
    mb = x.numel() * x.element_size() / 2**20
    rows = []
    pairs = (("torch", "torch"), ("halo", "torch"), ("torch-path", "torch-path"), ("drop-path", "torch-path"))
    for name, base in pairs:
        rows.append({**meta, "impl": name, "shape": "x".join(map(str, shape)), "dtype": str(dtype).removeprefix(
            "torch."), "mb": f"{mb:.1f}", "ms": f"{median(times[name]) * 1e3:.3f}",
            "ratio": f"{paired_ratio(times[name], times[base]):.2f}", "baseline": base})
    print_table(rows, ["impl", "shape", "dtype", "mb", "ms", "ratio", "baseline", "device"])
    append_csv(args.out / "dropout.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
