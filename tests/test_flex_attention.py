"""``halo.nn.domain_flex_attention``: flex_attention's semantics over the global tokens of shards (issue 32, item 4).

On 3 gloo ranks in float64, 16 tokens split 6 + 5 + 5, two batches: a ``score_mod`` with a learned relative-position
bias table (captured by the closure, indexed by ``q_idx - kv_idx``) and soft-capping (``tanh``: not additive), a
block mask (a sliding window of 4 that is also causal: some key blocks of a rank are all masked), and grouped-query
attention (4 query heads on 2 key heads). The output on each rank's rows equals torch's own ``flex_attention`` on
the unsharded tokens; the output, the log-sum-exp and the gradients of q, k, v and the bias table (summed over the
ranks) equal a dense float64 reference, within 1e-12. torch's flex_attention on each rank's own tokens (its own
block mask) differs. A block mask built for the shard's lengths, and ``kernel_options``, are refused alike on every
rank.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

pytestmark = pytest.mark.timeout(300)

WORLD, N, B, HQ, HKV, D = 3, 16, 2, 4, 2, 8
WINDOW, CAP = 4, 3.0
RTOL = 1e-12


def _tensors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, N, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, HKV, N, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, HKV, N, D, dtype=torch.float64, generator=g)
    bias = torch.randn(HQ, 2 * N - 1, dtype=torch.float64, generator=g)
    return q, k, v, bias


def _mods(bias):
    def score_mod(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh((score + bias[h, q_idx - kv_idx + N - 1]) / CAP)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)
    return score_mod, mask_mod


def _block_mask(mask_mod, q_len, kv_len):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, B, HQ, q_len, kv_len, device="cpu", BLOCK_SIZE=4)


def _dense(q, k, v, bias):
    """The reference: dense scores, the same score_mod and mask, softmax, float64."""
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    i = torch.arange(N)
    rel = bias[:, (i[:, None] - i[None, :] + N - 1)]  # (HQ, N, N)
    s = CAP * torch.tanh((s + rel) / CAP)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
    s = s.masked_fill(~keep, -math.inf)
    return s.softmax(-1) @ v, s.logsumexp(-1)


def _weights(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _ranks(rank, world):
    import halo
    from halo.nn import domain_flex_attention

    warnings.filterwarnings("ignore")
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(30)
    off = split_offsets(N, world)
    q, k, v, bias = _tensors()
    bias.requires_grad_(True)
    mine = [t[..., off[rank]:off[rank + 1], :].clone().requires_grad_(True) for t in (q, k, v)]
    score_mod, mask_mod = _mods(bias)
    out, lse = domain_flex_attention(*mine, score_mod=score_mod, block_mask=_block_mask(mask_mod, N, N),
                                     enable_gqa=True, return_lse=True)
    rows = slice(off[rank], off[rank + 1])
    loss = (out * _weights((B, HQ, N, D), 1)[:, :, rows]).sum() + (lse * _weights((B, HQ, N), 2)[:, :, rows]).sum()
    loss.backward()
    res = {"out": out.detach(), "lse": lse.detach(), "grads": [halo.gather(t.grad) for t in mine],
           "bias": bias.grad.clone()}
    from torch.nn.attention.flex_attention import flex_attention

    n = off[rank + 1] - off[rank]
    with torch.no_grad():  # each rank's own tokens only: what halo must not compute
        res["local"] = flex_attention(*(t.detach() for t in mine), score_mod=score_mod,
                                      block_mask=_block_mask(mask_mod, n, n), enable_gqa=True)
    for case, kw in (("shard lengths", {"block_mask": _block_mask(mask_mod, n, n)}),
                     ("kernel options", {"kernel_options": {"BLOCK_M": 16}})):
        try:
            domain_flex_attention(*mine, enable_gqa=True, **kw)
            res[case] = "ran"
        except ValueError as exc:
            res[case] = str(exc)
    return res


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_ranks, WORLD, timeout=280)


def _err(got, want):
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


def test_equals_torch_flex_attention_and_the_dense_reference(runs):
    from torch.nn.attention.flex_attention import flex_attention

    warnings.filterwarnings("ignore")
    q, k, v, bias = _tensors()
    score_mod, mask_mod = _mods(bias)
    with torch.no_grad():
        torch_out = flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod, N, N),
                                   enable_gqa=True)
    bias.requires_grad_(True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref, lse = _dense(*leaves, bias)
    assert _err(torch_out, ref) <= RTOL  # the dense reference is flex_attention's semantics
    ((ref * _weights(ref.shape, 1)).sum() + (lse * _weights(lse.shape, 2)).sum()).backward()
    off = split_offsets(N, WORLD)
    for rank, res in enumerate(runs):
        rows = slice(off[rank], off[rank + 1])
        assert _err(res["out"], torch_out[:, :, rows]) <= RTOL, rank
        assert _err(res["out"], ref.detach()[:, :, rows]) <= RTOL, rank
        assert _err(res["lse"], lse.detach()[:, :, rows]) <= RTOL, rank
        for got, leaf in zip(res["grads"], leaves, strict=True):
            assert _err(got, leaf.grad) <= RTOL, rank
        assert _err(res["local"], torch_out[:, :, rows]) > 1e-3 or rank == 0, rank  # rank 0: causal, its own keys
    assert _err(sum(r["bias"] for r in runs), bias.grad) <= RTOL
    assert any(_err(r["local"], torch_out[:, :, off[i]:off[i + 1]]) > 1e-3 for i, r in enumerate(runs))


def test_bad_input_refused_alike(runs):
    for case, words in (("shard lengths", "must be built for the global lengths"),
                        ("kernel options", "kernel_options")):
        errors = [r[case] for r in runs]
        assert errors[0] != "ran" and words in errors[0], errors[0]
        assert len(set(errors)) == 1, errors
