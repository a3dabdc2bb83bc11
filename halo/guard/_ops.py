"""The guard's op tables and messages (:mod:`halo.guard`): the ops that pass on a field by their name alone
(default deny: :data:`PASS`), the layout ops it follows, the wording and frames of a refusal, and the marks of what a
forward hook computed with a refused op (:class:`Marks`)."""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..plan.plans import TensorMap
from ._rules import RULES

__all__ = ["INTERPOLATES", "IN_PLACE", "LAYOUT", "MATMUL", "MEANS", "MERGES", "MT", "PASS", "SIZE_READS", "STACK",
           "Marks", "flows_message", "in_hook", "op_name", "refusal_message", "torch_module_call", "where"]

T = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__)


def _funcs(names: str, *spaces: Any, inplace: bool = False) -> set:
    """The functions called ``names`` (space separated) in each namespace that has them (and ``name_``)."""
    found = set()
    for name in names.split():
        for space in spaces:
            for n in (name, name + "_") if inplace else (name,):
                f = getattr(space, n, None)
                if f is not None:
                    found.add(f)
    return found


#: The ops that pass on a field by their name alone (default deny: everything else that is given a field and has no
#: rule above is refused). Each acts on every point independently, or reads only metadata, or makes a tensor of the
#: field's shape. In groups; an op goes here only if it is pointwise in every dim a rank may shard.
_ELEMENTWISE = _funcs(
    "abs absolute neg negative positive sign sgn signbit add sub subtract rsub mul multiply div divide true_divide "
    "floor_divide remainder fmod pow float_power reciprocal rsqrt sqrt square exp exp2 expm1 log log2 log10 log1p "
    "logaddexp logaddexp2 sin cos tan asin acos atan atan2 arcsin arccos arctan arctan2 sinh cosh tanh asinh acosh "
    "atanh arcsinh arccosh arctanh sinc hypot lerp addcmul addcdiv clamp clip clamp_min clamp_max maximum minimum "
    "fmax fmin floor ceil round trunc fix frac copysign nextafter ldexp xlogy erf erfc erfinv lgamma digamma "
    "polygamma mvlgamma i0 sigmoid logit nan_to_num heaviside gcd lcm deg2rad rad2deg angle conj conj_physical "
    "resolve_conj resolve_neg bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift "
    "bitwise_right_shift logical_and logical_or logical_not logical_xor masked_fill complex polar frexp",
    torch, T, inplace=True) | _funcs(
    "expit logit erf erfc erfinv erfcx gammaln digamma psi polygamma multigammaln i0 i0e i1 i1e ndtr ndtri "
    "log_ndtr sinc entr xlogy xlog1py exp2 expm1 log1p round", torch.special)
_COMPARISONS = _funcs(
    "eq ne lt le gt ge greater less greater_equal less_equal not_equal isnan isinf isfinite isposinf isneginf isreal "
    "isclose", torch, T, inplace=True)
_ACTIVATIONS = _funcs(
    "relu relu6 elu selu celu gelu silu mish hardswish hardsigmoid hardtanh leaky_relu logsigmoid softplus "
    "softshrink hardshrink tanhshrink softsign threshold sigmoid tanh prelu", F, torch, T, inplace=True)
_DUNDERS = _funcs(
    "__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ "
    "__itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ "
    "__pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__ "
    "__xor__ __rxor__ __ixor__ __lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__ __eq__ __ne__ "
    "__lt__ __le__ __gt__ __ge__", T)
#: Casts, copies and metadata: the same values (or none), the same shape.
_METADATA = _funcs(
    "to type type_as float double half bfloat16 int long bool short char byte cfloat cdouble cpu cuda contiguous "
    "clone detach detach_ requires_grad_ retain_grad size dim ndimension numel nelement stride storage_offset "
    "is_contiguous is_floating_point is_complex is_signed element_size data_ptr get_device register_hook "
    "untyped_storage pin_memory is_pinned dim_order __len__ __repr__ __format__ __bool__ __float__ __int__ "
    "__index__ __hash__ item __deepcopy__ __reduce_ex__ __setstate__ copy_ fill_ zero_ expand expand_as broadcast_to "
    "new_zeros new_ones new_empty new_full new_tensor zeros_like ones_like empty_like full_like", torch, T)
_GETTERS = {getattr(T, name).__get__ for name in (
    "shape dtype device ndim requires_grad is_cuda is_cpu is_mps is_xpu is_meta is_sparse is_quantized is_nested "
    "is_mkldnn grad grad_fn data layout names is_leaf output_nr _version itemsize nbytes retains_grad real imag "
    "_base").split() if hasattr(T, name) and hasattr(getattr(T, name), "__get__")}
PASS = _ELEMENTWISE | _COMPARISONS | _ACTIVATIONS | _DUNDERS | _METADATA | _GETTERS
PASS -= set(RULES)  # a rule reads the arguments of the ops that have one
MT = T.mT.__get__  # x.mT: transpose of the last two dims, followed
SIZE_READS = {T.shape.__get__, T.size}  # a field's size read by user code: what a size from a shard may name
INTERPOLATES = {F.interpolate, F.upsample}
MEANS = {torch.mean, T.mean}

LAYOUT = {torch.permute, T.permute, torch.transpose, T.transpose, torch.movedim, T.movedim, torch.swapaxes,
           T.swapaxes, torch.swapdims, T.swapdims, torch.unsqueeze, T.unsqueeze, torch.squeeze, T.squeeze, MT}
MERGES = {T.view, T.reshape, torch.reshape, torch.flatten, T.flatten, T.view_as, T.reshape_as, T.unflatten,
           torch.unflatten}
MATMUL = {torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.bmm, T.bmm}
STACK = {torch.stack}


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
_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep


def torch_module_call() -> bool:
    """Whether the op was called by a torch module's own forward (``nn.Linear.forward``)."""
    return sys._getframe(2).f_code.co_filename.startswith(_MODULES_DIR)
IN_PLACE = frozenset(("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                       "__imatmul__"))


def in_hook(frame: Any) -> bool:
    """Whether ``frame`` runs (at any depth) inside a module's forward hook or pre-hook: a frame that
    ``Module._call_impl`` called which is not the module's forward."""
    f = frame
    while f is not None:
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
