"""A converted model pickles whole (``torch.save(model)``, ``pickle``) and deep-copies (an EMA copy), and each copy
computes exactly what the original computes, on 2 gloo ranks in float64.

Models, converted with an explicit domain group: a conv + ``nn.AdaptiveAvgPool2d(1)`` + ``nn.Linear`` classifier
(the pool's result is whole on every rank: ``halo.nn.root.guard_whole`` hooks its tail), timm's ``ClassifierHead``
with a dropout (halo's ``WholeDropout``, holding the group) and timm's ``ResNet``, 69 rows (uneven shards at every
level); CREDIT's CrossFormer with its earth padding and final interpolation (halo's ``TensorPadding`` and a forward
hook, both holding the group), 64 rows.
Copies made before the first call (deepcopy) and after it (pickle, deepcopy, torch.save): output, input gradient
and every parameter gradient bitwise equal to the original's, which equals the unsharded model (1e-10: sums in
another order). The hooks survive the copy, not just the pickling: a copy of a model that feeds a global pool's
result to a halo conv still refuses it, naming the conv's path. A pickled model's parameters keep halo's
gradient-provenance mark but (torch never serializes hooks) not the hook: the sync must put it back, so that a
local loss in a later step is refused on the loaded model as on the original.
"""

import copy
import io
import pickle

import _thirdparty as tp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.testing import run_on_ranks

_MISSING = [p for p in tp.missing() if p in ("timm", "torchvision", "miles-credit")]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING} (tests/_thirdparty.py)")

RTOL = 1e-10  # against the unsharded model: float64 sums in another order; copies vs original: bitwise


class Classifier(nn.Module):
    """A timm-like classifier: features, a global average pool, flatten, a linear head (its own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.global_pool(self.act(self.conv(x))).flatten(1))


class PoolIntoConv(nn.Module):
    """A global pool's result given to a conv that halo converts: refused (the conv would take copies for shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.proj(self.pool(x))


def _saved(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _head() -> nn.Module:
    """timm's ``ClassifierHead`` after a conv: its ``SelectAdaptivePool2d`` and the dropout halo makes a
    ``WholeDropout`` (which holds the domain group)."""
    from timm.layers.classifier import ClassifierHead

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), ClassifierHead(8, 3, pool_type="avg", drop_rate=0.1))


def _crossformer() -> nn.Module:
    """CREDIT's CrossFormer with its TensorPadding (halo swaps in its own) and the final interpolation (run by
    halo in a forward hook): both hold the domain group."""
    from credit.models.wxformer.crossformer import CrossFormer

    return CrossFormer(image_height=64, image_width=32, frames=1, channels=1, surface_channels=2,
                       input_only_channels=0, levels=1, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4,
                       global_window_size=(2, 1, 1, 1), local_window_size=2,
                       cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
                       use_spectral_norm=False, interp=True,
                       padding_conf={"activate": True, "mode": "earth", "pad_lat": [16, 16], "pad_lon": [16, 16]})


def _run(model: nn.Module, x: torch.Tensor, w: torch.Tensor, rank: int) -> tuple:
    import halo

    model.zero_grad(set_to_none=True)
    xs = halo.shard(x, -2).requires_grad_(True)
    y = model(xs)
    if y.shape == w.shape:  # logits, whole on every rank: rank 0 backpropagates them
        ((y * w).sum() * (1.0 if rank == 0 else 0.0)).backward()
    else:  # a field's shard
        (y * halo.shard(w, -2)).sum().backward()
        y = halo.gather(y.detach(), -2)
    grads = {}
    for n, p in model.named_parameters():  # summed over the domain group: the model's gradient
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # (a parameter no rank used)
        torch.distributed.all_reduce(g)
        grads[n] = g
    return y.detach(), halo.gather(xs.grad, -2), grads


def _copies(rank: int, world: int, name: str, manager) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel

    build = {"classifier": Classifier, "head": _head, "resnet": tp._timm_resnet, "crossformer": _crossformer}[name]
    torch.manual_seed(0)
    ref = build().double().eval()
    torch.manual_seed(0)
    model = convert_to_domain_parallel(build().double().eval(), manager)  # (the explicit group: it must pickle)
    early = copy.deepcopy(model)  # an EMA copy made right after the conversion, before any call
    g = torch.Generator().manual_seed(1)
    if name == "crossformer":
        x = torch.randn(1, 3, 1, 64, 32, dtype=torch.float64, generator=g)
        w = torch.randn(ref(x).shape, dtype=torch.float64, generator=g)
    else:
        x = torch.randn(1, 3, 69, 32, dtype=torch.float64, generator=g)
        w = torch.randn(1, 3, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_(True)
    (ref(xr) * w).sum().backward()
    want = (ref(x).detach(), xr.grad,
            {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()})
    got = _run(model, x, w, rank)
    copies = {"deepcopy before a call": early, "pickle": pickle.loads(pickle.dumps(model)),
              "deepcopy": copy.deepcopy(model), "torch.save": _saved(model)}
    if name == "crossformer":  # (the slowest: the copies that hold the group as the classifiers' do are enough)
        copies = {k: copies[k] for k in ("deepcopy before a call", "torch.save")}
    same = {}
    for what, twin in copies.items():
        y, gx, gp = _run(twin, x, w, rank)
        same[what] = torch.equal(y, got[0]) and torch.equal(gx, got[1]) \
            and all(torch.equal(gp[n], got[2][n]) for n in got[2])
    close = [float((a - b).abs().max()) <= RTOL * float(b.abs().max()) for a, b in zip(got[:2], want[:2], strict=True)]
    top = max(float(v.abs().max()) for v in want[2].values())
    close.append(all(float((got[2][n] - v).abs().max()) <= RTOL * top for n, v in want[2].items()))
    halo.nn.revert_domain_parallel(model)  # (the original stays revertible after being copied)
    return {"same": same, "close": close}


def _refusal(rank: int, world: int) -> str | None:
    import halo
    from halo.nn import convert_to_domain_parallel

    model = pickle.loads(pickle.dumps(convert_to_domain_parallel(PoolIntoConv().double())))
    try:
        model(halo.shard(torch.randn(1, 3, 9, 4, dtype=torch.float64), -2))
    except ValueError as exc:
        return str(exc)
    return None


def _provenance(rank: int, world: int, manager) -> list:
    import halo
    from halo.nn import convert_to_domain_parallel
    from halo.parallel.reduce import domain_mean, sync_domain_gradients

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GELU(), nn.Conv2d(3, 2, 3, padding=1)).double()
    g = torch.Generator().manual_seed(2)
    xs, ys = (halo.shard(torch.randn(2, 2, 11, 6, dtype=torch.float64, generator=g), -2) for _ in range(2))
    out = []
    for model in (convert_to_domain_parallel(net), pickle.loads(pickle.dumps(convert_to_domain_parallel(net)))):
        domain_mean((model(xs) - ys) ** 2).backward()  # a right step: its sync (re)watches the parameters
        sync_domain_gradients(model, manager)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(xs), ys).backward()  # the shard's own mean: x world after the sum
        try:
            sync_domain_gradients(model, manager)
            out.append(None)
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def _worker(rank: int, world: int) -> dict:
    import halo

    tp._torchvision_schemas()
    manager = halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    return {name: _copies(rank, world, name, manager) for name in ("classifier", "head", "resnet", "crossformer")} | {
            "refusal": _refusal(rank, world), "provenance": _provenance(rank, world, manager)}


def test_converted_models_pickle_and_copy_exactly() -> None:
    runs = run_on_ranks(_worker, 2, timeout=120)
    for r in runs:
        for name in ("classifier", "head", "resnet", "crossformer"):
            assert all(r[name]["same"].values()), (name, r[name]["same"])
            assert all(r[name]["close"]), (name, r[name]["close"])
        assert r["refusal"] is not None and r["refusal"].startswith("proj (Domain") \
            and "global pool" in r["refusal"], r["refusal"]
        original, loaded = r["provenance"]
        assert original is not None and "no halo domain reduction" in original, original
        assert loaded == original, (loaded, original)
