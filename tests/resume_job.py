"""A tiny training job for tests/test_resume.py, run under ``torchrun --max-restarts``: a converted net with halo
dropout, Adam and an LR scheduler, float64 on CPU, that checkpoints every ``SAVE_EVERY`` steps and resumes from
the latest complete checkpoint, and can kill one of its ranks at a chosen step and phase.

Environment (set by the test):

==========================  ===========================================================================================
``RESUME_ROOT``             the checkpoint folder (shared by every attempt)
``RESUME_OUT``              where each rank writes its final state (``<RESUME_OUT>/rank<r>.pt``)
``RESUME_MODE``             ``none`` (every rank one domain group), ``ddp`` or ``fsdp`` (2 dp x the rest domain)
``RESUME_STEPS``            steps to train (default 6); ``RESUME_SAVE_EVERY`` (default 2)
``RESUME_FAULTS``           ``attempt:rank:step:phase,...``: on restart ``attempt`` (torchrun's
                            ``TORCHELASTIC_RESTART_COUNT``), global rank ``rank`` exits with ``os._exit(9)`` at step
                            ``step`` in phase ``forward``, ``backward``, ``between`` (after the optimizer step:
                            ``SIGKILL``), ``save`` (inside DCP's write of the save after that step) or ``load``
                            (inside DCP's read of the resume; ``step`` ignored). Each fires on its attempt only.
==========================  ===========================================================================================
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn

H, W, C = 11, 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, 4, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        return self.b(self.drop(F.gelu(self.a(x))))


class Data:
    """The data position (the next sample's index): what a sampler's state_dict holds."""

    def __init__(self):
        self.offset = 0

    def next(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.offset)
        self.offset += 1
        x = torch.randn(2, C, H, W, dtype=torch.float64, generator=g)
        y = torch.randn(2, 1, H, W, dtype=torch.float64, generator=g)
        return x[..., rows, :], y[..., rows, :]

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, sd):
        self.offset = int(sd["offset"])


def _faults(attempt: int, rank: int) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for item in filter(None, os.environ.get("RESUME_FAULTS", "").split(",")):
        a, r, s, phase = item.split(":")
        if int(a) == attempt and int(r) == rank:
            out.setdefault(phase, set()).add(int(s))
    return out


def _die_inside(cls: type, name: str) -> None:
    def die(*args, **kwargs):
        sys.stdout.flush()
        os._exit(9)

    setattr(cls, name, die)


def main() -> None:
    import torch.distributed.checkpoint.filesystem as fs

    import halo
    from halo import checkpoint
    from halo.launch import init_from_env
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.plan.partition import split_offsets

    torch.set_num_threads(1)
    rank, world = init_from_env("gloo", timeout=60.0, connect_timeout=30.0)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = _faults(attempt, rank)
    root, out = os.environ["RESUME_ROOT"], os.environ["RESUME_OUT"]
    mode = os.environ.get("RESUME_MODE", "none")
    steps = int(os.environ.get("RESUME_STEPS", "6"))
    every = int(os.environ.get("RESUME_SAVE_EVERY", "2"))
    halo.set_timeout(60.0)

    domain = world if mode == "none" else world // 2
    manager = halo.initialize_domain_parallel(world, domain)
    halo.random.manual_seed(0)
    model = halo.parallelize(Net().double(), manager, data_parallel=mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = Data()
    state = {"model": model, "optim": opt, "sched": sched, "data": data}
    offs = split_offsets(H, manager.domain_parallel_size)
    rows = slice(offs[manager.domain_rank], offs[manager.domain_rank + 1])
    dp = manager.dp_rank

    start = 0
    if checkpoint.latest(root) is not None:
        if "load" in faults:
            _die_inside(fs.FileSystemReader, "read_data")
        start = checkpoint.load(state, root).step
    for step in range(start, steps):
        x, y = data.next(rows)
        x, y = x[dp:dp + 1], y[dp:dp + 1]  # each replica its own sample
        if step in faults.get("forward", ()):
            os._exit(9)
        pred = model(x)
        loss = domain_mean((pred - y) ** 2)
        if step in faults.get("backward", ()):
            os._exit(9)
        loss.backward()
        sync_domain_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step in faults.get("between", ()):
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % every == 0 or step + 1 == steps:
            if step in faults.get("save", ()):
                _die_inside(fs.FileSystemWriter, "write_data")
            checkpoint.save(state, root, step + 1)

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                 flatten_optimizer_state_dict=True))

    def plain(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    final = {"model": {k: plain(v) for k, v in msd.items()}, "optim": {k: plain(v) for k, v in osd.items()},
             "sched": sched.state_dict(), "data": data.state_dict(), "rng": torch.get_rng_state(),
             "attempt": attempt, "start": start}
    os.makedirs(out, exist_ok=True)
    torch.save(final, os.path.join(out, f"rank{rank}.pt"))
    import torch.distributed as dist

    # Every rank is past its last collective before any tears its groups down: a rank that destroyed its gloo
    # group while a peer was still inside one aborted ("terminate called without an active exception", SIGABRT)
    # and torchrun counted it as a failed attempt (seen in CI, about 1 run in 9)
    dist.barrier()
    halo.destroy_domain_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
