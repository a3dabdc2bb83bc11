"""Helpers shared by the layer tests."""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from halo import testing
from halo.plan.partition import split_offsets


@contextlib.contextmanager
def virtual_rank(full, parts, rank, module):
    """Make ``module`` see ``parts`` ranks, this being ``rank``: its plans are made for that split of ``full``
    (``halo.plan.plans.resolve`` replaced by the plan's pure ``make``), and its exchanges slice ``full``."""
    import halo.exchange as hx
    from halo.dist.comm import CommGroup

    offs = split_offsets(full.shape[-2], parts)
    cg = CommGroup(None, parts, rank, tuple(range(parts)))
    sizes = tuple(offs[i + 1] - offs[i] for i in range(parts))

    def resolve(x, group, op, make, extra=(), **kwargs):
        return make(cg, (sizes,), *extra)

    def exchange(x, ex_id, rows, dim=-2):
        lo, hi = hx.exchange_spec(ex_id).needs[rank]
        assert hi - lo == rows
        return full.narrow(-2, lo, hi - lo)

    fakes = {"resolve": resolve, "exchange": exchange}
    saved = {name: getattr(module, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(module, name, fake)
    try:
        yield full.narrow(-2, offs[rank], offs[rank + 1] - offs[rank])
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def portable(obj):
    """Tensors as numpy arrays (bf16 as float32), recursively: results a rank returns, in a form the tests
    compare with numpy."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


class SteadyNet(nn.Module):
    """Every layer kind whose plan depends on every rank's extents: 3x3 convs (circular in W), GroupNorm, a stride-2
    conv, max pooling, bilinear upsampling, a transposed conv; 45 x 16 -> 23 -> 11 -> 22 -> 45 rows."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.enc = nn.Conv2d(c, 6, 3, padding=1, padding_mode="circular")
        self.norm = nn.GroupNorm(2, 6)
        self.down = nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="circular")
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.upt = nn.ConvTranspose2d(6, 6, 4, stride=2, padding=1, output_padding=(1, 0))
        self.dec = nn.Conv2d(6, c, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        a = F.gelu(self.norm(self.enc(x)))
        b = self.up(self.pool(F.gelu(self.down(a))))  # 45 -> 23 -> 11 -> 22
        return x + self.dec(F.gelu(self.upt(b)))  # 22 -> 45


def steady_reference(full, steps):
    """The unsharded twin of the steady-state tests' training loop: SteadyNet (seed 0), SGD with momentum, an MSE
    against the input, ``steps`` steps on the whole field ``full``; every step's output."""
    torch.manual_seed(0)
    model = SteadyNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    outs = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(full)
        ((out - full) ** 2).mean().backward()
        opt.step()
        outs.append(out.detach())
    return outs


def run_allow_failures(fn, world, *args, timeout=60.0, pg_timeout=30.0):
    """Like ``run_on_ranks`` but a dead rank does not hide the others: per rank ``("ok", result)``,
    ``("error", text)`` or ``("died", exit code)``; ranks still running at ``timeout`` are killed and
    reported as ``("timeout", None)`` (``halo.testing.run_on_ranks_outcomes``).
    """
    return testing.run_on_ranks_outcomes(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout)
