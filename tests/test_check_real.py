"""``halo.check_equivalence`` on the models users have (issue 23 item 3), and on the device a group computes on.

Each case is a small model of a kind users have, checked on 2 and 3 gloo ranks with uneven rows (37 rows: 19+18 and
13+12+12), float64, forward and backward: the exact model must pass (``report.ok``), and a deliberately broken
variant must be reported, naming the module where the difference arises. The broken variants scale a value by
the *local* row count (``x.shape[-2] / H``: 1 in the unsharded model, about 1/P on a shard), a bug the guard cannot
see (a Python number derived from a shard's shape) and exactly the kind ``check_equivalence`` is the net for.

Cases: a global pool (smp's scSE: ``AdaptiveAvgPool2d(1)`` squeeze-excite, whose branch after the pool is whole on
every rank), list / tuple / dict outputs (a ``features_only``-style encoder, a multi-head model with a classifier
head on the pooled features), 2-d ``(B, features)`` timestep embeddings (whole, never gathered along the batch
dim), a conv bias before a train-mode BatchNorm (its gradient is 0 in exact arithmetic), complex parameters and
integer buffers and outputs, BatchNorm running statistics, and the first differing module named where the
difference is made (the first in execution order, not by name; inside a module, or by a functional op in its
parent's forward between two child modules).
"""

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from halo.nn.convert import INSIDE
from halo.testing import run_on_ranks

#: above the rank launches' timeout (one launch runs every check of a world size): pytest must not kill them first
pytestmark = pytest.mark.timeout(500)

H, W, C = 37, 8, 4


def _local_factor(x):
    """1 in the unsharded model, this rank's share of the rows on a shard: a bug no function mode can see."""
    return x.shape[-2] / H


class SCSE(nn.Module):
    """smp's SCSEModule (concurrent spatial and channel squeeze-excitation), as smp writes it."""

    def __init__(self, c, reduction=2, broken=False):
        super().__init__()
        self.cSE = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // reduction, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())
        self.sSE = nn.Sequential(nn.Conv2d(c, 1, 1), nn.Sigmoid())
        self.broken = broken

    def forward(self, x):
        gate = self.cSE(x)
        if self.broken:
            gate = gate * _local_factor(x)
        return x * gate + x * self.sSE(x)


class SENet(nn.Module):
    """An encoder level and a stride-2 level, each with scSE (smp's U-Net decoder with attention_type="scse")."""

    def __init__(self, broken=False):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C, 3, padding=1)
        self.scse = SCSE(C, broken=broken)
        self.down = nn.Conv2d(C, C, 3, stride=2, padding=1)
        self.down_scse = SCSE(C)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.scse(torch.relu(self.conv1(x))))
        return self.conv2(torch.relu(self.down_scse(torch.relu(self.down(y)))))


class Scale(nn.Module):
    """x times a fixed factor (times the local factor when broken): no parameters, nothing to declare."""

    def __init__(self, c, broken=False):
        super().__init__()
        self.broken = broken

    def forward(self, x):
        return x * (0.5 * _local_factor(x) if self.broken else 0.5)


class Encoder(nn.Module):
    """A ``features_only`` encoder: a list of feature maps at strides 1, 2, 4."""

    def __init__(self, broken=False):
        super().__init__()
        self.stem = nn.Conv2d(C, C, 3, padding=1)
        self.stages = nn.ModuleList([nn.Sequential(nn.Conv2d(C, C, 3, stride=2, padding=1), nn.ReLU()),
                                     nn.Sequential(nn.Conv2d(C, C, 3, stride=2, padding=1), Scale(C, broken))])

    def forward(self, x):
        feats = [torch.relu(self.stem(x))]
        for stage in self.stages:
            feats.append(stage(feats[-1]))
        return feats


class MultiHead(nn.Module):
    """A dict of heads and a tuple: a segmentation field, a feature map and a classifier on the pooled features."""

    def __init__(self, broken=False):
        super().__init__()
        self.body = nn.Conv2d(C, C, 3, padding=1)
        self.seg = nn.Conv2d(C, 2, 1)
        self.aux = nn.Sequential(nn.Conv2d(C, C, 3, stride=2, padding=1), Scale(C, broken))
        self.cls = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, 3))

    def forward(self, x):
        f = torch.relu(self.body(x))
        return {"seg": self.seg(f), "heads": (self.aux(f), self.cls(f))}


class TimeEmbedding(nn.Module):
    """diffusers-style: sinusoidal features of the timestep, then Linear-SiLU-Linear: ``(B, features)``."""

    def __init__(self, dim, broken=False):
        super().__init__()
        self.linear_1 = nn.Linear(dim, 2 * dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(2 * dim, C)
        self.dim = dim

    def forward(self, t):
        freqs = torch.exp(-torch.arange(self.dim // 2, dtype=t.dtype, device=t.device) * (4.0 / self.dim))
        args = t[:, None] * freqs[None, :]
        return self.linear_2(self.act(self.linear_1(torch.cat([torch.sin(args), torch.cos(args)], dim=1))))


class TimeBlock(nn.Module):
    """A ResNet block with a timestep embedding added per channel (diffusers' ``ResnetBlock2D``, shrunk)."""

    def __init__(self, broken=False):
        super().__init__()
        self.time_embedding = TimeEmbedding(8)
        self.conv1 = nn.Conv2d(C, C, 3, padding=1)
        self.scale = Scale(C, broken)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x, t):
        emb = self.time_embedding(t)
        h = torch.relu(self.conv1(x) + emb[:, :, None, None])
        return x + self.conv2(self.scale(h)), emb


class BiasBeforeBN(nn.Module):
    """A conv with a bias before a train-mode BatchNorm: the bias's gradient is 0 in exact arithmetic."""

    def __init__(self, broken=False):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(C)
        self.out = nn.Conv2d(C, C, 3, padding=1)
        self.scale = Scale(C, broken)

    def forward(self, x):
        return self.scale(self.out(torch.relu(self.bn(self.conv(x)))))


class ComplexGain(nn.Module):
    """A per-channel complex gain (a complex parameter), its result a complex field."""

    def __init__(self, c, broken=False):
        super().__init__()
        self.gain = nn.Parameter(torch.complex(torch.linspace(0.5, 1.5, c), torch.linspace(-1.0, 1.0, c)))
        self.broken = broken

    def forward(self, z):
        out = z * self.gain.view(1, -1, 1, 1)
        return out * _local_factor(z) if self.broken else out


class ComplexNet(nn.Module):
    """Complex weights and an integer buffer; returns a complex field and an integer mask."""

    def __init__(self, broken=False):
        super().__init__()
        self.conv_re = nn.Conv2d(C, C, 3, padding=1)
        self.conv_im = nn.Conv2d(C, C, 3, padding=1)
        self.gain = ComplexGain(C, broken)
        self.register_buffer("offset", torch.arange(C, dtype=torch.int64))

    def forward(self, x):
        z = self.gain(torch.complex(self.conv_re(x), self.conv_im(x)))
        return z, (x > 0).to(torch.int64) + self.offset.view(1, -1, 1, 1)


class FunctionalBug(nn.Module):
    """The difference is made by a functional op in the parent's forward, between two child modules."""

    def __init__(self, broken=False):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.b = nn.Conv2d(C, C, 3, padding=1)
        self.broken = broken

    def forward(self, x):
        y = torch.relu(self.a(x))
        if self.broken:
            y = y * _local_factor(y)
        return self.b(y)


class Order(nn.Module):
    """Two broken layers: ``zeta`` runs first, ``alpha`` (first by name) second; the report names ``zeta``."""

    def __init__(self, broken=False):
        super().__init__()
        self.alpha = Scale(C, broken)
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.zeta = Scale(C, broken)

    def forward(self, x):
        return self.alpha(self.conv(self.zeta(x)))


class ZeroMeanBN(nn.Module):
    """A BatchNorm after a BatchNorm: its batch mean, hence its running_mean, is 0 in exact arithmetic (~1e-18 in
    float64, rounding of sums in another order on a shard): compared relative to its own value it was a false alarm
    (issue 32)."""

    def __init__(self, broken=False):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(C, affine=False)
        self.bn2 = nn.BatchNorm2d(C)
        self.scale = Scale(C, broken)

    def forward(self, x):
        return self.scale(self.bn2(self.bn1(self.conv(x))))


class TimmHead(nn.Module):
    """A timm classifier head (``ClassifierHead``: ``SelectAdaptivePool2d`` with its flatten, then ``fc``): halo
    folds the flatten into its pool, so comparing the pool's children was a false alarm ("not called", (B, C) vs
    (B, C, 1, 1)); the head's own output, whole on every rank, is compared."""

    def __init__(self, broken=False):
        super().__init__()
        _thirdparty_timm()
        from timm.layers import ClassifierHead

        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.scale = Scale(C, broken)
        self.head = ClassifierHead(C, 5, pool_type="avg")

    def forward(self, x):
        return self.head(self.scale(self.conv(x)))


def _thirdparty_timm():
    import _thirdparty

    _thirdparty._torchvision_schemas()  # (this environment's torchvision: its ops' schemas stand in)
    import timm  # noqa: F401


def _timm():
    try:
        _thirdparty_timm()
    except ImportError:
        return False
    return True


MODELS = {"scse": SENet, "features": Encoder, "multihead": MultiHead, "timestep": TimeBlock,
          "bias_bn": BiasBeforeBN, "complex": ComplexNet, "functional": FunctionalBug, "order": Order,
          "zero_mean_bn": ZeroMeanBN, **({"timm_head": TimmHead} if _timm() else {})}
#: leaf modules halo does not know are declared pointwise in latitude (as users do): true of the exact variants
DECLARED = {"custom_converters": {Scale: None, ComplexGain: None, ComplexNet: INSIDE}}
EXTRA = {"timestep": lambda: (torch.tensor([3.0, 250.0], dtype=torch.float64),)}
#: name -> (the first differing module's label, where it arises ("inside" or the parent's forward))
BROKEN_AT = {"scse": ("output of scse (SCSE)", "inside"),
             "features": ("output of stages.1.1 (Scale)", "inside"),
             "multihead": ("output of aux.1 (Scale)", "inside"),
             "timestep": ("output of scale (Scale)", "inside"),
             "bias_bn": ("output of scale (Scale)", "inside"),
             "complex": ("output of gain (ComplexGain)", "inside"),
             "functional": ("output of b (Conv2d)", "in the forward of (model) (FunctionalBug) before it calls b"),
             "order": ("output of zeta (Scale)", "inside"),
             "zero_mean_bn": ("output of scale (Scale)", "inside"),
             "timm_head": ("output of scale (Scale)", "inside")}


def _cases(rank, world, names):
    import halo

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in names:
        extra = EXTRA.get(name, lambda: ())()
        for broken in (False, True):
            report = halo.check_equivalence(lambda name=name, broken=broken: MODELS[name](broken), full, args=extra,
                                            convert_kwargs=DECLARED)
            first = report.first_mismatch
            checks = {c.what: (c.error, c.scale, c.tol, c.ok) for c in report.checks}
            out[(name, broken)] = (report.ok, first.what if first else None, report.where, str(report), checks)
    return out


# -- one rank launch per world size runs every check of this file on that many ranks (a launch and its warm-up cost
# more than most checks); each check makes its own models and inputs, and the one that stands in for an NCCL group
# runs last and puts halo.check back.

def _all_on_rank(rank, world):
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # halo's kernels: the torch reference (the interpreter: test_kernels.py)
    out = {"cases": _cases(rank, world, list(MODELS))}
    if world == 3:
        out["stats"] = _stats(rank, world)
        out["placement"] = _placement(rank, world)
        return out
    out["bias_bug"] = _bias_bug(rank, world)
    out["nccl"] = _nccl_needs_cuda(rank, world)
    out["dtype"] = _bad_dtype(rank, world)
    return out


_RUNS: dict = {}


def _results(world, part):
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_all_on_rank, world, timeout=400)
    return [r[part] for r in _RUNS[world]]


@pytest.mark.parametrize("world", [2, 3])
def test_check_equivalence_on_real_model_kinds(world):
    results = _results(world, "cases")
    for name in MODELS:
        texts = {r[(name, False)][3] for r in results} | set()
        assert len({r[(name, False)][3] for r in results}) == 1, texts  # the same report on every rank
        assert len({r[(name, True)][3] for r in results}) == 1
        ok, first, where, text, checks = results[0][(name, False)]
        assert ok, f"{name}: the exact model is reported different\n{text}"
        assert len(checks) > 5, text
        ok, first, where, text, checks = results[0][(name, True)]
        want_first, want_where = BROKEN_AT[name]
        assert not ok, f"{name}: the broken model passes\n{text}"
        assert first == want_first, (name, first, text)
        assert want_where in where, (name, where, text)
        assert "FIRST DIFFERENCE" in text and "where:" in text, text
    # What each case is about, checked in the exact model's comparisons:
    ok, _, _, text, checks = results[0][("scse", False)]
    assert {"output of scse.cSE.0 (AdaptiveAvgPool2d)", "output of scse.cSE (Sequential)",
            "output of down_scse.cSE (Sequential)"} <= set(checks), text
    _, _, _, text, checks = results[0][("features", False)]
    assert {f"output of (model) (Encoder){i}" for i in ("", " [1]", " [2]")} <= set(checks), text
    _, _, _, text, checks = results[0][("multihead", False)]
    assert {"output of (model) (MultiHead) [2]", "output of cls (Sequential)", "gradient of cls.2.weight"} \
        <= set(checks), text
    _, _, _, text, checks = results[0][("timestep", False)]
    assert {"output of time_embedding (TimeEmbedding)", "output of (model) (TimeBlock) [1]"} <= set(checks), text
    assert checks["gradient of time_embedding.linear_1.weight"][1] > 0, text  # the embedding gets its gradient
    _, _, _, text, checks = results[0][("bias_bn", False)]
    err, scale, tol, ok = checks["gradient of conv.bias"]
    weight_scale = checks["gradient of conv.weight"][1]
    assert ok and scale < 1e-12 * weight_scale and tol >= 1e-9 * weight_scale, (err, scale, tol, weight_scale)
    _, _, _, text, checks = results[0][("zero_mean_bn", False)]
    err, scale, tol, ok = checks["buffer bn2.running_mean after the step"]
    assert ok and scale < 1e-15 and tol > 1e-12, (err, scale, tol)  # its tolerance: the scale of bn2's inputs
    if "timm_head" in MODELS:
        _, _, _, text, checks = results[0][("timm_head", False)]
        assert "output of head (ClassifierHead)" in checks and "output of head.global_pool.flatten (Flatten)" \
            not in checks, text
    _, _, _, text, checks = results[0][("complex", False)]
    assert "gradient of gain.gain" in checks and checks["gradient of gain.gain"][1] > 0, text
    assert checks["output of (model) (ComplexNet) [1]"][2] == 0.0, text  # integers: exact


class BiasConv(nn.Conv2d):
    """An ``nn.Conv2d`` whose converter (below) adds ``1e-6`` to the bias gradient on group rank 0: a gradient bug."""


def _broken_converter(module, ctx):
    import torch.distributed as dist

    from halo.nn.conv import DomainConv2d

    conv = DomainConv2d(module, group=ctx.group)
    if dist.get_rank(ctx.group) == 0:
        conv.bias.register_hook(lambda g: g + 1e-6)
    return conv


class BiasConvBeforeBN(BiasBeforeBN):
    def __init__(self):
        super().__init__()
        self.conv = BiasConv(C, C, 3, padding=1, bias=True)


def _bias_bug(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    declared = {"custom_converters": {**DECLARED["custom_converters"], BiasConv: _broken_converter}}
    report = halo.check_equivalence(BiasConvBeforeBN, full, convert_kwargs=declared)
    first = report.first_mismatch
    return report.ok, first.what if first else None, str(report)


def test_a_wrong_gradient_that_is_zero_in_exact_arithmetic_is_still_reported():
    """The bias's tolerance is relative to its module's gradients (1e-9 x max |weight grad|), not a blanket pass:
    1e-6 added to the gradient of a conv bias before a BatchNorm (exactly 0 unsharded) is reported."""
    for ok, first, text in _results(2, "bias_bug"):
        assert not ok and first == "gradient of conv.bias", text


def _mesh_cases(rank, world, names):
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # halo's kernels: the torch reference (the interpreter: test_kernels.py)

    mesh = halo.DomainMesh((2, 2), periodic=(False, True))
    full = torch.randn(2, C, H, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in names:
        for broken in (False, True):
            report = halo.check_equivalence(lambda name=name, broken=broken: MODELS[name](broken), full, mesh=mesh,
                                            convert_kwargs=DECLARED)
            first = report.first_mismatch
            out[(name, broken)] = (report.ok, first.what if first else None, report.where, str(report))
    return out


def test_check_equivalence_on_a_latitude_longitude_mesh():
    """The same verdicts on a 2x2 mesh (37 x 11: uneven blocks both ways): the scSE branch is whole, the features
    list assembled block by block, a complex field assembled part by part (as one real tensor of pairs its last dim
    would be taken for longitude: the correct model was reported as differing in shape)."""
    names = ["scse", "features", "complex"]
    results = run_on_ranks(_mesh_cases, 4, names, timeout=180)
    for name in names:
        assert len({r[(name, True)][3] for r in results}) == 1
        ok, _, _, text = results[0][(name, False)]
        assert ok, text
        ok, first, where, text = results[0][(name, True)]
        assert not ok and first == BROKEN_AT[name][0] and "inside" in where, text


class MomentumBN(nn.BatchNorm2d):
    """A BatchNorm whose converter (below) gives group rank 0 another momentum: outputs equal, running stats not."""


def _momentum_converter(module, ctx):
    import torch.distributed as dist

    from halo.nn.norm import DomainBatchNorm2d

    bn = DomainBatchNorm2d(module, group=ctx.group)
    if dist.get_rank(ctx.group) == 0:
        bn.momentum = 0.5
    return bn


class StatsBug(BiasBeforeBN):
    def __init__(self):
        super().__init__()
        self.bn = MomentumBN(C)


def _stats(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    declared = {"custom_converters": {**DECLARED["custom_converters"], MomentumBN: _momentum_converter}}
    bad = halo.check_equivalence(StatsBug, full, convert_kwargs=declared)
    good = halo.check_equivalence(BiasBeforeBN, full, convert_kwargs=DECLARED)
    return [str(c) for c in bad.checks if not c.ok], {c.what: c.ok for c in good.checks}


def test_batchnorm_running_statistics_are_compared_after_the_step():
    """Replicated state is checked, not assumed: running statistics that differ on one rank, outputs and gradients
    equal, are reported (and are compared, and equal, in the exact model)."""
    for bad, good in _results(3, "stats"):
        assert {b.split(":")[0] for b in bad} == {"DIFFERS buffer bn.running_mean after the step",
                                                   "DIFFERS buffer bn.running_var after the step"}, bad
        assert good["buffer bn.running_var after the step"] and good["buffer bn.num_batches_tracked after the step"]


# -- devices ------------------------------------------------------------------------------------------------------

class _Placement(TorchFunctionMode):
    """A stand-in for a second device on a CPU-only machine: it tracks where each tensor would live if the sample
    were on a GPU. The sample and whatever is computed from it or moved with ``.to(device)`` / ``device=`` are on
    the "device"; tensors made by factories without ``device=`` (``torch.randn(..., generator=g)``, ``torch.tensor``)
    or by ``.cpu()`` are on the "host". An op given both (a host tensor with dims, as CUDA refuses) is recorded:
    what raises ``Expected all tensors to be on the same device`` on a GPU. Autograd's results are not tracked."""

    FACTORIES = {torch.randn, torch.rand, torch.randint, torch.zeros, torch.ones, torch.empty, torch.full,
                 torch.tensor, torch.arange, torch.linspace, torch.as_tensor, torch.eye, torch.randperm}
    CROSSING = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}

    def __init__(self):
        super().__init__()
        self.mixed = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.utils._pytree as pytree

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        places = [getattr(t, "_place", None) for t in leaves]
        if func in self.FACTORIES:
            place = "device" if kwargs.get("device") is not None else "host"
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and (
                func is torch.Tensor.cuda or "device" in kwargs
                or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])):
            place = "device"
        elif func is torch.Tensor.cpu:
            place = "host"
        else:
            if "device" in places and func not in self.CROSSING and any(
                    p == "host" and t.dim() > 0 for p, t in zip(places, leaves, strict=True)):
                import traceback

                frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
                self.mixed.append(f"{getattr(func, '__name__', func)} at {frame.filename}:{frame.lineno}")
            place = "device" if "device" in places else ("host" if "host" in places else None)
        if place is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    try:
                        t._place = place
                    except (AttributeError, RuntimeError):
                        pass
        return out


def _placement(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(0)
    audit = _Placement()
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with audit:
        full = full.to("cpu")  # "moved to the device"
        bad = (full * torch.randn(full.shape, generator=gen, dtype=torch.float64)).sum()  # what check.py used to do
    control = list(audit.mixed)
    audit.mixed.clear()
    with audit:
        sample = full.to("cpu")
        reports = [halo.check_equivalence(lambda name=name: MODELS[name](False), sample, args=EXTRA.get(
            name, lambda: ())(), convert_kwargs=DECLARED) for name in ("multihead", "timestep", "complex")]
    return control, list(audit.mixed), [r.ok for r in reports], float(bad)


def test_check_equivalence_makes_nothing_on_the_host_that_meets_the_device():
    """Issue 24: on CUDA, loss weights drawn from a CPU generator times a CUDA output raised. Audited on CPU with a
    stand-in device (``_Placement``): the audit catches exactly that op, and a whole check (dict, tuple, timestep
    and complex outputs; 3 ranks) combines no host-made tensor with the device's."""
    for control, mixed, oks, _ in _results(3, "placement"):
        assert len(control) == 1 and control[0].startswith("mul at "), control  # the audit sees the old bug
        assert mixed == [] and all(oks), (mixed, oks)


def test_weights_are_drawn_on_the_host_and_live_on_the_outputs_device():
    from halo.check._record import weights as _weights

    like = torch.empty(2, 3, 5, device="meta", dtype=torch.float32)
    w = _weights(like, torch.Generator().manual_seed(1))
    assert w.device.type == "meta" and w.dtype == torch.float32 and w.shape == like.shape
    z = _weights(torch.zeros(2, 3, dtype=torch.complex128), torch.Generator().manual_seed(1))
    assert z.shape == (2, 3) and z.dtype == torch.complex128  # split like the complex leaf it weighs
    same = _weights(torch.zeros(2, 3, 5), torch.Generator().manual_seed(1))
    assert torch.equal(same, torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                       .float())  # the same numbers whatever the device


def test_halo_check_builds_model_sample_and_reference_on_the_groups_device():
    """``halo check`` moves what it builds to the rank's device (``cuda:LOCAL_RANK`` under NCCL): here ``meta``."""
    from halo.tools.check import _prepare

    opts = {"target": f"{__name__}:SENet", "shape": (2, C, H, W), "boundary": "pole", "reference": None}
    model, sample, reference = _prepare(opts, torch.device("meta"))
    assert sample.device.type == "meta" and tuple(sample.shape) == (2, C, H, W)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.device.type for p in reference.parameters()} == {"meta"}


def _nccl_needs_cuda(rank, world):
    import halo
    import halo.check

    halo.initialize_domain_parallel(world, world)
    saved, halo.check._backend_needs_cuda = halo.check._backend_needs_cuda, lambda group: True  # as if NCCL
    full = torch.randn(2, C, H, W, dtype=torch.float64)
    try:
        halo.check_equivalence(SENet, full)
    except ValueError as exc:
        return str(exc)
    finally:
        halo.check._backend_needs_cuda = saved
    return None


def _bad_dtype(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    try:
        halo.check_equivalence(SENet, torch.randn(2, C, H, W, dtype=torch.float64), dtype="float64")
    except TypeError as exc:
        return str(exc)
    return None


def test_a_dtype_that_is_not_a_torch_dtype_is_a_clear_error_on_every_rank():
    texts = _results(2, "dtype")
    assert len(set(texts)) == 1 and texts[0] is not None and "dtype must be a floating dtype" in texts[0], texts


def test_a_cpu_sample_on_an_nccl_group_is_a_clear_error_on_every_rank():
    for text in _results(2, "nccl"):
        assert text is not None and "communicates CUDA tensors" in text and "sample.to('cuda')" in text, text


# -- the boundary reference ---------------------------------------------------------------------------------------

class SameConvs(nn.Module):
    """'same' padding with an even kernel (torch puts the extra row after), circular and zero longitudes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, (4, 3), padding="same", padding_mode="circular")
        self.b = nn.Conv2d(C, C, 3, padding=(2, 1), dilation=(2, 1))
        self.c = nn.Conv2d(C, C, 3, padding="valid")

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))))


@pytest.mark.parametrize("h, boundary", [(37, "pole"), (36, "pole_centered")])
def test_boundary_reference_is_the_demos_hand_written_pole_model(h, boundary):
    """``boundary_reference`` equals the demo's independent ``PolePadConv`` reference (bitwise), keeps every module
    name, and pads a conv's rows like ``F.pad`` with the pole rows written out by hand."""
    from halo.check import boundary_reference
    from halo.tools.demo import DemoNet, pole_pad, reference_model

    torch.manual_seed(0)
    net = DemoNet(3, 4, (h, 16)).double()
    x = torch.randn(2, 3, h, 16, dtype=torch.float64)
    ours = boundary_reference(net, boundary)
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in net.named_modules()]
    assert torch.equal(ours(x), reference_model(net, boundary)(x))
    same = SameConvs().double()
    x = torch.randn(1, C, h, 10, dtype=torch.float64)
    got = boundary_reference(same, boundary).a(x)
    padded = torch.nn.functional.pad(pole_pad(x, 1, 2, boundary), (1, 1, 0, 0), mode="circular")
    want = torch.nn.functional.conv2d(padded, same.a.weight, same.a.bias)
    assert torch.equal(got, want)
    assert not torch.equal(got, same.a(x))  # the model's own zero rows differ


# -- halo layers that compute in their own layout (issue 32 item 7: CREDIT FuXi-48 at P=2) -------------------------

FUXI_SAMPLE = (2, 3, 2, 48, 16)  # (B, C, T, H, W): FuXi's two frames of 3 channels, 48 rows (24 token rows)


def _fuxi(broken: bool) -> nn.Module:
    """CREDIT's FuXi (tests/_thirdparty.py); ``broken``: the LayerNorm inside its cube embedding (kept as torch's by
    halo's ``DomainCubeEmbedding``, which runs it on a (B, C, T, H, W) field instead of FuXi's (B, tokens, C)) scaled
    by the share of the tokens it sees: 1 unsharded, ~1/P on a shard (a local-factor bug inside a halo layer)."""
    import _thirdparty as tp

    tp.load()
    model = tp.credit_fuxi(48)
    if broken:
        tokens = FUXI_SAMPLE[0] * 8 * (FUXI_SAMPLE[2] // 2) * (FUXI_SAMPLE[3] // 2) * (FUXI_SAMPLE[4] // 2)
        model.cube_embedding.norm.register_forward_hook(lambda m, args, out: out * (out.numel() / tokens))
    return model


def _fuxi_checks(rank, world, variants):
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    full = torch.randn(FUXI_SAMPLE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = {}
    for broken in variants:
        report = halo.check_equivalence(lambda broken=broken: _fuxi(broken), full)
        first = report.first_mismatch
        out[broken] = (report.ok, first.what if first else None, list(report.inside), str(report))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fuxi_windows_and_cube_tokens_are_no_false_alarm(world):
    """FuXi is exact (tests/test_zoo_real.py): check_equivalence says so at P=2 and P=3. Its Swin V2 attention works
    on a rank's windows of every sample as one block, and its cube embedding's LayerNorm on a 5-d field instead of
    FuXi's token rows; those intermediates are not the reference's tensors, and are left out only because the halo
    layer that holds them (``DomainSwinV2Block``, ``DomainCubeEmbedding``) matches the reference at its output. With
    the bug inside the cube embedding (P=2), the difference is reported where it arises, naming that LayerNorm."""
    pytest.importorskip("credit")
    variants = (False, True) if world == 2 else (False,)
    results = run_on_ranks(_fuxi_checks, world, variants, timeout=400)
    assert all(r == results[0] for r in results), "ranks disagree"
    ok, first, inside, text = results[0][False]
    assert ok, text
    assert any("cube_embedding.norm" in w for w in inside) and any(".attn" in w for w in inside), inside
    if world == 2:
        ok, first, inside, text = results[0][True]
        assert not ok and first == "output of cube_embedding.norm (LayerNorm)", text
        assert "cube_embedding.norm" not in " ".join(inside), text
        assert "output of cube_embedding (CubeEmbedding)" in text, text


def test_intermediates_are_left_out_only_inside_a_halo_layer_that_matches():
    """The rule alone: a failed output inside one of halo's own layers is left out when that layer (any halo
    ancestor below the model itself) matches; kept when it differs, when the enclosing layer is not halo's (a user's
    or timm's block), and for the model's own output."""
    from halo.check import Mismatch, in_own_layout

    class Own(nn.Module):  # stands for a halo layer: a class defined in halo
        pass

    Own.__module__ = "halo.nn.swinv2"
    kinds = {"(model)": Own, "a": Own, "a.w": nn.Linear, "a.w.s": nn.Softmax, "b": nn.Sequential, "b.w": nn.Linear,
             "c": Own, "c.w": nn.Linear}
    good, bad = Mismatch("x", 0.0, 1.0, 1e-9), Mismatch("x", 1.0, 1.0, 1e-9)
    names = ["a.w.s", "a.w", "a", "b.w", "b", "c.w", "c", "(model)"]
    checks = [bad, bad, good, bad, bad, bad, bad, bad]
    assert in_own_layout(names, checks, kinds) == {0, 1}
    assert in_own_layout(names[:2], checks[:2], kinds) == set()  # the layer's own output not compared: kept


class Gain(nn.Module):
    """A per-channel gain (pointwise in latitude)."""

    def __init__(self, c):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, c).view(c, 1, 1))

    def forward(self, x):
        return x * self.g


class Wrapped(nn.Module):
    """A user's converter result that holds the layer under another name (``inner``): its parameter's name changes."""

    def __init__(self, m):
        super().__init__()
        self.inner = m

    def forward(self, x):
        return self.inner(x)


def _renamed(rank, world):
    import halo

    halo.initialize_domain_parallel(world, world)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    model = lambda: nn.Sequential(nn.Conv2d(C, C, 3, padding=1), Gain(C), nn.Conv2d(C, C, 3, padding=1))  # noqa: E731
    wrap = {"custom_converters": {Gain: lambda m, ctx: Wrapped(m)}}
    report = halo.check_equivalence(model, full, convert_kwargs=wrap)
    return report.ok, [(c.what, c.note) for c in report.checks if not c.ok]


def test_a_parameter_the_converted_model_renamed_is_reported_not_skipped():
    """Every parameter keeps its name in a converted model (invariant 6); one a converter renamed cannot be paired
    with the reference's, and is reported (its gradient would otherwise go unchecked: a wrong gradient there
    would pass)."""
    results = run_on_ranks(_renamed, 2, timeout=200)
    assert results[0] == results[1]
    ok, bad = results[0]
    assert not ok and bad == [("gradient of 1.g", "no parameter of that name in the converted model (its state_dict "
                                                   "keys changed: a converter renamed it), so its gradient cannot be "
                                                   "compared")], bad
