"""Bad input gets the same clear error on every rank, never a hang and never silence (invariants 4 and 8,
docs/design.md).

The mechanism of the zoo's diffusers ``UNet2DModel`` at P=2 (tests/test_zoo_real.py), in tiny hand-made models:

- a U-Net level of an odd number of rows, halved (stride 2) and doubled again (nearest x2), concatenated with its
  skip: 37 rows give 19 + 18 and 38 + 37 rows; the unsharded model raises at the ``cat`` (38 vs 37), the converted
  one must refuse it on every rank at the same ``cat`` (rank 0 holds 19 + 19, rank 1 19 + 18: a local ``torch.cat``
  would raise on rank 1 alone and leave rank 0 waiting in the next layer's exchange); 38 rows are exact;
- a field whose 1-row shard broadcasts over another field's rows on some ranks (3 rows = 2 + 1 against 4 = 2 + 2:
  rank 1 adds its 1 row to 2 rows and no rank sees two different row counts): the unsharded model raises, the
  converted one must refuse it on every rank instead of computing something (the guard's rule for pointwise ops on
  fields split differently; needs /tmp/briefs/B_guard.patch);
- an op torch itself refuses on one rank only (the same cat with an odd W: W 5 -> 3 -> 6 differs on every rank,
  H only on rank 1): the guard used to run the op before the ranks agreed on it, so rank 0 raised torch's error
  alone; the op's error must become that rank's part of the agreement (needs /tmp/briefs/B_guard.patch);
- a layer given a tensor of another number of dims on one rank only (``DomainConv2d``, a global adaptive pool on a
  latitude x longitude mesh; ``DomainGroupNorm``, ``DomainPad2d``, ``DomainPixelShuffle``, ``halo_interpolate`` with
  /tmp/briefs/B_prechecks.patch): the layer's shape checks run after the agreement, so every rank raises the same
  ``ValueError`` naming the ranks and shapes (before, the odd rank raised alone and the others waited).

Each multi-rank case runs with ``halo.set_timeout(10)`` under a 90-second bound on the whole run: a hang fails.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

TIMEOUT = 10  # halo.set_timeout in the ranks: a rank left waiting raises HaloCommError within it


class _Level(nn.Module):
    """One U-Net level: a conv, a stride-2 conv down, nearest x2 up, the skip concatenated, a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.tanh(self.enc(x))
        y = self.up(torch.tanh(self.down(skip)))
        return self.dec(torch.cat([y, skip], dim=1))


class _Broadcast(nn.Module):
    """``a + x`` where ``a`` (a 2-row conv) has one row fewer than ``x``: a 1-row shard of ``a`` broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, (2, 3), padding=(0, 1))
        self.out = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.out(self.conv(x) + x)


_MODELS = {"level": _Level, "broadcast": _Broadcast}


def _outcome(fn):
    try:
        return {"ok": fn()}
    except (ValueError, RuntimeError) as exc:  # HaloCommError is a RuntimeError: a rank that waited alone
        return {"error": f"{type(exc).__name__}: {exc}"}


def _model_case(rank, world, name, rows, width):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(TIMEOUT)
    torch.manual_seed(0)
    model = _MODELS[name]().double()
    ref = _MODELS[name]().double()
    ref.load_state_dict(model.state_dict())
    convert_to_domain_parallel(model)
    full = torch.randn(2, 2, rows, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(rows, world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    unsharded = _outcome(lambda: ref(full).shape)

    def step():
        out = model(x)
        got = halo.gather(out.detach())
        out.sum().backward()
        return got, halo.gather(x.grad)

    res = {"unsharded": unsharded, "sharded": _outcome(step)}
    if "ok" in res["sharded"] and "ok" in unsharded:
        xf = full.clone().requires_grad_(True)
        want = ref(xf)
        want.sum().backward()
        got, grad = res["sharded"].pop("ok")
        res["sharded"]["err"] = max((got - want.detach()).abs().max().item(), (grad - xf.grad).abs().max().item())
    return res


def _run(world, name, rows, width=6):
    return run_on_ranks(_model_case, world, name, rows, width, timeout=90)


def _same_error_everywhere(results, *needles):
    errors = [r["sharded"].get("error") for r in results]
    assert errors[0] is not None, f"the converted model ran where the unsharded one raises: {results}"
    assert len(set(errors)) == 1, f"the ranks ended differently: {errors}"
    assert errors[0].startswith("ValueError"), errors[0]  # a clear refusal, not a rank timing out (HaloCommError)
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def test_unet_level_of_another_extent_is_refused_on_every_rank():
    """37 rows at P=2: the unsharded model raises at the cat (38 vs 37 rows), the converted one at the same cat."""
    results = _run(2, "level", 37)
    assert all("Sizes of tensors must match" in r["unsharded"]["error"] for r in results), results
    _same_error_everywhere(results, "torch.cat([y, skip], dim=1)", "[18, 19]")


def test_an_op_torch_refuses_on_one_rank_only_is_refused_on_every_rank():
    """37 x 5: the cat's W extents differ too (6 vs 5), which torch refuses on rank 0, where H agrees (19 + 19); the
    guard runs the op before the ranks agree on it, so rank 0 raised alone and rank 1 waited (needs the guard patch:
    the op's own error becomes this rank's part of the agreement)."""
    results = _run(2, "level", 37, 5)
    assert all("Sizes of tensors must match" in r["unsharded"]["error"] for r in results), results
    _same_error_everywhere(results, "torch.cat([y, skip], dim=1)", "torch raises on this rank's shard")


@pytest.mark.parametrize("world", [2, 3])
def test_unet_level_the_unsharded_model_takes_is_exact(world):
    """38 rows (uneven at the halved level: 10 + 9, 7 + 6 + 6) run and equal the unsharded model."""
    results = _run(world, "level", 38)
    assert all(r["sharded"].get("err", 1.0) <= 1e-12 for r in results), results


@pytest.mark.parametrize("world,rows", [(2, 4), (3, 5)])
def test_one_row_shard_broadcasting_over_a_field_is_refused_on_every_rank(world, rows):
    """3 rows (2 + 1) + 4 rows (2 + 2), and 4 (2 + 1 + 1) + 5 (2 + 2 + 1): each rank's own shapes broadcast (no
    rank sees two row counts above 1), the unsharded op raises; the guard must refuse it on every rank."""
    results = _run(world, "broadcast", rows)
    assert all("must match the size" in r["unsharded"]["error"] for r in results), results
    _same_error_everywhere(results, "self.conv(x) + x", "split differently",
                           f"global extents along H differ ({rows - 1} vs {rows} rows), so the unsharded model raises")


class _BroadcastW(nn.Module):
    """:class:`_Broadcast` along W: ``a + x`` where ``a`` (a conv whose kernel is 2 columns wide) has one column
    fewer than ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, (3, 2), padding=(1, 0))
        self.out = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.out(self.conv(x) + x)


def _w_case(rank, world, cols):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(TIMEOUT)
    torch.manual_seed(0)
    model, ref = _BroadcastW().double(), _BroadcastW().double()
    ref.load_state_dict(model.state_dict())
    convert_to_domain_parallel(model, halo.DomainMesh((1, world)))
    full = torch.randn(2, 2, 5, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(cols, world)
    x = full[..., offs[rank]:offs[rank + 1]].clone()
    return {"unsharded": _outcome(lambda: ref(full).shape), "sharded": _outcome(lambda: model(x).shape)}


@pytest.mark.parametrize("world,cols", [(2, 4), (3, 5)])
def test_one_column_shard_broadcasting_over_a_field_is_refused_on_every_rank(world, cols):
    """The same along W on a 1 x P latitude x longitude mesh (3 columns = 2 + 1 against 4 = 2 + 2; 4 = 2 + 1 + 1
    against 5 = 2 + 2 + 1): the guard's pointwise check ran on H alone, so this ran and returned a result where the
    unsharded op raises; it must be refused on every rank."""
    results = run_on_ranks(_w_case, world, cols, timeout=90)
    assert all("must match the size" in r["unsharded"]["error"] for r in results), results
    _same_error_everywhere(results, "self.conv(x) + x", "acts on W", "split differently")


class _OnePerRank(nn.Module):
    """``a + b``: ``a`` a 2x pool of 6 (3 = 2 + 1 at P=2), ``b`` a stride-3 conv of 6 (2 = 1 + 1): on every rank
    ``b``'s shard has 1 row (or column, ``axis=-1``), which looks like a tensor that broadcasts (a bias), so no rank
    saw two counts above 1 and the check across ranks saw nothing either; the unsharded op raises (3 vs 2)."""

    def __init__(self, axis: int = -2, via: str = "plain") -> None:
        super().__init__()
        k = (2, 1) if axis == -2 else (1, 2)
        self.a = nn.MaxPool2d(k)
        self.b = nn.Conv2d(2, 2, (3, 1) if axis == -2 else (1, 3), stride=(3, 1) if axis == -2 else (1, 3))
        self.via = _VIA[via]

    def forward(self, x):
        return self.a(x) + self.via(self.b(x))


#: Routes from the layer's 1-row field to the ``+`` that the guard follows (layout ops, reductions and slices over
#: channels): the result is still the layer's field, never a broadcast (each was silent before).
_VIA = {
    "plain": lambda b: b,
    "permute and back": lambda b: b.permute(0, 1, 3, 2).permute(0, 1, 3, 2),
    "view": lambda b: b.view(b.shape[0], b.shape[1], b.shape[2], b.shape[3]),
    "unsqueeze, squeeze": lambda b: b.unsqueeze(0).squeeze(0),
    "mean over channels": lambda b: b.mean(1, keepdim=True),
    "a slice of channels": lambda b: b[:, :1],
}


def _one_per_rank_case(rank, world, axis):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(TIMEOUT)
    full = torch.randn(2, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(6, world)
    x = full.narrow(axis, offs[rank], offs[rank + 1] - offs[rank]).clone()
    results = {}
    for via in _VIA:
        torch.manual_seed(0)
        model, ref = _OnePerRank(axis, via).double(), _OnePerRank(axis, via).double()
        ref.load_state_dict(model.state_dict())
        convert_to_domain_parallel(model, halo.DomainMesh((1, world)) if axis == -1 else None)
        results[via] = {"unsharded": _outcome(lambda m=ref: m(full).shape),
                        "sharded": _outcome(lambda m=model: m(x).shape)}
    return results


@pytest.mark.parametrize("axis", [-2, -1])
def test_a_layer_field_of_one_row_a_rank_is_no_broadcast(axis):
    """A halo layer's output of 1 row (column) on every rank against a field of another extent: it ran, silently,
    where the unsharded op raises; the guard knows the layers' outputs are fields (halo.context.made), and so are the
    results of the layout ops, reductions and slices over channels it follows from them, so it refuses it on every
    rank, by every route of :data:`_VIA`."""
    results = run_on_ranks(_one_per_rank_case, 2, axis, timeout=90)
    for via in _VIA:
        runs = [r[via] for r in results]
        assert all("must match the size" in r["unsharded"]["error"] for r in runs), (via, runs)
        _same_error_everywhere(runs, "self.a(x) + self.via(self.b(x))", "split differently")


# -- layers given a tensor of another number of dims on one rank ------------------------------------------------

def _ndim_case(rank, world, layer):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import (
        DomainAdaptiveAvgPool2d,
        DomainConv2d,
        DomainGroupNorm,
        DomainPad2d,
        DomainPixelShuffle,
        halo_interpolate,
    )

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(TIMEOUT)
    torch.manual_seed(0)
    good = torch.randn(1, 4, 5, 4, dtype=torch.float64)  # 5 + 5 rows: the balanced split of 10
    bad = {"1-d": torch.randn(5, dtype=torch.float64), "3-d": good[0], "5-d": good[None]}[_BAD[layer][0]]
    module = {
        "conv": lambda: DomainConv2d(nn.Conv2d(4, 4, 3, padding=1).double()),
        "norm": lambda: DomainGroupNorm(nn.GroupNorm(2, 4).double()),
        "pad": lambda: DomainPad2d(nn.ZeroPad2d(1)),
        "shuffle": lambda: DomainPixelShuffle(nn.PixelShuffle(2)),
        "interpolate": lambda: lambda t: halo_interpolate(t, scale_factor=2.0),
        # a global pool of blocks of a latitude x longitude mesh
        "mesh_global_pool": lambda: DomainAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d(1), mesh=halo.DomainMesh((1, world))),
    }[layer]()
    x = bad if rank == 0 else good
    return _outcome(lambda: module(x).shape)


#: layer -> (what rank 0 passes, what every rank must raise); rank 1 passes a (1, 4, 5, 4) shard.
_BAD = {"conv": ("1-d", "dim -2 is out of range for a 1-d tensor"),
        "norm": ("1-d", "dim -2 is out of range for a 1-d tensor"),
        "pad": ("5-d", "disagree on the number of dims"),
        "shuffle": ("3-d", "disagree on the number of dims"),
        "interpolate": ("3-d", "disagree on the number of dims"),
        "mesh_global_pool": ("3-d", "disagree on the number of dims")}


@pytest.mark.parametrize("layer", list(_BAD))
def test_a_shape_one_rank_alone_gets_wrong_is_refused_on_every_rank(layer):
    """conv and mesh_global_pool: fixed in halo/nn/conv.py and pool.py; norm, pad, shuffle and interpolate need
    /tmp/briefs/B_prechecks.patch (their checks move after the agreement)."""
    results = run_on_ranks(_ndim_case, 2, layer, timeout=90)
    errors = [r.get("error") for r in results]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError"), errors[0]
    assert _BAD[layer][1] in errors[0], errors[0]


def test_one_process_shape_errors_are_unchanged():
    """Without peers the same checks raise the same errors (here: the agreement of one rank)."""
    from halo.nn import DomainConv2d

    conv = DomainConv2d(nn.Conv2d(2, 2, 3, padding=1))
    with pytest.raises(ValueError, match="dim -2 is out of range for a 1-d tensor"):
        conv(torch.randn(5))
    with pytest.raises(ValueError, match="expected 2 input channels"):
        conv(torch.randn(1, 3, 5, 4))
    assert conv(torch.randn(1, 2, 5, 4)).shape == F.conv2d(torch.randn(1, 2, 5, 4), conv.weight, padding=1).shape
