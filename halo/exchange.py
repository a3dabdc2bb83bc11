"""Halo exchange: extend a shard by rows of its neighbours, with the exact adjoint as its backward.

Layers (primitive -> autograd.Function / custom op -> public function)::

    Exchanger                   one plan on one rank: start (pack + post isend/irecv), finish, adjoint. Made once
                                per plan and cached; its message buffers and extended outputs are reused
    _ExchangeFn                 eager autograd: forward = finish(start(x)), backward = Exchanger.adjoint
    halo::exchange (custom op)  the same under torch.compile: opaque to dynamo, extended shape from the plan
    halo_exchange / _ / _async / _2d    group resolution, agreed validation (halo.plans), halo -> needs

Forward on rank r::   ext = [ before halo | x[interior] | after halo ]     (along dim)
Adjoint::             grad_x = grad_ext[interior] + (halo gradients sent back by the ranks that received
                      rows of x, added at those rows; boundary copies fold back onto their source rows)

Messages are dim-major buffers (``kernels.pack``): rows along ``dim`` outermost, so every message and every
received piece is a contiguous slice. Peers are addressed by their index in the group (``group_peer``),
never by assuming the group starts at global rank 0.

Costs of a steady call: no metadata collective (``halo.plans``), no tensor built from Python data (index maps
are made once per plan and device), no fresh buffer when the last one is free (reused when nothing else holds
it), one copy of the shard into the extended output (its floor), and, in a layer's backward, no copy of the
gradient at all (the halo rows' gradients are added into the interior of the incoming gradient in place).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import context, kernels, transport
from .comm import CommGroup, HaloCommError, comm_group, get_timeout, id_base, set_timeout
from .mesh import DomainMesh, mesh_coords
from .partition import POLE_MODES, RankPlan, check_boundary, offsets, plan_exchange
from .plans import carry, device_tensor, resolve, set_validation

__all__ = [
    "ExchangeSpec",
    "Exchanger",
    "HaloCommError",
    "SPECS_CAP",
    "HaloHandle",
    "communicating",
    "exchange",
    "exchange_spec",
    "exchanger_id",
    "get_timeout",
    "halo_exchange",
    "halo_exchange_",
    "halo_exchange_2d",
    "halo_exchange_async",
    "set_timeout",
    "set_validation",
    "static_shapes",
]


# -- reusable buffers ----------------------------------------------------------------------------------------

BufferPool = transport.BufferPool  # moved to halo.transport (the one transport allocates message buffers)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


def like_format(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` in ``x``'s memory format where ``x`` is channels_last (or channels_last_3d) and ``y`` is not: what
    torch's pooling, upsampling, pixel shuffle and conv layers return for a channels_last input. A layer's output
    cropped from a local result (a view: dense in no format) is copied once; otherwise ``y`` itself."""
    fmt = _memory_format(x)
    if fmt is torch.contiguous_format or y.dim() != x.dim() or y.is_contiguous(memory_format=fmt):
        return y
    return y.contiguous(memory_format=fmt)


# -- assembling the halo rows from the receive buffer -------------------------------------------------------------

class _Side(NamedTuple):
    """How the halo rows on one side come out of the receive buffer ``R``.

    ``rows[j]``: the row of ``R`` halo row ``j`` copies (-1: zero); ``rolled``: halo rows taken across a pole (rolled
    by half the longitudes). ``start >= 0``: the rows are ``R[start:start + n]`` as they are (no copy).
    """

    rows: tuple[int, ...]
    rolled: tuple[int, ...]
    start: int

    @staticmethod
    def of(halo: Sequence[tuple[int, bool]]) -> _Side:
        rows = tuple(i for i, _ in halo)
        rolled = tuple(k for k, (_, r) in enumerate(halo) if r)
        n = len(rows)
        plain = n > 0 and rows[0] >= 0 and rows == tuple(range(rows[0], rows[0] + n)) and not rolled
        return _Side(rows, rolled, rows[0] if plain else -1)

    def layers(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """The adjoint's scatter as rounds of ``(halo rows, R rows)`` with distinct R rows within a round, in halo
        row order: adding round by round is deterministic (no two additions race for one row)."""
        rounds: list[tuple[list[int], list[int]]] = []
        seen: collections.Counter = collections.Counter()
        for j, i in enumerate(self.rows):
            if i < 0:
                continue
            k = seen[i]
            seen[i] += 1
            if k == len(rounds):
                rounds.append(([], []))
            rounds[k][0].append(j)
            rounds[k][1].append(i)
        return tuple((tuple(a), tuple(b)) for a, b in rounds)


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return device_tensor(tuple(values), torch.int64, device)


def post_messages(cg: CommGroup, op: str, send: torch.Tensor | None, send_list: Sequence[tuple[int, int]],
                  recv: torch.Tensor | None, recv_list: Sequence[tuple[int, int]]) -> tuple[list, list]:
    """The old form of :func:`halo.transport.post_rows` (which it calls): the requests and their labels, for
    :func:`halo.comm.wait_all`. New code posts with ``transport.post_rows`` and waits with ``transport.wait``."""
    posted = transport.post_rows(cg, op, send, send_list, recv, recv_list)
    return list(posted.works), list(posted.labels)


class Exchanger:
    """One rank's part of one exchange plan: pack, post, finish; and the adjoint. No autograd here.

    Made once per plan (:func:`exchanger_id`); holds the message counts, the assembly of the halo rows, and pools
    of reusable buffers. Every wait is bounded (:func:`halo.set_timeout`) and a failed or late message raises
    :class:`HaloCommError` naming the peer; the buffers of a message given up on are kept alive.
    """

    def __init__(self, plan: RankPlan, cg: CommGroup, dim: int, boundary: str, op: str = "halo_exchange") -> None:
        self.plan, self.cg, self.dim, self.boundary, self.op = plan, cg, dim, boundary, op
        # (peer, rows) of every message, both directions; the adjoint swaps them.
        self.send_counts = tuple((q, sum(n for _, n in runs)) for q, runs in plan.sends)
        self.recv_counts = plan.recvs
        self.send_ranges = plan.send_ranges
        self.send_rows = sum(n for _, n in self.send_ranges)
        self.recv_rows = plan.recv_rows
        self.sides = (_Side.of(plan.before), _Side.of(plan.after))
        self.rounds = tuple(side.layers() for side in self.sides)
        self.pool = transport.BufferPool()
        self.op_backward = f"{op} (backward)"

    def ext_rows(self) -> int:
        return len(self.plan.before) + self.plan.interior[1] + len(self.plan.after)

    # forward ------------------------------------------------------------------------------------------
    def start(self, x: torch.Tensor) -> dict:
        """Pack every outgoing message in one pass and post all sends and receives; do not wait."""
        rest = [s for i, s in enumerate(x.shape) if i != self.dim]
        send = transport.alloc((self.send_rows, *rest), x, self.pool)
        kernels.pack(x, self.dim, self.send_ranges, out=send)
        recv = transport.alloc((self.recv_rows, *rest), x, self.pool)
        posted = self._post(self.op, send, self.send_counts, recv, self.recv_counts)
        return {"send": send, "recv": recv, "posted": posted}

    def finish(self, x: torch.Tensor, pending: dict, out: torch.Tensor | None = None, *,
               reuse: bool = False) -> torch.Tensor:
        """Write ``[before | interior | after]``: into ``out`` if given (if ``x`` is ``out``'s middle already, only
        the halo rows are written), else into a reused buffer (``reuse``) or a fresh one. The interior is copied
        *before* waiting for the messages, while they travel; the halo rows after."""
        p, dim = self.plan, self.dim
        nb, (i0, ni) = len(p.before), p.interior
        if out is None:
            shape = list(x.shape)
            shape[dim] = self.ext_rows()
            fmt = _memory_format(x)
            out = self.pool.get(shape, x, fmt) if reuse else kernels.reference.alloc_like(x, shape)
        mid = out.narrow(dim, nb, ni)
        interior = x.narrow(dim, i0, ni)
        if interior.numel() and (interior.data_ptr() != mid.data_ptr() or interior.stride() != mid.stride()):
            mid.copy_(interior)
        transport.wait(pending["posted"])  # finished requests are not kept
        recv = pending["recv"]
        return kernels.unpack(mid, self._assemble(recv, 0), self._assemble(recv, 1), dim, out)

    def _post(self, what: str, send: torch.Tensor, send_list, recv: torch.Tensor, recv_list) -> transport.Posted:
        return transport.post_rows(self.cg, what, send, send_list, recv, recv_list)

    def _assemble(self, recv: torch.Tensor, k: int) -> torch.Tensor:
        """Halo rows of side ``k`` (dim-major) from the receive buffer: a slice, or a gather by a cached map."""
        side = self.sides[k]
        n = len(side.rows)
        if side.start >= 0:
            return recv[side.start:side.start + n]
        if all(i < 0 for i in side.rows):
            return recv.new_zeros((n, *recv.shape[1:]))
        out = recv.index_select(0, _index([max(i, 0) for i in side.rows], recv.device))
        zero = [j for j, i in enumerate(side.rows) if i < 0]
        if zero:
            out.index_fill_(0, _index(zero, recv.device), 0)
        if side.rolled:
            rolled = _index(side.rolled, recv.device)
            out.index_copy_(0, rolled, out.index_select(0, rolled).roll(out.shape[-1] // 2, dims=-1))
        return out

    def halos(self, x: torch.Tensor, pending: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the messages of :meth:`start` and return the halo rows alone, ``(before, after)``, each in
        ``x``'s layout with its own rows along ``dim`` (no copy of the shard: compute-then-patch)."""
        transport.wait(pending["posted"])
        recv = pending["recv"]
        return self._assemble(recv, 0).movedim(0, self.dim), self._assemble(recv, 1).movedim(0, self.dim)

    # adjoint ------------------------------------------------------------------------------------------
    def adjoint(self, grad_ext: torch.Tensor, x_shape: Sequence[int]) -> torch.Tensor:
        """``grad_x``: the interior gradient plus the halo gradients sent back to the rows' owners, in one pass
        into a fresh contiguous tensor (the copy of the interior and the additions fused)."""
        p, dim = self.plan, self.dim
        nb, (i0, ni) = len(p.before), p.interior
        interior = grad_ext.narrow(dim, nb, ni)
        before, after = grad_ext.narrow(dim, 0, nb), grad_ext.narrow(dim, nb + ni, len(p.after))
        if (i0, ni) != (0, x_shape[dim]):  # a trimmed exchange: the gradient covers only part of x
            full = grad_ext.new_zeros(tuple(x_shape))
            full.narrow(dim, i0, ni).copy_(interior)
            return self._send_back(before, after, full, full)
        return self._send_back(before, after, interior, None)

    def start_adjoint(self, before: torch.Tensor | None, after: torch.Tensor | None, like: torch.Tensor) -> dict:
        """Post the adjoint of :meth:`halos`: the halo rows' gradients (``None``: a side with no rows from other
        ranks) go back to the rows' owners; do not wait. ``like``: a tensor of ``x``'s shape, dtype and device."""
        rest = [s for i, s in enumerate(like.shape) if i != self.dim]
        grad_recv = self._assemble_adjoint((before, after), rest, like)
        grad_send = transport.alloc((self.send_rows, *rest), like, self.pool)
        # Reverse traffic: what this rank received goes back to the sender and vice versa.
        posted = self._post(self.op_backward, grad_recv, self.recv_counts, grad_send, self.send_counts)
        return {"send": grad_recv, "recv": grad_send, "posted": posted}

    def finish_adjoint(self, pending: dict, base: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Wait for :meth:`start_adjoint` and add what arrives onto ``base``'s rows: into ``out`` (in place when it
        is ``base``, which the caller must own; a fresh tensor when ``None``)."""
        transport.wait(pending["posted"])
        if not self.send_ranges:
            return base if out is base else (base.contiguous() if out is None else out.copy_(base))
        if out is base and torch._debug_has_internal_overlap(base) == 1:  # 2: "too hard to tell", views
            raise RuntimeError(f"{self.op}: cannot add halo gradients in place into a tensor with overlapping "
                               f"memory (strides {tuple(base.stride())})")
        return kernels.pack_adjoint(base, self.dim, self.send_ranges, pending["recv"], out=out)

    def _send_back(self, before: torch.Tensor, after: torch.Tensor, base: torch.Tensor,
                   out: torch.Tensor | None) -> torch.Tensor:
        return self.finish_adjoint(self.start_adjoint(before, after, base), base, out)

    def _assemble_adjoint(self, halos: tuple[torch.Tensor, torch.Tensor], rest: list[int],
                          like: torch.Tensor) -> torch.Tensor:
        """The adjoint of the assembly: halo-row gradients summed onto the receive-buffer rows they were copied
        from, in fp32 for half dtypes, deterministically (rounds of distinct rows; no atomic races)."""
        dim = self.dim
        acc_dtype = torch.float32 if like.dtype in (torch.float16, torch.bfloat16) else like.dtype
        acc = torch.zeros((self.recv_rows, *rest), dtype=acc_dtype, device=like.device)
        for k, (side, halo) in enumerate(zip(self.sides, halos, strict=True)):
            n = len(side.rows)
            if not n or all(i < 0 for i in side.rows):
                continue
            g = kernels.pack(halo, dim, [(0, n)])
            if side.rolled:
                rolled = _index(side.rolled, g.device)
                g.index_copy_(0, rolled, g.index_select(0, rolled).roll(-(g.shape[-1] // 2), dims=-1))
            if side.start >= 0:
                acc[side.start:side.start + n] += g
                continue
            for src, dst in self.rounds[k]:
                acc.index_add_(0, _index(dst, g.device), g.index_select(0, _index(src, g.device)).to(acc_dtype))
        return acc if acc_dtype == like.dtype else acc.to(like.dtype)


# -- the registry: exchangers by plan, addressed by small ints (what a compiled graph holds) --------------------

class ExchangeSpec(NamedTuple):
    """What names an exchanger: the group, the dim, every rank's extent, every rank's needs, boundary, op name."""

    group: Any
    dim: int
    sizes: tuple[int, ...]
    needs: tuple[tuple[int, int], ...]
    boundary: str
    op: str


#: Exchange plans remembered per context (least recently planned dropped first; one whose exchanger is live is
#: kept). Each is a few hundred bytes: the cap bounds a process that plans ever new shapes (a sweep of sizes).
SPECS_CAP = 16384
#: Exchangers (with their buffers) kept live per context, least recently used dropped (made again from the spec).
LIVE_CAP = 256


@dataclasses.dataclass
class _ExchangeState:
    """The exchangers' part of the context: specs by id (ids never reused within a context) and live exchangers."""

    ids: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # spec -> id, LRU
    specs: dict = dataclasses.field(default_factory=dict)  # id -> spec
    live: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # id -> Exchanger
    next_id: int = dataclasses.field(default_factory=id_base)


def _state() -> _ExchangeState:
    return context.state("exchange", _ExchangeState)


def exchanger_id(cg: CommGroup, dim: int, sizes: Sequence[int], needs: Sequence[tuple[int, int]], boundary: str,
                 op: str = "halo_exchange") -> int:
    """The id of this rank's exchanger for a plan (made and cached on first use). ``sizes``: every rank's extent
    along ``dim``; ``needs[r]``: the virtual rows rank ``r`` needs. Both must be agreed (the same on every rank)."""
    spec = ExchangeSpec(cg.group, dim, tuple(int(s) for s in sizes), tuple((int(a), int(b)) for a, b in needs),
                        check_boundary(boundary), op)
    state = _state()
    ex_id = state.ids.get(spec)
    if ex_id is not None:
        state.ids.move_to_end(spec)
        return ex_id
    try:
        _plan(spec.sizes, spec.needs, spec.boundary)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    ex_id = state.ids[spec] = state.next_id
    state.specs[ex_id] = spec
    state.next_id += 1
    _evict(state)
    return ex_id


def _evict(state: _ExchangeState) -> None:
    """Drop the least recently planned specs beyond :data:`SPECS_CAP` (a live exchanger's spec is kept)."""
    for _ in range(len(state.ids) - SPECS_CAP):
        spec, ex_id = next(iter(state.ids.items()))
        state.ids.move_to_end(spec)
        if ex_id not in state.live:
            del state.ids[spec], state.specs[ex_id]


def exchange_spec(ex_id: int) -> ExchangeSpec:
    """The spec of exchanger ``ex_id``; a clear error for an id this context does not know (evicted past
    :data:`SPECS_CAP`, or made before ``halo.context.reset()`` or in another context): never another's spec."""
    spec = _state().specs.get(ex_id)
    if spec is None:
        raise LookupError(f"halo: exchanger id {ex_id} is unknown in this context (made before halo.context.reset(), "
                          f"in another halo.context.use() block, or dropped past halo.exchange.SPECS_CAP="
                          f"{SPECS_CAP} plans): plan the exchange again")
    return spec


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], needs: tuple[tuple[int, int], ...], boundary: str):
    return plan_exchange(sizes, needs, boundary)


def get_exchanger(ex_id: int) -> Exchanger:
    """The exchanger of id ``ex_id`` (rebuilt if it was evicted; its buffers go with it)."""
    live = _state().live
    ex = live.get(ex_id)
    if ex is None:
        spec = exchange_spec(ex_id)
        cg = comm_group(spec.group)
        ex = Exchanger(_plan(spec.sizes, spec.needs, spec.boundary).ranks[cg.index], cg, spec.dim, spec.boundary,
                       spec.op)
        live[ex_id] = ex
        if len(live) > LIVE_CAP:
            live.popitem(last=False)
    else:
        live.move_to_end(ex_id)
    return ex


# -- autograd ------------------------------------------------------------------------------------------------

class _ExchangeFn(torch.autograd.Function):
    """Forward: the extended shard. Backward: its exact adjoint (``Exchanger.adjoint``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchanger: Exchanger, pending: dict | None) -> torch.Tensor:
        ctx.exchanger, ctx.x_shape = exchanger, x.shape
        if pending is None:
            pending = exchanger.start(x)
        return exchanger.finish(x, pending, reuse=True)

    @staticmethod
    def backward(ctx, grad_ext: torch.Tensor):
        return ctx.exchanger.adjoint(grad_ext, ctx.x_shape), None, None


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
def _exchange_op(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    """:func:`exchange` under ``torch.compile``. Output: a fresh tensor in ``x``'s memory format (channels_last
    stays channels_last), as the fake kernel says. ``order``: the device's order token (:func:`order_after`)."""
    ex = get_exchanger(ex_id)
    shape = list(x.shape)
    shape[dim] = rows
    return _strided_like(ex.finish(x, ex.start(x)), shape, _memory_format(x))


@_exchange_op.register_fake
def _(x: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = rows
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_memory_format(x))


@torch.library.custom_op("halo::exchange_adjoint", mutates_args=())
def _exchange_adjoint_op(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    """The adjoint of ``halo::exchange``. Output: a fresh contiguous tensor (as the fake kernel says)."""
    shape = list(grad.shape)
    shape[dim] = rows
    out = get_exchanger(ex_id).adjoint(grad.contiguous(), shape)
    if out.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        out = out.clone(memory_format=torch.contiguous_format)
    return _strided_like(out, shape, torch.contiguous_format)


@_exchange_adjoint_op.register_fake
def _(grad: torch.Tensor, order: torch.Tensor, ex_id: int, dim: int, rows: int) -> torch.Tensor:
    shape = list(grad.shape)
    shape[dim] = rows
    return grad.new_empty(shape)


def _setup(ctx, inputs, output) -> None:
    x, order, ex_id, dim, _ = inputs
    ctx.order, ctx.args = order, (ex_id, dim, x.shape[dim])


def _backward(ctx, grad: torch.Tensor):
    order = backward_order_token(ctx.order, grad)
    out = _exchange_adjoint_op(grad, order, *ctx.args)
    order_after(order, out)
    return out, None, None, None, None


_exchange_op.register_autograd(_backward, setup_context=_setup)


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


order_communication(_exchange_op, _exchange_adjoint_op)
_save_communication_in_checkpoints()


def exchange(x: torch.Tensor, ex_id: int, rows: int, dim: int = -2) -> torch.Tensor:
    """Run planned exchange ``ex_id`` with autograd; the result has ``rows`` rows along ``dim``.

    Under ``torch.compile`` this is the ``halo::exchange`` custom op.
    """
    if torch.compiler.is_compiling():
        order = order_token(x.device)
        out = _exchange_op(x, order, ex_id, dim % x.dim(), rows)
        order_after(order, out)
        return out
    return _ExchangeFn.apply(x, get_exchanger(ex_id), None)


# -- public API -------------------------------------------------------------------------------------------------

class HaloPlan(NamedTuple):
    """A uniform-halo exchange as planned for this rank: exchanger id and the extended extent."""

    ex: int
    dim: int
    rows: int


def _uniform_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int, halo: Any, boundary: str,
                  ndim: int, width: int, op: str) -> HaloPlan:
    """The plan of ``halo_exchange``: checks that depend on agreed values only, so they fail on every rank alike."""
    (sizes,) = extents
    boundary = check_boundary(boundary)
    dim = dim % ndim
    before, after = (halo, halo) if isinstance(halo, int) else halo
    total = sum(sizes)
    if boundary in POLE_MODES:
        if dim == ndim - 1:
            raise ValueError(f"{op}: pole boundary exchanges latitude and rolls the last dim (longitude); "
                             f"it cannot exchange the last dim itself (dim={dim})")
        if width % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, "
                             f"got W={width}")
    if max(before, after) > total:
        raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                         f"({total} rows along dim {dim} over {cg.size} ranks); expected at most {total}")
    offs = offsets(sizes)
    needs = tuple((offs[r] - before, offs[r + 1] + after) for r in range(cg.size))
    ex_id = exchanger_id(cg, dim, sizes, needs, boundary, op)
    return HaloPlan(ex_id, dim, needs[cg.index][1] - needs[cg.index][0])


def _halo_arg(halo: Any) -> Any:
    return tuple(halo) if isinstance(halo, list) else halo


def _plan_uniform(x: torch.Tensor, halo: Any, dim: Any, group: Any, boundary: Any, op: str,
                  source: torch.Tensor | None = None) -> HaloPlan:
    halo = _halo_arg(halo)
    width = x.shape[-1] if x.dim() else 0
    return resolve(x, group, op, _uniform_plan, (dim, halo, boundary, x.dim(), width, op),
                   spec=(dim, halo, boundary), source=source)


def halo_exchange(x: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *, group: Any | None = None,
                  boundary: str = "zeros") -> torch.Tensor:
    """Return the local shard extended by ``halo`` rows of its neighbours along ``dim``.

    Args:
        x: this rank's shard; ranks of ``group`` (in group order) hold consecutive slabs along ``dim``.
        halo: rows on both sides, or ``(before, after)``; may exceed a neighbour's shard (rows then come from
            further ranks) but not the whole domain.
        group: the domain group along ``dim``; default the initialised manager's domain group.
        boundary: what fills rows beyond the first and last rank: ``zeros``, ``replicate``, ``reflect``,
            ``circular`` (= ``periodic``), ``pole`` / ``pole_centered`` (across the pole, rolled by W/2).

    With one rank this is ``F.pad`` (and the pole construction). Backward is the exact adjoint: halo gradients
    return to the rank owning those rows and are added there. The first call under an epoch (``halo.plans``)
    agrees on every rank's arguments, so a wrong argument on any rank raises the same error on every rank; waits
    are bounded (:func:`halo.set_timeout`).
    """
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange")
    out = exchange(x, plan.ex, plan.rows, plan.dim)
    carry(out, x)
    return out


@torch._dynamo.disable  # in place, from Python (no custom op): eager, a graph break under torch.compile
def halo_exchange_(ext: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *, group: Any | None = None,
                   boundary: str = "zeros") -> torch.Tensor:
    """In place: fill the halo rows of an extended buffer whose middle rows hold this rank's shard.

    ``ext`` has ``before + n + after`` rows along ``dim``, the shard in rows ``[before, before + n)``; the
    ``before`` first and ``after`` last rows are overwritten with the neighbours' rows (or the boundary fill)
    and ``ext`` is returned. No copy of the shard is made, so the wire is this form's floor (the out-of-place
    :func:`halo_exchange` also pays one copy of the shard). Not differentiable: for inference and rollouts,
    or a layer that owns its buffer; use :func:`halo_exchange` under autograd.

    A buffer made by :func:`halo_exchange` of a shard halo made (``ext = halo_exchange(halo.shard(x), 1)``, then
    ``ext`` refilled in place step after step) keeps that shard's epoch: after its first call, no agreement.
    """
    # Form the shard view locally where the arguments allow; otherwise hand the agreement something it will
    # refuse on every rank (a malformed halo or dim is named by it; a buffer thinner than its halo shows up as a
    # rank with no rows), so that no rank raises alone.
    x = ext
    halo = _halo_arg(halo)
    pair = (halo, halo) if isinstance(halo, int) else halo if isinstance(halo, tuple) else None
    if pair is not None and len(pair) == 2 and all(isinstance(h, int) and h >= 0 for h in pair) \
            and isinstance(dim, int) and -ext.dim() <= dim < ext.dim():
        n = ext.shape[dim] - pair[0] - pair[1]
        x = ext.narrow(dim, pair[0], n) if n >= 0 else ext.narrow(dim, 0, 0)
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange_", source=ext)
    if torch.is_grad_enabled() and ext.requires_grad:  # after the agreement: the same verdict on every rank
        raise RuntimeError("halo_exchange_ writes in place and is not differentiable; use halo_exchange (which "
                           "returns a new tensor) under autograd, or call this under torch.no_grad()")
    ex = get_exchanger(plan.ex)
    with torch.no_grad():
        ex.finish(x, ex.start(x), out=ext)
    return ext


class HaloHandle:
    """An exchange in flight: ``wait()`` returns the extended shard (differentiable w.r.t. ``x``).

    Under ``torch.compile`` its start and its wait are graph breaks (run eagerly, in program order on every rank:
    Python posting and waiting is never traced into a graph, where nothing would order it); for an exchange inside
    a compiled graph use :func:`halo_exchange` (the ordered ``halo::exchange`` custom op)."""

    @torch._dynamo.disable  # posts from Python (no custom op): eager, a graph break under torch.compile
    def __init__(self, x: torch.Tensor, ex_id: int) -> None:
        self._x, self._exchanger = x, get_exchanger(ex_id)
        self._pending: dict | None = self._exchanger.start(x.detach())
        self._result: torch.Tensor | None = None

    @torch._dynamo.disable  # waits from Python: eager, a graph break under torch.compile
    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = _ExchangeFn.apply(self._x, self._exchanger, self._pending)
            self._pending = None
            carry(self._result, self._x)
        return self._result


def halo_exchange_async(x: torch.Tensor, halo: int | Sequence[int], dim: int = -2, *,
                        group: Any | None = None, boundary: str = "zeros") -> HaloHandle:
    """Start :func:`halo_exchange` now and return a handle; compute on ``x`` meanwhile, then ``wait()``."""
    plan = _plan_uniform(x, halo, dim, group, boundary, "halo_exchange_async")
    return HaloHandle(x, plan.ex)


class Exchange2d(NamedTuple):
    """An exchange of a latitude x longitude block as planned for this rank (:func:`plan_exchange_2d`): along H over
    the mesh's H group (exchanger id, extended rows), the pole strips' roll by half the longitudes along W over the W
    group (exchanger id; ``top`` / ``bottom``: the extended rows across the pole), then along W over the W group."""

    h: int
    h_rows: int
    roll: int
    top: int
    bottom: int
    w: int
    w_rows: int
    dims: tuple[int, int]


def _pole_rows(need: tuple[int, int], n: int) -> tuple[int, int]:
    lo, hi = need
    return max(0, min(hi, 0) - lo), max(0, hi - max(lo, n))


def plan_exchange_2d(groups: tuple[Any, Any], sizes: tuple[tuple[int, ...], tuple[int, ...]],
                     needs: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]], boundaries: tuple[str, str],
                     dims: tuple[int, int], op: str) -> Exchange2d:
    """Plan an exchange along H then W of a 2-D mesh (pure in its agreed arguments: raises alike on every rank).

    ``groups``: the H and W axis groups; ``sizes[k]`` / ``needs[k]``: the extents of the ranks of this rank's line
    along axis ``k`` and the virtual rows each needs (as :func:`exchanger_id`); ``dims``: the tensor dims of H and
    W (non-negative). Exchanging H first and then W of the H-extended block fills the corners right.

    A pole boundary in H with W sharded: the rows across the pole are the mirrored rows (``reflect`` for
    ``pole``, ``symmetric`` for ``pole_centered``) rolled by W/2 around the whole circle, which other ranks of the
    W group hold; so H is exchanged with the mirror, and the strips of rows across the pole are then rolled along W
    by one more exchange over the W group (a circular exchange whose rows are shifted by W/2). The ranks of a W
    group share their H position, so they roll the same strips together.
    """
    cg_h, cg_w = comm_group(groups[0]), comm_group(groups[1])
    bh, bw = check_boundary(boundaries[0]), check_boundary(boundaries[1])
    roll, top, bottom = -1, 0, 0
    if bh in POLE_MODES:
        width = sum(sizes[1])
        if width % 2:
            raise ValueError(f"{op}: pole boundary needs an even number of longitudes to roll by W/2, got W={width}")
        top, bottom = _pole_rows(tuple(needs[0][cg_h.index]), sum(sizes[0]))
        offs, half = offsets(sizes[1]), width // 2
        roll = exchanger_id(cg_w, dims[1], sizes[1], tuple((offs[j] + half, offs[j + 1] + half)
                                                           for j in range(len(sizes[1]))), "circular", op)
        bh = "reflect" if bh == "pole" else "symmetric"
    lo_h, hi_h = needs[0][cg_h.index]
    lo_w, hi_w = needs[1][cg_w.index]
    return Exchange2d(exchanger_id(cg_h, dims[0], sizes[0], needs[0], bh, op), hi_h - lo_h, roll, top, bottom,
                      exchanger_id(cg_w, dims[1], sizes[1], needs[1], bw, op), hi_w - lo_w, dims)


def exchange_2d(x: torch.Tensor, plan: Exchange2d) -> torch.Tensor:
    """Run a planned :class:`Exchange2d` with autograd (each step an exact-adjoint exchange)."""
    dh, dw = plan.dims
    t = exchange(x, plan.h, plan.h_rows, dh)
    if plan.top or plan.bottom:
        rows, cols = t.shape[dh], x.shape[dw]
        parts = []
        if plan.top:
            parts.append(exchange(t.narrow(dh, 0, plan.top).contiguous(), plan.roll, cols, dw))
        parts.append(t.narrow(dh, plan.top, rows - plan.top - plan.bottom))
        if plan.bottom:
            parts.append(exchange(t.narrow(dh, rows - plan.bottom, plan.bottom).contiguous(), plan.roll, cols, dw))
        t = torch.cat(parts, dh)
    return exchange(t, plan.w, plan.w_rows, dw)


def _plan_2d(cg: CommGroup, extents: tuple, groups: tuple, dims: tuple, halos: tuple, boundaries: tuple,
             ndim: int, op: str) -> Exchange2d:
    needs = []
    for sizes, d, halo in zip(extents, dims, halos, strict=True):
        before, after = (halo, halo) if isinstance(halo, int) else halo
        total = sum(sizes)
        if max(before, after) > total:
            raise ValueError(f"{op}: a halo of {max(before, after)} rows is wider than the whole domain "
                             f"({total} rows along dim {d} over {len(sizes)} ranks); expected at most {total}")
        offs = offsets(sizes)
        needs.append(tuple((offs[r] - before, offs[r + 1] + after) for r in range(len(sizes))))
    return plan_exchange_2d(groups, extents, tuple(needs), boundaries, tuple(d % ndim for d in dims), op)


def halo_exchange_2d(x: torch.Tensor, halo_h: int | Sequence[int], halo_w: int | Sequence[int], *,
                     mesh: DomainMesh | None = None, boundary_h: str = "zeros",
                     boundary_w: str | None = None) -> torch.Tensor:
    """Exchange along H over the mesh's first domain axis, then along W over the second, so corners are right.

    ``boundary_w`` defaults to ``circular`` when the mesh's W axis is periodic, else ``zeros``. A pole boundary
    in H works with W sharded too: the rows across the pole are rolled by W/2 around the whole circle by one more
    exchange along W (:func:`plan_exchange_2d`). Both exchanges are validated by one agreement over the whole
    domain group, so every rank of the domain raises the same error.
    """
    op = "halo_exchange_2d"
    if mesh is None:  # (the domain-parallel manager's mesh has one domain axis: never a fallback)
        raise RuntimeError(f"{op} needs mesh=halo.DomainMesh((ph, pw)), built on every rank after "
                           f"torch.distributed.init_process_group()")
    if len(mesh.domain_shape) != 2:
        raise ValueError(f"{op} needs a mesh with two domain axes, got {mesh.domain_shape}; build one with "
                         f"halo.DomainMesh((ph, pw))")
    if boundary_w is None:
        boundary_w = "circular" if mesh.periodic[1] else "zeros"
    halo_h, halo_w = _halo_arg(halo_h), _halo_arg(halo_w)
    coords = mesh_coords(tuple(mesh.domain_shape))
    dims = mesh.shard_dims
    specs = ((dims[0], halo_h, boundary_h), (dims[1], halo_w, boundary_w))
    extra = ((mesh.axis_group(0), mesh.axis_group(1)), dims, (halo_h, halo_w), (boundary_h, boundary_w), x.dim(), op)
    plan = resolve(x, mesh.domain_group, op, _plan_2d, extra, spec=specs, coords=coords)
    out = exchange_2d(x, plan)
    carry(out, x)
    return out


# -- kept for old callers -----------------------------------------------------------------------------------------

class static_shapes:  # noqa: N801 - the name of the context manager it replaces
    """No longer needed, kept as a harmless no-op: every halo op learns its peers' extents once per epoch on its
    own (``halo.plans``). ``with halo.static_shapes(tag):`` runs its body unchanged."""

    def __init__(self, tag: Any = "default") -> None:
        self.tag = tag

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

