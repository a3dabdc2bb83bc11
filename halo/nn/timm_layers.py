"""halo forms of timm's layers, recognised by class name and attributes (timm is not imported here).

``convert_to_domain_parallel`` asks :func:`timm_adapter` about every module it does not know. What it recognises,
and why each is exact on an H-shard:

- **pointwise, kept as they are**: timm's activation classes (``timm.layers.activations*``: ``Swish``, ``GELU``,
  ``HardSigmoid``, ``PReLU``, ...) and its ``Linear`` (``nn.Linear`` with a forward of its own for torchscript);
  norms over channels only (``LayerNorm2d``, ``LayerNorm`` on channels-last,
  ``RmsNorm``/``RmsNorm2d``, their ``Fp32`` forms, and subclasses that keep their forward, such as metaformer's
  ``LayerNorm2dNoBias``: one grid point's channels, nothing across rows); per-channel layer scale (``LayerScale``,
  ``LayerScale2d``: ``x * gamma``).
- **learned per-channel scales and biases, by what they hold** (:func:`_scaled`): a timm module whose own state is
  per-channel or scalar Parameters only (``(C,)``, ``(C, 1, 1)``, ``(1,)``) and whose code reads no tensor shape —
  ``metaformer.Scale``, ``StarReLU``, InceptionNeXt's ``MetaNeXtBlock`` (its ``gamma``), fastvit's and
  swiftformer's ``LayerScale2d``, ... — is kept, its children converted; its own forward runs under the guard on the
  first call, which refuses any op on a field it does not know to be pointwise in latitude.
- **composites kept, their children converted**: ``LayerNormAct2d``/``LayerNormAct`` (a channel norm, then its
  ``drop`` and ``act`` children) and ``ConvNeXtBlock`` with its layer-scale ``gamma`` (its depthwise 7x7 conv
  becomes a ``DomainConv2d``; its own math — permutes, the channel MLP, ``x * gamma``, the residual — is pointwise).
- **ConvNeXt V2's ``GlobalResponseNorm``**: its ``x.norm`` over H x W is a sum of squares over the domain:
  :class:`DomainGlobalResponseNorm` (an all-reduce of each rank's sums; NHWC and NCHW).
- **group norms** (``GroupNorm``, ``GroupNorm1``, and ``GroupNorm1NoBias``: ``F.group_norm`` as ``nn.GroupNorm``):
  halo's ``DomainGroupNorm``;
  ``GroupNormAct``/``GroupNorm1Act``: the same, then its ``drop`` and ``act`` children (converted).
- **TF "same" padding** (``Conv2dSame``): the padding depends only on the global extent, so
  :class:`DomainConv2dSame` computes it from the global rows (agreed once per shape) and pads the global field
  (``halo.nn.halo_pad``) before a ``DomainConv2d`` without padding; W is whole on every rank and padded locally.
- **BlurPool2d**: a fixed binomial depthwise conv with reflect padding: :class:`DomainBlurPool2d` runs it as a
  ``DomainConv2d`` with reflect boundary (the filter stays a non-persistent buffer: the checkpoint is unchanged).
- **global pools and what computes on their result** (whole and the same on every rank, halo's global pools):
  ``SelectAdaptivePool2d`` (avg, max, avgmax, catavgmax; timm's fast pools too) and squeeze-excitation
  (``SqueezeExcite`` of timm's EfficientNet/MobileNet blocks, ``SEModule``): their means become halo's global pool;
  classifier heads (``ClassifierHead``, ``NormMlpClassifierHead``, InceptionNeXt's ``MlpClassifierHead``, MetaFormer's
  ``nn.Sequential`` head that starts with its pool) keep their layers after the pool as torch's own
  on the whole tensor (their ``nn.Dropout``: :class:`WholeDropout`, which draws the unsharded model's mask on every
  rank; any other random layer there is refused), and a model's
  ``flatten`` right after its global pool (MobileNetV3) flattens the whole result (it raises if given a field);
  RepViT's head ``NormLinear`` keeps its ``BatchNorm1d`` for the model's whole mean (:class:`WholeBatchNorm1d`).
- **MaxViT's block and grid partition attention** (``timm.models.maxxvit``): :mod:`halo.nn.maxvit`, asked last.

Anything else timm has is left to the converter's usual rules (refused with a hint when halo cannot know it).
On a latitude x longitude mesh every layer recognised here is refused (no 2-d form yet).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..dist.mesh import group_attribute
from ..parallel.reduce import accumulation_dtype, all_reduce
from ..plan.plans import Site, mark_whole, resolve, whole_source
from .base import AxisPlan, DomainLayer
from .conv import DomainConv2d
from .maxvit import maxvit_adapter  # MaxViT's block and grid partition attention
from .norm import DomainGroupNorm
from .pad import halo_pad
from .pool import DomainAdaptiveAvgPool2d, DomainAdaptiveMaxPool2d
from .registry import public

__all__ = ["DomainBlurPool2d", "DomainFlatten", "DomainGlobalResponseNorm", "DomainGroupNormAct",
           "DomainSelectAdaptivePool2d",
           "DomainSqueezeExcite", "DomainConv2dSame", "WholeBatchNorm1d", "WholeDropout", "timm_adapter"]

_ORIGINAL = "_halo_original"  # as halo.nn.convert: the module a replacement stands for (the walk skips it)

_ACTIVATION_MODULES = ("timm.layers.activations", "timm.layers.activations_me")
_CHANNEL_NORMS = ("LayerNorm2d", "LayerNorm2dFp32", "LayerNorm", "LayerNormFp32", "RmsNorm", "RmsNorm2d",
                  "RmsNormFp32", "RmsNorm2dFp32", "SimpleNorm", "SimpleNorm2d", "SimpleNormFp32", "SimpleNorm2dFp32")
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _timm(kind: type) -> bool:
    return kind.__module__.startswith("timm.")


def _twin(m: nn.Module) -> nn.Module:
    """A second instance of ``m``'s class sharing its Parameters and buffers (same objects) with its own containers:
    children set on the twin leave ``m`` as it was (``revert_domain_parallel`` puts ``m`` back)."""
    t = object.__new__(type(m))
    for key, value in m.__dict__.items():
        t.__dict__[key] = copy.copy(value) if isinstance(value, dict | set | list) else value
    return t


def _kept(m: nn.Module) -> nn.Module:
    """``m`` kept as torch's own on a whole tensor: a twin the converter's walk skips (marked as a replacement)."""
    t = _twin(m)
    object.__setattr__(t, _ORIGINAL, m)
    return t


def _own_state(m: nn.Module) -> list[str]:
    return [n for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None]


def _refuse_random(m: nn.Module, path: str) -> None:
    for name, sub in m.named_modules():
        p = getattr(sub, "p", getattr(sub, "drop_prob", 0.0))
        if (isinstance(sub, _RANDOM) or type(sub).__name__ in ("DropPath", "StochasticDepth")) and p:
            raise ValueError(
                f"{path}{'.' + name if name else ''} ({type(sub).__name__}, p={p}) draws on the result of a global "
                f"pool, which is whole on every rank: halo draws the unsharded model's mask there only for an "
                f"nn.Dropout that is the head's own child (not a channel or alpha dropout, a drop-path, or a dropout "
                f"nested in another layer), and torch's would differ per rank; set its rate to 0 or gather before "
                f"the head")


# -- pointwise ------------------------------------------------------------------------------------------------------

def _keep(m: nn.Module, ctx: Any) -> nn.Module:
    return m


def _channel_norm(m: nn.Module) -> bool:
    shape = getattr(m, "normalized_shape", None)
    if shape is None:
        shape = getattr(m, "dim", None)
        shape = (shape,) if isinstance(shape, int) else shape
    return shape is not None and len(tuple(shape)) == 1 and not m._modules


def _layer_scale(m: nn.Module) -> bool:
    gamma = m._parameters.get("gamma")
    return (set(_own_state(m)) == {"gamma"} and not m._modules and gamma is not None
            and all(s == 1 for s in gamma.shape[1:]))


_SHAPE_READ = re.compile(r"(?<!self)\.shape\b|\.size\(|\bsize\(|\blen\(")


def _reads_shape(kind: type) -> bool:
    """Whether the code of a timm class (and of its timm bases) reads a tensor's shape (``x.shape``, ``x.size()``,
    ``len(x)``; not the module's own ``self.shape``) or cannot be read: what it builds from a shard's extent (a
    grid, a size) is made of plain ints no guard sees."""
    for cls in kind.__mro__:
        if not _timm(cls):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            return True
        if any(_SHAPE_READ.search(line.split("#")[0]) for line in source.splitlines()):
            return True
    return False


def _per_channel(t: torch.Tensor) -> bool:
    """A vector over one dim, the first (``(C,)``, ``(C, 1, 1)``), or a scalar: it cannot hold anything per row."""
    return t.dim() >= 1 and all(s == 1 for s in t.shape[1:])


def _scaled(m: nn.Module) -> bool:
    """A timm module whose own state is per-channel (or scalar) Parameters only and whose code reads no shape: a
    learned scale or bias, by what it holds, not by its name (``LayerScale``, ``metaformer.Scale``, ``StarReLU``,
    fastvit's and swiftformer's ``LayerScale2d``, the ``gamma`` of InceptionNeXt's ``MetaNeXtBlock``, RDNet's and
    EdgeNeXt's blocks, ...). Kept (its children converted): its forward runs under the guard on the first call,
    which refuses any op on a field it does not know to be pointwise in latitude, so a scale that is used
    otherwise (a conv weight, a reduction) is refused there, naming the line."""
    own = _own_state(m)
    return (bool(own) and not m._buffers and all(_per_channel(m._parameters[n]) for n in own)
            and not _reads_shape(type(m)))


# -- TF "same" padding ----------------------------------------------------------------------------------------------

def _same_pad(size: int, k: int, s: int, d: int) -> tuple[int, int]:
    """timm's ``get_same_padding`` of a global extent, split as ``pad_same`` splits it (the extra row after)."""
    total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def _plain_conv(conv: nn.Conv2d) -> nn.Conv2d:
    """An ``nn.Conv2d`` sharing ``conv``'s Parameters (a ``Conv2dSame`` is a Conv2d with a forward of its own)."""
    plain = object.__new__(nn.Conv2d)
    for key, value in conv.__dict__.items():
        plain.__dict__[key] = copy.copy(value) if isinstance(value, dict | set | list) else value
    return plain


@public
class DomainConv2dSame(DomainLayer, nn.Module):
    """timm's ``Conv2dSame`` (TF "same": ``pad_same`` of the input, then an unpadded conv) on an H-shard.

    The H padding follows from the global rows (every rank's extent, agreed once per shape), and is applied to the
    global field (``halo_pad``: the output is the balanced split of the padded field) before a ``DomainConv2d`` without
    padding; the W padding follows from W (whole on every rank). State: the conv's ``weight`` and ``bias``.
    """

    def __init__(self, conv: nn.Conv2d, *, group: Any | None = None, mesh: Any | None = None) -> None:
        super().__init__()
        if not isinstance(conv, nn.Conv2d) or conv.padding not in (0, (0, 0)) or conv.padding_mode != "zeros":
            raise TypeError(f"DomainConv2dSame wraps timm's Conv2dSame (an nn.Conv2d with padding 0), got {conv!r}")
        inner = DomainConv2d(_plain_conv(conv), group=group, mesh=mesh)
        self.__dict__["_conv"] = inner  # not a child: its Parameters are this module's own (same state_dict keys)
        self._parameters["weight"] = conv.weight
        if conv.bias is not None:
            self._parameters["bias"] = conv.bias
        else:
            self.bias = None
        self.halo_init(group, mesh)  # the group (by reference: a deep copy shares it), halo's own to the converter
        self.kernel_size, self.stride, self.dilation = conv.kernel_size, conv.stride, conv.dilation
        self._pad_site = Site()

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, TF 'same'"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        geometry = tuple(zip(self.kernel_size, self.stride, self.dilation, strict=True))
        plans = self.axis_plans(x, "DomainConv2dSame", _same_axis, per_axis=geometry)
        # Per axis (H, W) from its global extent; an axis not sharded (W on latitude rows) from the local one.
        pads = [(p.before, p.after) for p in plans] + [_same_pad(x.shape[-1], *geometry[1])] * (2 - len(plans))
        (top, bottom), (left, right) = pads
        if top or bottom or left or right:
            x = halo_pad(x, (left, right, top, bottom), "zeros", group=self.group, site=self._pad_site,
                         op="DomainConv2dSame", mesh=self.halo_mesh)
        conv = self._conv
        conv._parameters["weight"] = self.weight  # the module's own (after .to(), .double(), load_state_dict)
        conv._parameters["bias"] = self.bias
        return conv(x)


@dataclasses.dataclass(frozen=True)
class SamePlan(AxisPlan):
    """TF "same" padding along one axis, from the axis's global extent (nothing exchanged: the pad exchanges)."""

    before: int = 0
    after: int = 0


def _same_axis(cg: Any, sizes: tuple[int, ...], dim: int, kernel: int, stride: int, dilation: int) -> SamePlan:
    before, after = _same_pad(sum(sizes), kernel, stride, dilation)
    return SamePlan(True, dim=dim, before=before, after=after)


def _conv_same(m: nn.Module, ctx: Any) -> nn.Module:
    if ctx.boundary not in (None, "zeros"):  # TF "same" pads with zeros; another boundary would change the rows
        raise ValueError(f"{type(m).__module__}.{type(m).__name__} (TF 'same' padding) pads latitude with zeros; "
                         f"halo has no form of it with boundary={ctx.boundary!r}: give custom_converters="
                         f"{{Conv2dSame: fn}} or convert without boundary=")
    return DomainConv2dSame(m, group=ctx.group, mesh=ctx.mesh)


# -- group norms ----------------------------------------------------------------------------------------------------

def _group_norm(m: nn.Module, ctx: Any) -> nn.Module:
    if not m._modules:
        return DomainGroupNorm(m, group=ctx.group, mesh=ctx.mesh)
    return DomainGroupNormAct(m, group=ctx.group, mesh=ctx.mesh)


class DomainGroupNormAct(DomainGroupNorm):
    """timm's ``GroupNormAct`` (a group norm over channels and H x W, then its ``drop`` and ``act``): the norm over the
    whole domain (``DomainGroupNorm``), then its children (converted: a dropout draws by global index)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


# -- GlobalResponseNorm (ConvNeXt V2) ------------------------------------------------------------------------------

def _extents(cg: Any, extents: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Every rank's rows (the agreement checks that the other dims are alike before the all-reduce)."""
    return tuple(extents[0])


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of torch's ``x.norm()``: float32 for a half input under CUDA autocast (``norm`` is on its float32
    list), else ``x``'s (CPU autocast keeps bf16)."""
    half = x.dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if half and x.device.type == "cuda" and torch.is_autocast_enabled("cuda") else x.dtype


@public
class DomainGlobalResponseNorm(DomainLayer, nn.Module):
    """timm's ``GlobalResponseNorm`` (ConvNeXt V2's GRN) on an H-shard, exactly.

    timm's ``x.norm(p=2, dim=(H, W))`` per sample and channel is the square root of a sum of squares over the whole
    domain: each rank sums the squares of its rows (in fp32 or wider), the sums are all-reduced over the domain group
    (the plain adjoint: every rank uses the result on its own rows, so each rank's gradient of it flows back to
    every rank), and the square root's gradient is 0 where the norm is 0 (as torch's norm). The rest of timm's
    forward — the mean over channels, ``x + bias + weight * x * x_n`` — is pointwise. Both of timm's layouts: NHWC
    (``channels_last=True``, spatial dims (1, 2): H is dim 1) and NCHW (spatial dims (2, 3)). State: timm's
    ``weight`` and ``bias`` (the same Parameters: the checkpoint is unchanged).
    """

    def __init__(self, grn: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self.eps = grn.eps
        self.spatial_dim, self.channel_dim, self.wb_shape = tuple(grn.spatial_dim), grn.channel_dim, grn.wb_shape
        if self.spatial_dim not in ((1, 2), (2, 3)):
            raise ValueError(f"DomainGlobalResponseNorm: spatial dims {self.spatial_dim}, expected timm's (1, 2) "
                             f"(NHWC) or (2, 3) (NCHW)")
        self._parameters["weight"] = grn.weight
        self._parameters["bias"] = grn.bias
        self.halo_init(group)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, {'NHWC' if self.spatial_dim == (1, 2) else 'NCHW'}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"DomainGlobalResponseNorm: expected a 4-d input (timm's GRN), got {tuple(x.shape)}")
        h = self.spatial_dim[0]
        resolve(x, self.group, "DomainGlobalResponseNorm", _extents, site=self._halo_site, spec=(h - x.dim(),))
        squares = x.to(accumulation_dtype(x.dtype)).square().sum(dim=self.spatial_dim, keepdim=True)
        squares = all_reduce(squares, "sum", self.domain_group)  # every rank's rows: the sum over the domain
        positive = squares > 0
        x_g = (torch.where(positive, squares, 1.0).sqrt() * positive).to(_norm_dtype(x))
        x_n = x_g / (x_g.mean(dim=self.channel_dim, keepdim=True) + self.eps)
        out = x + torch.addcmul(self.bias.view(self.wb_shape), self.weight.view(self.wb_shape), x * x_n)
        return self.finish(out, x)


# -- BlurPool2d -----------------------------------------------------------------------------------------------------

@public
class DomainBlurPool2d(DomainLayer, nn.Module):
    """timm's ``BlurPool2d`` (reflect padding, then a fixed depthwise binomial filter with a stride) on an H-shard:
    a ``DomainConv2d`` with reflect boundary whose weight is the filter (not a Parameter: no gradient, and the
    checkpoint is unchanged — ``filt`` stays a non-persistent buffer)."""

    def __init__(self, blur: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        pad = list(blur.padding)
        if len(set(pad)) != 1:
            raise ValueError(f"DomainBlurPool2d: padding {pad} is not the same on every side")
        self.channels, self.filt_size, self.stride, self.pad_mode = (blur.channels, blur.filt_size, blur.stride,
                                                                     blur.pad_mode)
        self.padding = blur.padding
        self.register_buffer("filt", blur.filt, persistent=False)
        self.halo_init(group)
        self.__dict__["_convs"] = {}

    def _conv(self, channels: int) -> nn.Module:
        key = (channels, self.filt.dtype, self.filt.device)
        conv = self._convs.get(key)
        if conv is None:
            plain = nn.Conv2d(channels, channels, self.filt_size, self.stride, self.padding[0], groups=channels,
                              bias=False, padding_mode=self.pad_mode, device=self.filt.device, dtype=self.filt.dtype)
            plain.weight.requires_grad_(False)
            conv = self._convs[key] = DomainConv2d(plain, group=self.group)
        weight = self.filt.expand(channels, 1, self.filt_size, self.filt_size)
        conv._parameters["weight"].data = weight
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv(x.shape[1] if self.channels is None else self.channels)(x)


# -- global pools, squeeze-excitation, heads ------------------------------------------------------------------------

_POOL_MODES = {"AdaptiveAvgPool2d": "avg", "AdaptiveMaxPool2d": "max", "AdaptiveAvgMaxPool2d": "avgmax",
               "AdaptiveCatAvgMaxPool2d": "catavgmax", "FastAdaptiveAvgPool": "avg", "FastAdaptiveMaxPool": "max",
               "FastAdaptiveAvgMaxPool": "avgmax", "FastAdaptiveCatAvgMaxPool": "catavgmax"}


class _GlobalPool(nn.Module):
    """A global average and/or max over H x W (halo's global pools: whole on every rank), combined as timm does."""

    def __init__(self, mode: str, flatten: bool, group: Any | None) -> None:
        super().__init__()
        self.mode, self.flat = mode, flatten
        if mode in ("avg", "avgmax", "catavgmax"):
            self.avg = DomainAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d(1), group=group)
        if mode in ("max", "avgmax", "catavgmax"):
            self.max = DomainAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d(1), group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "avg":
            y = self.avg(x)
        elif self.mode == "max":
            y = self.max(x)
        elif self.mode == "avgmax":
            y = 0.5 * self.avg(x) + 0.5 * self.max(x)
        else:
            y = torch.cat((self.avg(x), self.max(x)), 1)
        if self.flat:
            y = y.flatten(1)
        mark_whole(y, f"{type(self).__name__}({self.mode})")
        return y


@public
class DomainSelectAdaptivePool2d(nn.Module):
    """timm's ``SelectAdaptivePool2d`` (a global avg / max / avgmax / catavgmax pool, flattened or not) on an
    H-shard: the result is whole on every rank. No state (as timm's)."""

    _halo_check = "children"  # check_equivalence: its own output (its flatten is folded into its pool)

    def __init__(self, m: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self.pool_type = m.pool_type
        mode = _POOL_MODES[type(m.pool).__name__]
        flatten = isinstance(m.flatten, nn.Flatten) or bool(getattr(m.pool, "flatten", False))
        self.pool = _GlobalPool(mode, flatten, group)
        self.flatten = nn.Identity()

    def is_identity(self) -> bool:
        return False

    def feat_mult(self) -> int:
        return 2 if self.pool.mode == "catavgmax" else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)


def _select_pool(m: nn.Module) -> bool:
    pool, flatten = m._modules.get("pool"), m._modules.get("flatten")
    if pool is None or type(pool).__name__ not in _POOL_MODES or not isinstance(flatten, nn.Flatten | nn.Identity):
        return False
    if type(pool).__name__.startswith("Fast"):
        return tuple(getattr(pool, "dim", (2, 3))) in ((2, 3), (-2, -1))  # NCHW (NHWC: not recognised)
    size = getattr(pool, "output_size", 1)
    return size in (1, (1, 1))


@public
class DomainSqueezeExcite(nn.Module):
    """Squeeze-excitation of timm (``SqueezeExcite`` in EfficientNet/MobileNet blocks: ``conv_reduce``, ``act1``,
    ``conv_expand``, ``gate``; ``SEModule``: ``fc1``, ``bn``, ``act``, ``fc2``, ``gate``, optional max): the mean
    over H x W is halo's global pool (whole on every rank), the 1x1 convs and the gate run on that whole tensor,
    and the field is scaled pointwise. Same children, same ``state_dict``."""

    def __init__(self, m: nn.Module, *, group: Any | None = None) -> None:
        super().__init__()
        self.kind = type(m).__name__
        self.add_maxpool = bool(getattr(m, "add_maxpool", False))
        for name, child in m._modules.items():
            # torch's own on the whole (B, C, 1, 1) tensor (a BatchNorm there has the unsharded statistics)
            self._modules[name] = _kept(child) if isinstance(child, nn.modules.batchnorm._BatchNorm) else child
        self._modules["squeeze"] = _GlobalPool("avg", False, group)
        if self.add_maxpool:
            self._modules["squeeze_max"] = _GlobalPool("max", False, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.squeeze(x)
        if self.add_maxpool:
            s = 0.5 * s + 0.5 * self.squeeze_max(x)
        if "conv_reduce" in self._modules:
            s = self.conv_expand(self.act1(self.conv_reduce(s)))
        else:
            s = self.fc2(self.act(self.bn(self.fc1(s))))
        return x * self.gate(s)


def _squeeze_excite(m: nn.Module) -> bool:
    names = set(m._modules)
    if _own_state(m):
        return False
    if type(m).__name__ == "SqueezeExcite" and names == {"conv_reduce", "act1", "conv_expand", "gate"}:
        return True
    return type(m).__name__ in ("SEModule", "SqueezeExcite") and names == {"fc1", "bn", "act", "fc2", "gate"}


class WholeDropout(nn.Module):
    """The ``nn.Dropout`` of a recognised classifier head: every tensor after the head's global pool is whole and
    the same on every rank (the pool's result, then torch's own layers on it with the same Parameters on every rank:
    ``NormMlpClassifierHead``'s norm, flatten and ``pre_logits``), so in train mode it draws the mask of the whole
    tensor in one process, alike on every rank: the unsharded model's (``halo.random.dropout(whole=True)``, the draw
    ``DomainDropout`` makes for a global pool's own result). It is no halo layer (no ``_halo_site``): the guard's
    rule that refuses a halo layer given a tensor computed from a whole result does not apply to it, since its
    place in the head, not a mark on the tensor, says the tensor is whole. No state (as ``nn.Dropout``)."""

    group = group_attribute()  # (a GroupRef: the model pickles and deep-copies, as halo's layers do)

    def __init__(self, m: nn.Dropout, *, group: Any | None = None) -> None:
        super().__init__()
        self.p, self.inplace = float(m.p), bool(m.inplace)
        self.group = group
        self._site = Site()
        self.train(m.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .. import random as hr
        from ..autocast import cast_as_torch

        if not self.training or self.p == 0.0:
            return x
        x = cast_as_torch("dropout", x)  # torch's dtype under autocast (halo.autocast), as DomainDropout
        source = None if torch.compiler.is_compiling() else whole_source(x)
        out = hr.dropout(x, self.p, True, self.inplace, group=self.group, site=self._site, whole=True)
        if source is not None:
            mark_whole(out, source)  # whole in, whole out
        return out

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, whole: the unsharded mask on every rank"


class WholeBatchNorm1d(nn.BatchNorm1d):
    """The ``nn.BatchNorm1d`` of RepViT's classifier (``NormLinear``: the norm, then a linear layer), given the
    model's mean over H x W: a ``(B, C)`` tensor whole and the same on every rank, so torch's batch norm over its
    batch is the unsharded model's, its running statistics too, alike on every rank. It raises if given anything
    else: a tensor of more dims (its length may hold the sharded rows) or, on a guarded first call, a ``(B, C)``
    tensor halo did not make whole (a batch norm over each rank's own rows would differ from the unsharded one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..context import watch

        if x.dim() != 2 or (not torch.compiler.is_compiling() and watch().guard is not None
                            and whole_source(x) is None):
            raise ValueError(f"WholeBatchNorm1d: halo keeps this BatchNorm1d only for a (batch, channels) tensor "
                             f"that is the whole result of a mean over the domain (RepViT's head); got "
                             f"{tuple(x.shape)}{'' if x.dim() != 2 else ', not made whole by halo'}")
        out = super().forward(x)
        source = None if torch.compiler.is_compiling() else whole_source(x)
        if source is not None:
            mark_whole(out, source)
        return out


def _norm_linear(m: nn.Module, ctx: Any) -> nn.Module:
    """RepViT's ``NormLinear`` (an ``nn.Sequential`` of ``bn`` and ``l``) on the whole pooled tensor: its norm a
    :class:`WholeBatchNorm1d` (the same Parameters and buffers), its linear layer kept."""
    t = _twin(m)
    bn = _twin(m.bn)
    bn.__class__ = WholeBatchNorm1d
    object.__setattr__(bn, _ORIGINAL, m.bn)
    t._modules["bn"] = bn
    t._modules["l"] = _kept(m.l)
    return t


class DomainFlatten(nn.Flatten):
    """``nn.Flatten`` of the whole result of a global pool (timm's MobileNetV3 ``flatten`` after its head): it
    flattens a tensor halo made whole on every rank, and raises if given a field (which would mix its rows)."""

    def __init__(self, m: nn.Flatten, *, domain_size: int) -> None:
        super().__init__(m.start_dim, m.end_dim)
        self.domain_size = domain_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.domain_size > 1 and x.dim() >= 3 and whole_source(x) is None:
            raise ValueError(f"DomainFlatten: flatten (start_dim={self.start_dim}) of a field {tuple(x.shape)} would "
                             f"mix its sharded rows; halo keeps this flatten only for the whole result of a global "
                             f"pool")
        return super().forward(x)


#: the modules whose classifier heads pool first (their forward starts with ``self.global_pool(x)``): only these are
#: taken for heads whose other layers run on the pooled, whole result. A head of the same name elsewhere may compute
#: on the field before its pool (EfficientViT's ``ClassifierHead``: a conv and a BatchNorm, ``in_conv``): it converts
#: by the usual rules, its pool recognised on its own.
_HEADS = ("timm.layers.classifier", "timm.models.inception_next", "timm.models.hgnet")


def _head(m: nn.Module, ctx: Any) -> nn.Module:
    """A timm classifier head: its global pool made halo's, everything after it torch's own on the whole result."""
    for name, child in m._modules.items():
        if name != "global_pool" and child is not None and type(child) is not nn.Dropout:
            _refuse_random(child, f"{type(m).__name__}.{name}")  # (a channel or alpha dropout: refused)
    t = _twin(m)
    for name, child in m._modules.items():
        if child is None:
            continue
        if name == "global_pool":
            new = DomainSelectAdaptivePool2d(child, group=ctx.group)
        elif type(child) is nn.Dropout:
            new = WholeDropout(child, group=ctx.group)
        elif isinstance(child, nn.Flatten):
            new = DomainFlatten(child, domain_size=_size(ctx))
        else:
            t._modules[name] = _kept(child)
            continue
        object.__setattr__(new, _ORIGINAL, child)
        t._modules[name] = new
    return t


def _eca(m: nn.Module, ctx: Any) -> nn.Module:
    """timm's ECA (``EcaModule``, ``CecaModule``): a 1-d conv over the *channels* of the global mean
    (``x.mean((2, 3)).view(B, 1, C)``: the guard computes the mean over the domain, whole on every rank), so its
    ``Conv1d`` runs as torch's on that whole tensor; its forward is kept and watched by the guard."""
    t = _twin(m)
    for name in ("conv", "conv2"):
        child = t._modules.get(name)
        if child is not None:
            t._modules[name] = _kept(child)
    return t


def _size(ctx: Any) -> int:
    from ..dist.comm import comm_group

    return comm_group(ctx.group).size


def _tag_flatten(m: nn.Module) -> None:
    """A timm model whose forward runs ``global_pool`` ... ``flatten`` (MobileNetV3): its flatten follows the pool."""
    pool, flatten = m._modules.get("global_pool"), m._modules.get("flatten")
    if pool is not None and type(pool).__name__ == "SelectAdaptivePool2d" and type(flatten) is nn.Flatten:
        flatten.__dict__["_halo_after_global_pool"] = True


def timm_adapter(module: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The converter of a timm layer halo knows (module docstring), or ``None``."""
    kind = type(module)
    name = kind.__name__
    if type(module) is nn.Flatten and module.__dict__.pop("_halo_after_global_pool", False):
        return lambda m, ctx: DomainFlatten(m, domain_size=_size(ctx))
    if type(module) is nn.Sequential and next(iter(module._modules), None) == "global_pool" \
            and _timm(type(module.global_pool)) and type(module.global_pool).__name__ == "SelectAdaptivePool2d" \
            and _select_pool(module.global_pool):
        return _head  # MetaFormer's head: an nn.Sequential of the pool, a norm, flatten, dropout and fc
    if not _timm(kind):
        return None
    _tag_flatten(module)
    if kind.__module__ in _ACTIVATION_MODULES and not module._modules \
            and (not _own_state(module) or (name == "PReLU" and _own_state(module) == ["weight"])):
        return _keep
    if name == "Linear" and kind.__module__ == "timm.layers.linear" and isinstance(module, nn.Linear):
        return _keep  # nn.Linear with a forward of its own for torchscript: F.linear over the last dim
    norm = _inherited_norm(kind)
    if norm in _CHANNEL_NORMS and _channel_norm(module):
        return _keep  # and its subclasses that only change __init__ (metaformer's LayerNorm2dNoBias)
    if norm in ("GroupNorm", "GroupNorm1") and isinstance(module, nn.GroupNorm) and not module._modules:
        return _group_norm  # F.group_norm, as nn.GroupNorm (metaformer's GroupNorm1NoBias too)
    if name in ("LayerScale", "LayerScale2d") and _layer_scale(module):
        return _keep
    if name in ("LayerNormAct2d", "LayerNormAct") and _channel_norm_act(module):
        return lambda m, ctx: _twin(m)
    if name == "ConvNeXtBlock" and _own_state(module) == ["gamma"] and module.gamma.dim() == 1 \
            and {"conv_dw", "norm", "mlp"} <= set(module._modules):
        return lambda m, ctx: _twin(m)  # its children converted (the 7x7 depthwise conv), its own math pointwise
    if name in ("GroupNormAct", "GroupNorm1Act") and isinstance(module, nn.GroupNorm) \
            and set(module._modules) == {"drop", "act"}:
        return _group_norm
    if name == "Conv2dSame" and isinstance(module, nn.Conv2d):
        return _conv_same
    if name == "BlurPool2d" and _own_state(module) == ["filt"] and hasattr(module, "pad_mode") \
            and module.pad_mode in ("reflect", "replicate", "zeros", "circular", "constant"):
        return lambda m, ctx: DomainBlurPool2d(m, group=ctx.group)
    if name == "SelectAdaptivePool2d" and not _own_state(module) and _select_pool(module):
        return lambda m, ctx: DomainSelectAdaptivePool2d(m, group=ctx.group)
    if name in _POOL_MODES and name.startswith("Fast") and not module._modules and not _own_state(module) \
            and tuple(module.dim) in ((2, 3), (-2, -1)):
        return lambda m, ctx: _GlobalPool(_POOL_MODES[name], bool(m.flatten), ctx.group)
    if name == "GlobalResponseNorm" and set(_own_state(module)) == {"weight", "bias"} and not module._modules \
            and tuple(getattr(module, "spatial_dim", ())) in ((1, 2), (2, 3)):
        return lambda m, ctx: DomainGlobalResponseNorm(m, group=ctx.group)
    if name == "NormLinear" and kind.__module__ == "timm.models.repvit" and not _own_state(module) \
            and set(module._modules) == {"bn", "l"} and type(module.bn) is nn.BatchNorm1d \
            and type(module.l) is nn.Linear:
        return _norm_linear
    if _squeeze_excite(module):
        return lambda m, ctx: DomainSqueezeExcite(m, group=ctx.group)
    if name in ("EcaModule", "CecaModule") and kind.__module__ == "timm.layers.eca" and not _own_state(module) \
            and isinstance(module._modules.get("conv"), nn.Conv1d):
        return _eca
    if name in ("ClassifierHead", "NormMlpClassifierHead", "MlpClassifierHead") and kind.__module__ in _HEADS \
            and not _own_state(module) \
            and type(module._modules.get("global_pool")).__name__ == "SelectAdaptivePool2d" \
            and _select_pool(module.global_pool):
        return _head
    if _scaled(module):  # a learned per-channel scale or bias, by what it holds (after every named form above)
        return _keep if not module._modules else (lambda m, ctx: _twin(m))
    return maxvit_adapter(module)


def _inherited_norm(kind: type) -> str | None:
    """The name of the timm norm whose ``forward`` ``kind`` runs (itself, or a timm base it inherits the forward
    from unchanged: a subclass that only sets ``bias = None`` computes the same), or ``None``."""
    for base in kind.__mro__:
        if _timm(base) and (base.__name__ in _CHANNEL_NORMS or base.__name__ in ("GroupNorm", "GroupNorm1")) \
                and getattr(base, "forward", None) is getattr(kind, "forward", None):
            return base.__name__
    return None


def _channel_norm_act(m: nn.Module) -> bool:
    shape = getattr(m, "normalized_shape", ())
    return len(tuple(shape)) == 1 and {"drop", "act"} <= set(m._modules)


# The names before halo.nn took one prefix (issue 31), kept for one release so that code and pickles that name
# them still load (``halo.nn.HaloX`` warns: :data:`halo._moved.RENAMED`).
HaloConv2dSame = DomainConv2dSame
