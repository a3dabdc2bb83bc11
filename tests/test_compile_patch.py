"""Compute-then-patch under ``torch.compile`` (issue 33 item 5): a compiled converted model's stride-1 convs take the
patch path, as eager does, not pad-then-conv (a full extended copy of the shard each way).

The halo rows travel through ``halo::exchange_halos`` (only the edge rows are sent; its adjoint
``halo::exchange_halos_adjoint`` sends the halo rows' gradients back); the main conv, the strip conv and the
additions are plain ops the compiler sees. A few 3x3 convs (one circular in W) on 23 rows over 3 ranks, float64,
on latitude rows, on a (3, 1) mesh (its W axis plain), and two 3-d convs (one reflect-padded): forward, input and
parameter gradients equal the unsharded model's, and the graphs are counted — dynamo's graph holds one
``halo::exchange_halos`` per conv and no ``halo::exchange``, AOT's backward one adjoint per conv — so the test fails
if the path falls back. On a (2, 2) mesh (H and W sharded, 23 x 19: uneven both ways) four convs (zeros, circular,
dilated, 3x5) compute-then-patch on both axes: one ``halo::exchange_halos_2d`` a conv (the H rows, the W columns,
then the corners: the W exchange of the H rows) and its adjoint, counted, and in one order on every rank both ways;
across a pole too (``boundary="pole"``, 23 x 18, against the unsharded pole reference: the rows across the pole
rolled by W/2). The op pair is also checked on its own: ``<A x, y> == <x, A^T y>`` summed
over 3 ranks, for three boundaries.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from halo.testing import run_on_ranks

#: above the rank timeout of this file: pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(300)

H, W, B = 23, 10, 2
TOL = 1e-12


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(),
                         nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                         nn.Conv2d(4, 2, 3, padding=1)).double()


def _net2d() -> nn.Module:
    """A latitude x longitude block's convs: zeros (edge sides dead), circular (every side live: the corners wrap),
    dilated (p = 2 on both axes)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(),
                         nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                         nn.Conv2d(4, 3, 3, padding=2, dilation=2), nn.GELU(),
                         nn.Conv2d(3, 2, (3, 5), padding=(1, 2))).double()


def _net_pole() -> nn.Module:
    """Convs converted with ``boundary="pole"`` (latitude across the poles, longitude circular): p = 1 and 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), nn.GELU(),
                         nn.Conv2d(4, 2, 3, padding=2, dilation=2, padding_mode="circular")).double()


def _pole_forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``net`` on the whole field with every conv's rows across the pole the mirrored rows (1, 2, ...) rolled by
    W/2, the longitudes padded circularly (tests/test_pole_patch.py's reference)."""
    for m in net:
        if isinstance(m, nn.Conv2d):
            (ph, pw), n, w = m.padding, x.shape[-2], x.shape[-1]
            north = x.narrow(-2, 1, ph).flip(-2).roll(w // 2, -1)
            south = x.narrow(-2, n - 1 - ph, ph).flip(-2).roll(w // 2, -1)
            x = F.pad(torch.cat([north, x, south], -2), (pw, pw, 0, 0), mode="circular")
            x = F.conv2d(x, m.weight, m.bias, 1, 0, m.dilation)
        else:
            x = m(x)
    return x


def _net3d() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, padding_mode="reflect"), nn.GELU(),
                         nn.Conv3d(3, 2, 3, padding=1)).double()


#: per layout: the net, the full input's shape, the mesh (None: latitude rows), the convs (each patched), the
#: halo-rows exchanges per conv (2-d: the H rows, the W columns, the corners)
LAYOUTS = {"rows": (_net, (B, 3, H, W), None, 3, 1), "mesh": (_net, (B, 3, H, W), (3, 1), 3, 1),
           "3d": (_net3d, (B, 2, 3, H, 6), None, 2, 1)}
#: on 4 ranks: H and W both sharded, odd extents (23 rows as 12 + 11, 19 columns as 10 + 9); across the poles
#: (18 columns: even, to roll by 9)
LAYOUTS_2D = {"mesh2d": (_net2d, (B, 3, H, 19), (2, 2), 4, 1), "pole": (_net_pole, (B, 3, H, 18), (2, 2), 2, 1)}


def _op_names(gm) -> list[str]:
    """The halo ops a graph calls, directly or inside ``with_effects`` (AOT's form of an effectful op), in graph
    order, each with the tensor dim it exchanges (``halo::exchange_halos@3``; bare for ``order_after``)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = list(node.args)
        for i, t in enumerate((node.target, *args)):
            name = getattr(t, "name", None)
            if isinstance(t, torch._ops.OpOverload) and callable(name) and name().startswith("halo::"):
                rest = args[i:]  # the op's own arguments: (x, order, ex_id, dim, ...) for the one-axis ops
                one_axis = not name().startswith(("halo::exchange_halos_2d", "halo::order"))
                dim = rest[3] if one_axis and len(rest) > 3 and isinstance(rest[3], int) else None
                names.append(name() if dim is None else f"{name()}@{dim}")
    return names


def _count(names: list[str], op: str) -> int:
    return sum(n.split("@")[0] == op for n in names)


def _counting_backend(seen: dict):
    """aot_eager, recording the halo ops of dynamo's graph and of AOT's forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(key):
        def compile_graph(gm, example_inputs):
            seen.setdefault(key, []).extend(_op_names(gm))
            return make_boxed_func(gm.forward)
        return compile_graph

    inner = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))

    def backend(gm, example_inputs):
        seen.setdefault("dynamo", []).extend(_op_names(gm))
        return inner(gm, example_inputs)

    return backend


def _model_on_rank(rank, world, layout):
    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.plan.partition import local_range

    net, shape, mesh_shape, _, _ = {**LAYOUTS, **LAYOUTS_2D}[layout]
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = net()
    xf = full.clone().requires_grad_(True)
    yf = _pole_forward(ref, xf) if layout == "pole" else ref(xf)
    g = torch.randn(yf.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (yf * g).sum().backward()
    if mesh_shape is None:
        model = convert_to_domain_parallel(net(), halo.initialize_domain_parallel(world, world))
        group, at = None, (rank, 0)
    else:
        mesh = halo.DomainMesh(mesh_shape, periodic=(False, True))
        model = convert_to_domain_parallel(net(), mesh=mesh, boundary="pole" if layout == "pole" else None)
        group, at = mesh.domain_group, (mesh.axis_rank(0), mesh.axis_rank(1))
    h0, h1 = local_range(H, (mesh_shape or (world,))[0], at[0])
    w0, w1 = local_range(shape[-1], mesh_shape[1], at[1]) if mesh_shape else (0, shape[-1])

    def block(t):
        return t[..., h0:h1, w0:w1]
    seen: dict = {}
    torch._dynamo.reset()  # each layout its own graphs: static shapes (halo's plans are baked in per shape)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=_counting_backend(seen), dynamic=False)
    errs = []
    for _ in range(2):  # the second call reuses the graph
        x = block(full).clone().requires_grad_(True)
        y = compiled(x)
        yd = y.detach()
        (y * block(g)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for t in grads:
            dist.all_reduce(t, group=group)
        model.zero_grad(set_to_none=True)
        errs.append(max([float((yd - block(yf)).abs().max()),
                         float((x.grad - block(xf.grad)).abs().max())] +
                        [float((a - b.grad).abs().max()) for a, b in zip(grads, ref.parameters(), strict=True)]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return errs, seen, graphs


def _runs_on_rank(rank, world):
    return {**{layout: _model_on_rank(rank, world, layout) for layout in LAYOUTS},
            "adjoint": _adjoint_on_rank(rank, world)}


def _runs_2d_on_rank(rank, world):
    return {**{layout: _model_on_rank(rank, world, layout) for layout in LAYOUTS_2D},
            "adjoint": _adjoint_2d_on_rank(rank, world)}


def _adjoint_2d_on_rank(rank, world):
    """``<A x, y>`` and ``<x, A^T y>`` (summed over the mesh) of ``halo::exchange_halos_2d`` (its three outputs
    together), per boundary pair (H, W); p = (2, 1), a 16 x 10 field on (2, 2)."""
    import torch.distributed as dist

    import halo
    from halo.exchange import exchange_halos_2d
    from halo.nn.patch2d import plan_patch_2d
    from halo.plan.partition import split_sizes

    mesh = halo.DomainMesh((2, 2), periodic=(False, True))
    sizes = (split_sizes(16, 2), split_sizes(10, 2))
    groups = (mesh.axis_group(0), mesh.axis_group(1))
    gen = torch.Generator().manual_seed(20 + rank)
    out = {}
    for boundaries in (("zeros", "zeros"), ("reflect", "circular"), ("pole", "circular")):
        plan = plan_patch_2d(groups, sizes, (5, 3), (1, 1), boundaries)
        x = torch.randn(2, 3, sizes[0][mesh.axis_rank(0)], sizes[1][mesh.axis_rank(1)], dtype=torch.float64,
                        generator=gen).requires_grad_(True)
        ax = exchange_halos_2d(x, plan.ex_h, plan.ex_w, plan.ex_c, plan.pad)
        ys = [torch.randn(t.shape, dtype=torch.float64, generator=gen) for t in ax]
        (aty,) = torch.autograd.grad(ax, x, ys)
        dots = torch.stack([sum((a * y).sum() for a, y in zip(ax, ys, strict=True)), (x * aty).sum()])
        dist.all_reduce(dots, group=mesh.domain_group)
        out[boundaries] = (float(dots[0]), float(dots[1]))
    return out


_RUNS: dict = {}


def _results():
    if not _RUNS:
        _RUNS["aot_eager"] = run_on_ranks(_runs_on_rank, 3, timeout=240)
    return _RUNS["aot_eager"]


def _results_2d():
    if "2d" not in _RUNS:
        _RUNS["2d"] = run_on_ranks(_runs_2d_on_rank, 4, timeout=240)
    return _RUNS["2d"]


# aot_eager only (~15 s for the file): inductor's cold compile costs ~100 s a launch on 2 cores; the inductor run of
# tests/test_compile.py takes this path too (its 3x3 convs) and counts it there.
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_patch_path_equals_unsharded(layout):
    for rank, res in enumerate(_results()):
        errs, seen, graphs = res[layout]
        assert max(errs) < TOL, (rank, errs)
        # The patch path, counted: one halo-rows exchange per conv, no extended-shard exchange either way.
        _check_counts(rank, seen, LAYOUTS[layout][3])
        assert graphs == 1, (rank, graphs)  # one graph, reused by the second call


_OPS = {"dynamo": "halo::exchange_halos", "fw": "halo::exchange_halos", "bw": "halo::exchange_halos_adjoint"}
_OPS_2D = {key: op.replace("halos", "halos_2d") for key, op in _OPS.items()}


def _check_counts(rank, seen, count, ops=_OPS):
    for key, op in ops.items():
        assert _count(seen[key], op) == count, (rank, key, seen)
        assert not {"halo::exchange", "halo::exchange_adjoint"} & {n.split("@")[0] for n in seen[key]}, \
            (rank, key, seen)


# H and W sharded (a (2, 2) mesh): one exchange of both axes' halos a conv (rows along H, columns and then the
# corners along W), none of the extended shard's, so a fallback to pad-then-conv fails the count; and the same
# sequence of exchanges on every rank, forward and backward.
@pytest.mark.parametrize("layout", list(LAYOUTS_2D))
def test_compiled_patch_2d_equals_unsharded(layout):
    results = [res[layout] for res in _results_2d()]
    _, _, _, convs, per_conv = LAYOUTS_2D[layout]
    for rank, (errs, seen, graphs) in enumerate(results):
        assert max(errs) < TOL, (rank, errs)
        _check_counts(rank, seen, convs * per_conv, _OPS_2D)
        assert not {"halo::exchange_halos", "halo::exchange_halos_adjoint"} & {n.split("@")[0] for key in _OPS
                                                                             for n in seen[key]}, (rank, seen)
        assert graphs == 1, (rank, graphs)
        for key in _OPS:
            assert seen[key] == results[0][1][key], (rank, key, seen[key], results[0][1][key])


def _adjoint_on_rank(rank, world):
    import torch.distributed as dist

    import halo.exchange as hx
    from halo.plan.partition import local_range

    out = {}
    h0, h1 = local_range(H, world, rank)
    for boundary in ("zeros", "reflect", "circular"):
        gen = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(B, 3, h1 - h0, W, dtype=torch.float64, generator=gen).requires_grad_(True)
        plan = hx._plan_uniform(x, 2, -2, None, boundary, "test")
        ax = hx.exchange_halos(x, plan.ex, (2, 2), 2)
        y = torch.randn(ax.shape, dtype=torch.float64, generator=gen)
        (aty,) = torch.autograd.grad(ax, x, y)
        dots = torch.stack([(ax * y).sum(), (x * aty).sum()])
        dist.all_reduce(dots)
        ext = hx.halo_exchange(x.detach(), 2, -2, boundary=boundary)  # the halos are the extended shard's edges
        same = torch.equal(ax.detach(), torch.cat([ext[..., :2, :], ext[..., -2:, :]], -2))
        out[boundary] = (float(dots[0]), float(dots[1]), same)
    return out


def test_exchange_halos_adjoint_dot_product():
    for rank, res in enumerate(_results()):
        for boundary, (ax_y, x_aty, same) in res["adjoint"].items():
            assert abs(ax_y - x_aty) <= 1e-12 * max(abs(ax_y), 1.0), (rank, boundary, ax_y, x_aty)
            assert same, (rank, boundary)


def test_exchange_halos_2d_adjoint_dot_product():
    for rank, res in enumerate(_results_2d()):
        for boundaries, (ax_y, x_aty) in res["adjoint"].items():
            assert abs(ax_y - x_aty) <= 1e-12 * max(abs(ax_y), 1.0), (rank, boundaries, ax_y, x_aty)
