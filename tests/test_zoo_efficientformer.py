"""timm's EfficientFormer and EfficientFormerV2 as users run them (issue 32): the ``EfficientFormer`` and
``EfficientFormerV2`` classes themselves at tiny depths and widths, converted with
``halo.nn.convert_to_domain_parallel``. EfficientFormer: two stages, a ``Pooling`` block in each, then ``Flat`` and one
``MetaBlock1d`` whose ``Attention`` attends over all 7 x 7 tokens with its position bias (it becomes
``halo.nn.DomainEfficientFormerAttention``: ring attention, the bias rows of the rank's queries as its mask). V2: four
stages, its stride-2 ``Attention2d`` with talking heads in the third, ``Attention2dDownsample`` and an ``Attention2d``
in the fourth (``halo.nn.DomainEfficientFormerV2Attention2d`` / ``...Attention2dDownsample``), built with the input's
size as ``img_size``.

Each case runs on 2 and 3 gloo ranks in float64 at odd rows (V1: 50 or 53 rows x 55, halved three times to 7 x 7,
split 4/3 and 3/2/2; V2: 61 or 85 rows x 90, whose last stages have 2 or 3 rows), against the unsharded model built
from the same seed: the logits (whole on every rank: the head's mean is the guard's domain mean), the input gradient,
every parameter gradient (summed over the ranks), the BatchNorm running statistics, within 1e-9 of the largest value
of the quantity; ``attention_biases``'s and the talking heads' gradients also within 1e-9 of their own largest value.
The position biases, talking heads and layer scales are drawn at random (timm starts them at 0, near identity and
1e-5, under which the attention barely shows), so a wrong bias row or a per-shard softmax is seen. Cases: train mode
with ring_sdpa's choice at this size (the gathered K/V), the ring itself, eval mode and the head's dropout at 0.5 (V1;
the unsharded mask of the whole pooled tensor on every rank, as tests/test_zoo_pvt.py checks for PVT), and the same
models with the attention made per shard after conversion (each rank's own keys and bias columns), which must
differ. A grid that is
not the bias table's is refused on every rank alike, naming the layer, and so is a V2 layer given by a custom
converter with torch's convs inside; state_dict keys are kept and
``revert_domain_parallel`` gives timm's modules back. One launch per world size (V2's ring, V1's eval and head
dropout at P=3 only: the suite's time).
"""

from __future__ import annotations

import functools

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
WIDTH = 55  # EfficientFormer: -> 28, 14, 7 columns
WIDTH_V2 = 90  # EfficientFormerV2: -> 23, 12, 6 (3 after its stride-2 attention's conv), 3
#: model -> rows per world size. EfficientFormer: 50 -> 25, 13, 7 rows of tokens; 53 -> 27, 14, 7. V2 (its
#: stride-2 attention needs an even third stage, upsampled back): 61 -> 16, 8, 4 (2), 2; 85 -> 22, 11, 6 (3), 3
ROWS = {"v1": {2: 50, 3: 53}, "v2": {2: 61, 3: 85}}
BAD_ROWS = {"v1": 60, "v2": 97}  # v1: 8 rows of tokens, 56 not the table's 49; v2: a third stage of 7 rows, not 6
DROP, SEED = 0.5, 3
#: (model, case) -> what the ranks change: "ring" forces the ring, "eval", "drop" the head's dropout, "local" the
#: per-shard attention
CASES = {("v1", "train"): (), ("v1", "ring"): ("ring",), ("v1", "eval"): ("eval",),
         ("v1", "head dropout"): ("drop",), ("v1", "per shard"): ("local",),
         ("v2", "train"): (), ("v2", "ring"): ("ring",), ("v2", "per shard"): ("local",)}
#: the cases run at P=2 too (the suite's time: V2's ring, V1's eval and head dropout at P=3 only)
AT_2 = (("v1", "train"), ("v1", "ring"), ("v1", "per shard"), ("v2", "train"), ("v2", "per shard"))
ATTENTION = {"v1": ["DomainEfficientFormerAttention"],
             "v2": ["DomainEfficientFormerV2Attention2d", "DomainEfficientFormerV2Attention2dDownsample"]}
BIASES = {"v1": ["stages.1.blocks.2.token_mixer.attention_biases"],
          "v2": ["stages.2.blocks.0.token_mixer.attention_biases", "stages.3.downsample.attn.attention_biases",
                 "stages.3.blocks.0.token_mixer.attention_biases"]}


def _load() -> None:
    """timm alone, after the torchvision stand-in (tests/_thirdparty.py): the zoo's other packages would cost each
    rank seconds more."""
    tp._torchvision_schemas()
    import timm.models.efficientformer  # noqa: F401


def _build(model: str, world: int, drop: float = 0.0) -> nn.Module:
    """Two stages of EfficientFormer (a Pooling block in each, then Flat and one MetaBlock1d), or four of V2 (its
    stride-2 Attention2d in the third, Attention2dDownsample and an Attention2d in the fourth), built with the
    input's size as V2's ``img_size`` (V1's bias table is 7 x 7, whatever it is given)."""
    _load()
    from timm.models.efficientformer import EfficientFormer
    from timm.models.efficientformer_v2 import EfficientFormerV2

    torch.manual_seed(0)
    if model == "v1":
        net = EfficientFormer(depths=(1, 2), embed_dims=(8, 16), downsamples=(False, True), num_vit=1,
                              num_classes=3, drop_rate=drop)
    else:
        net = EfficientFormerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32), img_size=(ROWS[model][world],
                                WIDTH_V2), num_vit=1, num_classes=3, drop_rate=drop)
    with torch.no_grad():
        for name, p in net.named_parameters():
            # timm's zeros (the bias, V2's talking heads are near identity) and 1e-5: the attention would hide
            if name.endswith(("attention_biases", "gamma")) or "talking_head" in name:
                p.normal_(0.0, 1.0)
    return net.double().train()


def _input(model: str, world: int, rows: int | None = None) -> torch.Tensor:
    return torch.randn(2, 3, rows or ROWS[model][world], WIDTH if model == "v1" else WIDTH_V2,
                       dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def _make_local(net: nn.Module) -> None:
    """halo's attention layers of the converted ``net`` with the ring replaced by SDPA over this rank's own keys and
    their bias columns (per shard; V2: in its Attention2d, whose keys are its queries' grid). After conversion,
    which converted their children (a custom converter's result is not entered)."""
    from halo.guard import trusted
    from halo.nn import DomainEfficientFormerAttention, DomainEfficientFormerV2Attention2d

    class LocalEfficientFormerAttention(DomainEfficientFormerAttention):
        def _attend(self, q, k, v, bias, first):
            with trusted():  # (else the guard of the first call would compute this SDPA by the ring)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[..., first:first + k.shape[-2]],
                                                      scale=self.scale)

    class LocalEfficientFormerV2Attention2d(DomainEfficientFormerV2Attention2d):
        def _attend(self, q, k, v, mask, first, scale):
            with trusted():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., first:first + k.shape[-2]],
                                                      scale=scale)

    for m in net.modules():
        if type(m) is DomainEfficientFormerAttention:
            m.__class__ = LocalEfficientFormerAttention
        elif type(m) is DomainEfficientFormerV2Attention2d:
            m.__class__ = LocalEfficientFormerV2Attention2d


def _one(rank: int, world: int, model: str, how: tuple[str, ...], rows: int | None = None) -> dict:
    import halo
    import halo.nn.ring as ring
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel

    net = _build(model, world, DROP if "drop" in how else 0.0)
    if "eval" in how:
        net.eval()
    saved = ring.GATHER_MAX_BYTES
    if "ring" in how:
        ring.GATHER_MAX_BYTES = 0  # every K/V goes round the ring (ring_sdpa reads it per plan)
    try:
        keys = list(net.state_dict())
        custom = None
        if "custom" in how:  # the layer by a custom converter: the converter does not enter it (its children stay)
            from timm.models.efficientformer_v2 import Attention2d

            from halo.nn import DomainEfficientFormerV2Attention2d

            custom = {Attention2d: lambda m, ctx: DomainEfficientFormerV2Attention2d(m, group=ctx.group)}
        convert_to_domain_parallel(net, custom_converters=custom)
        if "local" in how:
            _make_local(net)
        kinds = sorted({type(m).__name__ for m in net.modules() if "Attention" in type(m).__name__})
        full = _input(model, world, rows)
        offs = split_offsets(full.shape[-2], world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        if "drop" in how:
            torch.manual_seed(SEED)
        out = net(x)
        (out * _weights(out.shape)).sum().mul(1.0 if rank == 0 else 0.0).backward()  # whole: rank 0's counts once
        grad = halo.gather(x.grad)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it (and on every rank alike)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    finally:
        ring.GATHER_MAX_BYTES = saved
    result = {"kinds": kinds, "out": out.detach(), "grad": grad, "keys": list(net.state_dict()) == keys,
              "params": {n: p.grad for n, p in net.named_parameters()},
              "buffers": {n: b.clone() for n, b in net.named_buffers() if b.is_floating_point()}}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    revert_domain_parallel(net)  # timm's modules back, with the state trained sharded
    result["reverted"] = not any("Domain" in type(m).__name__ for m in net.modules()) and all(
        torch.equal(v, state[k]) for k, v in net.state_dict().items())
    return result


def _all(rank: int, world: int) -> dict:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # the kernels' torch reference (Triton's interpreter: test_kernels.py)
    _load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    out = {case: _one(rank, world, case[0], how) for case, how in CASES.items() if world == 3 or case in AT_2}
    if world == 3:
        for model, rows in BAD_ROWS.items():
            out[model, "bad rows"] = _one(rank, world, model, (), rows=rows)
        out["v2", "custom"] = _one(rank, world, "v2", ("custom",))
    return out


_RUNS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_all, world, timeout=240)
    return _RUNS[world]


def _reference(model: str, world: int, how: tuple[str, ...]) -> dict:
    """The unsharded model; its head dropout drawing as halo's does in one process (tests/_modes.py). Only "eval"
    and "drop" change it: one per model, world size and those."""
    return _unsharded(model, world, "eval" in how, "drop" in how)


@functools.cache
def _unsharded(model: str, world: int, evaluate: bool, drop: bool) -> dict:
    from _modes import WholeFieldDropout

    how = ("eval",) * evaluate + ("drop",) * drop

    net = _build(model, world, DROP if "drop" in how else 0.0)
    if "eval" in how:
        net.eval()
    if "drop" in how:
        net.head_drop = WholeFieldDropout(DROP)
        torch.manual_seed(SEED)
    x = _input(model, world).requires_grad_(True)
    out = net(x)
    (out * _weights(out.shape)).sum().backward()
    return {"out": out.detach(), "grad": x.grad, "params": dict(net.named_parameters()),
            "buffers": {n: b for n, b in net.named_buffers() if b.is_floating_point()}}


def _buffer_scale(buffers: dict[str, torch.Tensor], name: str) -> float:
    """A running mean that is zero in exact arithmetic (V2's last norm, after BatchNorms) is ~1e-17 either way: its
    rounding is relative to the spread of the data it averages (as tests/test_zoo_real.py)."""
    scale = float(buffers[name].abs().max())
    var = buffers.get(name.removesuffix("running_mean") + "running_var") if name.endswith("running_mean") else None
    return max(scale, float(var.abs().max()) ** 0.5 if var is not None else 0.0) or 1.0


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
        check(f"logits (rank {r})", res["out"], ref["out"], float(ref["out"].abs().max()))
        check(f"input grad (rank {r})", res["grad"], ref["grad"], float(ref["grad"].abs().max()))
        for n, b in ref["buffers"].items():
            check(f"buffer {n} (rank {r})", res["buffers"].get(n), b, _buffer_scale(ref["buffers"], n))
    pscale = max(float(p.grad.abs().max()) for p in ref["params"].values() if p.grad is not None)
    for n, p in ref["params"].items():
        grads = [res["params"][n] for res in results if res["params"][n] is not None]
        got = sum(grads) if grads else None
        check(f"param grad {n}", got, p.grad, pscale)
        # their own scale: what the ring's mask and the talking heads carry (not talking_head1's bias: a constant
        # per head added to every score of a row, which the softmax cancels: its gradient is 0 up to rounding)
        if n.endswith("attention_biases") or "talking_head" in n and not n.endswith("talking_head1.bias"):
            check(f"param grad {n} (its own scale)", got, p.grad, float(p.grad.abs().max()))
    return bad


@pytest.mark.parametrize(("model", "case", "world"), [(*c, w) for w in (2, 3) for c in CASES
                                                      if c[1] != "per shard" and (w == 3 or c in AT_2)])
def test_efficientformer_is_exact(model, case, world):
    results = [r[model, case] for r in _results(world)]
    refused = [r.get("refused") for r in results]
    assert all(r is None for r in refused), refused
    assert all(r["kinds"] == ATTENTION[model] for r in results), results[0]["kinds"]
    assert all(r["keys"] for r in results), "the converted model's state_dict keys changed"
    assert all(r["reverted"] for r in results), "revert_domain_parallel did not give timm's modules and the state"
    ref = _reference(model, world, CASES[model, case])
    assert all(float(ref["params"][n].grad.abs().max()) > 0 for n in BIASES[model])
    bad = _differences(results, ref)
    assert not bad, f"{model} ({case}) at P={world} is SILENTLY different from the unsharded model: {bad}"
    if case == "head dropout":  # the dropout drew: without it the logits differ
        assert not torch.allclose(ref["out"], _reference(model, world, ())["out"]), "the dropout changes nothing"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", list(ROWS))
def test_per_shard_attention_differs(model, world):
    """The same model with each rank attending to its own tokens only (V2: in its Attention2d) differs: the ring is
    what makes the test above pass."""
    results = [r[model, "per shard"] for r in _results(world)]
    assert all(r.get("refused") is None for r in results), results[0].get("refused")
    assert all(any(k.startswith("Local") for k in r["kinds"]) for r in results), results[0]["kinds"]
    bad = _differences(results, _reference(model, world, ()))
    assert bad and max(bad.values()) > LOCAL_OFF, f"{model} at P={world}: the per-shard form is not seen to differ"


def test_a_grid_not_the_bias_tables_is_refused_on_every_rank():
    for model, want in (("v1", ("DomainEfficientFormerAttention (timm.models.efficientformer.Attention) at "
                                "stages.1.blocks.2.token_mixer", "built for 49 tokens", "got 56 over the domain")),
                        ("v2", ("DomainEfficientFormerV2Attention2d (timm.models.efficientformer_v2.Attention2d) at "
                                "stages.2.blocks.0.token_mixer", "its input grid must be (6, 6)",
                                "got (7, 6) over the domain group"))):
        refused = [r[model, "bad rows"].get("refused") for r in _results(3)]
        assert refused[0] is not None and len(set(refused)) == 1, refused
        assert all(w in refused[0] for w in want), refused[0]


def test_the_layer_keeps_the_checkpoint_and_refuses_a_mesh():
    from types import SimpleNamespace

    _load()
    from timm.models.efficientformer import Attention, Flat

    from halo.nn import DomainEfficientFormerAttention
    from halo.nn.efficientformer import efficientformer_adapter

    torch.manual_seed(0)
    attn = Attention(16, key_dim=4, num_heads=2, resolution=(3, 5)).double()
    with torch.no_grad():
        attn.attention_biases.normal_()
    layer = DomainEfficientFormerAttention(attn)
    assert list(layer.state_dict()) == list(attn.state_dict())
    assert layer.attention_biases is attn.attention_biases
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), attn(x), rtol=0, atol=1e-13)  # one process: the ring is SDPA
    layer.eval(), attn.eval()  # (timm's Attention.train returns None: no chaining)
    torch.testing.assert_close(layer(x), attn(x), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match=r"built for 15 tokens .* got 12 over the domain group"):
        layer(x[:, :12])
    mesh = SimpleNamespace(mesh=SimpleNamespace(domain_shape=(2, 2)), group=None)  # a latitude x longitude mesh
    with pytest.raises(ValueError, match="EfficientFormer's attention over all tokens on latitude rows only"):
        efficientformer_adapter(attn)(attn, mesh)
    with pytest.raises(ValueError, match=r"EfficientFormer's Flat \(row-major tokens of the whole grid\) on "
                                         r"latitude rows only"):
        efficientformer_adapter(Flat())(Flat(), mesh)
    from timm.models.efficientformer_v2 import Attention2d, Attention2dDownsample

    for v2 in (Attention2d(16, key_dim=4, num_heads=2), Attention2dDownsample(16, key_dim=4, num_heads=2)):
        with pytest.raises(ValueError, match=f"efficientformer_v2.{type(v2).__name__}: halo converts "
                                             f"EfficientFormerV2's attention over all tokens on latitude rows only"):
            efficientformer_adapter(v2)(v2, mesh)


def test_the_v2_layers_are_timms_in_one_process_and_refuse_an_odd_strided_grid():
    """One process (the ring is SDPA): halo's V2 layers give timm's numbers (the talking heads folded into the
    attention: a reordering of sums), keep the checkpoint, and refuse an input whose stride-2 grid cannot be
    upsampled back to it (the residual sum would fail on some ranks only)."""
    _load()
    from timm.models.efficientformer_v2 import Attention2d, Attention2dDownsample

    from halo.nn import DomainEfficientFormerV2Attention2d, DomainEfficientFormerV2Attention2dDownsample

    torch.manual_seed(0)
    layers = [(Attention2d(16, key_dim=4, num_heads=3, resolution=(6, 5)), (6, 5)),
              (Attention2d(16, key_dim=4, num_heads=3, resolution=(6, 4), stride=2), (6, 4)),
              (Attention2dDownsample(16, key_dim=4, num_heads=3, resolution=(7, 5), out_dim=12), (7, 5))]
    for attn, grid in layers:
        attn = attn.double()  # (in train mode: built so; timm's train() returns None)
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(0.0, 0.5)
        kind = DomainEfficientFormerV2Attention2d if type(attn) is Attention2d else \
            DomainEfficientFormerV2Attention2dDownsample
        layer = kind(attn)
        assert list(layer.state_dict()) == list(attn.state_dict())
        x = torch.randn(2, 16, *grid, dtype=torch.float64)
        torch.testing.assert_close(layer(x), attn(x), rtol=0, atol=1e-12)
    odd = Attention2d(16, key_dim=4, num_heads=2, resolution=(5, 4), stride=2).double()
    with pytest.raises(ValueError, match=r"its input grid must be \(6, 4\) \(its stride-2 grid \(3, 2\) upsampled "
                                         r"by 2.*got \(5, 4\)"):
        DomainEfficientFormerV2Attention2d(odd)(torch.randn(1, 16, 5, 4, dtype=torch.float64))


def test_a_v2_layer_whose_children_are_torchs_is_refused_on_every_rank():
    """Given by a custom converter (whose result the converter does not enter), halo's V2 attention has torch's
    convs and BatchNorms inside: it refuses on its first call, naming them, rather than run them per shard."""
    refused = [r["v2", "custom"].get("refused") for r in _results(3)]
    assert refused[0] is not None and len(set(refused)) == 1, refused
    assert "DomainEfficientFormerV2Attention2d (timm.models.efficientformer_v2.Attention2d) at " \
           "stages.2.blocks.0.token_mixer: its children stride_conv.conv (Conv2d), stride_conv.bn (BatchNorm2d)" \
           in refused[0], refused[0]
    assert "are torch's own" in refused[0] and "convert_to_domain_parallel" in refused[0], refused[0]
