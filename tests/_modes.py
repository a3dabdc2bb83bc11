"""The modes matrix's shared loop: every mode users train in, one model of a file's layer kinds, vs the unsharded model.

``tests/test_modes.py`` (the common 2-d layer kinds) and ``tests/test_modes_attention.py`` (attention, a 3-d conv,
shard/gather) run the same modes the same way; what differs is the model, how it takes the field (this rank's rows,
or the whole field through ``halo.shard`` / ``halo.gather``) and a few cells of their own. A file subclasses
:class:`Harness` for those and runs :func:`run_modes` on its ranks; its parent asserts each cell with
:func:`check_cell`. In each cell the converted model and the unsharded one run in the same process, in the same
mode, from the same parameters: forward, input gradient, parameter gradients (summed over the domain group, as
``sync_domain_gradients`` does) and, where the harness says so, the buffers; output and gradient dtypes and the
output's memory format must be torch's. ``torch.compile`` is compared with the *eager* unsharded model.

halo's pack/unpack/philox kernels run their torch reference in the ranks (``TRITON_INTERPRET=0``, what CPU ranks
run); the inductor cells keep the Triton interpreter, where the real kernels' output strides meet the fake kernels'
under inductor's stride asserts (test_modes.py's docstring has the measurements and the tolerances' argument).
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: relative to the largest magnitude of the reference tensor (test_modes.py's docstring gives the argument)
TOL = {"fp64": 1e-10, "fp32": 1e-4, "bf16": 6e-2, "fp16": 1e-2}

MODES = ["fp64", "fp32", "bf16", "fp16_scaler", "channels_last", "ckpt_reentrant", "ckpt", "no_grad",
         "inference_mode", "accumulate", "aot_eager", "inductor", "inductor_channels_last"]

#: modes without a backward: their cells compare the forward only
FORWARD_ONLY = ("no_grad", "inference_mode")


def tol(mode: str) -> float:
    """The tolerance of a mode's cell."""
    return {"fp32": TOL["fp32"], "bf16": TOL["bf16"], "fp16_scaler": TOL["fp16"]}.get(mode, TOL["fp64"])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64; inf for another shape or a non-finite value."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class Null:
    """A context manager that does nothing (the cells without autocast or no_grad)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class WholeFieldDropout(nn.Module):
    """The unsharded model's dropout: the draws halo's dropout makes for the whole field in one process (stream 0,
    each element keyed on its position in the field; the key one draw from torch's generator). The converted
    model's masks must be these, element for element, on every rank."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import halo.random as hr
        from halo.kernels import philox

        if not self.training or self.p == 0.0:
            return x
        run = x.shape[-2] * x.shape[-1]
        bits = philox.bits(hr.draw_key(x.device), x.numel(), run, run, 0, 0, hr.TAG_DROP)
        keep = bits.view(x.shape) >= hr.keep_threshold(self.p)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


def whole_field_dropouts(ref: nn.Module) -> None:
    """The reference's ``nn.Dropout`` children become :class:`WholeFieldDropout` (the masks halo draws)."""
    for name, mod in list(ref.named_children()):
        if isinstance(mod, nn.Dropout):
            setattr(ref, name, WholeFieldDropout(mod.p))


class Harness:
    """What one rank of a modes file runs: the models and the field as that file has them; :func:`run_modes` runs
    the modes with it. ``net`` holds the file's layer kinds; ``tiny`` is what inductor (C++ on CPU) and the 3-rank
    aot_eager cell compile."""

    net: type[nn.Module]
    tiny: type[nn.Module]
    #: compare the buffers (BatchNorm's running statistics) after each cell
    buffers_compared = False

    def __init__(self, rank: int, world: int) -> None:
        import halo
        from halo.plan.partition import split_offsets

        self.rank, self.world = rank, world
        self.manager = halo.initialize_domain_parallel(world, world)
        offs = split_offsets(self.rows, world)
        self.lo, self.hi = offs[rank], offs[rank + 1]

    # -- what a file supplies ---------------------------------------------------------------------------------

    rows: int  # the input's rows (H)

    def models(self, cls: type[nn.Module], dtype: torch.dtype, fmt: torch.memory_format = torch.contiguous_format
               ) -> tuple[nn.Module, nn.Module]:
        """``(reference, converted)`` from the same parameters."""
        raise NotImplementedError

    def data(self, dtype: torch.dtype, fmt: torch.memory_format = torch.contiguous_format, seed: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole input field and the whole weight of the loss (the output's shape)."""
        raise NotImplementedError

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """What of a whole-field tensor (input, output, weight) the converted model sees or gives on this rank."""
        raise NotImplementedError

    def params(self, dom: nn.Module) -> dict[str, nn.Parameter]:
        """The converted model's parameters by name (the reference's names)."""
        return dict(dom.named_parameters())

    def inductor(self, dom: nn.Module) -> tuple[nn.Module, Callable | None]:
        """The converted model compiled by inductor (fullgraph): ``(model, what to call)``."""
        return dom, torch.compile(dom, backend="inductor", fullgraph=True)

    def fp16_scaler(self, dom: nn.Module, ref: nn.Module) -> dict:
        raise NotImplementedError

    def extra(self, mode: str) -> dict:
        """A cell of the file's own."""
        raise ValueError(mode)

    # -- the shared steps ---------------------------------------------------------------------------------------

    def step(self, model: Callable, x: torch.Tensor, w: torch.Tensor, ctx: Callable | None = None,
             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(123)  # dropout keys come from torch's generator: the same for both models
        with ctx() if ctx is not None else Null():
            y = model(x)
        return y, (y.double() * w).sum() * scale

    def grads(self, dom: nn.Module, ref: nn.Module, sum_domain: bool = True) -> tuple[float, str]:
        """Worst parameter-gradient error relative to the largest reference gradient of any parameter (a bias
        before a norm has a gradient of rounding size only: relative to itself it means nothing), after the
        domain's sum (on a copy); a gradient on one side only, or in another dtype than its parameter, fails."""
        import torch.distributed as dist

        scale = max(q.grad.detach().abs().max().item() for q in ref.parameters() if q.grad is not None)
        errs = [(0.0, "")]
        mine, theirs = self.params(dom), dict(ref.named_parameters())
        if set(mine) != set(theirs):
            return float("inf"), f"parameter names differ: {sorted(set(mine) ^ set(theirs))}"
        for name, p in mine.items():
            q = theirs[name]
            if q.grad is None and p.grad is None:
                continue
            if p.grad is None or q.grad is None:
                return float("inf"), f"{name}: grad {p.grad is not None} here, {q.grad is not None} unsharded"
            g = p.grad.detach().clone()
            if g.dtype != p.dtype:
                return float("inf"), f"grad of {name} is {g.dtype}, its parameter {p.dtype}"
            if sum_domain:
                dist.all_reduce(g)
            ok = g.shape == q.grad.shape and bool(torch.isfinite(g).all())
            errs.append(((g.double() - q.grad.double()).abs().max().item() / scale if ok else float("inf"), name))
        worst = max(errs)
        return worst[0], f"worst: {worst[1]}"

    def buffers(self, dom: nn.Module, ref: nn.Module) -> float:
        out = 0.0
        for (name, b), (_, r) in zip(dom.named_buffers(), ref.named_buffers(), strict=True):
            if "num_batches" in name:
                out = max(out, 0.0 if torch.equal(b, r) else float("inf"))
            else:
                out = max(out, rel(b, r))
        return out

    def compare(self, dom: nn.Module, ref: nn.Module, dtype: torch.dtype, fmt: torch.memory_format =
                torch.contiguous_format, ctx: Callable | None = None, dom_run: Callable | None = None,
                ref_run: Callable | None = None, backward: bool = True, seeds: tuple[int, ...] = (1,)) -> dict:
        """One cell: forward (and backward) of both models on the same field; more than one seed: the gradients
        accumulate over the micro-batches (no zero_grad between)."""
        res: dict = {"y": 0.0, "gx": 0.0}
        for seed in seeds:
            xf, wf = self.data(dtype, fmt, seed)
            x, xr = self.part(xf).clone().requires_grad_(True), xf.clone().requires_grad_(True)
            y, loss = self.step(dom if dom_run is None else dom_run, x, self.part(wf), ctx)
            yr, loss_r = self.step(ref if ref_run is None else ref_run, xr, wf, ctx)
            res["y"] = max(res["y"], rel(y, self.part(yr)))
            res["dtype"] = (str(y.dtype), str(yr.dtype))
            res["channels_last"] = (y.is_contiguous(memory_format=torch.channels_last),
                                    yr.is_contiguous(memory_format=torch.channels_last))
            if backward:
                loss.backward()
                loss_r.backward()
                res["gx"] = max(res["gx"], rel(x.grad, self.part(xr.grad)))
                res["gx_dtype"] = (str(x.grad.dtype), str(xr.grad.dtype))
        if backward:
            res["gp"], res["gp_note"] = self.grads(dom, ref)
        if self.buffers_compared:
            res["buffers"] = self.buffers(dom, ref)
        return res


def run_cell(h: Harness, mode: str) -> dict:
    """One mode on this rank (the dispatch both files share)."""
    from torch.utils.checkpoint import checkpoint

    f64 = torch.float64
    if mode in ("fp64", "fp32"):
        dtype = f64 if mode == "fp64" else torch.float32
        ref, dom = h.models(h.net, dtype)
        return h.compare(dom, ref, dtype)
    if mode == "bf16":
        ref, dom = h.models(h.net, torch.float32)
        return h.compare(dom, ref, torch.float32, ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    if mode == "fp16_scaler":
        ref, dom = h.models(h.net, torch.float32)
        return h.fp16_scaler(dom, ref)
    if mode == "channels_last":
        ref, dom = h.models(h.net, f64, torch.channels_last)
        return h.compare(dom, ref, f64, torch.channels_last)
    if mode in ("ckpt_reentrant", "ckpt"):
        ref, dom = h.models(h.net, f64)
        reentrant = mode == "ckpt_reentrant"
        return h.compare(dom, ref, f64, dom_run=functools.partial(checkpoint, dom, use_reentrant=reentrant),
                         ref_run=functools.partial(checkpoint, ref, use_reentrant=reentrant))
    if mode in FORWARD_ONLY:
        ref, dom = h.models(h.net, f64)
        ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
        return h.compare(dom, ref, f64, backward=False, ctx=ctx)
    if mode == "accumulate":
        ref, dom = h.models(h.net, f64)
        return h.compare(dom, ref, f64, seeds=(1, 2))
    if mode == "aot_eager":  # every layer kind on 2 ranks; the tiny model on 3 (compile time)
        ref, dom = h.models(h.net if h.world == 2 else h.tiny, f64)
        return h.compare(dom, ref, f64, dom_run=torch.compile(dom, backend="aot_eager"))
    if mode in ("inductor", "inductor_channels_last"):
        fmt = torch.channels_last if mode == "inductor_channels_last" else torch.contiguous_format
        ref, dom = h.models(h.tiny, f64, fmt)
        dom, run = h.inductor(dom)
        return h.compare(dom, ref, f64, fmt, dom_run=run)
    return h.extra(mode)


def run_modes(h: Harness, modes: list[str]) -> dict:
    """Every mode in ``modes`` on this rank: ``{mode: result}``, an ``"error"`` (the traceback) where a cell raised,
    and its ``"seconds"``."""
    out: dict = {}
    for mode in modes:
        # halo's kernels: the torch reference (what CPU ranks run), the Triton interpreter for inductor only (the
        # real kernels' strides against the fake ones); module docstring
        os.environ["TRITON_INTERPRET"] = "1" if mode.startswith("inductor") else "0"
        t0 = time.perf_counter()
        try:
            res = run_cell(h, mode)
        except Exception:  # noqa: BLE001 - returned to the parent, which fails the cell with the traceback
            res = {"error": traceback.format_exc()[-4000:]}
        res["seconds"] = time.perf_counter() - t0
        out[mode] = res
    return out


def check_cell(mode: str, per_rank: list[dict], whole_model: bool = True) -> None:
    """The parent's verdict on one cell, from every rank's result (the checks both files share). ``whole_model``
    False (one layer of the registry's, test_modes.py): its output need not be channels-last in the channels_last
    cell nor bf16 under bf16 autocast (a pool stays float32 under CPU autocast, as torch's); that its dtype and
    memory format are torch's is checked on every rank either way."""
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}, mode {mode}:\n{res['error']}"
        limit = tol(mode)
        assert res["y"] <= limit, (rank, "forward", res)
        # The output dtype and memory format are torch's own in this mode.
        assert res["dtype"][0] == res["dtype"][1], (rank, "output dtype", res)
        if "channels_last" in res:
            assert res["channels_last"][0] == res["channels_last"][1], (rank, "memory format", res)
        if mode not in FORWARD_ONLY:
            assert res["gx"] <= limit, (rank, "input gradient", res)
            assert res["gx_dtype"][0] == res["gx_dtype"][1], (rank, "input gradient dtype", res)
            assert res["gp"] <= limit, (rank, "parameter gradients", res.get("gp_note"), res)
        if "buffers" in res:
            assert res["buffers"] <= limit, (rank, "BatchNorm buffers", res)
    if not whole_model:
        return
    if mode in ("channels_last", "inductor_channels_last"):
        assert all(r["channels_last"] == (True, True) for r in per_rank), per_rank
    if mode == "bf16":
        assert all(r["dtype"] == ("torch.bfloat16", "torch.bfloat16") for r in per_rank), per_rank
