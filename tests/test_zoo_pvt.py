"""Spatial-reduction attention as users run it (issue 32 item 4): timm's ``PyramidVisionTransformerV2`` (its
``pvt_v2.Attention`` with ``sr_ratio`` > 1, fused and explicit softmax, and the ``linear=True`` variant's 7 x 7 pool)
and segmentation_models_pytorch's MiT encoder (``mix_transformer.Attention``, explicit softmax) and ``Segformer``
(whose decoder resizes to a quarter of the input's global rows: ``halo.nn.smp_layers.DomainSegformerDecoder``),
converted with ``halo.nn.convert_to_domain_parallel`` (the attention becomes ``halo.nn.DomainSRAttention``: queries
from the rank's tokens, keys from the halo strided conv's share of the global reduced grid, the ring).

Each runs on 2 and 3 gloo ranks in float64, train mode (dropout and drop-path rates 0), at odd rows where the
token maps are not multiples of ``sr_ratio`` (the convs drop rows, as unsharded), against the unsharded model built
from the same seed: every output, the input gradient and every parameter gradient (summed over the ranks), within
1e-9 of the largest value of the quantity (sums in another order: ~1e-15). The same models with the ring replaced by
SDPA on each rank's own reduced keys (``LOCAL``) must differ: the comparison sees what the ring does. A reduced grid
with fewer rows than ranks is refused on every rank alike, naming the attention. One launch per world size.

PVT-v2 with its classifier head (5 classes): ``forward_head``'s mean over H and W is the guard's domain mean, whole
on every rank, and its ``head_drop`` (halo's ``DomainDropout``) draws that whole tensor's one-process mask alike on
every rank; at head drop rates 0 and 0.5 the logits, gradients and parameter gradients are the unsharded model's (its
dropout drawing as halo's does in one process: tests/_modes.py's ``WholeFieldDropout``), and ranks seeded differently
are refused alike.
"""

from __future__ import annotations

from collections.abc import Callable

import _thirdparty as tp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

_MISSING = tp.missing()
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=f"the zoo's packages are not installed: {_MISSING}"),
              pytest.mark.timeout(300)]

RTOL = 1e-9
LOCAL_OFF = 1e-6


def _pvt(linear: bool = False, fused: bool = True, classes: int = 0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from timm.models.pvt_v2 import PyramidVisionTransformerV2

        model = PyramidVisionTransformerV2(depths=(1, 1, 1), embed_dims=(8, 16, 24), num_heads=(1, 2, 1),
                                           sr_ratios=(4, 2, 1), mlp_ratios=(2, 2, 2), linear=linear,
                                           num_classes=classes, global_pool="avg" if classes else "")
        for m in model.modules():
            if hasattr(m, "fused_attn"):  # timm's switch (TIMM_FUSED_ATTN=0): q @ k^T, softmax, @ v
                m.fused_attn = fused
        return model
    return build


def _mit() -> nn.Module:
    from segmentation_models_pytorch.encoders.mix_transformer import MixVisionTransformerEncoder

    return MixVisionTransformerEncoder(out_channels=[3, 0, 8, 16, 24, 32], embed_dims=[8, 16, 24, 32],
                                       num_heads=[1, 2, 1, 1], mlp_ratios=[2, 2, 2, 2], qkv_bias=True,
                                       depths=[1, 1, 1, 1], sr_ratios=[4, 2, 1, 1])


def _segformer() -> nn.Module:
    import segmentation_models_pytorch as smp

    model = smp.Segformer(encoder_name="mit_b0", encoder_weights=None, classes=2, decoder_segmentation_channels=8)
    model.requires_divisible_input_shape = False  # smp's own switch: a shard's rows need not divide by 32
    return model


def _features(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return model(x)[2:]  # smp's encoder: the input and an empty placeholder, then the four stages


#: name -> (build, rows per world size, call). Token maps: PVT 53 rows -> 14 (sr 4: 3 reduced rows, 2 dropped),
#: 7 (sr 2: 3, 1 dropped); 49 -> 13, 7; MiT 85 -> 22 (5), 11 (5); 69 -> 18 (4), 9 (4); mit_b0 (sr 8, 4, 2) 99 ->
#: 25 (3), 13 (3), 7 (3); 77 -> 20 (2), 10 (2), 5 (2). Segformer's decoder resizes to a quarter of the input's rows
#: (19 of 77: its output has 76), the global quarter on shards (halo.nn.smp_layers.DomainSegformerDecoder)
CASES: dict[str, tuple[Callable[[], nn.Module], dict[int, int], Callable | None]] = {
    "timm.pvt_v2": (_pvt(), {2: 49, 3: 53}, None),
    "timm.pvt_v2(fused_attn off)": (_pvt(fused=False), {2: 49, 3: 53}, None),
    "timm.pvt_v2(linear)": (_pvt(linear=True), {2: 41, 3: 37}, None),
    "smp.MixVisionTransformerEncoder": (_mit, {2: 69, 3: 85}, _features),
    "smp.Segformer(mit_b0)": (_segformer, {2: 77, 3: 99}, None),
}
WIDTH = 32
#: timm's classifier head: forward_head's mean over (H, W) (the guard's domain mean: whole on every rank), then
#: ``head_drop`` (an nn.Dropout, converted: halo's, which draws a whole tensor's mask alike on every rank) and ``head``
HEAD = "timm.pvt_v2(classifier)"
HEADS = {HEAD: (_pvt(classes=5), {2: 49, 3: 53}, None)}
#: the head's dropout rate in the cases that draw (and the seed of torch's generator before each call)
DROP, SEED = 0.5, 3


def _build(name: str) -> nn.Module:
    tp.load()
    torch.manual_seed(0)
    model = {**CASES, **HEADS}[name][0]().double().train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if hasattr(m, "drop_prob"):  # timm's DropPath (mit_b0's rate is 0.1): each run would draw its own
            m.drop_prob = 0.0
    return model


def _call(name: str, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    call = {**CASES, **HEADS}[name][2]
    out = call(model, x) if call is not None else model(x)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _input(name: str, world: int, rows: int | None = None) -> torch.Tensor:
    shape = (2, 3, rows or {**CASES, **HEADS}[name][1][world], WIDTH)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _weights(shape: torch.Size, i: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2 + i))


def _local_sr(m: nn.Module, ctx) -> nn.Module:
    """halo's layer with the ring replaced by SDPA over this rank's own reduced keys (the per-shard attention)."""
    from halo.guard import trusted
    from halo.nn import DomainSRAttention

    class LocalSRAttention(DomainSRAttention):
        def _attend(self, q, k, v):
            with trusted():  # (else the guard of the first call would compute this SDPA by the ring too)
                return F.scaled_dot_product_attention(q, k, v, scale=self.scale)

    return LocalSRAttention(m, group=ctx.group)


def _one(rank: int, world: int, name: str, local: bool, rows: int | None = None, drop: float = 0.0,
         seeds: tuple[int, ...] = ()) -> dict:
    """``drop``: the rate of the head's dropout; ``seeds``: this rank's seed of torch's generator before each of
    that many calls (the last measured: with two, the first is the guarded one and the last the rerouted)."""
    import halo
    from halo.nn import convert_to_domain_parallel

    model = _build(name)
    if drop:
        model.head_drop.p = drop
    custom = None
    if local:
        custom = {type(m): _local_sr for m in model.modules() if type(m).__name__ == "Attention"}
    try:
        convert_to_domain_parallel(model, custom_converters=custom)
        kinds = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        full = _input(name, world, rows)
        offs = split_offsets(full.shape[-2], world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        earlier = []
        for seed in seeds[:-1]:
            torch.manual_seed(seed)
            earlier.append(model(x).detach())
        if seeds:
            torch.manual_seed(seeds[-1])
        outs, loss = [], 0.0
        for i, out in enumerate(_call(name, model, x)):
            if out.dim() >= 3:  # a field: this rank's rows
                whole = halo.gather(out.detach())
                mo = split_offsets(whole.shape[-2], world)
                loss = loss + (out * _weights(whole.shape, i)[..., mo[rank]:mo[rank + 1], :]).sum()
            else:  # whole on every rank (the classifier after the global pool): rank 0 backpropagates it
                whole = out.detach().clone()
                loss = loss + (out * _weights(out.shape, i)).sum() * (1.0 if rank == 0 else 0.0)
            outs.append(whole)
        loss.backward()
        grad = halo.gather(x.grad)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it (and on every rank alike)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    params = {n: p.grad for n, p in model.named_parameters()}
    return {"kinds": kinds, "outs": outs, "grad": grad, "params": params, "earlier": earlier}


def _all(rank: int, world: int) -> dict:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # the kernels' torch reference (Triton's interpreter: test_kernels.py)
    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    out = {(name, local): _one(rank, world, name, local) for name in CASES for local in (False, True)}
    if world == 3:  # PVT at 37 rows: stage 0's 10-row token map has 2 reduced rows (sr 4) for 3 ranks
        out["refused"] = _one(rank, world, "timm.pvt_v2(fused_attn off)", False, rows=37)
    out["head"] = _one(rank, world, HEAD, False)
    out["head", DROP] = _one(rank, world, HEAD, False, drop=DROP, seeds=(SEED, SEED))
    if world == 3:  # a seed per rank: the ranks' generators differ, so would their keys
        out["head", "seed per rank"] = _one(rank, world, HEAD, False, drop=DROP, seeds=(SEED + rank,))
    for name in CHECKED:
        for local in (False, True):
            out[name, local, "check"] = _check(world, name, local)
    return out


#: the cases ``halo.check_equivalence`` is run on too (its verdict must be the truth found above)
CHECKED = ("timm.pvt_v2(fused_attn off)", "timm.pvt_v2(linear)")


def _check(world: int, name: str, local: bool) -> tuple[bool, str]:
    from timm.models.pvt_v2 import Attention

    import halo

    custom = {Attention: _local_sr} if local else None
    try:
        report = halo.check_equivalence(lambda: _build(name), _input(name, world),
                                        convert_kwargs={"custom_converters": custom} if custom else None)
    except Exception as exc:  # noqa: BLE001 - a refusal (the same on every rank): the parent asserts on it
        return False, f"{type(exc).__name__}: {exc}"
    return report.ok, str(report)


_RUNS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_all, world, timeout=240)
    return _RUNS[world]


def _reference(name: str, world: int, drop: float = 0.0) -> dict:
    """The unsharded model; a head dropout of rate ``drop`` > 0 draws as halo's does in one process (tests/_modes.py's
    ``WholeFieldDropout``: each element keyed on its position, the key one draw from torch's generator)."""
    from _modes import WholeFieldDropout

    model = _build(name)
    if drop:
        model.head_drop = WholeFieldDropout(drop)
        torch.manual_seed(SEED)
    x = _input(name, world).requires_grad_(True)
    outs = _call(name, model, x)
    sum((o * _weights(o.shape, i)).sum() for i, o in enumerate(outs)).backward()
    return {"outs": [o.detach() for o in outs], "grad": x.grad, "params": dict(model.named_parameters())}


def _differences(results: list[dict], ref: dict) -> dict[str, float]:
    bad: dict[str, float] = {}

    def check(label: str, got: torch.Tensor | None, want: torch.Tensor, scale: float) -> None:
        if got is None or got.shape != want.shape:
            bad[label] = float("inf")
            return
        err = float((got - want).abs().max()) / max(scale, 1e-300)
        if not err <= RTOL:
            bad[label] = err

    for r, res in enumerate(results):
        for i, (got, want) in enumerate(zip(res["outs"], ref["outs"], strict=True)):
            check(f"output {i} (rank {r})", got, want, float(want.abs().max()))
        check(f"input grad (rank {r})", res["grad"], ref["grad"], float(ref["grad"].abs().max()))
    pscale = max(float(p.grad.abs().max()) for p in ref["params"].values() if p.grad is not None)
    for n, p in ref["params"].items():
        grads = [res["params"][n] for res in results if res["params"][n] is not None]
        check(f"param grad {n}", sum(grads) if grads else None, p.grad, pscale)
    return bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_sr_attention_is_exact(name, world):
    results = [r[name, False] for r in _results(world)]
    refused = [r.get("refused") for r in results]
    assert all(r is None for r in refused), refused
    assert all(r["kinds"] == ["DomainSRAttention"] for r in results), results[0]["kinds"]
    bad = _differences(results, _reference(name, world))
    assert not bad, f"{name} at P={world} is SILENTLY different from the unsharded model: {bad}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_per_shard_attention_differs(name, world):
    """The same model with each rank attending to its own reduced keys only differs: the ring is what makes the
    test above pass."""
    results = [r[name, True] for r in _results(world)]
    assert all(r.get("refused") is None for r in results), results[0].get("refused")
    assert all(r["kinds"] == ["LocalSRAttention"] for r in results), results[0]["kinds"]
    bad = _differences(results, _reference(name, world))
    assert bad and max(bad.values()) > LOCAL_OFF, f"{name} at P={world}: the per-shard form is not seen to differ"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", CHECKED)
def test_check_equivalence_agrees(name, world):
    """``halo.check_equivalence`` says what the comparison above found: OK for the ring, a difference for the
    per-shard attention."""
    for local in (False, True):
        verdicts = [r[name, local, "check"] for r in _results(world)]
        assert all(v == verdicts[0] for v in verdicts), f"{name} at P={world}: ranks disagree"
        ok, text = verdicts[0]
        assert ok is (not local), f"{name} at P={world} ({'per-shard' if local else 'ring'}): {text}"


def test_too_few_reduced_rows_is_refused_on_every_rank():
    refused = [r["refused"].get("refused") for r in _results(3)]
    assert refused[0] is not None and len(set(refused)) == 1, refused
    msg = refused[0]
    assert "DomainSRAttention (timm.models.pvt_v2.Attention) at stages.0.blocks.0.attn" in msg, msg
    assert "kernel 4, stride 4" in msg and "ranks [2] would get no rows" in msg, msg


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop", [0.0, DROP])
def test_the_classifier_head_is_exact(world, drop):
    """PVT-v2's ``forward_head``: a mean over H and W (the guard's domain mean, whole on every rank), then its
    ``head_drop`` (converted to halo's ``DomainDropout``, which knows the whole tensor: at a rate > 0 every rank draws
    the unsharded mask of it) and its ``head`` (a Linear on the whole tensor). The logits are the same on every rank
    and the unsharded model's (dropping half of them at ``DROP``: a mask drawn per rank, or per shard, would differ),
    on the guarded first call and the rerouted second; the input and parameter gradients too."""
    results = [r["head", drop] if drop else r["head"] for r in _results(world)]
    refused = [r.get("refused") for r in results]
    assert all(r is None for r in refused), refused
    ref = _reference(HEAD, world, drop)
    logits = ref["outs"][0]
    assert logits.shape == (2, 5), logits.shape
    if drop:
        kept = _reference(HEAD, world)["outs"][0]
        assert not torch.allclose(logits, kept), "the head's dropout changes nothing: the test could not fail"
        for r, res in enumerate(results):  # the guarded first call
            (first,) = res["earlier"]
            assert torch.allclose(first, logits, rtol=0, atol=RTOL * float(logits.abs().max())), (r, first, logits)
    bad = _differences(results, ref)
    assert not bad, f"{HEAD} (head dropout {drop}) at P={world} is SILENTLY different from the unsharded model: {bad}"


def test_a_head_dropout_with_a_seed_per_rank_is_refused_on_every_rank():
    """The ranks' generators differ (``torch.manual_seed(seed + rank)``): their keys, so their masks of the whole
    tensor, would differ; every rank raises alike, naming the fix."""
    refused = [r["head", "seed per rank"].get("refused") for r in _results(3)]
    assert refused[0] is not None and len(set(refused)) == 1, refused
    assert "halo.random.dropout: the domain ranks' torch random generators (cpu) are in different states" \
        in refused[0], refused[0]
    assert "halo.random.manual_seed" in refused[0], refused[0]


def test_the_layer_keeps_the_checkpoint_and_refuses_attention_dropout_and_a_mesh():
    from types import SimpleNamespace

    tp.load()
    from timm.models.pvt_v2 import Attention

    from halo.nn import DomainConv2d, DomainSRAttention
    from halo.nn.sr_attention import sr_attention_adapter

    torch.manual_seed(0)
    attn = Attention(8, num_heads=2, sr_ratio=2, attn_drop=0.1)
    layer = DomainSRAttention(attn)
    assert list(layer.state_dict()) == list(attn.state_dict())
    assert isinstance(layer.sr, DomainConv2d) and layer.sr.weight is attn.sr.weight
    x = torch.randn(1, 4 * 6, 8)
    with pytest.raises(ValueError, match=r"attention dropout in training \(attn_drop=0.1\)"):
        layer(x, (4, 6))
    layer.eval()  # one process: the ring is SDPA, the layer the original
    torch.testing.assert_close(layer(x, (4, 6)), attn.eval()(x, [4, 6]))
    with pytest.raises(ValueError, match=r"expected this rank's tokens \(B, H_r \* W, C\) with H_r \* W = 4 \* 5"):
        layer(x, (4, 5))
    mesh = SimpleNamespace(mesh=SimpleNamespace(domain_shape=(2, 2)), group=None)  # a latitude x longitude mesh
    with pytest.raises(ValueError, match="spatial-reduction attention on latitude rows only"):
        sr_attention_adapter(attn)(attn, mesh)
