"""Train a small U-Net-like weather model sharded along latitude with halo: a complete, runnable example.

    torchrun --nproc_per_node=2 examples/train.py              # CPU: gloo; with GPUs: NCCL, one GPU per rank
    torchrun --nproc_per_node=4 examples/train.py --domain 2   # 2 data-parallel replicas x 2 domain ranks

What it does, on every rank (seconds on a laptop CPU):

1. builds the same model on every rank (same seed: every rank of a domain group must hold the same weights);
2. checks, once, that the converted model computes what the unsharded model computes -- every module's output,
   the input gradient and every parameter gradient, in float64 -- *with the boundary it trains with*
   (``boundary="pole"``: the rows across a pole are the rows on the other side of it, half the longitudes
   away; torch has no layer for that, so the unsharded reference pads across the poles by hand, ``PoleConv2d``);
3. converts the model (same ``state_dict`` keys) and trains it a few steps on this rank's latitude rows: samples
   from ``halo.DomainSampler`` (the same sample on every rank of a domain group, split over data parallel), the
   latitude-weighted MSE over the *global* field (``halo.parallel.latitude_weighted_mse``: every rank gets the same
   loss), ``sync_domain_gradients`` (sum over the domain group, mean over data parallel), then halo's
   ``clip_grad_norm_``; with ``--ckpt DIR`` it resumes from and saves the whole training state
   (``halo.checkpoint``: model, Adam's moments, the sampler's epoch, the step, halo's RNG);
4. compares the sharded loss of the trained model with the unsharded loss of the same weights on the whole field,
   computed inside this distributed job under ``halo.dist.comm.unsharded()``;
5. optionally saves the weights (``--save model.pt``): they load into the unconverted ``UNet``.

The task is small on purpose: predict the field one grid column further east (advection by 5 degrees). For real
data each rank reads only its rows: ``halo.io.ShardedField("era5.nc", ["t2m", "u10", "v10"]).sample(t)``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import halo
import halo.checkpoint
import halo.launch
from halo.nn import convert_to_domain_parallel
from halo.parallel.reduce import clip_grad_norm_, latitude_weighted_mse, sync_domain_gradients


class PoleConv2d(nn.Conv2d):
    """``nn.Conv2d`` that pads latitude across the poles itself: the unsharded twin of ``boundary="pole"``.

    A row beyond the north pole is the row as far south of it, half the longitudes round the circle; longitude is
    padded by the conv's own ``padding_mode`` (circular here). ``pole_on_grid``: the first and last rows *are* the
    poles (an odd number of rows, 721 for ERA5 at 0.25 deg; halo's ``"pole"``), so they are not repeated; else the
    grid is cell-centred (halo's ``"pole_centered"``).
    """

    def __init__(self, *args, pole_on_grid: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pole_on_grid = pole_on_grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ph, pw = self.padding
        if ph:
            n, k, shift = x.shape[-2], int(self.pole_on_grid), x.shape[-1] // 2
            north = x[..., k:k + ph, :].flip(-2).roll(shift, -1)
            south = x[..., n - k - ph:n - k, :].flip(-2).roll(shift, -1)
            x = torch.cat([north, x, south], dim=-2)
        x = F.pad(x, (pw, pw, 0, 0), mode=self.padding_mode if self.padding_mode != "zeros" else "constant")
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class UNet(nn.Module):
    """Two levels, a skip and a residual output: conv - norm - strided conv down - conv - transposed conv up."""

    def __init__(self, channels: int, hidden: int, grid: tuple[int, int],
                 conv: Callable[..., nn.Conv2d] = nn.Conv2d) -> None:
        super().__init__()
        h, w = grid
        hd, wd = (h - 1) // 2 + 1, (w - 1) // 2 + 1  # rows and columns of the coarse level
        lon = {"kernel_size": 3, "padding": 1, "padding_mode": "circular"}  # longitude wraps round the globe
        self.enc = nn.Sequential(conv(channels, hidden, **lon), nn.GroupNorm(4, hidden), nn.GELU())
        self.down = nn.Sequential(conv(hidden, 2 * hidden, stride=2, **lon), nn.GroupNorm(4, 2 * hidden), nn.GELU(),
                                  conv(2 * hidden, 2 * hidden, **lon), nn.GELU())
        self.up = nn.ConvTranspose2d(2 * hidden, hidden, 3, stride=2, padding=1,
                                     output_padding=(h - 2 * hd + 1, w - 2 * wd + 1))  # back to exactly (h, w)
        self.dec = conv(2 * hidden, channels, **lon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc(x)
        b = self.up(self.down(a))
        return x + self.dec(torch.cat([a, b], dim=1))


def make_sample(channels: int, grid: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth global field ``(1, channels, H, W)`` (low spherical modes with random coefficients) and its
    target: the same field one grid column further east."""
    h, w = grid
    gen = torch.Generator().manual_seed(seed)
    lat = torch.deg2rad(halo.parallel.grid_latitudes(h))[:, None]
    lon = torch.deg2rad(torch.arange(w, dtype=torch.float64) * 360.0 / w)[None, :]
    x = torch.zeros(1, channels, h, w, dtype=torch.float64)
    for c in range(channels):
        for m, n in ((0, 1), (1, 1), (2, 2), (3, 2), (4, 3)):
            a, phase = torch.randn(2, generator=gen, dtype=torch.float64)
            x[0, c] += a * torch.cos(lat) ** m * torch.cos(n * lat) * torch.cos(m * lon + 3 * phase)
    return x.float(), x.roll(1, dims=-1).float()


class Samples(torch.utils.data.Dataset):
    """Sample ``i``: the field of seed ``1 + i`` and its target, whole (``(channels, H, W)``: the DataLoader adds the
    batch dim). The ranks of one domain group must get the same ``i``: ``halo.DomainSampler`` sees to it."""

    def __init__(self, n: int, channels: int, grid: tuple[int, int]) -> None:
        self.n, self.channels, self.grid = n, channels, grid

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = make_sample(self.channels, self.grid, seed=1 + i)
        return x[0], y[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default="37x72", help="HxW latitude x longitude (default 37x72: 5 degrees; W a "
                        "multiple of 4, so that the coarse level has an even W to roll by half across the poles)")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--domain", type=int, default=None, help="ranks per domain group (default: all)")
    parser.add_argument("--save", default=None, help="write the trained weights here (rank 0)")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder: resume from its newest complete checkpoint "
                        "(model, optimizer, sampler, step), save the whole training state there at the end")
    args = parser.parse_args(argv)
    h, w = (int(v) for v in args.grid.lower().split("x"))
    if w % 4 or h < 8:
        parser.error(f"--grid {args.grid}: W must be a multiple of 4 (the coarse level rolls by half its W across "
                     f"the poles) and H at least 8")
    if args.hidden % 4 or args.hidden < 4:
        parser.error(f"--hidden {args.hidden}: a positive multiple of 4 (GroupNorm with 4 groups)")

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT. NCCL on GPUs, gloo on CPUs: nothing else changes.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    rank, world = halo.launch.init_from_env(backend)  # init_process_group that comes back after a torchrun restart
    manager = halo.initialize_domain_parallel(world_size=world, domain_parallel_size=args.domain or world)

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    boundary = "pole" if h % 2 else "pole_centered"  # odd rows: both poles on the grid (721 for ERA5 0.25 deg)
    say(f"train.py: {world} ranks ({backend}, {device}): {manager.dp_world_size} data-parallel x "
        f"{manager.domain_world_size} domain ranks; grid {h}x{w}, boundary {boundary!r}")

    torch.manual_seed(0)  # the same seed on every rank: every rank builds the same weights
    net = UNet(args.channels, args.hidden, (h, w)).to(device)

    # 1. Once, at start-up: the converted model == the unsharded one, with the boundary we train with. The
    #    reference is the same network with the poles padded by hand (same module names and weights).
    pole_conv = functools.partial(PoleConv2d, pole_on_grid=boundary == "pole")
    reference = UNet(args.channels, args.hidden, (h, w), conv=pole_conv).to(device)
    reference.load_state_dict(net.state_dict())
    sample, _ = make_sample(args.channels, (h, w), seed=0)
    t0 = time.perf_counter()
    report = halo.check_equivalence(net, sample.to(device), reference=reference, convert_kwargs={"boundary": boundary})
    say(f"check_equivalence ({time.perf_counter() - t0:.1f} s): {report}")
    if not report.ok:  # every rank gets the same report, so every rank stops here
        dist.destroy_process_group()
        return 1

    # 2. Convert: layers that look at neighbouring rows exchange halos; the state_dict keys do not change.
    model = convert_to_domain_parallel(copy.deepcopy(net), manager, boundary=boundary, grid=(h, w))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # 3. Data: each data-parallel replica trains on its own samples, the ranks of a domain group on the same one
    #    (halo.DomainSampler: a DistributedSampler over the data-parallel ranks only), each holding its latitude
    #    rows (halo.shard: the balanced split, 37 rows on 2 ranks are 19 + 18). One epoch is --steps steps.
    dataset = Samples(args.steps * manager.dp_world_size, args.channels, (h, w))
    sampler = halo.DomainSampler(dataset, manager=manager, seed=0)
    loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=1)
    state = {"model": model, "optim": optimizer, "sampler": sampler, "step": 0}
    if args.ckpt and halo.checkpoint.latest(args.ckpt) is not None:
        halo.checkpoint.load(state, args.ckpt)  # weights, Adam's moments, the sampler's epoch, the step, halo's RNG
        sampler.set_epoch(sampler.epoch + 1)
        say(f"resumed from {args.ckpt} at step {state['step']} (epoch {sampler.epoch})")

    # 4. Train.
    t0 = time.perf_counter()
    first = state["step"]
    for i, (x, y) in enumerate(loader, start=1):
        x_local, y_local = halo.shard(x.to(device)), halo.shard(y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss = latitude_weighted_mse(model(x_local), y_local)  # the global loss, the same on every domain rank
        loss.backward()
        sync_domain_gradients(model, manager)  # sum over the domain group, mean over data parallel
        clip_grad_norm_(model, 10.0)  # the norm of the whole gradient (after the sync), the same on every rank
        optimizer.step()
        if i == 1 or i % 5 == 0 or i == args.steps:
            say(f"step {i:3d}/{args.steps}  loss {loss.item():.5f}  ({time.perf_counter() - t0:.1f} s)")
    state["step"] = first + len(loader)
    if args.ckpt:
        halo.checkpoint.save(state, args.ckpt, state["step"])  # a new folder, complete once every rank's part is in
        say(f"saved the training state to {args.ckpt} (step {state['step']})")

    # 5. The sharded loss of the trained model against the unsharded loss of the same weights on the whole field.
    #    Inside a distributed job, halo's functions reduce over the domain group by default; under
    #    halo.dist.comm.unsharded() they act on this process alone, as on one device.
    x, y = make_sample(args.channels, (h, w), seed=10**6)  # a held-out sample
    x, y = x.to(device), y.to(device)
    trained = UNet(args.channels, args.hidden, (h, w), conv=pole_conv).to(device)
    trained.load_state_dict(model.state_dict())  # the converted model's keys are the unconverted model's
    with torch.no_grad():
        sharded_loss = latitude_weighted_mse(model(halo.shard(x)), halo.shard(y)).item()
        with halo.dist.comm.unsharded():
            whole_loss = latitude_weighted_mse(trained(x), y).item()
    rel = abs(sharded_loss - whole_loss) / abs(whole_loss)
    ok = rel < 1e-5  # float32: the two sum the same numbers in another order
    say(f"held-out loss: sharded {sharded_loss:.6f}, unsharded {whole_loss:.6f}, relative difference {rel:.1e}")

    if args.save and rank == 0:
        torch.save(model.state_dict(), args.save)
        say(f"saved the trained weights to {args.save} (they load into the unconverted UNet)")
    say("OK: trained sharded, and the sharded loss equals the unsharded one" if ok
        else "FAILED: the sharded loss differs from the unsharded one")
    dist.barrier()  # every rank past its last collective before any tears its group down (gloo aborts otherwise)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
