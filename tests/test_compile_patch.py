"""Compute-then-patch under ``torch.compile`` (issue 33 item 5): a compiled converted model's stride-1 convs take the
patch path, as eager does, not pad-then-conv (a full extended copy of the shard each way).

The halo rows travel through ``halo::exchange_halos`` (only the edge rows are sent; its adjoint
``halo::exchange_halos_adjoint`` sends the halo rows' gradients back); the main conv, the strip conv and the
additions are plain ops the compiler sees. A few 3x3 convs (one circular in W) on 23 rows over 3 ranks, float64,
on latitude rows, on a (3, 1) mesh (its W axis plain), and two 3-d convs (one reflect-padded): forward, input and
parameter gradients equal the unsharded model's, and the graphs are counted — dynamo's graph holds one
``halo::exchange_halos`` per conv and no ``halo::exchange``, AOT's backward one adjoint per conv — so the test fails
if the path falls back. The op pair is also checked on its own: ``<A x, y> == <x, A^T y>`` summed over 3 ranks, for
three boundaries.
"""

import pytest
import torch
import torch.nn as nn

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


def _net3d() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, padding_mode="reflect"), nn.GELU(),
                         nn.Conv3d(3, 2, 3, padding=1)).double()


#: per layout: the net, the full input's shape, the mesh (None: latitude rows), the convs (each patched)
LAYOUTS = {"rows": (_net, (B, 3, H, W), None, 3), "mesh": (_net, (B, 3, H, W), (3, 1), 3),
           "3d": (_net3d, (B, 2, 3, H, 6), None, 2)}


def _op_names(gm) -> list[str]:
    """The halo ops a graph calls, directly or inside ``with_effects`` (AOT's form of an effectful op)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for t in (node.target, *node.args):
            name = getattr(t, "name", None)
            if isinstance(t, torch._ops.OpOverload) and callable(name) and name().startswith("halo::"):
                names.append(name())
    return names


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

    net, shape, mesh_shape, _ = LAYOUTS[layout]
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = net()
    xf = full.clone().requires_grad_(True)
    yf = ref(xf)
    g = torch.randn(yf.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (yf * g).sum().backward()
    h0, h1 = local_range(H, world, rank)
    if mesh_shape is None:
        model = convert_to_domain_parallel(net(), halo.initialize_domain_parallel(world, world))
        group = None
    else:
        mesh = halo.DomainMesh(mesh_shape, periodic=(False, True))
        model = convert_to_domain_parallel(net(), mesh=mesh)
        group = mesh.domain_group
    seen: dict = {}
    torch._dynamo.reset()  # each layout its own graphs: static shapes (halo's plans are baked in per shape)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=_counting_backend(seen), dynamic=False)
    errs = []
    for _ in range(2):  # the second call reuses the graph
        x = full[..., h0:h1, :].clone().requires_grad_(True)
        y = compiled(x)
        yd = y.detach()
        (y * g[..., h0:h1, :]).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for t in grads:
            dist.all_reduce(t, group=group)
        model.zero_grad(set_to_none=True)
        errs.append(max([float((yd - yf[..., h0:h1, :]).abs().max()),
                         float((x.grad - xf.grad[..., h0:h1, :]).abs().max())] +
                        [float((a - b.grad).abs().max()) for a, b in zip(grads, ref.parameters(), strict=True)]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return errs, {k: sorted(v) for k, v in seen.items()}, graphs


def _runs_on_rank(rank, world):
    return {**{layout: _model_on_rank(rank, world, layout) for layout in LAYOUTS},
            "adjoint": _adjoint_on_rank(rank, world)}


_RUNS: dict = {}


def _results():
    if not _RUNS:
        _RUNS["aot_eager"] = run_on_ranks(_runs_on_rank, 3, timeout=240)
    return _RUNS["aot_eager"]


# aot_eager only (~15 s for the file): inductor's cold compile costs ~100 s a launch on 2 cores; the inductor run of
# tests/test_compile.py takes this path too (its 3x3 convs) and counts it there.
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_patch_path_equals_unsharded(layout):
    for rank, res in enumerate(_results()):
        errs, seen, graphs = res[layout]
        assert max(errs) < TOL, (rank, errs)
        # The patch path, counted: one halo-rows exchange per conv, no extended-shard exchange either way.
        ops = {"dynamo": "halo::exchange_halos", "fw": "halo::exchange_halos", "bw": "halo::exchange_halos_adjoint"}
        for key, op in ops.items():
            assert seen[key].count(op) == LAYOUTS[layout][3], (rank, key, seen)
            assert not {"halo::exchange", "halo::exchange_adjoint"} & set(seen[key]), (rank, key, seen)
        assert graphs == 1, (rank, graphs)  # one graph, reused by the second call


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
