"""One rank's part of one halo exchange plan, without autograd: pack, post, finish, and the adjoint.

The primitive under :mod:`halo.exchange` (which adds autograd, the compiled custom ops and the public functions) and
:mod:`halo.exchange._registry` (which names exchangers by small ints). Messages are dim-major buffers
(``kernels.pack``): rows along ``dim`` outermost, so every message and every received piece is a contiguous slice.
Posting and waiting go through :mod:`halo.dist.transport`, the one place that does.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import kernels
from ..dist import transport
from ..dist.comm import CommGroup
from ..plan.partition import RankPlan
from ..plan.plans import device_tensor

__all__ = ["Exchanger", "like_format", "memory_format", "post_messages"]


# -- memory formats ------------------------------------------------------------------------------------------

def memory_format(x: torch.Tensor) -> torch.memory_format:
    """``x``'s memory format (channels_last, channels_last_3d or contiguous), as torch's ops keep it: an extended
    shard, a shard or a gathered field of a channels_last field is channels_last, as the unsharded model's are."""
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
    fmt = memory_format(x)
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
    """The old form of :func:`halo.dist.transport.post_rows` (which it calls): the requests and their labels, for
    :func:`halo.dist.comm.wait_all`. New code posts with ``transport.post_rows`` and waits with ``transport.wait``."""
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
        self.pool = transport.BufferPool()  # message strips only (send, receive, their adjoints): never an activation
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

    def finish(self, x: torch.Tensor, pending: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``[before | interior | after]``: into ``out`` if given (if ``x`` is ``out``'s middle already, only
        the halo rows are written), else into a fresh tensor. The interior is copied *before* waiting for the
        messages, while they travel; the halo rows after.

        Never a pooled buffer: an extended shard is an activation (a conv saves it for backward), as large as the
        shard; pooled, it would stay allocated after autograd frees it, for every shape, of every live exchanger,
        and never go back to the caching allocator (GBs at 721 x 1440 x 256 channels). Fresh, it is freed with the
        graph and the caching allocator reuses its memory. The pool keeps the message strips only."""
        p, dim = self.plan, self.dim
        nb, (i0, ni) = len(p.before), p.interior
        if out is None:
            shape = list(x.shape)
            shape[dim] = self.ext_rows()
            out = kernels.reference.alloc_like(x, shape)
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
