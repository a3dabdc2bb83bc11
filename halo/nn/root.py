"""A converted model's root: where its calls start a step, and the hooks that keep a global pool's result whole.

``convert_to_domain_parallel`` makes the model it converts a *root* (:func:`make_root`): a :class:`RootConfig` in its
``__dict__`` and two hooks, so that each call starts (or joins) a step's epoch (``halo.plan.plans.enter_root`` /
``exit_root``: plans learned once per global shape, invariant 7). A torch container (``nn.Sequential``, ...) gets a
derived class with a forward of its own (:func:`rooted`): torch.compile then runs the hooks eagerly instead of
tracing them. With a global pool in the model (its result whole on every rank), :func:`guard_whole` installs the
hooks that keep whole tensors away from the layers that split rows. :func:`drop_root` undoes the root
(``revert_domain_parallel``). Split from ``halo.nn.convert`` (the walk) so that each file says one thing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dist.comm import comm_group
from ..dist.mesh import GroupRef
from ..dist.transport import gather_words
from ..plan import entry, plans
from ..plan.plans import enter_root, exit_root
from . import pool

__all__ = ["RootConfig", "RootMethod", "drop_root", "entry_methods", "global_pool", "guard_whole", "make_root",
           "rooted", "set_grid"]


def global_pool(m: nn.Module, domain_size: int) -> bool:
    """An adaptive pool whose ``output_size`` gives fewer rows than there are ranks: its result is whole on every
    rank (``halo.nn.pool``)."""
    if not isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return False
    size = m.output_size
    rows = size if isinstance(size, int) else size[0]
    return rows is not None and rows < domain_size


def guard_whole(model: nn.Module, tails: list[nn.Module], domain_size: int) -> None:
    """With a global pool in the model (its result whole on every rank), hooks that keep whole tensors away from
    the layers that split rows: the modules after the pool in its Sequential run as torch's own on the whole
    tensor (and must get one); kept pointwise modules pass the mark on; a halo layer given a whole tensor raises
    (it would take the copies for shards). Nothing is installed in a model without a global pool; under
    ``torch.compile`` the hooks do nothing. The hooks are module-level (:class:`_ExpectWhole`, :func:`_pass_on`,
    :class:`_RefuseWhole`, each knowing its module's path), so the model pickles, ``torch.save``-s whole and
    deep-copies, and a copy's errors name its own modules."""
    for handle in model.__dict__.pop("_halo_whole_hooks", []):  # converting again: install afresh
        handle.remove()
    if not any(global_pool(m, domain_size) for m in model.modules()):
        return
    handles = model.__dict__.setdefault("_halo_whole_hooks", [])
    tail_ids = {id(m) for m in tails}
    for name, m in model.named_modules():
        if m is model:
            continue
        if id(m) in tail_ids:
            handles.append(m.register_forward_pre_hook(_ExpectWhole(name)))
            handles.append(m.register_forward_hook(_pass_on))
        elif "_halo_site" in m.__dict__ and not isinstance(m, (pool.DomainAdaptiveAvgPool2d,
                                                                 pool.DomainAdaptiveMaxPool2d)) \
                and not getattr(m, "_halo_takes_whole", False):  # (DomainDropout: draws a whole tensor's mask)
            handles.append(m.register_forward_pre_hook(_RefuseWhole(name)))
        elif next(m.children(), None) is None and "_halo_site" not in m.__dict__:
            handles.append(m.register_forward_hook(_pass_on))  # a kept pointwise layer: whole in, whole out


class _ExpectWhole:
    """Forward pre-hook of a module after a global pool in its Sequential (kept as torch's own): its input must be
    the pool's whole result."""

    def __init__(self, name: str) -> None:
        self.name = name  # the module's path in the converted model, for the error

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or not args:
            return
        if plans.whole_source(args[0]) is None and isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"{self.name} ({type(module).__name__}) follows a global pool in an nn.Sequential, so halo keeps it "
                f"as torch's own layer on the pool's result (whole on every rank), but its input is not that result "
                f"(the Sequential's forward does not chain its modules in order?): move it out of that Sequential")


def _pass_on(module: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook of a kept module (after the pool, or pointwise): a whole input makes a whole output."""
    if torch.compiler.is_compiling() or not args:
        return
    source = plans.whole_source(args[0])
    if source is not None:
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                plans.mark_whole(t, source)


class _RefuseWhole:
    """Forward pre-hook of a halo layer that splits rows: a global pool's whole result is refused (the layer would
    take the ranks' copies for shards of a field)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or not args:
            return
        source = plans.whole_source(args[0])
        if source is not None:
            raise ValueError(
                f"{self.name} ({type(module).__name__}) is given the result of a global pool ({source}), which is "
                f"whole and the same on every rank; this layer would take the ranks' copies for shards of a field. "
                f"Put the pool and the layers that use its result in one nn.Sequential (halo then keeps those "
                f"layers as torch's own), or use the result only in pointwise ops (as squeeze-excitation does)")


@dataclass(frozen=True)
class RootConfig:
    """What a converted model's entry needs: the domain group (shared by copies) and the declared grid."""

    group_ref: GroupRef
    grid: tuple[int, int] | None
    w_sharded: bool = False  # a latitude x longitude mesh: the guard watches W too
    mesh_shape: tuple[int, int] | None = None  # with a declared grid: the mesh whose blocks the inputs are

    @property
    def group(self) -> Any:
        return self.group_ref.group

    @property
    def guard(self) -> type:
        """The guard the planner enters at this model's first call of each epoch (``halo.plan.plans.enter_root``):
        handed to the planner with the config, so the planner never imports the guard and nothing registers it. A
        call-time import: the guard imports the layers (its exact functionals), whose package face imports this
        module, so at this module's import the guard may be half made (when it is imported first)."""
        from ..guard import SpatialGuard

        return SpatialGuard


def make_root(model: nn.Module, group: Any, grid: tuple[int, int] | None, w_sharded: bool = False,
               mesh_shape: tuple[int, int] | None = None) -> None:
    """Make ``model`` a converted model's root: its calls start (or join) a step's epoch (``halo.plan.plans``)."""
    if grid is not None:
        grid = _check_grid(grid, "convert_to_domain_parallel")
    had = "_halo_root" in model.__dict__
    entry.forget_grid(model)  # (converting again: the grid is learned or declared afresh)
    model.__dict__["_halo_root"] = RootConfig(GroupRef(group), grid, w_sharded, mesh_shape)
    if type(model).__module__.startswith("torch.nn"):
        # torch.compile traces a torch.nn container's call *with* its hooks (and the entry hook runs outside any
        # graph: fullgraph=True would fail); the same class under a forward of halo's own makes dynamo run the
        # hooks eagerly and trace the forward, as for a user's model. isinstance, state_dict and repr are unchanged.
        model.__class__ = rooted(type(model))
    if not had:
        model.register_forward_pre_hook(enter_root, with_kwargs=True)
        model.register_forward_hook(exit_root, with_kwargs=True, always_call=True)
    for name in entry_methods(model):
        model.__dict__[name] = RootMethod(model, name)


def entry_methods(model: nn.Module) -> list[str]:
    """The model's other entries: the methods of its class named ``forward_*`` (timm's ``forward_features``,
    ``forward_head``, ``forward_intermediates``, ...), which users call instead of ``model(x)``."""
    return [n for n in dir(type(model)) if n.startswith("forward_") and callable(getattr(type(model), n, None))
            and not isinstance(type(model).__dict__.get(n), (staticmethod, classmethod))]


class RootMethod:
    """A converted model's other entry (:func:`entry_methods`), as an instance attribute: called from outside the
    model's forward, it is a call of the model (the hooks' :func:`halo.plan.plans.enter_root` / ``exit_root`` around
    it, under an epoch of its own: its first call guarded), so the ops of its code that ``forward`` never runs (timm's
    ``forward_intermediates`` reshapes with the shard's rows) are checked, not run unguarded. Inside the forward (or
    compiled), the method as it is. Picklable, and copied with the model (``copy.deepcopy``)."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model, self.name = model, name
        self.entry = _Entry()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        # The class's function called with the model (not ``func.__get__(model)``: dynamo resolves that bound
        # method to the model's attribute, which is this object: a recursion without end under torch.compile).
        func = getattr(type(model), self.name)
        fn = functools.partial(func, model)
        if plans.state().depth:  # inside the model's call: the method as it is
            return func(model, *args, **kwargs)
        # Called from outside (compiled too: ``torch.compile(model.forward_features)``, traced with the epoch's
        # entry and exit, which dynamo runs eagerly around the graph; a compiled first call is run once eagerly
        # under the guard there, as a compiled model's is: halo.plan.plans.guarded_eager_call).
        enter_root(model, args, kwargs, method=self.name, compiled=torch.compiler.is_compiling())
        out = None
        try:
            out = self.entry(fn, *args, **kwargs)
        finally:
            exit_root(model, args, kwargs, out)
        return out


class _Entry(nn.Module):
    """A :class:`RootMethod`'s call as a module's forward: the functional ops its code calls directly (a mean over
    H in ``forward_head``) are computed exactly at their sites, which the guard's reroute records on a module."""

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def _check_grid(grid: Any, op: str) -> tuple[int, int]:
    if not isinstance(grid, (tuple, list)) or len(grid) != 2 or any(
            isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in grid):
        raise ValueError(f"{op}: grid must be (H, W), two positive ints, got {grid!r}")
    return int(grid[0]), int(grid[1])


def set_grid(model: nn.Module, grid: tuple[int, int] | None) -> None:
    """Change the global grid ``(H, W)`` a converted model runs on (``None``: learn it from its calls again).

    Why: a declared grid is fixed (every call is checked against it, with no communication), and a learned one is
    refused when every rank passes all of its rows (the whole field); an evaluation at another resolution says so
    here. Call it on every rank of the domain group: the ranks agree on ``grid`` (one small host all-gather) and all
    raise the same ``ValueError`` when they pass different grids."""
    op = "set_grid"
    config = model.__dict__.get("_halo_root")
    if config is None:
        raise ValueError(f"{op}: {type(model).__name__} is not a converted model (convert_to_domain_parallel)")
    mine = (0, 0) if grid is None else _check_grid(grid, op)
    cg = comm_group(config.group)
    if cg.size > 1:
        table = gather_words([0x47524944, *mine], cg, op)  # "GRID": host data, once per change
        grids = [(int(row[1]), int(row[2])) for row in table]
        if any(g != grids[0] for g in grids) or (table[:, 0] != 0x47524944).any():
            shown = ", ".join("None" if g == (0, 0) else str(g) for g in grids)
            raise ValueError(f"{op}: the ranks of the domain group pass different grids ({shown} on group ranks "
                             f"0..{cg.size - 1}); pass the same grid on every rank")
    entry.forget_grid(model)
    model.__dict__["_halo_root"] = RootConfig(config.group_ref, None if grid is None else mine, config.w_sharded,
                                              config.mesh_shape)


@functools.cache  # a pure function of a torch.nn class (a bounded set): one derived class each
def rooted(kind: type) -> type:
    """``kind`` with a ``forward`` defined here; pickled by name, found again by this module's ``__getattr__`` (and by
    ``halo.nn.convert``'s: pickles made before the split name that module)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return kind.forward(self, *args, **kwargs)

    name = f"_Rooted{kind.__name__}"
    return type(kind.__name__, (kind,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                         "_halo_unrooted": kind})


def __getattr__(name: str) -> Any:
    """``_RootedSequential`` and friends made on demand: a pickled converted model loads in a fresh process."""
    kind = getattr(nn, name.removeprefix("_Rooted"), None) if name.startswith("_Rooted") else None
    if isinstance(kind, type) and issubclass(kind, nn.Module):
        return rooted(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def drop_root(model: nn.Module) -> None:
    """Undo :func:`make_root`: the torch class back, the root's config and its two hooks gone."""
    unrooted = type(model).__dict__.get("_halo_unrooted")
    if unrooted is not None:
        model.__class__ = unrooted
    if model.__dict__.pop("_halo_root", None) is None:
        return
    for name in [n for n, v in model.__dict__.items() if isinstance(v, RootMethod)]:
        del model.__dict__[name]
    for hooks, fn in ((model._forward_pre_hooks, enter_root), (model._forward_hooks, exit_root)):
        for key in [k for k, h in hooks.items() if h is fn]:
            del hooks[key]
            for extra in (model._forward_pre_hooks_with_kwargs, model._forward_hooks_with_kwargs,
                          model._forward_hooks_always_called):
                extra.pop(key, None)
