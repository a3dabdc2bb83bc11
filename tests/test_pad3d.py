"""``DomainPad3d`` (halo/nn/pad3d.py): torch's 3-d padding modules on H-shards of a (B, C, D, H, W) field vs the
unsharded module, float64, forward and backward, at odd sizes.

- every class (zero, constant with a value, reflection, replication, circular), asymmetric paddings, a top padding
  wider than a rank's shard (its rows come from ranks further away), negative paddings (a crop), on 3 ranks and
  23 rows (8 + 8 + 7): the output equals the unsharded module's bitwise (a copy of values), the input gradient to
  a few ulps (its adjoint: sums of the copies' gradients, in another order); each case also checks that padding
  each shard on its own (the local path) would differ;
- in a converted model (``convert_to_domain_parallel``: the registry has the class, no other edit): conv3d ->
  reflection pad -> conv3d -> constant pad -> conv3d, forward, input and parameter gradients (summed over the
  domain); the state dict keys are torch's, and ``revert_domain_parallel`` puts the modules back;
- on a 2 x 2 latitude x longitude mesh (W sharded too): every class, the same way;
- bad input (a 3-d tensor, a reflection wider than the field) raises the same clear error on every rank.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import local_range, split_offsets
from halo.testing import run_on_ranks, run_on_ranks_outcomes

D, H, W = 3, 23, 7
SHAPE = (2, 2, D, H, W)

#: (class, padding) cases: asymmetric; top 9 > a rank's 7-8 rows (3 ranks), so rows come from two ranks away;
#: negative amounts crop. Reflection needs every amount below its dim's size (torch's rule on the whole field).
CASES = [
    (nn.ZeroPad3d, (1, 2, 2, 1, 1, 0)),
    (nn.ConstantPad3d, (0, 1, 9, 3, 2, 1)),
    (nn.ConstantPad3d, (-1, 2, -2, 4, 0, -1)),
    (nn.ReflectionPad3d, (1, 2, 2, 1, 1, 2)),
    (nn.ReflectionPad3d, (3, 0, 9, 5, 0, 1)),
    (nn.ReplicationPad3d, (2, 1, 1, 3, 1, 1)),
    (nn.ReplicationPad3d, (0, 0, 9, 10, 0, 0)),
    (nn.CircularPad3d, (1, 1, 3, 2, 1, 0)),
    (nn.CircularPad3d, (2, 0, 0, 9, 0, 2)),
]


def _make(kind, padding):
    return kind(padding, 0.75) if kind is nn.ConstantPad3d else kind(padding)


def _field(seed=1, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rows(t, world, rank):
    offs = split_offsets(t.shape[-2], world)
    return t[..., offs[rank]:offs[rank + 1], :]


def _layer_ranks(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import DomainPad3d

    halo.initialize_domain_parallel(world, world)
    out = []
    for i, (kind, padding) in enumerate(CASES):
        ref = _make(kind, padding)
        full = _field(10 + i).requires_grad_(True)
        want = ref(full)
        g = _field(50 + i, tuple(want.shape))
        (want * g).sum().backward()
        x = _rows(full.detach(), world, rank).clone().requires_grad_(True)
        layer = DomainPad3d(ref)
        y = layer(x)
        (y * _rows(g, world, rank)).sum().backward()
        want_rows = _rows(want.detach(), world, rank)
        try:  # each shard padded on its own: what halo must not do (torch may refuse it: a reflection too wide)
            local = ref(_rows(full.detach(), world, rank))
        except RuntimeError:
            local = None
        out.append({
            "case": f"{kind.__name__}{padding}",
            "y": torch.equal(y, want_rows),
            "gx": (x.grad - _rows(full.grad, world, rank)).abs().max().item(),
            "local_differs": local is None or local.shape != want_rows.shape or not torch.equal(local, want_rows),
            "repr": repr(layer),
        })
    return out


def test_every_3d_padding_equals_the_unsharded_module_on_3_ranks():
    results = run_on_ranks(_layer_ranks, 3, timeout=300)
    for rank, cases in enumerate(results):
        assert len(cases) == len(CASES)
        for c in cases:
            # forward: a copy of values, bitwise; backward: a value copied to several places (reflect and replicate
            # along H, D and W at once) gets its gradients summed in another order than torch's: a few ulps
            assert c["y"] and c["gx"] <= 1e-13, (rank, c)
    for i in range(len(CASES)):  # on some rank, padding the shard alone gives other numbers
        assert any(results[r][i]["local_differs"] for r in range(3)), CASES[i]
    assert "ConstantPad3d, padding=(0, 1, 9, 3, 2, 1), value=0.75" in results[0][1]["repr"]


class Net(nn.Module):
    """conv3d (pads H itself) -> reflection pad -> conv3d (valid) -> constant pad -> conv3d: (2, 2, 3, 23, 7)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(2, 4, 3, padding=1)
        self.pad = nn.ReflectionPad3d((1, 1, 2, 1, 1, 1))
        self.c2 = nn.Conv3d(4, 4, 3)
        self.fill = nn.ConstantPad3d((0, 1, 1, 2, 0, 0), -0.5)
        self.c3 = nn.Conv3d(4, 2, (1, 3, 3), padding=(0, 0, 1))

    def forward(self, x):
        return self.c3(self.fill(torch.tanh(self.c2(self.pad(F.gelu(self.c1(x)))))))


def _model_ranks(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import copy

    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = Net().double()
    dom = convert_to_domain_parallel(copy.deepcopy(ref), manager)
    kinds = {name: type(m).__name__ for name, m in dom.named_children()}
    full = _field(3).requires_grad_(True)
    want = ref(full)
    g = _field(4, tuple(want.shape))
    (want * g).sum().backward()
    x = _rows(full.detach(), world, rank).clone().requires_grad_(True)
    y = dom(x)
    (y * _rows(g, world, rank)).sum().backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    gp = 0.0
    for p, q in zip(dom.parameters(), ref.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        gp = max(gp, (grad - q.grad).abs().max().item() / scale)
    keys = list(dom.state_dict()) == list(ref.state_dict())
    revert_domain_parallel(dom)
    return {"kinds": kinds, "y": (y - _rows(want.detach(), world, rank)).abs().max().item(),
            "gx": (x.grad - _rows(full.grad, world, rank)).abs().max().item(), "gp": gp, "keys": keys,
            "reverted": {name: type(m).__name__ for name, m in dom.named_children()}}


def test_a_converted_model_with_3d_padding_equals_the_unsharded_model():
    # float64, each output row from the same input rows and weights: only the order of the convs' sums and of the
    # domain's gradient sum differs (a few ulps of the largest value)
    for rank, r in enumerate(run_on_ranks(_model_ranks, 3, timeout=300)):
        assert r["kinds"]["pad"] == "DomainPad3d" and r["kinds"]["fill"] == "DomainPad3d", r["kinds"]
        assert r["kinds"]["c2"] == "DomainConv3d", r["kinds"]
        assert r["y"] <= 1e-12 and r["gx"] <= 1e-12 and r["gp"] <= 1e-12, (rank, r)
        assert r["keys"], rank
        assert r["reverted"]["pad"] == "ReflectionPad3d" and r["reverted"]["fill"] == "ConstantPad3d", r["reverted"]


def _mesh_ranks(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    from halo.dist.mesh import DomainMesh
    from halo.nn import DomainPad3d

    mesh = DomainMesh((2, 2))

    def block(t):
        (h0, h1), (w0, w1) = (local_range(t.shape[d], mesh.axis_size(a), mesh.axis_rank(a))
                              for a, d in ((0, -2), (1, -1)))
        return t[..., h0:h1, w0:w1]

    out = {}
    for i, (kind, padding) in enumerate(CASES):
        ref = _make(kind, padding)
        full = _field(20 + i, (2, 2, D, H, 9)).requires_grad_(True)
        want = ref(full)
        g = _field(60 + i, tuple(want.shape))
        (want * g).sum().backward()
        x = block(full.detach()).clone().requires_grad_(True)
        y = DomainPad3d(ref, mesh=mesh)(x)
        (y * block(g)).sum().backward()
        out[f"{kind.__name__}{padding}"] = (torch.equal(y, block(want.detach())),  # as on 3 ranks: see there
                                            (x.grad - block(full.grad)).abs().max().item())
    return out


def test_every_3d_padding_on_a_latitude_x_longitude_mesh():
    for rank, r in enumerate(run_on_ranks(_mesh_ranks, 4, timeout=300)):
        assert all(y and gx <= 1e-13 for y, gx in r.values()), (rank, r)


def _bad_ranks(rank, world, what):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import DomainPad3d

    halo.initialize_domain_parallel(world, world)
    if what == "3d tensor":
        layer, x = DomainPad3d(nn.ZeroPad3d(1)), _rows(_field(1, (2, H, W)), world, rank)
    else:  # a reflection of 23 rows by 23: torch refuses it on the whole field
        layer, x = DomainPad3d(nn.ReflectionPad3d((0, 0, 23, 0, 0, 0))), _rows(_field(1), world, rank)
    layer(x)


@pytest.mark.parametrize(("what", "message"), [
    ("3d tensor", r"expected a \(B, C, D, H, W\) or \(C, D, H, W\) shard, got shape \(2, [78], 7\)"),
    ("reflection too wide", r"reflect boundary reaches 23 rows beyond the edge of an extent of 23 rows; it supports "
                            r"at most 22"),
])
def test_bad_input_raises_on_every_rank(what, message):
    import re

    outcomes = run_on_ranks_outcomes(_bad_ranks, 3, what, timeout=120, pg_timeout=60)
    for rank, (status, payload) in enumerate(outcomes):
        assert status == "error", (rank, status, payload)
        first = payload.splitlines()[0]
        assert first.startswith("ValueError") and re.search(message, first), (rank, first)


def test_the_registry_has_it_with_no_other_edit():
    """The layer is its module and this test: exported, converted, in the docs table and the modes matrix's cases
    by the registry alone."""
    import halo.nn
    from halo.nn.registry import entries, exports

    for kind in (nn.ZeroPad3d, nn.ConstantPad3d, nn.ReflectionPad3d, nn.ReplicationPad3d, nn.CircularPad3d):
        entry = entries()[kind]
        assert entry.halo_class is halo.nn.DomainPad3d and entry.axes == 2 and entry.example is not None
        module, shape = entry.example(kind)
        assert type(module) is kind and shape[-2] % 2 == 1
    assert exports()["DomainPad3d"] is halo.nn.DomainPad3d and "DomainPad3d" in halo.nn.__all__
