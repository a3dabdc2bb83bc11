"""No op the guard cannot see runs on a field (issue 32, item 1).

What computes on a field without the guard's classification is refused on every rank at the first call, naming it:

- ``torch.nn.attention.flex_attention`` over a shard's tokens (torch compiles its body into a higher-order op; the
  guard sees only metadata reads from torch's frames): refused at the call, naming flex_attention and the user line;
- a higher-order op that torch's own compiled code runs on a field (a ``torch.compile``'d flex_attention inside the
  forward, NATTEN's ``torch_compile=True``): refused at the call's end, naming the op;
- a custom ``torch.autograd.Function`` applied to a field (its backward is code of its own): refused after the
  guarded call, from the autograd graph, naming the class; inside ``halo.guard.trusted()`` it runs, and (being
  pointwise here) is exact, forward and backward;
- an extension op (``torch.ops.<namespace>.<op>``) on a field: refused as unclassified.

Each refusal is checked on every rank (``run_on_ranks_outcomes``: the same error everywhere, none left waiting).
Without the checks each of these models runs and differs from the unsharded one (the flex attention model by ~0.9).
"""

import warnings

import pytest
import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks, run_on_ranks_outcomes

B, C, H, W = 1, 4, 7, 4


class Flex(nn.Module):
    """Self-attention over all tokens of the field with flex_attention: needs every rank's rows."""

    def __init__(self, compiled=False):
        super().__init__()
        self.proj = nn.Conv2d(C, C, 1)
        self.compiled = compiled

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        y = self.proj(x)
        tokens = y.flatten(2).transpose(1, 2).unsqueeze(1)  # (B, 1, H*W, C)
        fn = torch.compile(flex_attention, backend="eager") if self.compiled else flex_attention
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(tokens, tokens, tokens)
        return out.squeeze(1).transpose(1, 2).reshape(y.shape) + y


class Double(torch.autograd.Function):
    """A custom Function, pointwise: forward 2x, backward 2g (a backward that mixed rows would be as invisible)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Custom(nn.Module):
    def __init__(self, trusted=False):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.trusted = trusted

    def forward(self, x):
        import halo.guard

        y = self.conv(x)
        if self.trusted:
            with halo.guard.trusted():
                return Double.apply(y)
        return Double.apply(y)


@torch.library.custom_op("halo_test_unseen::flip_rows", mutates_args=())
def flip_rows(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-2).clone()


class Extension(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return torch.ops.halo_test_unseen.flip_rows(self.conv(x))


BUILDS = {"flex": lambda: Flex(), "flex_compiled": lambda: Flex(compiled=True), "custom": lambda: Custom(),
          "custom_trusted": lambda: Custom(trusted=True), "extension": lambda: Extension()}


def _full():
    return torch.randn(B, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _run(rank, world, name, grad):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(BUILDS[name]().double(), manager)
    offs = split_offsets(H, world)
    x = _full()[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        y = model(x)
    if not grad:
        return {"out": halo.gather(y)}
    wts = torch.randn(y.shape[:2] + (H, W), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (y * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
    return {"out": halo.gather(y.detach()), "grad": halo.gather(x.grad),
            "params": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _refused_everywhere(outcomes, *words):
    assert all(kind == "error" for kind, _ in outcomes), outcomes
    firsts = {text.splitlines()[0] for _, text in outcomes}
    assert len(firsts) == 1, firsts  # the same error on every rank
    (first,) = firsts
    assert first.startswith("ValueError"), first
    for w in words:
        assert w in first, (w, first)
    return first


@pytest.mark.parametrize("world", [2, 3])
def test_flex_attention_refused(world):
    outcomes = run_on_ranks_outcomes(_run, world, "flex", False, timeout=120)
    first = _refused_everywhere(outcomes, "torch.nn.attention.flex_attention", "test_unseen_ops.py")
    assert "refuses it on every rank" in first
    assert "halo.nn.domain_flex_attention" in first  # the exact form (tests/test_flex_attention.py)


def test_flex_attention_compiled_in_forward_refused():
    """Compiled with the eager backend, the traced graph's ops reach the guard (refused there, in the graph's code);
    the higher-order op itself is seen only while dynamo traces it, and refused at the next eager op at the latest."""
    outcomes = run_on_ranks_outcomes(_run, 2, "flex_compiled", False, timeout=240)
    _refused_everywhere(outcomes, "refuses it on every rank")


@pytest.mark.parametrize("world", [2, 3])
def test_custom_function_refused(world):
    outcomes = run_on_ranks_outcomes(_run, world, "custom", True, timeout=120)
    _refused_everywhere(outcomes, "custom torch.autograd.Function", "Double", "halo.guard.trusted()")


def test_custom_function_in_inference_runs_checked():
    """Without a graph only the forward runs, and the guard checked its ops (pointwise here): exact."""
    results = run_on_ranks(_run, 2, "custom", False, timeout=120)
    torch.manual_seed(0)
    want = Custom().double()(_full()).detach()
    for r in results:
        assert torch.allclose(r["out"], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_custom_function_trusted_is_exact(world):
    results = run_on_ranks(_run, world, "custom_trusted", True, timeout=120)
    torch.manual_seed(0)
    model = Custom(trusted=True).double()
    x = _full().requires_grad_(True)
    y = model(x)
    wts = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (y * wts).sum().backward()
    for r in results:
        assert torch.allclose(r["out"], y.detach(), rtol=0, atol=1e-12)
        assert torch.allclose(r["grad"], x.grad, rtol=0, atol=1e-12)
    for n, p in model.named_parameters():
        assert torch.allclose(sum(r["params"][n] for r in results), p.grad, rtol=0, atol=1e-11), n


def test_extension_op_refused():
    outcomes = run_on_ranks_outcomes(_run, 2, "extension", True, timeout=120)
    _refused_everywhere(outcomes, "flip_rows", "not an op halo has classified")


# -- NATTEN's own classes (0.20+: no rpb; halo's adapter matched only a class with one) -----------------------------

NH, NW, NC = 11, 7, 16  # head_dim 8: what NATTEN's CPU backend (flex attention, float32) takes


def _natten_model(kind="NeighborhoodAttention2D", **kw):
    natten = pytest.importorskip("natten")
    torch.manual_seed(0)
    if kind == "NeighborhoodAttention2D":
        kw.setdefault("kernel_size", 3)
        kw.setdefault("dilation", 2)
    return getattr(natten, kind)(embed_dim=NC, num_heads=2, **kw)


def _natten_input(dtype):
    return torch.randn(2, NH, NW, NC, dtype=dtype, generator=torch.Generator().manual_seed(5))


def _natten_run(rank, world, dtype):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(nn.Sequential(_natten_model().to(dtype)), manager)
    offs = split_offsets(NH, world)
    x = _natten_input(dtype)[:, offs[rank]:offs[rank + 1]].clone().requires_grad_(dtype == torch.float64)
    y = model(x)
    out = {"type": type(model[0]).__name__, "keys": sorted(model[0].state_dict())}
    if dtype != torch.float64:
        return {**out, "out": halo.gather(y.detach(), dim=1)}
    wts = torch.randn(y.shape[:1] + (NH,) + y.shape[2:], dtype=dtype, generator=torch.Generator().manual_seed(6))
    (y * wts[:, offs[rank]:offs[rank + 1]]).sum().backward()
    return {**out, "out": halo.gather(y.detach(), dim=1), "grad": halo.gather(x.grad, dim=1),
            "params": {n: p.grad.clone() for n, p in model[0].named_parameters()}}


def _natten_reference(model, x):
    """NATTEN's NeighborhoodAttention2D.forward (0.21) with NATTEN's window rules (halo's reference of them)."""
    from halo.nn.neighborhood import neighborhood_attention_reference

    b, h, w, c = x.shape
    qkv = model.qkv(x).reshape(b, h, w, 3, model.num_heads, model.head_dim).permute(3, 0, 4, 1, 2, 5)
    y = neighborhood_attention_reference(qkv[0], qkv[1], qkv[2], model.kernel_size, model.dilation,
                                         scale=model.scale)
    return model.proj(y.permute(0, 2, 3, 1, 4).reshape(b, h, w, c))


@pytest.mark.parametrize("world", [2, 3])
def test_natten_021_class_converts_exactly(world):
    """NATTEN 0.21's own class converts (state dict unchanged) and matches, float64 forward, input and parameter
    gradients, NATTEN's semantics on the whole field; in float32 (NATTEN's CPU backend) NATTEN's own forward."""
    model = _natten_model()
    assert not hasattr(model, "rpb")  # 0.20+: the class the old adapter missed
    results = run_on_ranks(_natten_run, world, torch.float64, timeout=180)
    ref = _natten_model().double()
    x = _natten_input(torch.float64).requires_grad_(True)
    y = _natten_reference(ref, x)
    wts = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    (y * wts).sum().backward()
    for r in results:
        assert r["type"] == "DomainNeighborhoodAttention2D" and r["keys"] == sorted(ref.state_dict()), r["type"]
        assert torch.allclose(r["out"], y.detach(), rtol=0, atol=1e-12), (r["out"] - y).abs().max()
        assert torch.allclose(r["grad"], x.grad, rtol=0, atol=1e-12), (r["grad"] - x.grad).abs().max()
    for n, p in ref.named_parameters():
        assert torch.allclose(sum(r["params"][n] for r in results), p.grad, rtol=0, atol=1e-11), n
    with torch.no_grad():  # NATTEN itself, unsharded (its CPU backend: float32, no backward)
        own = _natten_model()(_natten_input(torch.float32))
    for r in run_on_ranks(_natten_run, world, torch.float32, timeout=180):
        assert torch.allclose(r["out"], own, rtol=0, atol=1e-5), (r["out"] - own).abs().max()


def _natten_refused(rank, world, kind, kw):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    convert_to_domain_parallel(nn.Sequential(_natten_model(kind, **kw)), manager)


@pytest.mark.parametrize("kind, kw, words", [
    ("NeighborhoodAttention1D", {"kernel_size": 3}, "NeighborhoodAttention1D (a 1D neighbourhood)"),
    ("NeighborhoodAttention3D", {"kernel_size": 3}, "NeighborhoodAttention3D (a 3D neighbourhood)"),
    ("NeighborhoodAttention2D", {"stride": 2}, "strided neighbourhoods (stride=(2, 2))"),
    ("NeighborhoodAttention2D", {"is_causal": True}, "causal neighbourhoods"),
])
def test_natten_classes_without_a_form_are_refused_by_name(kind, kw, words):
    outcomes = run_on_ranks_outcomes(_natten_refused, 2, kind, kw, timeout=60)
    first = _refused_everywhere(outcomes, f"natten.modules.{kind}", words)
    assert "halo.gather" in first


class Na2d(nn.Module):
    """NATTEN's functional ``na2d`` in a model's own forward (no module halo could convert): on CPU NATTEN runs it
    with torch's flex_attention, over the shard's rows only."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(NC, 3 * NC)

    def forward(self, x):
        from natten.functional import na2d

        b, h, w, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, h, w, 3, 2, NC // 2).unbind(3)
        return na2d(q, k, v, kernel_size=3).reshape(b, h, w, NC)


def _na2d(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Na2d(), manager)
    offs = split_offsets(NH, world)
    with torch.no_grad():  # (NATTEN's CPU backend: float32, no backward)
        return model(_natten_input(torch.float32)[:, offs[rank]:offs[rank + 1]].contiguous())


def test_natten_na2d_in_a_forward_refused():
    pytest.importorskip("natten")
    outcomes = run_on_ranks_outcomes(_na2d, 2, timeout=120)
    _refused_everywhere(outcomes, "torch.nn.attention.flex_attention")
