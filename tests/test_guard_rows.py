"""New rows of the guard's one table (issue 32 item 6): ``F.conv1d`` over a field's tokens (H merged with W by
``flatten(2)``) with kernel 1, stride 1, padding 0, dilation 1 is pointwise over tokens and passes, exact against
the unsharded model forward and backward; a wider kernel over tokens is refused on every rank, saying what it is
(a window over flattened tokens). 3 ranks, 7 rows (3 + 2 + 2), float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from halo.testing import run_on_ranks

B, C, OUT, H, W = 2, 3, 4, 7, 5


class Tokens(nn.Module):
    """A field flattened to tokens, a 1-d conv over them, and the tokens back to (B, C, H, W)."""

    def __init__(self, k: int = 1, **conv: object) -> None:
        super().__init__()
        self.conv = conv
        self.weight = nn.Parameter(torch.randn(OUT, C, k, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(OUT, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        t = F.conv1d(x.flatten(2), self.weight, self.bias, **self.conv)
        return t.view(b, OUT, h, w) * 2.0


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, C, H, W, generator=g, dtype=torch.float64),
            torch.randn(B, OUT, H, W, generator=g, dtype=torch.float64))


def _run(rank: int, world: int, k: int, conv: dict) -> tuple:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Tokens(k, **conv), manager, custom_converters={Tokens: INSIDE})
    full, wts = _inputs()
    x = torch.tensor_split(full, world, dim=-2)[rank].clone().requires_grad_(True)
    try:
        y = model(x)
    except ValueError as exc:
        return ("refused", str(exc))
    (y * torch.tensor_split(wts, world, dim=-2)[rank]).sum().backward()
    grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters()]
    return ("ran", halo.gather(y.detach()), halo.gather(x.grad), grads)


def test_a_pointwise_conv1d_over_tokens_passes_exactly():
    results = run_on_ranks(_run, 3, 1, {}, timeout=180)
    torch.manual_seed(0)
    model = Tokens(1)
    full, wts = _inputs()
    x = full.clone().requires_grad_(True)
    y = model(x)
    (y * wts).sum().backward()
    for r in results:
        assert r[0] == "ran", r
        _, got, grad, grads = r
        assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (got - y).abs().max()  # no cross-rank sum
        assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (grad - x.grad).abs().max()
        for p, g in zip(model.parameters(), grads, strict=True):  # summed over ranks: rounding only
            assert torch.allclose(g, p.grad, rtol=1e-12, atol=1e-12), (g - p.grad).abs().max()


def test_a_window_over_flattened_tokens_is_refused_on_every_rank_saying_so():
    for k, conv in ((3, {"padding": 1}), (1, {"stride": 2})):
        results = run_on_ranks(_run, 3, k, conv, timeout=180)
        assert all(r[0] == "refused" for r in results), (k, conv, [r[0] for r in results])
        texts = {r[1] for r in results}
        assert len(texts) == 1, texts  # the same error on every rank
        (text,) = texts
        assert "conv1d at test_guard_rows.py:" in text, text
        assert f"a 1-d convolution with kernel {k}" in text and "a window over flattened tokens" in text, text
        assert "latitude" not in text, text


# -- F.scaled_dot_product_attention: a field's tokens attending to a context whole on every rank ----------------------

E, S = 6, 4


class Cross(nn.Module):
    """The field's tokens query a learned context (a parameter: whole on every rank, as Perceiver's latents);
    ``self_attention``: the tokens attend to themselves instead (over all tokens of the field: refused)."""

    def __init__(self, self_attention: bool = False, **sdpa: object) -> None:
        super().__init__()
        self.self_attention, self.sdpa = self_attention, sdpa
        self.wq = nn.Parameter(torch.randn(E, C, dtype=torch.float64) / 2)
        self.context = nn.Parameter(torch.randn(S, E, dtype=torch.float64))
        self.wv = nn.Parameter(torch.randn(E, E, dtype=torch.float64) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q = F.linear(x.flatten(2).transpose(1, 2), self.wq)  # (B, tokens, E): H in the tokens
        k, v = (q, q) if self.self_attention else (self.context, F.linear(self.context, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        return out.transpose(1, 2).reshape(b, E, h, w) + x.sum(1, keepdim=True)


def _run_cross(rank: int, world: int, self_attention: bool, sdpa: dict) -> tuple:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Cross(self_attention, **sdpa), manager, custom_converters={Cross: INSIDE})
    full, _ = _inputs()
    wts = torch.randn(B, E, H, W, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = torch.tensor_split(full, world, dim=-2)[rank].clone().requires_grad_(True)
    try:
        y = model(x)
    except ValueError as exc:
        return ("refused", str(exc))
    (y * torch.tensor_split(wts, world, dim=-2)[rank]).sum().backward()
    grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters()]
    return ("ran", halo.gather(y.detach()), halo.gather(x.grad), grads)


def test_cross_attention_of_a_fields_tokens_to_a_whole_context_passes_exactly():
    results = run_on_ranks(_run_cross, 3, False, {}, timeout=180)
    torch.manual_seed(0)
    model = Cross()
    full, _ = _inputs()
    wts = torch.randn(B, E, H, W, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = full.clone().requires_grad_(True)
    y = model(x)
    (y * wts).sum().backward()
    for r in results:
        assert r[0] == "ran", r
        _, got, grad, grads = r
        assert torch.allclose(got, y.detach(), rtol=0, atol=1e-12), (got - y).abs().max()  # each query row alone
        assert torch.allclose(grad, x.grad, rtol=0, atol=1e-12), (grad - x.grad).abs().max()
        for p, g in zip(model.parameters(), grads, strict=True):  # the context's gradient: summed over ranks
            assert torch.allclose(g, p.grad, rtol=1e-10, atol=1e-12), (g - p.grad).abs().max()


def test_a_causal_context_stays_refused():
    results = run_on_ranks(_run_cross, 3, False, {"is_causal": True}, timeout=180)
    assert all(r[0] == "refused" for r in results), [r[0] for r in results]
    texts = {r[1] for r in results}
    assert len(texts) == 1 and "attends causally" in next(iter(texts)), texts


def _run_self(rank: int, world: int, sdpa: dict, calls: int) -> list:
    """Self-attention over all of a field's tokens in the model's own forward, ``calls`` times (the first call is
    guarded and records the site; later ones compute the recorded site: halo.guard.reroute)."""
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(Cross(True, **sdpa), manager, custom_converters={Cross: INSIDE})
    full, _ = _inputs()
    wts = torch.randn(B, E, H, W, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = []
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        x = torch.tensor_split(full, world, dim=-2)[rank].clone().requires_grad_(True)
        y = model(x)
        (y * torch.tensor_split(wts, world, dim=-2)[rank]).sum().backward()
        grads = [halo.parallel.all_reduce(p.grad.clone()) for p in model.parameters() if p.grad is not None]
        out.append((halo.gather(y.detach()), halo.gather(x.grad), grads))
    return out


def test_self_attention_over_a_fields_tokens_is_ring_attention_exactly():
    """``F.scaled_dot_product_attention(q, q, q)`` over the tokens of a field split over 3 ranks (7 rows: 3 + 2 +
    2, so 15 + 10 + 10 tokens), plain, causal (global positions) and with a global additive mask: computed by
    halo.nn.ring.ring_sdpa, equal to the unsharded model forward and backward, on the guarded first call and on the
    recorded second one (each shard attending alone differs: see tests/test_ring_attention.py)."""
    mask = torch.randn(H * W, H * W, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    for sdpa in ({}, {"is_causal": True}, {"attn_mask": mask}):
        results = run_on_ranks(_run_self, 3, sdpa, 2, timeout=180)
        torch.manual_seed(0)
        model = Cross(True, **sdpa)
        full, _ = _inputs()
        wts = torch.randn(B, E, H, W, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        x = full.clone().requires_grad_(True)
        y = model(x)
        (y * wts).sum().backward()
        want = [p.grad for p in model.parameters() if p.grad is not None]
        for calls in results:
            for got, grad, grads in calls:
                assert torch.allclose(got, y.detach(), rtol=0, atol=1e-11), (sdpa.keys(), (got - y).abs().max())
                assert torch.allclose(grad, x.grad, rtol=0, atol=1e-11), (sdpa.keys(), (grad - x.grad).abs().max())
                assert len(grads) == len(want)
                for g, p in zip(grads, want, strict=True):
                    assert torch.allclose(g, p, rtol=1e-10, atol=1e-11), (sdpa.keys(), (g - p).abs().max())


# -- vector norms over dims that include H: computed exactly over the domain -------------------------------------------

NORMS = {
    "vector_norm_2": lambda x: torch.linalg.vector_norm(x, 2, dim=(2, 3), keepdim=True),
    "vector_norm_1": lambda x: torch.linalg.vector_norm(x, 1, dim=(-2, -1), keepdim=True),
    "vector_norm_inf": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=(1, 2, 3), keepdim=True),
    "tensor_norm_3": lambda x: x.norm(3, dim=(2, 3), keepdim=True),
    "torch_norm_fro": lambda x: torch.norm(x, dim=(2, 3)).view(B, C, 1, 1),
    "all_dims": lambda x: torch.linalg.vector_norm(x),
    "linalg_norm_h": lambda x: torch.linalg.norm(x, dim=2, keepdim=True),
}


class Norms(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, C, dtype=torch.float64).view(1, C, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (1 + NORMS[self.name](x * self.scale))


def _run_norms(rank: int, world: int) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    manager = halo.initialize_domain_parallel(world, world)
    full, _ = _inputs()
    wts = torch.tensor_split(torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(7),
                                         dtype=torch.float64), world, dim=-2)[rank]
    out = {}
    for name in NORMS:
        model = convert_to_domain_parallel(Norms(name), manager, custom_converters={Norms: INSIDE})
        runs = []
        for _ in range(2):  # the guarded first call, then a call computed at the recorded site
            x = torch.tensor_split(full, world, dim=-2)[rank].clone().requires_grad_(True)
            y = model(x)
            model.zero_grad()
            (y * wts).sum().backward()
            runs.append((halo.gather(y.detach()), halo.gather(x.grad), halo.parallel.all_reduce(model.scale.grad)))
        out[name] = runs
    return out


def test_vector_norms_over_h_are_computed_over_the_domain_exactly():
    results = run_on_ranks(_run_norms, 3, timeout=240)
    full, _ = _inputs()
    wts = torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for name in NORMS:
        model = Norms(name)
        x = full.clone().requires_grad_(True)
        y = model(x)
        (y * wts).sum().backward()
        for r in results:
            for got, grad, scale_grad in r[name]:  # sums over ranks in another order: rounding only
                assert torch.allclose(got, y.detach(), rtol=1e-12, atol=1e-12), (name, (got - y).abs().max())
                assert torch.allclose(grad, x.grad, rtol=1e-10, atol=1e-12), (name, (grad - x.grad).abs().max())
                assert torch.allclose(scale_grad, model.scale.grad, rtol=1e-10, atol=1e-12), name
