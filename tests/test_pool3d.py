"""3-d pools of ``(B, C, D, H, W)`` fields sharded along H (dim -2) vs torch's unsharded pool on the same data.

``DomainMaxPool3d`` / ``DomainAvgPool3d`` use the 2-d pools' machinery along H (halo/nn/pool.py: exchange the rows the
kept windows read, run torch's op with the module's own arguments, drop the first outputs), so the forward is
compared bitwise (outputs and the global flat indices ``d*H*W + h*W + w`` of ``return_indices``) and the input
gradient at 1e-12 relative in float64 (a row read by windows of two ranks gets its partial gradients added by the
exchange adjoint, in another order than torch's backward).

- one process: every kernel x stride x padding x dilation x ceil_mode along H on 2, 3 and 5 virtual ranks (the
  exchange replaced by slices of the full field), forward;
- 2 and 3 gloo ranks, H = 23 (uneven at every level): forward, indices and input gradient for the configurations
  of the issue (k 3 s 1 p 1, k 2 s 2, k 3 s 2 p 1 dilation 2, ceil_mode, count_include_pad, divisor_override),
  channels_last_3d and unbatched inputs; too few output rows refused with the same error on every rank; a latitude x
  longitude mesh refused;
- a converted model (``convert_to_domain_parallel`` of ``nn.MaxPool3d`` / ``nn.AvgPool3d``) exact, and functional
  ``F.max_pool3d`` / ``F.avg_pool3d`` in a ``forward``: per row along H (kernel 1, stride 1, padding 0) they pass the
  guard and are exact; one with a window along H is computed as its nn module's halo layer (exact too).
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from _helpers import virtual_rank
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

D, H, W = 3, 23, 6

# (kernel, stride, padding, dilation, ceil_mode, return_indices); a tuple is (D, H, W).
MAX_CASES = [(3, 1, 1, 1, False, True), (2, 2, 0, 1, False, True), ((1, 3, 3), (1, 2, 2), (0, 1, 1), 2, False, True),
             (3, 2, 1, 2, False, False), (3, 2, 1, 1, True, True), ((2, 4, 3), (1, 3, 2), (1, 2, 1), 1, True, True),
             ((1, 5, 1), (1, 3, 1), (0, 2, 0), (1, 2, 1), True, True), ((2, 2, 2), (2, 3, 1), 0, 1, True, False)]
# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_CASES = [(3, 1, 1, False, True, None), (2, 2, 0, False, True, None), (3, 2, 1, True, False, None),
             (3, 2, 1, True, True, None), ((1, 5, 3), (1, 3, 2), (0, 2, 1), True, False, None),
             ((2, 3, 3), (1, 2, 2), (1, 1, 1), False, True, 5), ((1, 4, 2), (1, 3, 2), (0, 2, 1), True, True, None)]


def build(kind, args):
    if kind == "max":
        k, s, p, d, ceil, ri = args
        return nn.MaxPool3d(k, s, p, d, return_indices=ri, ceil_mode=ceil)
    k, s, p, ceil, cip, div = args
    return nn.AvgPool3d(k, s, p, ceil_mode=ceil, count_include_pad=cip, divisor_override=div)


def field(h, seed, ties=False, batch=True):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn((2, 3, D, h, W) if batch else (3, D, h, W), generator=gen, dtype=torch.float64)
    return ((2 * full).round() / 2 if ties else full), gen


def same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


# -- one process: many configurations, forward ----------------------------------------------------------------

def _virtual(layer, full, parts, module):
    outs = []
    for r in range(parts):
        with virtual_rank(full, parts, r, module) as x:
            outs.append(layer(x))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat([o[i] for o in outs], dim=-2) for i in range(2))
    return torch.cat(outs, dim=-2)


def test_pool3d_sweep_one_process():
    """Kernel 1-4 x stride 1-3 x padding x dilation x ceil_mode along H (D and W pooled too), max (with indices)
    and average (three divisor rules), on 2, 3 and 5 virtual ranks: bitwise equal to torch's unsharded op."""
    import halo.nn.base as base_mod
    import halo.nn.pool as pool_mod

    failures, count = [], 0
    for h in (11, H):
        data, _ = field(h, h, ties=True)
        for k, s, p, d, ceil in itertools.product((1, 2, 3, 4), (1, 2, 3), (0, 1, 2), (1, 2), (False, True)):
            if p > k // 2:
                continue
            specs = [("max", ((2, k, 2), (1, s, 2), (1, p, 1), (1, d, 1), ceil, True))]
            if d == 1:
                specs += [("avg", ((2, k, 2), (1, s, 2), (0, p, 1), ceil, cip, div))
                          for cip, div in ((True, None), (False, None), (True, 3))]
            for kind, args in specs:
                ref_layer = build(kind, args)
                ref = ref_layer(data)
                layer = pool_mod.halo_pool(ref_layer)
                for parts in (2, 3, 5):
                    if (ref[0] if isinstance(ref, tuple) else ref).shape[-2] < parts:
                        continue
                    got = _virtual(layer, data, parts, base_mod)  # the layer base plans and exchanges
                    count += 1
                    ok = (same(got[0], ref[0]) and torch.equal(got[1], ref[1])) if isinstance(ref, tuple) \
                        else same(got, ref)
                    if not ok:
                        failures.append((h, kind, args, parts))
    assert not failures, failures[:10]
    assert count > 500


def test_module_surface():
    """Same repr and (empty) state_dict as the wrapped module; the plain op in one process; clear type errors."""
    from halo.nn.pool import DomainAvgPool3d, DomainMaxPool3d, halo_pool

    for ref in (nn.MaxPool3d(3, 2, 1, ceil_mode=True, return_indices=True),
                nn.AvgPool3d((1, 3, 2), 2, (0, 1, 1), count_include_pad=False, divisor_override=4)):
        layer = halo_pool(ref)
        assert type(layer) in (DomainMaxPool3d, DomainAvgPool3d)
        assert layer.extra_repr() == ref.extra_repr() and layer.state_dict() == {}
        x = torch.randn(2, 3, 4, 11, 9, dtype=torch.float64)
        got, want = layer(x), ref(x)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(TypeError, match="DomainMaxPool3d wraps an nn.MaxPool3d, got MaxPool2d"):
        DomainMaxPool3d(nn.MaxPool2d(3))
    with pytest.raises(TypeError, match="DomainAvgPool3d wraps an nn.AvgPool3d, got MaxPool3d"):
        DomainAvgPool3d(nn.MaxPool3d(3))
    with pytest.raises(NotImplementedError, match="adaptive 3-d pools"):
        halo_pool(nn.AdaptiveAvgPool3d(2))


# -- gloo ranks ------------------------------------------------------------------------------------------------

def _cases(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn.pool import halo_pool

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(30)
    results = []
    specs = [("max", a, True, fmt, batch) for a in MAX_CASES for fmt, batch in ((False, True),)]
    specs += [("avg", a, False, False, True) for a in AVG_CASES]
    specs += [("max", MAX_CASES[4], True, True, True), ("avg", AVG_CASES[2], False, True, True),  # channels_last_3d
              ("max", MAX_CASES[0], True, False, False), ("avg", AVG_CASES[0], False, False, False)]  # unbatched
    for i, (kind, args, ties, channels_last, batch) in enumerate(specs):
        ref_layer = build(kind, args)
        full, gen = field(H, 10 * world + i, ties=ties, batch=batch)
        if channels_last:
            full = full.contiguous(memory_format=torch.channels_last_3d)
        offs = split_offsets(H, world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone(memory_format=torch.preserve_format).requires_grad_(True)
        out = halo_pool(ref_layer)(x)
        xf = full.clone(memory_format=torch.preserve_format).requires_grad_(True)
        ref = ref_layer(xf)
        res = {}
        if isinstance(ref, tuple):
            (out, idx), (ref, ref_idx) = out, ref
        o = split_offsets(ref.shape[-2], world)
        if isinstance(ref_layer, nn.MaxPool3d) and ref_layer.return_indices:
            res["idx"] = torch.equal(idx, ref_idx[..., o[rank]:o[rank + 1], :])
        res["fwd"] = same(out.detach(), ref.detach()[..., o[rank]:o[rank + 1], :])
        res["format"] = out.is_contiguous(memory_format=torch.channels_last_3d) if channels_last else True
        weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (ref * weights).sum().backward()
        (out * weights[..., o[rank]:o[rank + 1], :]).sum().backward()
        want = xf.grad[..., offs[rank]:offs[rank + 1], :]
        res["grad_err"] = ((x.grad - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
        results.append(((kind, args, channels_last, batch), res))
    errors = {}
    offs = split_offsets(H, world)
    x = field(H, 1)[0][..., offs[rank]:offs[rank + 1], :]
    for kind, layer in (("max", nn.MaxPool3d((1, 12, 1), (1, 12, 1))), ("avg", nn.AvgPool3d((1, 9, 1), (1, 9, 1)))):
        try:  # 1 (max) and 2 (avg) output rows: fewer than 3 ranks; on 2 ranks the avg pool runs
            halo_pool(layer)(x)
            errors[kind] = None
        except ValueError as exc:
            errors[kind] = str(exc)
    mesh = halo.DomainMesh((1, world))
    for cls, layer in ((halo.nn.pool.DomainMaxPool3d, nn.MaxPool3d(2)),
                       (halo.nn.pool.DomainAvgPool3d, nn.AvgPool3d(2))):
        try:
            cls(layer, mesh=mesh)
            errors[cls.__name__] = None
        except ValueError as exc:
            errors[cls.__name__] = str(exc)
    return results, errors


_RUNS: dict = {}


def _run(world):
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_cases, world, timeout=240)
    return _RUNS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_pool3d_matches_unsharded(world):
    runs = _run(world)
    for i, (case, _) in enumerate(runs[0][0]):
        per_rank = [run[0][i][1] for run in runs]
        assert all(p["fwd"] for p in per_rank), (case, per_rank)
        assert all(p.get("idx", True) for p in per_rank), (case, per_rank)
        assert all(p["format"] for p in per_rank), (case, per_rank)
        assert max(p["grad_err"] for p in per_rank) <= 1e-12, (case, per_rank)
        if case[0] == "max" and case[1][-1]:
            assert "idx" in per_rank[0], case  # the indices were compared


@pytest.mark.parametrize("world", [2, 3])
def test_pool3d_refusals_are_the_same_on_every_rank(world):
    errors = [run[1] for run in _run(world)]
    for key in errors[0]:
        assert len({e[key] for e in errors}) == 1, (key, errors)
    e = errors[0]
    assert "DomainMaxPool3d: the output has 1 rows along H (23 input rows, kernel 12, stride 12" in e["max"], e
    assert f"domain group has {world} ranks" in e["max"] and "use at most 1 ranks" in e["max"], e
    if world == 3:
        assert "DomainAvgPool3d: the output has 2 rows along H" in e["avg"] and "use at most 2 ranks" in e["avg"], e
    else:
        assert e["avg"] is None, e
    for name in ("DomainMaxPool3d", "DomainAvgPool3d"):
        assert e[name] == (f"{name}: a latitude x longitude mesh is supported by the 2-d layers only; shard only "
                           f"latitude (a one-axis mesh) for 3-d pools"), e


# -- converted models: the modules, and the functional ops under the guard ---------------------------------------

class _Net3d(nn.Module):
    """Conv3d, MaxPool3d (indices unused), AvgPool3d, then functional pools that act on each row of H on their own
    (kernel 1 along H: the guard lets them pass) and, with ``window``, one whose window spans rows (computed exactly
    by the guard)."""

    def __init__(self, window: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.maxpool = nn.MaxPool3d((1, 3, 2), (1, 2, 2), (0, 1, 0))
        self.avgpool = nn.AvgPool3d(3, 1, 1, count_include_pad=False)
        self.window = window

    def forward(self, x):
        y = self.avgpool(self.maxpool(torch.tanh(self.conv(x))))
        y = F.max_pool3d(y, (2, 1, 2), stride=(1, 1, 1), padding=(1, 0, 1)) + F.avg_pool3d(y, (2, 1, 2), (1, 1, 1),
                                                                                         (1, 0, 1))
        if self.window:
            y = F.avg_pool3d(y, (1, 3, 1), 1, (0, 1, 0))
        return y


def _converted(rank, world, window):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(30)
    torch.manual_seed(0)
    model = _Net3d(window).double()
    ref_model = _Net3d(window).double()
    ref_model.load_state_dict(model.state_dict())
    convert_to_domain_parallel(model)
    full = torch.randn(2, 2, D, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    try:
        out = model(x)
    except ValueError as exc:
        return {"error": str(exc)}
    xf = full.clone().requires_grad_(True)
    ref = ref_model(xf)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    o = split_offsets(ref.shape[-2], world)
    (ref * weights).sum().backward()
    (out * weights[..., o[rank]:o[rank + 1], :]).sum().backward()
    res = {"fwd": (out.detach() - ref.detach()[..., o[rank]:o[rank + 1], :]).abs().max().item(),
           "grad": (x.grad - xf.grad[..., offs[rank]:offs[rank + 1], :]).abs().max().item(),
           "types": sorted({type(m).__name__ for m in model.modules()})}
    res["params"] = {n: (p.grad, dict(ref_model.named_parameters())[n].grad) for n, p in model.named_parameters()}
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_converted_3d_pools_and_functional_row_pools_are_exact(world):
    """nn.MaxPool3d / nn.AvgPool3d are converted; F.max_pool3d / F.avg_pool3d with kernel 1, stride 1, padding 0
    along H pass the guard (they act on each row on its own): forward, input and parameter gradients exact."""
    results = run_on_ranks(_converted, world, False, timeout=240)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    assert {"DomainMaxPool3d", "DomainAvgPool3d", "DomainConv3d"} <= set(results[0]["types"]), results[0]["types"]
    assert max(r["fwd"] for r in results) <= 1e-12
    assert max(r["grad"] for r in results) <= 1e-12
    for name, (_, want) in results[0]["params"].items():
        got = sum(r["params"][name][0] for r in results)
        assert (got - want).abs().max() <= 1e-12 * max(1.0, want.abs().max()), name


def test_functional_pool3d_window_along_h_is_computed_exactly():
    """``F.avg_pool3d`` with a window of 3 along H (padding 1): the guard computes it as the halo layer of the
    ``nn.AvgPool3d`` the call describes (it was refused before): forward, input and parameter gradients exact."""
    results = run_on_ranks(_converted, 2, True, timeout=240)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    assert max(r["fwd"] for r in results) <= 1e-12
    assert max(r["grad"] for r in results) <= 1e-12
    for name, (_, want) in results[0]["params"].items():
        got = sum(r["params"][name][0] for r in results)
        assert (got - want).abs().max() <= 1e-12 * max(1.0, want.abs().max()), name
