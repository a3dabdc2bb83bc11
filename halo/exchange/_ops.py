"""``halo::exchange`` and its adjoint as custom ops (what ``torch.compile`` sees), and the order of communication.

Under ``torch.compile`` an exchange is opaque to dynamo: :func:`exchange_op` (its extended shape from the plan, in
the input's memory format, as the fake kernel says) and :func:`exchange_adjoint_op`; compute-then-patch's halo rows
alone (:func:`exchange_halos_op`, :func:`exchange_halos_adjoint_op`: a compiled ``DomainConv2d``'s; on a latitude x
longitude block both axes' and the corners at once, :func:`exchange_halos_2d_op` and its adjoint). Every
communicating custom op of halo (here, the norms' and the reductions') is declared an ordered effect and reads the
device's order token (:func:`order_communication`, :func:`order_token`, :func:`order_after`), so no compiler pass
drops, repeats or reorders messages; checkpointed regions save them (:func:`communicating`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..dist import transport
from ._registry import get_exchanger
from .exchanger import memory_format

__all__ = ["backward_order_token", "communicating", "exchange_adjoint_op", "exchange_halos_2d_adjoint_op",
           "exchange_halos_2d_op", "exchange_halos_adjoint_op", "exchange_halos_op", "exchange_op", "order_after",
           "order_communication", "order_devices", "order_token"]


def _strided_like(t: torch.Tensor, shape: Sequence[int], fmt: torch.memory_format) -> torch.Tensor:
    """``t`` with exactly the strides of ``torch.empty(shape, memory_format=fmt)``: what the fake kernels below
    promise (inductor asserts the real strides against them); a copy only if ``t`` has others (never, today)."""
    want = torch.empty(tuple(shape), dtype=t.dtype, device="meta", memory_format=fmt).stride()
    if tuple(t.shape) == tuple(shape) and t.stride() == want:
        return t
    out = torch.empty(tuple(shape), dtype=t.dtype, device=t.device, memory_format=fmt)
    return out.copy_(t)


#: One order token per device (``str(device)``): a 1-element int64 tensor every communicating custom op reads and
#: :func:`order_after` declares mutated, made once and kept (see :func:`order_token`). Deliberately not in the
#: context: a compiled graph reads the token as a global (a graph input at a fixed address, kept by CUDA graphs),
#: and a reset must not hand a graph compiled before it a different tensor. Bounded by the devices of the process.
_ORDER: dict[str, torch.Tensor] = {}


@torch._dynamo.assume_constant_result
def _order_key(device: torch.device) -> str:
    key = str(device)
    if key not in _ORDER:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, even if first met in inference_mode
            token = torch.zeros(1, dtype=torch.int64, device=device)
        torch._dynamo.mark_static_address(token)  # a fixed address: CUDA graphs (reduce-overhead) keep it
        _ORDER[key] = token
    return key


def order_token(device: torch.device) -> torch.Tensor:
    """The order token of ``device``: under ``torch.compile`` a graph input (the same tensor every step, so no
    recompiles), read by every communicating custom op and declared mutated right after it (:func:`order_after`)."""
    key = _order_key(device)  # made outside the trace (a constant result), then read as a global: a graph input
    return _ORDER[key]


def order_devices() -> tuple[str, ...]:
    """The devices that have an order token so far (for tests and debugging)."""
    return tuple(_ORDER)


#: ``halo::order_after``: declared to write ``order`` after reading ``after`` (a communicating op's output); computes
#: nothing. Defined on the plain library API (one CompositeExplicitAutograd kernel: ~3 us a call, against ~30 us for
#: a ``torch.library.custom_op``; nothing to differentiate).
_LIB = torch.library.Library("halo", "FRAGMENT")
_LIB.define("order_after(Tensor(a!) order, Tensor after) -> ()")


def _order_after_kernel(order: torch.Tensor, after: torch.Tensor) -> None:
    return None


_LIB.impl("order_after", _order_after_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("halo::order_after", _order_after_kernel, lib=_LIB)
_order_after_op = torch.ops.halo.order_after.default


def backward_order_token(order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The order token of the backward of a graph whose forward read ``order``: one per traced graph, made inside
    the backward (``like``'s device), shared by every backward formula of that trace.

    Never the forward's token: a tensor the forward saves for backward must keep its version, and every compiled
    forward declares the device token written (two forwards before one backward, as in a rollout, would fail
    autograd's saved-tensor check). So the backward formulas key their token on the forward token's traced object.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    trace = detect_fake_mode([like]), get_proxy_mode()  # this trace (None, None in eager: one real token)
    held = getattr(order, "_halo_backward_order", None)
    if held is not None and held[0] is trace[0] and held[1] is trace[1]:
        return held[2]
    token = like.new_zeros((1,), dtype=torch.int64)
    order._halo_backward_order = (*trace, token)
    return token


def order_after(order: torch.Tensor, after: torch.Tensor) -> None:
    """Sequence the communicating op that produced ``after`` before the next one that reads ``order``.

    A data dependency every compiler pass keeps: op k reads the token, ``order_after`` writes it after op k's output
    exists (read-after-write on ``after``, write-after-read on the token), op k+1 reads the written token. So under
    inductor (whose ``reorder_for_peak_memory`` ignores effect tokens, torch 2.13) the communicating ops of a graph
    run in program order on every rank, whatever each rank's shard size. Forward and backward alike (the backward
    formulas chain on :func:`backward_order_token`). Eager never calls it; compiled, it is a no-op call per
    communicating op (the token's value never changes: the declaration alone orders the graph).
    """
    _order_after_op(order, after)


@torch.library.custom_op("halo::exchange", mutates_args=())
def exchange_op(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    """:func:`exchange` under ``torch.compile``. Output: a fresh tensor in ``x``'s memory format (channels_last
    stays channels_last), as the fake kernel says. ``order``: the device's order token (:func:`order_after`)."""
    ex = get_exchanger(ex_id)
    shape = list(x.shape)
    shape[dim] = rows
    return _strided_like(ex.finish(x, ex.start(x)), shape, memory_format(x))


@exchange_op.register_fake
def _(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = rows
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format(x))


@torch.library.custom_op("halo::exchange_adjoint", mutates_args=())
def exchange_adjoint_op(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    """The adjoint of ``halo::exchange``. Output: a fresh contiguous tensor (as the fake kernel says)."""
    shape = list(grad.shape)
    shape[dim] = rows
    out = get_exchanger(ex_id).adjoint(grad.contiguous(), shape)
    if out.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        out = out.clone(memory_format=torch.contiguous_format)
    return _strided_like(out, shape, torch.contiguous_format)


@exchange_adjoint_op.register_fake
def _(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    shape = list(grad.shape)
    shape[dim] = rows
    return grad.new_empty(shape)


def _setup(ctx, inputs, output) -> None:
    x, order, ex_id, dim, _ = inputs
    ctx.order, ctx.args = order, (ex_id, dim, x.shape[dim])


def _backward(ctx, grad: torch.Tensor):
    order = backward_order_token(ctx.order, grad)
    out = exchange_adjoint_op(grad, order, *ctx.args)
    order_after(order, out)
    return out, None, None, None, None


exchange_op.register_autograd(_backward, setup_context=_setup)


# -- the halo rows alone (compute-then-patch under torch.compile) ---------------------------------------------------

@torch.library.custom_op("halo::exchange_halos", mutates_args=())
def exchange_halos_op(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, before: int,
                      after: int) -> torch.Tensor:
    """The halo rows of exchange ``ex_id`` alone, ``[before rows | after rows]`` along ``dim`` (zeros beyond the
    domain for a zeros boundary): what compute-then-patch adds to a conv of the shard itself (``DomainConv2d``
    under ``torch.compile``). Sends only the rank's edge rows; no extended copy of the shard. Output: a fresh
    tensor in ``x``'s memory format (the receive buffer is pooled; a compiled graph may save the halos)."""
    ex = get_exchanger(ex_id)
    if (len(ex.plan.before), len(ex.plan.after)) != (before, after):
        raise ValueError(f"halo::exchange_halos: exchanger {ex_id} has ({len(ex.plan.before)}, "
                         f"{len(ex.plan.after)}) halo rows (before, after), expected ({before}, {after})")
    lo, hi = ex.halos(x, ex.start(x))
    shape = list(x.shape)
    shape[dim] = before + after
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format(x))
    out.narrow(dim, 0, before).copy_(lo)
    out.narrow(dim, before, after).copy_(hi)
    return out


@exchange_halos_op.register_fake
def _(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, before: int, after: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = before + after
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format(x))


@torch.library.custom_op("halo::exchange_halos_adjoint", mutates_args=())
def exchange_halos_adjoint_op(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, before: int,
                              rows: int) -> torch.Tensor:
    """The adjoint of ``halo::exchange_halos``: the halo rows' gradients ``grad`` (``[before | after]`` along
    ``dim``) go back to the rows' owners; returns what comes back, the gradients of the rows this rank sent
    (``Exchanger.send_ranges``, in order: ``rows`` of them along ``dim``), fresh and contiguous. The caller adds
    them onto those rows of ``x``'s gradient (plain ops a compiler fuses with the conv's own input gradient)."""
    ex = get_exchanger(ex_id)
    grad = grad.contiguous()
    pending = ex.start_adjoint(grad.narrow(dim, 0, before), grad.narrow(dim, before, grad.shape[dim] - before),
                               grad)
    transport.wait(pending["posted"])
    shape = list(grad.shape)
    shape[dim] = rows
    return torch.empty(shape, dtype=grad.dtype, device=grad.device).copy_(pending["recv"].movedim(0, dim))


@exchange_halos_adjoint_op.register_fake
def _(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, before: int, rows: int) -> torch.Tensor:
    shape = list(grad.shape)
    shape[dim] = rows
    return grad.new_empty(shape)


def _halos_setup(ctx, inputs, output) -> None:
    x, order, ex_id, dim, before, _ = inputs
    ctx.order, ctx.args, ctx.x_shape = order, (ex_id, dim, before), tuple(x.shape)
    ctx.send_ranges = get_exchanger(ex_id).send_ranges


def _halos_backward(ctx, grad: torch.Tensor):
    ex_id, dim, before = ctx.args
    order = backward_order_token(ctx.order, grad)
    sent = exchange_halos_adjoint_op(grad, order, ex_id, dim, before, sum(n for _, n in ctx.send_ranges))
    order_after(order, sent)
    # Each block back onto the rows it was packed from, in range order (overlapping ranges add up: pack's adjoint).
    gx = grad.new_zeros(ctx.x_shape)
    row = 0
    for start, n in ctx.send_ranges:
        if n:
            gx.narrow(dim, start, n).add_(sent.narrow(dim, row, n))
        row += n
    return gx, None, None, None, None, None


exchange_halos_op.register_autograd(_halos_backward, setup_context=_halos_setup)


# -- both axes of a latitude x longitude block at once (the 2-d compute-then-patch under torch.compile) -------------

def _joined(parts: tuple[torch.Tensor, torch.Tensor], dim: int, fmt: torch.memory_format) -> torch.Tensor:
    """``parts`` (halo views into pooled receive buffers) side by side along ``dim`` in a fresh tensor of ``fmt``."""
    a, b = parts
    shape = list(a.shape)
    shape[dim] += b.shape[dim]
    out = torch.empty(shape, dtype=a.dtype, device=a.device, memory_format=fmt)
    out.narrow(dim, 0, a.shape[dim]).copy_(a)
    out.narrow(dim, a.shape[dim], b.shape[dim]).copy_(b)
    return out


@torch.library.custom_op("halo::exchange_halos_2d", mutates_args=())
def exchange_halos_2d_op(x: torch.Tensor, order: torch.Tensor, ex_h: int, ex_w: int, ex_c: int, ph: int,
                         pw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The halos of a block ``x`` (``(B, C, h, w)``) on both axes: ``(rows, cols, corners)``, the ``p_h`` rows
    before and after it (``(B, C, 2 p_h, w)``, of H exchange ``ex_h``: a :func:`pole_step` across a pole, its rows
    rolled), the ``p_w`` columns before and after it (``(B, C, h, 2 p_w)``, W exchange ``ex_w``) and the corners,
    the W exchange ``ex_c`` of ``rows`` (``(B, C, 2 p_h, 2 p_w)``). In eager patch2d's order: the H and W
    exchanges posted at once (two groups; two sync points in all, not three), the W one waited on before the
    corners are posted (one message on the W group at a time). Fresh outputs in ``x``'s memory format."""
    h, w, c = get_exchanger(ex_h), get_exchanger(ex_w), get_exchanger(ex_c)
    fmt = memory_format(x)
    pend_h, pend_w = h.start(x), w.start(x)
    rows = _joined(h.halos(x, pend_h), 2, fmt)
    cols = _joined(w.halos(x, pend_w), 3, fmt)
    corners = _joined(c.halos(rows, c.start(rows)), 3, fmt)
    return rows, cols, corners


@exchange_halos_2d_op.register_fake
def _(x: torch.Tensor, order: torch.Tensor, ex_h: int, ex_w: int, ex_c: int, ph: int,
      pw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, ch, n, m = x.shape
    fmt = memory_format(x)
    return tuple(torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
                 for shape in ((b, ch, 2 * ph, m), (b, ch, n, 2 * pw), (b, ch, 2 * ph, 2 * pw)))


@torch.library.custom_op("halo::exchange_halos_2d_adjoint", mutates_args=())
def exchange_halos_2d_adjoint_op(g_rows: torch.Tensor, g_cols: torch.Tensor, g_corners: torch.Tensor,
                                 order: torch.Tensor, ex_h: int, ex_w: int, ex_c: int, ph: int,
                                 pw: int) -> torch.Tensor:
    """The adjoint of ``halo::exchange_halos_2d``: ``x``'s gradient from its halos' (fresh, contiguous; zero but
    on the rows and columns this rank sent). The corners' gradients go back along W first and what returns is added
    onto the H rows' gradients, which then go back along H while the columns' go back along W (eager's order:
    the corner adjoint before the W adjoint; a pole's roll adjoint, on the W group, in the H adjoint's start)."""
    h, w, c = get_exchanger(ex_h), get_exchanger(ex_w), get_exchanger(ex_c)
    b, ch, _, m = g_rows.shape
    g_band = g_rows.clone(memory_format=torch.contiguous_format)  # own: the corners' gradients are added in place
    g_corners = g_corners.contiguous()
    c.finish_adjoint(c.start_adjoint(g_corners.narrow(3, 0, pw), g_corners.narrow(3, pw, pw), g_band), g_band,
                     g_band)
    gx = g_rows.new_zeros((b, ch, g_cols.shape[2], m))
    g_cols = g_cols.contiguous()
    pend_h = h.start_adjoint(g_band.narrow(2, 0, ph), g_band.narrow(2, ph, ph), gx)
    pend_w = w.start_adjoint(g_cols.narrow(3, 0, pw), g_cols.narrow(3, pw, pw), gx)
    w.finish_adjoint(pend_w, gx, gx)
    h.finish_adjoint(pend_h, gx, gx)
    return gx


@exchange_halos_2d_adjoint_op.register_fake
def _(g_rows: torch.Tensor, g_cols: torch.Tensor, g_corners: torch.Tensor, order: torch.Tensor, ex_h: int,
      ex_w: int, ex_c: int, ph: int, pw: int) -> torch.Tensor:
    b, ch, _, m = g_rows.shape
    return g_rows.new_empty((b, ch, g_cols.shape[2], m))


def _halos_2d_setup(ctx, inputs, output) -> None:
    x, order, *args = inputs
    ctx.order, ctx.args, ctx.shapes = order, tuple(args), tuple(tuple(t.shape) for t in output)


def _halos_2d_backward(ctx, g_rows, g_cols, g_corners):
    like = next(g for g in (g_rows, g_cols, g_corners) if g is not None)
    g_rows, g_cols, g_corners = (like.new_zeros(shape) if g is None else g
                                 for g, shape in zip((g_rows, g_cols, g_corners), ctx.shapes, strict=True))
    order = backward_order_token(ctx.order, like)
    gx = exchange_halos_2d_adjoint_op(g_rows, g_cols, g_corners, order, *ctx.args)
    order_after(order, gx)
    return gx, None, None, None, None, None, None


exchange_halos_2d_op.register_autograd(_halos_2d_backward, setup_context=_halos_2d_setup)


def order_communication(*ops: Any) -> None:
    """Declare communicating custom ops *ordered* side effects under ``torch.compile``.

    A custom op with ``mutates_args=()`` is pure to the compiler: nothing stops it from dropping one whose result is
    unused, or repeating one when recomputing. An ordered effect threads one token through every such op of a graph
    (``torch._higher_order_ops.effects``, ``with_effects``): AOT autograd keeps them, in program order, and neither
    DCE nor recomputation may drop or repeat them. The effect alone does not order them under inductor (torch 2.13:
    ``reorder_for_peak_memory`` ignores it and would order them by a memory estimate that depends on each rank's
    shard size — a hang, or swapped halos): every such op also reads the device's order token, declared written
    after it (:func:`order_after`), a data dependency every pass keeps. torch 2.11-2.14 register the effect through
    ``torch.library._register_effectful_op``; older versions through ``_higher_order_ops.effects``.
    """
    _COMMUNICATING.update(op._qualname for op in ops)
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:
        from torch._library.effects import EffectType

        for op in ops:
            register(op._qualname, EffectType.ORDERED)
        return
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op  # pragma: no cover - older

    for op in ops:  # pragma: no cover
        _register_effectful_op(op._opoverload, _EffectType.ORDERED)


#: The qualified names of halo's communicating custom ops (:func:`order_communication`) and of ``halo::order_after``,
#: whose outputs a checkpointed region of a compiled graph saves (:func:`_save_communication_in_checkpoints`).
_COMMUNICATING: set[str] = {"halo::order_after"}


def communicating(op: Any) -> bool:
    """Whether ``op`` (an ``OpOverload``) is one of halo's communicating custom ops or ``halo::order_after``."""
    name = getattr(op, "name", None)
    return callable(name) and name() in _COMMUNICATING


def _save_communication_in_checkpoints() -> None:
    """Under ``torch.compile``, ``torch.utils.checkpoint`` (no ``context_fn``) recomputes every op of its region in
    backward, with the policy ``torch._higher_order_ops.wrap._always_prefer_recompute``. torch 2.13 cannot recompute
    an ordered-effect op there: aot_eager saves the region's input effect token, which is ``None`` at run time
    (``expected all tensors_saved_with_vc_check to be Tensors``), and inductor fails to unlift the tokens
    (``forward num_erased_outs``). So halo's communicating ops (and ``order_after``) are saved instead
    (``MUST_SAVE``): a compiled checkpointed region posts its messages once, in forward, and recomputes the rest
    (convolutions, normalisation, activations) from the saved exchanged shards in backward — correct on every rank
    alike, at the cost of keeping the exchanged (extended) shards of the region, which eager checkpointing recomputes
    (re-posting the messages in backward). A ``context_fn`` of your own (selective checkpointing) must save them
    too: return ``MUST_SAVE`` where ``halo.exchange.communicating(op)``. Eager checkpointing is unchanged. Where
    the policy is absent (another torch), nothing is patched."""
    try:
        from torch._higher_order_ops import wrap
    except ImportError:  # another torch: nothing to patch
        return
    base = getattr(wrap, "_always_prefer_recompute", None)
    if base is None:  # torch 2.11/2.12: vanilla AC tags each node of the region PREFER_RECOMPUTE (tag_nodes)
        _save_communication_in_tagged_nodes(wrap)
        return
    if getattr(base, "_halo_saves_communication", False):
        return

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if communicating(op):
            from torch.utils.checkpoint import CheckpointPolicy

            return CheckpointPolicy.MUST_SAVE
        return base(ctx, op, *args, **kwargs)

    policy._halo_saves_communication = True  # type: ignore[attr-defined]
    wrap._always_prefer_recompute = policy


def _save_communication_in_tagged_nodes(wrap: Any) -> None:
    """The same as :func:`_save_communication_in_checkpoints` where torch tags the checkpointed region's nodes
    itself (``TagActivationCheckpoint.tag_nodes``, torch 2.11 / 2.12): halo's communicating ops are tagged
    ``MUST_SAVE`` after it."""
    tag = getattr(getattr(wrap, "TagActivationCheckpoint", None), "tag_nodes", None)
    if tag is None or getattr(tag, "_halo_saves_communication", False):
        return

    def tag_nodes(gmod: Any, is_sac: bool) -> Any:
        gmod = tag(gmod, is_sac)
        if not is_sac:
            from torch.utils.checkpoint import CheckpointPolicy

            for node in gmod.graph.nodes:
                if node.op == "call_function" and communicating(node.target):
                    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        return gmod

    tag_nodes._halo_saves_communication = True  # type: ignore[attr-defined]
    wrap.TagActivationCheckpoint.tag_nodes = staticmethod(tag_nodes)


order_communication(exchange_op, exchange_adjoint_op, exchange_halos_op, exchange_halos_adjoint_op,
                    exchange_halos_2d_op, exchange_halos_2d_adjoint_op)
_save_communication_in_checkpoints()
