"""The real model zoo: timm, segmentation_models_pytorch, diffusers and NCAR CREDIT's own classes (tiny widths,
``pretrained=False`` / ``encoder_weights=None``; builders in ``tests/_thirdparty.py``), converted unchanged by
``convert_to_domain_parallel`` on 2 and 3 gloo ranks with uneven rows.

Each model is exact or refused with its reason asserted — never silent. Float64, train mode (dropout rates 0: halo's
dropouts draw by global index, not torch's draws): the forward (every output tensor), the input gradient, the
parameter gradients (summed over ranks) and the buffers (BatchNorm running statistics) against the unsharded model
built from the same seed in the parent process. A sharded output (3+ dims) is gathered along the rows; a whole
output (a classifier's ``(B, classes)`` after a global pool, the same on every rank) is compared on every rank, and
only rank 0 backpropagates its weights (the ranks' gradients of a whole result are partial: halo's global pools sum
them). Tolerance: 1e-9 relative to the largest value of the compared quantity (sums in another order are ~1e-15; the
silent differences this guards against were 1e-6 to 1).

The ranks run halo's kernels through their torch reference (``TRITON_INTERPRET=0``: the interpreter's kernels are
tested against it in test_kernels.py and would make this file minutes slower). One ``run_on_ranks`` per world size
runs the whole zoo inside the ranks (once per session, by the first test of that size), and each model's verdict is its
own test.
``VERDICTS`` says what each model must give; a model whose converted result differs without an error fails, whatever
its entry says.
"""

from __future__ import annotations

import re
import time
import traceback

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

_MISSING = tp.missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"the zoo's packages are not installed: {_MISSING} (the "
                                                       f"install commands are in tests/_thirdparty.py)")

RTOL = 1e-9

#: name -> what the converted model must give: "exact", or a tuple of substrings one of which the refusal on every
#: rank must contain. ``("exact", "...")``: exact or refused naming that (models that depend on the guard's
#: default-deny rule for an op their attention uses).
VERDICTS: dict[str, tuple[str, ...]] = {
    "timm.resnet": ("exact",),
    "timm.convnext": ("exact",),
    "timm.efficientnet": ("exact",),
    "timm.tf_efficientnet": ("exact",),
    "timm.mobilenetv3": ("exact",),
    "timm.fastvit": ("exact",),  # fastvit.Attention on (B, C, H, W): its F.scaled_dot_product_attention by ring_sdpa
    "timm.regnet": ("exact",),
    "timm.mobilevit": ("exact",),  # its MobileVitBlock: whole patch rows, ring attention (halo.nn.mobilevit)
    # its LinearSelfAttention: a softmax over all patches and a sum over them, computed over the domain by the guard
    "timm.mobilevitv2": ("exact",),
    "timm.repvit": ("exact",),  # its head's BatchNorm1d on the whole mean (halo.nn.timm_layers.WholeBatchNorm1d)
    # its ClassifierHead's in_conv (a conv and a BatchNorm before the pool) converts: it was taken for a timm head
    # whose layers all follow the pool and kept, so its BatchNorm ran on each shard (silently 0.06-0.9 off in train)
    "timm.efficientvit": ("exact",),
    "timm.eca_resnet": ("exact",),  # its ECA's Conv1d runs on the whole global mean (it was refused as a window)
    "timm.focalnet": ("exact",),
    "timm.vovnet": ("exact",),
    "timm.mixnet": ("exact",),
    # token mixing: an nn.Linear over the tokens (x.transpose(1, 2)), refused at the call although torch's own
    # module makes it (it would fail with a shape error on each shard, or mix a shard's tokens only)
    "timm.mixer": ("multiplies over H (the sharded dim is the last one, which F.linear contracts)",),
    "timm.gmlp": ("multiplies over H (the sharded dim is the last one, which F.linear contracts)",),
    # ResMLP's Affine is unknown (its hint {Affine: None}, followed, reaches the token Linear: refused)
    "timm.resmlp": ("blocks.0.norm1 (timm.models.mlp_mixer.Affine)",),
    # a class token per stage: refused by name
    "timm.coat": ("(cls_token1, cls_token2, cls_token3, cls_token4)",),
    # its Swin V2 blocks are halo.nn.swinv2's; its classifier head pools channels-last (NHWC) features with
    # FastAdaptiveAvgPool, which halo.nn.timm_layers does not convert (NCHW pools only): refused, naming it
    "timm.swinv2": ("exact", "head.global_pool.pool (timm.layers.adaptive_avgmax_pool.FastAdaptiveAvgPool)"),
    # smp's decoders resize to the skip's local size (F.interpolate(size=skip.shape[-2:])) or upsample unevenly
    # split levels: exact where halo computes the global size, else refused naming the resize (never per shard)
    "smp.Unet": ("exact",),  # its decoder resizes to global level sizes (halo.nn.smp_layers)
    "smp.UnetPlusPlus": ("exact",),  # its nearest x2 resizes the global field (halo.guard.reroute)
    "smp.FPN": ("exact",),
    "smp.DeepLabV3Plus": ("exact",),
    "smp.MAnet": ("matmul",),  # its PAB block is attention over all H x W tokens
    "smp.PSPNet": ("exact",),  # its whole (or sharded) pooled map resized to the global size (halo.guard.reroute)
    "smp.PAN": ("exact",),  # its FPABlock resizes to fractions of the global rows (halo.nn.smp_layers.DomainFPABlock)
    "smp.Linknet": ("exact",),
    # a ViT encoder with a class token (a token of the whole field, attending to every patch) and a position table
    # it resizes to the grid: refused by name (the hint it offers, followed, is refused too: test below)
    "smp.DPT": ("(cls_token, pos_embed)",),
    "diffusers.UNet2DModel": ("exact",),
    "diffusers.UNet2DModel+attention": ("exact",),  # its mid-block Attention: ring attention (halo.nn.attention_layers)
    # its Transformer2DModel: self-attention by ring attention, cross-attention to the whole context local
    "diffusers.UNet2DConditionModel": ("exact",),
    "monai.UNet": ("exact",),
    "monai.BasicUNet": ("exact",),
    "monai.DynUNet": ("exact",),
    "monai.SegResNet": ("exact",),
    "monai.AttentionUnet": ("exact",),
    "monai.BasicUNetPlusPlus": ("exact",),
    "monai.HighResNet": ("exact",),  # its ChannelPad kept (pointwise: halo.nn.monai_layers)
    # its ViT: the position table's rows of each rank's patches, ring attention (halo.nn.monai_layers)
    "monai.UNETR": ("exact",),
    "credit.crossformer": ("exact",),
    "credit.unet": ("exact",),  # CREDIT's smp U-Net: its decoder resizes to global level sizes (halo.nn.smp_layers)
    "credit.swin": ("exact",),  # CREDIT's Swin V2 (halo.nn.swinv2): windows whole on each rank at 48 rows
    "credit.fuxi": ("exact",),  # FuXi: timm's SwinTransformerV2Block (halo.nn.swinv2)
    "credit.swin(bias dropout)": ("DomainWindowAttentionV2 (WindowMultiHeadAttention): its dropout meta_mlp.drop1",),
    **{name: ("exact",) for name in tp.LAYERS},  # halo/nn/timm_layers.py
    # train mode, the head's dropout at 0.2: the unsharded model's mask on every rank (its reference draws as halo's
    # does in one process: tests/_modes.py's WholeFieldDropout; test_a_head_dropout_changes_the_logits)
    "timm.ClassifierHead(drop_rate=0.2)": ("exact",),
    "timm.NormMlpClassifierHead(drop_rate=0.2)": ("exact",),
    "timm.resnet(drop_rate=0.2)": ("exact",),  # F.dropout in its forward_head (halo.guard.reroute.WholeDropout)
}


def _build(spec: tp.Spec) -> torch.nn.Module:
    """The model from seed 0, float64, train mode, its dropouts off (rate 0): halo's dropouts draw by global index,
    the same on any number of ranks but not torch's draws (``tests/test_random.py`` tests them)."""
    tp.load()
    torch.manual_seed(0)
    model = spec.build().double().train()
    for m in model.modules() if not spec.dropout else ():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        elif type(m).__name__ == "DropPath" and hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    return model


def _input(spec: tp.Spec, world: int) -> torch.Tensor:
    h = spec.rows[world]
    shape = (2, spec.channels, spec.frames, h, spec.width) if spec.frames else (2, spec.channels, h, spec.width)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for v in out.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _weights(shape: torch.Size, i: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2 + i))


def _plain(m: torch.nn.Module) -> dict:
    """A module's plain attributes (numbers, strings, tuples of them): what ``revert_domain_parallel`` must give back
    as they were (halo pins some while converted: diffusers' ``num_upsamplers``)."""
    return {k: v for k, v in m.__dict__.items()
            if not k.startswith("_halo") and isinstance(v, (bool, int, float, str, tuple, type(None)))}


def _shadows(m: torch.nn.Module) -> list[str]:
    """Instance attributes that hide a method of the module's class (halo's ``proj_feat`` for UNETR, if left)."""
    return [k for k, v in m.__dict__.items() if callable(getattr(type(m), k, None)) and callable(v)
            and not k.startswith("_") and not isinstance(v, torch.nn.Module)]


def _one(rank: int, world: int, name: str, hint: tuple[str, str] | None = None) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel

    spec = tp.SPECS[name]
    model = _build(spec)
    keys, types = list(model.state_dict()), [type(m) for m in model.modules()]
    plain = [_plain(m) for m in model.modules()]
    converters = spec.converters()
    if hint is not None:  # a refusal's hint, followed: {T: None} or {T: INSIDE} for the class it names
        from halo.nn.convert import INSIDE

        kind = next(type(m) for m in model.modules() if type(m).__name__ == hint[0])
        converters = {**converters, kind: None if hint[1] == "None" else INSIDE}
    try:
        convert_to_domain_parallel(model, custom_converters=converters or None)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}", "at": "convert"}
    full = _input(spec, world)
    offs = split_offsets(full.shape[-2], world)
    x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
    try:
        outs = _outputs(spec.call(model, x))
        loss, gathered, whole = 0.0, [], []
        for i, o in enumerate(outs):
            if o.dim() >= 3:  # a field: this rank's rows
                g = halo.gather(o.detach())
                mo = split_offsets(g.shape[-2], world)
                loss = loss + (o * _weights(g.shape, i)[..., mo[rank]:mo[rank + 1], :]).sum()
                gathered.append(g)
                whole.append(False)
            else:  # whole on every rank: rank 0 backpropagates the weights
                loss = loss + (o * _weights(o.shape, i)).sum() * (1.0 if rank == 0 else 0.0)
                gathered.append(o.detach().clone())
                whole.append(True)
        loss.backward()
        grad = halo.gather(x.grad)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent asserts on it
        return {"refused": f"{type(exc).__name__}: {exc}", "at": "call",
                "trace": "".join(traceback.format_exception(exc, limit=-4))}
    result = {"keys": list(model.state_dict()) == keys, "outs": gathered, "whole": whole, "grad": grad,
              "params": {n: p.grad for n, p in model.named_parameters()},
              "buffers": {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    revert_domain_parallel(model)  # the torch modules back, with the state trained sharded
    result["reverted"] = [type(m) for m in model.modules()] == types and all(
        torch.equal(v, state[k]) for k, v in model.state_dict().items()) and [
        _plain(m) for m in model.modules()] == plain and not any(_shadows(m) for m in model.modules())
    return result


def _agree(rank: int, world: int, key: str, status: str) -> list[str]:
    """Every rank's status after a model, exchanged through the store (not the process group, which a rank that
    raised alone may have left mid-message); waits at most ``2 * STEP_TIMEOUT``."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", status)
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=2 * STEP_TIMEOUT))
    except Exception:  # noqa: BLE001 - a rank that never reported: stop (the parent names the model)
        return [status] + ["(no report)"] * (world - 1)
    return [store.get(k).decode() for k in keys]


STEP_TIMEOUT = 30  # halo.set_timeout in the ranks: a rank left waiting by a peer that raised alone raises


def _zoo(rank: int, world: int, names: list[str], attempt: int) -> dict:
    """The models ``names`` in order; stops after a model whose ranks did not all end alike (one rank raised, the
    others waited: the process group may hold a stale message), reporting it under ``"diverged"``."""
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # the kernels' torch reference: Triton's interpreter is tested elsewhere
    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(STEP_TIMEOUT)
    results: dict = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = _one(rank, world, name)
        results[name]["seconds"] = time.perf_counter() - t0
        statuses = _agree(rank, world, f"zoo/{attempt}/{name}", results[name].get("refused", "ran"))
        if len(set(statuses)) != 1:
            results[name] = {"diverged": statuses, "trace": results[name].get("trace", "")}
            break
    return results


def run_zoo(world: int, names: list[str]) -> list[dict]:
    """Every model of ``names`` on ``world`` ranks: per-rank ``{name: result}``; after a model that diverged, the
    rest run in fresh processes."""
    merged: list[dict] = [{} for _ in range(world)]
    attempt = 0
    while names:
        runs = run_on_ranks(_zoo, world, names, attempt, timeout=600)
        done = [n for n in names if all(n in r for r in runs)]
        for r, res in enumerate(runs):
            merged[r].update({n: res[n] for n in done})
        names = [n for n in names if n not in done]
        attempt += 1
    return merged


def _reference(name: str, world: int, drop: bool = True) -> dict:
    """The unsharded model (``drop=False``: its dropout rates set to 0 first)."""
    spec = tp.SPECS[name]
    model = _build(spec)
    if not drop:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd):
                m.p = 0.0
        if hasattr(model, "drop_rate"):  # timm's F.dropout in forward_head
            model.drop_rate = 0.0
    if spec.reference is not None:
        spec.reference(model)
    x = _input(spec, world).requires_grad_(True)
    outs = _outputs(spec.call(model, x))
    sum((o * _weights(o.shape, i)).sum() for i, o in enumerate(outs)).backward()
    return {"outs": [o.detach() for o in outs], "grad": x.grad, "params": dict(model.named_parameters()),
            "buffers": {n: b for n, b in model.named_buffers() if b.is_floating_point()}}


def _err(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """The largest difference relative to ``scale`` (the largest magnitude of the quantity compared)."""
    return float((got - want).abs().max()) / max(scale, 1e-300)


def _buffer_scale(buffers: dict[str, torch.Tensor], name: str) -> float:
    """A running mean's rounding error is relative to the spread of the data it averages (a mean that is zero in
    exact arithmetic, e.g. of a 1x1 conv of BatchNorm-normalised channels, is ~1e-17 either way)."""
    scale = float(buffers[name].abs().max())
    if name.endswith("running_mean"):
        var = buffers.get(name.removesuffix("running_mean") + "running_var")
        if var is not None:
            scale = max(scale, float(var.abs().max()) ** 0.5)
    return scale or 1.0


def differences(results: list[dict], name: str, world: int) -> dict[str, float]:
    """What differs from the unsharded model by more than ``RTOL`` (relative): ``{quantity: error}``."""
    ref = _reference(name, world)
    bad: dict[str, float] = {}

    def check(label: str, got: torch.Tensor | None, want: torch.Tensor | None, scale: float) -> None:
        if got is None or want is None:
            if (got is None) != (want is None) and not (want is not None and not want.abs().max() > 0):
                bad[label] = float("inf")
            return
        if got.shape != want.shape:
            bad[f"{label} shape {tuple(got.shape)} != {tuple(want.shape)}"] = float("inf")
            return
        e = _err(got.double(), want.double(), scale)
        if not e <= RTOL:
            bad[label] = e

    if len(results[0]["outs"]) != len(ref["outs"]):
        return {"number of outputs": float("inf")}
    for r, res in enumerate(results):
        if not res["keys"]:
            bad["state_dict keys"] = float("inf")
        if not res["reverted"]:
            bad["revert_domain_parallel (types or state)"] = float("inf")
        for i, (got, want) in enumerate(zip(res["outs"], ref["outs"], strict=True)):
            check(f"output {i} (rank {r})", got, want, float(want.abs().max()))
        check(f"input grad (rank {r})", res["grad"], ref["grad"], float(ref["grad"].abs().max()))
        for n, b in ref["buffers"].items():
            check(f"buffer {n} (rank {r})", res["buffers"].get(n), b, _buffer_scale(ref["buffers"], n))
    pscale = max(float(p.grad.abs().max()) for p in ref["params"].values() if p.grad is not None)
    for n, p in ref["params"].items():
        grads = [res["params"][n] for res in results]
        got = None if all(g is None for g in grads) else sum(g for g in grads if g is not None)
        check(f"param grad {n}", got, p.grad, pscale)
    return bad


_RUNS: dict[int, tuple[list[dict], float]] = {}


def zoo_run(world: int) -> tuple[list[dict], float]:
    """The whole zoo on ``world`` ranks, once per session: ``(per-rank results, seconds)``."""
    if world not in _RUNS:
        t0 = time.perf_counter()
        _RUNS[world] = (run_zoo(world, list(tp.SPECS)), time.perf_counter() - t0)
    return _RUNS[world]


#: Models that fail today for a known bug outside this file, each marked a strict xfail: when the bug is fixed the
#: test passes, which fails the run until the entry is removed (a model can never silently leave this list).
KNOWN_BUGS: dict[tuple[str, int], str] = {}


def _cases() -> list:
    return [pytest.param(name, world, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name, world]))
            if (name, world) in KNOWN_BUGS else pytest.param(name, world)
            for world in (2, 3) for name in tp.SPECS]


@pytest.mark.timeout(600)  # the first test of each world size runs its whole zoo (~1 min quiet)
@pytest.mark.parametrize(("name", "world"), _cases())
def test_real_model_exact_or_refused(name, world):
    results = [per_rank[name] for per_rank in zoo_run(world)[0]]
    want = VERDICTS[name]
    diverged = [r for r in results if "diverged" in r]
    trace = "\n".join(r.get("trace") or "" for r in diverged)
    assert not diverged, f"{name} at P={world}: the ranks did not end alike (an error on some ranks only, the " \
                         f"others left waiting): {diverged[0]['diverged']}\n{trace}"
    if "refused" in results[0]:
        errors = [r.get("refused") for r in results]
        assert len(set(errors)) == 1, f"{name}: ranks disagree: {errors}"
        reasons = [w for w in want if w != "exact"]
        assert reasons, f"{name} at P={world} must be exact, got refused ({results[0]['at']}): {errors[0]}\n" \
                        f"{results[0].get('trace', '')}"
        assert any(w in errors[0] for w in reasons), f"{name}: refused for another reason: {errors[0]}"
        return
    assert all("refused" not in r for r in results), [r.get("refused") for r in results]
    bad = differences(results, name, world)
    assert not bad, f"{name} at P={world} is SILENTLY different from the unsharded model: {bad}"
    assert "exact" in want, f"{name} at P={world} must be refused ({want}) but ran and is exact"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", [n for n, s in tp.SPECS.items() if s.reference is not None])
def test_a_head_dropout_changes_the_logits(name, world):
    """The exact cases with a head dropout (rate 0.2) could fail: their reference's logits differ from those of the
    same model without the dropout (so a converted head that drew nothing, or another mask, would be caught)."""
    tp.load()
    kept, dropped = _reference(name, world, drop=False)["outs"][0], _reference(name, world)["outs"][0]
    assert not torch.allclose(kept, dropped), f"{name}: the head's dropout changes nothing: the test could not fail"


def test_same_padding_of_the_global_extent_is_timms():
    """``DomainConv2dSame`` pads what timm's ``pad_same`` pads for the global extent (the extra row after)."""
    tp.load()
    from timm.layers.padding import pad_same_arg

    from halo.nn.timm_layers import _same_pad

    for size in range(1, 40):
        for k in (1, 2, 3, 4, 5, 7):
            for s in (1, 2, 3):
                for d in (1, 2):
                    left, right, top, bottom = pad_same_arg([size, size], [k, k], [s, s], [d, d])
                    assert _same_pad(size, k, s, d) == (top, bottom) == (left, right), (size, k, s, d)


def test_flatten_after_a_global_pool_refuses_a_field():
    """The flatten kept after a timm model's global pool flattens only a whole tensor; given a field it raises."""
    from torch import nn

    from halo.nn.timm_layers import DomainFlatten, WholeDropout

    flat = DomainFlatten(nn.Flatten(1), domain_size=2)
    with pytest.raises(ValueError, match=r"flatten \(start_dim=1\) of a field \(2, 3, 5, 4\) would mix its sharded"):
        flat(torch.zeros(2, 3, 5, 4))
    assert DomainFlatten(nn.Flatten(1), domain_size=1)(torch.zeros(2, 3, 5, 4)).shape == (2, 60)  # one rank
    drop = WholeDropout(nn.Dropout(0.3))  # one process: the whole tensor's mask
    torch.manual_seed(3)
    got = drop(torch.ones(4, 50, dtype=torch.float64))
    assert set(got.unique().tolist()) == {0.0, 1 / 0.7}
    assert drop.eval()(torch.ones(2, 3)).sum() == 6


class _LocalMeanHead(torch.nn.Module):
    """RepViT's ``NormLinear`` given each rank's own mean (in a trusted block: the guard does not compute it over
    the domain), not the whole one: the batch norm would see each rank's statistics."""

    def __init__(self) -> None:
        from timm.models.repvit import NormLinear

        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = NormLinear(4, 2)

    def forward(self, x):
        import halo

        y = self.conv(x)
        with halo.guard.trusted():
            v = y.mean((2, 3))
        return self.head(v)


def _refusals(rank: int, world: int) -> dict[str, str]:
    """RepViT's head norm given each rank's own mean; MobileViT at 40 rows (5 at 1/8: not whole patches of 2)."""
    import halo
    from halo.nn import convert_to_domain_parallel

    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(10)
    out = {}
    for name, model, rows in (("local mean", _LocalMeanHead(), 9), ("mobilevit", tp.ZOO["timm.mobilevit"].build(), 40)):
        model = convert_to_domain_parallel(model.double())
        offs = split_offsets(rows, world)
        try:
            model(torch.randn(2, 3, offs[rank + 1] - offs[rank], 16, dtype=torch.float64))
            out[name] = "ran"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_repvit_head_norm_takes_only_a_whole_mean_and_mobilevit_whole_patches():
    """``WholeBatchNorm1d`` (RepViT's head norm, kept as torch's) takes a (batch, channels) tensor halo made whole:
    given a field it raises, and given each rank's own mean on a guarded first call it raises on every rank.
    MobileViT at a level whose global rows are not whole patches (timm resizes the whole map there) is refused on
    every rank, naming the rows."""
    tp.load()
    from timm.models.repvit import NormLinear

    from halo.nn.timm_layers import timm_adapter

    head = NormLinear(4, 2)
    ctx = type("Ctx", (), {"group": None, "mesh": None})()
    kept = timm_adapter(head)(head, ctx)
    assert type(kept.bn).__name__ == "WholeBatchNorm1d" and kept.bn.weight is head.bn.weight
    with pytest.raises(ValueError, match=r"only for a \(batch, channels\) tensor .* got \(2, 4, 5\)"):
        kept.bn(torch.zeros(2, 4, 5))
    results = run_on_ranks(_refusals, 2, timeout=60)
    assert all("not made whole by halo" in r["local mean"] for r in results), results
    assert all("DomainMobileVitBlock: 5 rows at this block are not a multiple of its patch height 2" in r["mobilevit"]
               for r in results), results


def test_a_head_random_layer_other_than_its_dropout_is_refused():
    """A classifier head's own ``nn.Dropout`` draws the whole tensor's mask (``WholeDropout``); a channel dropout
    there (or a dropout nested in another of its layers) has no such draw: refused at conversion, naming it."""
    tp.load()
    from timm.layers.classifier import ClassifierHead
    from torch import nn

    from halo.nn.timm_layers import timm_adapter

    ctx = type("Ctx", (), {"group": None, "mesh": None})()
    for drop, where in ((nn.Dropout2d(0.2), "ClassifierHead.drop (Dropout2d, p=0.2)"),
                        (nn.Sequential(nn.Dropout(0.2)), "ClassifierHead.drop.0 (Dropout, p=0.2)")):
        head = ClassifierHead(8, 3, drop_rate=0.2)
        head.drop = drop
        with pytest.raises(ValueError, match=re.escape(where) + " draws on the result of a global pool"):
            timm_adapter(head)(head, ctx)


def test_smp_decoder_block_outside_a_converted_decoder_refuses_a_shard_size():
    """A converted ``UnetDecoderBlock`` given a plain (shard) height and no skip cannot know the field's height: it
    refuses rather than resize to the shard's size (which would be silently wrong on an uneven split)."""
    tp.load()
    from segmentation_models_pytorch.decoders.unet.decoder import UnetDecoderBlock

    from halo.nn.smp_layers import GlobalExtent, smp_adapter

    block = UnetDecoderBlock(4, 0, 4)
    convert = smp_adapter(block)
    assert convert is not None
    halo_block = convert(block, type("Ctx", (), {"group": None, "mesh": None})())
    assert list(halo_block.state_dict()) == list(block.state_dict())
    with pytest.raises(ValueError, match="outside a converted UnetDecoder"):
        halo_block(torch.randn(1, 4, 5, 6), 10, 12)
    assert isinstance(GlobalExtent(10), int)


# -- every hint the zoo's refusals offer, followed (issue 32, item 2) --------------------------------------------------

_HINT = re.compile(r"custom_converters=\{(\w+): (None|halo\.nn\.convert\.INSIDE)\}")


def _hint_of(name: str) -> tuple[str, str] | None:
    """The first ``{T: None}`` / ``{T: INSIDE}`` hint of the model's conversion refusal (``None``: no refusal or
    no such hint); conversion only, nothing runs."""
    from halo.nn import convert_to_domain_parallel

    spec = tp.SPECS[name]
    try:
        convert_to_domain_parallel(_build(spec), custom_converters=spec.converters() or None)
    except (ValueError, TypeError, NotImplementedError) as exc:
        found = _HINT.search(str(exc))
        return found.groups() if found else None
    return None


def _hinted(rank: int, world: int, names: list[str]) -> dict:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"
    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(STEP_TIMEOUT)
    out = {}
    for name in names:
        hint = _hint_of(name)
        if hint is not None:
            out[name] = (hint, _one(rank, world, name, hint))
    return out


@pytest.mark.timeout(600)
def test_every_zoo_hint_followed_is_exact_or_refused():
    """Each refusal's ``{T: None}`` / ``{T: INSIDE}`` hint, followed on the model that provoked it, at P=2: the
    unsharded model's numbers or a refusal the same on every rank, never a silent difference."""
    runs = run_on_ranks(_hinted, 2, list(tp.SPECS), timeout=600)
    assert runs[0], "no zoo refusal offers a hint: nothing followed"
    for name, (hint, _) in runs[0].items():
        results = [r[name][1] for r in runs]
        if "refused" in results[0]:
            errors = {r.get("refused") for r in results}
            assert len(errors) == 1, f"{name} with {hint}: ranks disagree: {errors}"
            continue
        assert all("refused" not in r for r in results), [r.get("refused") for r in results]
        bad = differences(results, name, 2)
        assert not bad, f"{name}, its hint {hint} followed, is SILENTLY different from the unsharded model: {bad}"
