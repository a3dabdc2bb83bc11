"""Attention over all tokens on shards (``halo.nn.ring``, ``halo.nn.attention_layers``).

- The ring's communication: ``ring_shift`` and ``gather_tokens`` move the right rows (bitwise) and pass the
  dot-product test ``sum_r <A x, y>_r == sum_r <x, A^T y>_r`` in float64, uneven counts and a rank with none.
- ``ring_sdpa`` is linear in ``v``: ``sum_r <O(v), y>_r == sum_r <v, dV(y)>_r`` (its backward is the adjoint of
  its forward, the whole ring included).
- ``ring_sdpa`` (ring and gathered) equals ``F.scaled_dot_product_attention`` on the global tokens, forward and
  backward (q, k, v and a float mask's gradients), float64, 3 ranks with 7 tokens (3 + 2 + 2), a rank with 0
  tokens, cross-attention with other key counts, boolean / additive / broadcast masks, causal, a scale; and the
  same data attended locally per shard is far off (so these tests fail if the ring is replaced by local attention).
- Bad input raises the same clear error on every rank: dropout, a mask of the wrong rows on one rank, mismatched
  shapes on one rank.
"""

import pytest
import torch
import torch.nn.functional as F
from _helpers import run_allow_failures
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

TOL = 1e-12  # float64, the same sums reordered (online softmax): rounding only


def _offs(sizes):
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def _mine(t, sizes, rank, dim=-2):
    o = _offs(sizes)
    return t.narrow(dim, o[rank], sizes[rank])


def _rel(a, b):
    """The max error relative to the reference's largest value; a reference that is zero in exact arithmetic
    (k_norm's bias: a shift of every key changes no softmax; its gradient is rounding, ~1e-17) is compared
    absolutely."""
    if not a.numel():
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0 if b.abs().max() < 1e-12 else 1e-300)).item()


# -- the communication --------------------------------------------------------------------------------------------

def _comm(rank, world, cases):
    import halo
    from halo.nn.ring import gather_tokens, ring_shift

    halo.initialize_domain_parallel(world, world)
    res = []
    for sizes, seed in cases:
        gen = torch.Generator().manual_seed(seed)
        n = sum(sizes)
        full = torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64)
        x = _mine(full, sizes, rank).clone().requires_grad_(True)
        out = ring_shift(x)
        want = _mine(full, sizes, (rank - 1) % world)
        y = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed * 31 + rank), dtype=torch.float64)
        (out * y).sum().backward()
        dots = torch.tensor([(out.detach() * y).sum().item(), (x.detach() * x.grad).sum().item()],
                            dtype=torch.float64)
        x2 = _mine(full, sizes, rank).clone().requires_grad_(True)
        g = gather_tokens(x2)
        yg = torch.randn(g.shape, generator=torch.Generator().manual_seed(seed * 7 + rank), dtype=torch.float64)
        (g * yg).sum().backward()
        dots_g = torch.tensor([(g.detach() * yg).sum().item(), (x2.detach() * x2.grad).sum().item()],
                              dtype=torch.float64)
        torch.distributed.all_reduce(dots)
        torch.distributed.all_reduce(dots_g)
        res.append((torch.equal(out.detach(), want), torch.equal(g.detach(), full), dots.tolist(), dots_g.tolist()))
    return res


@pytest.mark.parametrize("world,cases", [(3, [((3, 2, 2), 1), ((2, 0, 3), 2), ((0, 4, 1), 3)]), (2, [((5, 2), 4)])])
def test_ring_communication_moves_rows_and_is_its_adjoint(world, cases):
    for res in run_on_ranks(_comm, world, cases, timeout=120):
        for shifted, gathered, (ax_y, x_aty), (gx_y, x_gty) in res:
            assert shifted and gathered
            assert abs(ax_y - x_aty) <= 1e-12 * max(1.0, abs(ax_y)), (ax_y, x_aty)
            assert abs(gx_y - x_gty) <= 1e-12 * max(1.0, abs(gx_y)), (gx_y, x_gty)


# -- ring_sdpa against SDPA on the global tokens ------------------------------------------------------------------

def _case_tensors(case, gen):
    nq, nk = sum(case["q"]), sum(case["k"])
    q = torch.randn(2, 3, nq, 5, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, nk, 5, generator=gen, dtype=torch.float64)
    dv = case.get("dv", 5)  # d_v = d: unmasked blocks run on torch's fused kernel; d_v != d: the explicit scores
    v = torch.randn(2, 3, nk, dv, generator=gen, dtype=torch.float64)
    mask = None
    kind = case.get("mask")
    if kind == "bool":
        mask = torch.rand(nq, nk, generator=gen) > 0.4
        mask[1] = False  # a query row that attends to nothing: 0, as SDPA
    elif kind == "add":
        mask = torch.randn(3, nq, nk, generator=gen, dtype=torch.float64)
    elif kind == "row":
        mask = torch.randn(1, nk, generator=gen, dtype=torch.float64)  # one row broadcast over every query
    weight = torch.randn(2, 3, nq, dv, generator=gen, dtype=torch.float64)
    return q, k, v, mask, weight


def _sdpa(rank, world, cases):
    import halo
    from halo.nn.ring import ring_sdpa

    halo.initialize_domain_parallel(world, world)
    out = []
    for case in cases:
        gen = torch.Generator().manual_seed(case["seed"])
        q, k, v, mask, weight = _case_tensors(case, gen)
        causal, scale = case.get("causal", False), case.get("scale")
        qs, ks = case["q"], case["k"]
        # the reference: SDPA on the global tokens (one process)
        qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
        mf = mask.clone().requires_grad_(True) if mask is not None and mask.is_floating_point() else mask
        ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mf, is_causal=causal, scale=scale)
        (ref * weight).sum().backward()
        # sharded
        ql, kl, vl = (_mine(t, s, rank).clone().requires_grad_(True) for t, s in ((q, qs), (k, ks), (v, ks)))
        ml = None
        if mask is not None:
            ml = mask.clone()
            if case.get("mask_rows") == "local":
                ml = _mine(ml, qs, rank)
            if ml.is_floating_point():
                ml.requires_grad_(True)
        o = ring_sdpa(ql, kl, vl, attn_mask=ml, is_causal=causal, scale=scale, variant=case["variant"])
        (o * _mine(weight, qs, rank)).sum().backward()
        e = {"out": _rel(o.detach(), _mine(ref.detach(), qs, rank)), "dq": _rel(ql.grad, _mine(qf.grad, qs, rank)),
             "dk": _rel(kl.grad, _mine(kf.grad, ks, rank)), "dv": _rel(vl.grad, _mine(vf.grad, ks, rank))}
        if ml is not None and ml.requires_grad:
            g = ml.grad.clone()
            if case.get("mask_rows") == "local":
                e["dmask"] = _rel(g, _mine(mf.grad, qs, rank))
            else:  # each rank holds its query rows' share of the whole mask's gradient: their sum is the whole
                torch.distributed.all_reduce(g)
                e["dmask"] = _rel(g, mf.grad)
        # the same shards attended locally (what a model runs without halo): far off
        local = F.scaled_dot_product_attention(_mine(q, qs, rank), _mine(k, ks, rank), _mine(v, ks, rank)) \
            if qs[rank] and ks[rank] and mask is None and not causal else None
        e["local"] = _rel(local, _mine(ref.detach(), qs, rank)) if local is not None else None
        out.append((case, e))
    return out


def _cases(variant):
    return [
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 1, "variant": variant},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 10, "variant": variant, "dv": 4},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 2, "variant": variant, "causal": True},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 3, "variant": variant, "mask": "bool"},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 4, "variant": variant, "mask": "add", "mask_rows": "local",
         "scale": 0.37},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 5, "variant": variant, "mask": "add"},
        {"q": (3, 2, 2), "k": (3, 2, 2), "seed": 6, "variant": variant, "mask": "row"},
        {"q": (4, 0, 3), "k": (4, 0, 3), "seed": 7, "variant": variant, "causal": True},  # a rank with no tokens
        {"q": (3, 2, 2), "k": (1, 4, 0), "seed": 8, "variant": variant},  # cross-attention, other key counts
        {"q": (3, 2, 2), "k": (1, 4, 0), "seed": 13, "variant": variant, "causal": True, "dv": 3},
        {"q": (2, 5, 4), "k": (6, 1, 4), "seed": 9, "variant": variant, "causal": True},
    ]


@pytest.mark.parametrize("variant", ["ring", "gathered"])
def test_ring_sdpa_equals_sdpa_on_all_tokens(variant):
    for res in run_on_ranks(_sdpa, 3, _cases(variant), timeout=240):
        for case, e in res:
            local = e.pop("local")
            assert max(e.values()) < TOL, (case, e)
            if local is not None:
                assert local > 1e-2, (case, local)  # local attention is not the ring: the comparison can fail


def test_ring_sdpa_two_ranks_auto():
    cases = [{"q": (4, 3), "k": (4, 3), "seed": 11, "variant": "auto", "causal": True},
             {"q": (4, 3), "k": (4, 3), "seed": 12, "variant": "ring", "mask": "add"}]
    for res in run_on_ranks(_sdpa, 2, cases, timeout=120):
        for case, e in res:
            e.pop("local")
            assert max(e.values()) < TOL, (case, e)


def _linear_in_v(rank, world, sizes, variant):
    import halo
    from halo.nn.ring import ring_sdpa

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(5)
    n = sum(sizes)
    q, k, v = (torch.randn(1, 2, n, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    y = torch.randn(1, 2, n, 3, generator=gen, dtype=torch.float64)
    vl = _mine(v, sizes, rank).clone().requires_grad_(True)
    o = ring_sdpa(_mine(q, sizes, rank), _mine(k, sizes, rank), vl, is_causal=True, variant=variant)
    yl = _mine(y, sizes, rank)
    (o * yl).sum().backward()
    dots = torch.tensor([(o.detach() * yl).sum().item(), (vl.detach() * vl.grad).sum().item()], dtype=torch.float64)
    torch.distributed.all_reduce(dots)
    return dots.tolist()


@pytest.mark.parametrize("variant", ["ring", "gathered"])
def test_ring_sdpa_backward_is_the_adjoint(variant):
    for ax_y, x_aty in run_on_ranks(_linear_in_v, 3, (3, 0, 4), variant, timeout=120):
        assert abs(ax_y - x_aty) <= 1e-12 * max(1.0, abs(ax_y)), (ax_y, x_aty)


# -- bad input: the same error on every rank ---------------------------------------------------------------------

def _bad(rank, world, kind):
    import halo
    from halo.dist.transport import set_timeout
    from halo.nn.ring import ring_sdpa

    halo.initialize_domain_parallel(world, world)
    set_timeout(20)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k, v = q.clone(), q.clone()
    mask = None
    if kind == "dropout":
        return ring_sdpa(q, k, v, dropout_p=0.1)
    if kind == "mask_rows":
        mask = torch.ones(2 if rank == 1 else 3, 9, dtype=torch.bool)
    if kind == "shape" and rank == 2:
        v = torch.randn(1, 2, 2, 4, dtype=torch.float64)
    if kind == "mask_keys":
        mask = torch.ones(3, 7, dtype=torch.bool)
    return ring_sdpa(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind,words", [
    ("dropout", "dropout_p=0.1"), ("mask_rows", "attn_mask on rank 1 has 2 query rows"),
    ("shape", "ring_sdpa"), ("mask_keys", "global key count 9"),
])
def test_bad_input_raises_on_every_rank(kind, words):
    outcomes = run_allow_failures(_bad, 3, kind, timeout=90)
    for status, text in outcomes:
        assert status == "error", outcomes
        assert words in text and "HaloCommError" not in text, text


# -- the converted layers on a field's tokens ---------------------------------------------------------------------

class FieldAttention(nn.Module):
    """A conv, attention over all tokens of the field (as user code writes it), a conv."""

    def __init__(self, kind, attn, c=8):
        super().__init__()
        self.kind, self.inp, self.attn, self.out = kind, nn.Conv2d(3, c, 3, padding=1), attn, nn.Conv2d(c, 3, 3,
                                                                                                           padding=1)

    def forward(self, x, context=None):
        x = self.inp(x)
        b, c, h, w = x.shape
        if self.kind == "diffusers":
            y = self.attn(x) if context is None else self.attn(x, encoder_hidden_states=context)
        else:
            t = x.flatten(2).transpose(1, 2)
            if self.kind == "mha":
                a = self.attn(t, t, t, need_weights=False)[0]
            elif self.kind == "mha_seq_first":  # (L, B, E), need_weights left at its default
                s = t.transpose(0, 1)
                a = self.attn(s, s, s)[0].transpose(0, 1)
            else:
                a = self.attn(t)
            y = (t + a).transpose(1, 2).reshape(b, c, h, w)
        return self.out(y)


def _attention_module(kind):
    if kind in ("mha", "mha_seq_first"):
        return nn.MultiheadAttention(8, 2, batch_first=kind == "mha")
    import _thirdparty

    _thirdparty.load()
    if kind == "timm":
        from timm.layers import Attention

        return Attention(8, num_heads=2, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm)
    from diffusers.models.attention_processor import Attention

    if kind == "diffusers":
        return Attention(8, heads=2, dim_head=4, norm_num_groups=4, residual_connection=True, bias=True,
                         upcast_softmax=True, _from_deprecated_attn_block=True, eps=1e-6)
    return Attention(8, cross_attention_dim=6, heads=2, dim_head=4, bias=True)  # cross-attention


def _perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _layers(rank, world, kinds, h, w):
    import halo
    from halo.nn.attention_layers import attention_converters

    manager = halo.initialize_domain_parallel(world, world)
    out = []
    for kind in kinds:
        torch.manual_seed(0)
        ref = _perturbed(FieldAttention("diffusers" if kind == "cross" else kind, _attention_module(kind)).double(), 3)
        model = FieldAttention("diffusers" if kind == "cross" else kind, _attention_module(kind)).double()
        model.load_state_dict(ref.state_dict())
        keys = list(model.state_dict())
        halo.nn.convert_to_domain_parallel(model, manager, custom_converters=attention_converters(model))
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
        weight = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
        context = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64) if kind == "cross" else None
        offs = split_offsets(h, world)
        lo, hi = offs[rank], offs[rank + 1]
        xf = x.clone().requires_grad_(True)
        (ref(xf, context) * weight).sum().backward()
        xs = x[:, :, lo:hi].clone().requires_grad_(True)
        y = model(xs, context)
        (y * weight[:, :, lo:hi]).sum().backward()
        with torch.no_grad():
            yf = ref(x, context)
        e = {"out": _rel(y.detach(), yf[:, :, lo:hi]), "dx": _rel(xs.grad, xf.grad[:, :, lo:hi])}
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = p.grad.clone()
            torch.distributed.all_reduce(g)
            e[name] = _rel(g, q.grad)
        out.append((kind, type(model.attn).__name__, list(model.state_dict()) == keys, e))
    return out


LAYERS = {"mha": "DomainMultiheadAttention", "mha_seq_first": "DomainMultiheadAttention",
          "timm": "DomainTimmAttention", "diffusers": "DomainDiffusersAttention", "cross": "DomainDiffusersAttention"}


@pytest.mark.parametrize("world,h,w", [(3, 7, 4), (2, 5, 3)])
def test_converted_attention_layers_equal_unsharded(world, h, w):
    kinds = list(LAYERS)
    if world == 3:
        import _thirdparty

        if _thirdparty.missing():
            kinds = ["mha", "mha_seq_first"]
    for res in run_on_ranks(_layers, world, kinds, h, w, timeout=300):
        for kind, name, same_keys, e in res:
            assert name == LAYERS[kind] and same_keys, (kind, name)
            assert max(e.values()) < TOL, (kind, e)


def _mha_masks(rank, world, cases):
    import halo
    from halo.nn.attention_layers import DomainMultiheadAttention

    halo.initialize_domain_parallel(world, world)
    out = []
    for sizes, batch_first, masks, seed in cases:
        torch.manual_seed(seed)
        ref = _perturbed(nn.MultiheadAttention(8, 2, batch_first=batch_first).double(), seed)
        mha = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
        mha.load_state_dict(ref.state_dict())
        dom = DomainMultiheadAttention(mha)
        n = sum(sizes)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
        wy = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
        ww = torch.randn(2, n, n, generator=gen, dtype=torch.float64)
        kpm = am = None
        if "kpm" in masks:
            kpm = torch.zeros(2, n, dtype=torch.bool)
            kpm[0, 1], kpm[1, n - 1], kpm[1, 2] = True, True, True  # keys each sample ignores (torch: True = ignore)
        if "am" in masks:
            am = torch.rand(n, n, generator=gen) > 0.7  # torch: True = not allowed
            am.fill_diagonal_(False)
        tb = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
        xf = x.clone().requires_grad_(True)
        o_ref, w_ref = ref(tb(xf), tb(xf), tb(xf), key_padding_mask=kpm, attn_mask=am)
        ((tb(o_ref) * wy).sum() + (w_ref * ww).sum()).backward()
        xs = _mine(x, sizes, rank).clone().requires_grad_(True)
        o, w = dom(tb(xs), tb(xs), tb(xs), key_padding_mask=None if kpm is None else _mine(kpm, sizes, rank, -1),
                   attn_mask=am)  # the global mask: each rank takes its query rows
        ((tb(o) * _mine(wy, sizes, rank)).sum() + (w * _mine(ww, sizes, rank)).sum()).backward()
        e = {"out": _rel(tb(o).detach(), _mine(tb(o_ref).detach(), sizes, rank)),
             "weights": _rel(w.detach(), _mine(w_ref.detach(), sizes, rank)),
             "dx": _rel(xs.grad, _mine(xf.grad, sizes, rank))}
        for (name, p), q in zip(mha.named_parameters(), ref.parameters(), strict=True):
            g = p.grad.clone()
            torch.distributed.all_reduce(g)
            e[name] = _rel(g, q.grad)
        out.append(e)
    return out


def test_multihead_attention_masks_and_weights():
    cases = [((3, 2, 2), True, ("kpm",), 1), ((3, 2, 2), False, ("am",), 2), ((4, 0, 3), True, ("kpm", "am"), 3)]
    for res in run_on_ranks(_mha_masks, 3, cases, timeout=180):
        for e in res:
            assert max(e.values()) < TOL, e


def _on_mesh(rank, world, kind):
    import halo
    from halo.nn.attention_layers import attention_converters

    mesh = halo.DomainMesh((2, 2))
    model = FieldAttention(kind, _attention_module(kind)).double()
    try:
        halo.nn.convert_to_domain_parallel(model, mesh=mesh, custom_converters=attention_converters(model) or None)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind,words", [("mha", "MultiheadAttention"), ("timm", "latitude rows only")])
def test_attention_on_a_latitude_longitude_mesh_is_refused(kind, words):
    if kind == "timm":
        import _thirdparty

        if _thirdparty.missing():
            pytest.skip(f"timm is not installed: {_thirdparty.missing()}")
    for msg in run_on_ranks(_on_mesh, 4, kind, timeout=120):
        assert msg is not None and words in msg, msg


def _low_precision(rank, world, sizes):
    import halo
    from halo.nn.ring import ring_sdpa

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(3)
    n = sum(sizes)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch_bf16 = F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True).double()
    out = {}
    for variant in ("ring", "gathered"):
        got = ring_sdpa(*(_mine(t, sizes, rank).bfloat16() for t in (q, k, v)), is_causal=True, variant=variant)
        out[variant] = (str(got.dtype), _rel(got.double(), _mine(want, sizes, rank)))
    return out, _rel(_mine(torch_bf16, sizes, rank), _mine(want, sizes, rank))


def test_bf16_inputs_return_bf16_as_accurate_as_torch():
    """bf16 shards: the ring sums in fp32 (invariant 5), so it is no less accurate than torch's own bf16 SDPA on
    all tokens (both against float64; bf16 rounds its inputs and output to ~4e-3)."""
    for res, torch_err in run_on_ranks(_low_precision, 3, (4, 2, 3), timeout=120):
        for variant, (dtype, err) in res.items():
            assert dtype == "torch.bfloat16", (variant, dtype)
            assert err <= max(2 * torch_err, 1e-2), (variant, err, torch_err)


class UserAttention(nn.Module):
    """Attention over all tokens written in a model's own forward: with ``halo.nn.ring.ring_sdpa`` (exact on
    shards) or with ``F.scaled_dot_product_attention`` (which the guard refuses on a field's tokens)."""

    def __init__(self, c=8, heads=2, ring=True):
        super().__init__()
        self.inp, self.qkv, self.proj = nn.Conv2d(3, c, 3, padding=1), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.heads, self.ring = heads, ring

    def forward(self, x):
        from halo.nn.ring import ring_sdpa

        x = self.inp(x)
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = (u.reshape(b, h * w, self.heads, c // self.heads).transpose(1, 2) for u in self.qkv(t).chunk(3, -1))
        a = ring_sdpa(q, k, v) if self.ring else F.scaled_dot_product_attention(q, k, v)
        y = t + self.proj(a.transpose(1, 2).reshape(b, h * w, c))
        return y.transpose(1, 2).reshape(b, c, h, w)


def _user_code(rank, world, h, w):
    import halo

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = _perturbed(UserAttention().double(), 4)
    model = UserAttention().double()
    model.load_state_dict(ref.state_dict())
    halo.nn.convert_to_domain_parallel(model, manager)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, 8, h, w, generator=gen, dtype=torch.float64)
    lo, hi = split_offsets(h, world)[rank:rank + 2]
    xf = x.clone().requires_grad_(True)
    (ref(xf) * weight).sum().backward()
    xs = x[:, :, lo:hi].clone().requires_grad_(True)
    y = model(xs)
    (y * weight[:, :, lo:hi]).sum().backward()
    with torch.no_grad():
        e = {"out": _rel(y, ref(x)[:, :, lo:hi]), "dx": _rel(xs.grad, xf.grad[:, :, lo:hi])}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        e[name] = _rel(g, q.grad)
    # F.scaled_dot_product_attention in the same place: the guard computes it by ring_sdpa (halo.guard._policy),
    # on the guarded first call and the recorded second one
    plain = UserAttention(ring=False).double()
    plain.load_state_dict(ref.state_dict())
    halo.nn.convert_to_domain_parallel(plain, manager)
    for call in range(2):
        xp = x[:, :, lo:hi].clone().requires_grad_(True)
        yp = plain(xp)
        (yp * weight[:, :, lo:hi]).sum().backward()
        with torch.no_grad():
            e[f"sdpa out {call}"] = _rel(yp, ref(x)[:, :, lo:hi])
            e[f"sdpa dx {call}"] = _rel(xp.grad, xf.grad[:, :, lo:hi])
    return e


def test_ring_sdpa_in_user_code_of_a_converted_model():
    for e in run_on_ranks(_user_code, 3, 7, 4, timeout=120):
        assert max(e.values()) < TOL, e
