"""The layer base (halo.nn.base): construction, adoption, per-axis plans, the end of a forward.

One process for what needs no peers (adoption, the checks, ``finish``, a compiled layer's plan); 2 and 3 gloo ranks
with uneven rows for the per-axis plans: ``make`` sees every rank's extent along the axis, the H dim and the
per-axis arguments, and a layer written only against the base equals the unsharded op forward and backward.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from halo.nn.base import AxisPlan, DomainLayer, adopt, finish
from halo.testing import run_on_ranks


@dataclasses.dataclass(frozen=True)
class _Plan(AxisPlan):
    sizes: tuple = ()
    arg: int = 0


def _make(cg, sizes, dim, arg, tag):
    return _Plan(cg.size == 1, dim=dim, sizes=sizes, arg=arg * 10 + tag)


class _Probe(DomainLayer, nn.Module):
    """A layer written against the base alone: its plan says what ``make`` saw."""

    def __init__(self, group=None, mesh=None):
        nn.Module.__init__(self)
        self.halo_init(group, mesh)

    def forward(self, x):
        return self.axis_plans(x, "probe", _make, (7,), per_axis=((1,), (2,)))


def test_plans_are_frozen_hashable_constants():
    plan = _Plan(False, 3, 5, 2, (4, 5), 1)
    assert (plan.plain, plan.ex, plan.rows, plan.dim, plan.sizes, plan.arg) == (False, 3, 5, 2, (4, 5), 1)
    assert hash(plan) == hash(_Plan(False, 3, 5, 2, (4, 5), 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = 1


def test_one_process_plan_is_plain_with_the_h_dim_and_the_first_axis_arguments():
    (plan,) = _Probe()(torch.zeros(2, 3, 5, 4))
    assert plan.plain and plan.dim == 2 and plan.sizes == (5,) and plan.arg == 17
    (plan,) = _Probe()(torch.zeros(3, 5, 4))  # unbatched: H is dim 1
    assert plan.dim == 1


def test_site_is_per_instance_and_per_copy():
    a = _Probe()
    b = copy.deepcopy(a)
    assert a._halo_site.id != b._halo_site.id and a.group is None and a.halo_mesh is None


def test_mesh_must_be_a_domain_mesh():
    with pytest.raises(TypeError, match="halo.DomainMesh"):
        _Probe(mesh="2x2")


def test_adopt_shares_parameters_and_keeps_names():
    conv = nn.Conv2d(2, 3, 3)
    hook = conv.register_forward_hook(lambda *a: None)
    layer = nn.Conv2d.__new__(nn.Conv2d)
    adopt(layer, conv, nn.Conv2d)
    assert layer.weight is conv.weight and list(layer.state_dict()) == list(conv.state_dict())
    assert layer._forward_hooks is not conv._forward_hooks and hook.id in layer._forward_hooks
    assert type(layer._forward_hooks) is type(conv._forward_hooks)


class _Custom(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("src, kind, words", [
    (nn.Linear(2, 2), TypeError, "wraps a torch.nn.Conv2d"),
    (_Custom(2, 2, 3), TypeError, "overrides forward"),
    (nn.LazyConv2d(2, 3), ValueError, "lazy"),
])
def test_adopt_refuses_what_it_cannot_make_halo_aware(src, kind, words):
    with pytest.raises(kind, match=words):
        adopt(nn.Conv2d.__new__(nn.Conv2d), src, nn.Conv2d, "DomainConv2d")


def test_adopt_refuses_a_parametrized_layer():
    conv = nn.Conv2d(2, 2, 3)
    parametrize.register_parametrization(conv, "weight", nn.Identity())
    with pytest.raises(TypeError, match="parametrized"):
        adopt(nn.Conv2d.__new__(nn.Conv2d), conv, nn.Conv2d, "DomainConv2d")


def test_finish_keeps_channels_last_and_carries_the_epoch():
    from halo.plan.plans import epoch_of, tag

    x = torch.randn(1, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    tag(x, 12345)
    out = finish(x[:, :, 1:3] * 1, x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert epoch_of(out) == 12345
    pair = (x * 2, x * 3)
    finish(pair, x)
    assert all(epoch_of(t) == 12345 for t in pair)


def test_a_compiled_layer_bakes_its_per_axis_plans_in():
    """The plans are frozen dataclasses returned through ``assume_constant_result``: fullgraph compiles."""
    from halo.nn.shuffle import DomainPixelShuffle, DomainPixelUnshuffle

    x = torch.randn(1, 8, 6, 4)
    for layer, ref in ((DomainPixelShuffle(nn.PixelShuffle(2)), nn.PixelShuffle(2)),
                       (DomainPixelUnshuffle(nn.PixelUnshuffle(2)), nn.PixelUnshuffle(2))):
        assert torch.equal(torch.compile(layer, backend="eager", fullgraph=True)(x), ref(x))


# -- on ranks ------------------------------------------------------------------------------------------------

def _probe_ranks(rank, world, rows):
    import torch.distributed as dist

    import halo
    from halo.plan.partition import local_range

    torch.manual_seed(0)
    full = torch.randn(2, 3, rows, 5, dtype=torch.float64)
    lo, hi = local_range(rows, world, rank)
    (plan,) = _Probe(group=dist.group.WORLD)(full[..., lo:hi, :].clone())
    # a layer built on the base alone (pixel shuffle): torch's forward and backward, bitwise, on uneven rows
    from halo.nn.shuffle import DomainPixelShuffle

    xf = torch.randn(2, 8, rows, 5, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 2, 2 * rows, 10, dtype=torch.float64)
    ref = nn.PixelShuffle(2)(xf)
    ref.backward(gy)
    xs = halo.shard(xf.detach(), dim=-2, group=dist.group.WORLD).requires_grad_(True)
    out = DomainPixelShuffle(nn.PixelShuffle(2), group=dist.group.WORLD)(xs)
    out.backward(halo.shard(gy, dim=-2, group=dist.group.WORLD))
    g = dist.group.WORLD
    return {"plan": (plan.plain, plan.dim, plan.sizes, plan.arg), "out": halo.gather(out.detach(), dim=-2, group=g),
            "ref": ref.detach(), "grad": halo.gather(xs.grad, dim=-2, group=g), "ref_grad": xf.grad}


@pytest.mark.parametrize("world, rows", [(2, 9), (3, 8)])
def test_axis_plans_on_ranks_see_every_rank_extent(world, rows):
    from halo.plan.partition import split_sizes

    results = run_on_ranks(_probe_ranks, world, rows, timeout=120)
    for res in results:
        assert res["plan"] == (False, 2, tuple(split_sizes(rows, world)), 17)
        assert torch.equal(res["out"], res["ref"]) and torch.equal(res["grad"], res["ref_grad"])
