"""Spectral transforms on H-shards (``halo.nn.spectral``): the transposes' bytes and time against the local
transform on the same shard, and torch-harmonics' own distributed SHT where its backend runs, in one run.

P gloo ranks on this machine, a field ``(B, C, H, W)`` split along H (default 1 x 8 x 181 x 360, float32), timed
interleaved (per iteration the max over ranks, then the median; forward + backward of ``sum(y * g)``):

================  =============================================================================================
impl              one call
================  =============================================================================================
local rfft2       ``torch.fft.rfft2`` of the shard alone (wrong on a shard: the floor of the arithmetic)
halo rfft2 cols   ``halo.nn.spectral.rfft2(layout="columns")``: rfft along W, one transpose, fft along H
halo rfft2 rows   the same and the transpose back (the balanced split of the frequency rows)
transpose         ``halo.nn.spectral.to_columns`` of the shard's rfft (the wire part alone, forward only): the
                  slab transpose of ``halo.nn.transpose``
transpose         the same permutation by ``halo.nn.longrange.rows_to_columns`` (a regroup over index maps)
  regroup
local SHT         torch-harmonics ``RealSHT(H_r, W)`` on the shard (the same work per rank, wrong on a shard)
halo SHT          ``halo.nn.DomainRealSHT`` of ``RealSHT(H, W)``: rfft, transpose, Legendre, transpose back
whole rfft2/SHT   the unsharded transform of the whole field on one rank (the one-device cost; halo's / P is
                  the arithmetic's share of each rank: the Legendre step of a shard is H x H x m / P, not
                  (H / P)^2 x m as the local SHT's)
th dist SHT       ``torch_harmonics.distributed.DistributedRealSHT`` (polar group = the domain group): its
                  transposes are ``dist.all_to_all``; reported as "n/a" where the backend lacks it (gloo)
================  =============================================================================================

``bytes/rank``: what one rank sends in one forward transpose, ``H_r * (m - m_s) * B * C`` complex values (``m``
the modes that travel, ``m_s`` this rank's own), the largest rank's.

    python benchmarks/spectral.py [--quick] [--nproc 2,3] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from halo.tools.bench import append_csv, default_out, median, print_table, run_meta, time_iterations

__all__ = ["main"]


class _Call(nn.Module):
    """A model whose forward is one functional call (converted, so that its plans are recalled)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _rank(rank: int, world: int, b: int, c: int, h: int, w: int, iters: int) -> list[dict]:
    import torch.distributed as dist
    from torch_harmonics import RealSHT

    import halo
    from halo.nn import DomainRealSHT, convert_to_domain_parallel
    from halo.nn import spectral as S
    from halo.nn.convert import INSIDE
    from halo.plan.partition import split_offsets

    halo.initialize_domain_parallel(world, world)
    ro = split_offsets(h, world)
    hr = ro[rank + 1] - ro[rank]
    torch.manual_seed(0)
    x = torch.randn(b, c, hr, w, requires_grad=True)
    spec = torch.fft.rfft(x.detach(), dim=-1)
    sht_local = RealSHT(hr, w)
    # as users run them: in a converted model, whose calls recall their plans (a bare call outside one agrees and
    # plans again every time: the regroup's index maps are O(H * W) Python, ~50 ms at 91 x 181)
    sht = convert_to_domain_parallel(nn.Sequential(RealSHT(h, w)))
    assert isinstance(sht[0], DomainRealSHT)
    mine = {_Call: INSIDE}  # its forward kept (and watched)
    cols = convert_to_domain_parallel(_Call(lambda t: S.rfft2(t, layout="columns")), custom_converters=mine)
    rows_ = convert_to_domain_parallel(_Call(S.rfft2), custom_converters=mine)
    tr = convert_to_domain_parallel(_Call(S.to_columns), custom_converters=mine)
    tr_regroup = convert_to_domain_parallel(_Call(S.to_columns_regroup), custom_converters=mine)

    def step(fn):
        def run():
            x.grad = None
            y = fn(x)
            y = torch.view_as_real(y) if y.is_complex() else y
            y.sum().backward()
        return run

    xw = torch.randn(b, c, h, w, requires_grad=True)

    def whole(fn):  # the unsharded transform of the whole field on one rank (each rank runs it alone)
        def run():
            xw.grad = None
            y = torch.view_as_real(fn(xw))
            y.sum().backward()
        return run

    fns = {"local rfft2": step(torch.fft.rfft2), "halo rfft2 cols": step(cols), "halo rfft2 rows": step(rows_),
           "transpose": lambda: tr(spec), "transpose regroup": lambda: tr_regroup(spec),
           "local SHT": step(sht_local), "halo SHT": step(sht),
           "whole rfft2": whole(torch.fft.rfft2), "whole SHT": whole(RealSHT(h, w))}
    th_note = ""
    try:  # torch-harmonics' own distributed SHT: polar (latitude) group = ours, no azimuth split
        from torch_harmonics import distributed as thd

        thd.init(dist.group.WORLD, None)
        th = thd.DistributedRealSHT(h, w)
        step(th)()  # its first call: does the backend have all_to_all?
        fns["th dist SHT"] = step(th)
    except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
        th_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    ok = torch.tensor([0 if th_note else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        fns.pop("th dist SHT", None)
        th_note = th_note or "failed on another rank"
    times = time_iterations(fns, iters)
    m = w // 2 + 1
    co = split_offsets(m, world)
    sent = max((ro[r + 1] - ro[r]) * (m - (co[r + 1] - co[r])) for r in range(world)) * b * c * 8  # complex64
    rows = [{"impl": k, "P": world, "ms": round(median(v) * 1e3, 3), "bytes/rank": sent if "halo" in k or
             k.startswith("transpose") else 0} for k, v in times.items()]
    rows.sort(key=lambda r: list(fns).index(r["impl"]))
    if th_note:
        rows.append({"impl": "th dist SHT", "P": world, "ms": "n/a", "bytes/rank": th_note})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", default="2,3")
    parser.add_argument("--size", default="1,8,181,360", help="B,C,H,W")
    parser.add_argument("--out", type=Path, default=default_out())
    args = parser.parse_args(argv)
    from halo.testing import run_on_ranks

    b, c, h, w = (int(v) for v in args.size.split(","))
    iters = 5 if args.quick else 20
    rows: list[dict] = []
    for world in (int(p) for p in args.nproc.split(",")):
        got = run_on_ranks(_rank, world, b, c, h, w, iters, timeout=900)[0]
        meta = run_meta("gloo", world)
        rows += [{**r, "B,C,H,W": args.size, **meta} for r in got]
    print_table(rows, ["impl", "P", "ms", "bytes/rank"])
    path = append_csv(args.out / "spectral.csv", rows)
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
