"""Model conversion and training equivalence: a small weather U-Net trained sharded equals the unsharded run.

Float64 throughout. The sharded run differs from the unsharded one only in the order of floating-point sums
(norm statistics and the loss are all-reduced across ranks; parameter gradients are summed across ranks), so
after 3 SGD steps parameters agree to ~1e-13 relative; the issue asks for 1e-10.
"""

import pytest
import torch
from torch import nn

from halo.testing import RankError, run_on_ranks

H, W, C = 44, 16, 3


class WeatherUNet(nn.Module):
    """conv, strided conv down, BatchNorm, pooling, upsample, transposed conv up, GroupNorm, skip connection."""

    def __init__(self, c: int = C, hidden: int = 6) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(c, hidden, 3, padding=1, padding_mode="circular"),
                                 nn.GroupNorm(2, hidden), nn.SiLU())
        self.down = nn.Sequential(nn.Conv2d(hidden, 2 * hidden, 3, stride=2, padding=1),
                                  nn.BatchNorm2d(2 * hidden), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(2 * hidden, 2 * hidden, (5, 3), padding="same", dilation=(2, 1))
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.up2 = nn.ConvTranspose2d(2 * hidden, hidden, 4, stride=2, padding=1)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.out = nn.Conv2d(2 * hidden, c, 1)

    def forward(self, x):
        a = self.inc(x)
        b = self.pool(self.down(a))
        b = self.up1(self.mid(b))
        c = self.avg(self.up2(b))
        return self.out(torch.cat([a, c], dim=1))


def _data(batch):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, C, H, W, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, C, H, W, generator=gen, dtype=torch.float64)
    return x, y


def _reference(batch, steps):
    torch.manual_seed(0)
    model = WeatherUNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(batch)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


TRAINING = (2, 3)  # batch, steps


def _sharded(rank, world, domain, batch, steps):
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # torch reference kernels: the interpreter path is tested elsewhere
    import halo
    from halo.nn.convert import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients
    from halo.plan.partition import local_range

    m = halo.initialize_domain_parallel(world, domain)
    torch.manual_seed(0)
    model = WeatherUNet().double()
    keys_before = list(model.state_dict())
    convert_to_domain_parallel(model, m)
    assert list(model.state_dict()) == keys_before
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(batch)
    per = batch // m.dp_world_size  # each dp rank its part of the batch
    lo, hi = local_range(H, domain, m.domain_rank)
    xs = x[m.dp_rank * per:(m.dp_rank + 1) * per, :, lo:hi]
    ys = y[m.dp_rank * per:(m.dp_rank + 1) * per, :, lo:hi]
    for _ in range(steps):
        opt.zero_grad()
        loss = domain_mean((model(xs) - ys) ** 2)
        loss.backward()
        sync_domain_gradients(model, m)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _sharded_then_rules(rank, world, domain, batch, steps):
    """The 2-rank training launch also runs the conversion rules (a launch costs more than they do)."""
    return _sharded(rank, world, domain, batch, steps), _convert_rules(rank, world)


_RUNS: dict = {}


def _trained(world, domain, batch, steps):
    if (world, domain) not in _RUNS:
        if (world, domain) == (2, 2):
            trained, rules = zip(*run_on_ranks(_sharded_then_rules, world, domain, batch, steps, timeout=240),
                                 strict=True)
            _RUNS[2, 2], _RUNS["rules"] = list(trained), list(rules)
        else:
            _RUNS[world, domain] = run_on_ranks(_sharded, world, domain, batch, steps, timeout=240)
    return _RUNS[world, domain]


@pytest.mark.parametrize("world,domain", [(1, 1), (2, 2), (3, 3), (4, 4), (4, 2)])
def test_training_equivalence(world, domain):
    batch, steps = TRAINING
    want = _reference(batch, steps)
    results = _trained(world, domain, batch, steps)
    for rank, got in enumerate(results):
        assert list(got) == list(want)
        for k in want:
            err = (got[k].double() - want[k].double()).abs().max().item()
            assert err <= 1e-10, (rank, k, err)


def _convert_rules(rank, world):
    import halo
    from halo.nn.convert import convert_to_domain_parallel, revert_domain_parallel

    m = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = WeatherUNet().double()
    original_types = [type(mod) for mod in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_domain_parallel(model, m)
    converted = {name: type(mod).__name__ for name, mod in model.named_modules()}
    same_state = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    # A sharded-trained state loads into the unsharded model and back.
    revert_domain_parallel(model)
    reverted_types = [type(mod) for mod in model.modules()]
    errors = {}
    for name, bad in (("attention", nn.TransformerEncoderLayer(4, 2, dim_feedforward=8)), ("flatten", nn.Flatten()),
                      ("unknown", _Mystery())):
        try:
            convert_to_domain_parallel(nn.Sequential(nn.Conv2d(1, 1, 3), bad), m)
        except ValueError as exc:
            errors[name] = str(exc)
    declared = convert_to_domain_parallel(nn.Sequential(_Mystery()), m, custom_converters={_Mystery: None})
    return {"converted": converted, "same_state": same_state, "reverted": reverted_types == original_types,
            "errors": errors, "declared": type(declared[0]).__name__}


class _Mystery(nn.Module):
    def forward(self, x):
        return x


def test_convert_keeps_state_and_refuses_global_layers():
    _trained(2, 2, *TRAINING)  # the 2-rank training launch runs the rules too
    for r in _RUNS["rules"]:
        conv = r["converted"]
        assert conv["inc.0"] == "DomainConv2d" and conv["down.0"] == "DomainConv2d"
        assert conv["out"] == "Conv2d", "a 1x1 stride-1 conv is pointwise: untouched"
        assert conv["inc.1"] == "DomainGroupNorm" and conv["down.1"] == "DomainBatchNorm2d"
        assert conv["pool"] == "DomainMaxPool2d" and conv["up1"] == "DomainUpsample"
        assert conv["up2"] == "DomainConvTranspose2d" and conv["avg"] == "DomainAvgPool2d"
        assert conv["inc.2"] == "SiLU"
        assert r["same_state"] and r["reverted"]
        assert "1 (TransformerEncoderLayer) mixes values across the whole sharded latitude dim" \
            in r["errors"]["attention"]
        assert "1 (Flatten) mixes values across the whole sharded latitude dim" in r["errors"]["flatten"]
        assert "_Mystery) is not a layer halo knows" in r["errors"]["unknown"]
        assert "pointwise in latitude when every output row depends only on" in r["errors"]["unknown"]
        assert r["declared"] == "_Mystery"


def _no_manager(rank, world):
    from halo.nn.convert import convert_to_domain_parallel

    convert_to_domain_parallel(nn.Sequential(nn.Conv2d(1, 1, 3)))


def test_convert_without_manager_says_how():
    with pytest.raises(RankError, match="call halo.initialize_domain_parallel"):
        run_on_ranks(_no_manager, 2, timeout=60)
