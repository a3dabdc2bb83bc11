"""Neighbourhood attention with NATTEN's semantics (``halo.nn.neighborhood``) on gloo ranks vs one process.

- The reference: ``neighborhood_attention_reference`` equals a naive per-query loop written from NATTEN's C++ CPU
  kernels' ``get_window_start`` / ``get_pb_start`` (transcribed below as they are, not as halo writes them), with
  and without dilation, with the relative positional bias; the per-rank key rows planned are exactly the union of
  the rows the rank's windows read.
- Sharded: ``neighborhood_attention`` on 2 and 3 ranks (H = 21 and 14: shards of 7 rows, thinner than a dilated
  window's reach of up to 12 rows, so rows come from beyond the neighbours) equals the reference, forward and
  backward (q, k, v gradients; the rpb gradient summed over the domain group), float64, to 1e-12.
- The module: a NATTEN-structured ``NeighborhoodAttention2D`` (natten is not installed; written here to NATTEN's
  layout) is converted by ``convert_to_domain_parallel`` into ``DomainNeighborhoodAttention2D`` with the same
  state_dict keys, and a small model with it trains for three SGD steps equal to the unsharded model.
- Errors: a field smaller than kernel x dilation, and a rank whose keys have another shape, raise the same clear
  error on every rank (no hang).
"""

import itertools

import pytest
import torch
from torch import nn

from halo.nn.neighborhood import (
    DomainNeighborhoodAttention2D,
    neighborhood_attention_reference,
    neighborhood_row_plan,
    window_start,
)
from halo.plan.partition import split_offsets, split_sizes
from halo.testing import run_on_ranks

TOL = 1e-12


# -- NATTEN's CPU kernels' rules, transcribed (natten/csrc/cpu/natten_cpu_commons.h) ---------------------------

def natten_window_start(index, length, kernel, ns, dilation):
    if dilation <= 1:
        return max(index - ns, 0) + (index + ns >= length) * (length - index - ns - 1)
    ni = index - ns * dilation
    if ni < 0:
        return index % dilation
    if index + ns * dilation >= length:
        imodd = index % dilation
        a = (length // dilation) * dilation
        b = length - a
        if imodd < b:
            return length - b + imodd - 2 * ns * dilation
        return a + imodd - kernel * dilation
    return ni


def natten_pb_start(index, length, kernel, ns, dilation):
    if dilation <= 1:
        return ns + (index < ns) * (ns - index) + (index + ns >= length) * (length - index - 1 - ns)
    if index - ns * dilation < 0:
        return kernel - 1 - (index // dilation)
    if index + ns * dilation >= length:
        return (length - index - 1) // dilation
    return ns


def naive_na(q, k, v, kernel, dilation, rpb, scale=1.0):
    """NATTEN's qkrpb + softmax + av kernels as loops, one query at a time."""
    b_, n_, h_, w_, _ = q.shape
    out = torch.zeros_like(q)
    ns = kernel // 2
    for b, n, i, j in itertools.product(range(b_), range(n_), range(h_), range(w_)):
        ni, nj = natten_window_start(i, h_, kernel, ns, dilation), natten_window_start(j, w_, kernel, ns, dilation)
        pi, pj = natten_pb_start(i, h_, kernel, ns, dilation), natten_pb_start(j, w_, kernel, ns, dilation)
        logits, vals = [], []
        for a, c in itertools.product(range(kernel), range(kernel)):
            s = (q[b, n, i, j] * scale * k[b, n, ni + a * dilation, nj + c * dilation]).sum()
            logits.append(s + (rpb[n, pi + a, pj + c] if rpb is not None else 0))
            vals.append(v[b, n, ni + a * dilation, nj + c * dilation])
        out[b, n, i, j] = (torch.stack(logits).softmax(0)[:, None] * torch.stack(vals)).sum(0)
    return out


@pytest.mark.parametrize("h,w,kernel,dilation", [(9, 8, 3, 1), (11, 7, 5, 1), (13, 10, 3, 2), (15, 9, 3, 3),
                                                 (10, 10, 5, 2), (21, 11, 5, 2), (7, 7, 7, 1), (14, 14, 7, 2)])
def test_reference_is_natten(h, w, kernel, dilation):
    gen = torch.Generator().manual_seed(h * 100 + kernel * 10 + dilation)
    q, k, v = (torch.randn(1, 2, h, w, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    rpb = torch.randn(2, 2 * kernel - 1, 2 * kernel - 1, generator=gen, dtype=torch.float64)
    for bias in (None, rpb):
        ref = neighborhood_attention_reference(q, k, v, kernel, dilation, bias, scale=0.7)
        assert (ref - naive_na(q, k, v, kernel, dilation, bias, scale=0.7)).abs().max().item() < 1e-14


def test_window_start_matches_natten_everywhere():
    for length, kernel, dilation in itertools.product(range(1, 40), (1, 3, 5, 7, 9), (1, 2, 3, 4)):
        if length < kernel * dilation:
            continue
        for i in range(length):
            assert window_start(i, length, kernel, dilation) == natten_window_start(i, length, kernel, kernel // 2,
                                                                                   dilation)


def test_row_plan_is_the_union_of_windows():
    for length, kernel, dilation, parts in itertools.product((14, 21, 23), (3, 5, 7), (1, 2), (1, 2, 3, 5)):
        if length < kernel * dilation:
            continue
        sizes = split_sizes(length, parts)
        offs = split_offsets(length, parts)
        needs = neighborhood_row_plan(sizes, kernel, dilation)
        for r in range(parts):
            rows = {natten_window_start(i, length, kernel, kernel // 2, dilation) + a * dilation
                    for i in range(offs[r], offs[r + 1]) for a in range(kernel)}
            assert needs[r] == (min(rows), max(rows) + 1)  # exactly the rows read (first to last)
            assert 0 <= needs[r][0] and needs[r][1] <= length


def test_too_small_field_raises():
    q = torch.zeros(1, 1, 9, 12, 2)
    with pytest.raises(ValueError, match=r"9 positions along H, fewer than kernel size x dilation = 5 x 2 = 10"):
        neighborhood_attention_reference(q, q, q, 5, 2)


# -- NATTEN's module, as natten writes it (natten is not installed here) ----------------------------------------

class NeighborhoodAttention2D(nn.Module):
    """natten.NeighborhoodAttention2D's structure and unfused forward, computed by the reference."""

    def __init__(self, dim, num_heads, kernel_size, dilation=1, rel_pos_bias=False, qkv_bias=True, qk_scale=None,
                 attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = qk_scale or self.head_dim ** -0.5
        self.kernel_size = (kernel_size, kernel_size)
        self.dilation = (dilation, dilation)
        self.is_causal = (False, False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.zeros(num_heads, 2 * kernel_size - 1, 2 * kernel_size - 1))
            nn.init.trunc_normal_(self.rpb, std=0.02, mean=0.0, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)
        self.attn_drop_rate = attn_drop
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        b, h, w, c = x.shape
        qkv = self.qkv(x).reshape(b, h, w, 3, self.num_heads, self.head_dim).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        y = neighborhood_attention_reference(q, k, v, self.kernel_size, self.dilation, self.rpb)
        y = y.permute(0, 2, 3, 1, 4).reshape(b, h, w, c)
        return self.proj_drop(self.proj(y))


class ChannelsLast(nn.Module):
    """(B, C, H, W) -> NATTEN block (B, H, W, C) -> back: how a weather model would hold one."""

    def __init__(self, dim, heads, kernel, dilation):
        super().__init__()
        self.inp = nn.Conv2d(2, dim, 3, padding=1)
        self.na = NeighborhoodAttention2D(dim, heads, kernel, dilation, rel_pos_bias=True)
        self.out = nn.Conv2d(dim, 2, 1)

    def forward(self, x):
        y = self.inp(x).permute(0, 2, 3, 1)
        y = y + self.na(y)
        return self.out(y.permute(0, 3, 1, 2))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


# -- multi-rank -------------------------------------------------------------------------------------------------

def _functional(rank, world, cases):
    import torch.distributed as dist

    import halo
    from halo.nn.neighborhood import neighborhood_attention

    halo.initialize_domain_parallel(world, world)
    errs = []
    for h, w, kernel, dilation, seed in cases:
        gen = torch.Generator().manual_seed(seed)
        full = [torch.randn(2, 2, h, w, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
        rpb = torch.randn(2, 2 * kernel - 1, 2 * kernel - 1, generator=gen, dtype=torch.float64)
        weight = torch.randn(2, 2, h, w, 3, generator=gen, dtype=torch.float64)
        offs = split_offsets(h, world)
        lo, hi = offs[rank], offs[rank + 1]
        ref_in = [t.clone().requires_grad_(True) for t in full]
        ref_rpb = rpb.clone().requires_grad_(True)
        ref = neighborhood_attention_reference(*ref_in, kernel, dilation, ref_rpb, scale=0.5)
        (ref * weight).sum().backward()
        loc = [t[:, :, lo:hi].clone().requires_grad_(True) for t in full]
        loc_rpb = rpb.clone().requires_grad_(True)
        out = neighborhood_attention(*loc, kernel, dilation, loc_rpb, scale=0.5)
        (out * weight[:, :, lo:hi]).sum().backward()
        grad_rpb = loc_rpb.grad.clone()
        dist.all_reduce(grad_rpb)
        errs.append(max([rel(out, ref[:, :, lo:hi])] + [rel(a.grad, b.grad[:, :, lo:hi])
                                                       for a, b in zip(loc, ref_in, strict=True)]
                        + [rel(grad_rpb, ref_rpb.grad)]))
    return errs


@pytest.mark.parametrize("world,cases", [
    (3, [(21, 9, 5, 1, 1), (21, 9, 7, 1, 2), (21, 11, 5, 2, 3), (21, 14, 7, 2, 4), (23, 9, 3, 3, 5)]),
    (2, [(14, 14, 7, 2, 6), (15, 9, 5, 1, 7), (21, 7, 7, 1, 8)]),
])
def test_sharded_equals_reference(world, cases):
    for errs in run_on_ranks(_functional, world, cases, timeout=240):
        assert max(errs) < TOL, errs


def _module(rank, world, kernel, dilation, steps):
    import halo
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    h, w = 21, 10
    ref = ChannelsLast(8, 2, kernel, dilation).double()
    model = ChannelsLast(8, 2, kernel, dilation).double()
    model.load_state_dict(ref.state_dict())
    keys = list(model.state_dict())
    halo.nn.convert_to_domain_parallel(model, manager)
    assert isinstance(model.na, DomainNeighborhoodAttention2D), type(model.na)
    assert list(model.state_dict()) == keys
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    offs = split_offsets(h, world)
    lo, hi = offs[rank], offs[rank + 1]
    errs = []
    for _ in range(steps):
        x = torch.randn(2, 2, h, w, generator=gen, dtype=torch.float64)
        target = torch.randn(2, 2, h, w, generator=gen, dtype=torch.float64)
        ref_out = ref(x)
        loss_ref = ((ref_out - target) ** 2).sum()
        xs = x[:, :, lo:hi].clone().requires_grad_(True)
        out = model(xs)
        loss = local_share(((out - target[:, :, lo:hi]) ** 2).sum())  # this rank's share of the global sum
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref.backward()
        loss.backward()
        sync_domain_gradients(model)
        errs.append(rel(out.detach(), ref_out.detach()[:, :, lo:hi]))
        opt_ref.step()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        errs.append(rel(p.detach(), q.detach()))
    halo.nn.revert_domain_parallel(model)
    assert isinstance(model.na, NeighborhoodAttention2D)
    return errs


@pytest.mark.parametrize("world,kernel,dilation", [(3, 5, 2), (2, 7, 1)])
def test_converted_model_trains_like_unsharded(world, kernel, dilation):
    for errs in run_on_ranks(_module, world, kernel, dilation, 3, timeout=240):
        assert max(errs) < TOL, errs


def _errors(rank, world, case):
    import halo
    from halo.nn.neighborhood import neighborhood_attention

    halo.initialize_domain_parallel(world, world)
    h = 9 if case == "small" else 21
    sizes = split_sizes(h, world)
    q = torch.zeros(1, 2, sizes[rank], 12, 4)
    k = q if not (case == "shape" and rank == 1) else torch.zeros(1, 2, sizes[rank], 12, 3)
    try:
        if case == "module":  # rank 1 passes an input without its batch dim
            x = torch.zeros(1, sizes[rank], 12, 8)
            DomainNeighborhoodAttention2D(NeighborhoodAttention2D(8, 2, 3))(x[0] if rank == 1 else x)
        else:
            neighborhood_attention(q, k, q, 5, 2)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,match", [
    ("small", "the field has 9 positions along H, fewer than kernel size x dilation = 5 x 2 = 10"),
    ("shape", "disagree on the number of dims"),
    ("module", "disagree on the number of dims"),
])
def test_errors_are_the_same_on_every_rank(case, match):
    msgs = run_on_ranks(_errors, 3, case, timeout=120)
    assert len(set(msgs)) == 1, msgs
    assert match in msgs[0], msgs[0]


def test_module_refuses_dropout_in_training():
    m = DomainNeighborhoodAttention2D(NeighborhoodAttention2D(8, 2, 3, attn_drop=0.1))
    with pytest.raises(ValueError, match="dropout in training"):
        m(torch.zeros(1, 5, 5, 8))
    m.eval()
    assert m(torch.zeros(1, 5, 5, 8)).shape == (1, 5, 5, 8)


def test_module_unsharded_equals_natten_structure():
    torch.manual_seed(3)
    ref = NeighborhoodAttention2D(12, 3, 5, 2, rel_pos_bias=True).double()
    dom = DomainNeighborhoodAttention2D(12, 3, 5, 2, rel_pos_bias=True).double()
    assert list(dom.state_dict()) == list(ref.state_dict())
    dom.load_state_dict(ref.state_dict())
    x = torch.randn(2, 11, 13, 12, dtype=torch.float64)
    assert rel(dom(x), ref(x)) < 1e-14
