"""The guard's messages and frames (:mod:`halo.guard`): the wording of a refusal, where user code called an op,
and the marks of what a forward hook computed with a refused op (:class:`Marks`). What each op may do is the one
table of :mod:`halo.guard._policy`."""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

import torch

from ..plan.plans import TensorMap, guarded_eager_call

__all__ = ["IN_PLACE", "Marks", "flows_message", "in_hook", "op_name", "refusal_message", "torch_module_call", "where"]

T = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__)


def op_name(func: Any) -> str:
    """The op's name as users write it (``Tensor.shape``, ``Tensor.add``, ``einsum``)."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor" and getattr(func, "__name__", "") == "__get__":
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    return name.replace("TensorBase.", "Tensor.")


def refusal_message(note: tuple[int, str, str, str]) -> str:
    r, text, where, name = note
    return (f"{name} {where}: {text}. halo refuses it on every rank (seen on domain rank {r}) rather than compute each "
            f"shard on its own: the converted model would silently differ from the unsharded one")


def flows_message(message: str) -> str:
    return (f"{message}. It ran in a forward hook, where halo lets monitoring code compute what it likes, but its "
            f"result flows into the model's computation (the hook returned it, changed a tensor of the model in "
            f"place, or a later op of the model uses it), so halo refuses it here")


_MODULE_PY = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")
_EAGER_CALL = guarded_eager_call.__code__  # (a compiled first call run eagerly: in_hook)
_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep


def torch_module_call(depth: int = 2) -> bool:
    """Whether the op was called by a torch module's own forward (``nn.Linear.forward``); ``depth``: frames to skip
    (2: the caller of the ``__torch_function__`` that calls this)."""
    return sys._getframe(depth).f_code.co_filename.startswith(_MODULES_DIR)
IN_PLACE = frozenset(("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                       "__imatmul__"))


def in_hook(frame: Any) -> bool:
    """Whether ``frame`` runs (at any depth) inside a module's forward hook or pre-hook: a frame that
    ``Module._call_impl`` called which is not the module's forward. A forward that
    :func:`halo.plan.plans.guarded_eager_call` runs (from the model's pre-hook, for a compiled first call) is the
    model's call, not a hook's: the walk ends there."""
    f = frame
    while f is not None:
        if f.f_code is _EAGER_CALL:
            return False
        back = f.f_back
        if back is not None and back.f_code.co_filename == _MODULE_PY and f.f_code.co_filename != _MODULE_PY \
                and back.f_code.co_name in ("_call_impl", "inner"):  # hooks run in _call_impl's inner()
            call = back.f_locals.get("forward_call")
            code = getattr(getattr(call, "__func__", call), "__code__", None)
            if code is not None and code is not f.f_code:
                return True
        f = back
    return False


def where(frame: Any, names: dict[int, str]) -> str:
    """``at file:line `code` (in the forward of path (Type))``: the user line, and the module whose forward ran it
    (the nearest caller that is a module's method; ``names``: id(module) -> its path in the model)."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    at = f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} `{line}`"
    f = frame
    while f is not None:
        module = f.f_locals.get("self")
        if isinstance(module, torch.nn.Module):
            path = names.get(id(module), "(a module)")
            return f"{at} (in the forward of {path} ({type(module).__name__}))"
        f = f.f_back
    return at


class Marks:
    """The marks of what monitoring code in a forward hook computed with an op the guard refuses (a mixin of
    :class:`halo.guard.SpatialGuard`): refused only once such a result flows into the model."""

    tainted: TensorMap

    def _taint(self, func, args, out, message: str) -> None:
        """Mark what an op the guard refuses computed in a forward hook (and the tensor it changed in place)."""
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):
                self.tainted[o] = message
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and (name.endswith("_") and not name.endswith("__")
                                                           or name in IN_PLACE):
            self.tainted[args[0]] = message

    def _check_taint(self, func, args, kwargs) -> tuple[Any] | None:
        """An op given a tensor computed by a refused op in a hook: inside a hook, run it and pass the mark on
        (``(out,)``); outside, the refused result flows into the model: refuse it (the same on every rank: the
        marks come from agreed refusals). ``None``: no marked input."""
        message = None
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    message = message or self.tainted.get(t)
        if message is None:
            return None
        if in_hook(sys._getframe(2)):
            out = func(*args, **kwargs)
            self._taint(func, args, out, message)
            return (out,)
        raise ValueError(flows_message(message))
