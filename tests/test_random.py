"""Randomness that does not depend on the sharding (``halo.random``, ``halo.nn.dropout``).

- The generator: Philox-4x32-10 against Random123's known-answer vectors; the Triton kernel (interpreter here,
  compiled on CUDA) bitwise against the torch reference, counters past 2**32 included.
- The distribution: keep rates, uniformity and independence (neighbours in W, in H, across calls, across
  data-parallel streams) within 5 standard errors; normal noise's moments.
- Equivalence: a converted model with ``Dropout``, ``Dropout2d``, timm's ``DropPath``, torchvision's
  ``StochasticDepth``, ``AlphaDropout`` and ``FeatureAlphaDropout`` in train mode gives the same output, input
  gradient and (summed) parameter gradients on 1, 2, 3 and 7 gloo ranks, float64, 21 rows (uneven shards): bitwise
  where no cross-rank sum is involved (a model of random layers only), to 1e-12 with convolutions. The same layers
  in one process without torch.distributed draw the same. With dp 2 x domain 2 the two replicas draw differently
  and each equals the unsharded run of its own stream.
- Seeding: domain ranks seeded differently raise on every rank (never a silent mix of masks); activation
  checkpointing recomputes the same masks; ``torch.compile(fullgraph=True)`` works; a steady step reads nothing
  back and builds no tensor from Python data.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo import kernels as hk
from halo.kernels import philox
from halo.plan.partition import split_offsets
from halo.testing import RankError, run_on_ranks

H, W, C = 21, 10, 3


# -- the generator ----------------------------------------------------------------------------------------------

def test_philox_matches_random123_known_answers():
    t = lambda *v: [torch.tensor(a, dtype=torch.int64) for a in v]  # noqa: E731
    cases = [
        (t(0, 0, 0, 0, 0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        (t(*[0xFFFFFFFF] * 6), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (t(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for args, want in cases:
        assert [int(w) for w in philox.philox4x32(*args)] == want


SPACES = [  # (n, run, stride, offset): whole, a shard of rows, per channel, counters past 2**32
    (2 * 21 * 10, 21 * 10, 21 * 10, 0),
    (3 * 7 * 10, 7 * 10, 21 * 10, 7 * 10),
    (37, 1, 1, 0),
    (4 * 9, 9, 1 << 35, (1 << 34) + 3),
]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device "
                                                                  "(this test's CPU form runs Triton's interpreter)"))]


@pytest.mark.skipif(not hk.HAS_TRITON, reason=f"triton did not import: {hk.TRITON_IMPORT_ERROR}")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("space", SPACES)
def test_triton_bits_equal_reference(space, device):
    key = torch.tensor([0x1234_5678_9ABC_DEF], dtype=torch.int64, device=device)
    want = hk.bits(key, *space, 5, 2, impl="reference")
    got = hk.bits(key, *space, 5, 2, impl="triton")
    assert want.dtype == got.dtype == torch.int32
    assert torch.equal(got, want)
    assert int(want.min()) >= 0 and int(want.max()) < 1 << 24


@pytest.mark.skipif(not hk.HAS_TRITON, reason=f"triton did not import: {hk.TRITON_IMPORT_ERROR}")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_triton_dropout_equals_reference(dtype, device):
    key = torch.tensor([987654321987], dtype=torch.int64, device=device)
    x = torch.randn(2, 3, 7, 10, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    args = (key, 7 * 10, 21 * 10, 5 * 10, 1, round(0.3 * 2**24), 1 / 0.7)
    want = hk.dropout(x, *args, impl="reference")
    got = hk.dropout(x, *args, impl="triton")
    assert torch.equal(got == 0, want == 0)
    if dtype == torch.bfloat16 and device == "cpu":  # the interpreter rounds float32 -> bfloat16 toward zero
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


def test_draws_of_a_shard_are_the_whole_fields_rows():
    key = torch.tensor([42], dtype=torch.int64)
    whole = philox.bits(key, 2 * H * W, H * W, H * W, 0, 0, 0).view(2, H, W)
    for world in (2, 3, 7):
        offs = split_offsets(H, world)
        parts = [philox.bits(key, 2 * (b - a) * W, (b - a) * W, H * W, a * W, 0, 0).view(2, b - a, W)
                 for a, b in zip(offs[:-1], offs[1:], strict=True)]
        assert torch.equal(torch.cat(parts, dim=1), whole)


# -- the distribution ---------------------------------------------------------------------------------------------

def _within(observed, expected, sd, k=5.0):
    assert abs(observed - expected) <= k * sd, (observed, expected, sd)


def test_keep_rate_uniformity_and_independence():
    from halo import random as hr

    torch.manual_seed(0)
    x = torch.ones(4, 8, 64, 128, dtype=torch.float64)  # 262144 elements
    n = x.numel()
    for p in (0.1, 0.5, 0.9):
        y = hr.dropout(x, p)
        kept = (y != 0).double()
        _within(kept.mean().item(), 1 - p, math.sqrt(p * (1 - p) / n))
        assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)))
        # Independence: neighbours along W and along H, and two draws of the same elements (a new key per call).
        other = (hr.dropout(x, p) != 0).double()
        for a, b in ((kept[..., 1:], kept[..., :-1]), (kept[..., 1:, :], kept[..., :-1, :]), (kept, other)):
            both = (a * b).mean().item()
            _within(both, (1 - p) ** 2, math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / a.numel()))
    # The 24-bit draws are uniform: 64 bins, chi-square within 5 sd of its mean (63).
    u = philox.bits(torch.tensor([7]), n, n, n, 0, 0, 0)
    counts = torch.bincount((u >> 18).long(), minlength=64).double()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    _within(chi2, 63, math.sqrt(2 * 63))
    # Streams (data-parallel replicas) are independent of each other.
    a = (philox.bits(torch.tensor([7]), n, n, n, 0, 1, 0) >= 1 << 23).double()
    b = (u >= 1 << 23).double()
    _within((a * b).mean().item(), 0.25, math.sqrt(0.25 * 0.75 / n))


def test_per_channel_and_per_sample_rates():
    from halo import random as hr

    torch.manual_seed(1)
    x = torch.ones(64, 256, 3, 5, dtype=torch.float64)
    y = hr.feature_dropout(x, 0.3)
    per_channel = (y != 0).double()
    assert torch.equal(per_channel, per_channel[..., :1, :1].expand_as(per_channel))  # whole channels
    _within(per_channel[..., 0, 0].mean().item(), 0.7, math.sqrt(0.21 / (64 * 256)))
    z = hr.drop_path(torch.ones(20000, 2, 3, dtype=torch.float64), 0.25, True)
    rows = (z != 0).double()
    assert torch.equal(rows, rows[:, :1, :1].expand_as(rows))  # whole samples
    _within(rows[:, 0, 0].mean().item(), 0.75, math.sqrt(0.1875 / 20000))
    assert torch.equal(z[z != 0], torch.full_like(z[z != 0], 1 / 0.75))


def test_noise_moments():
    from halo import random as hr

    torch.manual_seed(2)
    x = torch.zeros(2, 4, 128, 256, dtype=torch.float64)
    n = x.numel()
    u = hr.rand_like(x)
    assert 0 <= u.min().item() and u.max().item() < 1
    _within(u.mean().item(), 0.5, math.sqrt(1 / 12 / n))
    z = hr.randn_like(x)
    _within(z.mean().item(), 0.0, math.sqrt(1 / n))
    _within(z.var().item(), 1.0, math.sqrt(2 / n))
    _within((z**4).mean().item(), 3.0, math.sqrt(96 / n))
    _within((z[..., 1:] * z[..., :-1]).mean().item(), 0.0, math.sqrt(1 / n))


# -- equivalence across rank counts -----------------------------------------------------------------------------------

def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm.layers.drop_path, verbatim (timm imports torchvision, which the CPU torch here cannot load)."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    """timm.layers.DropPath, verbatim."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth, as torchvision writes it."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        survival_rate = 1.0 - self.p
        size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival_rate)
        if survival_rate > 0.0:
            noise.div_(survival_rate)
        return x * noise


class RandomOnly(nn.Module):
    """Random layers only: no sum across ranks anywhere, so every rank count gives the same bits."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.chan = nn.Dropout2d(0.25)
        self.path = DropPath(0.5)
        self.depth = StochasticDepth(0.2, "batch")
        self.alpha = nn.AlphaDropout(0.2)
        self.falpha = nn.FeatureAlphaDropout(0.1)

    def forward(self, x):
        a = self.chan(self.drop(x))
        a = x + self.path(a) + self.depth(a)
        return self.falpha(self.alpha(a))


class ConvRandom(nn.Module):
    """Convolutions around the random layers (a U-Net-like block with drop-path on a residual branch)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(C, 6, 3, padding=1)
        self.drop = nn.Dropout(0.2)
        self.mid = nn.Conv2d(6, 6, 3, padding=1)
        self.chan = nn.Dropout2d(0.3)
        self.path = DropPath(0.4)
        self.dec = nn.Conv2d(6, C, 3, padding=1)

    def forward(self, x):
        a = self.drop(F.gelu(self.enc(x)))
        a = a + self.path(self.chan(F.gelu(self.mid(a))))
        return x + self.dec(a)


BUILDS = {"RandomOnly": RandomOnly, "ConvRandom": ConvRandom}
TYPES = {"drop": "DomainDropout", "chan": "DomainDropout2d", "path": "DomainDropPath", "depth": "DomainDropPath",
         "alpha": "DomainAlphaDropout", "falpha": "DomainFeatureAlphaDropout"}


def _inputs():
    full = torch.randn(4, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wts = torch.randn(4, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return full, wts


def _equivalence(rank, world, domain, name, checkpoint):
    import torch.utils.checkpoint as ckpt

    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, domain)
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    convert_to_domain_parallel(model, manager)
    types = {n: type(m).__name__ for n, m in model.named_children()}
    full, wts = _inputs()
    offs = split_offsets(H, domain)
    r = manager.domain_rank
    x = full[..., offs[r]:offs[r + 1], :].clone().requires_grad_(True)
    results = []
    halo.manual_seed(5)
    for _ in range(2):  # two steps: new keys, new masks
        out = ckpt.checkpoint(model, x, use_reentrant=False) if checkpoint else model(x)
        (out * wts[..., offs[r]:offs[r + 1], :]).sum().backward()
        results.append({"out": halo.gather(out.detach()), "grad": halo.gather(x.grad),
                        "params": {n: p.grad.clone() for n, p in model.named_parameters()}})
        x.grad = None
        model.zero_grad(set_to_none=True)
    return {"types": types, "steps": results, "dp": manager.dp_rank}


def _single_process(name):
    """The same halo layers in this process, without torch.distributed: the whole field on one 'rank'."""
    from halo import manual_seed
    from halo.nn import dropout as hd

    torch.manual_seed(0)
    model = BUILDS[name]().double()
    for child_name, child in list(model.named_children()):
        kind = TYPES.get(child_name)
        if kind == "DomainDropPath":
            setattr(model, child_name, hd.DomainDropPath.adopt(child))
        elif kind is not None:
            setattr(model, child_name, getattr(hd, kind)(child))
    full, wts = _inputs()
    x = full.clone().requires_grad_(True)
    manual_seed(5)
    steps = []
    for _ in range(2):
        out = model(x)
        (out * wts).sum().backward()
        steps.append({"out": out.detach(), "grad": x.grad, "params": {n: p.grad for n, p in model.named_parameters()}})
        x.grad = None
        model.zero_grad(set_to_none=True)
    return steps


def _check(results, ref, exact, domain):
    for r in results:
        for step, want in zip(r["steps"], ref, strict=True):
            for k in ("out", "grad"):
                if exact:
                    assert torch.equal(step[k], want[k]), (k, (step[k] - want[k]).abs().max())
                else:
                    assert torch.allclose(step[k], want[k], rtol=0, atol=1e-12), (k, (step[k] - want[k]).abs().max())
    for s, want in enumerate(ref):
        for n, g in want["params"].items():
            got = sum(r["steps"][s]["params"][n] for r in results[:domain])  # the first replica's domain group
            assert torch.allclose(got, g, rtol=0, atol=1e-11), (n, (got - g).abs().max())


@pytest.mark.parametrize("name", ["RandomOnly", "ConvRandom"])
def test_converted_model_draws_the_same_on_any_number_of_ranks(name):
    ref = _single_process(name)
    assert (ref[0]["out"] != ref[1]["out"]).any()  # a new mask each step
    exact = name == "RandomOnly"
    for world in (1, 2, 3, 7) if exact else (1, 3):
        results = run_on_ranks(_equivalence, world, world, name, False, timeout=120)
        for r in results:
            assert all(r["types"][k] == v for k, v in TYPES.items() if k in r["types"]), r["types"]
        _check(results, ref, exact, world)


def test_activation_checkpointing_recomputes_the_same_masks():
    ref = _single_process("ConvRandom")
    _check(run_on_ranks(_equivalence, 2, 2, "ConvRandom", True, timeout=120), ref, False, 2)


def test_data_parallel_replicas_draw_differently():
    results = run_on_ranks(_equivalence, 4, 2, "RandomOnly", False, timeout=120)
    ref = _single_process("RandomOnly")  # stream 0: the first replica's draws
    first = [r for r in results if r["dp"] == 0]
    second = [r for r in results if r["dp"] == 1]
    _check(first, ref, True, 2)
    for r in second:
        assert torch.equal(r["steps"][0]["out"], second[0]["steps"][0]["out"])  # one replica: one mask
        assert (r["steps"][0]["out"] != ref[0]["out"]).float().mean() > 0.1  # another replica: another mask


def _seeded_per_rank(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(nn.Sequential(nn.Dropout(0.5)), manager)
    torch.manual_seed(100 + rank)  # the usual "seed + rank": wrong inside a domain group
    full, _ = _inputs()
    offs = split_offsets(H, world)
    return model(full[..., offs[rank]:offs[rank + 1], :])


def test_domain_ranks_seeded_differently_raise_on_every_rank():
    with pytest.raises(RankError) as info:
        run_on_ranks(_seeded_per_rank, 3, timeout=60)
    text = str(info.value)
    assert "random generators" in text and "halo.random.manual_seed" in text, text


def _steady(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean
    from halo.testing import HostWorkCounter

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(ConvRandom().double(), manager, grid=(H, W))
    full, _ = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :]
    counts = []
    for _ in range(4):
        with HostWorkCounter(keep_stacks=True) as counter:
            domain_mean(model(x) ** 2).backward()
        counts.append((counter.summary(), dict(counter.where)))
    return counts


def test_steady_step_with_dropout_makes_no_host_work():
    for counts in run_on_ranks(_steady, 3, timeout=120):
        first, _ = counts[0]
        assert first.get("agreement", 0) >= 1  # the first step learns the extents and checks the generators
        summary, where = counts[3]
        assert summary == counts[2][0], (summary, counts[2][0])
        for key in ("read", "from_data", "agreement", "c10d.all_gather"):
            assert summary.get(key, 0) == 0, (key, where.get(key))


def test_compiled_layers_regenerate_the_mask_in_backward():
    from halo.nn import DomainDropout, DomainDropPath

    torch.manual_seed(3)
    model = nn.Sequential(DomainDropout(0.4), DomainDropPath(0.3))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = (torch.rand(64, 2, 9, 6, dtype=torch.float64) + 0.5).requires_grad_(True)
    y = compiled(x)
    y.backward(torch.ones_like(y))
    ratio = y.detach() / x.detach()  # each element's mask times its scales
    assert torch.equal(x.grad == 0, ratio == 0)  # the backward drew the forward's mask again
    assert torch.allclose(x.grad, ratio, rtol=1e-14, atol=0)
    kept = (ratio != 0).double().mean().item()
    assert abs(kept - 0.6 * 0.7) < 0.17, kept  # 64 samples: 5 sd of the drop-path's share
    assert torch.allclose(x.grad[x.grad != 0], torch.tensor(1 / 0.6 / 0.7, dtype=torch.float64), rtol=1e-14)


def test_eval_mode_and_bad_input():
    from halo.nn import DomainDropout, DomainDropout2d

    x = torch.randn(2, 3, 5, 4)
    d = DomainDropout(0.5).eval()
    assert d(x) is x
    with pytest.raises(ValueError, match="refused rather than guessed"):
        DomainDropout(0.5)(torch.randn(4, 8))
    with pytest.raises(ValueError, match="between 0 and 1"):
        DomainDropout2d(0.5).__class__(1.5)(x)
    assert torch.equal(DomainDropout(1.0)(x), torch.zeros_like(x))


def _compiled(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(ConvRandom().double(), manager)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    full, wts = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    halo.manual_seed(5)
    steps = []
    for _ in range(2):
        out = compiled(x)
        (out * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
        steps.append({"out": halo.gather(out.detach()), "grad": halo.gather(x.grad),
                      "params": {n: p.grad.clone() for n, p in model.named_parameters()}})
        x.grad = None
        model.zero_grad(set_to_none=True)
    return {"steps": steps, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def test_compiled_converted_model_draws_what_the_unsharded_model_draws():
    # aot_eager runs the graph's randint eagerly: the same keys as the eager model (inductor draws its own stream,
    # the same on every rank).
    results = run_on_ranks(_compiled, 2, timeout=240)
    _check(results, _single_process("ConvRandom"), False, 2)
    assert all(r["graphs"] == 1 for r in results), [r["graphs"] for r in results]


def test_reference_path_equals_the_kernel_path(monkeypatch):
    """On CPU without the interpreter the dropout runs on the torch reference and keeps its mask for the backward
    (the kernel path draws it again): the same numbers either way."""
    from halo import manual_seed
    from halo.nn import DomainDropout

    x = torch.randn(3, 4, 11, 6, dtype=torch.float64)
    g = torch.randn(3, 4, 11, 6, dtype=torch.float64)
    results = []
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        xi = x.clone().requires_grad_(True)
        manual_seed(11)
        y = DomainDropout(0.35)(xi)
        y.backward(g)
        results.append((y.detach(), xi.grad))
    assert hk.backend_for(x, "dropout") == "reference"
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _mesh_equivalence(rank, world, shape, name):
    import halo
    from halo.nn import convert_to_domain_parallel

    mesh = halo.DomainMesh(shape)
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    convert_to_domain_parallel(model, mesh=mesh)
    types = {n: type(m).__name__ for n, m in model.named_children()}
    full, wts = _inputs()
    x = halo.shard_2d(full, mesh=mesh).requires_grad_(True)
    w = halo.shard_2d(wts, mesh=mesh)
    results = []
    halo.manual_seed(5)
    for _ in range(2):
        out = model(x)
        (out * w).sum().backward()
        results.append({"out": halo.gather_2d(out.detach(), mesh=mesh), "grad": halo.gather_2d(x.grad, mesh=mesh),
                        "params": {n: p.grad.clone() for n, p in model.named_parameters()}})
        x.grad = None
        model.zero_grad(set_to_none=True)
    return {"types": types, "steps": results}


@pytest.mark.parametrize("name, shape", [("RandomOnly", (2, 2)), ("RandomOnly", (3, 2)), ("ConvRandom", (2, 3))])
def test_converted_model_draws_the_same_on_a_latitude_longitude_mesh(name, shape):
    """On blocks of a latitude x longitude mesh every element, channel and sample draws what it draws in one
    process: the random layers alone bitwise, with convolutions around them to rounding."""
    ref = _single_process(name)
    world = shape[0] * shape[1]
    results = run_on_ranks(_mesh_equivalence, world, shape, name, timeout=180)
    for r in results:
        assert all(r["types"][k] == v for k, v in TYPES.items() if k in r["types"]), r["types"]
    _check(results, ref, name == "RandomOnly", world)
