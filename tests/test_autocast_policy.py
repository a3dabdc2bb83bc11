"""Every halo op that stands in for a torch op returns the dtype torch's op returns under CUDA autocast, checked on CPU.

CUDA's autocast runs ``layer_norm``, ``group_norm``, ``softmax``, the ``upsample_*`` kernels and ``pow`` in float32
(a bf16 input gives a float32 output), convolutions in bf16, and leaves ``batch_norm``, the pools, ``pad`` alone.
CPU autocast has other lists, so the modes matrix on CPU cannot see a halo op that returns the input's dtype where
torch returns float32 (``DomainLayerNorm`` did: silently different from the unsharded model on a GPU).

Here CUDA's policy is faked on CPU tensors: CUDA autocast is switched on directly (``torch.autocast("cuda")`` turns
itself off without a GPU, ``torch.set_autocast_enabled("cuda", True)`` does not) and :func:`halo.autocast.policy_of`
makes halo's ops follow it. The expected dtype is computed here, independently of halo: the *unsharded* torch module
(or the model's forward with the functional op) run on fake CUDA tensors (``FakeTensorMode``: CUDA's autocast
kernels are registered on a CPU build) under CUDA autocast. Every class halo's converter replaces is covered (a new
one without a case fails :func:`test_every_converted_class_has_a_case`), and the functional ops the guard reroutes.
On 2 gloo ranks at 9 rows (5 + 4): forward dtype, values against the unsharded op computed as CUDA computes it
(inputs cast to the policy's dtype), and the input gradient's dtype and values.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.testing import run_on_ranks

pytestmark = pytest.mark.timeout(600)

WORLD = 2
C, H, W = 4, 9, 8


@contextlib.contextmanager
def fake_cuda_autocast(dtype: torch.dtype = torch.bfloat16):
    """CUDA autocast on (no GPU needed) and halo's ops following CUDA's policy."""
    from halo.autocast import policy_of

    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with policy_of("cuda"):
            yield
    finally:
        torch.set_autocast_enabled("cuda", was[0])
        torch.set_autocast_dtype("cuda", was[1])


def cuda_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype the unsharded ``module`` returns for ``x`` on CUDA under bf16 autocast, asked of torch's own
    CUDA autocast kernels on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = copy.deepcopy(module)
    for m in module.modules():  # batch statistics only (a fake CUDA buffer cannot be updated on a CPU build)
        if isinstance(m, nn.modules.batchnorm._NormBase):
            m.track_running_stats, m.running_mean, m.running_var, m.num_batches_tracked = False, None, None, None
    state = dict([*module.named_parameters(), *module.named_buffers()])
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in state.items()}
        xf = torch.empty(x.shape, dtype=x.dtype, device="cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            out = torch.func.functional_call(module, fakes, (xf,))
        finally:
            torch.set_autocast_enabled("cuda", was[0])
            torch.set_autocast_dtype("cuda", was[1])
    return (out[0] if isinstance(out, tuple) else out).dtype


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


X4, X5 = (2, C, H, W), (1, C, 3, H, W)

#: name -> (the torch module, input shape, compare values[, input dtype: bf16]): a case per class the converter
#: replaces
MODULES = {
    "Conv2d": (lambda: nn.Conv2d(C, C, 3, padding=1), X4, True),
    "Conv3d": (lambda: nn.Conv3d(C, C, 3, padding=1), X5, True),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(C, C, 3, padding=1), X4, True),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(C, C, 3, padding=1), X5, True),
    "Dropout": (lambda: nn.Dropout(0.3), X4, False),
    "Dropout1d": (lambda: nn.Dropout1d(0.3), (C, H, W), False),
    "Dropout2d": (lambda: nn.Dropout2d(0.3), X4, False),
    "Dropout3d": (lambda: nn.Dropout3d(0.3), X5, False),
    "AlphaDropout": (lambda: nn.AlphaDropout(0.3), X4, False),
    "FeatureAlphaDropout": (lambda: nn.FeatureAlphaDropout(0.3), X4, False),
    "GroupNorm": (lambda: nn.GroupNorm(2, C), X4, True),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(C), X4, True),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(C, affine=True), X4, True),
    "LayerNorm": (lambda: nn.LayerNorm((C, H, W)), X4, True),
    "ZeroPad2d": (lambda: nn.ZeroPad2d(2), X4, True),
    "ConstantPad2d": (lambda: nn.ConstantPad2d(1, 0.5), X4, True),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(2), X4, True),
    "ReplicationPad2d": (lambda: nn.ReplicationPad2d(2), X4, True),
    "CircularPad2d": (lambda: nn.CircularPad2d(2), X4, True),
    "MaxPool2d": (lambda: nn.MaxPool2d(3, 2, 1), X4, True),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, 2, 1), X4, True),
    "MaxPool3d": (lambda: nn.MaxPool3d(3, 1, 1), X5, True),
    "AvgPool3d": (lambda: nn.AvgPool3d(3, 1, 1), X5, True, torch.float32),  # (no bf16 avg_pool3d on CPU)
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 4)), X4, True),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d((3, 4)), X4, True),
    "LPPool2d": (lambda: nn.LPPool2d(2, 3, 3), X4, True),
    "PixelShuffle": (lambda: nn.PixelShuffle(2), X4, True),
    "PixelUnshuffle": (lambda: nn.PixelUnshuffle(2), (2, C, 8, W), True),
    "Softmax": (lambda: nn.Softmax(1), X4, True),
    "LogSoftmax": (lambda: nn.LogSoftmax(1), X4, True),
    "Upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), X4, True),
    "UpsampleNearest": (lambda: nn.Upsample(scale_factor=2), X4, True),
    "UpsampleArea": (lambda: nn.Upsample(size=(5, 4), mode="area"), X4, True),
}



def _registry_cases() -> dict:
    """The cases of registered layers that declare ``example=`` (``@converts``) and have none above: a new layer
    gets its CUDA-policy case from its own module, with no edit here."""
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import entries

    out = {}
    for kind, entry in entries().items():
        if entry.example is not None and kind.__name__ not in MODULES \
                and entry.halo_class.__module__.startswith("halo."):
            out[kind.__name__] = ((lambda kind=kind, entry=entry: entry.example(kind)[0]), entry.example(kind)[1], True)
    return out


MODULES.update(_registry_cases())

class Functional(nn.Module):
    """A conv, then a functional op on the field (the guard computes it exactly at its site: halo.guard.reroute)."""

    OPS = {
        "F.layer_norm": lambda m, x: F.layer_norm(x, x.shape[1:]),
        "F.group_norm": lambda m, x: F.group_norm(x, 2, m.gw, m.gb),
        "F.instance_norm": lambda m, x: F.instance_norm(x, weight=m.gw, bias=m.gb),
        "F.batch_norm": lambda m, x: F.batch_norm(x, None, None, m.gw, m.gb, training=True),
        "F.interpolate": lambda m, x: F.interpolate(x, scale_factor=2.0, mode="bilinear"),
        "Tensor.mean": lambda m, x: x - x.mean((2, 3), keepdim=True),
    }

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.gw = nn.Parameter(1 + 0.2 * torch.randn(C))
        self.gb = nn.Parameter(0.1 * torch.randn(C))

    def forward(self, x):
        return self.OPS[self.name](self, self.a(x))


def _as_cuda(module: nn.Module, x: torch.Tensor, dtype: torch.dtype, conv_dtype: torch.dtype | None = None):
    """The unsharded ``module`` on ``x`` computed as CUDA autocast computes it, on CPU: ``x`` (and a conv's
    parameters) cast to the policy's dtype, the module run without autocast."""
    ref = copy.deepcopy(module)
    if isinstance(ref, (nn.modules.conv._ConvNd,)):
        ref = ref.to(dtype)
    elif isinstance(ref, Functional):
        ref.a = ref.a.to(torch.bfloat16)  # the conv before the op: bf16 under autocast
        xr = ref.a(x.to(torch.bfloat16))
        return Functional.OPS[ref.name](ref, xr.to(dtype))
    if dtype == torch.bfloat16 and not isinstance(ref, nn.modules.conv._ConvNd):
        return ref(x.float()).to(dtype)  # (CPU lacks some bf16 kernels: one rounding of the float32 result)
    return ref(x.to(dtype))


def _case(module, x, halo_module, rank, world):
    """(dtype of halo's output, of torch's on CUDA, max error of the output, of the input gradient, grad dtype)."""
    import halo

    want = cuda_dtype(module, x)
    h = x.dim() - 2
    full_g = torch.randn(_as_cuda(module, x, want).shape, generator=torch.Generator().manual_seed(7))
    xs = torch.tensor_split(x, world, h)[rank].clone().requires_grad_(True)
    with fake_cuda_autocast():
        y = halo_module(xs)
    gs = torch.tensor_split(full_g, world, h)[rank].to(y.dtype)
    (y.float() * gs.float()).sum().backward()
    xr = x.clone().requires_grad_(True)
    ref = _as_cuda(module, xr, want)
    (ref.float() * full_g.float()).sum().backward()
    y_all, gx_all = halo.gather(y.detach(), dim=h), halo.gather(xs.grad, dim=h)
    ref = ref.detach()
    scale = max(float(ref.abs().max()), 1.0)
    err = float((y_all.float() - ref.detach().float()).abs().max()) / scale
    gscale = max(float(xr.grad.abs().max()), 1.0)
    gerr = float((gx_all.float() - xr.grad.float()).abs().max()) / gscale
    return y.dtype, want, err, gerr, xs.grad.dtype


def _on_ranks(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    out = {}
    for name, (make, shape, *rest) in MODULES.items():
        torch.manual_seed(0)
        module = make()
        x = _x(shape).to(rest[1] if len(rest) > 1 else torch.bfloat16)
        halo_module = convert_to_domain_parallel(nn.Sequential(copy.deepcopy(module)), manager)
        out[name] = _case(module, x, halo_module, rank, world)
    for name in Functional.OPS:
        torch.manual_seed(0)
        module = Functional(name)
        x = _x(X4)
        halo_module = convert_to_domain_parallel(copy.deepcopy(module), manager,
                                                 custom_converters={Functional: INSIDE})
        out[name] = _case(module, x, halo_module, rank, world)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_on_ranks, WORLD, timeout=500)


#: values: bf16 results (one rounding of a value of ~1: 2**-8, and the ranks' order of sums), float32 ones
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-5}


@pytest.mark.parametrize("name", [*MODULES, *Functional.OPS])
def test_dtype_and_values_as_torch_under_cuda_autocast(results, name):
    for rank_result in results:
        got, want, err, gerr, gdtype = rank_result[name]
        assert got == want, f"{name}: halo returns {got} under CUDA bf16 autocast, torch's op returns {want}"
        xdtype = MODULES[name][3] if len(MODULES.get(name, ())) > 3 else torch.bfloat16
        assert gdtype == xdtype, f"{name}: the input's gradient is {gdtype}, expected the input's {xdtype}"
        values = MODULES[name][2] if name in MODULES else True
        if values:
            tol = TOL[want] if name in MODULES else TOL[torch.bfloat16]  # (after a bf16 conv: its rounding)
            assert err <= tol, f"{name}: output off by {err:.2e} (relative) from torch's as CUDA computes it"
            assert gerr <= 3e-2, f"{name}: input gradient off by {gerr:.2e} (relative)"


def test_the_cuda_policy_is_torch_s():
    """The fake really applies CUDA's lists (not CPU's): float32 norms and upsampling, bf16 conv, pools kept."""
    x = _x(X4)
    assert cuda_dtype(nn.LayerNorm((C, H, W)), x) == torch.float32
    assert cuda_dtype(nn.GroupNorm(2, C), x) == torch.float32
    assert cuda_dtype(nn.Upsample(scale_factor=2), x) == torch.float32
    assert cuda_dtype(nn.Conv2d(C, C, 3), x.float()) == torch.bfloat16
    assert cuda_dtype(nn.MaxPool2d(2), x) == torch.bfloat16
    assert cuda_dtype(nn.BatchNorm2d(C), x) == torch.bfloat16


#: Converted classes without a faked-CUDA case here, and why (each has its autocast case elsewhere).
NO_CASE = {
    "MultiheadAttention": "torch's own nn.MultiheadAttention fails under the faked CUDA policy on a CPU build "
                          "(_in_projection_packed: 'not linked with cuda'); DomainMultiheadAttention's bf16 case is "
                          "in tests/test_ring_attention.py",
}


def test_every_converted_class_has_a_case():
    import halo.nn  # noqa: F401 - fills the converter's table
    from halo.nn.registry import entries

    # halo's own registrations (a test module may register a class of its own: tests/test_convert.py does)
    ours = [k for k, e in entries().items() if e.halo_class.__module__.startswith("halo.")]
    missing = sorted(k.__name__ for k in ours if k.__name__ not in MODULES and k.__name__ not in NO_CASE)
    assert not missing, f"classes halo's converter replaces without a case in MODULES: {missing}"


def test_result_dtype_follows_the_policy_device():
    """halo.autocast asks torch for the device whose policy applies: CPU autocast leaves layer_norm in bf16,
    CUDA's makes it float32; with autocast off the input's dtype; a memo, not a list."""
    from halo.autocast import cast_as_torch, result_dtype

    x = _x(X4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert result_dtype("layer_norm", x, None, None) == torch.bfloat16
        assert result_dtype("conv2d", x.float(), None, None) == torch.bfloat16
    assert result_dtype("layer_norm", x, None, None) == torch.bfloat16
    with fake_cuda_autocast():
        assert result_dtype("layer_norm", x, None, None) == torch.float32
        assert result_dtype("interpolate", x, mode="area") == torch.bfloat16  # an adaptive pool, not an upsample
        assert result_dtype("interpolate", x, mode="bilinear") == torch.float32
        assert cast_as_torch("layer_norm", x).dtype == torch.float32
        assert cast_as_torch("max_pool2d", x) is x


def test_result_dtype_under_torch_compile():
    """Under torch.compile (fullgraph, no graph break) the answer is a constant of the trace, the same as eager,
    on a fresh context (nothing of halo's state made yet), which keeps the state other modules made. (The converted
    model's compiled backward, where a traced read of the policy once lost the exchangers' registry, is
    tests/test_compile.py's.)"""
    import torch._dynamo

    from halo import context
    from halo.autocast import cast_as_torch

    x = _x(X4)

    def f(t):
        return cast_as_torch("layer_norm", t) * 2

    with context.use():
        marker = context.state("test_marker", dict)  # another module's state, made before the trace
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        assert compiled(x).dtype == torch.bfloat16  # CPU's policy: layer_norm left alone
        assert compiled(x).dtype == torch.bfloat16
        assert context.state("test_marker", dict) is marker, "the trace replaced the context's slots"
        with fake_cuda_autocast():
            torch._dynamo.reset()
            assert torch.compile(f, fullgraph=True, backend="eager")(x).dtype == torch.float32
