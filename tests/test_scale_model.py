"""The scale model (``halo.tools.scale``) counts what halo's planner would send, and its table's shape holds.

The model takes every rank's messages from :func:`halo.partition.plan_exchange` (the plan the exchange posts); here
they are checked against the closed form of a one-row halo: an interior rank of a 1-D split sends one row of W
columns to each neighbour (two messages), the edge ranks one; on a 2-D mesh a rank sends one row of its columns
up and down, then one column of its H-extended rows left and right (periodic in longitude), four messages (three
with two columns of ranks: both columns go to the one neighbour in one message). And the model's verdicts move
the right way: more GPUs, fewer rows, the exchange harder to hide.
"""

import pytest

from halo.partition import split_sizes
from halo.tools.scale import BYTES, GRIDS, best_2d, plan_1d, plan_2d, table


@pytest.mark.parametrize("h, w, p", [(721, 1440, 8), (721, 1440, 7), (1801, 3600, 64), (45, 16, 3)])
def test_1d_bytes_and_messages_match_the_closed_form(h, w, p):
    c = 4
    layout = plan_1d(h, w, c, p)
    assert layout.messages == (2 if p > 2 else 1)
    assert layout.bytes == (2 if p > 2 else 1) * w * c * BYTES  # one row to each neighbour
    assert layout.rows == min(split_sizes(h, p))


@pytest.mark.parametrize("h, w, ph, pw", [(721, 1440, 4, 4), (45, 16, 3, 2), (1801, 3600, 8, 16)])
def test_2d_bytes_and_messages_match_the_closed_form(h, w, ph, pw):
    c = 4
    layout = plan_2d(h, w, c, ph, pw)
    hs, ws = split_sizes(h, ph), split_sizes(w, pw)
    up_down = [(i > 0) + (i < ph - 1) for i in range(ph)]  # H neighbours (zeros beyond the poles' edge)
    most = max(up_down[i] * ws[j] + 2 * (hs[i] + 2) for i in range(ph) for j in range(pw))
    assert layout.bytes == most * c * BYTES  # rows up and down, then two H-extended columns (periodic)
    assert layout.messages == max(up_down) + (2 if pw > 2 else 1)  # with 2 columns of ranks: one peer, one message


def test_table_covers_every_grid_and_scales_the_right_way():
    rows = table(channels=256)
    assert {r["grid"] for r in rows} == set(GRIDS)
    for grid in GRIDS:
        ours = [r for r in rows if r["grid"] == grid and r["1d_rows"] != "-"]
        assert [r["1d_rows"] for r in ours] == sorted((r["1d_rows"] for r in ours), reverse=True)
        hidden = [r["1d_hidden"] == "yes" for r in ours]
        assert hidden == sorted(hidden, reverse=True)  # once 1-D stops hiding its exchange, it does not recover
    # 2-D keeps hiding the exchange longer than 1-D on the 0.25 degree grid
    first_1d = min(r["gpus"] for r in rows if r["grid"] == "0.25deg" and r["1d_hidden"] != "yes")
    first_2d = min(r["gpus"] for r in rows if r["grid"] == "0.25deg" and r["2d_hidden"] != "yes")
    assert first_2d > first_1d
    assert best_2d(721, 1440, 256, 7) is None or best_2d(721, 1440, 256, 7).pw > 1
