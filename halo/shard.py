"""Shard, scatter and gather a field along one tensor dim (or H and W of a 2-D mesh), autograd-aware.

Shards are the balanced split (``torch.tensor_split``; 721 rows over 4 ranks: 181, 180, 180, 180) in group
order; ``gather`` concatenates whatever extents the ranks hold. Uneven sizes travel padded to the largest shard
(gloo refuses uneven all-gathers), in dim-major buffers (rows along ``dim`` outermost: every message is one
contiguous slice of one buffer, which gloo requires).

Three kinds of value, and the inner product each is measured with (the dot-product tests use these)::

    sharded      rank r holds x_r                       <x, y> = sum_r <x_r, y_r>
    on one rank  only rank s holds X                    <X, Y> = <X_s, Y_s>
    replicated   every rank holds the same X            <X, Y> = mean_r <X_r, Y_r>   (counted once)

"Counted once" is the convention of ``halo.parallel.reduce``: a loss computed identically on every rank from a gathered
field is one loss, with the gradient one device would give. Under it the four ops are two adjoint pairs::

    op                 input        output       backward (the exact adjoint)
    shard(x)           replicated   sharded      all-gather of the slice gradients (replicated result)
    gather(x)          sharded      replicated   own slice of the mean over ranks of the incoming gradients
    scatter(x, src)    on src       sharded      gather of the slice gradients onto src
    gather(x, dst)     sharded      on dst       scatter of dst's gradient

The mean in ``gather``'s backward projects gradients that differ across ranks onto the replicated space (a
per-rank different loss of a replicated field is averaged); when they agree it is the plain slice. So the
gradient of a replicated value is whole on every rank, not a per-rank part: ``shard(gather(x))`` is the
identity forward and backward, but a parameter used only in replicated computation (before ``shard``, after
``gather``) already holds its whole gradient on every rank and must not be summed again over the domain group
(``halo.parallel.sync_domain_gradients`` sums).

Like every collective, these must be called by every rank of the group in the same order, with the same
``dim``/``src``/``dst``, the same grad mode and the same ``requires_grad``; and backward must run through
the result on every rank (the backward is a collective too). Layers: primitives (no autograd) ->
``_XxxFn`` -> public functions, which validate.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from .dist import transport
from .dist.comm import CommGroup, comm_group
from .dist.mesh import DomainMesh, mesh_coords
from .dist.transport import eager_only
from .exchange.exchanger import memory_format
from .plan.agree import DEVICES, DTYPES, MAX_NDIM, ROW_WORDS, SHAPE_AT, Meta, Spec, agree_with
from .plan.entry import KEY_ATTR, FieldSpec, fingerprint, key_digest, set_spec, spec_of
from .plan.partition import split_problem, split_sizes
from .plan.plans import epoch_of, field_epoch, resolve, shard_sizes, tag, whole_source

__all__ = ["shard", "scatter", "gather", "shard_2d", "scatter_2d", "gather_2d", "local_rows"]


# -- primitives (no autograd): x is a tensor with extent sizes[index] along dim on each rank --------------------

def _rest(x: torch.Tensor, dim: int) -> list[int]:
    return [s for i, s in enumerate(x.shape) if i != dim]


def _empty_like(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with extent 0 along ``dim``: what ranks without a result get."""
    return x.new_empty([0 if i == dim else s for i, s in enumerate(x.shape)])


def _pack(pieces: list[torch.Tensor], dim: int, rows: int) -> torch.Tensor:
    """Each piece moved dim-major into ``rows`` rows (zero-padded) of one fresh contiguous buffer."""
    buf = pieces[0].new_empty((len(pieces) * rows, *_rest(pieces[0], dim)))
    for k, p in enumerate(pieces):
        n = p.shape[dim]
        buf[k * rows:k * rows + n].copy_(p.movedim(dim, 0))
        buf[k * rows + n:(k + 1) * rows].zero_()
    return buf


def _chunks(buf: torch.Tensor, parts: int) -> list[torch.Tensor]:
    rows = buf.shape[0] // parts
    return [buf[k * rows:(k + 1) * rows] for k in range(parts)]


def _unpack(buf: torch.Tensor, sizes: tuple[int, ...], dim: int, rows: int,
            fmt: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """Inverse of ``_pack``: the pieces (their first ``sizes[k]`` rows) concatenated along ``dim``, in ``fmt``."""
    shape = list(buf.shape[1:])
    shape.insert(dim, sum(sizes))
    out = torch.empty(shape, dtype=buf.dtype, device=buf.device, memory_format=fmt)
    at = 0
    for k, n in enumerate(sizes):
        out.narrow(dim, at, n).copy_(buf[k * rows:k * rows + n].movedim(0, dim))
        at += n
    return out


def _silent(x: torch.Tensor, sizes: tuple[int, ...], dim: int) -> bool:
    """Nothing to send (every rank computes the same answer: sizes and other dims are agreed)."""
    return max(sizes) == 0 or math.prod(_rest(x, dim)) == 0


def _slice(x: torch.Tensor, sizes: tuple[int, ...], dim: int, index: int) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[:index]), sizes[index]).clone(memory_format=memory_format(x))


@eager_only  # posts a collective: never traced into a compiled graph (halo.dist.comm)
def _all_gather(x: torch.Tensor, sizes: tuple[int, ...], dim: int, info: CommGroup) -> torch.Tensor:
    """Every rank's piece, concatenated along ``dim`` in group order, on every rank."""
    if info.size == 1:
        return x.clone()
    rows = max(sizes)
    recv = x.new_empty((info.size * rows, *_rest(x, dim)))
    if not _silent(x, sizes, dim):
        send = _pack([x], dim, rows)
        transport.all_gather(_chunks(recv, info.size), send, info, "gather")
    return _unpack(recv, sizes, dim, rows, memory_format(x))


@eager_only  # posts a collective: never traced into a compiled graph (halo.dist.comm)
def _gather_to(x: torch.Tensor, sizes: tuple[int, ...], dim: int, info: CommGroup, dst: int) -> torch.Tensor:
    """The concatenation on group rank ``dst``; elsewhere an empty tensor (extent 0 along ``dim``)."""
    if info.size == 1:
        return x.clone()
    rows, here = max(sizes), info.index == dst
    recv = x.new_empty((info.size * rows, *_rest(x, dim))) if here else None
    if not _silent(x, sizes, dim):
        send = _pack([x], dim, rows)
        transport.gather(send, _chunks(recv, info.size) if here else None, info, "gather", dst)
    return _unpack(recv, sizes, dim, rows, memory_format(x)) if here else _empty_like(x, dim)


@eager_only  # posts a collective: never traced into a compiled graph (halo.dist.comm)
def _scatter_from(x: torch.Tensor | None, sizes: tuple[int, ...], dim: int, info: CommGroup, src: int,
                  like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``x`` (held on group rank ``src`` only); ``like``: an empty tensor of the
    right dtype/device/ndim whose other dims are those of ``x``."""
    if info.size == 1:
        return x.clone()
    rows = max(sizes)
    recv = like.new_empty((rows, *_rest(like, dim)))
    if not _silent(like, sizes, dim):
        send = None
        if info.index == src:
            send = _chunks(_pack(list(x.split(list(sizes), dim)), dim, rows), info.size)
        transport.scatter(recv, send, info, "scatter", src)
    return recv[:sizes[info.index]].movedim(0, dim).contiguous()


@eager_only  # posts a collective: never traced into a compiled graph (halo.dist.comm)
def _reduce_scatter_mean(x: torch.Tensor, sizes: tuple[int, ...], dim: int, info: CommGroup) -> torch.Tensor:
    """This rank's piece of the mean over ranks of the full tensors ``x``."""
    if info.size == 1:
        return x.clone()
    rows = max(sizes)
    recv = x.new_zeros((rows, *_rest(x, dim)))
    if not _silent(x, sizes, dim):
        send = _pack(list(x.split(list(sizes), dim)), dim, rows)
        transport.reduce_scatter(recv, _chunks(send, info.size), info, "gather (backward)")
        recv.div_(info.size)
    return recv[:sizes[info.index]].movedim(0, dim).contiguous()


# -- autograd: each forward beside its adjoint ------------------------------------------------------------------

class _ShardFn(torch.autograd.Function):
    """Forward: keep this rank's slice of the replicated ``x``. Backward: all-gather of the slice gradients."""

    @staticmethod
    def forward(ctx, x, sizes, dim, info):
        ctx.args = sizes, dim, info
        return _slice(x, sizes, dim, info.index)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


class _GatherFn(torch.autograd.Function):
    """Forward: all-gather (replicated result). Backward: own slice of the mean of the incoming gradients."""

    @staticmethod
    def forward(ctx, x, sizes, dim, info):
        ctx.args = sizes, dim, info
        return _all_gather(x, sizes, dim, info)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_mean(grad, *ctx.args), None, None, None


class _ScatterFn(torch.autograd.Function):
    """Forward: src's tensor split over the ranks. Backward: gather of the slice gradients onto src.

    ``anchor``: on ranks other than src an empty leaf that requires grad when src's input does, so that those
    ranks' results are in the graph and their backward joins the gather.
    """

    @staticmethod
    def forward(ctx, x, anchor, like, sizes, dim, info, src):
        ctx.args = sizes, dim, info, src
        return _scatter_from(x, sizes, dim, info, src, like)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, info, src = ctx.args
        full = _gather_to(grad, sizes, dim, info, src)
        return (full if info.index == src else None), None, None, None, None, None, None


class _GatherToFn(torch.autograd.Function):
    """Forward: gather onto dst (others: empty). Backward: scatter of dst's gradient."""

    @staticmethod
    def forward(ctx, x, sizes, dim, info, dst):
        ctx.args = sizes, dim, info, dst
        ctx.like = _empty_like(x, dim)
        return _gather_to(x, sizes, dim, info, dst)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, info, dst = ctx.args
        return _scatter_from(grad if info.index == dst else None, sizes, dim, info, dst, ctx.like), *[None] * 4


# -- public API ---------------------------------------------------------------------------------------------

def _check_rank(value: Any, info: CommGroup, op: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < info.size:
        raise ValueError(f"{op}: {name}={value!r} is not a rank of the group: expected an int in "
                         f"[0, {info.size}) (a position in the group, not a global rank)")
    return value


def _split(op: str, n: int, parts: int, granularity: int) -> tuple[int, ...]:
    """The split of ``n`` rows over ``parts`` ranks (of blocks of ``granularity`` rows), errors naming ``op``."""
    try:
        return tuple(split_sizes(n, parts, granularity))
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def _field_shape(shape: tuple[int, ...], granularity: int) -> tuple:
    """What names a field's epoch: its global shape, and its granularity when that is not 1 (two splits of one
    shape are two epochs: a layer's recorded plan holds for one split only)."""
    return shape if granularity == 1 else (*shape, ("granularity", granularity))


def _shard_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], dim: int,
                granularity: int = 1) -> tuple[int, ...]:
    (sizes,) = extents
    if len(set(sizes)) != 1:
        raise ValueError(f"shard: x must be the same whole tensor on every rank of the group, but its extents "
                         f"along dim {dim} differ: {list(sizes)} (group ranks 0..{cg.size - 1}); "
                         f"use scatter() when only one rank holds it")
    return _split("shard", sizes[0], cg.size, granularity)


def shard(x: torch.Tensor, dim: int = -2, *, group: Any | None = None, granularity: int = 1) -> torch.Tensor:
    """This rank's slice of ``x``, which every rank of ``group`` holds whole (the balanced split, group order).

    ``x`` is replicated: the same tensor on every rank, counted once. Every call agrees (one small all-gather of
    host data): a shape, dtype or dim that differs on one rank is the same ``ValueError`` on every rank, and, for a
    host (CPU) tensor, a fingerprint of a strided subsample of ``x`` (and ``x.halo_sample_key``, if set) must be the
    same on every rank: ranks holding different samples are refused (no device tensor is read). The result carries
    its spec (global shape, dim, group: ``halo.plan.entry.FieldSpec``), from which a converted model takes its grid.
    Backward: the full gradient on every rank is the concatenation of all ranks' slice gradients (all-gather).
    ``granularity=g``: the balanced split of blocks of ``g`` rows (``g * split_sizes(N // g, P)``), so that
    attention windows or patches of ``g`` rows never straddle two ranks; a ``ValueError`` on every rank when
    ``N`` is not a multiple of ``g`` or a rank would get no block (:func:`halo.plan.partition.split_sizes`).
    """
    info = comm_group(group)
    if torch.compiler.is_compiling():  # (traced: the plan is a constant of the graph, learned once per shape)
        sizes = resolve(x, info.group, "shard", _shard_plan, (dim % max(x.dim(), 1), granularity), spec=(dim,),
                        grad=False, allow_empty=True, replicated=True)
        fp = 0
    else:
        sizes, fp = _agree_shard(x, dim, info, granularity)
    out = _ShardFn.apply(x, sizes, dim % x.dim(), info)
    tag(out, field_epoch(info, dim % x.dim(), _field_shape(tuple(x.shape), granularity)))
    if not torch.compiler.is_compiling():
        _mark_share(out, x, (dim % x.dim(),), info, (info.size,), fp)
    return out


def _mark_share(out: torch.Tensor, x: torch.Tensor | None, dims: tuple[int, ...], info: CommGroup,
                parts: tuple[int, ...], fp: int, shape: tuple[int, ...] | None = None) -> None:
    """Record on ``out`` the field it is a share of (``halo.plan.entry``: a converted model takes its grid from it), and
    keep the sample key of the field it was cut from."""
    set_spec(out, FieldSpec(tuple(x.shape) if shape is None else shape, dims, info.ranks, parts, fp))
    key = getattr(x, KEY_ATTR, None) if x is not None else None
    if key is not None:
        setattr(out, KEY_ATTR, key)


def _different_samples(op: str, info: CommGroup, tails: Any, what: str) -> ValueError:
    odd = [r for r in range(info.size) if (tails[r] != tails[0]).any()]
    return ValueError(
        f"{op}: ranks {','.join(str(r) for r in [0, *odd])} of the domain group are looking at different samples: "
        f"{what} {[format(int(v), '#x') for v in tails[:, 0]]} on group ranks 0..{info.size - 1} (a fingerprint of "
        f"the whole field each rank holds, and its halo_sample_key); every rank of a domain group must hold the same "
        f"field: sample with halo's data-parallel sampler / DistributedSampler(num_replicas=dp_size, rank=dp_rank)")


@eager_only  # an agreement on host data: never traced
def _agree_shard(x: torch.Tensor, dim: int, info: CommGroup, granularity: int) -> tuple[tuple[int, ...], int]:
    """The split of ``x`` along ``dim`` and a fingerprint of ``x``, agreed on every call: a shape, dtype or field
    that differs on one rank is the same error on every rank (one small all-gather of host data, as any
    agreement). The fingerprint (host tensors only: nothing is read from a device) and ``x.halo_sample_key`` ride
    on it: ranks that hold different samples are refused on every rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard: x must be a tensor, got {type(x).__name__}")
    fp, key = fingerprint(x)[0], key_digest(getattr(x, KEY_ATTR, None))
    extents, tails = agree_with(Meta.of(x, (Spec.of(dim),)), (fp, key), info, "shard", allow_empty=True)
    sizes = _shard_plan(info, extents, dim % x.dim(), granularity)  # (shapes first: a fingerprint includes it)
    if (tails != tails[0]).any():
        raise _different_samples("shard", info, tails, "fingerprints")
    return sizes, fp


def gather(x: torch.Tensor, dim: int = -2, *, group: Any | None = None, dst: int | None = None) -> torch.Tensor:
    """Concatenate the ranks' shards along ``dim`` in group order (any extents, the other dims equal).

    Refuses, on every rank alike, what is not a shard: extents that are not the balanced split of their sum (nor
    one of whole blocks), a gather's own output (whole already), and a host tensor with the same non-constant values
    on every rank (a fingerprint of a strided subsample rides on the agreement a tensor halo did not make needs).

    ``dst=None``: the whole tensor on every rank (replicated, counted once); backward gives each rank its slice
    of the mean of the ranks' incoming gradients (its slice, when they agree). ``dst=s`` (a position in the
    group): the whole tensor on group rank ``s``; every other rank gets an empty tensor (extent 0 along
    ``dim``) which is still part of the graph: its backward receives that rank's slice of ``s``'s gradient, so
    those ranks must backpropagate through it too (e.g. add ``out.sum()``, which is 0, to their loss).
    """
    info = comm_group(group)
    if dst is not None:
        _check_rank(dst, info, "gather", "dst")
    whole = whole_source(x)
    if getattr(x, _GATHERED, None) == info.ranks:
        whole = "halo.gather over this group"
    if whole is not None and info.size > 1:  # (marked on every rank alike: by a gather, a global pool)
        raise ValueError(f"gather: x is already whole and the same on every rank (the output of {whole}); gathering "
                         f"it would stack {info.size} copies along dim {dim}: use it as it is")
    if isinstance(x, torch.Tensor) and info.size > 1 and epoch_of(x) is None and not torch.compiler.is_compiling():
        sizes = _agree_gather(x, dim, info)  # a tensor halo did not make: checked on every call
    else:
        sizes = shard_sizes(x, dim, info.group, op="gather", allow_empty=True)
    if isinstance(x, torch.Tensor) and not torch.compiler.is_compiling():
        _check_share(x, sizes, dim, info)
    if dst is None:
        out = _GatherFn.apply(x, sizes, dim % x.dim(), info)
        if info.size > 1 and not torch.compiler.is_compiling():
            setattr(out, _GATHERED, info.ranks)  # whole on this group's ranks (not on another group's)
        return out
    return _GatherToFn.apply(x, sizes, dim % x.dim(), info, dst)


_GATHERED = "_halo_gathered"  # a gather's output: the group's global ranks it is whole over


def _check_share(x: torch.Tensor, sizes: tuple[int, ...], dim: int, info: CommGroup) -> None:
    """Refuse what is not a shard: extents that are not the balanced split of their sum (nor one of whole blocks),
    or a shard of a field whose spec says another split. The extents are agreed, so every rank raises alike."""
    problem = split_problem(sizes)
    if problem is not None:
        raise ValueError(f"gather: the ranks' tensors are not the shares of one tensor along dim {dim}: {problem}")
    spec = spec_of(x)
    d = dim % x.dim()
    if spec is not None and spec.ranks == info.ranks and spec.dims == (d,) and sum(sizes) != spec.shape[d]:
        raise ValueError(f"gather: x is a shard (halo.shard) of a field of {spec.shape[d]} along dim {dim}, but the "
                         f"ranks' extents {list(sizes)} add up to {sum(sizes)}")


@eager_only  # an agreement on host data: never traced
def _agree_gather(x: torch.Tensor, dim: int, info: CommGroup) -> tuple[int, ...]:
    """Every rank's extent along ``dim``, agreed (as for any tensor halo did not make), with a fingerprint of each
    rank's tensor riding on the same all-gather (host tensors only): the same non-constant values on every rank
    are a tensor that is whole already, not shards of one, and are refused on every rank."""
    value, constant = fingerprint(x)
    if not constant and x.dim() and x.shape[dim] > 1 and x.device.type == "cpu":
        # Rows that are all alike (a field that does not vary along ``dim``, or a gradient of a global pool's
        # input): shards of such a field are alike on every rank too, and their gather is right; not refused.
        xd = x.detach()
        constant = torch.equal(xd, xd.narrow(dim, 0, 1).expand_as(xd))
    extents, tails = agree_with(Meta.of(x, (Spec.of(dim),)), (0 if constant else value,), info, "gather",
                                allow_empty=True)
    (sizes,) = extents
    if tails[0, 0] and (tails[:, 0] == tails[0, 0]).all():
        raise ValueError(
            f"gather: every rank of the group holds the same values (a tensor of shape {tuple(x.shape)}: the same "
            f"fingerprint of a strided subsample on group ranks 0..{info.size - 1}): x is already whole, and "
            f"gathering it would give {sum(sizes)} rows along dim {dim} instead of {sizes[0]}; gather shards "
            f"(halo.shard, a converted model's output), or use x as it is")
    return sizes


def _scatter_meta(x: Any, info: CommGroup, src: Any, dim: Any, granularity: Any) -> list[int]:
    """src's :meth:`halo.plan.agree.Meta.row` of ``x`` on every rank (host data; word 1 flags what src got wrong:
    1 not a tensor, 2 too many dims, 3 a dtype without a code), after checking that every rank passed the same
    ``src``, ``dim`` and ``granularity``: one all-gather of every rank's row (not a broadcast of src's), so an
    argument wrong on one rank only is the same error on every rank."""
    def code(v: Any) -> int:
        try:
            return operator.index(v) if not isinstance(v, bool) else -(1 << 40)
        except TypeError:
            return -(1 << 40)  # not an int: judged below, alike on every rank

    args = [code(src), code(dim), code(granularity)]
    row = [0] * ROW_WORDS
    if args[0] == info.index:
        if not isinstance(x, torch.Tensor):
            row[1] = 1
        elif x.dim() > MAX_NDIM:
            row[1], row[2] = 2, x.dim()
        elif x.dtype not in DTYPES:
            row[1] = 3
        else:
            row = Meta.of(x, (Spec.of(dim),), int(x.requires_grad and torch.is_grad_enabled())).row()
            row[1] = 0  # a bad dim is judged on every rank below
    if info.size == 1:
        return row
    table = transport.gather_words([*args, *row], info, "scatter (shape)")  # host data, once per scatter
    if (table[:, :3] != table[0, :3]).any():
        shown = [tuple(int(v) for v in r[:3]) for r in table]
        raise ValueError(f"scatter: the ranks of the group pass different (src, dim, granularity): {shown} on group "
                         f"ranks 0..{info.size - 1} (a value that is not an int shows as {-(1 << 40)}); pass the "
                         f"same src, dim and granularity on every rank")
    at = int(table[0, 0])
    return [int(v) for v in table[at, 3:]] if 0 <= at < info.size else row


def scatter(x: torch.Tensor | None, dim: int = -2, *, src: int = 0, group: Any | None = None,
            granularity: int = 1) -> torch.Tensor:
    """Split the tensor held by group rank ``src`` over the ranks (balanced split); return this rank's slice.

    Other ranks pass ``None`` (anything they pass is ignored): shape, dtype, device type and whether it
    requires grad are broadcast from ``src``. Results live on the current CUDA device for a CUDA tensor, else on
    the CPU. Backward: the slice gradients are gathered onto ``src`` (``x.grad`` there); other ranks have no
    input to give a gradient to, but must run backward through their slice. ``granularity=g``: the balanced
    split of blocks of ``g`` rows, as :func:`shard` (its errors are raised on every rank alike).
    """
    info = comm_group(group)
    row = _scatter_meta(x, info, src, dim, granularity)
    _check_rank(src, info, "scatter", "src")
    who = f"group rank {src} (src, global {info.ranks[src]})"
    if row[1] == 1:
        raise ValueError(f"scatter: {who} must pass a tensor (the other ranks may pass None)")
    if row[1] == 2:
        raise ValueError(f"scatter: at most {MAX_NDIM} dims are supported, {who} has {row[2]}")
    if row[1] == 3:
        raise ValueError(f"scatter: {who} has a dtype outside {[str(d) for d in DTYPES]}")
    ndim = row[2]
    shape = row[SHAPE_AT:SHAPE_AT + ndim]
    dtype_code, device_code, grad = row[SHAPE_AT + MAX_NDIM:SHAPE_AT + MAX_NDIM + 3]
    if not -ndim <= dim < ndim:
        raise ValueError(f"scatter: dim {dim} is out of range for the {ndim}-d tensor of shape {tuple(shape)} "
                         f"on {who}")
    dim %= ndim
    device_type = DEVICES[device_code] if 0 <= device_code < len(DEVICES) else None
    if info.index == src:
        device = x.device
    elif device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type or "cpu")
    like = torch.empty([0 if i == dim else s for i, s in enumerate(shape)], dtype=DTYPES[dtype_code], device=device)
    anchor = None
    if grad == 1 and info.index != src:
        anchor = torch.empty(0, requires_grad=True)
    sizes = _split("scatter", shape[dim], info.size, granularity)
    out = _ScatterFn.apply(x if info.index == src else None, anchor, like, sizes, dim, info, src)
    tag(out, field_epoch(info, dim, _field_shape(tuple(shape), granularity)))
    if not torch.compiler.is_compiling():
        _mark_share(out, None, (dim,), info, (info.size,), 0, tuple(shape))
    return out


# -- 2-D meshes: H over mesh axis 0, W over axis 1 --------------------------------------------------------------

def _mesh_2d(mesh: DomainMesh | None, op: str) -> DomainMesh:
    if mesh is None:  # (the domain-parallel manager's mesh has one domain axis: never a fallback)
        raise RuntimeError(f"{op} needs mesh=DomainMesh((ph, pw))")
    if len(mesh.domain_shape) != 2:
        raise ValueError(f"{op} needs a mesh with two domain axes, got {mesh.domain_shape}")
    return mesh


def _mesh_rank(mesh: DomainMesh, rank: int, op: str, name: str) -> tuple[int, int]:
    """A position in the domain group (row-major over (h, w), as ``mesh.domain_rank``) -> (h, w)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < mesh.domain_size:
        raise ValueError(f"{op}: {name}={rank!r} is not a domain rank: expected an int in [0, {mesh.domain_size}) "
                         f"(row-major over the {mesh.domain_shape[0]} x {mesh.domain_shape[1]} mesh)")
    return divmod(rank, mesh.domain_shape[1])


def shard_2d(x: torch.Tensor, *, mesh: DomainMesh | None = None) -> torch.Tensor:
    """This rank's block of the replicated ``x``: H over mesh axis 0, W over axis 1 (``mesh.shard_dims``)."""
    mesh = _mesh_2d(mesh, "shard_2d")
    full, whole = tuple(x.shape), x
    x = shard(x, mesh.shard_dims[0], group=mesh.axis_group(0))
    out = shard(x, mesh.shard_dims[1], group=mesh.axis_group(1))
    # The block belongs to the whole field (one epoch over the domain group), not to the H-shard it was cut from.
    dims = tuple(d % len(full) for d in mesh.shard_dims)
    tag(out, field_epoch(comm_group(mesh.domain_group), dims, full))
    if not torch.compiler.is_compiling():
        spec = spec_of(x)
        _mark_share(out, whole, dims, comm_group(mesh.domain_group), tuple(mesh.domain_shape),
                    spec.fingerprint if spec is not None else 0)
    return out


def scatter_2d(x: torch.Tensor | None, *, src: int = 0, mesh: DomainMesh | None = None) -> torch.Tensor:
    """Split the tensor held by domain rank ``src`` into the ranks' blocks (H over axis 0, W over axis 1)."""
    mesh = _mesh_2d(mesh, "scatter_2d")
    src_h, src_w = _mesh_rank(mesh, src, "scatter_2d", "src")
    if mesh.axis_rank(1) == src_w:  # only src's column holds anything to split along H
        x = scatter(x, mesh.shard_dims[0], src=src_h, group=mesh.axis_group(0))
    out = scatter(x, mesh.shard_dims[1], src=src_w, group=mesh.axis_group(1))
    if not torch.compiler.is_compiling():
        set_spec(out, None)  # (the W scatter's spec names an H-shard; the global H is not known off src's column)
    return out


def gather_2d(x: torch.Tensor, *, mesh: DomainMesh | None = None, dst: int | None = None) -> torch.Tensor:
    """Assemble the ranks' blocks: on every rank (``dst=None``), or on domain rank ``dst`` (others: empty)."""
    mesh = _mesh_2d(mesh, "gather_2d")
    dim_h, dim_w = mesh.shard_dims
    if dst is None:
        x = gather(x, dim_w, group=mesh.axis_group(1))
        return gather(x, dim_h, group=mesh.axis_group(0))
    dst_h, dst_w = _mesh_rank(mesh, dst, "gather_2d", "dst")
    x = gather(x, dim_w, group=mesh.axis_group(1), dst=dst_w)
    if mesh.axis_rank(1) != dst_w:  # rows of this column end on dst's column; nothing more to assemble here
        return x
    return gather(x, dim_h, group=mesh.axis_group(0), dst=dst_h)


# -- a whole tensor's part that matches a shard ---------------------------------------------------------------------

def _local_part(cg: CommGroup, extents: tuple[tuple[int, ...], ...], width: int) -> tuple[tuple[int, int, int], ...]:
    """Per sharded axis ``(start, extent, total)`` of this rank (``width``: the mesh's W size; 0 for one axis)."""
    if not width:
        (sizes,) = extents
        return ((sum(sizes[:cg.index]), sizes[cg.index], sum(sizes)),)
    index = divmod(cg.index, width)
    return tuple((sum(sizes[:i]), sizes[i], sum(sizes)) for sizes, i in zip(extents, index, strict=True))


def local_rows(t: torch.Tensor, like: torch.Tensor, *, dim: int | tuple[int, int] = -2,
               like_dim: int | tuple[int, int] = -2, group: Any | None = None,
               mesh: DomainMesh | None = None) -> torch.Tensor:
    """The part of ``t`` (whole on every rank: a learned absolute positional embedding of the global grid, a
    land-sea mask, latitude features) that lines up with this rank's shard ``like``: rows ``[off_r, off_r + n_r)``
    of ``t`` along ``dim``, where ``like`` holds rows ``off_r ...`` of its global extent along ``like_dim``.

    Differentiable: ``t``'s gradient lands in this rank's rows only, so :func:`halo.parallel.sync_domain_gradients`'s
    sum over the domain group assembles a parameter's full gradient. ``mesh``: a latitude x longitude
    ``DomainMesh``; ``dim`` / ``like_dim`` are then pairs (H, W) (default ``(-2, -1)``). Every rank's extent is
    agreed on once per epoch (``halo.plan.plans``); ``t``'s extent must be the global one (a clear error otherwise).
    Use it in a model's ``forward``: ``x = x + halo.local_rows(self.pos_embed, x)``.
    """
    from .plan.plans import resolve

    op = "local_rows"
    two = mesh is not None and len(mesh.domain_shape) == 2
    if two:
        dims = dim if isinstance(dim, tuple) else (-2, -1)
        like_dims = like_dim if isinstance(like_dim, tuple) else (-2, -1)
        coords = mesh_coords(tuple(mesh.domain_shape))
        parts = resolve(like, mesh.domain_group, op, _local_part, (mesh.domain_shape[1],),
                        spec=tuple((d,) for d in like_dims), coords=coords, grad=False)
    else:
        if isinstance(dim, tuple) or isinstance(like_dim, tuple):
            raise ValueError(f"{op}: dim / like_dim pairs are for a latitude x longitude mesh (mesh=); got {dim}, "
                             f"{like_dim}")
        dims = (dim,)
        parts = resolve(like, group, op, _local_part, (0,), spec=(like_dim,), grad=False)
    for d, (start, n, total) in zip(dims, parts, strict=True):
        if not -t.dim() <= d < t.dim() or t.shape[d] != total:
            got = t.shape[d] if -t.dim() <= d < t.dim() else "no such dim"
            raise ValueError(f"{op}: t must hold the whole global extent {total} along dim {d} (the shards' "
                             f"{like_dims if two else like_dim} add up to it), got {got} in shape {tuple(t.shape)}")
        t = t.narrow(d, start, n)
    return t
