"""``torch.compile(model, fullgraph=True)`` of a converted model: default torch settings, gloo ranks, float64.

The model has a strided conv, a transposed conv, GroupNorm, max pooling and bilinear upsampling, with the pole
boundary; it is compiled whole (no graph break is allowed) with ``aot_eager`` on 2 and 3 ranks and ``inductor`` on 3
and called three times: forward and backward must equal the eager converted model's (which the rest of the suite
holds to the unsharded model) to rounding, and the graph must not be recompiled after the first call. The halo
exchange and the fused GroupNorm are custom ops (``halo::exchange``, ``halo::group_norm``) whose fake kernels give
shapes from the plan; the plan is learned at trace time under the epoch that the model's entry agreed on outside
the graph, which the graph guards on. The stride-1 3x3 convs compute-then-patch under compile as in eager
(``halo::exchange_halos``, the halo rows alone): the graph's halo ops are counted (tests/test_compile_patch.py holds
that path to the unsharded model).

Tolerance: the compiled graph may reorder the float64 arithmetic of the local convs and of autograd's sums
(inductor fuses and decomposes), so values agree to ~1e-15 relative, not bitwise: 1e-12 relative.
"""

import pytest
import torch
import torch.nn as nn
from _helpers import SteadyNet

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

#: above the longest rank timeout of this file (cold inductor compiles): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(700)


H, W, C = 45, 16, 3


def _compiled(rank, world, backend):
    import torch._dynamo

    import halo
    from halo.nn import convert_to_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    model = convert_to_domain_parallel(SteadyNet().double(), manager, boundary="pole")
    seen: list[str] = []

    def counting(gm, example_inputs):  # the halo ops of dynamo's graph, then the backend itself
        seen.extend(n.target.name() for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                    and n.target.name().startswith("halo::"))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=counting)
    full = torch.randn(2, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(H, world)
    x = full[..., offs[rank]:offs[rank + 1], :]
    torch._dynamo.utils.counters.clear()
    out = []
    for step in range(3):
        results = {}
        # The compiled model runs first on the first call: its plans are learned while tracing (every rank traces,
        # since every rank meets the same new epoch), not recalled from an eager call.
        for fn in (compiled, model) if step == 0 else (model, compiled):
            xi = (x * (1 + step)).clone().requires_grad_(True)
            y = fn(xi)
            (y * y).sum().backward()
            results[fn is compiled] = (y.detach(), xi.grad, [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        (ye, gxe, gpe), (yc, gxc, gpc) = results[False], results[True]

        def rel(a, b):
            return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()

        out.append({"y": rel(yc, ye), "gx": rel(gxc, gxe), "gp": max(rel(a, b) for a, b in zip(gpc, gpe, strict=True))})
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out, graphs, {op: seen.count(op) for op in ("halo::exchange", "halo::exchange_halos")}


def _compiled_then_sequential(rank, world, backend):
    """The 2-rank aot_eager launch also runs the Sequential root on latitude rows (after ``_compiled``, whose plans
    are then still learned while tracing: the Sequential's shapes are other epochs)."""
    return _compiled(rank, world, backend), _sequential(rank, world, None)


_RUNS: dict = {}


def _results(world, backend):
    if (world, backend) not in _RUNS:
        if (world, backend) == (2, "aot_eager"):
            compiled, sequential = zip(*run_on_ranks(_compiled_then_sequential, world, backend, timeout=600),
                                       strict=True)
            _RUNS[2, "aot_eager"], _RUNS[2, None] = list(compiled), list(sequential)
        else:
            _RUNS[world, backend] = run_on_ranks(_compiled, world, backend, timeout=600)
    return _RUNS[world, backend]


# Inductor at 3 ranks only: its C++ compile is the file's cost (~30-50 s a launch on 2 cores), and 3 ranks hold both
# an edge rank (one neighbour and the pole) and an interior one (two neighbours), the two graphs a 2-rank run traces
# one of; aot_eager traces both world sizes.
@pytest.mark.parametrize(("world", "backend"), [(2, "aot_eager"), (3, "aot_eager"), (3, "inductor")])
def test_compiled_converted_model_equals_eager(world, backend):
    results = _results(world, backend)
    for rank, (steps, graphs, ops) in enumerate(results):
        for step, errs in enumerate(steps):
            assert max(errs.values()) < 1e-12, (rank, step, errs)
        assert graphs == 1, (rank, graphs)  # one graph of the whole forward (fullgraph), reused by later calls
        # The two stride-1 3x3 convs (enc, dec) compute-then-patch (halo::exchange_halos) as eager does; the
        # strided and transposed convs, the pooling and the upsampling exchange the extended shard (halo::exchange).
        assert ops == {"halo::exchange": 4, "halo::exchange_halos": 2}, (rank, ops)


def _sequential(rank, world, mesh_shape):
    import pickle

    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), nn.BatchNorm2d(4), nn.GELU(),
                        nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.MaxPool2d(2),
                        nn.Upsample(scale_factor=4, mode="bilinear"), nn.ConvTranspose2d(4, 3, 3, padding=1)).double()
    full = torch.randn(2, 3, 21, 26, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if mesh_shape is None:
        model = convert_to_domain_parallel(net, halo.initialize_domain_parallel(world, world), boundary="pole")
        x = halo.shard(full)
    else:
        mesh = halo.DomainMesh(mesh_shape, periodic=(False, True))
        model = convert_to_domain_parallel(net, mesh=mesh, boundary="pole")
        x = halo.shard_2d(full, mesh=mesh)
    out = {"repr": repr(model).startswith("Sequential("), "isinstance": isinstance(model, nn.Sequential)}
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (ye, gxe, gpe), (yc, gxc, gpc) = results
    out["err"] = max([float((yc - ye).abs().max()), float((gxc - gxe).abs().max())]
                     + [float((a - b).abs().max()) for a, b in zip(gpc, gpe, strict=True)])
    out["pickles"] = isinstance(pickle.loads(pickle.dumps(model)), nn.Sequential)
    out["reverted"] = type(revert_domain_parallel(model)) is nn.Sequential
    return out


@pytest.mark.parametrize("world, mesh_shape", [(2, None), (4, (2, 2))])
def test_sequential_root_compiles_fullgraph(world, mesh_shape):
    """A converted nn.Sequential (torch traces a torch.nn container's hooks with its call) compiles with
    fullgraph=True, BatchNorm's domain statistics included, on latitude rows and on a latitude x longitude mesh."""
    if mesh_shape is None:
        _results(2, "aot_eager")  # the 2-rank aot_eager launch runs it
        results = _RUNS[2, None]
    else:
        results = run_on_ranks(_sequential, world, mesh_shape, timeout=300)
    for r in results:
        assert r["err"] <= 1e-12, r
        assert r["repr"] and r["isinstance"] and r["pickles"] and r["reverted"], r
