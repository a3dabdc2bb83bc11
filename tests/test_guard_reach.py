"""Reachability of the guard's one op table (issue 31 item 3): EVERY entry of :data:`halo.guard._policy.POLICY`
(iterated from the table itself: a new entry without a case fails :func:`test_every_entry_has_a_case`) is called in
a converted model's own forward, on a field sharded along H (3 gloo ranks, 8 rows: 3 + 3 + 2) and on a latitude x
longitude mesh (2 x 2, the rule applied to W too), once acting along each sharded dim and once along a dim that is
not sharded (pointwise ops: once, on the field and a second field). Each outcome is one of:

* ``ran``: the gathered output and input gradient equal the unsharded model's (float64);
* ``refused``: a ``ValueError`` on every rank, the same message, naming the op (for a layout op: the reduction
  after it, over the dim it moved, which the guard must see through it);
* ``raises alike``: torch itself raises for the whole field too (``cuda`` on a CPU build, ``item`` of a field).

Never silently different, never a hang (``halo.set_timeout``, a short ``run_on_ranks`` timeout). On the mesh, an
op acting along H and the same op along W must get the same verdict (one rule, written once per ``Axis``).
One rank pool per mesh shape runs all cases (each in a freshly converted model: the guard watches first calls).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.guard._ops import op_name
from halo.guard._policy import POLICY
from halo.testing import run_on_ranks

T = torch.Tensor
B, C, H, W = 2, 4, 8, 6
SIZE = {1: C, 2: H, 3: W}
TOL = {"rtol": 1e-9, "atol": 1e-10, "equal_nan": True}


# -- every entry's stable name (ids differ between processes; the ranks start from a forkserver) ---------------------

def _spaces() -> list[tuple[str, object]]:
    return [("F", F), ("torch.fft", torch.fft), ("torch.linalg", torch.linalg), ("torch.special", torch.special),
            ("torch", torch), ("Tensor", T), ("aten", torch.ops.aten)]


@functools.cache
def entries() -> dict[str, tuple[object, str]]:
    """``key -> (func, base name)`` for every entry of POLICY, sorted by key; the base name picks its case."""
    named: dict[int, tuple[str, str]] = {}
    for space, ns in _spaces():
        for attr in sorted(dir(ns)):
            try:
                obj = getattr(ns, attr)
                known = obj in POLICY
            except Exception:  # noqa: BLE001 - unhashable or lazy attributes
                continue
            if known and id(obj) not in named:
                named[id(obj)] = (f"{space}.{attr}", attr)
    out = {}
    for f in POLICY:
        if id(f) in named:
            key, base = named[id(f)]
        else:  # getters (x.shape: Tensor.shape.__get__)
            key = op_name(f)
            base = key.rsplit(".", 1)[-1]
        assert key not in out, key
        out[key] = (f, base)
    return dict(sorted(out.items()))


# -- the cases: base name -> fn(f, x, d, m) acting along dim d of the (B, C, H, W) field x ---------------------------

def _keep(d):
    return {"dim": d, "keepdim": True}


def _other(d):
    return 0 if d == 1 else 1


def _at(d, v, n=4):
    """A per-dim tuple for dims 2, 3 (H, W): ``v`` at ``d``, 1 elsewhere."""
    return tuple(v if k == d else 1 for k in range(2, n))


def _pad(d):
    pairs = [0, 0] * 3  # W, H, C from the last dim backwards
    pairs[2 * (3 - d)], pairs[2 * (3 - d) + 1] = 1, 2
    return pairs


def _sdpa(f, x, d, m):
    if d == 1:  # tokens: channels; features: W
        t = x.movedim(1, -2)
        return f(t, t, t).movedim(-2, 1)
    order, back = ((0, 3, 2, 1),) * 2 if d == 2 else ((0, 2, 3, 1), (0, 3, 1, 2))  # tokens along d, features: C
    return f(*[x.permute(order)] * 3).permute(back)


def _conv(f, x, d, m):
    w = m.k3[str(d)]
    return f(x, w, None, 1, tuple(k // 2 for k in w.shape[2:]))


def _conv3d(f, x, d, m):
    w = m.k3[str(d)].unsqueeze(2)
    return f(x.unsqueeze(2), w, None, 1, (0, *(k // 2 for k in w.shape[3:]))).squeeze(2)


def _conv_t(f, x, d, m):
    w = m.k3[str(d)]
    return f(x, w, None, 1, tuple(k // 2 for k in w.shape[2:]))


def _conv_t3d(f, x, d, m):
    w = m.k3[str(d)].unsqueeze(2)
    return f(x.unsqueeze(2), w, None, 1, (0, *(k // 2 for k in w.shape[3:]))).squeeze(2)


def _conv1d(f, x, d, m):
    b, c, h, w = x.shape
    k = m.k1[str(d) if m.sharded else "1"]  # (a kernel of 1 over tokens: pointwise, along no dim)
    return f(x.flatten(2), k, None, 1, k.shape[-1] // 2).view(b, c, h, w)


def _pool(f, x, d, m):
    k = _at(d, 3)
    return f(x, k, 1, tuple(v // 2 for v in k))


def _pool3d(f, x, d, m):
    k = (1, *_at(d, 3))
    return f(x.unsqueeze(2), k, 1, tuple(v // 2 for v in k)).squeeze(2)


def _first(r):
    return r[0] if isinstance(r, (tuple, list)) else r


def _iter(f, x, d, m):
    return torch.stack(list(f(x.movedim(d, 0))), 0).movedim(0, d)


def _three(t):
    """(.., n) as 3 dims, merging the two dims before the last ones that are not H of a (B, C, H, W) field."""
    return t.flatten(1, 2) if t.shape[-1] == C else t.flatten(0, 1)


def _adaptive1d(f, x, d, m):
    t = x.movedim(d, -1)
    return f(_three(t), 2).view(*t.shape[:-1], 2).movedim(-1, d)


def _einsum(f, x, d, m):
    letters = "bchw"
    out = letters.replace(letters[d], "")
    return f(f"{letters},{letters}->{out}", x, m.y).unsqueeze(d)


def _interp(f, x, d, m):
    return f(x, scale_factor=_at(d, 2.0), mode="bilinear" if f is not F.upsample_nearest else "nearest") \
        if f not in (F.upsample_bilinear, F.upsample_nearest) else f(x, scale_factor=_at(d, 2))


def _layer_norm(f, x, d, m):
    if d == 1:  # over channels only (channels-last)
        return f(x.movedim(1, -1), (C,)).movedim(-1, 1)
    return f(x, tuple(x.shape[d:]))


def _flatten(f, x, d, m):
    b, c, h, w = x.shape
    if m.sharded:
        return f(x, 2).sum(-1, keepdim=True).unsqueeze(-1)  # tokens: over H and W
    r = f(x, 0, 1).sum(d - 1 if d > 1 else 0, keepdim=True)  # B and C merged: over the dim d went to
    return r.view(b if d > 1 else 1, c if d > 1 else 1, *r.shape[1:])


def _view(f, x, d, m):
    b, c, h, w = x.shape
    shape = [b, c, h, w]
    shape[d:d + 1] = [shape[d], 1]  # a size-1 dim after d
    return f(x, shape).sum(d, keepdim=True).squeeze(d + 1)


def _matmul(f, x, d, m):
    t = x.movedim(d, -1)
    return f(t, m.mat[str(d)]).movedim(-1, d)


def _rmatmul(f, x, d, m):
    t = x.movedim(d, -2)
    return f(t, m.mat[str(d)]).movedim(-2, d)  # mat @ t: over dim -2 of t


def _bmm(f, x, d, m):
    t = x.movedim(d, -1)
    t3 = _three(t)
    return f(t3, m.mat[str(d)].expand(t3.shape[0], -1, -1)).view(t.shape).movedim(-1, d)


def _baddbmm(f, x, d, m):
    t = x.movedim(d, -1)
    t3 = _three(t)
    return f(t3, t3, m.mat[str(d)].expand(t3.shape[0], -1, -1)).view(t.shape).movedim(-1, d)


def _index(d, i):
    return (slice(None),) * d + (i,)


def _setitem(f, x, d, m):
    z = x * 1
    f(z, _index(d, slice(0, 1)), 0.5)
    return z


LAYOUT = "layout"  # a refusal may name the reduction after a layout op, over the dim the layout op moved

CASES: dict[str, object] = {
    # reductions, keepdim: a (.., 1, ..) result broadcast back over the field
    **{n: (lambda f, x, d, m: f(x, **_keep(d))) for n in
       "sum mean nansum nanmean amax amin std var logsumexp max min median nanmedian mode std_mean var_mean".split()},
    "prod": lambda f, x, d, m: f(x, d, keepdim=True),
    "all": lambda f, x, d, m: f(x > 0.3, **_keep(d)),
    "any": lambda f, x, d, m: f(x > 0.7, **_keep(d)),
    "argmax": lambda f, x, d, m: f(x, **_keep(d)),
    "argmin": lambda f, x, d, m: f(x, **_keep(d)),
    "aminmax": lambda f, x, d, m: f(x, **_keep(d)),
    "count_nonzero": lambda f, x, d, m: f(x > 0.5, dim=d).unsqueeze(d),
    "quantile": lambda f, x, d, m: f(x, 0.3, dim=d, keepdim=True),
    "nanquantile": lambda f, x, d, m: f(x, 0.3, dim=d, keepdim=True),
    "kthvalue": lambda f, x, d, m: f(x, 2, d, True),
    "topk": lambda f, x, d, m: f(x, 2, d),
    "norm": lambda f, x, d, m: f(x, 2, dim=d, keepdim=True),
    "vector_norm": lambda f, x, d, m: f(x, 2, dim=d, keepdim=True),
    "linalg_vector_norm": lambda f, x, d, m: f(x, 2, dim=d, keepdim=True),
    "linalg_norm": lambda f, x, d, m: f(x, dim=d, keepdim=True),
    # scans and sorts (shape kept)
    **{n: (lambda f, x, d, m: f(x, d)) for n in
       "cumsum cumprod cummax cummin logcumsumexp sort argsort softmax log_softmax softmin".split()},
    "normalize": lambda f, x, d, m: f(x, dim=d),
    "glu": lambda f, x, d, m: f(x, d),
    "cosine_similarity": lambda f, x, d, m: f(x, m.y, dim=d).unsqueeze(d),
    "diff": lambda f, x, d, m: f(x, dim=d),
    # joins, splits and selections along d
    "cat": lambda f, x, d, m: f([x, m.y], dim=d), "concat": lambda f, x, d, m: f([x, m.y], dim=d),
    "concatenate": lambda f, x, d, m: f([x, m.y], dim=d),
    "split": lambda f, x, d, m: f(x, 2, dim=d), "chunk": lambda f, x, d, m: f(x, 2, dim=d),
    "tensor_split": lambda f, x, d, m: f(x, 2, dim=d),
    "unbind": lambda f, x, d, m: f(x, dim=d)[0].unsqueeze(d),
    "narrow": lambda f, x, d, m: f(x, d, 1, 2),
    "select": lambda f, x, d, m: f(x, d, 1).unsqueeze(d),
    "index_select": lambda f, x, d, m: f(x, d, m.idx),
    "gather": lambda f, x, d, m: f(x, d, torch.zeros_like(x, dtype=torch.long)),
    "take_along_dim": lambda f, x, d, m: f(x, torch.zeros_like(x, dtype=torch.long), dim=d),
    "__getitem__": lambda f, x, d, m: f(x, _index(d, slice(1, None))),
    "__setitem__": _setitem,
    "__iter__": _iter,
    "flip": lambda f, x, d, m: f(x, [d]),
    "fliplr": lambda f, x, d, m: f(x.movedim(d, 1)).movedim(1, d),
    "flipud": lambda f, x, d, m: f(x.movedim(d, 0)).movedim(0, d),
    "roll": lambda f, x, d, m: f(x, 1, d),
    "repeat": lambda f, x, d, m: f(x, *[2 if k == d else 1 for k in range(4)]),
    "tile": lambda f, x, d, m: f(x, [2 if k == d else 1 for k in range(4)]),
    "repeat_interleave": lambda f, x, d, m: f(x, 2, dim=d),
    "where": lambda f, x, d, m: f(x > 0.5) if m.sharded else f(x > 0.5, x, m.y),
    # windows: a kernel of 3 along d (1 along a dim they do not act on)
    "pad": lambda f, x, d, m: f(x, _pad(d)),
    "constant_pad_nd": lambda f, x, d, m: f(x, _pad(d)),
    "conv2d": _conv, "conv3d": _conv3d, "conv1d": _conv1d, "conv_transpose2d": _conv_t,
    "conv_transpose3d": _conv_t3d,
    "max_pool2d": _pool, "avg_pool2d": _pool, "max_pool2d_with_indices": _pool,
    "lp_pool2d": lambda f, x, d, m: f(x, 2, _at(d, 2), 1),
    "max_pool3d": _pool3d, "avg_pool3d": _pool3d, "max_pool3d_with_indices": _pool3d,
    "adaptive_avg_pool2d": lambda f, x, d, m: f(x, tuple(2 if k == d else x.shape[k] for k in (2, 3))),
    "adaptive_max_pool2d": lambda f, x, d, m: f(x, tuple(2 if k == d else x.shape[k] for k in (2, 3))),
    "adaptive_avg_pool1d": _adaptive1d,
    "pixel_shuffle": lambda f, x, d, m: f(x, 2), "pixel_unshuffle": lambda f, x, d, m: f(x, 2),
    "unfold": lambda f, x, d, m: f(x, 1).view(x.shape),
    "fold": lambda f, x, d, m: f(x.flatten(2), tuple(x.shape[2:]), 1),
    "grid_sample": lambda f, x, d, m: f(x, m.grid, align_corners=False),
    "interpolate": _interp, "upsample": _interp, "upsample_bilinear": _interp, "upsample_nearest": _interp,
    # contractions and attention along d
    "linear": lambda f, x, d, m: f(x.movedim(d, -1), m.mat[str(d)]).movedim(-1, d),
    "matmul": _matmul, "__matmul__": _matmul, "__rmatmul__": _rmatmul, "bmm": _bmm, "baddbmm": _baddbmm,
    "einsum": _einsum,
    "scaled_dot_product_attention": _sdpa,
    # norms
    "layer_norm": _layer_norm, "rms_norm": _layer_norm,
    "group_norm": lambda f, x, d, m: f(x, 2),
    "instance_norm": lambda f, x, d, m: f(x),
    "batch_norm": lambda f, x, d, m: f(x, None, None, training=True),
    # Fourier transforms along d
    **{n: (lambda f, x, d, m: f(x, dim=d)) for n in
       "fft_fft fft_ifft fft_rfft fft_irfft fft_hfft fft_ihfft fft fft ifft rfft irfft hfft ihfft fftshift "
       "ifftshift".split()},
    **{n: (lambda f, x, d, m: f(x, dim=(_other(d), d))) for n in
       "fft2 ifft2 rfft2 irfft2 hfft2 ihfft2 fftn ifftn rfftn irfftn hfftn ihfftn".split()},
    # layout ops: the field moved, a reduction over where dim d went (the guard must follow it), moved back
    "permute": lambda f, x, d, m: f(x, _swap(d)).sum(_other(d), keepdim=True).permute(_swap(d)),
    **{n: (lambda f, x, d, m: f(x, d, _other(d)).sum(_other(d), keepdim=True).transpose(d, _other(d)))
       for n in "transpose swapaxes swapdims".split()},
    "movedim": lambda f, x, d, m: f(x, d, _other(d)).sum(_other(d), keepdim=True).movedim(_other(d), d),
    "mT": lambda f, x, d, m: f(x).sum(5 - d if d > 1 else d, keepdim=True).mT,
    "unsqueeze": lambda f, x, d, m: f(x, 0).sum(d + 1, keepdim=True).squeeze(0),
    "squeeze": lambda f, x, d, m: f(x.unsqueeze(0), 0).sum(d, keepdim=True),
    "flatten": _flatten, "reshape": _view, "view": _view,
    "unflatten": lambda f, x, d, m: f(x, d, (x.shape[d], 1)).sum(d, keepdim=True).squeeze(d + 1),
    "view_as": lambda f, x, d, m: f(x, m.y).sum(d, keepdim=True),
    "reshape_as": lambda f, x, d, m: f(x, m.y).sum(d, keepdim=True),
    "stack": lambda f, x, d, m: f([x, m.y], 0).sum(d + 1, keepdim=True).sum(0),
}
#: the op a refusal names where torch's own code calls it for the entry (x @ m is Tensor.matmul, iteration unbinds)
#: and F.upsample* have no torch-function dispatch of their own: the guard sees the F.interpolate they call
ALSO = {"__matmul__": ("Tensor.matmul",), "__rmatmul__": ("Tensor.matmul",), "__iter__": ("Tensor.unbind",),
        "upsample": ("interpolate",), "upsample_bilinear": ("interpolate",), "upsample_nearest": ("interpolate",)}
LAYOUT_OPS = set("permute transpose swapaxes swapdims movedim mT unsqueeze squeeze flatten reshape view unflatten "
                 "view_as reshape_as stack".split())


def _swap(d):
    order = [0, 1, 2, 3]
    o = _other(d)
    order[d], order[o] = o, d
    return order


DROPOUTS = set("dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout feature_dropout".split())


# -- pointwise (and metadata) ops: the first call form that the whole field takes -------------------------------------

def _hook(g):
    return g


#: call forms tried in order on the unsharded field (z: a field, y: a second one, zi / zb: integer / bool fields)
FORMS = (
    lambda f, z, y, zi, zb, m: f(z),
    lambda f, z, y, zi, zb, m: f(z, y),
    lambda f, z, y, zi, zb, m: f(z, 0.5),
    lambda f, z, y, zi, zb, m: f(z, y, y),
    lambda f, z, y, zi, zb, m: f(z, y, 0.5),
    lambda f, z, y, zi, zb, m: f(z, 0.5, 0.0),
    lambda f, z, y, zi, zb, m: f(zi),
    lambda f, z, y, zi, zb, m: f(zi, zi + 3),
    lambda f, z, y, zi, zb, m: f(zi, 2),
    lambda f, z, y, zi, zb, m: f(zb, y > 0.5),
    lambda f, z, y, zi, zb, m: f(zb),
    lambda f, z, y, zi, zb, m: f(1, z),
    lambda f, z, y, zi, zb, m: f(z + 2, 1),
    lambda f, z, y, zi, zb, m: f(z, zb, 0.0),
    lambda f, z, y, zi, zb, m: f(z, zi),
    lambda f, z, y, zi, zb, m: f(z, m.prelu),
    lambda f, z, y, zi, zb, m: f(z, torch.float32),
    lambda f, z, y, zi, zb, m: f(z, {}),
    lambda f, z, y, zi, zb, m: f(z, tuple(z.shape)),
    lambda f, z, y, zi, zb, m: f(z, 2),
    lambda f, z, y, zi, zb, m: f(z, ""),
    lambda f, z, y, zi, zb, m: f(z, [1.0]),
    lambda f, z, y, zi, zb, m: f(z, tuple(z.shape), 0.5),
    lambda f, z, y, zi, zb, m: f(z, _hook),
    lambda f, z, y, zi, zb, m: f(torch.complex(z, y)),
)
#: pointwise entries torch itself refuses for the whole field too (a CPU build, a field of many elements)
RAISES = set("cuda pin_memory item __bool__ __float__ __int__ __index__ __setstate__ multinomial".split())


class Case(nn.Module):
    """Entries' calls in a model's own forward, one output each: ``items`` of ``(key, d, form, sharded)``, ``d``
    the dim the call acts along (``None``: a pointwise form, ``form`` its index in FORMS)."""

    def __init__(self, items: list[tuple]) -> None:
        super().__init__()
        self.items = items
        g = torch.Generator().manual_seed(5)

        def p(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1] * 3))

        self.k3 = {"1": p(C, C, 1, 1), "2": p(C, C, 3, 1), "3": p(C, C, 1, 3)}  # (registered below)
        self.k1 = {"1": p(C, C, 1), "2": p(C, C, 3), "3": p(C, C, 3)}
        self.mat = {str(k): p(n, n) for k, n in SIZE.items()}
        for name in ("k3", "k1", "mat"):
            for k, v in getattr(self, name).items():
                setattr(self, f"{name}_{k}", v)
        self.grid = nn.Parameter(torch.rand(B, 2, 3, 2, generator=g, dtype=torch.float64) * 2 - 1)
        self.prelu = nn.Parameter(torch.tensor([0.25], dtype=torch.float64))
        self.register_buffer("idx", torch.tensor([0, 1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.y = torch.tanh(x) + 0.5  # a second field
        return tuple(self.one(x, *item) for item in self.items)

    def one(self, x: torch.Tensor, key: str, d: int | None, form: int | None, sharded: bool) -> torch.Tensor:
        f, base = entries()[key]
        self.sharded = sharded
        if d is None:  # (form < 0: ~form, on a detached field: an op with no derivative)
            z, y = (x * 1.0, self.y) if form >= 0 else (x.detach() * 1.0, self.y.detach())
            r = FORMS[form if form >= 0 else ~form](f, z, y, (x * 10).long(), x > 0.5, self)
        elif base in DROPOUTS:
            r = f(x, 0.5, sharded)  # drawn in training (refused); evaluated, the identity
        else:
            r = CASES[base](f, x, d, self)
        r = _first(r)
        if base in ("empty_like", "new_empty") and isinstance(r, torch.Tensor):
            r = r.zero_()  # (uninitialised memory)
        if not isinstance(r, torch.Tensor) or d is None and r.dim() != x.dim():
            return x * 1.0  # (metadata: the call is the case)
        if r.is_complex():
            r = r.abs()
        if r.dtype != x.dtype:
            r = r.to(x.dtype)
        if r.dim() == x.dim() and all(a in (1, b) for a, b in zip(r.shape, x.shape, strict=True)):
            r = r + x  # a keepdim result (whole on every rank where it is exact) broadcast over the field
        return r


def _grads(ys: tuple, x: torch.Tensor) -> list:
    """Each output's input gradient (of ``(y * y).sum()``: the ranks' sum is the unsharded loss)."""
    out = []
    for y in ys:
        g = torch.autograd.grad((y * y).sum(), x, retain_graph=True, allow_unused=True)[0] \
            if y.requires_grad else None
        out.append(g)
    return out


def _form(key: str) -> int | None:
    """The first call form the whole field takes, forward and backward (``~form``: forward only; ``None``: none)."""
    x = _field().requires_grad_(True)
    for i in (*range(len(FORMS)), *(~i for i in range(len(FORMS)))):
        try:
            _grads(Case([(key, None, i, False)])(x), x)
        except Exception:  # noqa: BLE001 - the next form
            continue
        return i
    return None


def _field() -> torch.Tensor:
    return torch.rand(B, C, H, W, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.8 + 0.1


def _pointwise(key: str) -> bool:
    f, base = entries()[key]
    p = POLICY[f]
    return p.kind == "pass" or (base not in CASES and base not in DROPOUTS)


@functools.cache
def plan(dims: tuple[int, ...]) -> list[tuple[str, int | None, int | None, bool]]:
    """Every ``(key, d, form, d sharded)`` to run: pointwise entries once, the others along each of ``dims``."""
    cases = []
    for key in entries():
        if _pointwise(key):
            form = _form(key)
            cases.append((key, None, 0 if form is None else form, True))
        else:
            cases.extend((key, d, None, d != dims[-1]) for d in dims)
    return cases


def _jobs(cases: list) -> list[list]:
    """Pointwise cases and those along a dim that is not sharded in batches (one model, one guarded call each: a
    batch that raises runs case by case), the others one by one."""
    def batched(c):  # (along a dim that is not sharded, the calls mostly run: batched too)
        f, base = entries()[c[0]]
        return (POLICY[f].kind == "pass" or not c[3]) and base not in RAISES

    single = [[c] for c in cases if not batched(c)]
    pointwise = [c for c in cases if batched(c)]
    return single + [pointwise[i:i + BATCH] for i in range(0, len(pointwise), BATCH)]


BATCH = 40


# -- the ranks ---------------------------------------------------------------------------------------------------------

def _on_ranks(rank: int, world: int, shape: tuple[int, ...], cases: list) -> dict:
    import halo
    from halo.dist.mesh import DomainMesh
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE
    from halo.plan.partition import local_range

    halo.set_timeout(10)
    mesh = DomainMesh(shape)
    cuts = [local_range(n, mesh.axis_size(a), mesh.axis_rank(a)) for a, n in enumerate((H, W)[:len(shape)])]
    full = _field()
    entries()
    out = {}

    def run(items):
        torch.manual_seed(0)
        model = convert_to_domain_parallel(Case(items), mesh, custom_converters={Case: INSIDE})
        x = full[..., cuts[0][0]:cuts[0][1], :]
        if len(cuts) > 1:
            x = x[..., cuts[1][0]:cuts[1][1]]
        x = x.clone().requires_grad_(True)
        try:
            ys = model(x)
            for item, y, g in zip(items, ys, _grads(ys, x), strict=True):
                out[item[:2]] = ("ran", y.detach(), g)
        except ValueError as exc:
            if len(items) > 1:
                return False
            out[items[0][:2]] = ("refused", str(exc))
        except Exception as exc:  # noqa: BLE001 - torch's own error (judged against the unsharded model)
            if len(items) > 1:
                return False
            out[items[0][:2]] = ("raised", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return True

    for job in _jobs(cases):
        if not run(job):
            for item in job:
                run([item])
    return out


def _assemble(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The ranks' blocks (rank order, W fastest) as one tensor: along H (dim 2), and W (dim 3) on a mesh."""
    if len(shape) == 1:
        return torch.cat(parts, 2)
    rows = [torch.cat(parts[i * shape[1]:(i + 1) * shape[1]], 3) for i in range(shape[0])]
    return torch.cat(rows, 2)


@functools.cache
def _reference(key: str, d: int | None, form: int | None, sharded: bool) -> tuple:
    torch.manual_seed(0)
    model = Case([(key, d, form, sharded)])
    x = _field().requires_grad_(True)
    try:
        (y,) = model(x)
        (g,) = _grads((y,), x)
    except Exception as exc:  # noqa: BLE001
        return ("raised", f"{type(exc).__name__}: {exc}")
    return ("ran", y.detach(), g)


def judge(results: list[dict], shape: tuple[int, ...], cases: list) -> dict:
    """``(key, d) -> (verdict, detail)``: verdict ``ran`` / ``refused`` / ``raises alike`` (right), or ``DIFFERS``,
    ``SPLIT`` (ranks disagree), ``ERROR`` (a wrong error, or none where torch raises)."""
    verdicts = {}
    for key, d, form, sharded in cases:
        f, base = entries()[key]
        got = [r[(key, d)] for r in results]
        kinds = {g[0] for g in got}
        ref = _reference(key, d, form, sharded)
        if kinds == {"ran"}:
            if ref[0] != "ran":
                verdicts[(key, d)] = ("ERROR", f"ran where the unsharded model raises: {ref[1]}")
                continue
            try:
                y = _assemble([g[1] for g in got], shape)
                gx = None if got[0][2] is None else _assemble([g[2] for g in got], shape)
            except (RuntimeError, IndexError) as exc:
                verdicts[(key, d)] = ("DIFFERS", f"blocks {[tuple(g[1].shape) for g in got]} do not assemble: {exc}")
                continue
            if y.shape != ref[1].shape:
                verdicts[(key, d)] = ("DIFFERS", f"shape {tuple(y.shape)} != {tuple(ref[1].shape)}")
                continue
            err = (y - ref[1]).nan_to_num().abs().max().item()
            ok = torch.allclose(y, ref[1], **TOL)
            if ok and (gx is None) != (ref[2] is None):
                ok, err = False, math.inf
            if ok and gx is not None:
                err = max(err, (gx - ref[2]).nan_to_num().abs().max().item())
                ok = torch.allclose(gx, ref[2], **TOL)
            verdicts[(key, d)] = ("ran", err) if ok else ("DIFFERS", f"max error {err:.3g}")
        elif ref[0] == "raised" and kinds <= {"raised", "refused"} and len({g[1] for g in got}) == 1:
            verdicts[(key, d)] = ("raises alike", got[0][1])
        elif kinds == {"refused"}:
            texts = {g[1] for g in got}
            names = (op_name(f), *ALSO.get(base, ()), *(("Tensor.sum",) if base in LAYOUT_OPS else ()))
            if len(texts) > 1:
                verdicts[(key, d)] = ("SPLIT", f"different messages: {sorted(texts)}")
            elif not any(next(iter(texts)).startswith(n + " ") for n in names):
                verdicts[(key, d)] = ("ERROR", f"refused, not naming {names}: {next(iter(texts))[:300]}")
            else:
                verdicts[(key, d)] = ("refused", next(iter(texts)))
        elif kinds == {"raised"} and ref[0] == "raised":
            verdicts[(key, d)] = ("raises alike", got[0][1])
        else:
            verdicts[(key, d)] = ("SPLIT" if len(kinds) > 1 else "ERROR",
                                  f"ranks: {[g[0] + (': ' + g[1][:200] if g[0] != 'ran' else '') for g in got]}; "
                                  f"unsharded: {ref[0]}")
    return verdicts


SHAPES = {"rows": ((3,), (2, 3)), "mesh": ((2, 2), (2, 3, 1))}  # mesh shape, the dims acted along (last: not sharded)
_RESULTS: dict = {}


def _verdicts(which: str) -> dict:
    """Both pools' verdicts, from one run of each, the two at once (their ranks mostly wait on each other)."""
    if not _RESULTS:
        from concurrent.futures import ThreadPoolExecutor

        def pool(name):
            shape, dims = SHAPES[name]
            return run_on_ranks(_on_ranks, math.prod(shape), shape, plan(dims), timeout=120)

        for name in SHAPES:  # (the plans first: their forms are probed in this process)
            plan(SHAPES[name][1])
        with ThreadPoolExecutor(len(SHAPES)) as ex:  # (the unsharded references computed meanwhile)
            futures = {name: ex.submit(pool, name) for name in SHAPES}
            for name in SHAPES:
                for case in plan(SHAPES[name][1]):
                    _reference(*case)
            runs = {name: f.result() for name, f in futures.items()}
        for name, results in runs.items():
            _RESULTS[name] = judge(results, SHAPES[name][0], plan(SHAPES[name][1]))
    return _RESULTS[which]


def test_every_entry_has_a_case():
    """Every entry of POLICY (from the table itself) has a case: a call along a dim, a dropout, or a pointwise
    form the whole field takes (or torch refuses it for the whole field too: RAISES)."""
    missing = []
    for key, (_, base) in entries().items():
        if _pointwise(key):
            if _form(key) is None and base not in RAISES:
                missing.append(key)
    assert not missing, f"entries of POLICY without a case: {missing}"
    assert len(entries()) == len(POLICY)


@pytest.mark.parametrize("which", list(SHAPES))
def test_every_entry_is_exact_or_refused_on_every_rank(which):
    verdicts = _verdicts(which)
    bad = {k: v for k, v in verdicts.items() if v[0] not in ("ran", "refused", "raises alike")}
    assert not bad, "\n".join(f"{k}: {v[0]} {v[1]}" for k, v in sorted(bad.items(), key=str))


#: entries refused along every dim: they act on H and W whatever their arguments (a norm over H x W, windows over
#: both, pixel shuffles); on the mesh, attention over channel tokens contracts W (the features)
ALWAYS = set("batch_norm group_norm instance_norm fold unfold grid_sample pixel_shuffle pixel_unshuffle".split())
ALWAYS_ON_MESH = ALWAYS | {"scaled_dot_product_attention"}


@pytest.mark.parametrize("which", list(SHAPES))
def test_along_a_dim_that_is_not_sharded_nothing_is_refused(which):
    """An op along a dim no rank shards (W on rows, channels on the mesh) computes what the unsharded model does:
    a refusal there is a rule that reads the wrong argument (lp_pool2d's norm type for its window)."""
    verdicts = _verdicts(which)
    free = SHAPES[which][1][-1]
    always = ALWAYS if which == "rows" else ALWAYS_ON_MESH
    refused = [f"{k[0]}: {v[1][:200]}" for k, v in sorted(verdicts.items(), key=str)
               if k[1] == free and v[0] == "refused" and entries()[k[0]][1] not in always]
    assert not refused, "\n".join(refused)


def test_h_and_w_get_the_same_verdict_on_the_mesh():
    """One rule per Axis: on the mesh, an op along H (dim 2) and along W (dim 3) is refused on both or neither."""
    verdicts = _verdicts("mesh")
    odd = []
    for key in entries():
        a, b = verdicts.get((key, 2)), verdicts.get((key, 3))
        if a is None or b is None:
            continue
        if (a[0] == "refused") != (b[0] == "refused"):
            odd.append(f"{key}: H {a[0]}, W {b[0]}")
    assert not odd, "\n".join(odd)
