"""MONAI's vision transformer as users run it (issue 32: attention over all tokens): ``monai.networks.nets.ViT`` and
``UNETR`` (2-d), converted with ``halo.nn.convert_to_domain_parallel``. Their ``PatchEmbeddingBlock`` becomes
``halo.nn.DomainPatchEmbeddingBlock`` (the position table's rows of each rank's patches) and their ``SABlock``
``halo.nn.DomainSABlock`` (ring attention); UNETR's ``proj_feat`` views each rank's tokens as its patch rows.

On 3 gloo ranks in float64, an 80 x 48 field of 16 x 16 patches (5 x 3: patch rows 2 + 2 + 1, each rank's image rows
27 + 27 + 26, so patches are cut by the split), against the unsharded model built from the same seed: a ViT with
``SABlock``'s other form (``use_flash_attention=True``: SDPA; ``qkv_bias``; separate ``to_q`` / ``to_k`` / ``to_v``
with ``use_combined_linear=False``) and random position embeddings (MONAI draws them small), its output tokens and
every hidden state (gathered), the input gradient and every parameter gradient (summed over the ranks), within
1e-9 of the largest value of each. The same ViT with the attention made per shard after conversion (each rank's own
keys) must differ. Refused on every rank alike, naming the cause: ``proj_type="perceptron"``, ``classification=True``
(its class token), ``save_attn``, attention dropout in training, and an input whose patches are not the table's.
``revert_domain_parallel`` gives MONAI's modules back (UNETR's own ``proj_feat`` too). The whole UNETR is exact in
the real zoo (``tests/test_zoo_real.py``).
"""

from __future__ import annotations

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

_MISSING = tp.missing()
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=f"the zoo's packages are not installed: {_MISSING}"),
              pytest.mark.timeout(300)]

RTOL = 1e-9
LOCAL_OFF = 1e-6
ROWS, COLS = 80, 48
WORLD = 3


def _vit(**kw):
    from monai.networks.nets import ViT

    torch.manual_seed(0)
    args = dict(in_channels=3, img_size=(ROWS, COLS), patch_size=16, hidden_size=16, mlp_dim=32, num_layers=2,
                num_heads=2, proj_type="conv", classification=False, spatial_dims=2, qkv_bias=True)
    args.update(kw)
    model = ViT(**args).double().train()
    for block in model.blocks:
        block.attn.use_flash_attention = True  # SDPA (UNETR's blocks use the einsum form)
    with torch.no_grad():
        model.patch_embedding.position_embeddings.normal_()
    return model


def _separate(model):
    """Every SABlock with separate ``to_q`` / ``to_k`` / ``to_v`` (``use_combined_linear=False``), from its qkv."""
    from einops.layers.torch import Rearrange
    from torch import nn

    for block in model.blocks:
        attn = block.attn
        w, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()
        for i, name in enumerate(("to_q", "to_k", "to_v")):
            lin = nn.Linear(w.shape[1], w.shape[0] // 3, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w[i * lin.out_features:(i + 1) * lin.out_features])
                lin.bias.copy_(b[i * lin.out_features:(i + 1) * lin.out_features])
            setattr(attn, name, lin)
        del attn.qkv
        attn.use_combined_linear = False
        attn.input_rearrange = Rearrange("b h (l d) -> b l h d", l=attn.num_heads)  # as MONAI builds this form
    return model


def _input() -> torch.Tensor:
    return torch.randn(2, 3, ROWS, COLS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _weights(shape, i) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2 + i))


def _run(model, x, gather=None):
    """Output tokens and hidden states, the loss's input and parameter gradients."""
    out, hidden = model(x)
    outs = [out, *hidden]
    full = [gather(o.detach()) if gather else o.detach() for o in outs]
    loss = 0.0
    for i, (o, f) in enumerate(zip(outs, full, strict=True)):
        w = _weights(f.shape, i)
        if gather is not None:
            first, n = gather.first, o.shape[1]
            w = w[:, first:first + n]
        loss = loss + (o * w).sum()
    loss.backward()
    return full, {n: p.grad for n, p in model.named_parameters()}


def _attempt(make):
    try:
        make()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def _ranks(rank: int, world: int) -> dict:
    import os

    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.nn.monai_layers import DomainSABlock

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(30)
    offs = split_offsets(ROWS, world)
    full = _input()
    out: dict = {}

    def shard(t):
        return t[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)

    cols = COLS // 16

    class Tokens:
        """Gathers tokens (B, N_r, C) as the rows of patches they are ((B, C, R_r, Wp): the balanced split of the
        patch rows); ``first``: this rank's first token."""

        first = split_offsets(ROWS // 16, world)[rank] * cols

        def __call__(self, t):
            b, n, c = t.shape
            g = halo.gather(t.reshape(b, n // cols, cols, c).permute(0, 3, 1, 2).contiguous())
            return g.permute(0, 2, 3, 1).reshape(b, -1, c)

    for case in ("exact", "per shard"):
        model = _separate(_vit())
        types = [type(m) for m in model.modules()]
        convert_to_domain_parallel(model)
        out.setdefault("converted", [type(m).__name__ for m in model.modules()])
        if case == "per shard":  # each rank's own keys only: what halo must not compute
            import torch.nn.functional as F

            for m in model.modules():
                if isinstance(m, DomainSABlock):
                    m.__dict__["_halo_local"] = True
            original = DomainSABlock.forward

            def local(self, x, attn_mask=None, _original=original, _F=F):
                if not self.__dict__.get("_halo_local"):
                    return _original(self, x, attn_mask)
                b, n, _ = x.shape
                q, k, v = (f(x).reshape(b, n, self.num_heads, self.dim_head).transpose(1, 2)
                           for f in (self.to_q, self.to_k, self.to_v))
                with halo.guard.trusted():  # (else the guard computes this SDPA over the domain: its exact row)
                    y = _F.scaled_dot_product_attention(q, k, v, scale=self.scale)
                y = y.transpose(1, 2).reshape(b, n, -1)
                return self.drop_output(self.out_proj(y))
            DomainSABlock.forward = local
        x = shard(full)
        tokens = Tokens()
        try:
            outs, grads = _run(model, x, tokens)
        finally:
            if case == "per shard":
                DomainSABlock.forward = original
        out[case] = {"outs": outs, "grad": halo.gather(x.grad), "params": grads}
        revert_domain_parallel(model)
        out[f"{case} reverted"] = [type(m) for m in model.modules()] == types

    from monai.networks.nets import UNETR

    torch.manual_seed(0)
    unetr = UNETR(in_channels=3, out_channels=2, img_size=(ROWS, COLS), spatial_dims=2, feature_size=4,
                  hidden_size=16, mlp_dim=32, num_heads=2).double()
    convert_to_domain_parallel(unetr)
    out["proj_feat converted"] = "proj_feat" in unetr.__dict__
    revert_domain_parallel(unetr)
    out["proj_feat reverted"] = "proj_feat" not in unetr.__dict__

    def refused(**kw):
        def make():
            m = _vit(**kw)
            convert_to_domain_parallel(m)
            m(shard(full))
        return make

    out["perceptron"] = _attempt(refused(proj_type="perceptron"))
    out["classification"] = _attempt(refused(classification=True))
    out["save_attn"] = _attempt(refused(save_attn=True))
    out["dropout"] = _attempt(refused(dropout_rate=0.1))

    def wrong_size():
        m = _vit()
        convert_to_domain_parallel(m)
        bigger = torch.randn(2, 3, ROWS + 16, COLS, dtype=torch.float64)
        o = split_offsets(ROWS + 16, world)
        m(bigger[..., o[rank]:o[rank + 1], :])
    out["size"] = _attempt(wrong_size)
    return out


def _reference() -> dict:
    model = _separate(_vit())
    x = _input().requires_grad_(True)
    outs, grads = _run(model, x)
    return {"outs": outs, "grad": x.grad, "params": grads}


def _err(got, want) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


@pytest.fixture(scope="module")
def runs():
    tp._torchvision_schemas()
    return run_on_ranks(_ranks, WORLD, timeout=280), _reference()


def _worst(res: dict, ref: dict) -> dict[str, float]:
    errs = {f"output {i}": _err(g, w) for i, (g, w) in enumerate(zip(res["outs"], ref["outs"], strict=True))}
    errs["input grad"] = _err(res["grad"], ref["grad"])
    return errs


def test_vit_is_exact_and_per_shard_attention_is_not(runs):
    ranks, ref = runs
    assert "DomainSABlock" in ranks[0]["converted"] and "DomainPatchEmbeddingBlock" in ranks[0]["converted"]
    for rank, res in enumerate(ranks):
        errs = _worst(res["exact"], ref)
        assert max(errs.values()) <= RTOL, (rank, errs)
        assert res["exact reverted"] and res["per shard reverted"], rank
        local = _worst(res["per shard"], ref)
        assert local["output 0"] > LOCAL_OFF, (rank, local)  # the test sees a per-shard softmax
    pscale = max(float(p.abs().max()) for p in ref["params"].values() if p is not None)
    for name, want in ref["params"].items():
        grads = [r["exact"]["params"][name] for r in ranks]
        assert (want is None) == all(g is None for g in grads), name
        if want is None:
            continue
        got = sum(g for g in grads if g is not None)
        assert float((got - want).abs().max()) <= RTOL * pscale, name
    table = "patch_embedding.position_embeddings"
    got = sum(r["exact"]["params"][table] for r in ranks)
    assert _err(got, ref["params"][table]) <= RTOL  # the table's rows, each from the rank that holds them


def test_unetr_proj_feat_is_given_back(runs):
    ranks, _ = runs
    for res in ranks:
        assert res["proj_feat converted"] and res["proj_feat reverted"]


@pytest.mark.parametrize(("case", "words"), [
    ("perceptron", "proj_type='perceptron'"),
    ("classification", "class token"),
    ("save_attn", "save_attn=True"),
    ("dropout", "attention dropout in training (dropout_rate=0.1)"),
    ("size", "built for 15 patches"),
])
def test_refused_alike_on_every_rank(runs, case, words):
    ranks, _ = runs
    errors = [r[case] for r in ranks]
    assert errors[0] != "ran" and words in errors[0], errors[0]
    assert len(set(errors)) == 1, errors
