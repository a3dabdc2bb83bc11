"""timm's EfficientFormer as users run it (issue 32): the ``EfficientFormer`` class itself at tiny depths and widths
(two stages, a ``Pooling`` block in each, then ``Flat`` and one ``MetaBlock1d`` whose ``Attention`` attends over all
7 x 7 tokens with its position bias), converted with ``halo.nn.convert_to_domain_parallel``: the attention becomes
``halo.nn.DomainEfficientFormerAttention`` (ring attention, the bias rows of the rank's queries as its mask).

Each case runs on 2 and 3 gloo ranks in float64 at odd rows and width (50 or 53 rows x 55: the stem and the
downsample halve them three times, to 7 x 7, split 4/3 and 3/2/2), against the unsharded model built from the same
seed: the logits (whole on every rank: the head's mean over the tokens is the guard's domain mean), the input
gradient, every parameter gradient (summed over the ranks) and the BatchNorm running statistics, within 1e-9 of the
largest value of the quantity; ``attention_biases``'s gradient also within 1e-9 of its own largest value. The model's
position bias and layer scales are drawn at random (timm starts them at 0 and 1e-5, under which the attention
barely shows), so a wrong bias row or a per-shard softmax is seen. Cases: train mode with ring_sdpa's choice at this
size (the gathered K/V), the ring itself, eval mode, the head's dropout at 0.5 (the unsharded mask of the whole
pooled tensor on every rank, as tests/test_zoo_pvt.py checks for PVT), and the same model with the attention made
per shard (each rank's own keys and bias columns), which must differ. A last stage whose token count is not the bias
table's is refused on every rank alike, naming the layer. One launch per world size.
"""

from __future__ import annotations

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
ROWS = {2: 50, 3: 53}  # -> 25/27, 13/14, 7 rows of tokens
WIDTH = 55  # -> 28, 14, 7 columns
BAD_ROWS = 60  # -> 8 rows of tokens: 56, not the table's 49
DROP, SEED = 0.5, 3
#: case -> what the ranks change: ("ring",) forces the ring, ("eval",), ("drop",) the head's dropout, ("local",)
CASES = {"train": (), "ring": ("ring",), "eval": ("eval",), "head dropout": ("drop",), "per shard": ("local",)}


def _load() -> None:
    """timm alone, after the torchvision stand-in (tests/_thirdparty.py): the zoo's other packages would cost each
    rank seconds more."""
    tp._torchvision_schemas()
    import timm.models.efficientformer  # noqa: F401


def _build(drop: float = 0.0) -> nn.Module:
    _load()
    from timm.models.efficientformer import EfficientFormer

    torch.manual_seed(0)
    model = EfficientFormer(depths=(1, 2), embed_dims=(8, 16), downsamples=(False, True), num_vit=1, num_classes=3,
                            drop_rate=drop)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attention_biases", "gamma")):  # timm's zeros and 1e-5: the attention would hide
                p.normal_(0.0, 1.0)
    return model.double().train()


def _input(world: int, rows: int | None = None) -> torch.Tensor:
    return torch.randn(2, 3, rows or ROWS[world], WIDTH, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def _local(m: nn.Module, ctx) -> nn.Module:
    """halo's layer with the ring replaced by SDPA over this rank's own keys and bias columns (per shard)."""
    from halo.guard import trusted
    from halo.nn import DomainEfficientFormerAttention

    class LocalEfficientFormerAttention(DomainEfficientFormerAttention):
        def _attend(self, q, k, v, bias, first):
            with trusted():  # (else the guard of the first call would compute this SDPA by the ring)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[..., first:first + q.shape[-2]],
                                                      scale=self.scale)

    return LocalEfficientFormerAttention(m, group=ctx.group)


def _one(rank: int, world: int, how: tuple[str, ...], rows: int | None = None) -> dict:
    import halo
    import halo.nn.ring as ring
    from halo.nn import convert_to_domain_parallel

    model = _build(DROP if "drop" in how else 0.0)
    if "eval" in how:
        model.eval()
    custom = None
    if "local" in how:
        from timm.models.efficientformer import Attention

        custom = {Attention: _local}
    saved = ring.GATHER_MAX_BYTES
    if "ring" in how:
        ring.GATHER_MAX_BYTES = 0  # every K/V goes round the ring (ring_sdpa reads it per plan)
    try:
        keys = list(model.state_dict())
        convert_to_domain_parallel(model, custom_converters=custom)
        kinds = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        full = _input(world, rows)
        offs = split_offsets(full.shape[-2], world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        if "drop" in how:
            torch.manual_seed(SEED)
        out = model(x)
        (out * _weights(out.shape)).sum().mul(1.0 if rank == 0 else 0.0).backward()  # whole: rank 0's counts once
        grad = halo.gather(x.grad)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it (and on every rank alike)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    finally:
        ring.GATHER_MAX_BYTES = saved
    return {"kinds": kinds, "out": out.detach(), "grad": grad, "keys": list(model.state_dict()) == keys,
            "params": {n: p.grad for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}}


def _all(rank: int, world: int) -> dict:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # the kernels' torch reference (Triton's interpreter: test_kernels.py)
    _load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    out = {case: _one(rank, world, how) for case, how in CASES.items()}
    if world == 3:
        out["bad rows"] = _one(rank, world, (), rows=BAD_ROWS)
    return out


_RUNS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RUNS:
        _RUNS[world] = run_on_ranks(_all, world, timeout=240)
    return _RUNS[world]


def _reference(world: int, how: tuple[str, ...]) -> dict:
    """The unsharded model; its head dropout drawing as halo's does in one process (tests/_modes.py)."""
    from _modes import WholeFieldDropout

    model = _build(DROP if "drop" in how else 0.0)
    if "eval" in how:
        model.eval()
    if "drop" in how:
        model.head_drop = WholeFieldDropout(DROP)
        torch.manual_seed(SEED)
    x = _input(world).requires_grad_(True)
    out = model(x)
    (out * _weights(out.shape)).sum().backward()
    return {"out": out.detach(), "grad": x.grad, "params": dict(model.named_parameters()),
            "buffers": {n: b for n, b in model.named_buffers() if b.is_floating_point()}}


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
            check(f"buffer {n} (rank {r})", res["buffers"].get(n), b, float(b.abs().max()) or 1.0)
    pscale = max(float(p.grad.abs().max()) for p in ref["params"].values() if p.grad is not None)
    for n, p in ref["params"].items():
        grads = [res["params"][n] for res in results if res["params"][n] is not None]
        got = sum(grads) if grads else None
        check(f"param grad {n}", got, p.grad, pscale)
        if n.endswith("attention_biases"):  # its own scale: the bias rows each rank's queries read
            check(f"param grad {n} (its own scale)", got, p.grad, float(p.grad.abs().max()))
    return bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [c for c in CASES if c != "per shard"])
def test_efficientformer_is_exact(case, world):
    results = [r[case] for r in _results(world)]
    refused = [r.get("refused") for r in results]
    assert all(r is None for r in refused), refused
    assert all(r["kinds"] == ["DomainEfficientFormerAttention"] for r in results), results[0]["kinds"]
    assert all(r["keys"] for r in results), "the converted model's state_dict keys changed"
    ref = _reference(world, CASES[case])
    assert float(ref["params"]["stages.1.blocks.2.token_mixer.attention_biases"].grad.abs().max()) > 0
    bad = _differences(results, ref)
    assert not bad, f"EfficientFormer ({case}) at P={world} is SILENTLY different from the unsharded model: {bad}"
    if case == "head dropout":  # the dropout drew: without it the logits differ
        assert not torch.allclose(ref["out"], _reference(world, ())["out"]), "the head's dropout changes nothing"


@pytest.mark.parametrize("world", [2, 3])
def test_per_shard_attention_differs(world):
    """The same model with each rank attending to its own tokens only differs: the ring is what makes the test
    above pass."""
    results = [r["per shard"] for r in _results(world)]
    assert all(r.get("refused") is None for r in results), results[0].get("refused")
    assert all(r["kinds"] == ["LocalEfficientFormerAttention"] for r in results), results[0]["kinds"]
    bad = _differences(results, _reference(world, ()))
    assert bad and max(bad.values()) > LOCAL_OFF, f"P={world}: the per-shard form is not seen to differ"


def test_a_token_count_not_the_bias_tables_is_refused_on_every_rank():
    refused = [r["bad rows"].get("refused") for r in _results(3)]
    assert refused[0] is not None and len(set(refused)) == 1, refused
    msg = refused[0]
    assert "DomainEfficientFormerAttention (timm.models.efficientformer.Attention) at " \
           "stages.1.blocks.2.token_mixer" in msg, msg
    assert "built for 49 tokens" in msg and "got 56 over the domain group" in msg, msg


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
