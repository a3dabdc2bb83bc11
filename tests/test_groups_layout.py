"""Pure tests of the ColossalAI-style group layouts in ``halo.dist.groups`` (no process group).

The expected layouts are built here a different way from the implementation: as numpy reshapes and transposes
of ``arange(world)``, read off ColossalAI's loops (``colossalai/legacy/context/process_group_initializer``).
The global rank at grid point ``(i, j, k)`` (``i`` fastest) of tensor block ``h`` is the array element
``arange(world).reshape(G, K, J, I)[h, k, j, i]``; a mode whose groups vary ``j`` and whose loops run over
``h, i, k`` is that array transposed to ``(h, i, k, j)`` and cut into rows of length ``J``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from halo.dist.groups import (
    GroupInfo,
    Initializer_1D,
    Initializer_2D,
    Initializer_2p5D,
    Initializer_3D,
    Initializer_Data,
    Initializer_Model,
    Initializer_Pipeline,
    Initializer_Sequence,
    Initializer_Sequence_DP,
    Initializer_Tensor,
    ParallelMode,
    ProcessGroupInitializer,
)

M = ParallelMode
WORLDS = range(1, 65)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def product_configs(worlds=WORLDS):
    """Every (world, dp, pp, tp) with world == dp * pp * tp: what ColossalAI's context produces."""
    for w in worlds:
        for dp in divisors(w):
            for pp in divisors(w // dp):
                yield w, dp, pp, w // (dp * pp)


def rows(a: np.ndarray, n: int) -> list[list[int]]:
    return a.reshape(-1, n).tolist()


# ---- expected layouts, from ColossalAI's loops, via numpy --------------------------------------------------
# Each takes (world, dp, pp, tp[, depth]) and does not assume world == dp * pp * tp.


def exp_data(w, dp, pp, tp):
    # group i = [i + j * (w / dp) for j]: the columns of a (dp, w/dp) array
    return {M.DATA: np.arange(w).reshape(dp, w // dp).T.tolist()}


def exp_pipeline(w, dp, pp, tp):
    # per data block d, per stage offset s: [d*w/dp + s + m * stage for m], stage = w / (dp * pp)
    a = np.arange(w).reshape(dp, pp, w // (dp * pp))  # (d, m, s)
    return {M.PIPELINE: rows(a.transpose(0, 2, 1), pp)}


def exp_blocks(mode, size):
    return lambda w, dp, pp, tp: {mode: rows(np.arange(w), size(w, pp, tp))}


exp_tensor = exp_blocks(M.TENSOR, lambda w, pp, tp: tp)
exp_1d = exp_blocks(M.PARALLEL_1D, lambda w, pp, tp: tp)
exp_model = exp_blocks(M.MODEL, lambda w, pp, tp: pp * tp)
exp_sequence_dp = exp_blocks(M.SEQUENCE_DP, lambda w, pp, tp: w // pp)


def exp_sequence(w, dp, pp, tp):
    return {M.SEQUENCE: rows(np.arange(w), tp), **exp_sequence_dp(w, dp, pp, tp)}


def exp_2d(w, dp, pp, tp):
    q = math.isqrt(tp)
    a = np.arange(w).reshape(w // tp, q, q)  # (h, j, i)
    return {
        M.PARALLEL_2D_ROW: rows(a, q),  # loops h, j; vary i
        M.PARALLEL_2D_COL: rows(a.transpose(0, 2, 1), q),  # loops h, i; vary j
    }


def exp_2p5d(w, dp, pp, tp, depth):
    q = math.isqrt(tp // depth)
    a = np.arange(w).reshape(w // tp, depth, q, q)  # (h, k, j, i)
    return {
        M.PARALLEL_2P5D_COL: rows(a.transpose(0, 3, 1, 2), q),  # loops h, i, k; vary j
        M.PARALLEL_2P5D_ROW: rows(a.transpose(0, 2, 1, 3), q),  # loops h, j, k; vary i
        M.PARALLEL_2P5D_DEP: rows(a.transpose(0, 3, 2, 1), depth),  # loops h, i, j; vary k
        M.PARALLEL_2P5D_XZ: rows(a.transpose(0, 3, 1, 2), q * depth),  # loops h, i; vary k, j
    }


def exp_3d(w, dp, pp, tp):
    d = round(tp ** (1 / 3))
    a = np.arange(w).reshape(w // tp, d, d, d)  # (h, k, j, i)
    return {
        M.PARALLEL_3D_INPUT: rows(a.transpose(0, 3, 1, 2), d),  # loops h, i, k; vary j
        M.PARALLEL_3D_WEIGHT: rows(a, d),  # loops h, k, j; vary i
        M.PARALLEL_3D_OUTPUT: rows(a.transpose(0, 3, 2, 1), d),  # loops h, i, j; vary k
        M.PARALLEL_3D_INPUT_X_WEIGHT: rows(a, d * d),  # loops h, k; vary j, i
        M.PARALLEL_3D_OUTPUT_X_WEIGHT: rows(a.transpose(0, 2, 1, 3), d * d),  # loops h, j; vary k, i
    }


SIMPLE = {
    Initializer_Data: exp_data,
    Initializer_Pipeline: exp_pipeline,
    Initializer_Tensor: exp_tensor,
    Initializer_1D: exp_1d,
    Initializer_Model: exp_model,
    Initializer_Sequence: exp_sequence,
    Initializer_Sequence_DP: exp_sequence_dp,
}
RETURNS_LIST = {Initializer_Pipeline, Initializer_Sequence, Initializer_2D, Initializer_2p5D, Initializer_3D}


def check_partition(layout, world):
    for mode, groups in layout.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{mode} groups do not partition range({world}): {groups}"
        assert len({len(g) for g in groups}) == 1, f"{mode} groups of different sizes: {groups}"
        # ColossalAI's local rank (index in the list) is torch's group rank (index in the sorted ranks)
        assert all(g == sorted(g) for g in groups), f"{mode} group not ascending: {groups}"


def sizes(layout):
    return {mode: len(groups[0]) for mode, groups in layout.items()}


# ---- every configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(SIMPLE), ids=lambda c: c.__name__)
def test_simple_layouts_all_product_configs(cls):
    for w, dp, pp, tp in product_configs():
        layout = cls(0, w, None, dp, pp, tp).layout()
        assert layout == SIMPLE[cls](w, dp, pp, tp), (cls.__name__, w, dp, pp, tp)
        check_partition(layout, w)
        expected_sizes = {
            M.DATA: dp, M.PIPELINE: pp, M.TENSOR: tp, M.PARALLEL_1D: tp, M.MODEL: pp * tp,
            M.SEQUENCE: tp, M.SEQUENCE_DP: dp * tp,
        }  # fmt: skip
        assert sizes(layout) == {m: expected_sizes[m] for m in layout}


def test_2d_all_product_configs():
    count = 0
    for w, dp, pp, tp in product_configs():
        if math.isqrt(tp) ** 2 != tp:
            continue
        init = Initializer_2D(0, w, None, dp, pp, tp)
        layout = init.layout()
        assert layout == exp_2d(w, dp, pp, tp), (w, dp, pp, tp)
        check_partition(layout, w)
        q = init.summa_dim
        assert q * q == tp and sizes(layout) == {M.PARALLEL_2D_ROW: q, M.PARALLEL_2D_COL: q}
        count += 1
    assert count > 200


def test_2p5d_all_product_configs_and_depths():
    count = 0
    for w, dp, pp, tp in product_configs():
        for depth in divisors(tp):
            if math.isqrt(tp // depth) ** 2 * depth != tp:
                continue
            init = Initializer_2p5D(0, w, None, dp, pp, tp, depth=depth)
            layout = init.layout()
            assert layout == exp_2p5d(w, dp, pp, tp, depth), (w, dp, pp, tp, depth)
            check_partition(layout, w)
            q = init.tesseract_dim
            assert (init.tesseract_dep, q * q * depth) == (depth, tp)
            assert sizes(layout) == {
                M.PARALLEL_2P5D_COL: q, M.PARALLEL_2P5D_ROW: q, M.PARALLEL_2P5D_DEP: depth,
                M.PARALLEL_2P5D_XZ: q * depth,
            }  # fmt: skip
            count += 1
    assert count > 300


def test_3d_all_product_configs():
    count = 0
    for w, dp, pp, tp in product_configs():
        if tp not in (1, 8, 27, 64):
            continue
        init = Initializer_3D(0, w, None, dp, pp, tp)
        layout = init.layout()
        assert layout == exp_3d(w, dp, pp, tp), (w, dp, pp, tp)
        check_partition(layout, w)
        d = init.depth
        assert d**3 == tp
        assert list(sizes(layout).values()) == [d, d, d, d * d, d * d]
        count += 1
    assert count > 100


def test_loose_configs_match_colossalai_formulas():
    """Standalone use (sizes need only divide the world, as ColossalAI's formulas need): same construction."""
    for w in range(1, 25):
        for dp in divisors(w):
            for pp in divisors(w // dp):
                for tp in divisors(w):
                    for cls, expected in SIMPLE.items():
                        if cls is Initializer_Model and w % (pp * tp):
                            continue
                        assert cls(0, w, None, dp, pp, tp).layout() == expected(w, dp, pp, tp)
                    if math.isqrt(tp) ** 2 == tp:
                        assert Initializer_2D(0, w, None, dp, pp, tp).layout() == exp_2d(w, dp, pp, tp)


def test_layout_is_the_same_on_every_rank():
    # every rank must create the same groups in the same order
    for w, dp, pp, tp in product_configs(range(1, 17)):
        inits = [Initializer_Sequence, Initializer_Pipeline, Initializer_Data, Initializer_Model]
        if math.isqrt(tp) ** 2 == tp:
            inits.append(Initializer_2D)
        for cls in inits:
            layouts = [cls(r, w, None, dp, pp, tp).layout() for r in range(w)]
            assert all(lay == layouts[0] for lay in layouts)


# ---- structure: modes, their order, list or tuple --------------------------------------------------------


def test_modes_and_order_follow_colossalai():
    assert list(Initializer_2D(0, 4, None, 1, 1, 4).layout()) == [M.PARALLEL_2D_ROW, M.PARALLEL_2D_COL]
    assert list(Initializer_2p5D(0, 8, None, 1, 1, 8, depth=2).layout()) == [
        M.PARALLEL_2P5D_COL, M.PARALLEL_2P5D_ROW, M.PARALLEL_2P5D_DEP, M.PARALLEL_2P5D_XZ,
    ]  # fmt: skip
    assert list(Initializer_3D(0, 8, None, 1, 1, 8).layout()) == [
        M.PARALLEL_3D_INPUT, M.PARALLEL_3D_WEIGHT, M.PARALLEL_3D_OUTPUT,
        M.PARALLEL_3D_INPUT_X_WEIGHT, M.PARALLEL_3D_OUTPUT_X_WEIGHT,
    ]  # fmt: skip
    assert list(Initializer_Sequence(0, 8, None, 2, 2, 2).layout()) == [M.SEQUENCE, M.SEQUENCE_DP]
    for cls in (*SIMPLE, Initializer_2D, Initializer_2p5D, Initializer_3D):
        assert cls.returns_list == (cls in RETURNS_LIST), cls.__name__


def test_parallel_mode_values_are_colossalai_strings():
    assert {m.name: m.value for m in ParallelMode} == {
        "GLOBAL": "global", "DATA": "data", "MODEL": "model", "PIPELINE": "pipe", "TENSOR": "tensor",
        "SEQUENCE": "sequence", "SEQUENCE_DP": "sequence_dp", "PARALLEL_1D": "1d",
        "PARALLEL_2D_ROW": "2d_row", "PARALLEL_2D_COL": "2d_col",
        "PARALLEL_3D_INPUT": "3d_input", "PARALLEL_3D_WEIGHT": "3d_weight", "PARALLEL_3D_OUTPUT": "3d_output",
        "PARALLEL_3D_INPUT_X_WEIGHT": "3d_input_x_weight",
        "PARALLEL_3D_OUTPUT_X_WEIGHT": "3d_output_x_weight",
        "PARALLEL_2P5D_ROW": "2p5d_row", "PARALLEL_2P5D_COL": "2p5d_col", "PARALLEL_2P5D_DEP": "2p5d_dep",
        "PARALLEL_2P5D_XZ": "2p5d_xz",
    }  # fmt: skip
    assert GroupInfo._fields == ("local_rank", "group_world_size", "process_group", "ranks_in_group", "mode")
    with pytest.raises(TypeError):
        ProcessGroupInitializer(0, 1, None, 1, 1, 1)  # abstract


# ---- literal layouts, worked out by hand from ColossalAI's loops -----------------------------------------


def test_literal_hybrid_world_8():
    # world 8 = dp 2 x pp 2 x tp 2: rank = 4 d + 2 p + t
    args = (0, 8, None, 2, 2, 2)
    assert Initializer_Data(*args).layout() == {M.DATA: [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert Initializer_Pipeline(*args).layout() == {M.PIPELINE: [[0, 2], [1, 3], [4, 6], [5, 7]]}
    assert Initializer_Tensor(*args).layout() == {M.TENSOR: [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert Initializer_Model(*args).layout() == {M.MODEL: [[0, 1, 2, 3], [4, 5, 6, 7]]}
    # SEQUENCE_DP is contiguous blocks of world / pp: here NOT the ranks of one pipeline stage ({0,1,4,5})
    assert Initializer_Sequence(*args).layout() == {
        M.SEQUENCE: [[0, 1], [2, 3], [4, 5], [6, 7]],
        M.SEQUENCE_DP: [[0, 1, 2, 3], [4, 5, 6, 7]],
    }


def test_literal_2d():
    assert Initializer_2D(3, 8, None, 2, 1, 4).layout() == {
        M.PARALLEL_2D_ROW: [[0, 1], [2, 3], [4, 5], [6, 7]],
        M.PARALLEL_2D_COL: [[0, 2], [1, 3], [4, 6], [5, 7]],
    }
    layout = Initializer_2D(0, 16, {}, 1, 1, 16).layout()
    assert layout[M.PARALLEL_2D_ROW] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout[M.PARALLEL_2D_COL] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_literal_2p5d_creation_order_is_not_sorted():
    assert Initializer_2p5D(0, 8, None, 1, 1, 8, depth=2).layout() == {
        M.PARALLEL_2P5D_COL: [[0, 2], [4, 6], [1, 3], [5, 7]],
        M.PARALLEL_2P5D_ROW: [[0, 1], [4, 5], [2, 3], [6, 7]],
        M.PARALLEL_2P5D_DEP: [[0, 4], [2, 6], [1, 5], [3, 7]],
        M.PARALLEL_2P5D_XZ: [[0, 2, 4, 6], [1, 3, 5, 7]],
    }
    # depth 1 is 2D with other names (and COL first); depth == tp is q = 1
    assert Initializer_2p5D(0, 4, None, 1, 1, 4, depth=1).layout() == {
        M.PARALLEL_2P5D_COL: [[0, 2], [1, 3]],
        M.PARALLEL_2P5D_ROW: [[0, 1], [2, 3]],
        M.PARALLEL_2P5D_DEP: [[0], [2], [1], [3]],  # loops i, then j
        M.PARALLEL_2P5D_XZ: [[0, 2], [1, 3]],
    }
    assert Initializer_2p5D(0, 4, None, 1, 1, 4, depth=4).layout()[M.PARALLEL_2P5D_DEP] == [[0, 1, 2, 3]]


def test_literal_3d():
    assert Initializer_3D(0, 16, None, 2, 1, 8).layout() == {
        M.PARALLEL_3D_INPUT: [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]],
        M.PARALLEL_3D_WEIGHT: [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        M.PARALLEL_3D_OUTPUT: [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]],
        M.PARALLEL_3D_INPUT_X_WEIGHT: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        M.PARALLEL_3D_OUTPUT_X_WEIGHT: [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
    }


def test_2p5d_depth_from_config():
    cfg = {"parallel": {"tensor": {"mode": "2.5d", "size": 8, "depth": 2}}}
    assert Initializer_2p5D(0, 8, cfg, 1, 1, 8).tesseract_dim == 2
    obj = SimpleNamespace(parallel=SimpleNamespace(tensor=SimpleNamespace(depth=2)))
    assert Initializer_2p5D(0, 8, obj, 1, 1, 8).layout() == Initializer_2p5D(0, 8, None, 1, 1, 8, 2).layout()


# ---- invalid configurations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Initializer_2D(0, 6, None, 1, 1, 6), ["perfect square", "6"]),
        (lambda: Initializer_2D(0, 8, None, 1, 1, 8), ["perfect square", "8"]),
        (lambda: Initializer_2D(0, 8, None, 1, 1, 9), ["(9)", "(8)", "divide"]),
        (lambda: Initializer_2p5D(0, 8, None, 1, 1, 8, depth=3), ["q*q*depth", "8", "depth 3"]),
        (lambda: Initializer_2p5D(0, 8, None, 1, 1, 8, depth=1), ["q*q*depth", "8", "depth 1"]),
        (lambda: Initializer_2p5D(0, 4, None, 1, 1, 4, depth=8), ["q*q*depth", "4", "depth 8"]),
        (lambda: Initializer_2p5D(0, 8, None, 1, 1, 8, depth=0), ["depth", "positive", "0"]),
        (lambda: Initializer_2p5D(0, 8, None, 1, 1, 8), ["depth"]),
        (lambda: Initializer_2p5D(0, 8, {"parallel": {}}, 1, 1, 8), ["depth"]),
        (lambda: Initializer_3D(0, 4, None, 1, 1, 4), ["perfect cube", "4"]),
        (lambda: Initializer_3D(0, 27, None, 1, 1, 9), ["perfect cube", "9"]),
        (lambda: Initializer_3D(0, 12, None, 1, 1, 8), ["(8)", "(12)"]),
        (lambda: Initializer_Tensor(0, 8, None, 1, 1, 3), ["tensor parallel size (3)", "(8)"]),
        (lambda: Initializer_1D(0, 8, None, 1, 1, 16), ["(16)", "(8)"]),
        (lambda: Initializer_Data(0, 8, None, 3, 1, 1), ["data parallel size (3)", "(8)"]),
        (lambda: Initializer_Pipeline(0, 8, None, 2, 3, 1), ["pipeline parallel size (3)", "(4)"]),
        (lambda: Initializer_Pipeline(0, 8, None, 5, 1, 1), ["data parallel size (5)", "(8)"]),
        (lambda: Initializer_Model(0, 8, None, 1, 2, 3), ["(6)", "(8)"]),
        (lambda: Initializer_Sequence(0, 8, None, 1, 3, 2), ["pipeline parallel size (3)", "(8)"]),
        (lambda: Initializer_Sequence(0, 8, None, 1, 1, 5), ["(5)", "(8)"]),
        (lambda: Initializer_Sequence_DP(0, 6, None, 1, 4, 1), ["(4)", "(6)"]),
        (lambda: Initializer_Tensor(0, 8, None, 1, 1, 0), ["tensor_parallel_size", "positive", "0"]),
        (lambda: Initializer_Data(0, 8, None, -2, 1, 1), ["data_parallel_size", "positive", "-2"]),
        (lambda: Initializer_Pipeline(0, 8, None, 1, 0, 1), ["pipeline_parallel_size", "positive", "0"]),
        (lambda: Initializer_2D(0, 0, None, 1, 1, 1), ["world_size", "positive", "0"]),
        (lambda: Initializer_Tensor(0, 8, None, 1, 1, 2.0), ["tensor_parallel_size", "2.0"]),
        (lambda: Initializer_Tensor(0, 8, None, 1, 1, True), ["tensor_parallel_size", "True"]),
        (lambda: Initializer_Tensor(8, 8, None, 1, 1, 2), ["rank", "[0, 8)", "8"]),
        (lambda: Initializer_Tensor(-1, 8, None, 1, 1, 2), ["rank", "-1"]),
    ],
)
def test_invalid_configurations_raise_value_error(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_init_dist_group_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        Initializer_Tensor(0, 1, None, 1, 1, 1).init_dist_group()
