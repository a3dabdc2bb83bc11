"""DomainConv2d / DomainConv3d / DomainConvTranspose2d on gloo ranks vs the unsharded layer in the same process.

Every rank builds the same layer and full field from one seed, runs the halo layer on its H-shard and the plain
layer on the whole field, and returns its errors and parameter gradients; the parent asserts (all ranks seen).
Loss: ``sum(out * w)`` with ``w`` drawn for the full output and sliced, so the input gradient of each shard is
comparable row by row and the parameter gradients *summed over ranks* equal the unsharded ones.

Tolerances (float64): forward and input gradient 1e-12 (abs, and relative to the largest value). Each output
row is computed by exactly one rank from exactly the input rows the unsharded conv reads, with the same
weights, so only the order of the sums inside the conv kernel can differ; but the local conv runs on a tensor
of another size than the reference, and CPU conv kernels (mkldnn / im2col + gemm) block their reductions by
shape, so the last bit is not promised. Observed on torch 2.13 CPU (2 and 3 ranks): 1/2 to 2/3 of the Conv2d
forwards, nearly all Conv3d and compute-then-patch forwards, ~10 % of transposed-conv forwards and few input
gradients are bitwise equal; the largest difference is < 1e-15 of the largest value (a few ulps).
Parameter gradients: 1e-12 too; they are sums over rows split between ranks, added in the parent in another
order, so bitwise equality is not expected there.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.nn.conv import DomainConv2d, DomainConv3d, DomainConvTranspose2d, conv_row_plan, conv_transpose_row_plan
from halo.testing import run_on_ranks

TOL = {"rtol": 1e-12, "atol": 1e-12}
MODES = ["zeros", "reflect", "replicate", "circular"]
BUILD = {"conv2d": (nn.Conv2d, DomainConv2d), "conv3d": (nn.Conv3d, DomainConv3d),
         "convT2d": (nn.ConvTranspose2d, DomainConvTranspose2d)}


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread in this process: on a loaded 2-core machine two spinning threads make a tiny
    float64 conv ~200x slower (40 ms instead of 0.2 ms). The rank processes already run one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(((got - want).abs() <= TOL["atol"] + TOL["rtol"] * want.abs()).all())


# -- reference -------------------------------------------------------------------------------------------------

def _pad_h(x: torch.Tensor, before: int, after: int, boundary: str) -> torch.Tensor:
    """Pad H (dim -2) of the full field by ``boundary`` (the modes the layers default to, and the poles)."""
    if boundary in ("pole", "pole_centered"):
        k, shift, n = (1 if boundary == "pole" else 0), x.shape[-1] // 2, x.shape[-2]
        north = x.narrow(-2, k, before).flip(-2).roll(shift, -1)
        south = x.narrow(-2, n - k - after, after).flip(-2).roll(shift, -1)
        return torch.cat([north, x, south], dim=-2)
    flat = x.reshape(-1, *x.shape[-3:])  # F.pad's non-constant modes take up to 4-d for a 2-d pad
    mode = "constant" if boundary == "zeros" else boundary
    out = F.pad(flat, (0, 0, before, after), mode=mode)
    return out.reshape(*x.shape[:-2], *out.shape[-2:])


def _reference(conv: nn.Module, x: torch.Tensor, boundary: str | None) -> torch.Tensor:
    """The unsharded layer, or (with a boundary override) H padded by that boundary, then the same conv."""
    if boundary is None:
        return conv(x)
    rp = list(conv._reversed_padding_repeated_twice)  # (W lo, W hi, H lo, H hi[, D lo, D hi])
    x = _pad_h(x, rp[2], rp[3], boundary)
    rp[2] = rp[3] = 0
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, rp, mode=mode)
    fn = F.conv3d if isinstance(conv, nn.Conv3d) else F.conv2d
    return fn(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


# -- rank side ---------------------------------------------------------------------------------------------

def _one(rank: int, world: int, case: dict) -> dict:
    gen = torch.Generator().manual_seed(case["seed"])
    torch.manual_seed(case["seed"])
    layers = [BUILD[case["kind"]][0](**kw).double() for kw in case["layers"]]
    full = torch.randn(case["shape"], generator=gen, dtype=torch.float64)
    halos = [BUILD[case["kind"]][1](layer, boundary=case.get("boundary"), **case.get("halo_kw", {}))
             for layer in layers]
    params = [p for layer in layers for p in layer.parameters()]

    xf = full.clone().requires_grad_(True)
    ref = xf
    for layer in layers:
        ref = _reference(layer, ref, case.get("boundary")) if case["kind"] != "convT2d" \
            else layer(ref, case.get("output_size"))
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), [xf, *params])

    x = full.tensor_split(world, -2)[rank].clone().requires_grad_(True)
    out = x
    for halo in halos:
        out = halo(out) if case["kind"] != "convT2d" else halo(out, case.get("output_size"))
    want = ref.detach().tensor_split(world, -2)[rank]
    grads = torch.autograd.grad((out * w.tensor_split(world, -2)[rank]).sum(), [x, *params])
    want_gx = ref_grads[0].tensor_split(world, -2)[rank]
    same_shape = out.shape == want.shape
    res = {
        "shape": (tuple(out.shape), tuple(want.shape)),
        "fwd_err": (out.detach() - want).abs().max().item() if same_shape else float("inf"),
        "fwd_bitwise": same_shape and torch.equal(out.detach(), want),
        "gx_err": (grads[0] - want_gx).abs().max().item(),
        "gx_bitwise": torch.equal(grads[0], want_gx),
        "scale": max(want.abs().max().item(), want_gx.abs().max().item(), 1.0),
        # numpy, not tensors: torch pickles tensors between processes as shared-memory handles, which die
        # with the rank process before the parent unpickles them
        "param_grads": [g.numpy() for g in grads[1:]],
    }
    if rank == 0:
        res["ref_param_grads"] = [g.numpy() for g in ref_grads[1:]]
    return res


def _rank_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    os.environ["TRITON_INTERPRET"] = "0"  # torch reference pack/unpack: the interpreter is tested elsewhere
    import halo

    halo.initialize_domain_parallel(world, world)
    out = []
    for case in cases:
        try:
            out.append(_one(rank, world, case))
        except ValueError as exc:
            if not case.get("error"):
                raise
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


# -- cases -----------------------------------------------------------------------------------------------

KERNELS = [1, 3, 4, 5, (3, 5), (2, 3)]
PADDINGS = [0, 1, (2, 1), "same", "valid"]


def _grid2d(world: int, h: int) -> list[dict]:
    """Kernel x stride x dilation x padding, cycling padding_mode, groups and bias through the grid."""
    cases = []
    combos = [c for c in itertools.product(KERNELS, (1, 2, 3), (1, 2), PADDINGS) if c[3] != "same" or c[1] == 1]
    for i, (k, s, d, pad) in enumerate(combos):
        kw = dict(in_channels=4, out_channels=6, kernel_size=k, stride=s, dilation=d, padding=pad,
                  padding_mode=MODES[i % 4], groups=1 + (i // 4) % 2, bias=(i // 8) % 2 == 0)
        cases.append({"group": "grid2d", "kind": "conv2d", "layers": [kw], "shape": (2, 4, h, 12),
                      "seed": 1000 * world + i})
    return cases


def _pole_and_overlap(world: int, h: int) -> list[dict]:
    cases = []
    for i, (boundary, k, s, mode) in enumerate(itertools.product(
            ("pole", "pole_centered"), (3, (4, 3), 5), (1, 2), ("zeros", "circular"))):
        kw = dict(in_channels=4, out_channels=4, kernel_size=k, stride=s, padding=(k if isinstance(k, int) else 3) // 2,
                  padding_mode=mode, groups=2 if i % 3 == 0 else 1, bias=i % 2 == 0)
        cases.append({"group": "pole", "kind": "conv2d", "layers": [kw], "shape": (1, 4, h, 12),
                      "boundary": boundary, "seed": 5000 + i})
    # compute-then-patch: every eligible geometry, every H boundary (padding_mode zeros), and forced ineligible
    # ones (stride 2, even kernel, reflect) that must fall back to pad-then-conv.
    geoms = [(3, 1, 1), (3, 2, "same"), (5, 1, 2), ((3, 5), 1, "same"), ((5, 3), 2, (4, 2)), (4, 1, "same"),
             (3, 1, 0)]
    for i, ((k, d, pad), boundary) in enumerate(itertools.product(geoms, (None, "reflect", "circular", "pole",
                                                                          "replicate"))):
        kw = dict(in_channels=4, out_channels=6, kernel_size=k, dilation=d, padding=pad, groups=1 + i % 2,
                  bias=i % 3 != 0)
        cases.append({"group": "overlap", "kind": "conv2d", "layers": [kw], "shape": (2, 4, h, 12),
                      "boundary": boundary, "halo_kw": {"overlap": True}, "seed": 6000 + i})
    for i, (s, mode) in enumerate([(2, "zeros"), (1, "reflect")]):
        kw = dict(in_channels=4, out_channels=4, kernel_size=3, stride=s, padding=1, padding_mode=mode)
        cases.append({"group": "overlap", "kind": "conv2d", "layers": [kw], "shape": (1, 4, h, 12),
                      "halo_kw": {"overlap": True}, "seed": 6500 + i})
    return cases


def _conv3d(world: int, h: int) -> list[dict]:
    cases = []
    geoms = [(3, 1, 1, 1), ((3, 4, 3), (1, 2, 1), (1, 1, 2), "valid"), ((1, 5, 3), 1, (1, 2, 1), "same"),
             ((2, 3, 3), (2, 3, 1), 1, (0, 2, 1)), (3, 1, 1, "same")]
    for i, ((k, s, d, pad), mode) in enumerate(itertools.product(geoms, MODES)):
        kw = dict(in_channels=4, out_channels=2, kernel_size=k, stride=s, dilation=d, padding=pad,
                  padding_mode=mode, groups=2 if i % 2 else 1, bias=i % 3 != 1)
        cases.append({"group": "conv3d", "kind": "conv3d", "layers": [kw], "shape": (1, 4, 4, h, 10),
                      "seed": 7000 + i, "halo_kw": {"overlap": i % 4 == 0}})
    cases.append({"group": "conv3d", "kind": "conv3d", "layers": [dict(in_channels=4, out_channels=2,
                  kernel_size=3, padding=1)], "shape": (1, 4, 4, h, 10), "boundary": "pole", "seed": 7100})
    return cases


def _transpose(world: int, h: int) -> list[dict]:
    cases = []
    combos = list(itertools.product((1, 2, 3, 4, 5, (3, 5)), (1, 2, 3), (1, 2), (0, 1, 2)))
    for i, (k, s, d, p) in enumerate(combos):
        op = (i % max(s, d))  # output_padding < max(stride, dilation)
        kw = dict(in_channels=4, out_channels=6, kernel_size=k, stride=s, dilation=d, padding=p,
                  output_padding=op, groups=1 + i % 2, bias=i % 3 != 2)
        cases.append({"group": "transpose", "kind": "convT2d", "layers": [kw], "shape": (1, 4, h, 7),
                      "seed": 8000 + i})
    # output_size= is the global size: 2*h (stride 2, kernel 3, padding 1: h*2 - 1 or h*2)
    kw = dict(in_channels=4, out_channels=2, kernel_size=3, stride=2, padding=1)
    cases.append({"group": "transpose", "kind": "convT2d", "layers": [kw], "shape": (2, 4, h, 7),
                  "output_size": [2 * h, 14], "seed": 8900})
    return cases


def _chain(world: int, h: int) -> list[dict]:
    """Stride 2 then stride 1 (with an even kernel): the second layer's input is the first's output split."""
    a = dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1)
    b = dict(in_channels=6, out_channels=4, kernel_size=(4, 3), padding="same", padding_mode="circular")
    c = dict(in_channels=6, out_channels=4, kernel_size=5, dilation=2, padding=2)
    return [{"group": "chain", "kind": "conv2d", "layers": [a, b], "shape": (2, 4, h, 12), "seed": 9000},
            {"group": "chain", "kind": "conv2d", "layers": [a, c], "shape": (2, 4, h, 12), "seed": 9001},
            {"group": "chain", "kind": "conv2d", "layers": [dict(in_channels=4, out_channels=4, kernel_size=3,
             stride=2), dict(in_channels=4, out_channels=4, kernel_size=3, padding=1)], "shape": (1, 4, h, 12),
             "seed": 9002, "halo_kw": {"overlap": True}}]


def _unbatched(world: int, h: int) -> list[dict]:
    return [{"group": "unbatched", "kind": "conv2d", "shape": (4, h, 12), "seed": 9500,
             "layers": [dict(in_channels=4, out_channels=2, kernel_size=3, padding=1, padding_mode="reflect")]},
            {"group": "unbatched", "kind": "convT2d", "shape": (4, h, 6), "seed": 9501,
             "layers": [dict(in_channels=4, out_channels=2, kernel_size=4, stride=2, padding=1)]}]


#: world -> H of the field (odd, and not a multiple of the world size)
WORLDS = {2: 37, 3: 45, 4: 37}


@functools.cache
def _results(world: int) -> tuple[list[dict], list[list[dict]]]:
    """All cases of one world size in one run_on_ranks call. Three ranks (H = 45 over 3: 15 each, and strided
    outputs uneven) run the whole grid; 2 and 4 ranks every other case of the two big grids, to keep time."""
    h = WORLDS[world]
    grid, transpose = _grid2d(world, h), _transpose(world, 13 + world)
    if world != 3:
        grid, transpose = grid[world % 4 // 2::2], transpose[world % 4 // 2::2]
    cases = (grid + _pole_and_overlap(world, h) + _conv3d(world, h) + transpose + _chain(world, h)
             + _unbatched(world, h))
    return cases, run_on_ranks(_rank_cases, world, cases, timeout=600)


def _check(cases: list[dict], results: list[list[dict]], group: str) -> int:
    world, checked = len(results), 0
    for i, case in enumerate(cases):
        if case["group"] != group:
            continue
        per_rank = [results[r][i] for r in range(world)]
        for r, res in enumerate(per_rank):
            assert res["shape"][0] == res["shape"][1], (case, r, res["shape"])
            assert res["fwd_err"] <= TOL["atol"] * res["scale"], (case, r, res["fwd_err"])
            assert res["gx_err"] <= TOL["atol"] * res["scale"], (case, r, res["gx_err"])
        ref = per_rank[0]["ref_param_grads"]
        for j, want in enumerate(ref):
            got = torch.from_numpy(sum(res["param_grads"][j] for res in per_rank))
            want = torch.from_numpy(want)
            assert _close(got, want), (case, j, (got - want).abs().max().item())
        checked += 1
    assert checked
    return checked


@pytest.mark.parametrize("world", sorted(WORLDS))
@pytest.mark.parametrize("group", ["grid2d", "pole", "overlap", "conv3d", "transpose", "chain", "unbatched"])
def test_halo_conv_matches_unsharded(world, group):
    cases, results = _results(world)
    _check(cases, results, group)


# -- halos from further ranks, more ranks than rows per shard ----------------------------------------------------

def _far_cases() -> list[dict]:
    cases = []
    geoms = [(5, 3, "same", 1), (5, 3, 0, 1), (5, 3, (6, 2), 2), (3, 5, 5, 1), ((7, 3), 2, (6, 1), 3)]
    for i, ((k, d, pad, s), mode) in enumerate(itertools.product(geoms, MODES)):
        if pad == "same" and s != 1:
            continue
        kw = dict(in_channels=2, out_channels=2, kernel_size=k, dilation=d, padding=pad, stride=s,
                  padding_mode=mode, bias=i % 2 == 0)
        cases.append({"group": "far", "kind": "conv2d", "layers": [kw], "shape": (1, 2, 37, 14), "seed": 100 + i})
    kw = dict(in_channels=2, out_channels=2, kernel_size=5, dilation=3, padding=6)
    cases.append({"group": "far", "kind": "conv2d", "layers": [kw], "shape": (1, 2, 37, 14), "boundary": "pole",
                  "seed": 150})
    cases.append({"group": "far", "kind": "conv2d", "layers": [kw], "shape": (1, 2, 37, 14), "seed": 151,
                  "halo_kw": {"overlap": True}})  # ineligible (shards of 5 rows < 2 * 6): falls back
    for i, (k, s, d) in enumerate([(5, 1, 3), (4, 3, 2), (7, 2, 1)]):
        kw = dict(in_channels=2, out_channels=2, kernel_size=k, stride=s, dilation=d, padding=1)
        cases.append({"group": "far", "kind": "convT2d", "layers": [kw], "shape": (1, 2, 9, 5), "seed": 160 + i})
    # more ranks than output rows: every rank raises the same ValueError before any point-to-point call
    cases.append({"group": "error", "kind": "conv2d", "error": True, "shape": (1, 2, 13, 6), "seed": 170,
                  "layers": [dict(in_channels=2, out_channels=2, kernel_size=5, stride=3)]})
    return cases


def test_halo_from_further_ranks_seven_ranks():
    cases = _far_cases()
    results = run_on_ranks(_rank_cases, 7, cases, timeout=600)
    assert _check(cases, results, "far") == len(cases) - 1
    errors = {results[r][-1]["error"] for r in range(7)}
    assert len(errors) == 1, errors
    msg = errors.pop()
    assert msg.startswith("ValueError") and "3 rows" in msg and "[3, 4, 5, 6]" in msg, msg


# -- pure row arithmetic, many configurations in one process -----------------------------------------------

def test_row_plans_match_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        p, k, s, d = rng.randint(1, 7), rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 3)
        n = rng.randint(p, 40)
        sizes = [len(t) for t in torch.arange(n).tensor_split(p)]
        pad = (rng.randint(0, 6), rng.randint(0, 6))
        m = (n + sum(pad) - d * (k - 1) - 1) // s + 1
        if m < p:
            with pytest.raises(ValueError):
                conv_row_plan(sizes, k, s, d, pad)
        else:
            outs, needs = conv_row_plan(sizes, k, s, d, pad)
            offs = [0, *itertools.accumulate(outs)]
            for r, (lo, hi) in enumerate(needs):
                rows = {o * s - pad[0] + j * d for o in range(offs[r], offs[r + 1]) for j in range(k)}
                assert (lo, hi) == (min(rows), max(rows) + 1)
        pt, op = rng.randint(0, 3), rng.randint(0, max(s, d) - 1)
        m = (n - 1) * s - 2 * pt + d * (k - 1) + op + 1
        if m < p:
            with pytest.raises(ValueError):
                conv_transpose_row_plan(sizes, k, s, d, pt, op)
            continue
        outs, needs = conv_transpose_row_plan(sizes, k, s, d, pt, op)
        assert sum(outs) == m
        offs = [0, *itertools.accumulate(outs)]
        for r, (lo, hi) in enumerate(needs):
            reach = {i for i in range(-k * d - 2, n + k * d + 2) for j in range(k)
                     if offs[r] <= i * s - pt + j * d < offs[r + 1]}
            assert reach <= set(range(lo, hi)) and hi > lo
            if reach:
                assert (lo, hi) == (min(reach), max(reach) + 1)


# -- one process: plain conv, wrapping, errors -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["conv2d", "conv3d", "convT2d"])
def test_single_process_equals_plain_layer(kind, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pole path packs rows: use the torch reference
    torch.manual_seed(0)
    plain, halo_cls = BUILD[kind]
    nd = 3 if kind == "conv3d" else 2
    for k, s, mode in itertools.product((1, 3, 4), (1, 2), MODES):
        if kind == "convT2d":
            layer, mode = plain(4, 6, k, stride=s, padding=1, groups=2), "zeros"
        else:
            layer = plain(4, 6, k, stride=s, padding=1, padding_mode=mode, groups=2)
        layer = layer.double()
        x = torch.randn(2, 4, *(5,) * (nd - 2), 11, 8, dtype=torch.float64)
        assert torch.equal(halo_cls(layer)(x), layer(x))
        assert torch.equal(halo_cls(layer, overlap=True)(x) if kind != "convT2d" else halo_cls(layer)(x), layer(x))
        if kind == "conv2d":
            assert _close(halo_cls(layer, boundary="pole")(x), _reference(layer, x, "pole"))


def test_wrapping_keeps_parameters_and_state_dict():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(4, 2, 2, stride=2),
                          nn.Conv3d(2, 2, 3))
    before = model.state_dict()
    params = list(model.parameters())
    model[0] = DomainConv2d(model[0], boundary="pole")
    model[2] = DomainConvTranspose2d(model[2])
    model[3] = DomainConv3d(model[3], overlap=False)
    after = model.state_dict()
    assert list(before) == list(after) and all(before[k] is after[k] or torch.equal(before[k], after[k])
                                               for k in before)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    model.load_state_dict(before)
    assert "boundary='pole'" in repr(model[0])
    plain = model[0].to_conv()
    assert type(plain) is nn.Conv2d and plain.weight is model[0].weight
    # built like nn.Conv2d: fresh parameters, same keys
    fresh = DomainConv2d(3, 4, (3, 5), stride=2, padding="valid", bias=False, group=None)
    assert list(fresh.state_dict()) == ["weight"] and fresh.kernel_size == (3, 5)
    # a deep copy (EMA) shares the process group, which cannot be copied
    class Uncopyable:
        def __deepcopy__(self, memo):
            raise RuntimeError("process groups cannot be copied")
    wrapped = DomainConv2d(nn.Conv2d(2, 2, 3), group=Uncopyable())
    twin = copy.deepcopy(wrapped)
    assert twin.group is wrapped.group and twin.weight is not wrapped.weight
    assert torch.equal(twin.weight, wrapped.weight)


def test_errors_name_expected_and_got():
    with pytest.raises(TypeError, match="Conv2d, got Conv3d"):
        DomainConv2d(nn.Conv3d(2, 2, 3))
    with pytest.raises(TypeError, match="ConvTranspose2d, got Conv2d"):
        DomainConvTranspose2d(nn.Conv2d(2, 2, 3))
    with pytest.raises(TypeError, match="only group="):
        DomainConv2d(nn.Conv2d(2, 2, 3), 5)

    class Custom(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="overrides forward"):
        DomainConv2d(Custom(2, 2, 3))
    with pytest.raises(ValueError, match="unknown boundary"):
        DomainConv2d(nn.Conv2d(2, 2, 3), boundary="mirror")
    with pytest.raises(ValueError, match="boundary must be None or 'zeros'"):
        DomainConvTranspose2d(nn.ConvTranspose2d(2, 2, 3), boundary="circular")
    layer = DomainConv2d(nn.Conv2d(2, 2, 3))
    with pytest.raises(ValueError, match="expected a 4-d .* got 5-d"):
        layer(torch.randn(1, 2, 3, 5, 5))
    with pytest.raises(ValueError, match="expected 2 input channels .* got 3"):
        layer(torch.randn(1, 3, 5, 5))
    with pytest.raises(ValueError, match="expected a 5-d"):
        DomainConv3d(nn.Conv3d(2, 2, 3))(torch.randn(2, 5, 5))
