"""The modes matrix on a latitude x longitude mesh: a converted model on blocks, in the modes users train in.

The converted model runs on blocks of a ``DomainMesh((ph, pw))`` (H over the first axis, W over the second, uneven
on both: a 23 x 30 field), where its stride-1 convs compute-then-patch on both axes (``halo.nn.patch2d``: the
block's conv while rows and columns travel, corners a second hop), its strided and transposed convs pad-then-conv,
and its norms, pools, upsampling and dropout take the block's global rows and columns. Each cell compares with the
unsharded model in the same process, from the same parameters (tests/_modes.py's loop and verdict: forward, input
gradient, parameter gradients summed over the domain, BatchNorm's buffers, dtypes and memory format): float64,
bf16 autocast, channels_last, both checkpointings, gradient accumulation, no_grad, and ``torch.compile``
(aot_eager; compiled, the stride-1 convs compute-then-patch as ops of the graph) on 2x2; the eager cells on 2x3
(6 ranks) too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _modes import check_cell, run_modes
from test_modes import ModesHarness, TinyNet
from torch import nn

from halo.testing import run_on_ranks

pytestmark = pytest.mark.timeout(900)

H, W, C = 23, 30, 3


class MeshNet(nn.Module):
    """Layer kinds with a latitude x longitude form: 23 x 30 -> 12 x 15 -> 6 x 8 -> 12 x 16 -> 23 x 30."""

    def __init__(self, c: int = C) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, 6, 3, padding=1, padding_mode="circular")  # compute-then-patch, periodic W
        self.bn = nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 6, 3, padding=2, dilation=2)  # compute-then-patch, dilated
        self.gn = nn.GroupNorm(2, 6)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Conv2d(6, 6, 3, stride=2, padding=1)  # pad-then-conv
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.up = nn.Upsample(size=(12, 15), mode="bilinear")
        self.upt = nn.ConvTranspose2d(6, 6, 3, stride=2, padding=1, output_padding=(0, 1))
        self.out = nn.Conv2d(12, c, 5, padding=2)  # compute-then-patch, 5x5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.gelu(self.bn(self.c1(x)))
        a = self.drop(F.gelu(self.gn(self.c2(a))))
        b = self.upt(self.up(self.pool(F.gelu(self.down(a)))))
        return self.out(torch.cat([a, b], dim=1))


class MeshHarness(ModesHarness):
    """test_modes.py's harness on blocks: the model converted onto the mesh, this rank's block of the field."""

    net, tiny, rows, cols = MeshNet, TinyNet, H, W

    def __init__(self, rank: int, world: int, shape: tuple[int, int]) -> None:
        from halo.dist.mesh import DomainMesh
        from halo.plan.partition import local_range

        self.rank, self.world = rank, world
        self.mesh = DomainMesh(shape, periodic=(False, True))
        (self.lo, self.hi), (self.w0, self.w1) = (local_range(n, self.mesh.axis_size(a), self.mesh.axis_rank(a))
                                                  for a, n in ((0, H), (1, W)))

    def target(self):
        return self.mesh

    def part(self, t):
        return t[..., self.lo:self.hi, self.w0:self.w1]


EAGER = ["fp64", "bf16", "channels_last", "ckpt_reentrant", "ckpt", "no_grad", "accumulate"]
MODES_2x2 = [*EAGER, "aot_eager"]


def _modes_on_rank(rank: int, world: int, shape: tuple[int, int], modes: list[str]) -> dict:
    import os

    os.environ["TRITON_INTERPRET"] = "0"
    return run_modes(MeshHarness(rank, world, shape), modes)


_RESULTS: dict = {}


def _results(shape: tuple[int, int]) -> list[dict]:
    if shape not in _RESULTS:
        modes = MODES_2x2 if shape == (2, 2) else EAGER
        _RESULTS[shape] = run_on_ranks(_modes_on_rank, shape[0] * shape[1], shape, modes, timeout=800)
    return _RESULTS[shape]


@pytest.mark.parametrize("mode", MODES_2x2)
def test_mode_on_a_2x2_mesh(mode):
    check_cell(mode, [r[mode] for r in _results((2, 2))])


@pytest.mark.parametrize("mode", EAGER)
def test_mode_on_a_2x3_mesh(mode):
    check_cell(mode, [r[mode] for r in _results((2, 3))])
