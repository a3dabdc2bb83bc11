"""The guard on spatial ops that a converted model's ``forward`` calls itself (not through a module).

The converter replaces modules; code in a ``forward`` (``F.pad(x1, [.., diffY // 2, diffY - diffY // 2])`` sized
from the *local* shapes, ``F.interpolate``, slicing or a mean over H) runs on the shard as written, and is silently
wrong. While a converted model learns its plans (its first call for each input shape: ``halo.plan.plans``), a
``TorchFunctionMode`` watches every torch function called from user code (calls from torch's or halo's own code
are not checked) and refuses, on every rank, the ops that would act on the sharded dim H of a field, as the one
table of :mod:`halo.guard._policy` says (its docstring lists each op and when it is refused; ``POLICY`` is the
table itself).

An op that torch itself refuses on one rank's shard (the others' pass) is agreed on like a refusal: every rank
raises at that op, none is left waiting in the next layer's exchange.

**Computed exactly instead** (:mod:`halo.guard.reroute`, whose docstring has the table): where the rule above finds that
a group / instance / batch / layer norm, a ``mean`` or an ``F.interpolate`` acts on H of a ``(B, C, ..., H, W)``
field, outside forward hooks and on latitude rows (on a latitude x longitude mesh they stay refused), the guard
computes it over the whole domain instead (the statistics, the global mean, ``halo_interpolate``).

The guard records each such call's site (module, line, ordinal) under the model's epoch; later calls of that epoch
compute exactly the recorded sites (a small ``TorchFunctionMode`` over those modules' forward only), so they stay
exact after the first call, at no agreement.

**Default deny.** An op given a field passes only when halo knows what it does to H: it acts on each point (the
table's ``"pass"`` entries, an explicit, grouped allowlist: elementwise math, activations, comparisons, casts,
metadata such as ``.shape`` / ``.size()`` / ``.dtype``, in-place pointwise ops, ``torch.where``), halo follows H
through it (the layout ops), or a rule of the table reads its arguments and finds that it leaves H alone. Every
other torch function called on a field from user code is refused, naming it; an op torch adds tomorrow is refused
until it is classified in the table. The guard is off where nothing is sharded (one domain rank).

**Hooks.** Code in a module's forward hook or pre-hook (monitoring: ``(o != 0).float().mean()``) is not refused
where it stands: what an op the guard would refuse computes there is marked, and refused (naming that op and line)
as soon as it flows into the model's computation: an op of the model outside the hook uses it, the hook changed a
model tensor with it in place, or it is the model's output.

H is dim -2 of a field of 3 or more dims, followed through ``permute``/``transpose``/``movedim``, ``(un)squeeze``
and ``view``/``flatten`` (channels-last blocks, tokens); on a latitude x longitude mesh W (dim -1) is followed
alike and checked by the same rules (:mod:`halo.guard._follow`). Tensors that are whole on every rank (after a global
pool) are not fields. A refusal raises ``ValueError`` on every rank at the same op, naming the op, the module
whose forward called it, the line of user code and the way out (a halo layer or module that does it exactly). Every
checked op is agreed on by the ranks (one small host all-gather), only during those first calls: afterwards the
model runs without the guard, at no cost but for the modules with sites computed exactly (above). An allowlisted op
on one field passes by its name alone, with no agreement; on two fields or more it is agreed on (are they split
alike).
What it cannot see :func:`halo.check_equivalence` catches by comparing with the unsharded model: numpy, ops run
under ``torch._C.DisableTorchFunction``, a model compiled by the user (only an eager first call is guarded), and
above all *values derived from a
shard's shape*: ``torch.linspace(-1, 1, x.shape[-2])`` or ``torch.arange(h)`` builds coordinates from this rank's
row count, and a function mode sees only the ints it is given (a tensor made from them is not a field; later
arithmetic with fields is pointwise), so such code runs, per rank, silently wrong; a shape decision taken before
the first call, likewise. Code the
guard takes for a field by mistake (a tensor of 3 or more dims made in ``forward`` rather than derived from the
input) can be marked ``with halo.guard.trusted():``.
"""

from __future__ import annotations

import os
import sys
import zlib
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator
from torch.overrides import TorchFunctionMode

from .. import context
from ..context import place, trusted
from ..dist.comm import CommGroup, all_gather_object, gather_words
from ..nn.registry import twin_hint
from ..plan import plans
from ..plan.plans import TensorMap, whole_source
from . import reroute
from ._follow import Follower
from ._ops import Marks, flows_message, in_hook, op_name, refusal_message, torch_module_call, where
from ._policy import (
    POLICY,
    H,
    Policy,
    W,
    broadcasts,
    get_arg,
    global_extents,
    h_dim,
    interpolate_rule,
    linear_rule,
    row_masks,
    split_differently,
    torch_raised,
    whole_interpolate_rule,
)
from .reroute import user_frame

__all__ = ["POLICY", "SpatialGuard", "place", "trusted", "with_twin_hint"]

T = torch.Tensor
_LAYOUT_ONLY = Policy("follow", after="layout")  # a layout op in a trusted() block: followed, nothing else checked
_AGREE = 0x47554152  # "GUAR"


def _sequence_nr() -> int | None:
    """The autograd sequence number the next node made on this thread gets (``None``: no graph is recorded, as in
    inference mode): where the guarded call's graph begins, and a trusted block's nodes."""
    try:
        with torch._C.DisableTorchFunction(), torch.enable_grad():
            node = (torch.zeros((), requires_grad=True) * 1).grad_fn
    except RuntimeError:  # (inference mode)
        return None
    return None if node is None else node._sequence_nr() + 1


_TORCH_DIR = os.path.dirname(torch.__file__)
_HALO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # halo/, above this package
#: torch's own code that computes on what it is given where the guard cannot classify it: a function mode sees
#: only the metadata reads and small tensors it makes, the computation runs in a higher-order op compiled inside
#: (and the guard passes over torch's frames). A field reaching it from user code is refused, naming it.
_BLIND = ((os.path.join(_TORCH_DIR, "nn", "attention", "flex_attention.py"), "torch.nn.attention.flex_attention"),
          (os.path.join(_TORCH_DIR, "_higher_order_ops") + os.sep, "a torch higher-order op (torch._higher_order_ops)"))
_UNSEEN = ("computes on a field in code the guard cannot see (a higher-order op: torch compiles its body and runs "
           "it as one op, so neither its attention, its masks nor its reductions over the sharded H are checked): "
           "each rank would compute over its own rows only")


def _blind(frame: Any) -> tuple[str, Any] | None:
    """``(what, the user frame that called it)`` when ``frame`` is torch code the guard cannot see (:data:`_BLIND`)
    called from user code (not from halo's own layers)."""
    name = frame.f_code.co_filename
    what = next((w for prefix, w in _BLIND if name.startswith(prefix)), None)
    if what is None:
        return None
    f = frame
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    if f is None or f.f_code.co_filename.startswith(_HALO_DIR):
        return None
    return what, f



def with_twin_hint(func: Any, problem: str) -> str:
    """``problem`` with the registry's way out for ``func`` (:func:`halo.nn.registry.twin_hint`: the torch modules a
    halo layer declared itself the exact form of, ``@converts(functional=...)``) where the rule's own words name
    none: a new layer's functional twin is hinted with no edit of the guard."""
    hint = twin_hint(func)
    return problem if hint is None or "(converted" in problem else f"{problem}; {hint}"

class SpatialGuard(Follower, Marks, TorchFunctionMode):
    """The guard of one converted model's first call (module docstring). ``names``: id(module) -> path."""

    def __init__(self, names: dict[int, str], cg: CommGroup, epoch: int, w_sharded: bool = False) -> None:
        super().__init__()
        self.w_sharded = w_sharded  # a latitude x longitude mesh: the last dim of an untracked field is W, sharded
        self.names = names
        self.cg = cg
        self.epoch = epoch
        self.dims = TensorMap()  # tensor -> (its H dim, rows) where that is not (dim -2, all of it); (-1, 0): none
        self.wdims = TensorMap()  # (a mesh) tensor -> (its W dim, columns), wherever a followed op put W
        self.tainted = TensorMap()  # tensor -> the refusal of the op in a forward hook that computed it
        self.made = TensorMap()  # halo layers' output fields and pointwise results of them: 1 row is no broadcast
        self.checked = 0
        self.off = cg.size == 1  # nothing is sharded: every op computes what the unsharded model does
        self.recorder = reroute.Recorder(cg)  # the calls computed exactly (halo.guard.reroute), by site
        self.sized = reroute.SizeTable()
        self._hook: Any = None
        self.hops: list[str] = []  # higher-order ops run on fields inside torch's own compiled code (refused)
        self.trusted_nodes: list[tuple[int, int]] = []  # autograd sequence numbers made in trusted blocks
        self.first_node: int | None = None  # the guarded call's first autograd node
        self._outer: Any = None

    def __enter__(self) -> SpatialGuard:
        w = context.watch()  # where the layers' place() and trusted() find the guard (halo.context)
        self._outer, w.guard = w.guard, self
        if not self.off:
            self.first_node = _sequence_nr()
        if not self.off:  # a halo layer must not take a whole mean computed here for a shard
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: reroute.refuse_whole_mean(module, args, self.names))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.recorder.close()
            context.watch().guard, self._outer = self._outer, None

    # -- what the layers tell it (halo.context.place / trusted) -------------------------------------------------------

    def place(self, t: Any, dim: int, rows: int | None = None) -> None:
        """:func:`halo.context.place`: ``t`` holds the sharded rows at ``dim`` (``rows`` of them)."""
        if not isinstance(t, torch.Tensor) or torch.compiler.is_compiling():
            return
        d = dim % t.dim()
        self.dims[t] = (d, int(t.shape[d]) if rows is None else int(rows))

    def made_field(self, t: Any) -> None:
        """:func:`halo.context.made`: ``t`` is a halo layer's output field (not whole: a global pool's is marked so)."""
        if isinstance(t, torch.Tensor) and not torch.compiler.is_compiling() and whole_source(t) is None:
            self.made[t] = True

    def trust_begin(self) -> int | None:
        """A :class:`halo.context.trusted` block starts: where its autograd nodes begin (``None``: not watched)."""
        return None if self.off else _sequence_nr()

    def trust_end(self, start: int | None) -> None:
        """A trusted block ends: the autograd nodes made in it are trusted too (:meth:`_refuse_functions`)."""
        if start is not None:
            self.trusted_nodes.append((start, _sequence_nr()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():  # torch's own code compiled inside the guarded call (flex_attention)
            if isinstance(func, HigherOrderOperator) and any(
                    isinstance(a, torch.Tensor) and a.dim() >= 3 for a in (*args, *kwargs.values())):
                self.hops.append(func._name)  # (a side effect dynamo replays; refused at the next eager op)
            return self._after(args, kwargs, func(*args, **kwargs))
        trusted = context.watch().trusted
        if self.hops:
            self._refuse_hops(func, sys._getframe(1))
        if not trusted:
            blind = _blind(sys._getframe(1))
            if blind is not None and self._any_field(args, kwargs):
                what, at = blind
                hint = ("; call halo.nn.domain_flex_attention instead (flex_attention's semantics over the "
                        "domain's tokens, with your score_mod and block mask, exact forward and backward)"
                        if what.endswith("flex_attention") else
                        "; attention over all tokens needs a halo attention layer (window or neighbourhood "
                        "attention: halo.nn) or a gather first")
                note = self._verdict(func, f"{_UNSEEN}{hint}", at, checked=False)
                if note is not None:
                    raise ValueError(refusal_message((note[0], note[1], note[2], what)))
        if self.tainted._items:
            hooked = self._check_taint(func, args, kwargs)
            if hooked is not None:
                return self._after(args, kwargs, hooked[0])
        entry = POLICY.get(func)
        if entry is not None and entry.after == "stack":
            return self._after(args, kwargs, self._stack(func, args, kwargs))
        site = None
        if entry is not None and entry.kind == "exact" and not trusted:  # counted wherever called (sites' ordinals)
            at = user_frame()
            if at is not None and not in_hook(at):
                site = self.recorder.count(at)
        elif entry is not None and entry.sizes and args:
            self._note_size(args[0])
        if trusted and (entry is None or entry.after != "layout"):  # nothing checked (layout ops still followed)
            out = func(*args, **kwargs)
            self._carry_all(args, out)
            return self._after(args, kwargs, out)
        if trusted:
            entry = _LAYOUT_ONLY
        if entry is None or entry.kind == "pass":
            return self._after(args, kwargs, self._pointwise(func, args, kwargs, entry))
        out = self._checked(func, args, kwargs, entry, site)
        if self.made._items:
            self._made_through(args, kwargs, out)
        return self._after(args, kwargs, out)

    def _made_through(self, args, kwargs, out) -> None:
        """An op followed or checked (a view, a permute and back, a reduction over channels, a slice of channels)
        on a halo layer's field: each result that still holds H (or W) is that layer's field too, so its 1-row
        shard is no broadcast either (:meth:`made_field`)."""
        given = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                 if isinstance(t, torch.Tensor)]
        if not any(self.made.get(t) is not None for t in given):
            return
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor) and (self._field(o) is not None or self.w_sharded and self._on_w(
                    lambda o=o: self._field(o)) is not None):
                self.made[o] = True

    def _carry_all(self, args, out) -> None:
        """An op that keeps the shape along the axes (pointwise): its result holds H (and W) where its tracked
        argument does."""
        tracked = self._tracked(args) if self.dims._items else None
        if tracked is not None:
            self._carry(tracked, out)
        if self.w_sharded and self.wdims._items:
            tracked = self._on_w(lambda: self._tracked(args))
            if tracked is not None:
                self._on_w(lambda: self._carry(tracked, out))

    def _after(self, args, kwargs, out):
        """What an op returns, after: an op on a tensor whole on every rank (a mean or norm over H computed here, a
        global pool's result) and on no field, called by user code (or torch's layers it runs), gives a tensor
        whole too (``m * 2.0``, ``m.view(...)``): marked :data:`halo.guard.reroute.WHOLE_DERIVED` for this guarded
        call, so a halo layer given it is refused (:func:`halo.guard.reroute.refuse_whole_mean`) rather than taking
        the ranks' copies for one-row shards (which drew a different dropout mask on each rank, or exchanged the
        copies as rows, silently)."""
        if not plans.state().whole._items or torch.compiler.is_compiling():
            return out
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(whole_source(t) is not None for t in leaves) or any(h_dim(t, self.dims) is not None
                                                                       for t in leaves):
            return out  # (an op on a field: its result is a field, the field's rules applied)
        if reroute.halo_called(3):  # (halo_called, this method, __torch_function__; then the op's caller)
            return out
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and whole_source(t) is None:
                plans.mark_whole(t, reroute.WHOLE_DERIVED)
        return out

    def _pointwise(self, func, args, kwargs, entry):
        """An op passed by its name (``entry``), or an unclassified one (``None``: refused on a field, naming it)."""
        if entry is None:
            if self._any_field(args, kwargs) and user_frame(3) is not None:
                frame = user_frame(3)
                problem = ("is not an op halo has classified (pointwise in H, a layout op it follows, or one it "
                           "computes exactly), and it is given a field sharded along H: it may read rows of other "
                           "ranks, so halo refuses it until it is classified (halo.guard); compute it with a module "
                           "halo converts, gather first (halo.gather), or, if it acts on each row of H on its own, "
                           "run it in `with halo.guard.trusted():`")
                return self._judged(func, args, kwargs, problem, frame, checked=False)
        elif len(args) + len(kwargs) > 1:
            rows = self._rows_of_fields(args, kwargs)
            if rows is not None:  # a pointwise op on two fields or more: are they split alike (H, then W)?
                frame = user_frame(3)
                if frame is not None:
                    cols = self._on_w(lambda: self._rows_of_fields(args, kwargs)) \
                        if self.w_sharded else None
                    made = self._made_of(args, kwargs)
                    made_w = self._on_w(lambda: self._made_of(args, kwargs)) if cols else None
                    problem = split_differently(rows, H, made) or (split_differently(cols, W, made_w) if cols else None)
                    note = self._verdict(func, problem, frame, rows=rows, cols=cols)
                    if note is not None:
                        if not in_hook(frame):
                            raise ValueError(refusal_message(note))
                        out = func(*args, **kwargs)  # monitoring: marked, refused once it flows on
                        self._taint(func, args, out, refusal_message(note))
                        return out
        out = func(*args, **kwargs)
        self._carry_all(args, out)
        if self.made._items and isinstance(out, torch.Tensor) and any(
                isinstance(a, torch.Tensor) and self.made.get(a) is not None for a in (*args, *kwargs.values())):
            self.made[out] = True  # a pointwise result of a layer's field is a field too
        return out

    def _made_of(self, args, kwargs) -> list[bool]:
        """Per tensor argument aligned as :meth:`_rows_of_fields` lists them: whether it is a layer's field."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        fields = [t for t in tensors if self._field(t) is not None]
        back = fields[0].dim() - self._field(fields[0])[0] if fields else 0
        return [self.made.get(t) is not None for t in tensors if t.dim() >= back]

    def _judged(self, func, args, kwargs, problem, frame, checked=True):
        """Agree on ``problem`` across ranks; raise it, or (in a forward hook) run the op and mark its result."""
        note = self._verdict(func, problem, frame, checked=checked)
        if note is None:
            return func(*args, **kwargs)
        if not in_hook(frame):
            raise ValueError(refusal_message(note))
        out = func(*args, **kwargs)  # monitoring code in a hook: refused only once its result flows into the model
        self._taint(func, args, out, refusal_message(note))
        return out

    def _checked(self, func, args, kwargs, entry, site):
        """The dispatcher of the one table (:data:`halo.guard._policy.POLICY`) for an op with a rule or a check."""
        tracked = self._tracked(args) if self.dims._items else None
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, str):  # einsum(equation, *operands)
            x = next((t for t in args[1:] if isinstance(t, torch.Tensor)), x)
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):  # cat
            x = next((t for t in x if h_dim(t, self.dims) is not None), x[0])
        h = h_dim(x, self.dims)
        rule = entry.rule
        if rule is interpolate_rule and h is None and isinstance(x, torch.Tensor) and x.dim() >= 3 \
                and x.shape[-2] > 1 and whole_source(x) is not None:
            rule, h = whole_interpolate_rule, x.dim() - 2  # a small map whole on every rank (PSP), resized
        if entry.how == "dropout" and h is None and isinstance(x, torch.Tensor):
            exact = self._whole_dropout(func, args, kwargs, x, site)
            if exact is not None:
                return exact[0]
        watch = h is not None or entry.check is not None
        frame = user_frame(3) if watch else None
        if frame is None and rule is linear_rule and watch and torch_module_call(3) \
                and (self.w_sharded or (h is not None and isinstance(x, torch.Tensor) and h == x.dim() - 1
                                        and not reroute.halo_called(3))):
            # a kept nn.Linear given a field whose last dim is sharded: W on a latitude x longitude mesh
            # (custom_converters={nn.Linear: None}), or H itself (MLP-Mixer's token mixing, x.transpose(1, 2) of
            # its tokens, called from user code, not from a halo layer's): it mixes the sharded rows; checked although
            # torch's own module makes the call
            frame = sys._getframe(2)
        if frame is None:  # not a field, or torch's / halo's own code: run it (and follow H through it)
            out = func(*args, **kwargs)
            if entry.after == "layout" and h is not None:
                self._follow(func, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
            self._w_after(entry, func, args, kwargs, x, out)
            return out
        if entry.check is not None:
            operands = (args[1], args[0], *args[2:]) if func is T.__rmatmul__ and len(args) > 1 else args  # (m @ x)
            problem = getattr(self, entry.check)(operands, kwargs)
            if problem is None and self.w_sharded:  # the same check on W (a latitude x longitude mesh)
                found = self._on_w(lambda: getattr(self, entry.check)(operands, kwargs))
                problem = None if found is None else W.prefix + found
        elif rule is not None and h is not None:
            problem = rule(args, kwargs, x, h, H)
        else:
            problem = None
        if site is not None and site[0] is not None and not self.w_sharded and isinstance(x, torch.Tensor):
            exact = self._exact(entry, func, args, kwargs, x, h, problem, frame, site)
            if isinstance(exact, str):
                problem = exact
            elif exact is not None:
                return exact[0]
        w = self._on_w(lambda: self._field(x)) if self.w_sharded and rule is not None else None
        if problem is None and w is not None:
            found = rule(args, kwargs, x, w[0], W)  # the same rule, on W (the last dim, or where it was followed)
            problem = None if found is None else W.prefix + found
        if problem is not None:
            problem = with_twin_hint(func, problem)
        out, ran, failed = None, problem is None, None
        if ran:
            try:
                out = func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - torch refuses this rank's shard: agreed on first (invariant 4)
                failed, ran, problem = exc, False, torch_raised(exc)
        if ran:
            if entry.after == "layout":
                problem = self._follow(func, args, kwargs, x, h, out)
            elif entry.after in ("einsum", "sdpa"):
                getattr(self, f"_{entry.after}_follow")(args, kwargs, out)
            elif entry.after == "index" and func is T.__getitem__:
                problem = self._follow_index(x, h, args[1] if len(args) > 1 else None, out)
            elif entry.after == "reduce" and h is not None:
                self._follow_reduce(rule.along, args, kwargs, x, h, out)
            elif tracked is not None:
                self._carry(tracked, out)
            if problem is None:
                found = self._w_after(entry, func, args, kwargs, x, out)
                problem = None if found is None else W.prefix + found
        note = self._verdict(func, problem, frame)
        if note is not None:  # some rank refuses it (all ranks alike from here)
            if not in_hook(frame) or failed is not None:
                raise ValueError(refusal_message(note)) from failed
            if not ran:  # monitoring code in a hook: refused only once its result flows into the model
                out = func(*args, **kwargs)
            self._taint(func, args, out, refusal_message(note))
        return out

    def _w_after(self, entry, func, args, kwargs, x, out) -> str | None:
        """On a latitude x longitude mesh: follow W through an op that ran, as H is followed (its problem: a layout
        op W cannot be followed through)."""
        if not self.w_sharded:
            return None

        def follow():
            f = self._field(x)
            if entry.after == "layout":
                return None if f is None else self._follow(func, args, kwargs, x, f[0], out)
            if entry.after in ("einsum", "sdpa"):
                getattr(self, f"_{entry.after}_follow")(args, kwargs, out)
            elif entry.after == "index" and func is T.__getitem__:
                return None if f is None else self._follow_index(x, f[0], args[1] if len(args) > 1 else None, out)
            elif entry.after == "reduce" and f is not None:
                self._follow_reduce(entry.rule.along, args, kwargs, x, f[0], out)
            else:
                tracked = self._tracked(args) if self.dims._items else None
                if tracked is not None:
                    self._carry(tracked, out)
            return None
        return self._on_w(follow)

    # -- computed exactly (halo.guard.reroute) -------------------------------------------------------------------------

    def _note_size(self, t: Any) -> None:
        """User code read the size of ``t``: if it is a field (H at dim -2), a size taken from a shard may name it."""
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.dim() >= 3 \
                and self.dims.get(t) is None and whole_source(t) is None and user_frame(3) is not None:
            self.sized.note(t)

    def _whole_dropout(self, func, args, kwargs, x, site) -> tuple[Any] | None:
        """``F.dropout`` drawing (training, ``p > 0``) on a tensor that is no field: on a global pool's or a mean
        over H's own result (whole on every rank), the whole tensor's mask drawn alike on every rank, recorded at its
        site for later calls (:class:`halo.guard.reroute.WholeDropout`); on a tensor computed from one
        (:data:`halo.guard.reroute.WHOLE_DERIVED`), refused: later calls could not tell it from a replicated tensor
        of another kind. ``None``: not a draw on a whole tensor (the rule's usual path)."""
        p = get_arg(args, kwargs, 1, "p", 0.5)
        source = whole_source(x)
        if not get_arg(args, kwargs, 2, "training", True) or not p or source is None or self.w_sharded:
            return None
        frame = user_frame(4)
        if frame is None:  # torch's or halo's own code: not the model's call
            return None
        if source == reroute.WHOLE_DERIVED or site is None or site[0] is None:
            why = ("it is computed from a whole result (not the global pool's or mean's own result)"
                   if source == reroute.WHOLE_DERIVED else "halo found no module whose call runs it")
            note = self._verdict(func, f"draws a random mask (p={p}) on a tensor whole on every rank, which halo "
                                       f"draws whole (the unsharded model's mask) only for a global pool's or a mean "
                                       f"over H's own result; here {why}: apply the dropout to that result itself "
                                       f"(or an nn.Dropout module right after the pool)", frame)
            if note is not None:
                raise ValueError(refusal_message(note))
            return None
        note = self._verdict(func, None, frame)
        if note is not None:
            raise ValueError(refusal_message(note))
        action = reroute.WholeDropout(self.recorder.gid)
        out = action(args, kwargs)
        self.recorder.record(*site, action)
        return (out,)

    def _exact(self, entry, func, args, kwargs, x, h, problem, frame, site) -> tuple[Any] | str | None:
        """An op halo can compute exactly where the rule finds it acts on H: ``(out,)`` computed (and recorded at its
        site for later calls), a refusal (why not here), or ``None``: go on as the rule says."""
        module, key, ordinal = site
        whole = False
        if entry.how == "dropout":  # on a field: refused (the rule); on a whole tensor: _whole_dropout
            return None
        if entry.how in ("mean", "sum"):
            dims = reroute.mean_dims(args, kwargs, x) if problem is not None else None
            if dims is None:
                return None
            why = None if h in dims[0] else "it does not reduce over H"
            if why is None and entry.how == "sum" and not (x.is_floating_point() or x.is_complex()) \
                    and kwargs.get("dtype") is None:
                why = f"a sum of a {x.dtype} field (halo sums floating fields)"
        elif entry.how == "contract":
            if problem is None:
                return None
            a, b = (args[1], args[0]) if func is T.__rmatmul__ else (args[0], args[1] if len(args) > 1 else None)
            why = reroute.contract_form(a, b, h_dim(a, self.dims), h_dim(b, self.dims),
                                        self.made.get(a) is not None and self.made.get(b) is not None)
        elif entry.how == "softmax":
            if problem is None:
                return None
            form = reroute.softmax_form(func, args, kwargs, x)
            why = form if isinstance(form, str) else None if form[0] == h else "it does not normalise over H"
        elif entry.how == "vector_norm":
            if problem is None:
                return None
            form = reroute.norm_form(func, args, kwargs, x)
            why = form if isinstance(form, str) else None if h in form[1] else "it does not reduce over H"
        elif entry.how == "attention":
            if problem is None:
                return None  # cross-attention to a whole context, or not over a field's tokens
            why = reroute.attention_form(args, kwargs, self.dims)
        elif entry.how == "pool":
            if problem is None or h != x.dim() - 2:
                return None  # no window along H (or not a field's H: the rule's refusal stands)
            form = reroute.pool_form(func, args, kwargs, x)
            why = form if isinstance(form, str) else None
        elif entry.how == "interpolate":
            whole = whole_source(x) is not None
            sized = get_arg(args, kwargs, 1, "size") is not None  # (a size from a shard: gathered on every rank)
            if h != x.dim() - 2 or problem is None and not sized and (
                    whole or reroute.interpolate_change(args, kwargs, x) is None):
                return None
            why = reroute.plan_interpolate(args, kwargs, x, whole)
        else:
            if problem is None:
                return None
            why = reroute.plan_norm(func, args, kwargs, x, h)
        if why is not None:
            return f"{problem}; halo computes it exactly only in a form it can (here: {why})" if problem else None
        note = self._verdict(func, None, frame)
        if note is not None:
            raise ValueError(refusal_message(note))
        gid = self.recorder.gid
        try:  # (collectives: every rank gets here, and an agreement that fails raises the same on every rank)
            if entry.how == "vector_norm":
                action = reroute.VectorNorm(*form, gid)
            elif entry.how == "attention":
                action = reroute.Attention(gid)
            elif entry.how == "pool":
                action = reroute.finish_pool(func, args, kwargs, x, gid)
            elif entry.how in ("mean", "sum"):
                action = reroute.finish_mean(x, h, *dims, self.cg, gid, entry.how)
            elif entry.how == "softmax":
                action = reroute.Softmax(*form, gid)
            elif entry.how == "contract":
                action = reroute.Contract(func is T.__rmatmul__, gid)
            elif entry.how == "interpolate":
                action = reroute.finish_interpolate(args, kwargs, x, whole, self.sized, self.cg, gid, op_name(func))
            else:
                action = reroute.finish_norm(func, x, self.cg, gid)
        except ValueError as exc:
            action = f"halo would compute it over the whole domain, but {exc}"
        if isinstance(action, str):
            raise ValueError(refusal_message((0, action, where(frame, self.names), op_name(func))))
        if action is None:  # exact on the shard as it is
            return (func(*args, **kwargs),)
        out = action(args, kwargs)
        self.recorder.record(module, key, ordinal, action)
        if entry.how == "softmax":  # this rank's rows of the normalised field: H where its input held it
            self._carry((x, self._field(x)), out)
        if entry.after == "sdpa":  # this rank's rows of the attention's output: a field's tokens, as the query's
            self._sdpa_follow(args, kwargs, out)
        return (out,)

    # -- hooks ---------------------------------------------------------------------------------------------------

    def finish(self, output: Any, root: torch.nn.Module) -> None:
        """The model's output: refuse it if a forward hook computed it with an op the guard refuses; else the epoch
        is guarded, with its sites (``root``: the converted model)."""
        import torch.utils._pytree as pytree

        for t in pytree.tree_leaves(output):
            message = self.tainted.get(t) if isinstance(t, torch.Tensor) else None
            if message is not None:
                raise ValueError(flows_message(message))
        if not self.off:
            if self.hops:
                self._refuse_hops(None, None)
            self._refuse_functions([t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)])
        reroute.install(self.recorder, self.epoch, self.names, root)  # later calls of this epoch compute them alike

    def _refuse_hops(self, func, frame) -> None:
        """A higher-order op ran on a field inside torch's compiled code (the guard saw it only while dynamo traced
        it): refused on every rank (each rank traced the same code), at the next eager op or the call's end."""
        name = ", ".join(dict.fromkeys(self.hops))
        self.hops.clear()
        text = f"{_UNSEEN}; compute it with a module halo converts, or gather first"
        if frame is None:
            self._agree_refusal(f"the higher-order op {name} (run by torch's own code in the model's forward): {text}")
            return
        at = user_frame(3) or frame
        note = self._verdict(func, text, at, checked=False)
        if note is not None:
            raise ValueError(refusal_message((note[0], note[1], note[2], f"the higher-order op {name}")))

    def _refuse_functions(self, outputs: list[torch.Tensor]) -> None:
        """After the guarded call: walk its autograd graph from the outputs (the nodes it made, from
        :attr:`first_node` on) and refuse a custom ``torch.autograd.Function`` applied to a field (an output of
        3 dims or more), on every rank: the guard saw the ops of its forward, but its backward is code halo cannot
        check. halo's and torch's own Functions pass (the exchanges, checkpointing), as do nodes made in
        ``with halo.guard.trusted():``. (Without a graph, as in inference, only the forward runs: the guard
        checked its ops.)"""
        found = None
        if self.first_node is not None:
            first, seen = self.first_node, set()
            stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
            while stack and found is None:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                nr = node._sequence_nr()
                if nr < first:  # made before the call (its input's history)
                    continue
                if isinstance(node, torch.autograd.function.BackwardCFunction) \
                        and not any(a <= nr < b for a, b in self.trusted_nodes):
                    found = _custom_function(node)
                stack.extend(n for n, _ in node.next_functions)
        self._agree_refusal(found)

    def _agree_refusal(self, problem: str | None) -> None:
        """Every rank at the end of the guarded call: raise the first rank's ``problem`` on all of them."""
        table = gather_words([_AGREE, 2, 1 if problem else 0], self.cg, "halo guard (the call's graph)") \
            if self.cg.size > 1 else np.array([[_AGREE, 2, 1 if problem else 0]])
        if not table[:, 2].any():
            return
        notes = all_gather_object(problem, self.cg) if self.cg.size > 1 else [problem]
        r, text = next((r, n) for r, n in enumerate(notes) if n)
        raise ValueError(f"{text}. halo refuses it on every rank (seen on domain rank {r}) rather than compute each "
                         f"shard on its own: the converted model would silently differ from the unsharded one")

    def _verdict(self, func, problem: str | None, frame, checked: bool = True,
                 rows: list[int] | None = None, cols: list[int] | None = None) -> tuple[int, str, str, str] | None:
        """The ranks' agreed verdict on an op: ``None`` (every rank goes on), or ``(rank, problem, where, name)`` of
        the first rank that refuses it. An op refused by its name alone (``checked=False``) is refused on every
        rank that reaches it (SPMD), with a collective only to check that they all got there. ``rows``: a pointwise
        op's operand rows on this rank (:meth:`_rows_of_fields`), also judged across ranks (:func:`broadcasts`);
        ``cols``: the same along W on a latitude x longitude mesh."""
        self.checked += checked
        if self.cg.size == 1 and problem is None:
            return None
        name = op_name(func)
        tag = zlib.crc32(name.encode()) & 0x7FFFFFFF
        if self.cg.size > 1:
            masks = (*row_masks(rows), *row_masks(cols))
            table = gather_words([_AGREE, tag, 1 if problem else 0, *masks], self.cg, f"halo guard ({name})")
            split, split_w = (bool(np.bitwise_and.reduce(table[:, k]) | np.bitwise_and.reduce(table[:, k + 1]) != -1)
                              for k in (3, 5))
            if not table[:, 2].any() and (table[:, 1] == tag).all() and not split and not split_w:
                return None
            notes = all_gather_object((problem, where(frame, self.names), name, rows, cols), self.cg)
            if (split or split_w) and not any(n[0] for n in notes) and len({n[2] for n in notes}) == 1:
                text = broadcasts([n[3] for n in notes]) if split else broadcasts([n[4] for n in notes], W)
                notes = [(text, *n[1:]) for n in notes]
        else:
            notes = [(problem, where(frame, self.names), name, rows, cols)]
        if not self.w_sharded and any(n[0] for n in notes) and len({n[2] for n in notes}) == 1:
            extra = global_extents([n[3] for n in notes])  # (the unsharded model's own error? latitude rows only)
            notes = [(n[0] + extra if n[0] else n[0], *n[1:]) for n in notes]
        if len({n[2] for n in notes}) > 1:
            raise ValueError(
                "halo guard: the ranks of the domain group called different torch functions at the same point of "
                "the model's forward (" + "; ".join(f"rank {r}: {n[2]} at {n[1]}" for r, n in enumerate(notes))
                + "): code that branches on the size of its shard computes something else on each rank")
        r, (text, at, name, *_) = next((r, n) for r, n in enumerate(notes) if n[0])
        return r, text, at, name


def _custom_function(node: Any) -> str | None:
    """The refusal of a custom ``autograd.Function``'s node, or ``None``: halo's or torch's own, or not on a field."""
    cls = getattr(node, "_forward_cls", None)
    module = getattr(cls, "__module__", "") or ""
    if module.split(".")[0] in ("halo", "torch"):
        return None
    meta = getattr(node, "_input_metadata", None)
    if meta is not None and all(len(m.shape) < 3 for m in meta):  # its outputs are no fields (parameters, scalars)
        return None
    name = getattr(cls, "__qualname__", type(node).__name__)
    try:
        import inspect

        at = f" (defined at {os.path.basename(inspect.getsourcefile(cls))}:{inspect.getsourcelines(cls)[1]})"
    except (OSError, TypeError):
        at = ""
    return (f"the custom torch.autograd.Function {module}.{name}{at}, applied to a field in the model's forward: "
            f"the guard checked the ops of its forward, but not its backward, which is code of its own that halo "
            f"cannot see (it may mix the sharded rows H); compute it with torch ops or a module halo converts, or, "
            f"if its forward and backward act on each row of H on their own, call it in "
            f"`with halo.guard.trusted():`")
