"""``halo demo``: a small weather-like model, sharded along latitude, against the unsharded model.

What one run does (rank 0 prints progress; the unsharded reference runs on rank 0 only, on the full field,
which is cheaper than on every rank and leaves rank 0 a core to itself while the others wait)::

    field (1, C, H, W) on a global lat-lon grid  ──  every rank builds it from the seed, keeps its rows
    DemoNet: conv3x3 ─ GroupNorm ─ conv3x3 stride 2 ─ conv3x3 ─ GroupNorm ─ ConvTranspose2d ─ (+skip) ─ conv3x3
        sharded:   convert_to_domain_parallel(net, boundary="pole")  (DomainConv2d, DomainGroupNorm, ...)
        unsharded: the same torch modules; convs pad latitude across the pole by hand (PolePadConv)
    loss = latitude-weighted MSE against the field advected 5 degrees east; backward; gradient sync
    compare output, input gradient, parameter gradients; time steps; count halo bytes; draw a PNG

The unsharded model is plain torch (``F.pad`` + ``F.conv2d``, ``nn.GroupNorm``, ``nn.ConvTranspose2d``): it
shares no code with the sharded layers, so agreement is evidence, not a tautology. Grids with an odd number
of rows have both poles on the grid (``pole`` boundary, 721 rows = 0.25 deg); even ones are cell-centred
(``pole_centered``).
"""

from __future__ import annotations

import argparse
import copy
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.partition import split_offsets

__all__ = ["DemoNet", "PolePadConv", "make_field", "pole_pad", "run_demo"]

#: Relative tolerance (max |sharded - unsharded| / max |unsharded|) per dtype. Cross-rank sums (GroupNorm
#: statistics, the loss, gradient sums over ranks) add in another order than one device does, so results
#: differ by rounding: float64 by ~1e-15. In float32 a parameter gradient sums ~10^6 grid points and the
#: unsharded float32 run is itself ~1e-5 (relative) away from float64, so float32 passes within this
#: tolerance *or* within YARDSTICK_FACTOR times that measured float32-vs-float64 error, whichever is larger.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-11}
YARDSTICK_FACTOR = 4.0


def pole_boundary(h: int) -> str:
    """``pole`` when the grid has both poles on it (odd rows: 721 at 0.25 deg), else ``pole_centered``."""
    return "pole" if h % 2 else "pole_centered"


def latitudes(h: int) -> torch.Tensor:
    """Latitude of each row in degrees, north to south."""
    if h % 2:
        return torch.linspace(90.0, -90.0, h, dtype=torch.float64)
    return 90.0 - (torch.arange(h, dtype=torch.float64) + 0.5) * 180.0 / h


def make_field(h: int, w: int, channels: int, seed: int = 0) -> torch.Tensor:
    """A smooth weather-like field ``(1, channels, h, w)`` (float64): low zonal/meridional modes, two
    meandering jets, large-scale noise and a little white noise; each channel normalised to unit variance."""
    gen = torch.Generator().manual_seed(seed)
    lat = latitudes(h)[:, None]
    lon = (torch.arange(w, dtype=torch.float64) * 360.0 / w)[None, :]
    phi, lam = torch.deg2rad(lat), torch.deg2rad(lon)
    out = torch.empty(1, channels, h, w, dtype=torch.float64)
    for c in range(channels):
        f = torch.zeros(h, w, dtype=torch.float64)
        for m, n in ((0, 1), (0, 2), (1, 1), (2, 3), (3, 2), (4, 4), (6, 5)):
            a, b, d = torch.randn(3, generator=gen, dtype=torch.float64)
            # cos(phi)^m vanishes at the poles for m >= 1: the field is single-valued there.
            f += a / (1 + m) * torch.cos(phi) ** m * torch.cos(n * phi + b) * torch.cos(m * lam + 3 * d)
        for sign in (1.0, -1.0):  # a jet in each hemisphere, meandering with wavenumber 4-6
            k = 4 + (c + int(sign > 0)) % 3
            centre = sign * (40.0 + 6.0 * torch.sin(k * lam + float(torch.rand(1, generator=gen)) * 6.28))
            f += (1.5 if c % 2 == 0 else -1.0) * torch.exp(-(((lat - centre) / 5.0) ** 2))
        coarse = torch.randn(1, 1, h // 16 + 2, w // 16 + 2, generator=gen, dtype=torch.float64)
        f += 0.3 * F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)[0, 0]
        f += 0.05 * torch.randn(h, w, generator=gen, dtype=torch.float64)
        out[0, c] = (f - f.mean()) / f.std()
    return out


def pole_pad(x: torch.Tensor, before: int, after: int, boundary: str) -> torch.Tensor:
    """Pad latitude (dim -2) across the poles: rows mirrored at the pole and rolled by half the longitudes."""
    n, shift = x.shape[-2], x.shape[-1] // 2
    k = 1 if boundary == "pole" else 0  # "pole": the pole row is on the grid and is not repeated
    north = x.narrow(-2, k, before).flip(-2).roll(shift, -1)
    south = x.narrow(-2, n - k - after, after).flip(-2).roll(shift, -1)
    return torch.cat([north, x, south], dim=-2)


class PolePadConv(nn.Module):
    """The unsharded twin of ``DomainConv2d(conv, boundary=pole)``: latitude padded across the poles, then
    longitude by the conv's own ``padding_mode`` (circular here; corners wrap), then ``F.conv2d`` unpadded."""

    def __init__(self, conv: nn.Conv2d, boundary: str) -> None:
        super().__init__()
        self.conv, self.boundary = conv, boundary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        ph, pw = c.padding
        mode = "constant" if c.padding_mode == "zeros" else c.padding_mode
        x = pole_pad(x, ph, ph, self.boundary)  # first: the pole roll is by half the *unpadded* longitudes
        x = F.pad(x, (pw, pw, 0, 0), mode=mode)
        return F.conv2d(x, c.weight, c.bias, c.stride, 0, c.dilation, c.groups)


class DemoNet(nn.Module):
    """A small U-Net-like block: full resolution, a stride-2 level, back up, a skip, a residual output."""

    def __init__(self, channels: int, hidden: int, grid: tuple[int, int]) -> None:
        super().__init__()
        h, w = grid
        hd, wd = (h - 1) // 2 + 1, (w - 1) // 2 + 1  # rows and columns after the stride-2 conv
        circ = {"padding": 1, "padding_mode": "circular"}  # longitude wraps; latitude is set by the boundary
        groups = 2 if hidden % 2 == 0 else 1
        self.enc = nn.Conv2d(channels, hidden, 3, **circ)
        self.norm1 = nn.GroupNorm(groups, hidden)
        self.down = nn.Conv2d(hidden, hidden, 3, stride=2, **circ)
        self.mid = nn.Conv2d(hidden, hidden, 3, **circ)
        self.norm2 = nn.GroupNorm(groups, hidden)
        self.up = nn.ConvTranspose2d(hidden, hidden, 3, stride=2, padding=1,
                                     output_padding=(h - 2 * hd + 1, w - 2 * wd + 1))
        self.dec = nn.Conv2d(hidden, channels, 3, **circ)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.norm1(self.enc(x)))
        b = self.act(self.norm2(self.mid(self.act(self.down(a)))))
        return x + self.dec(self.act(self.up(b) + a))


def reference_model(net: DemoNet, boundary: str) -> DemoNet:
    """A copy of ``net`` whose convs pad latitude across the poles by hand (plain torch, one device)."""
    ref = copy.deepcopy(net)
    for name in ("enc", "down", "mid", "dec"):
        setattr(ref, name, PolePadConv(getattr(ref, name), boundary))
    return ref


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, lat_deg: torch.Tensor) -> torch.Tensor:
    """Unsharded latitude-weighted MSE: weights cos(lat) normalised to mean 1 over the rows."""
    wts = torch.cos(torch.deg2rad(lat_deg)).clamp_min(0).to(pred.dtype)
    wts = wts / wts.mean()
    return ((pred - target) ** 2 * wts[:, None]).mean()


class Traffic:
    """Counts bytes sent by point-to-point ops and wall time inside halo exchanges during one step.

    A measurement shim for one untimed step: wraps ``torch.distributed.batch_isend_irecv`` and the
    ``Exchanger`` methods, and restores them on exit.
    """

    def __enter__(self) -> Traffic:
        import torch.distributed as dist

        from .. import exchange

        self.bytes_sent, self.seconds, self._saved = 0, 0.0, []

        def count(orig):
            def wrapper(ops):
                self.bytes_sent += sum(op.tensor.numel() * op.tensor.element_size()
                                       for op in ops if op.op is dist.isend)
                return orig(ops)
            return wrapper

        def timed(orig):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return orig(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
            return wrapper

        timed_methods = ("start", "finish", "halos", "start_adjoint", "finish_adjoint")  # adjoint calls the last two
        for owner, name, wrap in ((dist, "batch_isend_irecv", count),
                                  *((exchange.Exchanger, m, timed) for m in timed_methods)):
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            setattr(owner, name, wrap(orig))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def reference_step(ref: nn.Module, field: torch.Tensor, target: torch.Tensor, lat: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One unsharded forward + backward: (output, input gradient, parameter gradients)."""
    ref.zero_grad(set_to_none=True)
    x = field.detach().clone().requires_grad_(True)
    out = ref(x)
    weighted_mse(out, target, lat).backward()
    return out.detach(), x.grad, [p.grad for p in ref.parameters()]


def compare(got: tuple, want: tuple) -> dict[str, tuple[float, float]]:
    """``{quantity: (max |got - want|, max |want|)}`` for output, input grad and the parameter gradients (all
    parameters together: a relative error against the largest gradient entry of the model)."""
    def err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        return float((a.double() - b.double()).abs().max()), float(b.double().abs().max())

    pairs = [err(a, b) for a, b in zip(got[2], want[2], strict=True)]
    return {"output": err(got[0], want[0]), "input grad": err(got[1], want[1]),
            "param grads": (max(e for e, _ in pairs), max(m for _, m in pairs))}


def _rank_main(rank: int, world: int, opts: dict) -> dict | None:
    """One rank of the demo: returns rank 0's measurements and images, ``None`` elsewhere."""
    import torch.distributed as dist

    from ..check import check_equivalence
    from ..dist.mesh import DomainMesh, initialize_domain_parallel
    from ..launch import rank_device
    from ..nn.convert import convert_to_domain_parallel
    from ..parallel.reduce import latitude_weighted_mse, sync_domain_gradients
    from ..shard import gather, gather_2d, shard, shard_2d
    from .bench import gather_times, median

    def say(msg: str) -> None:
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    device, dtype = rank_device(opts["backend"]), getattr(torch, opts["dtype"])
    h, w = opts["grid"]
    boundary = pole_boundary(h)
    if opts.get("mesh"):  # latitude x longitude blocks; longitude periodic, the poles rolled across the W ranks
        manager, mesh = None, DomainMesh(opts["mesh"], periodic=(False, True))
        group = mesh.domain_group
        split, whole = (lambda t: shard_2d(t, mesh=mesh)), (lambda t: gather_2d(t, mesh=mesh))
        on = {"mesh": mesh}
    else:  # latitude rows
        manager, mesh = initialize_domain_parallel(world, world), None
        group = manager.domain_group
        split, whole = (lambda t: shard(t, dim=-2)), (lambda t: gather(t, dim=-2))
        on = {}
    layout = f"a {opts['mesh'][0]}x{opts['mesh'][1]} latitude x longitude mesh" if mesh else "latitude rows"

    say(f"building field {h}x{w}, {opts['channels']} channels, on {world} ranks, {layout} ({opts['backend']}, "
        f"{device})")
    field = make_field(h, w, opts["channels"], opts["seed"]).to(device, dtype)
    target = field.roll(max(1, w // 72), dims=-1)  # the field advected 5 degrees east
    lat = latitudes(h).to(device)
    x_local = split(field).detach().requires_grad_(True)  # this rank's latitude rows (and longitudes)
    y_local = split(target)

    torch.manual_seed(opts["seed"])
    net = DemoNet(opts["channels"], opts["hidden"], (h, w)).to(device, dtype)

    # First, as the README recommends: does the converted model compute what the unsharded one does, module by
    # module, forward and backward (float64, so any difference is a bug and not rounding)?
    say("halo.check_equivalence (every module's output and the gradients, float64)...")
    report = check_equivalence(net, field, reference=reference_model(net, boundary),
                               convert_kwargs={"boundary": boundary}, **on)
    for line in str(report).splitlines():
        say(line)
    if not report.ok:
        raise RuntimeError(f"halo demo: the converted model differs from the unsharded one:\n{report}")

    model = convert_to_domain_parallel(copy.deepcopy(net), manager, boundary=boundary, **on)

    def sharded_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x_local.grad = None
        out = model(x_local)
        loss = latitude_weighted_mse(out, y_local, **on)
        loss.backward()
        if mesh is None:
            sync_domain_gradients(model, manager)
        else:
            sync_domain_gradients(model, domain_group=group, dp_group=None)
        return out

    say("sharded step (checked against the unsharded model)...")
    out_local = sharded_step()
    out_full = whole(out_local.detach())
    grad_x_full = whole(x_local.grad)
    grads = [p.grad.detach().clone() for p in model.parameters()]

    times: list[float] = []
    for i in range(opts["steps"] + 1):  # the first is warm-up (every layer learns its plan in the first step)
        dist.barrier(group)
        t0 = time.perf_counter()
        sharded_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i:
            say(f"  sharded step {i}/{opts['steps']}: {times[-1]:.3f} s (rank 0)")
    step_max = gather_times(times[1:], group)
    with Traffic() as traffic:  # one more, instrumented, steady-state step
        sharded_step()
    traffic_all: list[Any] = [None] * world
    dist.all_gather_object(traffic_all, (traffic.bytes_sent, traffic.seconds), group=group)

    result: dict | None = None
    if rank == 0:
        say("reference step (unsharded, rank 0, full field)...")
        ref = reference_model(net, boundary)
        ref_times = []
        for i in range(opts["steps"] + 1):
            t0 = time.perf_counter()
            ref_res = reference_step(ref, field, target, lat)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ref_times.append(time.perf_counter() - t0)
            if i:
                say(f"  unsharded step {i}/{opts['steps']}: {ref_times[-1]:.3f} s")
        errors = compare((out_full, grad_x_full, grads), ref_res)
        yardstick = None
        if dtype != torch.float64:  # how far float32 itself is from exact: the unsharded run vs float64
            say("rounding yardstick (unsharded float64 step)...")
            ref64 = reference_model(copy.deepcopy(net).double(), boundary)
            yardstick = compare(ref_res, reference_step(ref64, field.double(), target.double(), lat))
        ref_out = ref_res[0]
        result = {
            "errors": errors, "yardstick": yardstick, "tol": TOLERANCE[dtype], "world": world, "grid": (h, w),
            "dtype": opts["dtype"], "boundary": boundary, "device": str(device), "backend": opts["backend"],
            "step_sharded": median(step_max), "step_unsharded": median(ref_times[1:]),
            "traffic": traffic_all,
            "n_params": sum(p.numel() for p in net.parameters()),
            "offsets": split_offsets(h, opts["mesh"][0] if mesh else world), "mesh": opts.get("mesh"),
            "col_offsets": split_offsets(w, opts["mesh"][1]) if mesh else [0, w],
            "lat": lat.cpu().numpy(), "field": field[0, 0].float().cpu().numpy(),
            "output": out_full[0, 0].float().cpu().numpy(),
            "diff": (out_full[0, 0] - ref_out[0, 0].detach()).abs().float().cpu().numpy(),
        }
    dist.barrier(group)
    return result


def print_report(res: dict) -> bool:
    """Print the result table; True if every error is within tolerance."""
    h, w = res["grid"]
    layout = f" as a {res['mesh'][0]}x{res['mesh'][1]} latitude x longitude mesh" if res.get("mesh") else ""
    print(f"\nhalo demo: {h}x{w} grid, {res['dtype']}, {res['boundary']} boundary, {res['world']} ranks{layout} "
          f"({res['backend']}, {res['device']}), untrained model of {res['n_params']} parameters")
    yard = res["yardstick"]
    head = f"{'check (sharded vs unsharded)':<30}{'max error':>12}{'max |ref|':>12}{'relative':>12}"
    print(head + (f"{'fp32 vs fp64':>14}" if yard else "") + f"{'tol':>10}")
    ok, worst = True, 0.0
    for name, (err, scale) in res["errors"].items():
        rel = err / max(scale, 1e-300)
        tol = res["tol"]
        line = f"{name:<30}{err:>12.3e}{scale:>12.3e}{rel:>12.3e}"
        if yard:  # the unsharded float32 run's own distance from float64, same quantity
            rounding = yard[name][0] / max(yard[name][1], 1e-300)
            tol = max(tol, YARDSTICK_FACTOR * rounding)
            line += f"{rounding:>14.3e}"
        ok &= rel <= tol
        worst = max(worst, rel)
        print(line + f"{tol:>10.1e}" + ("" if rel <= tol else "  FAIL"))
    print(f"max error: {worst:.3e} relative ({'within' if ok else 'BEYOND'} tolerance)"
          + (f"; tolerance: {res['tol']:.0e} or {YARDSTICK_FACTOR:g}x the float32 rounding of the unsharded "
             f"run (fp32 vs fp64), whichever is larger" if yard else ""))
    t1, tp = res["step_unsharded"], res["step_sharded"]
    print(f"\n{'timing (fwd + loss + bwd, median)':<42}{'seconds':>10}")
    print(f"{'step, unsharded (1 rank, full field)':<42}{t1:>10.3f}")
    label = f"step, sharded ({res['world']} ranks, max over ranks)"
    print(f"{label:<42}{tp:>10.3f}   speedup {t1 / tp:.2f}x")
    traffic = res["traffic"]
    total = sum(b for b, _ in traffic)
    r = max(range(len(traffic)), key=lambda i: traffic[i][0])
    b, sec = traffic[r]
    print(f"{'halo bytes per step (all ranks, sent)':<42}{total / 1e6:>10.3f} MB")
    if b:
        label = f"rank {r}: sent, time inside exchanges"
        print(f"{label:<42}{b / 1e6:>10.3f} MB in {sec * 1e3:.1f} ms "
              f"= {b / sec / 1e9:.3f} GB/s achieved (pack + wire + wait + unpack, fwd + bwd)")
    print(f"{'wall time of the demo':<42}{res['wall_s']:>10.1f} s")
    return ok


def png_bytes(rgb: list[bytes], width: int) -> bytes:
    """A minimal RGB PNG from rows of ``3 * width`` bytes (no dependencies beyond zlib)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + row for row in rgb)
    header = struct.pack(">IIBBBBB", width, len(rgb), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def rgb_rows(img: Any, lo: float, hi: float, lines: list[int]) -> list[bytes]:
    """Blue-white-red colour rows of a 2-D array; rows listed in ``lines`` drawn black."""
    t = ((torch.as_tensor(img, dtype=torch.float32) - lo) / max(hi - lo, 1e-30)).clamp(0, 1)
    r = (255 * (2 * t).clamp(max=1)).to(torch.uint8)
    b = (255 * (2 - 2 * t).clamp(max=1)).to(torch.uint8)
    g = torch.minimum(r, b)
    rgb = torch.stack([r, g, b], dim=-1)
    for row in lines:
        rgb[min(row, rgb.shape[0] - 1)] = 0
    return [bytes(row.flatten().tolist()) for row in rgb]


def rgb_rows_sequential(img: Any, hi: float) -> list[bytes]:
    """Black-red-yellow-white colour rows of a 2-D array of magnitudes in ``[0, hi]`` (an |error| map)."""
    t = (torch.as_tensor(img, dtype=torch.float32) / max(hi, 1e-30)).clamp(0, 1)
    rgb = torch.stack([(3 * t).clamp(max=1), (3 * t - 1).clamp(0, 1), (3 * t - 2).clamp(0, 1)], dim=-1)
    return [bytes(row.flatten().tolist()) for row in (255 * rgb).to(torch.uint8)]


def layout_text(res: dict) -> str:
    """``"2 ranks (latitude rows)"`` or ``"a 2x2 latitude x longitude mesh (4 ranks)"``."""
    if res.get("mesh"):
        ph, pw = res["mesh"]
        return f"a {ph}x{pw} latitude x longitude mesh ({ph * pw} ranks)"
    return f"{res['world']} ranks (latitude rows)"


def picture_name(res: dict) -> str:
    """The demo's picture: ``halo_demo.png`` for latitude rows, ``halo_demo_mesh2x2.png`` on a mesh (a run on
    a mesh does not overwrite the rows picture)."""
    return f"halo_demo_mesh{res['mesh'][0]}x{res['mesh'][1]}.png" if res.get("mesh") else "halo_demo.png"


def label_shards(ax: Any, lat: Any, row_offsets: list[int], col_offsets: list[int], width: int,
                 first_rank_at_bottom: bool = False) -> None:
    """Dashed lines at the shard boundaries of a map drawn with ``extent=(0, 360, lat[-1], lat[0])``, and each
    shard's rank written in its middle (row-major over a mesh: rank = row block x column blocks + column block;
    ``first_rank_at_bottom``: the rows are drawn in the reverse of the ranks' order)."""
    def row_edge(r: int) -> float:  # latitude of the boundary above row r (the pole beyond the first/last row)
        if r <= 0:
            return float(lat[0])
        if r >= len(lat):
            return float(lat[-1])
        return float(lat[r - 1] + lat[r]) / 2

    for row in row_offsets[1:-1]:
        ax.axhline(row_edge(row), color="k", lw=1.2, ls="--")
    for col in col_offsets[1:-1]:
        ax.axvline(360.0 * col / width, color="k", lw=1.2, ls="--")
    blocks = len(col_offsets) - 1
    for i in range(len(row_offsets) - 1):
        y = (row_edge(row_offsets[i]) + row_edge(row_offsets[i + 1])) / 2
        for j in range(blocks):
            x = 180.0 * (col_offsets[j] + col_offsets[j + 1]) / width
            rows = row_offsets[i + 1] - row_offsets[i]
            size = f"{rows} x {col_offsets[j + 1] - col_offsets[j]}" if blocks > 1 else f"{rows} rows"
            block = len(row_offsets) - 2 - i if first_rank_at_bottom else i
            ax.text(x, y, f"rank {block * blocks + j}\n{size}", ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "k", "alpha": 0.8})


def write_png(res: dict, path: Path) -> Path:
    """The input field with the shards labelled by rank, the gathered sharded output, and |sharded - unsharded|
    (a sequential map: a magnitude). Without matplotlib: the three maps stacked, no text (a plain PNG)."""
    field, out, diff, offs = res["field"], res["output"], res["diff"], res["offsets"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lim = float(abs(field).max())
        gap = [bytes(3 * field.shape[1])] * 4
        rows = (rgb_rows(field, -lim, lim, offs[1:-1]) + gap + rgb_rows(out, -lim, lim, []) + gap
                + rgb_rows_sequential(diff, float(diff.max()) or 1.0))
        path.write_bytes(png_bytes(rows, field.shape[1]))
        return path
    lat = res["lat"]
    h, w = res["grid"]
    extent = (0, 360, float(lat[-1]), float(lat[0]))
    fig, axes = plt.subplots(3, 1, figsize=(9, 13), constrained_layout=True)
    lim = float(abs(field).max())
    unit = "normalised value (each channel: mean 0, std 1)"
    panels = ((field, f"input field, channel 0, split over {layout_text(res)}", "RdBu_r", -lim, lim, unit),
              (out, "output of the sharded model (gathered), channel 0", "RdBu_r", -lim, lim, unit),
              (diff, f"|sharded - unsharded| output, channel 0 ({res['dtype']} rounding; max {float(diff.max()):.1e})",
               "viridis", 0, float(diff.max()) or 1.0, "|difference| (same units)"))
    for ax, (img, title, cmap, vmin, vmax, label) in zip(axes, panels, strict=True):
        im = ax.imshow(img, extent=extent, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set(title=title, xlabel="longitude (degrees east)", ylabel="latitude (degrees north)",
               xticks=range(0, 361, 60), yticks=range(-90, 91, 30))
        fig.colorbar(im, ax=ax, shrink=0.85, label=label)
    label_shards(axes[0], lat, offs, res.get("col_offsets", [0, w]), w)
    fig.suptitle(f"halo demo: {h}x{w} grid ({360 / w:g} deg), {layout_text(res)}, {res['dtype']}, "
                 f"{res['boundary']} boundary\nthe model is untrained (random weights): the point is that sharded "
                 f"equals unsharded, not skill", fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo (see the module docstring); 0 if sharded and unsharded agree within tolerance."""
    from ..launch import is_printer, launch, under_torchrun

    opts = {k: getattr(args, k) for k in ("grid", "channels", "hidden", "steps", "dtype", "seed", "backend")}
    opts["mesh"] = getattr(args, "mesh", None)
    if args.hidden < 1 or args.channels < 1 or args.steps < 1 or args.nproc < 1:
        raise SystemExit("halo demo: --hidden, --channels, --steps and --nproc must be positive")
    if opts["mesh"]:
        ph, pw = opts["mesh"]
        if ph < 1 or pw < 1:
            raise SystemExit(f"halo demo: --mesh needs positive sizes, got {ph}x{pw}")
        if ph > args.grid[0] // 4 or pw > args.grid[1] // 4:
            raise SystemExit(f"halo demo: a {args.grid[0]}x{args.grid[1]} grid is too small for a {ph}x{pw} mesh "
                             f"(the stride-2 level needs >= 2 rows and columns per rank); use a larger --grid")
        if under_torchrun():
            world = int(os.environ.get("WORLD_SIZE", "1"))
            if world != ph * pw:
                raise SystemExit(f"halo demo: --mesh {ph}x{pw} needs {ph * pw} ranks, torchrun started {world}")
        args.nproc = ph * pw
    elif args.nproc > args.grid[0] // 4 and not under_torchrun():
        raise SystemExit(f"halo demo: {args.grid[0]} rows are too few for {args.nproc} ranks "
                         f"(the stride-2 level needs >= 2 rows per rank); use a larger --grid")
    from .bench import LoadWatch

    started = time.perf_counter()
    own = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun() else args.nproc
    with LoadWatch(own=own) as watch:
        results = launch(_rank_main, args.nproc, opts, backend=args.backend, timeout=args.timeout)
    if not is_printer():
        return 0
    res = results[0]
    res["wall_s"] = time.perf_counter() - started
    ok = print_report(res)
    if watch.warning():  # the timings, not the errors, depend on the machine's load
        print(f"timing: {watch.warning()}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = write_png(res, out_dir / picture_name(res))
    print(f"picture: {png}")
    print("OK: sharded equals unsharded within tolerance" if ok else "FAILED: sharded differs from unsharded")
    return 0 if ok else 1
