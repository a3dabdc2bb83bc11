"""Domain-parallel pools on gloo ranks vs the unsharded pool on the same data, forward and backward.

Tolerances: the forward is compared bitwise (outputs and max-pool indices): each rank runs torch's own pool on
the same windows (halo/nn/pool.py says why). The input gradient is compared at 1e-12 relative in float64: a
row read by windows of two ranks gets its two partial gradients added by the exchange adjoint, in another
order than torch's backward adds them.

A one-process sweep (the exchange replaced by slicing the full field) covers many more configurations
forward; the multi-rank runs cover the wiring, the backward and the explicit group.
"""

import itertools
import os

import pytest
import torch
import torch.nn as nn
from _helpers import virtual_rank

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

H, W = 37, 13

# (kernel, stride, padding, dilation, ceil_mode, return_indices) along H; W gets (3, 2, 1, 1).
MAX_CASES = [(2, 2, 0, 1, False, False), (3, 2, 1, 1, False, True), (3, 2, 1, 1, True, True),
             (3, 1, 1, 1, False, False), (5, 3, 2, 1, True, True), (3, 2, 1, 2, True, True),
             (4, 3, 1, 1, True, False), (2, 3, 0, 1, True, True), (5, 1, 2, 3, False, True),
             (7, 5, 3, 1, True, True), (5, 2, 2, 1, True, True)]
# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override) along H.
AVG_CASES = [(2, 2, 0, False, True, None), (3, 2, 1, False, True, None), (3, 2, 1, True, False, None),
             (3, 2, 1, True, True, None), (5, 3, 2, True, False, None), (5, 3, 2, True, True, 7),
             (4, 3, 2, True, False, None), (2, 3, 1, True, True, None), (3, 1, 1, False, False, None),
             (7, 2, 3, True, False, None), (5, 1, 2, False, True, None)]
ADAPTIVE_CASES = [("avg", (10, 5)), ("avg", (H - 2, None)), ("avg", (2 * H + 1, 3)),
                  ("max", (7, 4)), ("max", (2 * H + 1, 3))]


def build(spec):
    kind, args = spec
    if kind == "max":
        k, s, p, d, ceil, ri = args
        return nn.MaxPool2d((k, 3), (s, 2), (p, 1), (d, 1), return_indices=ri, ceil_mode=ceil)
    if kind == "avg":
        k, s, p, ceil, cip, div = args
        return nn.AvgPool2d((k, 3), (s, 2), (p, 1), ceil_mode=ceil, count_include_pad=cip, divisor_override=div)
    if kind == "adaptive_avg":
        return nn.AdaptiveAvgPool2d(args)
    if kind == "adaptive_max":
        return nn.AdaptiveMaxPool2d(args, return_indices=True)
    raise ValueError(kind)


def all_specs():
    return ([("max", a) for a in MAX_CASES] + [("avg", a) for a in AVG_CASES]
            + [(f"adaptive_{k}", a) for k, a in ADAPTIVE_CASES])


def field(h, w, seed, data):
    """Random field; ``ties``: values on a 0.5 grid (many equal maxima); ``special``: also -inf rows and NaN."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    if data in ("ties", "special"):
        full = (2 * full).round() / 2
    if data == "special":
        full[0, 0, 5:9] = float("-inf")
        full[1, 1, 3, 2] = float("nan")
        full[1, 2, h - 2:] = float("-inf")
    return full, gen


def same(a, b):
    """Bitwise equality with NaN == NaN."""
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _pool_cases(rank, world, domain, cases):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn.pool import halo_pool

    manager = halo.initialize_domain_parallel(world, domain)
    r, group = manager.domain_rank, (manager.domain_group if domain < world else None)
    out_list = []
    for spec, h, w, seed, data in cases:
        ref_layer = build(spec)
        full, gen = field(h, w, seed + manager.dp_rank, data)
        offs = split_offsets(h, domain)
        x = full[..., offs[r]:offs[r + 1], :].clone().requires_grad_(True)
        try:
            out = halo_pool(ref_layer, group=group)(x)
        except (ValueError, NotImplementedError) as exc:
            out_list.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        xf = full.clone().requires_grad_(True)
        ref = ref_layer(xf)
        res = {}
        has_idx = isinstance(ref, tuple)
        if has_idx:
            (out, idx), (ref, ref_idx) = out, ref
        o = split_offsets(ref.shape[-2], domain)
        if has_idx:
            res["idx"] = torch.equal(idx, ref_idx[..., o[r]:o[r + 1], :])
        res["fwd"] = same(out.detach(), ref.detach()[..., o[r]:o[r + 1], :])
        weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (ref * weights).sum().backward()
        (out * weights[..., o[r]:o[r + 1], :]).sum().backward()
        res["grad_err"] = rel_err(x.grad, xf.grad[..., offs[r]:offs[r + 1], :])
        out_list.append(res)
    return out_list


def _run(world, cases, domain=None):
    return run_on_ranks(_pool_cases, world, domain or world, cases, timeout=300)


def _check(results, cases):
    for i, case in enumerate(cases):
        per_rank = [res[i] for res in results]
        assert all("error" not in p for p in per_rank), (case, per_rank)
        assert all(p["fwd"] for p in per_rank), (case, [p["fwd"] for p in per_rank])
        assert all(p.get("idx", True) for p in per_rank), (case, [p.get("idx") for p in per_rank])
        # Cross-rank halo gradients are added in another order than torch's backward: 1e-12 in float64.
        assert max(p["grad_err"] for p in per_rank) <= 1e-12, (case, [p["grad_err"] for p in per_rank])


@pytest.mark.parametrize("world,h", [(2, H), (3, 45), (4, H), (7, H)])
def test_pools_match_unsharded(world, h):
    """Every pool configuration on 2, 3, 4 and 7 ranks (7 ranks: shards of 5-6 rows, smaller than the
    13-row dilated window and the 7-row kernel); max pools on tied values, and -inf / NaN where meaningful."""
    cases = []
    for i, spec in enumerate(all_specs()):
        is_max = spec[0] in ("max", "adaptive_max")
        data = ("special" if i % 2 else "ties") if is_max else "randn"
        cases.append((spec, h, W, 100 * world + i, data))
    _check(_run(world, cases), cases)


def test_pools_on_subgroups():
    """Two domain groups of 2 ranks (the second one does not contain rank 0), explicit group=, other data."""
    cases = [(spec, H, W, 7 + i, "ties") for i, spec in enumerate(all_specs()[::3])]
    _check(_run(4, cases, domain=2), cases)


def test_too_few_output_rows_is_an_error_on_every_rank():
    """A window pool needs an output row on every rank (an adaptive pool with fewer rows than ranks makes its result
    whole on every rank instead: tests/test_global_pool.py)."""
    cases = [(("max", (19, 19, 0, 1, False, False)), H, W, 1, "randn"),  # 1 output row on 3 ranks
             (("avg", (16, 16, 0, False, True, None)), H, W, 2, "randn"),  # 2 output rows
             (("max", (3, 2, 1, 1, False, False)), H, W, 4, "randn")]  # fine: 19 rows
    results = _run(3, cases)
    for i in range(2):
        errors = [res[i].get("error") for res in results]
        assert all(e is not None and e.startswith("ValueError") for e in errors), errors
        assert len(set(errors)) == 1 and "use at most" in errors[0], errors
        assert ("nn.AdaptiveAvgPool2d(1)" in errors[0]) == (i == 0), errors  # 1 output row: the way to a global pool
    _check([res[2:] for res in results], cases[2:])


# -- one process: the exchange replaced by slices of the full field (forward only, many configurations) ----

def virtual_run(layer, full, parts, module):
    outs = []
    for r in range(parts):
        with virtual_rank(full, parts, r, module) as x:
            outs.append(layer(x))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat([o[i] for o in outs], dim=-2) for i in range(2))
    return torch.cat(outs, dim=-2)


def test_pool_sweep_one_process():
    """Every kernel 1-5 x stride 1-4 x padding x dilation x ceil_mode x pool kind on 2, 3 and 7 virtual ranks."""
    import halo.nn.base as base_mod
    import halo.nn.pool as pool_mod

    failures, count = [], 0
    for h in (13, 37):
        full, _ = field(h, W, h, "special")
        full_avg, _ = field(h, W, h + 1, "randn")
        for k, s, p, d, ceil in itertools.product((1, 2, 3, 5), (1, 2, 3, 4), (0, 1, 2), (1, 2), (False, True)):
            if p > k // 2:
                continue
            specs = [("max", (k, s, p, d, ceil, True))]
            if d == 1:
                specs += [("avg", (k, s, p, ceil, cip, div)) for cip, div in ((True, None), (False, None),
                                                                              (True, 5))]
            for spec in specs:
                ref_layer = build(spec)
                data = full if spec[0] == "max" else full_avg
                ref = ref_layer(data)
                layer = pool_mod.halo_pool(ref_layer)
                for parts in (2, 3, 7):
                    if (ref[0] if isinstance(ref, tuple) else ref).shape[-2] < parts:
                        continue
                    got = virtual_run(layer, data, parts, base_mod)  # the layer base plans and exchanges
                    count += 1
                    ok = (same(got[0], ref[0]) and torch.equal(got[1], ref[1])) if isinstance(ref, tuple) \
                        else same(got, ref)
                    if not ok:
                        failures.append((h, spec, parts))
    assert not failures, failures[:10]
    assert count > 1000


def test_module_surface():
    """Same repr and (empty) state_dict as the wrapped module; clear errors for what is not supported."""
    from halo.nn.pool import DomainAvgPool2d, DomainMaxPool2d, halo_pool

    for ref in (nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.AvgPool2d(3, 2, 1, count_include_pad=False),
                nn.AdaptiveAvgPool2d((5, 7)), nn.AdaptiveMaxPool2d(4, return_indices=True)):
        layer = halo_pool(ref)
        assert layer.extra_repr() == ref.extra_repr() and layer.state_dict() == {}
        x = torch.randn(2, 3, 11, 9, dtype=torch.float64)
        got, want = layer(x), ref(x)  # one process without torch.distributed: the plain op
        if not isinstance(want, tuple):
            got, want = (got,), (want,)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(TypeError, match="DomainAdaptiveAvgPool2d"):
        DomainMaxPool2d(nn.AdaptiveAvgPool2d(3))
    with pytest.raises(TypeError, match="nn.AvgPool2d"):
        DomainAvgPool2d(nn.MaxPool2d(3))
    with pytest.raises(NotImplementedError, match="FractionalMaxPool2d"):
        halo_pool(nn.FractionalMaxPool2d(2, output_size=3))
    assert type(halo_pool(nn.LPPool2d(2, 3))).__name__ == "DomainLPPool2d"
