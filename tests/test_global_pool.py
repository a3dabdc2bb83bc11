"""Global pools (an adaptive pool with fewer output rows than ranks): squeeze-excitation, scSE, ASPP, CBAM.

A global pool's result is whole on every rank: each rank pools its rows of every window, the shares are summed
(average) or compared (max: the winner is torch's, the first maximum in row-major order) over the domain group,
and the backward sums the ranks' partial gradients of the result before routing them to the input rows. Modules
after the pool in its ``nn.Sequential`` (ASPP's 1x1 conv + BatchNorm + ReLU) stay torch's own and compute on the
whole result, so BatchNorm's statistics and running buffers are the unsharded ones. Each model runs converted on
2 and 3 gloo ranks and unsharded in the same test: float64, 21 rows (uneven shards), train mode, forward,
backward, parameter gradients (summed over ranks) and BatchNorm buffers; tolerance 1e-12 (sums in another order).
A halo layer given a global pool's result outside such a Sequential would take the copies for shards: it raises on
every rank, naming itself and the pool. halo's dropout is the exception: it draws the whole result's one-process mask
on every rank.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import RankError, run_on_ranks

H, W, C = 21, 12, 4


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation, as torchvision writes it: its own forward, pool then 1x1 convs."""

    def __init__(self, channels, squeeze):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class SCSEModule(nn.Module):
    """segmentation_models_pytorch's SCSEModule (CREDIT's U-Net attention): cSE is a Sequential."""

    def __init__(self, in_channels, reduction=2):
        super().__init__()
        self.cSE = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_channels, in_channels // reduction, 1),
                                 nn.ReLU(inplace=True), nn.Conv2d(in_channels // reduction, in_channels, 1),
                                 nn.Sigmoid())
        self.sSE = nn.Sequential(nn.Conv2d(in_channels, 1, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.cSE(x) + x * self.sSE(x)


class ASPPPooling(nn.Sequential):
    """torchvision's (and smp's) ASPPPooling: a Sequential with its own forward, then a resize to the input's
    size (from a 1 x 1 map: the same value in every row, so the local size is right)."""

    def __init__(self, in_channels, out_channels):
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_channels, out_channels, 1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU())

    def forward(self, x):
        size = x.shape[-2:]
        for mod in self:
            x = mod(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class ChannelGate(nn.Module):
    """CBAM's channel attention: average and max global pools through one shared MLP."""

    def __init__(self, channels):
        super().__init__()
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.max = nn.AdaptiveMaxPool2d((1, 1))
        self.mlp = nn.Sequential(nn.Conv2d(channels, channels // 2, 1), nn.ReLU(),
                                 nn.Conv2d(channels // 2, channels, 1))

    def forward(self, x):
        return x * torch.sigmoid(self.mlp(self.avg(x)) + self.mlp(self.max(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(C, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.se = SqueezeExcitation(C, 2)
        self.scse = SCSEModule(C)
        self.aspp_pool = ASPPPooling(C, C)
        self.aspp_conv = nn.Conv2d(C, C, 3, padding=2, dilation=2)
        self.gate = ChannelGate(C)
        self.head = nn.Conv2d(2 * C, C, 3, padding=1)

    def forward(self, x):
        a = F.relu(self.bn(self.stem(x)))
        a = self.gate(self.scse(self.se(a)))
        a = torch.cat([self.aspp_pool(a), self.aspp_conv(a)], dim=1)
        return self.head(a)


class MaxTies(nn.Module):
    """A global max pool of ReLU outputs (exact ties at 0 across ranks, and a constant channel)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        a = F.relu(self.conv(x) - 10.0)  # mostly zeros
        a = torch.cat([a[:, :-1], torch.zeros_like(a[:, -1:]) + 0.5], dim=1)  # a constant channel: all ties
        return x * self.pool(a + 1.0)


BUILDS = {"Net": Net, "MaxTies": MaxTies}


def _inputs():
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wts = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return full, wts


def _run(rank, world, name):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    keys = list(model.state_dict())
    convert_to_domain_parallel(model, manager)
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    full, wts = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    out = model(x)
    (out * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
    return {"types": types, "keys": list(model.state_dict()) == keys, "out": halo.gather(out.detach()),
            "grad": halo.gather(x.grad), "params": {n: p.grad for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def _reference(name):
    torch.manual_seed(0)
    model = BUILDS[name]().double()
    full, wts = _inputs()
    x = full.clone().requires_grad_(True)
    out = model(x)
    (out * wts).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())


@pytest.mark.parametrize("name", ["Net", "MaxTies"])
@pytest.mark.parametrize("world", [2, 3])
def test_global_pools_convert_exactly(name, world):
    results = run_on_ranks(_run, world, name, timeout=120)
    out, grad, params, buffers = _reference(name)
    for r in results:
        assert r["keys"]
        if name == "Net":
            assert r["types"]["se.avgpool"] == "DomainAdaptiveAvgPool2d", r["types"]
            assert r["types"]["aspp_pool.2"] == "BatchNorm2d", r["types"]  # after the pool: torch's own
            assert r["types"]["bn"] == "DomainBatchNorm2d", r["types"]
        assert torch.allclose(r["out"], out, rtol=0, atol=1e-12), (r["out"] - out).abs().max()
        assert torch.allclose(r["grad"], grad, rtol=0, atol=1e-12), (r["grad"] - grad).abs().max()
        for n, b in buffers.items():
            assert torch.allclose(r["buffers"][n].double(), b.double(), rtol=0, atol=1e-12), (n, r["buffers"][n], b)
    for n, want in params.items():
        got = sum(r["params"][n] for r in results)
        assert torch.allclose(got, want, rtol=0, atol=1e-11), (n, (got - want).abs().max())


@pytest.mark.parametrize("world", [2, 3])
def test_pool_with_fewer_output_rows_than_ranks(world):
    """The pool alone: 2 output rows over 3 ranks, (avg and max, indices global), and a (1, 5) output; of
    (B, C, H, W) fields and of (C, H, W) ones (a rank without rows of a window pools an empty part)."""
    results = run_on_ranks(_pool_only, world, timeout=60)
    full, wts = _inputs()
    for r in results:
        for (size, kind), got in r.items():
            x = (full[0] if kind.endswith("3d") else full).clone().requires_grad_(True)
            w = wts[0] if kind.endswith("3d") else wts
            if kind.startswith("avg"):
                y = F.adaptive_avg_pool2d(x, size)
                idx = None
            else:
                y, idx = F.adaptive_max_pool2d(x, size, return_indices=True)
            (y * w[..., :y.shape[-2], :y.shape[-1]]).sum().backward()
            assert torch.allclose(got["out"], y, rtol=0, atol=1e-12), (size, kind)
            assert torch.allclose(got["grad"], x.grad, rtol=0, atol=1e-12), (size, kind)
            if idx is not None:
                assert torch.equal(got["idx"], idx), (size, kind)


def _pool_only(rank, world):
    import halo
    from halo.nn.pool import halo_adaptive_avg_pool2d, halo_adaptive_max_pool2d

    halo.initialize_domain_parallel(world, world)
    full, wts = _inputs()
    offs = split_offsets(H, world)
    results = {}
    for size in ((1, 5), (world - 1, 3)):
        for kind in ("avg", "max", "avg3d", "max3d"):  # 3d: a (C, H, W) field, as torch's adaptive pools take
            three = kind.endswith("3d")
            x = (full[0] if three else full)[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
            idx = None
            if kind.startswith("avg"):
                y = halo_adaptive_avg_pool2d(x, size)
            else:
                y, idx = halo_adaptive_max_pool2d(x, size, return_indices=True)
            # Each rank's consumers use their own part of the whole result: rank r takes its share of the weights.
            share = ((wts[0] if three else wts)[..., :y.shape[-2], :y.shape[-1]] / world)
            (y * share).sum().backward()
            results[(size, kind)] = {"out": y.detach(), "idx": idx, "grad": halo.gather(x.grad)}
    return results


class PoolThenNorm(nn.Module):
    """A global pool whose result goes to a BatchNorm in a forward halo cannot see (not a Sequential)."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.conv = nn.Conv2d(C, C, 1)
        self.norm = nn.BatchNorm2d(C)

    def forward(self, x):
        return x * self.norm(self.conv(self.pool(x)))


def _refused(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    model = convert_to_domain_parallel(PoolThenNorm().double(), manager)
    full, _ = _inputs()
    offs = split_offsets(H, world)
    return model(full[..., offs[rank]:offs[rank + 1], :])


def test_whole_result_into_a_splitting_layer_raises_on_every_rank():
    with pytest.raises(RankError) as info:
        run_on_ranks(_refused, 3, timeout=60)
    text = str(info.value)
    assert "norm (DomainBatchNorm2d) is given the result of a global pool" in text, text
    assert "nn.Sequential" in text, text


class DroppedGate(nn.Module):
    """A dropout on a field, then a gate whose global pool's result goes through a dropout (in a forward halo cannot
    see): halo's dropout draws the pool's result whole, the same mask on every rank."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(C, C, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.pool_drop = nn.Dropout(0.5)
        self.conv = nn.Conv2d(C, C, 1)

    def forward(self, x):
        a = self.drop(self.stem(x))
        return a * torch.sigmoid(self.conv(self.pool_drop(self.pool(a))))


def _dropped(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(DroppedGate().double(), manager)
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    full, wts = _inputs()
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    torch.manual_seed(5)
    out = model(x)
    (out * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
    return {"types": types, "out": halo.gather(out.detach()), "grad": halo.gather(x.grad),
            "params": {n: p.grad for n, p in model.named_parameters()}}


def test_a_dropout_of_a_global_pools_result_draws_the_unsharded_mask():
    """The reference: the unsharded model with halo's one-process draws (tests/_modes.py's ``WholeFieldDropout``),
    the same key order; at 3 ranks the output, the input gradient and the parameter gradients are its own."""
    from _modes import WholeFieldDropout

    results = run_on_ranks(_dropped, 3, timeout=60)
    full, wts = _inputs()
    outs = {}
    for p in (0.5, 0.0):
        torch.manual_seed(0)
        ref = DroppedGate().double()
        ref.drop, ref.pool_drop = WholeFieldDropout(p), WholeFieldDropout(p)
        x = full.clone().requires_grad_(True)
        torch.manual_seed(5)
        outs[p] = out = ref(x)
        if p:
            (out * wts).sum().backward()
            grad, params = x.grad, {n: q.grad for n, q in ref.named_parameters()}
    assert not torch.allclose(outs[0.5], outs[0.0]), "the dropouts change nothing: the test could not fail"
    for r in results:
        assert r["types"]["pool_drop"] == "DomainDropout", r["types"]
        assert torch.allclose(r["out"], outs[0.5], rtol=0, atol=1e-12), (r["out"] - outs[0.5]).abs().max()
        assert torch.allclose(r["grad"], grad, rtol=0, atol=1e-12), (r["grad"] - grad).abs().max()
    for n, want in params.items():
        got = sum(r["params"][n] for r in results)
        assert torch.allclose(got, want, rtol=0, atol=1e-11), (n, (got - want).abs().max())


class PSPBlock(nn.Module):
    """smp's PSPBlock: pool to a small grid, conv-BN-ReLU, resize back to the input's (local) size in forward."""

    def __init__(self, channels, pool_size):
        super().__init__()
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(pool_size), nn.Conv2d(channels, channels, 1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())

    def forward(self, x):
        h, w = x.shape[-2:]
        return F.interpolate(self.pool(x), size=(h, w), mode="bilinear", align_corners=True)


class PSP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.blocks = nn.ModuleList([PSPBlock(C, s) for s in sizes])

    def forward(self, x):
        return torch.cat([x, *[b(x) for b in self.blocks]], dim=1)


def _psp(rank, world, sizes):
    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(PSP(sizes).double(), manager)
    full, _ = _inputs()
    offs = split_offsets(H, world)
    try:
        return halo.gather(model(full[..., offs[rank]:offs[rank + 1], :]).detach())
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("sizes", [(1,), (1, 2)])
def test_psp_levels_resized_to_a_shards_size_are_exact(sizes):
    """A 1 x 1 level is constant along H; a 2 x 2 grid (whole on every rank at 3 ranks) resized to the shard's own
    size is resized to the field's global rows and each rank keeps its rows (``halo.guard.reroute``)."""
    results = run_on_ranks(_psp, 3, sizes, timeout=60)
    torch.manual_seed(0)
    want = PSP(sizes).double()(_inputs()[0]).detach()
    for got in results:
        assert isinstance(got, torch.Tensor), got
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


# -- one global-pool path on either decomposition: meshes with an axis of one rank --------------------------------

#: mesh shape -> (output_size, path): "whole" (every sharded axis a global pool), "rows" (H windowed, W on each rank
#: alone: the balanced split of H), "refused" (a windowed axis beside a sharded one).
MESH_CASES = {(1, 3): [(1, "whole"), ((2, 1), "whole"), ((4, 2), "whole"), ((1, 4), "refused")],
              (3, 1): [(1, "whole"), ((2, 3), "whole"), ((5, 4), "rows"), ((7, None), "rows")]}


def _mesh_pools(rank, world, shape):
    import halo
    from halo.nn import DomainAdaptiveAvgPool2d, DomainAdaptiveMaxPool2d
    from halo.plan.partition import local_range

    mesh = halo.DomainMesh(shape)
    (h0, h1), (w0, w1) = (local_range(n, mesh.axis_size(a), mesh.axis_rank(a)) for a, n in ((0, H), (1, W)))
    full, wts = _inputs()
    full = (2 * full).round() / 2  # a 0.5 grid: ties within and across ranks for the max
    results = {}
    for size, path in MESH_CASES[shape]:
        for kind in ("avg", "max"):
            pool = nn.AdaptiveAvgPool2d(size) if kind == "avg" else nn.AdaptiveMaxPool2d(size, return_indices=True)
            layer = (DomainAdaptiveAvgPool2d if kind == "avg" else DomainAdaptiveMaxPool2d)(pool, mesh=mesh)
            x = full[..., h0:h1, w0:w1].clone().requires_grad_(True)
            try:
                y = layer(x)
            except ValueError as exc:
                results[(size, kind)] = {"error": str(exc)}
                continue
            y, idx = y if kind == "max" else (y, None)
            m = pool(full)[0 if kind == "max" else slice(None)].shape[-2]
            if path == "whole":  # each rank's consumers use their own share of the whole result
                (y * wts[..., :y.shape[-2], :y.shape[-1]] / world).sum().backward()
                rows = (0, m)
            else:  # this rank's rows of the output
                rows = local_range(m, shape[0], mesh.axis_rank(0))
                (y * wts[..., rows[0]:rows[1], :y.shape[-1]]).sum().backward()
            results[(size, kind)] = {"out": y.detach(), "idx": idx, "rows": rows, "grad": x.grad,
                                     "block": (h0, h1, w0, w1), "whole": halo.plan.plans.whole_source(y) is not None}
    return results


@pytest.mark.parametrize("shape", [(1, 3), (3, 1)])
def test_global_pool_path_on_meshes_with_a_rank_alone_on_an_axis(shape):
    """The one global-pool path reduces over the domain whatever the decomposition: a 1 x 3 mesh (W sharded alone:
    H whole on each rank, pooled by torch) and a 3 x 1 mesh (latitude rows as a mesh), outputs 1 x 1 and more than one
    output along the unsharded axis; on the 3 x 1 mesh a windowed H is the rows path. Values bitwise (max: indices
    too, ties across ranks: torch's winner), the input gradient at 1e-12, the result marked whole only where it is.
    A windowed axis beside a sharded one raises the same error on every rank."""
    results = run_on_ranks(_mesh_pools, 3, shape, timeout=120)
    full, wts = _inputs()
    full = (2 * full).round() / 2
    for size, path in MESH_CASES[shape]:
        for kind in ("avg", "max"):
            got = [r[(size, kind)] for r in results]
            if path == "refused":
                assert len({g.get("error") for g in got}) == 1, got
                assert "only as a global pool" in got[0]["error"] and "1 x 4" in got[0]["error"], got[0]
                continue
            x = full.clone().requires_grad_(True)
            if kind == "avg":
                ref, ref_idx = F.adaptive_avg_pool2d(x, size), None
            else:
                ref, ref_idx = F.adaptive_max_pool2d(x, size, return_indices=True)
            (ref * wts[..., :ref.shape[-2], :ref.shape[-1]]).sum().backward()
            for g in got:
                assert "error" not in g, (size, kind, g)
                a, b = g["rows"]
                assert g["whole"] == (path == "whole"), (size, kind)
                want = ref.detach()[..., a:b, :]
                if kind == "max":
                    assert torch.equal(g["out"], want) and torch.equal(g["idx"], ref_idx[..., a:b, :]), (size, kind)
                else:
                    assert torch.allclose(g["out"], want, rtol=0, atol=1e-14), (size, kind)
                h0, h1, w0, w1 = g["block"]
                err = (g["grad"] - x.grad[..., h0:h1, w0:w1]).abs().max()
                assert err <= 1e-12, (size, kind, err)


class DerivedFromMean(nn.Module):
    """A mean over H, W (computed over the domain by the guard, whole on every rank), scaled or reshaped, then a
    halo layer: a dropout, or a 3x3 conv of the (B, C, 1, 1) tensor."""

    def __init__(self, how):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.conv3 = nn.Conv2d(C, C, 3, padding=1)
        self.how = how

    def forward(self, x):
        m = self.conv(x).mean((2, 3), keepdim=True)
        if self.how == "scaled":
            return x * self.drop(m * 2.0)
        if self.how == "view":
            return x * self.drop(m.view(m.shape))
        return x * self.conv3(m * 2.0)


def _derived(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    full, _ = _inputs()
    offs = split_offsets(H, world)
    out = {}
    for how in ("scaled", "view", "conv"):
        torch.manual_seed(0)
        model = convert_to_domain_parallel(DerivedFromMean(how).double())
        try:
            torch.manual_seed(5)
            model(full[..., offs[rank]:offs[rank + 1], :])
            out[how] = None
        except ValueError as exc:
            out[how] = str(exc)
    return out


def test_a_halo_layer_given_a_tensor_computed_from_a_whole_mean_is_refused_on_every_rank():
    """Each rank holds the same copy of ``m * 2.0``: a dropout took the copies for one-row shards and drew a
    different mask on each rank (2.86 off at 3 ranks, 1.43 through a view), silently. Refused on every rank, the
    same message; a dropout of the mean itself draws the unsharded mask
    (tests/test_zoo_pvt.py::test_the_classifier_head_is_exact)."""
    results = run_on_ranks(_derived, 3, timeout=60)
    for how in ("scaled", "view", "conv"):
        errors = {r[how] for r in results}
        assert len(errors) == 1 and None not in errors, (how, errors)
        (text,) = errors
        layer = "conv3 (DomainConv2d)" if how == "conv" else "drop (DomainDropout)"
        assert f"{layer} is given a tensor computed from a whole result only" in text, (how, text)


class FunctionalDropout(nn.Module):
    """``F.dropout`` in a forward of a mean over H, W (computed over the domain by the guard, whole on every rank),
    as timm's ResNet and EfficientNet ``forward_head`` drop their global pool's result; ``derived``: of ``m * 2.0``."""

    def __init__(self, derived=False):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.derived = derived

    def forward(self, x):
        m = self.conv(x).mean((2, 3), keepdim=True)
        return x * F.dropout(m * 2.0 if self.derived else m, 0.5, self.training)


def _functional_dropout(rank, world):
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    full, wts = _inputs()
    offs = split_offsets(H, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(FunctionalDropout().double())
    out = {}
    for call in (0, 1):  # the guarded call, then one the guard's reroute computes
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        torch.manual_seed(5)
        y = model(x)
        (y * wts[..., offs[rank]:offs[rank + 1], :]).sum().backward()
        out[call] = {"out": halo.gather(y.detach()), "grad": halo.gather(x.grad),
                     "params": {n: p.grad.clone() for n, p in model.named_parameters()}}
        model.zero_grad()
    torch.manual_seed(0)
    derived = convert_to_domain_parallel(FunctionalDropout(derived=True).double())
    try:
        derived(full[..., offs[rank]:offs[rank + 1], :])
        out["derived"] = None
    except ValueError as exc:
        out["derived"] = str(exc)
    return out


def test_a_functional_dropout_of_a_whole_mean_draws_the_unsharded_mask():
    """``F.dropout`` of the mean's own result: at 3 ranks, on the guarded call and the next (rerouted), the output,
    input gradient and parameter gradients of the unsharded model drawing halo's one-process mask (a per-rank draw of
    torch's was a different mask on each rank seeded differently, silently). Of ``m * 2.0``: refused on every rank."""
    from _modes import WholeFieldDropout

    results = run_on_ranks(_functional_dropout, 3, timeout=60)
    full, wts = _inputs()
    refs = {}
    for p in (0.5, 0.0):
        torch.manual_seed(0)
        ref = FunctionalDropout().double()
        drop = WholeFieldDropout(p)
        ref.forward = lambda x, ref=ref, drop=drop: x * drop(ref.conv(x).mean((2, 3), keepdim=True))
        x = full.clone().requires_grad_(True)
        torch.manual_seed(5)
        out = ref(x)
        (out * wts).sum().backward()
        refs[p] = out.detach(), x.grad, {n: q.grad for n, q in ref.named_parameters()}
    assert not torch.allclose(refs[0.5][0], refs[0.0][0]), "the dropout changes nothing: the test could not fail"
    out, grad, params = refs[0.5]
    for call in (0, 1):
        for r in results:
            got = r[call]
            assert torch.allclose(got["out"], out, rtol=0, atol=1e-12), (call, (got["out"] - out).abs().max())
            assert torch.allclose(got["grad"], grad, rtol=0, atol=1e-12), (call, (got["grad"] - grad).abs().max())
        for n, want in params.items():
            total = sum(r[call]["params"][n] for r in results)
            assert torch.allclose(total, want, rtol=0, atol=1e-11), (call, n, (total - want).abs().max())
    errors = {r["derived"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    (text,) = errors
    assert "F.dropout" in text and "here it is computed from a whole result" in text, text
