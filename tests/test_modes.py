"""The modes matrix: a converted model of every common layer kind, in every mode users train in, vs the unsharded model.

One small model (``ModesNet``: a 3x3 conv, BatchNorm2d with its buffers, a dilated conv, GroupNorm, dropout, a
stride-2 conv, average and max pooling, bilinear upsampling, a transposed conv, a padding module with a valid conv,
nearest upsampling, a pixel shuffle, a strided output conv and a global average pool) on 37 rows (uneven on 2 and 3
ranks) is run in each mode by the converted model on the shards and by the unsharded model on the whole field, in
the same process, from the same parameters; forward, input gradient and parameter gradients (summed over the domain,
as ``sync_domain_gradients`` does) and BatchNorm's running buffers are compared. Dropout masks are compared through
the outputs: the reference's dropout is halo's own on a one-rank group (the whole field), which draws by global
index, so the masks must be the same element for element. ``torch.compile`` (aot_eager and inductor) is compared
against the *eager* unsharded model (stronger than a compiled reference and half the compile time); inductor uses a
tiny model (``TinyNet``: a 3x3 conv, GroupNorm, a stride-2 conv, a transposed conv) since it compiles C++ on CPU.

All modes of one world size run inside ONE ``run_on_ranks`` call (the ranks loop over the modes and return their
errors); the parent caches the results per world size and asserts per cell. The loop over the modes, the comparison
and the per-cell verdict are tests/_modes.py's, shared with test_modes_attention.py; this file gives its model, how
the model takes the field (this rank's rows) and its own cells (the fp16 overflow on one rank, BatchNorm with
``momentum=None``).

Besides ModesNet, every torch class in the registry (``halo.nn.registry.entries()``) is a case of its own: the
``example=`` of its ``@converts``, converted, against the unsharded module in the eager modes (fp64, bf16,
channels_last, checkpointing, inference_mode) on 3 ranks, so a newly registered layer is in the matrix with no edit
here (the end of this file says how).

halo's pack/unpack/philox kernels run their torch reference in the ranks (``TRITON_INTERPRET=0``, what CPU ranks
run): the Triton interpreter made the eager cells ~10x slower and is tested against the reference in
test_kernels.py (every dtype and layout), test_exchange.py and test_random.py. The inductor cells keep the
interpreter: there the real kernels' output strides meet the fake kernels' under inductor's stride asserts.

Tolerances (relative to the largest magnitude of the reference tensor):
  * float64 (fp64, channels_last, checkpointing, no_grad/inference_mode, accumulation, compiled): 1e-10. Each output
    row is computed from the same input rows with the same weights; only the order of sums inside kernels and of
    the cross-rank sums differs (a few ulps, ~1e-15), amplified at most by the norm layers.
  * float32: 1e-4 (the same argument with an ulp of 6e-8, through ~15 layers and two normalisations).
  * bf16 / fp16 autocast: 6e-2 / 1e-2. Every conv's output is rounded to bf16 (ulp 2^-8 of its magnitude) or fp16
    (2^-11); the sharded and unsharded convs block their fp32 accumulation differently (other shapes), so an
    intermediate can round one ulp the other way, and the next layers carry that difference on. Observed maxima:
    (bf16) ~1-3e-2, (fp16) ~1-3e-3. Besides values, the dtypes must be torch's: the output dtype of the converted
    model equals the unsharded model's under the same autocast, and every gradient has its parameter's own dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _modes import MODES, TOL, Harness, Null, WholeFieldDropout, check_cell, rel, run_modes, whole_field_dropouts
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

#: above the longest rank timeout of this file (cold inductor compiles): pytest must not kill the ranks first
pytestmark = pytest.mark.timeout(1000)


H, W, C = 37, 8, 3

# TOL (the tolerances below) and MODES: tests/_modes.py, shared with test_modes_attention.py


class ModesNet(nn.Module):
    """Every common layer kind on (B, 3, 37, 8): 37 -> 19 -> 9 -> 18 -> 37 -> 74 -> 37 rows."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, 8, 3, padding=1)  # compute-then-patch
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2)  # compute-then-patch, dilated
        self.gn = nn.GroupNorm(2, 8)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)  # pad-then-conv
        self.avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.upt = nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1, output_padding=(1, 0))
        self.pad = nn.ReflectionPad2d(1)
        self.c3 = nn.Conv2d(8, 8, 3)
        self.upn = nn.Upsample(scale_factor=2, mode="nearest")
        self.shuffle = nn.PixelShuffle(2)  # 8 -> 2 channels, W doubled, rows doubled
        self.out = nn.Conv2d(2, c, 3, stride=(4, 4), padding=1)
        self.gpool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.gelu(self.bn(self.c1(x)))
        a = self.drop(F.gelu(self.gn(self.c2(a))))
        b = self.up(self.pool(self.avg(F.gelu(self.down(a)))))  # 37 -> 19 -> 9 -> 18
        b = F.gelu(self.c3(self.pad(F.gelu(self.upt(b)))))  # 18 -> 37
        y = self.out(self.shuffle(self.upn(b)))  # 37 -> 74 -> 148 -> 37
        return y + self.gpool(y)


class TinyNet(nn.Module):
    """What inductor compiles (C++ on CPU: keep it small): 37 -> 19 -> 37 rows."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.upt = nn.ConvTranspose2d(4, c, 3, stride=2, padding=1, output_padding=(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.upt(F.gelu(self.down(F.gelu(self.gn(self.c1(x))))))


# -- what every rank runs: tests/_modes.py's shared loop, with this file's model and cells --------------------------

class ModesHarness(Harness):
    """The converted model takes this rank's rows of the field and gives its rows of the output (37 rows in, 37 out:
    the input's split is the output's); BatchNorm's running buffers are compared too."""

    net, tiny, rows, cols = ModesNet, TinyNet, H, W
    buffers_compared = True

    def target(self):
        """What the model is converted onto (``convert_to_domain_parallel``'s second argument)."""
        return self.manager

    def models(self, cls, dtype, fmt=torch.contiguous_format):
        from halo.nn import convert_to_domain_parallel

        torch.manual_seed(0)
        ref = cls().to(dtype).to(memory_format=fmt)
        dom = convert_to_domain_parallel(copy.deepcopy(ref), self.target())
        whole_field_dropouts(ref)
        return ref, dom

    def data(self, dtype, fmt=torch.contiguous_format, seed=1):
        g = torch.Generator().manual_seed(seed)
        shape = (2, C, self.rows, self.cols)
        xf = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
        wf = torch.randn(shape, generator=g, dtype=torch.float64)
        return xf, wf

    def part(self, t):
        return t[..., self.lo:self.hi, :]

    def fp16_scaler(self, dom, ref):
        return _fp16_scaler(self, dom, ref)

    def extra(self, mode):
        if mode == "bn_momentum_none":
            return _bn_momentum_none(self)
        raise ValueError(mode)


def _modes_on_rank(rank: int, world: int, modes: list[str]) -> dict:
    return run_modes(ModesHarness(rank, world), modes)


def _fp16_scaler(h: ModesHarness, dom: nn.Module, ref: nn.Module) -> dict:
    """fp16 autocast with ``torch.amp.GradScaler("cpu")``: the scaled step on both models, then a step whose
    gradients overflow on ONE rank only (its loss times 1e30): after the domain's gradient sum every rank must skip
    the step and back off the scale alike (an inf on any rank reaches every rank's summed gradients)."""
    import torch.distributed as dist

    res: dict = {}
    fp16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    xf, wf = h.data(torch.float32)
    x, xr = h.part(xf).clone().requires_grad_(True), xf.clone().requires_grad_(True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dom, ref)]
    y, loss = h.step(dom, x, h.part(wf), fp16)
    yr, loss_r = h.step(ref, xr, wf, fp16)
    res["y"], res["dtype"] = rel(y, h.part(yr)), (str(y.dtype), str(yr.dtype))
    scalers[0].scale(loss).backward()
    scalers[1].scale(loss_r).backward()
    res["gx"] = rel(x.grad, h.part(xr.grad))
    res["gx_dtype"] = (str(x.grad.dtype), str(xr.grad.dtype))
    sync_domain_gradients(dom)
    res["gp"], res["gp_note"] = h.grads(dom, ref, sum_domain=False)
    for scaler, opt in zip(scalers, opts, strict=True):
        scaler.step(opt)
        scaler.update()
    res["params_after_step"] = max(rel(p, q) for p, q in zip(dom.parameters(), ref.parameters(), strict=True))
    # The overflow on one rank: rank 0's loss is scaled far beyond fp16.
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in dom.parameters()]
    xf, wf = h.data(torch.float32, seed=2)
    x = h.part(xf).clone().requires_grad_(True)
    y, loss = h.step(dom, x, h.part(wf), fp16, scale=1e30 if dist.get_rank() == 0 else 1.0)
    scalers[0].scale(loss).backward()
    sync_domain_gradients(dom)
    scalers[0].step(opts[0])
    scalers[0].update()
    res["skipped"] = all(torch.equal(p, b) for p, b in zip(dom.parameters(), before, strict=True))
    res["scale"] = scalers[0].get_scale()
    return res


def sync_domain_gradients(model: nn.Module) -> None:
    """The domain's gradient sum (what ``halo.parallel.sync_domain_gradients`` does on one domain group, dp 1)."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _bn_momentum_none(h: ModesHarness) -> dict:
    """``BatchNorm2d(momentum=None)`` (the cumulative average, factor ``1 / num_batches_tracked``): steady training
    steps read nothing back to the host (the factor is computed on the buffer's device), and the running statistics
    equal torch's after every step."""
    from halo.nn import convert_to_domain_parallel
    from halo.testing import HostWorkCounter

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C, momentum=None)).double()
    dom = convert_to_domain_parallel(copy.deepcopy(ref), h.manager, grid=(H, W))
    res: dict = {"buffers": 0.0}
    for step in range(4):
        xf, wf = h.data(torch.float64, seed=10 + step)
        x = h.part(xf).clone().requires_grad_(True)
        with HostWorkCounter() if step >= 2 else Null() as counter:  # steps 0-1 learn the plans
            (dom(x) * h.part(wf)).sum().backward()
        (ref(xf) * wf).sum().backward()
        if counter is not None:
            res[f"reads_{step}"] = counter.counts.get("read", 0)
        for b, r in zip(dom.buffers(), ref.buffers(), strict=True):
            res["buffers"] = max(res["buffers"], 0.0 if torch.equal(b, r) else rel(b, r))
    return res


def test_WholeFieldDropout_draws_the_masks_of_halo_dropout_in_one_process() -> None:
    """The reference's dropout is halo's on the whole field (one process, stream 0), bit for bit, with the keep rate
    of ``p``: what the dropout cells compare the converted model's masks with."""
    import halo.random as hr

    x = torch.randn(2, C, H, W, dtype=torch.float64) + 3.0  # no zeros: a zero is a dropped element
    for p in (0.25, 0.5):
        torch.manual_seed(7)
        want = hr.dropout(x, p)
        torch.manual_seed(7)
        got = WholeFieldDropout(p)(x)
        assert torch.equal(got, want), p
        assert abs((got == 0).double().mean().item() - p) < 0.05, p
        torch.manual_seed(8)
        assert not torch.equal(WholeFieldDropout(p)(x), got), p  # the key comes from torch's generator
    assert torch.equal(WholeFieldDropout(0.25).eval()(x), x)


# -- the parent: one rank launch per world size, cached ------------------------------------------------------------

_RESULTS: dict[int, list[dict]] = {}


# Inductor on contiguous inputs is tests/test_compile.py's, at 3 ranks (an edge and an interior rank): SteadyNet
# holds every layer kind of
# TinyNet (3x3 conv, GroupNorm, stride-2 conv, transposed conv) and more (max pool, bilinear upsampling, the pole
# boundary), compiled fullgraph with inductor and compared forward, input gradient and per-rank parameter gradients
# (1e-12) with the eager converted model, which the fp64 cells here hold to the unsharded model. Here it would add a
# C++ compilation (~20-40 s) for no new path; inductor with channels_last (other strides through the custom ops'
# fake kernels) runs here at 2 and 3 ranks. Every other cell runs at 2 and 3 ranks.
_CELLS = [(m, w) for w in (2, 3) for m in MODES if m != "inductor"]


def _results(world: int) -> list[dict]:
    if world not in _RESULTS:
        modes = [m for m, w in _CELLS if w == world]
        _RESULTS[world] = run_on_ranks(_modes_on_rank, world, [*modes, "bn_momentum_none"], timeout=900)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_batchnorm_momentum_none_reads_nothing_to_the_host(world: int) -> None:
    for rank, r in enumerate(_results(world)):
        res = r["bn_momentum_none"]
        assert "error" not in res, res.get("error")
        assert res["reads_2"] == 0 and res["reads_3"] == 0, (rank, res)
        assert res["buffers"] <= 1e-12, (rank, res)


_KNOWN: dict = {}  # mode -> a pytest mark for a cell halo cannot do yet (none today)


@pytest.mark.parametrize(("mode", "world"), [pytest.param(m, w, marks=_KNOWN[m]) if m in _KNOWN else (m, w)
                                             for m, w in _CELLS])
def test_mode(mode: str, world: int) -> None:
    per_rank = [r[mode] for r in _results(world)]
    check_cell(mode, per_rank)
    if mode == "fp16_scaler":
        assert all(r["params_after_step"] <= TOL["fp16"] for r in per_rank), per_rank
        # One rank overflowed: every rank skipped its step and backed off the scale alike.
        assert all(r["skipped"] for r in per_rank), per_rank
        assert len({r["scale"] for r in per_rank}) == 1 and per_rank[0]["scale"] == 2.0 ** 9, per_rank


# -- every registered layer on its own: the registry's cases ------------------------------------------------------
#
# Each torch class the registry converts (halo.nn.registry.entries()) is a case: its ``example=`` of @converts (a
# small instance and the shape of a field it takes), converted inside an nn.Sequential, against the same module
# unsharded, in the eager modes below, on 3 ranks (odd row counts: 23 rows are 8 + 8 + 7). A layer registered
# with an example is in the matrix with no edit here; a class without one fails test_every_registered_layer_has_a_case
# (but for _ELSEWHERE, below). Dropouts are compared with halo's own layer run on the whole
# field in one process (WholeField: their draws are keyed on global indices, WholeFieldDropout's argument).

LAYER_MODES = ["fp64", "bf16", "channels_last", "ckpt", "inference_mode"]
LAYER_WORLD = 3

def _layer_cases() -> dict[str, tuple[type, Callable | None]]:
    """Case name -> (torch class, its example or None), for every class in the registry."""
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import entries

    return {kind.__name__: (kind, entry.example) for kind, entry in entries(ours=True).items()}  # (not a test's)


#: what a halo layer is made on to run on this process alone (with halo.dist.comm.unsharded)
_NO_GROUP = SimpleNamespace(group=None, mesh=None, boundary=None, dp_group=None)


class WholeField(nn.Module):
    """``inner`` on the whole field in this process alone (``halo.dist.comm.unsharded``: how check_equivalence runs
    its reference): a dropout of halo's then draws the whole field's masks, keyed on global indices."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from halo.dist.comm import unsharded

        with unsharded():
            return self.inner(x)


class LayerHarness(Harness):
    """One registered layer, converted inside an nn.Sequential: this rank's rows in, its rows of the output out (the
    balanced split of each tensor's own rows); buffers (BatchNorm's running statistics) compared."""

    buffers_compared = True

    def __init__(self, rank: int, world: int, manager: Any, kind: type, example: Callable) -> None:
        self.rank, self.world, self.manager = rank, world, manager
        self.kind, self.example = kind, example
        module, self.shape = example(kind)
        self.rows = self.shape[-2]
        with torch.no_grad():
            self.out_shape = tuple(module.eval()(torch.zeros(self.shape)).shape)
        self.net = self.tiny = nn.Module  # unused: models() builds the case's own

    def draws(self) -> bool:
        return self.kind.__module__ == "torch.nn.modules.dropout"

    def fmt(self, fmt: torch.memory_format) -> torch.memory_format:
        return torch.channels_last_3d if fmt == torch.channels_last and len(self.shape) == 5 else fmt

    def models(self, cls, dtype, fmt=torch.contiguous_format):
        from halo.nn import convert_to_domain_parallel
        from halo.nn.registry import entries

        torch.manual_seed(0)
        module, _ = self.example(self.kind)
        ref = nn.Sequential(module).to(dtype)
        if len(self.shape) in (4, 5):
            ref = ref.to(memory_format=self.fmt(fmt))
        dom = convert_to_domain_parallel(copy.deepcopy(ref), self.manager)
        if self.draws():  # halo's draws for the whole field: its layer run on this process alone
            ref = WholeField(nn.Sequential(entries()[self.kind].make(module, _NO_GROUP)))
        return ref, dom

    def data(self, dtype, fmt=torch.contiguous_format, seed=1):
        g = torch.Generator().manual_seed(seed)
        xf = torch.randn(self.shape, generator=g, dtype=torch.float64).to(dtype)
        if len(self.shape) in (4, 5):
            xf = xf.contiguous(memory_format=self.fmt(fmt))
        return xf, torch.randn(self.out_shape, generator=g, dtype=torch.float64)

    def part(self, t):
        offs = split_offsets(t.shape[-2], self.world)
        return t[..., offs[self.rank]:offs[self.rank + 1], :]

    def grads(self, dom, ref, sum_domain=True):
        if not any(q.grad is not None for q in ref.parameters()):  # no parameters (a pad, a pool): none on either
            bad = [n for n, p in dom.named_parameters() if p.grad is not None]
            return (float("inf"), f"grads here only: {bad}") if bad else (0.0, "no parameters")
        return super().grads(dom, ref, sum_domain)


def _layers_on_rank(rank: int, world: int, names: list[str]) -> dict:
    import halo

    manager = halo.initialize_domain_parallel(world, world)
    cases = _layer_cases()
    out = {}
    for name in names:
        kind, example = cases[name]
        h = LayerHarness(rank, world, manager, kind, example)
        modes = [m for m in LAYER_MODES if m != "channels_last" or len(h.shape) in (4, 5)]
        out[name] = run_modes(h, modes)
    return out


_LAYER_RESULTS: list[dict] = []


def _layer_results() -> list[dict]:
    if not _LAYER_RESULTS:
        names = [n for n, (_, example) in _layer_cases().items() if example is not None]
        _LAYER_RESULTS.extend(run_on_ranks(_layers_on_rank, LAYER_WORLD, names, timeout=900))
    return _LAYER_RESULTS


#: registered layers the one-input matrix cannot call, and where their modes are tested instead
_ELSEWHERE = {
    "MultiheadAttention": "takes (query, key, value) and returns (output, weights): its fp64, bf16 and masked cases "
                          "are in tests/test_ring_attention.py",
}


def test_every_registered_layer_has_a_case() -> None:
    missing = sorted(n for n, (_, example) in _layer_cases().items() if example is None and n not in _ELSEWHERE)
    assert not missing, (f"registered layers without a modes-matrix case: {missing}; give their @converts an "
                         f"example=lambda kind: (kind(...), shape) (halo.nn.registry)")


_FORMAT = "the output is channels-last where torch's {} gives a contiguous one (values and gradients equal)"
#: (case, mode) -> why halo does not do it yet: xfail(strict), so the cell fails once it is fixed
_KNOWN_LAYER: dict[tuple[str, str], str] = {
    ("CircularPad2d", "channels_last"): _FORMAT.format("nn.CircularPad2d"),
    ("InstanceNorm2d", "channels_last"): _FORMAT.format("nn.InstanceNorm2d"),
    ("LayerNorm", "channels_last"): _FORMAT.format("nn.LayerNorm over (H, W)"),
}


@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(n, m, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_LAYER[n, m])) if (n, m) in _KNOWN_LAYER
    else (n, m) for n in sorted(n for n, (_, example) in _layer_cases().items() if example is not None)
    for m in LAYER_MODES])
def test_registered_layer(name: str, mode: str) -> None:
    per_rank = [r[name] for r in _layer_results()]
    if mode not in per_rank[0]:
        assert mode == "channels_last", (name, mode)  # a field of other than 4 or 5 dims has no channels-last form
        return
    check_cell(mode, [r[mode] for r in per_rank], whole_model=False)
