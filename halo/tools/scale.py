"""Scale on paper: per-rank halo bytes, messages and exchange time of a 3x3 conv for global grids on 8-1024 GPUs.

For a grid ``H x W`` (0.25 deg 721 x 1440, 0.1 deg 1801 x 3600, 3 km 6667 x 13334), ``C`` channels in bf16 and a
halo of one row/column, each layout is planned by halo's own planner (:func:`halo.plan.partition.plan_exchange`, the
messages every rank would post) and timed by the performance model of docs/design.md:

=====================  ================================================================================================
model term             value
=====================  ================================================================================================
message within a node  NVLink 4 through NCCL with default settings: 3.5 us + bytes / 180 GB/s
message across nodes   InfiniBand NDR, one 400 Gb/s NIC per GPU: 5 us + bytes / 48 GB/s
node                   8 GPUs, consecutive global ranks
exchange time (rank)   its messages posted together: the slowest of its sends and receives (per link kind, bytes add)
conv time (rank)       2 * C^2 * 9 * rows * cols flops at 60 % of 989 TFLOP/s (H200 bf16 dense)
hidden                 halo's compute-then-patch overlaps the exchange with the interior conv: the exchange is hidden
                       when it takes less than the conv of the shard's interior
=====================  ================================================================================================

1-D: the ranks split latitude (balanced); 2-D: a ``ph x pw`` mesh (latitude x longitude, longitude periodic; the
exchange runs along H, then along W on the H-extended shard, so corners are right — two phases, four messages),
the factorisation with the least halo bytes per rank among those with at least 2 rows and columns per rank. The
table says, per grid and GPU count, what each decomposition costs and whether 1-D still hides its exchange; beside
the exchange time (``exch_us``, each message over its own link) it gives the bytes that cross nodes (``inter_MB``,
the busiest rank's) and the time the same exchange would take inside one node (``intra_us``): their gap is what the
inter-node links cost.

    python -m halo.tools.scale [--channels 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from ..plan.partition import plan_exchange, split_offsets, split_sizes

__all__ = ["GRIDS", "Layout", "main", "plan_1d", "plan_2d"]

GRIDS = {"0.25deg": (721, 1440), "0.1deg": (1801, 3600), "3km": (6667, 13334)}
GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
NODE = 8
NVLINK = (3.5e-6, 180e9)  # latency, bytes/s (docs/design.md: NCCL send/recv with default settings)
IB = (5e-6, 48e9)  # InfiniBand NDR, one NIC per GPU
FLOPS = 0.6 * 989e12  # H200 bf16 dense at 60 %
BYTES = 2  # bf16


@dataclass
class Layout:
    """One decomposition's worst rank: bytes it sends, messages, exchange time, conv time."""

    name: str
    ph: int
    pw: int
    bytes: int  # sent by the busiest rank
    messages: int  # posted by the busiest rank (sends)
    exchange_s: float
    conv_s: float  # the conv of the smallest shard's interior (what the exchange must hide behind)
    rows: int  # the smallest shard's rows
    cols: int
    inter_bytes: int = 0  # sent across nodes by the rank sending most across nodes
    intra_s: float = 0.0  # the exchange time were every peer on this rank's node (NVLink only)

    @property
    def hidden(self) -> bool:
        return self.exchange_s <= self.conv_s


def _link(a: int, b: int) -> tuple[float, float]:
    return NVLINK if a // NODE == b // NODE else IB


def _inter(messages: list[tuple[int, int, int]]) -> int:
    """Bytes of ``(src, dst, bytes)`` messages that leave the sender's node."""
    return sum(nb for src, dst, nb in messages if src // NODE != dst // NODE)


def _time(messages: list[tuple[int, int, int]], intra: bool = False) -> float:
    """``(src, dst, bytes)`` posted together by one rank: per link kind the bytes add, the latencies overlap.
    ``intra``: as if every peer were on the sender's node (what the same exchange costs inside one node)."""
    by_kind: dict[tuple[float, float], int] = {}
    for src, dst, nbytes in messages:
        kind = NVLINK if intra else _link(src, dst)
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    return max((lat + nb / bw for (lat, bw), nb in by_kind.items()), default=0.0)


def _axis_messages(sizes: list[int], halo: int, boundary: str) -> list[list[tuple[int, int]]]:
    """Per rank of one axis: ``(peer, rows)`` it sends, from the planner's own message list."""
    offs = split_offsets(sum(sizes), len(sizes))
    needs = [(offs[r] - halo, offs[r + 1] + halo) for r in range(len(sizes))]
    plan = plan_exchange(sizes, needs, boundary)
    out = []
    for rp in plan.ranks:
        out.append([(peer, sum(n for _, n in runs)) for peer, runs in rp.sends if peer != rp.index])
    return out


def plan_1d(h: int, w: int, c: int, p: int, halo: int = 1) -> Layout:
    """Latitude split over ``p`` ranks (zeros at the poles' edge: the pole boundary sends as many rows)."""
    sizes = split_sizes(h, p)
    sends = _axis_messages(sizes, halo, "zeros")
    worst_t, worst_b, worst_m, worst_x, worst_i = 0.0, 0, 0, 0, 0.0
    for r, msgs in enumerate(sends):
        posted = [(r, peer, rows * w * c * BYTES) for peer, rows in msgs]
        worst_t = max(worst_t, _time(posted))
        worst_i = max(worst_i, _time(posted, intra=True))
        worst_b = max(worst_b, sum(b for *_, b in posted))
        worst_x = max(worst_x, _inter(posted))
        worst_m = max(worst_m, len(posted))
    rows = min(sizes)
    conv = 2 * c * c * 9 * max(rows - 2 * halo, 0) * w / FLOPS
    return Layout("1-D", p, 1, worst_b, worst_m, worst_t, conv, rows, w, worst_x, worst_i)


def plan_2d(h: int, w: int, c: int, ph: int, pw: int, halo: int = 1) -> Layout:
    """A ``ph x pw`` mesh, row-major global ranks (a node holds 8 consecutive ranks: W neighbours first)."""
    hs, ws = split_sizes(h, ph), split_sizes(w, pw)
    h_sends = _axis_messages(hs, halo, "zeros")
    w_sends = _axis_messages(ws, halo, "circular")
    worst_t, worst_b, worst_m, worst_x, worst_i = 0.0, 0, 0, 0, 0.0
    for i in range(ph):
        for j in range(pw):
            me = i * pw + j
            phase_h = [(me, peer * pw + j, rows * ws[j] * c * BYTES) for peer, rows in h_sends[i]]
            ext_rows = hs[i] + 2 * halo  # the W exchange carries the H-extended columns: corners come along
            phase_w = [(me, i * pw + peer, cols * ext_rows * c * BYTES) for peer, cols in w_sends[j]]
            t = _time(phase_h) + _time(phase_w)  # two phases, one after the other
            worst_t = max(worst_t, t)
            worst_i = max(worst_i, _time(phase_h, intra=True) + _time(phase_w, intra=True))
            worst_b = max(worst_b, sum(b for *_, b in phase_h + phase_w))
            worst_x = max(worst_x, _inter(phase_h + phase_w))
            worst_m = max(worst_m, len(phase_h) + len(phase_w))
    rows, cols = min(hs), min(ws)
    conv = 2 * c * c * 9 * max(rows - 2 * halo, 0) * max(cols - 2 * halo, 0) / FLOPS
    return Layout("2-D", ph, pw, worst_b, worst_m, worst_t, conv, rows, cols, worst_x, worst_i)


def best_2d(h: int, w: int, c: int, p: int) -> Layout | None:
    """The ``ph x pw = p`` mesh (pw > 1) with the least halo bytes per rank, at least 2 rows and columns each."""
    best = None
    for pw in range(2, p + 1):
        if p % pw:
            continue
        ph = p // pw
        if h // ph < 2 or w // pw < 2:
            continue
        layout = plan_2d(h, w, c, ph, pw)
        if best is None or layout.bytes < best.bytes:
            best = layout
    return best


def table(channels: int = 256) -> list[dict]:
    rows = []
    for grid, (h, w) in GRIDS.items():
        for p in GPUS:
            one = plan_1d(h, w, channels, p) if h // p >= 1 else None
            two = best_2d(h, w, channels, p)
            row = {"grid": grid, "H": h, "W": w, "gpus": p}
            for tag, lay in (("1d", one), ("2d", two)):
                if lay is None:
                    row.update({f"{tag}_mesh": "-", f"{tag}_rows": "-", f"{tag}_MB": "-", f"{tag}_msgs": "-",
                                f"{tag}_exch_us": "-", f"{tag}_conv_us": "-", f"{tag}_hidden": "-",
                                f"{tag}_inter_MB": "-", f"{tag}_intra_us": "-"})
                    continue
                row.update({f"{tag}_mesh": f"{lay.ph}x{lay.pw}", f"{tag}_rows": lay.rows,
                            f"{tag}_MB": f"{lay.bytes / 1e6:.2f}", f"{tag}_msgs": lay.messages,
                            f"{tag}_exch_us": f"{lay.exchange_s * 1e6:.1f}",
                            f"{tag}_conv_us": f"{lay.conv_s * 1e6:.1f}",
                            f"{tag}_inter_MB": f"{lay.inter_bytes / 1e6:.2f}",
                            f"{tag}_intra_us": f"{lay.intra_s * 1e6:.1f}",
                            f"{tag}_hidden": "yes" if lay.hidden else "NO"})
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from .bench import append_csv, default_out, plot_panels, print_table

    rows = table(args.channels)
    print_table(rows, ["grid", "gpus", "1d_rows", "1d_MB", "1d_inter_MB", "1d_intra_us", "1d_exch_us", "1d_conv_us",
                       "1d_hidden", "2d_mesh", "2d_MB", "2d_inter_MB", "2d_intra_us", "2d_exch_us", "2d_conv_us",
                       "2d_hidden"])
    out = args.out or default_out()
    append_csv(out / "scale_model.csv", rows)
    series = {}
    for r in rows:
        for tag in ("1d", "2d"):
            if r[f"{tag}_exch_us"] != "-":
                ratio = float(r[f"{tag}_exch_us"]) / max(float(r[f"{tag}_conv_us"]), 1e-9)
                series.setdefault(f"{r['grid']} {tag}", []).append((r["gpus"], ratio))
    plot_panels(out / "scale_model.png", [{"title": "exchange / interior conv time (<1: hidden)", "xlabel": "GPUs",
                                           "ylabel": "ratio", "series": series, "logx": True, "logy": True,
                                           "hline": 1.0}], f"3x3 conv, {args.channels} channels, bf16, halo 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
