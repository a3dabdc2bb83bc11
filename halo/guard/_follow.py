"""How the guard follows H (:mod:`halo.guard`): where a field's sharded rows go through layout ops (permute,
view, indexing, reductions over other dims, stack) and the checks of ops whose operands' H decides (matmul,
einsum, attention). :class:`Follower` is the part of the guard that reads and writes ``self.dims`` (tensor -> its H
dim and rows, where that is not dim -2) and ``self.w_sharded``; the table's ``check`` and ``after`` name its
methods; it also tells which arguments of an op are fields (:meth:`Follower._rows_of_fields`).
:func:`halo.context.place` is how a layer tells it where its output holds H.

On a latitude x longitude mesh W is followed by the same code (:meth:`Follower._on_w`: ``self.wdims`` for
``self.dims``, the axis :data:`W`): W is dim -1 of a field whose H was not moved, and wherever a followed op put it
(for view / reshape / flatten: the fastest part of its dim, as in ``flatten(2)``'s tokens); a field whose H a layer
placed, or an op moved, and whose W was not followed has no W the guard checks."""

from __future__ import annotations

import string
from typing import Any

import torch

from ..plan.plans import TensorMap
from ._policy import Axis, H, W, dims_arg, field_of, get_arg, h_dim, merge_dims, merge_fastest

__all__ = ["Follower"]

T = torch.Tensor
_MT = T.mT.__get__  # x.mT: transpose of the last two dims


class Follower:
    """Following H through the ops of a guarded call (a mixin of :class:`halo.guard.SpatialGuard`)."""

    dims: TensorMap
    w_sharded: bool
    wdims: TensorMap  # W's map, on a latitude x longitude mesh (as dims is H's): swapped in by _on_w
    axis: Axis = H  # the axis self.dims follows now
    _h_dims: TensorMap | None = None  # while W is followed: H's map (a field whose H moved has no W unless tracked)

    def _on_w(self, fn):
        """``fn()`` with W followed instead of H (a latitude x longitude mesh): the same code, W's map and axis."""
        saved = self.dims, self.axis, self._h_dims
        self._h_dims, self.dims, self.axis = self.dims, self.wdims, W
        try:
            return fn()
        finally:
            self.dims, self.axis, self._h_dims = saved

    def _field(self, t: Any) -> tuple[int, int] | None:
        """:func:`field_of` for the axis followed now."""
        return field_of(t, self.dims, self.axis, self._h_dims)

    def _stack(self, func, args, kwargs):
        """``torch.stack``: the new dim shifts H (and W) when it comes before it; follow them to their place."""
        out = func(*args, **kwargs)
        self._stack_follow(args, kwargs, out)
        if self.w_sharded:
            self._on_w(lambda: self._stack_follow(args, kwargs, out))
        return out

    def _stack_follow(self, args, kwargs, out) -> None:
        tensors = get_arg(args, kwargs, 0, "tensors", ())
        first = next((t for t in tensors if self._field(t) is not None), None)
        if first is not None and isinstance(out, torch.Tensor):
            h, rows = self._field(first)
            d = get_arg(args, kwargs, 1, "dim", 0) % out.dim()
            new = h + (d <= h)
            if self.axis is W or new != out.dim() - 2:
                self.dims[out] = (new, rows)

    def _tracked(self, args) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """The first argument whose H is tracked away from dim -2, with that dim."""
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    d = self.dims.get(t)
                    if d is not None:
                        return t, d
        return None

    def _carry(self, tracked: tuple[torch.Tensor, tuple[int, int]], out: Any) -> None:
        """An op on a tensor whose H is tracked: outputs of its shape along that dim keep it (elementwise ops)."""
        t, (d, rows) = tracked
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(o, torch.Tensor) or o.dim() < t.dim():
                continue
            e = d + o.dim() - t.dim() if d >= 0 else d  # broadcasting puts new dims in front
            if d < 0 or o.shape[e] == t.shape[d]:
                self.dims[o] = (e, rows)

    def _rows_of_fields(self, args, kwargs) -> list[int] | None:
        """An op on two fields or more: the sizes of its tensor arguments along the first field's H (aligned from
        the right, as broadcasting aligns them); ``None``: fewer than two fields."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        fields = [(t, f) for t in tensors if (f := self._field(t)) is not None]
        if len(fields) < 2:
            return None
        ref, (h, _) = fields[0]
        back = ref.dim() - h
        return [int(t.shape[t.dim() - back]) for t in tensors if t.dim() >= back]

    def _any_field(self, args, kwargs) -> bool:
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if field_of(t, self.dims) is not None:
                    return True
        return False

    def _matmul(self, args, kwargs=None) -> str | None:
        a, b = (args + (None, None))[:2]
        if self.axis is W:  # a contracts its last dim with b's dim -2; b's last dim becomes the result's
            fa, fb = self._field(a), self._field(b)
            tracked = self.dims.get(b) is not None  # (an untracked b of 3 dims may be a weight expanded in forward)
            if (fa is not None and fa[0] == a.dim() - 1) or (fb is not None and b.dim() >= 2 and (
                    fb[0] == b.dim() - 2 or tracked and fa is not None and fa[0] == a.dim() - 2
                    and fb[0] == b.dim() - 1)):
                return ("multiplies over W (the sharded dim) or makes it a second token dim (attention over all "
                        "tokens): each rank would see only its own columns; gather first (halo.gather_2d)")
            return None
        ha, hb = h_dim(a, self.dims), h_dim(b, self.dims)
        # (b's H as its last dim stays the result's last dim: a second token dim only where a is a field too)
        if (ha is not None and ha == a.dim() - 1) or (hb is not None and b.dim() >= 2 and hb == b.dim() - 1
                                                      and ha is not None):
            return ("multiplies over H (the sharded dim) or makes it a second token dim (attention over all "
                    "tokens): each rank would see only its own rows; gather first")
        return None

    def _follow(self, func, args, kwargs, x, h, out) -> str | None:
        """Record where H went through a layout op; a merge of H with an earlier dim is a problem."""
        if not isinstance(out, torch.Tensor):
            return None
        nd = x.dim()
        rows = self._field(x)[1]
        new = None
        if func in (torch.permute, T.permute):
            order = args[1:] if len(args) > 1 and isinstance(args[1], int) else get_arg(args, kwargs, 1, "dims")
            order = [d % nd for d in order]
            new = order.index(h)
        elif func in (torch.transpose, T.transpose, torch.swapaxes, T.swapaxes, torch.swapdims, T.swapdims):
            a, b = (get_arg(args, kwargs, 1, "dim0") % nd, get_arg(args, kwargs, 2, "dim1") % nd)
            new = b if h == a else a if h == b else h
        elif func == _MT:
            new = nd - 2 if h == nd - 1 else nd - 1 if h == nd - 2 else h
        elif func in (torch.movedim, T.movedim):
            src = dims_arg(get_arg(args, kwargs, 1, "source"), nd)
            dst = dims_arg(get_arg(args, kwargs, 2, "destination"), nd)
            order = [d for d in range(nd) if d not in src]
            for s_, d_ in sorted(zip(dst, src, strict=True)):
                order.insert(s_, d_)
            new = order.index(h)
        elif func in (torch.unsqueeze, T.unsqueeze):
            d = get_arg(args, kwargs, 1, "dim") % (nd + 1)
            new = h + (d <= h)
        elif func in (torch.squeeze, T.squeeze):
            dim = get_arg(args, kwargs, 1, "dim")
            removed = [d for d in range(nd) if x.shape[d] == 1 and out.dim() < nd
                       and (dim is None or d in (dims_arg(dim, nd) or ()))]
            new = None if h in removed else h - sum(d < h for d in removed)
        else:  # view / reshape / flatten
            new, problem = (merge_dims if self.axis is H else merge_fastest)(x, h, rows, out)
            if problem is not None:
                return problem
        self._record(out, new, rows)
        return None

    def _record(self, out: Any, new: int | None, rows: int) -> None:
        """``out`` holds H at dim ``new`` (``None``: no longer)."""
        if not isinstance(out, torch.Tensor):
            return
        if new is None:
            self.dims[out] = (-1, 0)
        elif self.axis is W or new != out.dim() - 2 or out.dim() < 3 or int(out.shape[new]) != rows:
            self.dims[out] = (new, rows)  # (W: always, as a field whose H moved has no W of its own)

    def _follow_reduce(self, along, args, kwargs, x, h, out) -> None:
        """A reduction over other dims than H: H moves down by the dims removed before it (``keepdim=False``)."""
        position, name, default = along
        d = get_arg(args, kwargs, position, name, default)
        dims = dims_arg(d, x.dim()) if not isinstance(d, torch.Tensor) else ()
        rows = self._field(x)[1]
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(o, torch.Tensor):
                continue
            if o.dim() == x.dim():
                if self.dims.get(x) is not None:
                    self.dims[o] = self.dims.get(x)
            elif dims and o.dim() == x.dim() - len(dims):
                self._record(o, h - sum(1 for e in dims if e < h), rows)

    def _follow_index(self, x, h, index, out) -> str | None:
        """``x[index]`` (H itself kept whole: the rule): where H goes (ints remove dims, ``None`` adds one, an index
        tensor stands in its place with its own dims)."""
        if not isinstance(out, torch.Tensor) or h is None:
            return None
        items = list(index) if isinstance(index, tuple) else [index]

        def consumed(i):
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                return max(i.dim(), 1)
            return 0 if i is None or i is Ellipsis else 1

        used = sum(consumed(i) for i in items)
        pos = at = 0
        new = None
        advanced = 0
        for i in items:
            if i is Ellipsis:
                k = x.dim() - used
                if pos <= h < pos + k:
                    new = at + h - pos
                pos, at = pos + k, at + k
            elif i is None:
                at += 1
            elif isinstance(i, slice):
                if pos == h:
                    new = at
                pos, at = pos + 1, at + 1
            elif isinstance(i, (int, torch.SymInt)) or (isinstance(i, torch.Tensor) and i.dim() == 0
                                                      and i.dtype != torch.bool):
                pos += 1
            else:  # an index tensor or list: its dims stand in the place of the dims it indexes
                advanced += 1
                n = consumed(i)
                made = 1 if isinstance(i, torch.Tensor) and i.dtype == torch.bool else (
                    i.dim() if isinstance(i, torch.Tensor) else len(torch.as_tensor(i).shape))
                pos, at = pos + n, at + made
        if new is None and h >= pos:
            new = at + h - pos
        if advanced > 1:
            return ("indexes with several index tensors or lists (advanced indexing), which moves dims in ways halo "
                    "does not follow; index one dim at a time")
        self._record(out, new, self._field(x)[1])
        return None

    def _einsum_dims(self, args, a: Axis = H) -> tuple[str | None, int | None, int]:
        """``torch.einsum``: (a problem on axis ``a``, the output dim of H, rows)."""
        equation = str(args[0]).replace(" ", "")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        lhs, arrow, rhs = equation.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(ops) or not all(isinstance(t, torch.Tensor) for t in ops):
            return "an einsum halo cannot read (operands do not match the equation); gather first", None, 0
        spare = (c for c in string.ascii_letters if c not in equation)
        width = max((t.dim() - len(term) + 3 for term, t in zip(terms, ops, strict=True) if "..." in term), default=0)
        ell = "".join(next(spare) for _ in range(width))
        full = [term.replace("...", ell[width - (t.dim() - len(term) + 3):]) if "..." in term else term
                for term, t in zip(terms, ops, strict=True)]
        if arrow:
            out = rhs.replace("...", ell)
        else:
            letters = "".join(full)
            out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
        marks = {}
        rows = 0
        for term, t in zip(full, ops, strict=True):
            f = self._field(t)
            if f is not None and f[0] < len(term):
                marks[term[f[0]]] = True
                rows = f[1]
        if not marks:
            return None, None, 0
        if len(marks) > 1:
            return (f"makes the sharded {a.name} of two fields two dims of its result (attention over all tokens, or "
                    f"an outer product of {a.unit}): each rank would see only its own {a.unit}; gather first"), None, 0
        (c,) = marks
        if c not in out:
            return (f"contracts {a.name} (the sharded dim): each rank would sum only over its own {a.unit}; use "
                    f"halo.parallel (domain_sum) on the partial result, or gather first"), None, 0
        return None, out.index(c), rows

    def _einsum(self, args, kwargs) -> str | None:
        return self._einsum_dims(args, self.axis)[0]  # (W, on a mesh: the guard checks it again on W's map)

    def _einsum_follow(self, args, kwargs, out) -> None:
        _, new, rows = self._einsum_dims(args)
        if new is not None:
            self._record(out, new, rows)

    def _sdpa(self, args, kwargs) -> str | None:
        q, k, v = (get_arg(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value")))
        if self.axis is W:  # the query's and key's last dims are contracted; the key's and value's -2 attended
            fq, fk, fv = self._field(q), self._field(k), self._field(v)
            if (fq is not None and fq[0] == q.dim() - 1) or (fk is not None and fk[0] >= k.dim() - 2) \
                    or (fv is not None and fv[0] == v.dim() - 2):
                return ("attends over tokens that hold W (the sharded dim), or contracts W as the features: each "
                        "rank would see only its own columns; gather first (halo.gather_2d)")
            return None
        fq = field_of(q, self.dims)
        if fq is not None and fq[0] == q.dim() - 2 and field_of(k, self.dims) is None \
                and field_of(v, self.dims) is None:
            # cross-attention to a context whole on every rank (a parameter, a tensor of 2 dims, a global pool's
            # result): each query row attends to all of it on its own, so the rows of H stay where they are
            if get_arg(args, kwargs, 5, "is_causal", False):
                return ("attends causally from tokens that hold H (the sharded dim) to a context: the causal mask "
                        "numbers the query tokens per rank; pass an explicit attn_mask, or gather first")
            if get_arg(args, kwargs, 4, "dropout_p", 0.0):
                return ("drops attention weights at random (dropout_p > 0) on each shard: each rank would draw its "
                        "own numbers, unlike the unsharded model's one draw; use dropout_p=0.0 under halo")
            mask = get_arg(args, kwargs, 3, "attn_mask")
            fm = field_of(mask, self.dims)
            if fm is None or fm[0] == mask.dim() - 2:
                return None
        for i, name in enumerate(("query", "key", "value")):
            t = get_arg(args, kwargs, i, name)
            f = field_of(t, self.dims)
            if f is not None and f[0] >= t.dim() - 2:
                return ("attends over tokens that hold H (the sharded dim): each rank would attend over its own "
                        "rows' tokens only; attention over all tokens needs a halo attention layer (window or "
                        "neighbourhood attention, or ring attention: halo.nn.ring.ring_sdpa) or a gather first")
        return None

    def _sdpa_follow(self, args, kwargs, out) -> None:
        q = get_arg(args, kwargs, 0, "query")
        f = self._field(q)
        if f is not None and isinstance(out, torch.Tensor) and out.dim() == q.dim():
            self._record(out, f[0], f[1])

    def _baddbmm(self, args, kwargs) -> str | None:
        return self._matmul((get_arg(args, kwargs, 1, "batch1"), get_arg(args, kwargs, 2, "batch2")))

