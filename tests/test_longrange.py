"""Long-range attention on H-shards (``halo.nn.longrange``): the regroup all-to-all and CREDIT's CrossFormer attention.

- ``regroup``: on 2 and 3 gloo ranks, uneven sizes in and out, a random permutation and CrossFormer's long-range
  one: forward equals the permuted global tensor (bitwise), and the dot-product test
  ``sum_r <A x, y>_r == sum_r <x, A^T y>_r`` (backward through autograd) holds in float64.
- CrossFormer: modules written here to CREDIT's exact structure and names (``credit.models.crossformer``'s
  ``LayerNorm``, ``FeedForward``, ``DynamicPositionBias``, ``Attention``, ``Transformer``; CREDIT is not installable
  and einops is not installed, so the rearranges are reshapes/permutes, transcribed independently of halo's).
  ``DomainCrossFormerAttention`` (short and long) equals the unsharded module forward and backward on 2 and 3 ranks
  (input grads; parameter grads summed over the domain group); a converted ``Transformer`` (short + FF + long + FF)
  keeps its state_dict keys and trains for three SGD steps equal to the unsharded one.
- Short windows on shards that are not whole windows (a conv's balanced split): the rows regroup to the split of
  whole windows (fewer windows than ranks: the last ranks hold none) and back, exact as above.
- Errors: a height that is not a multiple of the short window, and a height or width that is not a multiple of
  the long window, raise the same error naming the sizes on every rank.
- Axial attention over H: ``rows_to_columns`` (H-shards -> W-shards, a regroup) gives every rank whole columns
  (bitwise), passes the dot-product test, ``columns_to_rows`` undoes it; ``nn.MultiheadAttention`` along H of every
  column between the two equals the unsharded one forward and backward (parameter grads summed) on 2 and 3 ranks.
"""

import random

import pytest
import torch
from torch import nn

from halo.nn.longrange import DomainCrossFormerAttention, crossformer_attention_reference
from halo.plan.partition import split_offsets, split_sizes
from halo.testing import run_on_ranks

TOL = 1e-12
CREDIT = "credit.models.crossformer"


# -- CREDIT's CrossFormer pieces (credit/models/crossformer.py), einops written out ------------------------------

class Squeeze(nn.Module):
    """einops ``Rearrange("... () -> ...")``."""

    def forward(self, x):
        return x.squeeze(-1)


class DynamicPositionBias(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(2, dim), nn.LayerNorm(dim), nn.ReLU(),
            nn.Linear(dim, dim), nn.LayerNorm(dim), nn.ReLU(),
            nn.Linear(dim, dim), nn.LayerNorm(dim), nn.ReLU(),
            nn.Linear(dim, 1), Squeeze())

    def forward(self, x):
        return self.layers(x)


class LayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.b = nn.Parameter(torch.zeros(1, dim, 1, 1))

    def forward(self, x):
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) / (var + self.eps).sqrt() * self.g + self.b


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        self.layers = nn.Sequential(LayerNorm(dim), nn.Conv2d(dim, dim * mult, 1), nn.GELU(), nn.Dropout(dropout),
                                    nn.Conv2d(dim * mult, dim, 1))

    def forward(self, x):
        return self.layers(x)


def rearrange_short(x, s):  # "b d (h s1) (w s2) -> (b h w) d s1 s2"
    b, d, hh, ww = x.shape
    x = x.reshape(b, d, hh // s, s, ww // s, s)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b * (hh // s) * (ww // s), d, s, s)


def unrearrange_short(x, b, h, w):  # "(b h w) d s1 s2 -> b d (h s1) (w s2)"
    _, d, s, _ = x.shape
    return x.reshape(b, h, w, d, s, s).permute(0, 3, 1, 4, 2, 5).reshape(b, d, h * s, w * s)


def rearrange_long(x, l1):  # "b d (l1 h) (l2 w) -> (b h w) d l1 l2"
    b, d, hh, ww = x.shape
    x = x.reshape(b, d, l1, hh // l1, l1, ww // l1)
    return x.permute(0, 3, 5, 1, 2, 4).reshape(b * (hh // l1) * (ww // l1), d, l1, l1)


def unrearrange_long(x, b, h, w):  # "(b h w) d l1 l2 -> b d (l1 h) (l2 w)"
    _, d, s, _ = x.shape
    return x.reshape(b, h, w, d, s, s).permute(0, 3, 4, 1, 5, 2).reshape(b, d, s * h, s * w)


class Attention(nn.Module):
    def __init__(self, dim, attn_type, window_size, dim_head=32, dropout=0.0):
        super().__init__()
        assert attn_type in {"short", "long"}
        heads = dim // dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads
        self.attn_type = attn_type
        self.window_size = window_size
        self.norm = LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.to_qkv = nn.Conv2d(dim, inner_dim * 3, 1, bias=False)
        self.to_out = nn.Conv2d(inner_dim, dim, 1)
        self.dpb = DynamicPositionBias(dim // 4)
        pos = torch.arange(window_size)
        grid = torch.stack(torch.meshgrid(pos, pos, indexing="ij"))
        grid = grid.reshape(2, -1).t()  # "c i j -> (i j) c"
        rel_pos = grid[:, None] - grid[None, :]
        rel_pos += window_size - 1
        rel_pos_indices = (rel_pos * torch.tensor([2 * window_size - 1, 1])).sum(dim=-1)
        self.register_buffer("rel_pos_indices", rel_pos_indices, persistent=False)

    def forward(self, x):
        *_, height, width = x.shape
        heads, wsz, device = self.heads, self.window_size, x.device
        b = x.shape[0]
        x = self.norm(x)
        if self.attn_type == "short":
            x = rearrange_short(x, wsz)
        else:
            x = rearrange_long(x, wsz)
        q, k, v = self.to_qkv(x).chunk(3, dim=1)
        q, k, v = (t.reshape(t.shape[0], heads, t.shape[1] // heads, wsz * wsz).transpose(-1, -2)
                   for t in (q, k, v))  # "b (h d) x y -> b h (x y) d"
        q = q * self.scale
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        pos = torch.arange(-wsz, wsz + 1, device=device)
        rel_pos = torch.stack(torch.meshgrid(pos, pos, indexing="ij"))
        rel_pos = rel_pos.reshape(2, -1).t().to(x.dtype)  # "c i j -> (i j) c"
        biases = self.dpb(rel_pos)
        sim = sim + biases[self.rel_pos_indices]
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(-1, -2).reshape(out.shape[0], -1, wsz, wsz)  # "b h (x y) d -> b (h d) x y"
        out = self.to_out(out)
        if self.attn_type == "short":
            return unrearrange_short(out, b, height // wsz, width // wsz)
        return unrearrange_long(out, b, height // wsz, width // wsz)


class Transformer(nn.Module):
    def __init__(self, dim, *, local_window_size, global_window_size, depth=4, dim_head=32, attn_dropout=0.0,
                 ff_dropout=0.0):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, attn_type="short", window_size=local_window_size, dim_head=dim_head,
                          dropout=attn_dropout),
                FeedForward(dim, dropout=ff_dropout),
                Attention(dim, attn_type="long", window_size=global_window_size, dim_head=dim_head,
                          dropout=attn_dropout),
                FeedForward(dim, dropout=ff_dropout),
            ]))

    def forward(self, x):
        for short_attn, short_ff, long_attn, long_ff in self.layers:
            x = short_attn(x) + x
            x = short_ff(x) + x
            x = long_attn(x) + x
            x = long_ff(x) + x
        return x


for _cls in (Squeeze, DynamicPositionBias, LayerNorm, FeedForward, Attention, Transformer):
    _cls.__module__ = CREDIT  # as the converter sees CREDIT's classes


def rel(a, b):
    """Max error relative to the largest entry, at least 1 (some gradients are 0 in exact arithmetic: the output
    bias of the position MLP shifts every logit alike, so softmax removes it; there only roundoff is left)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _perturb(m, seed):
    """Random parameters (the zero/one inits would hide mistakes in g, b and biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return m


# -- one process ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn_type,window", [("short", 4), ("long", 3), ("short", 2), ("long", 4)])
def test_reference_and_module_equal_credit_in_one_process(attn_type, window):
    torch.manual_seed(0)
    m = _perturb(Attention(16, attn_type, window, dim_head=8).double(), 1)
    x = torch.randn(2, 16, 12, 24, dtype=torch.float64)
    ref = m(x)
    assert rel(crossformer_attention_reference(m, x), ref) < 1e-14
    dom = DomainCrossFormerAttention(m)
    assert list(dom.state_dict()) == list(m.state_dict())
    assert rel(dom(x), ref) < 1e-14


# -- multi-rank -------------------------------------------------------------------------------------------------

def _regroup(rank, world, cases):
    import halo
    from halo.dist.comm import comm_group
    from halo.nn.longrange import long_range_plan, regroup, regroup_plan

    manager = halo.initialize_domain_parallel(world, world)
    cg = comm_group(manager.domain_group)
    res = []
    for kind, h, arg, seed in cases:
        gen = torch.Generator().manual_seed(seed)
        sizes_in = split_sizes(h, world)
        if kind == "random":
            source = list(range(h))
            random.Random(seed).shuffle(source)
            sizes_out = arg
            plan = regroup_plan(cg, -2, sizes_in, sizes_out, source)
        else:
            plan = long_range_plan(cg, -2, sizes_in, arg)
            groups = h // arg
            per = split_sizes(groups, world)
            sizes_out = [n * arg for n in per]
            source = [t * groups + g for g in range(groups) for t in range(arg)]
        full = torch.randn(2, 3, h, 5, generator=gen, dtype=torch.float64)
        ys = torch.randn(2, 3, h, 5, generator=gen, dtype=torch.float64)
        off_in = [sum(sizes_in[:r]) for r in range(world + 1)]
        off_out = [sum(sizes_out[:r]) for r in range(world + 1)]
        x = full[:, :, off_in[rank]:off_in[rank + 1]].clone().requires_grad_(True)
        out = regroup(x, plan)
        want = full[:, :, source][:, :, off_out[rank]:off_out[rank + 1]]
        y = ys[:, :, off_out[rank]:off_out[rank + 1]]
        (out * y).sum().backward()
        lhs = torch.tensor([(out.detach() * y).sum().item(), (x.detach() * x.grad).sum().item()],
                           dtype=torch.float64)
        torch.distributed.all_reduce(lhs)
        res.append((torch.equal(out.detach(), want), lhs[0].item(), lhs[1].item()))
    return res


@pytest.mark.parametrize("world,cases", [
    (3, [("random", 23, [5, 11, 7], 1), ("random", 23, [8, 8, 7], 2), ("long", 24, 3, 3), ("long", 12, 4, 4),
         ("long", 6, 3, 5)]),
    (2, [("random", 15, [3, 12], 6), ("long", 18, 3, 7)]),
])
def test_regroup_forward_and_dot_product_adjoint(world, cases):
    for res in run_on_ranks(_regroup, world, cases, timeout=120):
        for same, ax_y, x_aty in res:
            assert same
            assert abs(ax_y - x_aty) <= 1e-12 * max(1.0, abs(ax_y)), (ax_y, x_aty)


def _attention(rank, world, cases):
    import torch.distributed as dist

    import halo

    halo.initialize_domain_parallel(world, world)
    errs = []
    for attn_type, window, h, w, seed in cases:
        torch.manual_seed(seed)
        ref = _perturb(Attention(16, attn_type, window, dim_head=8).double(), seed)
        dom = DomainCrossFormerAttention(_perturb(Attention(16, attn_type, window, dim_head=8).double(), seed))
        gen = torch.Generator().manual_seed(seed + 1)
        full = torch.randn(2, 16, h, w, generator=gen, dtype=torch.float64)
        weight = torch.randn(2, 16, h, w, generator=gen, dtype=torch.float64)
        offs = split_offsets(h, world)
        lo, hi = offs[rank], offs[rank + 1]
        xf = full.clone().requires_grad_(True)
        out_ref = ref(xf)
        (out_ref * weight).sum().backward()
        x = full[:, :, lo:hi].clone().requires_grad_(True)
        out = dom(x)
        (out * weight[:, :, lo:hi]).sum().backward()
        e = [rel(out.detach(), out_ref.detach()[:, :, lo:hi]), rel(x.grad, xf.grad[:, :, lo:hi])]
        for p, q in zip(dom.parameters(), ref.parameters(), strict=True):
            g = p.grad.clone()
            dist.all_reduce(g)
            e.append(rel(g, q.grad))
        errs.append(max(e))
    return errs


@pytest.mark.parametrize("world,cases", [
    # short windows on shards that are not whole windows (7 + 7 + 6 rows, windows of 4; 3 + 3, windows of 2): the
    # rows regroup to whole windows (8 + 8 + 4; 4 + 2) and back; 3 + 3 + 2 rows, 2 windows of 4: 4 + 4 + 0; long
    # range with 2 groups over 3 ranks: 4 + 4 + 0 rows
    (3, [("short", 4, 24, 12, 1), ("long", 3, 24, 12, 2), ("long", 4, 12, 8, 3), ("short", 3, 9, 6, 4),
         ("short", 4, 20, 12, 7), ("short", 4, 8, 8, 9), ("long", 4, 8, 8, 10)]),
    (2, [("short", 3, 18, 9, 5), ("long", 3, 21, 9, 6), ("short", 2, 6, 8, 8)]),
])
def test_crossformer_attention_equals_unsharded(world, cases):
    for errs in run_on_ranks(_attention, world, cases, timeout=180):
        assert max(errs) < TOL, errs


def _block(rank, world, h, w, steps):
    import halo
    from halo.parallel.reduce import local_share, sync_domain_gradients

    manager = halo.initialize_domain_parallel(world, world)
    torch.manual_seed(0)
    ref = _perturb(Transformer(16, local_window_size=4, global_window_size=3, depth=1, dim_head=8).double(), 7)
    model = Transformer(16, local_window_size=4, global_window_size=3, depth=1, dim_head=8).double()
    model.load_state_dict(ref.state_dict())
    keys = list(model.state_dict())
    halo.nn.convert_to_domain_parallel(model, manager)
    kinds = [type(m).__name__ for m in model.layers[0]]
    assert kinds == ["DomainCrossFormerAttention", "FeedForward", "DomainCrossFormerAttention", "FeedForward"], kinds
    assert list(model.state_dict()) == keys
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    offs = split_offsets(h, world)
    lo, hi = offs[rank], offs[rank + 1]
    errs = []
    for _ in range(steps):
        x = torch.randn(2, 16, h, w, generator=gen, dtype=torch.float64)
        target = torch.randn(2, 16, h, w, generator=gen, dtype=torch.float64)
        out_ref = ref(x)
        out = model(x[:, :, lo:hi].clone())
        opt_ref.zero_grad()
        opt.zero_grad()
        ((out_ref - target) ** 2).sum().div(target.numel()).backward()  # the mean over the whole field
        local_share(((out - target[:, :, lo:hi]) ** 2).sum().div(target.numel())).backward()  # this rank's share
        sync_domain_gradients(model)
        errs.append(rel(out.detach(), out_ref.detach()[:, :, lo:hi]))
        opt_ref.step()
        opt.step()
    errs += [rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    halo.nn.revert_domain_parallel(model)
    assert type(model.layers[0][0]).__name__ == "Attention"
    return errs


@pytest.mark.parametrize("world,h", [(3, 24), (2, 24)])
def test_crossformer_block_trains_like_unsharded(world, h):
    for errs in run_on_ranks(_block, world, h, 12, 3, timeout=240):
        assert max(errs) < TOL, errs


def _errors(rank, world, attn_type, window, h):
    import halo

    halo.initialize_domain_parallel(world, world)
    dom = DomainCrossFormerAttention(Attention(16, attn_type, window, dim_head=8))
    x = torch.zeros(1, 16, split_sizes(h, world)[rank], 12)
    try:
        dom(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("attn_type,window,h,match", [
    ("short", 4, 18, "has 18 rows along H, not a multiple of window_size=4 (the shards hold [6, 6, 6]"),
    ("long", 3, 25, "the field has 25 rows along H, not a multiple of window_size=3"),
    ("long", 5, 25, "the field has 12 columns along W, not a multiple of window_size=5"),
])
def test_errors_are_the_same_on_every_rank(attn_type, window, h, match):
    msgs = run_on_ranks(_errors, 3, attn_type, window, h, timeout=120)
    assert len(set(msgs)) == 1, msgs
    assert match in msgs[0], msgs[0]


# -- axial attention over H: rows <-> columns ---------------------------------------------------------------------

def _axial_apply(mha, x):
    """Self-attention along H of every column of ``x`` (B, C, H, W)."""
    b, c, h, w = x.shape
    t = x.permute(0, 3, 2, 1).reshape(b * w, h, c)
    return mha(t, t, t, need_weights=False)[0].reshape(b, w, h, c).permute(0, 3, 2, 1)


def _axial(rank, world, h, w):
    import torch.distributed as dist

    import halo
    from halo.nn.longrange import columns_to_rows, rows_to_columns

    halo.initialize_domain_parallel(world, world)
    gen = torch.Generator().manual_seed(h)
    full = torch.randn(2, 6, h, w, generator=gen, dtype=torch.float64)
    ys = torch.randn(2, 6, h, w, generator=gen, dtype=torch.float64)
    ro, co = split_offsets(h, world), split_offsets(w, world)
    x = full[:, :, ro[rank]:ro[rank + 1]].clone().requires_grad_(True)
    cols = rows_to_columns(x)
    same = torch.equal(cols.detach(), full[..., co[rank]:co[rank + 1]])
    y = ys[..., co[rank]:co[rank + 1]]
    (cols * y).sum().backward()
    dots = torch.tensor([(cols.detach() * y).sum().item(), (x.detach() * x.grad).sum().item()], dtype=torch.float64)
    dist.all_reduce(dots)
    back = columns_to_rows(cols.detach())
    same = same and torch.equal(back, full[:, :, ro[rank]:ro[rank + 1]])
    # axial attention over H: attention along whole columns, local after the regroup
    torch.manual_seed(0)
    ref = _perturb(nn.MultiheadAttention(6, 2, batch_first=True).double(), 3)
    mha = _perturb(nn.MultiheadAttention(6, 2, batch_first=True).double(), 3)
    xf = full.clone().requires_grad_(True)
    out_ref = _axial_apply(ref, xf)
    (out_ref * ys).sum().backward()
    xs = full[:, :, ro[rank]:ro[rank + 1]].clone().requires_grad_(True)
    out = columns_to_rows(_axial_apply(mha, rows_to_columns(xs)))
    (out * ys[:, :, ro[rank]:ro[rank + 1]]).sum().backward()
    errs = [rel(out.detach(), out_ref.detach()[:, :, ro[rank]:ro[rank + 1]]),
            rel(xs.grad, xf.grad[:, :, ro[rank]:ro[rank + 1]])]
    for p, q in zip(mha.parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        errs.append(rel(g, q.grad))
    return same, dots[0].item(), dots[1].item(), max(errs)


@pytest.mark.parametrize("world,h,w", [(3, 23, 7), (2, 10, 5)])
def test_axial_attention_over_h(world, h, w):
    for same, ax_y, x_aty, err in run_on_ranks(_axial, world, h, w, timeout=120):
        assert same
        assert abs(ax_y - x_aty) <= 1e-12 * max(1.0, abs(ax_y)), (ax_y, x_aty)
        assert err < TOL, err
