"""The inputs :func:`halo.check.check_equivalence` gives both copies of the model, what its hooks record, and how
each recorded tensor is assembled whole from the ranks' parts (whole on every rank, split along one dim, or a block
of a latitude x longitude mesh).

Split out of :mod:`halo.check` (the call itself). The names here are public within the package, so that
``halo.check`` imports no private name; they are the pieces ``check_equivalence`` is made of, not part of halo's
API. Layouts are plain tuples decided from every rank's shapes alike: ``("whole",)``, ``("split", dim, sizes)``,
``("mesh",)``, ``("bad", why)`` (and ``("skip",)`` for a leaf that is not a tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..shard import gather, gather_2d, shard_2d

__all__ = ["Call", "assemble", "cast", "counted_once", "gather_or_none", "layout", "load_matching", "local_weights",
           "param_pairs", "record", "shape_of", "weighted", "weights", "windowed"]

_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32,
            torch.bfloat16: torch.complex64}


# -- dtypes and devices -----------------------------------------------------------------------------------------

def cast(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Floating -> ``dtype``, complex -> the complex dtype of its precision, others keep theirs; all on ``device``."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    if t.is_complex():
        return t.to(device=device, dtype=_COMPLEX.get(dtype, torch.complex128))
    return t.to(device=device)


def weights(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fixed random loss weights of ``like``'s shape and dtype (complex: complex weights), drawn on the CPU from
    the seeded generator (the same numbers whatever the device) and then moved to ``like``'s device."""
    real = torch.view_as_real(like) if like.is_complex() else like
    w = torch.randn(real.shape, generator=gen, dtype=torch.float64).to(real.dtype)
    w = torch.view_as_complex(w) if like.is_complex() else w
    return w.to(device=like.device)


def weighted(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum(t * w)``; for complex ``t`` the real inner product ``sum(Re t Re w + Im t Im w)``."""
    if t.is_complex():
        return (torch.view_as_real(t) * torch.view_as_real(w)).sum()
    return (t * w).sum()


# -- recording --------------------------------------------------------------------------------------------------

@dataclass
class Call:
    """One recorded call of a module: its name and the pytree leaves of its output and inputs (args, then kwargs),
    tensors detached and cloned."""

    name: str
    outs: list[Any]
    ins: list[Any]


def _snapshot(tree: Any) -> list[Any]:
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(tree)]


def windowed(model: nn.Module) -> set[int]:
    """Modules whose tensors are attention windows or regrouped rows, not the field's rows: their shards do not
    concatenate to the reference's tensor (a rank's windows of every batch element are one block), so comparing them
    would report differences that are not there. halo's attention layers mark them with ``_halo_check``:
    ``"children"`` (the layer's own output is a field, compared; its submodules see windows: CrossFormer's attention)
    or ``"self"`` (the layer itself takes and returns windows: Swin's window attention)."""
    out: set[int] = set()
    for m in model.modules():
        mark = getattr(m, "_halo_check", None)
        if mark in ("children", "self"):
            out.update(id(c) for c in m.modules() if c is not m)
            if mark == "self":
                out.add(id(m))
    return out


def record(model: nn.Module, names: dict[int, str], log: list[Call]) -> list[Any]:
    """Forward hooks on the modules of ``model`` named in ``names`` (by ``id``) that append a :class:`Call` to
    ``log``; returns the handles (remove them after the run)."""
    handles = []
    for module in model.modules():
        name = names.get(id(module))
        if name is None:
            continue

        def hook(mod, args, kwargs, output, name=name):
            log.append(Call(name, _snapshot(output), _snapshot((args, kwargs))))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles


def shape_of(t: Any) -> tuple[int, ...] | None:
    """A tensor's shape as plain ints (host data for the ranks' exchange); ``None`` for anything else."""
    return tuple(int(s) for s in t.shape) if isinstance(t, torch.Tensor) else None


# -- layouts: whole, split along one dim, a mesh block -------------------------------------------------------------

def layout(want: tuple[int, ...], shapes: list[tuple[int, ...] | None], mesh: bool) -> tuple:
    """How the ranks hold a tensor whose unsharded shape is ``want``: ``("whole",)``, ``("split", dim, sizes)``,
    ``("mesh",)`` or ``("bad", why)`` (``shapes``: every rank's, in group order; the same decision everywhere)."""
    if any(s is None for s in shapes):
        missing = [r for r, s in enumerate(shapes) if s is None]
        return ("bad", f"no tensor here on group rank(s) {missing}")
    if all(s == want for s in shapes):
        return ("whole",)
    if any(len(s) != len(want) for s in shapes):
        return ("bad", f"shapes on the ranks {shapes} vs the reference's {want}")
    if mesh:
        return ("mesh",) if len(want) >= 2 else ("bad", f"shapes on the ranks {shapes} vs the reference's {want}")
    dims = [d for d in range(len(want)) if any(s[d] != want[d] for s in shapes)]
    if len(dims) == 1 and sum(s[dims[0]] for s in shapes) == want[dims[0]]:
        return ("split", dims[0], tuple(s[dims[0]] for s in shapes))
    return ("bad", f"shapes on the ranks {shapes} are neither the reference's {want} on every rank nor a split of "
                   f"it along one dim")


def assemble(t: torch.Tensor, lay: tuple, group: Any, mesh: Any) -> torch.Tensor:
    """The whole tensor from this rank's part (collective for ``split`` / ``mesh``: every rank calls it alike).

    Complex parts travel as real pairs and booleans as bytes. Along a split dim the pair dim (last) is not in the
    way; on a mesh, whose blocks are cut along the last dims, the real and imaginary parts are assembled one after
    the other (as one real tensor the pair dim would be taken for longitude)."""
    if lay[0] == "whole":
        return t
    x = t.detach().contiguous()
    kind = x.dtype
    if x.is_complex():
        pairs = torch.view_as_real(x)
        if lay[0] == "mesh":
            parts = [assemble(pairs[..., k].contiguous(), lay, group, mesh) for k in (0, 1)]
            return torch.view_as_complex(torch.stack(parts, dim=-1))
        return torch.view_as_complex(gather(pairs, dim=lay[1], group=group).contiguous())
    if kind == torch.bool:
        x = x.to(torch.uint8)
    x = gather(x, dim=lay[1], group=group) if lay[0] == "split" else gather_2d(x, mesh=mesh)
    return x.to(kind) if kind == torch.bool else x


def gather_or_none(t: Any, lay: tuple, group: Any, mesh: Any) -> torch.Tensor | None:
    """:func:`assemble`, or ``None`` when ``t`` is not a tensor or its parts do not fit together (the comparison
    then reports it could not be assembled)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return assemble(t, lay, group, mesh)
    except (ValueError, RuntimeError):
        return None


def counted_once(t: Any) -> bool:
    """Whether a whole output leaf is a loss the model returns, replicated and counted once (a commit loss by
    :func:`halo.parallel.domain_mean`): the halo reductions nearest to it in its autograd graph all count once (their
    backward averages the ranks' gradients). A training step adds such a loss on every rank alike; any other whole
    leaf (a global pool's result, whose backward sums the ranks' gradients) is shared out, 1/P to each rank."""
    if not isinstance(t, torch.Tensor) or t.grad_fn is None:
        return False
    found: set[bool] = set()
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and (cls.__module__ or "").split(".")[0] == "halo":
            found.add(cls.__name__ == "_ReplicatedSumFn")  # the nearest halo reduction on this path
            continue
        stack.extend(f for f, _ in node.next_functions)
    return found == {True}


def local_weights(w: torch.Tensor, lay: tuple, index: int, ranks: int, mesh: Any,
                  once: bool = False) -> torch.Tensor | None:
    """This rank's share of the loss weights ``w`` of a whole output leaf (``None``: not in the loss); ``once``: a
    replicated loss (:func:`counted_once`), weighted in full on every rank."""
    if lay[0] == "whole":
        return w if once else w / ranks
    if lay[0] == "split":
        sizes = lay[2]
        return w.narrow(lay[1], sum(sizes[:index]), sizes[index])
    if lay[0] == "mesh":
        return shard_2d(w, mesh=mesh)
    return None


# -- the two copies' parameters -----------------------------------------------------------------------------------

def load_matching(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` where names and shapes agree, then the parameters left
    unmatched on both sides in order (a reference that wraps the layers: ``enc.conv.weight`` for ``enc.weight``)
    when their count and shapes agree."""
    theirs = src.state_dict()
    left_dst, used = [], set()
    with torch.no_grad():
        for n, t in dst.state_dict(keep_vars=True).items():
            s = theirs.get(n)
            if s is not None and s.shape == t.shape:
                t.copy_(s)
                used.add(n)
            elif isinstance(t, nn.Parameter):
                left_dst.append(t)
        left_src = [p for n, p in src.named_parameters() if n not in used]
        if left_dst and len(left_dst) == len(left_src) and all(a.shape == b.shape
                                                               for a, b in zip(left_dst, left_src, strict=True)):
            for a, b in zip(left_dst, left_src, strict=True):
                a.copy_(b)


def param_pairs(par: nn.Module, ref: nn.Module, reference_given: bool) -> list[tuple[str, nn.Parameter, Any]]:
    """``(name, converted parameter, reference parameter)``: by name, or by order for a given reference that
    wraps the layers (its names differ, its count is the same)."""
    ref_params = dict(ref.named_parameters())
    par_params = list(par.named_parameters())
    if reference_given and not all(n in ref_params for n, _ in par_params):
        listed = list(ref.parameters())
        if len(listed) == len(par_params):  # a reference that wraps the layers: by order
            return [(n, p, q) for (n, p), q in zip(par_params, listed, strict=True)]
    return [(n, p, ref_params[n]) for n, p in par_params if n in ref_params]
