"""Randomness that does not depend on the sharding: dropout, drop-path and noise keyed on *global* indices.

torch's own dropout on an H-shard draws a mask for the shard's elements from the rank's generator. With the same
seed on every domain rank that repeats one mask in every shard (a latitude-periodic pattern); with a seed per rank,
per-sample draws (drop-path in every Swin or CrossFormer block) disagree, and one sample's shards go through
different networks. Either way the sharded model is not the unsharded one.

Here a draw is a pure function of ``(key, stream, global index)``: Philox-4x32-10 (``halo.kernels.philox``)
evaluated at the element's index in the *whole* field, so every rank draws exactly the numbers the unsharded model
would draw for its rows, with no communication, and a converted model gives the same result on 1, 2, 3 or 7 ranks
(bitwise in float64: a dropout has no cross-rank sum).

=======================  ==================================================================================
what                     where it comes from
=======================  ==================================================================================
key (one per call)       ``torch.randint`` on the tensor's device from torch's default generator: seeded
                         by ``torch.manual_seed``, replayed by activation checkpointing, captured by CUDA
                         graphs and ``torch.compile``; the same on every domain rank when their generators
                         are (checked once per plan: the ranks' generator states are compared, and differ
                         only if they were seeded differently — every rank then raises, naming the fix)
stream                   the data-parallel coordinate of the layer's own domain group: its mesh's (the
                         ``mesh=`` or ``group=`` of a ``DomainMesh``, or the manager's), else the group's
                         smallest global rank (distinct for disjoint groups); 0 in one process. Replicas
                         draw different masks, the domain ranks of one replica the same
global index             the element's position in the field ``(..., H, W)`` (H the sharded dim), learned
                         once per plan like every layer's extents (``halo.plan.plans``)
=======================  ==================================================================================

What changes against torch: the masks are not torch's stream (a converted model does not reproduce the unconverted
one's masks); the distribution is the same: each element (or channel, or sample) is dropped independently with
probability ``p`` (to 2**-24: a draw is a 24-bit integer compared with ``round(p * 2**24)``), kept ones are scaled
by ``1 / (1 - p)``. Tests check the keep rate and the independence statistically. On CUDA a dropout is one fused
Triton kernel (after the key's tiny draw) that stores no mask: the backward draws it again from the key.

Seeding: :func:`manual_seed` (``torch.manual_seed`` on every rank alike, which also makes initial parameters equal
across ranks, as DDP and the domain group want); the stream makes data-parallel replicas differ. torch's own random
ops stay torch's: after :func:`manual_seed` they draw the same on every rank — use :func:`rand_like` /
:func:`randn_like` for noise that must follow the grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import torch

from . import kernels
from .dist.comm import CommGroup, comm_group, gather_words
from .dist.mesh import dp_coordinate, mesh_coords
from .kernels import philox
from .kernels.philox import BITS
from .plan.plans import Site, carry, resolve

__all__ = [
    "TAG_DROP",
    "TAG_NORMAL_1",
    "TAG_NORMAL_2",
    "TAG_UNIFORM",
    "alpha_dropout",
    "drop_path",
    "draw_key",
    "dropout",
    "get_rng_state",
    "feature_dropout",
    "keep_threshold",
    "manual_seed",
    "rand_like",
    "randn_like",
    "set_rng_state",
]

_ONE = 1 << BITS  # draws are integers in [0, 2**24)
#: the op a draw is for, a word of Philox's counter: dropout's keep/drop, rand_like's, randn_like's two uniforms
#: (Box-Muller). Ops drawing at one element with one key never reuse each other's numbers. Public for references
#: that recompute halo's draws on the whole field in one process (``philox.bits(draw_key(dev), ..., TAG_DROP)``).
TAG_DROP, TAG_UNIFORM, TAG_NORMAL_1, TAG_NORMAL_2 = 0, 1, 2, 3


def manual_seed(seed: int) -> None:
    """Seed for a (data-parallel x domain) run: call with the same ``seed`` on every rank.

    ``torch.manual_seed(seed)`` on every rank alike (so parameters initialise identically everywhere, and halo's
    per-call keys agree across each domain group); halo's draws add the data-parallel rank as their stream, so
    replicas draw different masks. A seed per rank (``seed + rank``) would break the domain group's agreement:
    halo raises at the first draw rather than compute shards with different masks."""
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """This rank's whole random state as halo draws from it: torch's CPU generator and every visible CUDA
    device's (each call's key is a draw from the generator of its tensor's device; the stream and the indices are
    fixed by the mesh and the grid, not state). What ``halo.checkpoint.save`` keeps, so that a resumed job draws the
    dropout masks the uninterrupted job would have drawn."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned. A state with CUDA generators on a process that has a different
    number of CUDA devices raises ``ValueError`` (expected vs got) rather than restore some of them."""
    if not isinstance(state, dict) or "cpu" not in state:
        raise TypeError(f"halo.random.set_rng_state: expected the dict get_rng_state() returns (key 'cpu'), got "
                        f"{type(state).__name__}{f' with keys {sorted(state)}' if isinstance(state, dict) else ''}")
    cuda = state.get("cuda")
    if cuda is not None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(cuda):
            raise ValueError(f"halo.random.set_rng_state: the state holds {len(cuda)} CUDA generators, this process "
                             f"sees {have} CUDA devices")
        torch.cuda.set_rng_state_all(cuda)
    torch.set_rng_state(state["cpu"])


def _stream(cg: CommGroup) -> int:
    """The stream of draws over domain group ``cg``: the data-parallel coordinate of the mesh that made the group
    (not the global manager's: a model converted with ``mesh=`` has none), else the group's smallest global rank,
    which is the same on its members and differs between disjoint groups (replicas); 0 in one process."""
    if cg.group is None:
        return 0
    dp = dp_coordinate(cg.group)
    return int(dp) if dp is not None else min(cg.ranks)


# -- the plan of a draw: where this rank's elements sit in the field, and a one-time check of the generators ------

@dataclasses.dataclass(frozen=True)
class RandomPlan:
    """The sharded dim's global extent, this rank's first index along it, and the stream."""

    total: int
    offset: int
    stream: int
    width: int = 0  # a latitude x longitude mesh: the global W (0: W whole on every rank)
    col0: int = 0  # ... and this rank's first column


_AGREE_RNG = 0x524E4721  # "RNG!"


def _generator_digest(device: str) -> tuple[int, int]:
    dev = torch.device(device)
    if dev.type == "cpu":
        state = torch.get_rng_state()
    elif dev.type == "cuda":
        state = torch.cuda.get_rng_state(dev)
    else:  # no generator state to compare on this device type
        return 0, 0
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=16).digest()
    w = np.frombuffer(digest, dtype=np.int64)
    return int(w[0]), int(w[1])


def _random_plan(cg: CommGroup, extents: tuple[tuple[int, ...], ...], device: str, op: str,
                 shape: tuple[int, ...] = (), whole: bool = False) -> RandomPlan:
    """Made once per plan on every rank alike: compares the ranks' generator states over the whole domain group,
    then places this rank along every axis: ``extents`` holds its line's extents per axis (one axis: latitude rows;
    two: the H line and the W line of a latitude x longitude mesh of ``shape``, ranks row-major). ``whole``: the
    tensor is whole on every rank; every rank is placed at 0 of its own extent (the one-process draws)."""
    if cg.size > 1:
        table = gather_words([_AGREE_RNG, *_generator_digest(device)], cg, op)
        differ = [r for r in range(cg.size) if (table[r] != table[0]).any()]
        if differ:
            raise RuntimeError(
                f"{op}: the domain ranks' torch random generators ({device}) are in different states (group ranks "
                f"{differ} differ from group rank 0): halo's draws take their per-call key from torch's generator, "
                f"and a domain group must draw the same key to give every shard of a sample the same dropout and "
                f"drop-path. Seed every rank alike with halo.random.manual_seed(seed) (data-parallel replicas still "
                f"draw differently), and draw from torch's generator in the same order on every domain rank")
    if whole:  # the same tensor on every rank: its one-process index space, whatever the rank
        if len(set(extents[0])) != 1:
            raise ValueError(f"{op}: a tensor whole and the same on every rank (the result of a global mean or pool) "
                             f"has the same shape on every rank, but its extents along the drawn dim are "
                             f"{list(extents[0])} (group ranks in order)")
        return RandomPlan(extents[0][0], 0, _stream(cg))
    coords = np.unravel_index(cg.index, shape or (cg.size,))
    starts = [sum(sizes[:int(c)]) for sizes, c in zip(extents, coords, strict=True)]
    if len(extents) == 2:  # a latitude x longitude mesh: the global W and this rank's first column
        return RandomPlan(sum(extents[0]), starts[0], _stream(cg), sum(extents[1]), starts[1])
    return RandomPlan(sum(extents[0]), starts[0], _stream(cg))


def _plan(x: torch.Tensor, dim: int, group: Any, op: str, site: Site | None, mesh: Any | None = None,
          whole: bool = False) -> RandomPlan:
    if whole:  # the same tensor on every rank of the domain group (of the mesh's, on a mesh): nothing is split
        return resolve(x, mesh.domain_group if mesh is not None else group, op, _random_plan,
                       (str(x.device), op, (), True), site=site, spec=(dim,), grad=False, allow_empty=True,
                       replicated=True)
    if mesh is None:  # latitude rows: one axis, the sharded dim ``dim``
        return resolve(x, group, op, _random_plan, (str(x.device), op), site=site, spec=(dim,), grad=False,
                       allow_empty=True)
    if dim % max(x.dim(), 1) != x.dim() - 2:
        raise ValueError(f"{op}: on a latitude x longitude mesh the field's H and W are its last two dims")
    shape = tuple(mesh.domain_shape)
    return resolve(x, mesh.domain_group, op, _random_plan, (str(x.device), op, shape), site=site,
                   spec=((-2,), (-1,)), coords=mesh_coords(shape), grad=False, allow_empty=True)


def _field_bits(x: torch.Tensor, d: int, plan: RandomPlan, key: torch.Tensor, tag: int) -> torch.Tensor:
    """The draws of ``x``'s elements, of ``x``'s shape. On a mesh, the draws of this rank's rows over the *whole*
    width (the index space of a row slab), then its columns: a block's elements are not one strided run."""
    if not plan.width:
        run, stride, offset = _space(x, d, plan)
        return _bits(key, x.numel(), run, stride, offset, plan.stream, tag).view(x.shape)
    h, w = int(x.shape[-2]), int(x.shape[-1])
    n = x.numel() // max(w, 1) * plan.width
    u = _bits(key, n, h * plan.width, plan.total * plan.width, plan.offset * plan.width, plan.stream, tag)
    return u.view(*x.shape[:-1], plan.width).narrow(-1, plan.col0, w)


def draw_key(device: torch.device) -> torch.Tensor:
    """This call's key: one draw from torch's generator on ``device`` (no host read); every random op of this module
    draws one per call, so a reference seeded alike (``torch.manual_seed``) and calling this gets the same key."""
    return torch.randint(1 << 62, (1,), dtype=torch.int64, device=device)


def _space(x: torch.Tensor, dim: int, plan: RandomPlan) -> tuple[int, int, int]:
    """``(run, stride, offset)`` of ``x``'s elements in the whole field (``halo.kernels.philox``)."""
    inner = 1
    for s in x.shape[dim + 1:]:
        inner *= int(s)
    return int(x.shape[dim]) * inner, plan.total * inner, plan.offset * inner


def keep_threshold(p: float) -> int:
    """The 24-bit draw at or above which an element is kept by a dropout of probability ``p`` (module docstring)."""
    return min(_ONE, max(0, round(p * _ONE)))


def _check_p(p: float, op: str) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: dropout probability has to be between 0 and 1, but got {p}")
    return p


def _field_dim(x: torch.Tensor, dim: int, op: str) -> int:
    if x.dim() < 2:
        raise ValueError(f"{op}: expected a field (..., H_local, W) with the sharded dim at {dim}, got shape "
                         f"{tuple(x.shape)}")
    return dim % x.dim()


# -- the ops under torch.compile (eager calls use the autograd Function: less dispatch) -------------------------

@torch.library.custom_op("halo::philox_dropout", mutates_args=())
def _dropout_op(x: torch.Tensor, key: torch.Tensor, run: int, stride: int, offset: int, stream: int, threshold: int,
                scale: float) -> torch.Tensor:
    return kernels.dropout(x, key, run, stride, offset, stream, threshold, scale)


@_dropout_op.register_fake
def _(x, key, run, stride, offset, stream, threshold, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _dropout_setup(ctx, inputs, output) -> None:
    ctx.args = inputs[1:]


def _dropout_backward(ctx, gy):
    key, *rest = ctx.args
    return _dropout_op(gy.contiguous(), key, *rest), None, None, None, None, None, None, None


_dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup)


@torch.library.custom_op("halo::philox_bits", mutates_args=())
def _bits_op(key: torch.Tensor, n: int, run: int, stride: int, offset: int, stream: int, tag: int) -> torch.Tensor:
    return kernels.bits(key, n, run, stride, offset, stream, tag)


@_bits_op.register_fake
def _(key, n, run, stride, offset, stream, tag):
    return key.new_empty(n, dtype=torch.int32)


class _DropoutFn(torch.autograd.Function):
    """The dropout's backward is the same dropout of the gradient. The fused kernel (CUDA) draws the mask again
    from the key and stores nothing; the torch reference (CPU), where a draw costs more than the multiply, keeps a
    bool mask as torch's own dropout does."""

    @staticmethod
    def forward(ctx, x, key, run, stride, offset, stream, threshold, scale):
        ctx.args = (key, run, stride, offset, stream, threshold, scale)
        ctx.scale = scale
        if kernels.backend_for(x, "dropout") == "triton":
            return kernels.dropout(x, key, run, stride, offset, stream, threshold, scale)
        keep = (kernels.bits(key, x.numel(), run, stride, offset, stream, TAG_DROP) >= threshold).view(x.shape)
        ctx.save_for_backward(keep)
        return philox.masked(x, keep, scale)

    @staticmethod
    def backward(ctx, gy):
        saved = ctx.saved_tensors  # read once: non-reentrant checkpointing unpacks saved tensors a single time
        if saved:
            gx = philox.masked(gy, saved[0], ctx.scale)
        else:
            gx = kernels.dropout(gy.contiguous(), *ctx.args)
        return gx, None, None, None, None, None, None, None


def _bits(key: torch.Tensor, n: int, run: int, stride: int, offset: int, stream: int, tag: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _bits_op(key, n, run, stride, offset, stream, tag)
    return kernels.bits(key, n, run, stride, offset, stream, tag)


def _fused_dropout(x: torch.Tensor, key: torch.Tensor, *args: Any) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _dropout_op(x.contiguous(), key, *args)
    return _DropoutFn.apply(x.contiguous(), key, *args)


def _finish(out: torch.Tensor, x: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        return x.copy_(out)
    carry(out, x)
    return out


# -- the public ops -------------------------------------------------------------------------------------------------

def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, dim: int = -2,
            group: Any | None = None, site: Site | None = None, mesh: Any | None = None,
            whole: bool = False) -> torch.Tensor:
    """``F.dropout`` on a shard of a field split along ``dim`` over ``group``, with draws keyed on global indices:
    every element of the whole field is kept or dropped the same way on any number of ranks (module docstring).

    ``x``: this rank's rows; the other dims whole and equal on every rank. Returns ``x * mask / (1 - p)``; its
    backward draws the mask again (nothing stored but a one-element key). ``group``: the domain group (default the
    initialised manager's; none: one process, the whole field). ``mesh``: a latitude x longitude ``DomainMesh``
    (``x`` a block; its mask is stored for the backward). ``whole``: ``x`` is whole and the same on every rank of
    the group (the result of a global mean or pool), not a shard: every rank draws the mask of the whole ``x`` in one
    process, so the ranks' copies stay the same and equal to the unsharded model's."""
    op = "halo.random.dropout"
    p = _check_p(p, op)
    if not training or p == 0.0:
        return x
    d = dim % x.dim() if whole and x.dim() else _field_dim(x, dim, op)
    plan = _plan(x, d, group, op, site, mesh, whole)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    if plan.width:
        keep = _field_bits(x, d, plan, draw_key(x.device), TAG_DROP) >= keep_threshold(p)
        return _finish(philox.masked(x, keep, scale), x, inplace)
    run, stride, offset = _space(x, d, plan)
    out = _fused_dropout(x, draw_key(x.device), run, stride, offset, plan.stream, keep_threshold(p), scale)
    return _finish(out.view(x.shape), x, inplace)


def _unit_mask(x: torch.Tensor, shape: tuple[int, ...], p: float, stream: int) -> torch.Tensor:
    """A keep mask (bool) of ``shape`` (per sample / channel: the same on every domain rank), elements indexed
    row-major."""
    n = 1
    for s in shape:
        n *= int(s)
    u = _bits(draw_key(x.device), n, 1, 1, 0, stream, TAG_DROP)
    return (u >= keep_threshold(p)).view(shape)


def _check_group(x: torch.Tensor, group: Any, op: str, site: Site | None, mesh: Any | None = None) -> int:
    """The stream, after the one-time check that the domain ranks' generators agree (a plan on ``x``)."""
    if x.dim() == 0:
        return _stream(comm_group(mesh.domain_group if mesh is not None else group))
    if mesh is not None and x.dim() >= 2:
        return _plan(x, -2, None, op, site, mesh).stream
    return _plan(x, -2 if x.dim() >= 2 else 0, group, op, site).stream


def feature_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
                    batched: bool = True, group: Any | None = None, site: Site | None = None,
                    mesh: Any | None = None) -> torch.Tensor:
    """Channel dropout (``F.dropout1d/2d/3d``): whole channels of a sample are zeroed, the same channels on every
    domain rank. ``batched``: ``x`` is ``(B, C, ...)`` (else ``(C, ...)``)."""
    op = "halo.random.feature_dropout"
    p = _check_p(p, op)
    if not training or p == 0.0:
        return x
    stream = _check_group(x, group, op, site, mesh)
    lead = 2 if batched else 1
    if x.dim() < lead + 1:
        raise ValueError(f"{op}: expected ({'B, ' if batched else ''}C, ...) with spatial dims, got shape "
                         f"{tuple(x.shape)}")
    if batched and x.dim() == 3:
        # (N, C, L) (nn.Dropout1d): C is a field's dim -2, the rows split across the ranks, so each channel's draw
        # is keyed on its global row (an element of the (N, C, 1) field), not on the local index of a channel.
        if mesh is not None:
            raise ValueError(f"{op}: channel dropout of an (N, C, L) block on a latitude x longitude mesh (C is "
                             f"split along the mesh's first axis, L along its second): not supported; use "
                             f"latitude rows, or nn.Dropout")
        scaled = dropout(x.new_ones((*x.shape[:2], 1)), p, True, False, dim=-2, group=group, site=site)
        return _finish(x * scaled, x, inplace)
    shape = (*x.shape[:lead], *([1] * (x.dim() - lead)))
    keep = _unit_mask(x, shape, p, stream)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    out = x * (keep.to(x.dtype) * scale)
    return _finish(out, x, inplace)


def drop_path(x: torch.Tensor, p: float = 0.0, training: bool = False, scale_by_keep: bool = True, *,
              mode: str = "row", group: Any | None = None, site: Site | None = None,
              mesh: Any | None = None) -> torch.Tensor:
    """Stochastic depth (timm's ``drop_path``, torchvision's ``stochastic_depth``): each sample's residual branch
    (``mode="row"``) or the whole batch's (``"batch"``) is dropped with probability ``p``, kept ones scaled by
    ``1 / (1 - p)`` if ``scale_by_keep``; the same draw on every domain rank, another on each replica."""
    op = "halo.random.drop_path"
    if mode not in ("row", "batch"):
        raise ValueError(f"{op}: mode must be 'row' or 'batch', got {mode!r}")
    p = _check_p(p, op)
    if not training or p == 0.0:
        return x
    stream = _check_group(x, group, op, site, mesh)
    shape = (int(x.shape[0]) if mode == "row" and x.dim() else 1,) + (1,) * max(x.dim() - 1, 0)
    keep = _unit_mask(x, shape, p, stream).to(x.dtype)
    if p < 1.0 and scale_by_keep:
        keep = keep.div_(1.0 - p)
    out = x * keep
    carry(out, x)
    return out


_ALPHA = 1.7580993408473766  # -scale * alpha of SELU: where SELU saturates


def alpha_dropout(x: torch.Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *,
                  feature: bool = False, dim: int = -2, group: Any | None = None,
                  site: Site | None = None, mesh: Any | None = None) -> torch.Tensor:
    """``F.alpha_dropout`` (``feature=True``: ``F.feature_alpha_dropout``, whole channels) with draws keyed on
    global indices: dropped values are set to SELU's negative saturation and the result affinely restored to zero
    mean and unit variance, as torch does."""
    op = "halo.random.alpha_dropout"
    p = _check_p(p, op)
    if not training or p == 0.0:
        return x
    if feature:
        stream = _check_group(x, group, op, site, mesh)
        keep = _unit_mask(x, (*x.shape[:2], *([1] * (x.dim() - 2))), p, stream)
    else:
        d = _field_dim(x, dim, op)
        plan = _plan(x, d, group, op, site, mesh)
        keep = _field_bits(x, d, plan, draw_key(x.device), TAG_DROP) >= keep_threshold(p)
    if p == 1.0:
        return _finish(x * 0, x, inplace)
    a = 1.0 / ((_ALPHA * _ALPHA * p + 1) * (1 - p)) ** 0.5
    noise = keep.to(x.dtype)
    b = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
    return _finish(x * (noise * a) + b, x, inplace)


def _uniform(x: torch.Tensor, tag: int, dim: int, group: Any, op: str, site: Site | None,
             key: torch.Tensor, mesh: Any | None = None) -> torch.Tensor:
    d = _field_dim(x, dim, op)
    return _field_bits(x, d, _plan(x, d, group, op, site, mesh), key, tag)


def rand_like(x: torch.Tensor, *, dim: int = -2, group: Any | None = None, dtype: torch.dtype | None = None,
              site: Site | None = None, mesh: Any | None = None) -> torch.Tensor:
    """Uniform noise on ``[0, 1)`` (multiples of 2**-24) for a shard of a field: each element's value depends only
    on its global index, so the noise is the same however the field is split."""
    u = _uniform(x, TAG_UNIFORM, dim, group, "halo.random.rand_like", site, draw_key(x.device), mesh)
    out = u.to(dtype or x.dtype) * (1.0 / _ONE)
    carry(out, x)
    return out


def randn_like(x: torch.Tensor, *, dim: int = -2, group: Any | None = None, dtype: torch.dtype | None = None,
               site: Site | None = None, mesh: Any | None = None) -> torch.Tensor:
    """Standard normal noise for a shard of a field (Box-Muller on two 24-bit draws per element, in float64 then
    rounded): each element's value depends only on its global index, so it is the same however the field is split.
    """
    op = "halo.random.randn_like"
    key = draw_key(x.device)
    u1 = _uniform(x, TAG_NORMAL_1, dim, group, op, site, key, mesh).to(torch.float64).add_(1.0).mul_(1.0 / _ONE)
    u2 = _uniform(x, TAG_NORMAL_2, dim, group, op, site, key, mesh).to(torch.float64).mul_(2.0 * np.pi / _ONE)
    out = (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(u2)).to(dtype or x.dtype)
    carry(out, x)
    return out
