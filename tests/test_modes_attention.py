"""The modes matrix, part two: attention layers, a 3-d conv, dropout and shard/gather, in every mode users train in.

``tests/test_modes.py`` runs the common 2-d layer kinds through every mode; this file runs the same modes on
``AttnNet``, which holds the layer kinds that file lacks: a shifted Swin window-attention block (``halo.nn.window``),
NATTEN neighbourhood attention with dilation and a relative position bias (``halo.nn.neighborhood``), CrossFormer's
short- and long-distance attention (``halo.nn.longrange``: the long one regroups rows across ranks),
``nn.MultiheadAttention`` over all tokens (ring attention: ``halo.nn.attention_layers``), a 3-d conv (``DomainConv3d``)
and halo's dropout. The Swin, NATTEN and CrossFormer layers are the structural copies the layer tests use
(``test_swin``, ``test_neighborhood``, ``test_longrange``: timm's, NATTEN's and CREDIT's names and attributes,
recognised by the converter). The converted model is wrapped in ``halo.shard`` (granularity 8 = patch 2 x window 4:
windows never straddle ranks) and ``halo.gather``, so the modes also run through shard and gather (autograd, memory
format, dtype, compile); the loss is then replicated (counted once) and the input gradient is the whole field's. The 56
x 16 input is 28 x 8 after the patch embedding, whose rows the block split keeps: 16 + 12 on 2 ranks, 12 + 8 + 8 on 3
(uneven, whole 4-row windows); the 3-d conv's output is the balanced split (14 + 14, 10 + 9 + 9), which is why it has no
residual around it (a block split plus a balanced one do not add).
Dropout masks are compared through the outputs, as in test_modes.py (the reference's dropout draws halo's masks
for the whole field).
Everything is compared with the unsharded model in the same mode, in the same process, from the same parameters:
forward, input gradient, parameter gradients summed over the domain group; output dtype and memory format as
torch's. ``torch.compile`` (aot_eager, inductor) is compared with the eager unsharded model. aot_eager compiles the
whole ``Sharded`` model (graph breaks at shard, gather and the long-range regroup, which are autograd Functions, not
custom ops). Inductor compiles C++ on CPU: its cells compile the converted ``TinyAttnNet`` (a patch embedding, the
Swin block, a conv) with ``fullgraph=True``, between eager shard and gather.

halo's kernels run as in test_modes.py (the torch reference, the Triton interpreter in the inductor cells). The loop
over the modes, the comparison and the per-cell verdict are tests/_modes.py's, shared with test_modes.py.

Tolerances are test_modes.py's (its docstring gives the argument): 1e-10 in float64, 1e-4 in float32, 6e-2 / 1e-2 of
the largest reference magnitude under bf16 / fp16 autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _modes import MODES, TOL, Harness, check_cell, rel, run_modes, whole_field_dropouts
from test_longrange import Attention as CrossAttention
from test_neighborhood import NeighborhoodAttention2D
from test_swin import SwinTransformerBlock
from torch import nn

from halo.testing import run_on_ranks

#: above the longest rank timeout of this file (cold inductor compiles): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(1000)


H, W, C, P, G = 56, 16, 2, 2, 8  # rows, columns, channels, patch, split granularity (patch x the Swin window)
WS = G // P  # the attention windows, at the patch grid (28 x 8)



class AttnNet(nn.Module):
    """(B, 2, 56, 16): patch embedding (2) -> Swin block (shifted, window 4) -> CrossFormer short and long (window 4)
    -> multi-head attention over all 224 tokens (ring attention) -> NATTEN (kernel 3, dilation 2, rpb) -> 3-d conv on
    (B, 2, 4, 28, 8) -> dropout -> conv."""

    def __init__(self) -> None:
        super().__init__()
        d = 8
        self.inp = nn.Conv2d(C, d, P, stride=P)  # a patch embedding: keeps the block split
        self.swin = SwinTransformerBlock(d, (H // P, W // P), num_heads=2, window_size=WS, shift_size=WS // 2,
                                         mlp_ratio=2.0)
        self.na = NeighborhoodAttention2D(d, 2, 3, dilation=2, rel_pos_bias=True)
        self.short = CrossAttention(d, "short", WS, dim_head=4)
        self.long = CrossAttention(d, "long", WS, dim_head=4)
        self.glob = nn.MultiheadAttention(d, 2, batch_first=True)  # over all tokens: ring attention
        self.c3 = nn.Conv3d(2, 2, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Conv2d(d, C, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.inp(x)
        a = self.swin(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # timm's (B, H, W, C) layout
        a = self.short(a) + a
        a = self.long(a) + a
        b, d, h, w = a.shape
        t = a.flatten(2).transpose(1, 2)  # (B, tokens, d), the tokens row-major: this rank's rows' tokens
        a = (t + self.glob(t, t, t, need_weights=False)[0]).transpose(1, 2).reshape(b, d, h, w)
        t = a.permute(0, 2, 3, 1)  # NATTEN's layout
        a = (self.na(t) + t).permute(0, 3, 1, 2)
        # No residual around the conv: a conv's output is the balanced split, not the input's block split.
        b, d, h, w = a.shape
        a = self.c3(a.reshape(b, 2, d // 2, h, w))
        a = a.reshape(b, d, *a.shape[-2:])
        return self.out(self.drop(F.gelu(a)))


class TinyAttnNet(nn.Module):
    """What inductor compiles (fullgraph): patch embedding -> Swin block (its rolls: halo's exchange custom op) ->
    a conv."""

    def __init__(self) -> None:
        super().__init__()
        d = 4
        self.inp = nn.Conv2d(C, d, P, stride=P)
        self.swin = SwinTransformerBlock(d, (H // P, W // P), num_heads=1, window_size=WS, shift_size=WS // 2,
                                         mlp_ratio=1.0)
        self.out = nn.Conv2d(d, C, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.swin(self.inp(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.out(a)


class Sharded(nn.Module):
    """The converted model between ``halo.shard`` (granularity ``G``) and ``halo.gather``: whole field in, whole
    field out on every rank (replicated)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        object.__setattr__(self, "run", net)  # what runs the net (a compiled net: not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import halo

        return halo.gather(self.run(halo.shard(x, -2, granularity=G)), -2)


def _randomize(model: nn.Module) -> nn.Module:
    """Parameters of order one (zero-initialised biases and position tables would hide their paths)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.3)
    return model


# -- what every rank runs: tests/_modes.py's shared loop, with this file's model and cells --------------------------

class AttnHarness(Harness):
    """The converted model inside :class:`Sharded` takes the whole field and gives the whole output on every rank
    (replicated); its parameters are the inner net's."""

    net, tiny, rows = AttnNet, TinyAttnNet, H

    def models(self, cls, dtype, fmt=torch.contiguous_format):
        from halo.nn import convert_to_domain_parallel

        torch.manual_seed(0)
        ref = _randomize(cls().double()).to(dtype)
        for p in ref.parameters():  # channels_last: the 2-d convs' weights (Module.to refuses the 3-d conv's)
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=fmt)
        dom = Sharded(convert_to_domain_parallel(copy.deepcopy(ref), self.manager))
        whole_field_dropouts(ref)
        return ref, dom

    def data(self, dtype, fmt=torch.contiguous_format, seed=1):
        g = torch.Generator().manual_seed(seed)
        xf = torch.randn(2, C, H, W, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
        wf = torch.randn(2, C, H // P, W // P, generator=g, dtype=torch.float64)  # the output's shape
        return xf, wf

    def part(self, t):
        return t  # whole in, whole out

    def params(self, dom):
        return dict(dom.net.named_parameters())

    def inductor(self, dom):
        """The inner net compiled (fullgraph), between eager shard and gather."""
        object.__setattr__(dom, "run", torch.compile(dom.net, backend="inductor", fullgraph=True))
        return dom, None

    def fp16_scaler(self, dom, ref):
        return _fp16_scaler(self, dom, ref)


def _modes_on_rank(rank: int, world: int, modes: list[str]) -> dict:
    return run_modes(AttnHarness(rank, world), modes)


def _fp16_scaler(h: AttnHarness, dom: nn.Module, ref: nn.Module) -> dict:
    """fp16 autocast with ``torch.amp.GradScaler("cpu")``: the scaled backward on both models, the unscaled
    gradients compared, one optimizer step each, the parameters compared after it. (The overflow on one rank is
    test_modes.py's: it does not depend on the layers.)"""
    import torch.distributed as dist

    fp16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    xf, w = h.data(torch.float32)
    x, xr = xf.clone().requires_grad_(True), xf.clone().requires_grad_(True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dom, ref)]
    y, loss = h.step(dom, x, w, fp16)
    yr, loss_r = h.step(ref, xr, w, fp16)
    res: dict = {"y": rel(y, yr), "dtype": (str(y.dtype), str(yr.dtype))}
    scalers[0].scale(loss).backward()
    scalers[1].scale(loss_r).backward()
    res["gx"] = rel(x.grad, xr.grad)
    res["gx_dtype"] = (str(x.grad.dtype), str(xr.grad.dtype))
    for opt, scaler in zip(opts, scalers, strict=True):
        scaler.unscale_(opt)
    res["gp"], res["gp_note"] = h.grads(dom, ref)  # sums dom's gradients over the domain (in place: on a copy)
    for p in dom.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    for scaler, opt in zip(scalers, opts, strict=True):
        scaler.step(opt)
        scaler.update()
    res["stepped"] = all(scaler.get_scale() == 2.0 ** 4 for scaler in scalers)  # no overflow: both stepped
    res["params_after_step"] = max(rel(p, q) for p, q in zip(dom.net.parameters(), ref.parameters(), strict=True))
    return res


# -- the parent: one rank launch per world size, cached ------------------------------------------------------------

_RESULTS: dict[int, list[dict]] = {}

# Inductor runs at 2 ranks only: its C++ compilation dominates the file's time (measured under load: 90-230 s a
# cell), and the 3-rank plans are the same code, which every other cell runs at 3 ranks (it passed
# at 3 ranks run by hand: inductor_channels_last, 3 ranks, 1e-16).
_CELLS = [(m, w) for w in (2, 3) for m in MODES if not (m.startswith("inductor") and w == 3)]


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_on_ranks(_modes_on_rank, world, [m for m, w in _CELLS if w == world], timeout=900)
    return _RESULTS[world]


@pytest.mark.parametrize(("mode", "world"), _CELLS)
def test_mode(mode: str, world: int) -> None:
    per_rank = [r[mode] for r in _results(world)]
    check_cell(mode, per_rank)
    if mode == "fp16_scaler":
        assert all(r["stepped"] and r["params_after_step"] <= TOL["fp16"] for r in per_rank), per_rank
