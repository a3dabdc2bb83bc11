"""All-or-nothing writes (``halo.io.write_rows``): a step a rank dies in is never reported complete, a rerun over
an older store never mixes, every wait is bounded by ``halo.set_timeout``, disagreeing ranks and existing arrays of
another shape are refused on every rank, chunks follow the ranks' rows.

A field of 10 rows on 3 ranks (rows 0..4, 4..7, 7..10; 4-row chunks: rank 2 holds row 7 of the chunk 4..8 that
rank 1 writes whole) and 721 rows on 4 ranks (181-row chunks: 4 chunk files per step, not 721).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from _helpers import run_allow_failures

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

pytest.importorskip("zarr")

T, C, H, W = 4, 2, 10, 5
HALO_TIMEOUT = 3.0


def _run_allow_failures(fn, world, *args, timeout=90.0, pg_timeout=30.0):
    return run_allow_failures(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout)


def _field(run):
    g = torch.Generator().manual_seed(run)
    return torch.randn(T, C, H, W, generator=g, dtype=torch.float64) + 100 * run


def _write_run(rank, world, store, run, die_at):
    """Write every step of run ``run``'s field; the last rank dies (``os._exit``) inside step ``die_at``: after
    the agreement, when it sends its boundary row. Survivors return ``(step, error type, message, seconds)``."""
    import torch.distributed as dist

    import halo
    from halo.io import write_rows

    halo.set_timeout(HALO_TIMEOUT)
    offs = split_offsets(H, world)
    full = _field(run)
    for t in range(T):
        if rank == world - 1 and t == die_at:
            dist.batch_isend_irecv = lambda *a, **k: os._exit(7)  # halo.dist.transport posts every message
        t0 = time.monotonic()
        try:
            write_rows(store, "pred", full[t, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (t,),
                       group=dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001
            return t, type(exc).__name__, str(exc), time.monotonic() - t0
    return "finished"


def test_rank_killed_inside_a_step_over_an_older_store(tmp_path):
    from halo.io import complete_steps, read_step

    store = str(tmp_path / "pred.zarr")
    assert run_on_ranks(_write_run, 3, store, 1, -1, timeout=120) == ["finished"] * 3
    assert complete_steps(store, "pred") == [(t,) for t in range(T)]
    old = _field(1).numpy()
    for t in range(T):
        assert np.array_equal(read_step(store, "pred", t), old[t])

    # A rerun over the older store; rank 2 dies inside step 2 (rank 0 has written its rows of step 2 by then).
    results = _run_allow_failures(_write_run, 3, store, 2, 2)
    assert results[2] == ("died", 7), results
    for status, (step, kind, msg, seconds) in results[:2]:
        assert status == "ok" and step == 2 and kind == "HaloCommError", results
        assert "write_rows('pred', index (2,))" in msg and "global rank" in msg, msg
        assert seconds < HALO_TIMEOUT + 10, seconds
    new = _field(2).numpy()
    # Steps 0 and 1 of this run are complete and intact; step 2 (a mix of both runs' rows on disk) and step 3 (the
    # older run's) are not reported complete.
    assert complete_steps(store, "pred") == [(0,), (1,)]
    for t in (0, 1):
        assert np.array_equal(read_step(store, "pred", t), new[t])
    for t in (2, 3):
        with pytest.raises(ValueError, match=f"step \\({t},\\) of 'pred' .* is not complete"):
            read_step(store, "pred", t)
    import zarr

    on_disk = zarr.open_array(store, path="pred", mode="r")[2]
    assert np.array_equal(on_disk[:, :4], new[2, :, :4]) and np.array_equal(on_disk[:, 4:], old[2, :, 4:])


def _misuse(rank, world, store, existing):
    import torch.distributed as dist

    import halo
    from halo.io import write_rows

    halo.set_timeout(20.0)
    offs = split_offsets(H, world)
    local = _field(3)[:, :, offs[rank]:offs[rank + 1]].float()
    out = {}

    def attempt(key, *args, **kwargs):
        try:
            write_rows(*args, group=dist.group.WORLD, **kwargs)
            out[key] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[key] = (type(exc).__name__, str(exc))

    attempt("shape", store, "a", local[0], ((5 if rank == 1 else 6), C, H, W), (0,))  # one rank's T=5
    attempt("dtype", store, "a", local[0].bfloat16(), (T, C, H, W), (0,))
    attempt("shard", store, "a", local[0, :, 1:] if rank == 2 else local[0], (T, C, H, W), (0,))
    attempt("step", store, "a", local[0], (T, C, H, W), (rank % 2,))  # ranks write different steps
    attempt("existing", existing, "x", local[0], (T, C, H, W), (0,))  # the store has (T, 3, H, W) there
    for t in range(T):  # after every refusal the group is usable and nothing was written
        attempt(f"ok{t}", store, "a", local[t], (T, C, H, W), (t,))
    attempt("changed", store, "a", local[0, :1], (T, 1, H, W), (0,))  # this run wrote (T, C, H, W)
    return out


def test_misuse_refused_on_every_rank(tmp_path):
    import zarr

    from halo.io import complete_steps, read_step

    store, existing = str(tmp_path / "a.zarr"), str(tmp_path / "x.zarr")
    zarr.open_group(existing, mode="w").create_array("x", shape=(T, 3, H, W), chunks=(1, 3, 4, W), dtype="float32")
    results = run_on_ranks(_misuse, 3, store, existing, timeout=120)
    for rank, out in enumerate(results):
        for key, kind, text in [
            ("shape", "ValueError", "group rank 0 (global 0) writes shape (6, 2, 10, 5), index (0,), dtype float32, "
                                    "group rank 1 (global 1) writes shape (5, 2, 10, 5)"),
            ("dtype", "TypeError", "cannot store torch.bfloat16"),
            ("shard", "ValueError", "group rank 2 (global 2) holds rows 7..10 and columns 0..5 of (10, 5), so "
                                    "expects (2, 3, 5), got (2, 2, 5)"),
            ("step", "ValueError", "writes shape (4, 2, 10, 5), index (1,)"),
            ("existing", "ValueError", "already has an array 'x' of shape (4, 3, 10, 5), dtype float32; this write "
                                       "is shape (4, 2, 10, 5)"),
            ("changed", "ValueError", "this run writes 'a' with shape (4, 2, 10, 5)"),
        ]:
            assert out[key][0] == kind and text in out[key][1], (rank, key, out[key])
        assert all(out[f"ok{t}"] == "ok" for t in range(T)), out
    assert zarr.open_array(existing, path="x", mode="r").shape == (T, 3, H, W)  # never resized
    assert complete_steps(store, "a") == [(t,) for t in range(T)]
    want = _field(3).float().numpy()
    assert all(np.array_equal(read_step(store, "a", (t,)), want[t]) for t in range(T))


def _write_721(rank, world, store):
    import torch.distributed as dist

    from halo.io import write_rows

    offs = split_offsets(721, world)
    full = torch.arange(2 * 721 * 3, dtype=torch.float32).reshape(2, 721, 3)
    for t in range(2):
        write_rows(store, "f", full[t, offs[rank]:offs[rank + 1]], (2, 721, 3), (t,), group=dist.group.WORLD)
    return True


def test_chunks_follow_the_ranks_rows(tmp_path):
    import zarr

    from halo.io import complete_steps

    store = str(tmp_path / "f.zarr")
    assert all(run_on_ranks(_write_721, 4, store, timeout=120))
    arr = zarr.open_array(store, path="f", mode="r")
    assert arr.chunks == (1, 181, 3)  # ceil(721 / 4): rows 0, 181, 361, 541 start ranks; 361 and 541 are not
    assert np.array_equal(arr[...], np.arange(2 * 721 * 3, dtype=np.float32).reshape(2, 721, 3))
    files = [f for _, _, fs in os.walk(os.path.join(store, "f", "c")) for f in fs]
    assert len(files) == 2 * 4  # 4 chunk files per step
    assert complete_steps(store, "f") == [(0,), (1,)]


def _stall(rank, world, store, marker):
    import torch.distributed as dist

    import halo
    from halo.io import write_rows

    halo.set_timeout(HALO_TIMEOUT)
    offs = split_offsets(H, world)
    full = _field(4)
    for t in range(2):
        if rank == 1 and t == 1:  # stays away until the other rank has given up
            t0 = time.monotonic()
            while not os.listdir(marker) and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            return "stalled"
        t0 = time.monotonic()
        try:
            write_rows(store, "s", full[t, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (t,), group=dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001
            open(os.path.join(marker, str(rank)), "w").close()
            return t, type(exc).__name__, str(exc), time.monotonic() - t0
    return "finished"


def test_stalled_rank_bounded_by_set_timeout(tmp_path):
    from halo.io import complete_steps

    store, marker = str(tmp_path / "s.zarr"), tmp_path / "m"
    marker.mkdir()
    results = run_on_ranks(_stall, 2, store, str(marker), timeout=120, pg_timeout=60)
    assert results[1] == "stalled"
    step, kind, msg, seconds = results[0]
    assert step == 1 and kind == "HaloCommError", results
    assert "timed out" in msg and f"halo.set_timeout({HALO_TIMEOUT:g})" in msg and "global ranks [1]" in msg, msg
    assert HALO_TIMEOUT - 0.5 < seconds < HALO_TIMEOUT + 10, seconds
    assert complete_steps(store, "s") == [(0,)]


def _marker_lost(rank, world, store):
    """Step 0 written; then group rank 0 loses the step markers' metadata (a disk error where only it writes): at
    step 1 its marker write fails. Every rank returns ``(step, error type, message)``."""
    import shutil

    import torch.distributed as dist

    import halo
    from halo.io import write_rows

    halo.set_timeout(20.0)
    offs = split_offsets(H, world)
    full = _field(5)
    for t in range(2):
        try:
            write_rows(store, "m", full[t, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (t,), group=dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001
            return t, type(exc).__name__, str(exc)
        if t == 0 and rank == 0:
            shutil.rmtree(os.path.join(store, "halo_steps", "m"))
    return "finished"


def test_a_marker_that_cannot_be_written_fails_the_step_on_every_rank(tmp_path):
    """The marker is written last, by group rank 0 alone; when that write fails, every rank raises the same error
    for that step (before: rank 0 raised and the others returned, as if the step were complete, and went on to the
    next step alone)."""
    results = run_on_ranks(_marker_lost, 3, str(tmp_path / "m.zarr"), timeout=120)
    for rank, (step, kind, msg) in enumerate(results):
        assert step == 1 and kind == "RuntimeError", results
        assert "marking the step complete failed on group rank 0 (global 0) (" in msg, msg
        assert msg.endswith("its rows are in the store but the step is not reported complete"), msg
        assert ("ArrayNotFoundError" in msg) if rank == 0 else ("(see its error)" in msg), (rank, msg)


def test_one_process_runs_and_resume(tmp_path):
    """Without torch.distributed: each new run hides the older run's steps; ``resume=True`` keeps them."""
    import halo.io as hio
    from halo import context

    store = str(tmp_path / "one.zarr")
    full = _field(5)
    with context.use():  # each run in a context of its own, as a new process would be
        for t in range(3):
            hio.write_rows(store, "p", full[t], (T, C, H, W), (t,))
    assert hio.complete_steps(store, "p") == [(0,), (1,), (2,)]
    with context.use():  # a new process: a new run
        hio.write_rows(store, "p", full[3] + 1, (T, C, H, W), (3,))
    assert hio.complete_steps(store, "p") == [(3,)]
    context.reset()  # (what a reset forgets: this process's runs)
    hio.write_rows(store, "p", full[0], (T, C, H, W), (0,), resume=True)  # continue that run
    assert hio.complete_steps(store, "p") == [(0,), (3,)]
    assert np.array_equal(hio.read_step(store, "p", 3), full[3].numpy() + 1)
    with pytest.raises(ValueError, match="not complete"):
        hio.read_step(store, "p", 1)
    context.reset()
    with pytest.raises(ValueError, match="resume=True but"):
        hio.write_rows(str(tmp_path / "fresh.zarr"), "p", full[0], (T, C, H, W), (0,), resume=True)
    hio.write_rows(store, "whole", full[0, 0], (H, W))  # no index: the whole array is one step
    assert hio.complete_steps(store, "whole") == [()]
    assert np.array_equal(hio.read_step(store, "whole"), full[0, 0].numpy())


def test_chunk_owners_tile_the_array():
    """Pure arithmetic, many grids: the regions the ranks write (whole chunks, each by the rank holding its first
    row and column) tile the array exactly once; along latitude a rank sends at most P - 1 rows to its neighbour."""
    from halo.io._write import _meet, _owned

    for h in list(range(1, 40)) + [181, 721]:
        for p in range(1, 9):
            offs = split_offsets(h, p)
            chunk = max(1, -(-h // p))
            regions = [_owned(offs[r], offs[r + 1], chunk, h) for r in range(p)]
            covered = np.zeros(h, dtype=int)
            for a, b in regions:
                covered[a:b] += 1
                assert a % chunk == 0 and (b % chunk == 0 or b == h)
            assert (covered == 1).all(), (h, p, regions)
            for r in range(p):
                sent = sum((m[1] - m[0]) for j in range(p) if j != r
                           for m in [_meet((offs[r], offs[r + 1], 0, 1), (*regions[j], 0, 1))] if m is not None)
                assert sent <= p - 1, (h, p, r, sent)
    # a latitude x longitude mesh: blocks of a 3 x 4 mesh over 721 x 1440 and 10 x 7
    for h, w, ph, pw in [(721, 1440, 3, 4), (10, 7, 3, 4), (5, 3, 3, 4)]:
        oh, ow = split_offsets(h, ph), split_offsets(w, pw)
        ch, cw = max(1, -(-h // ph)), max(1, -(-w // pw))
        grid = np.zeros((h, w), dtype=int)
        for i in range(ph):
            for j in range(pw):
                r0, r1 = _owned(oh[i], oh[i + 1], ch, h)
                c0, c1 = _owned(ow[j], ow[j + 1], cw, w)
                grid[r0:r1, c0:c1] += 1
        assert (grid == 1).all(), (h, w, ph, pw)


def _rewrite_same_job(rank, world, store):
    """Every step written and complete; then step 1 written again with another field, and group rank 1 fails
    writing its chunk (a disk error). Every rank returns ``(error type, message)`` of the rewrite."""
    import torch.distributed as dist
    import zarr

    import halo
    from halo.io import write_rows

    halo.set_timeout(20.0)
    offs = split_offsets(H, world)
    old, new = _field(6), _field(7)
    for t in range(T):
        write_rows(store, "r", old[t, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (t,), group=dist.group.WORLD)
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("disk full")
        zarr.open_array = broken
    try:
        write_rows(store, "r", new[1, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (1,), group=dist.group.WORLD)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def _resumed_rewrite(rank, world, store):
    """A second job (resume=True) rewrites step 1 of the first job's complete steps; the last rank dies inside it,
    when it writes its chunk, once rank 0's new rows are on disk (it watches the store: no timing). Rank 1 reads the
    markers late (before the fix's agreement it then missed step 1 among the complete ones and skipped the
    unmarking the others waited in: a hang until the timeout)."""
    import torch.distributed as dist
    import zarr

    import halo
    import halo.io._steps
    from halo.io import write_rows

    halo.set_timeout(20.0)  # a loaded machine: the survivors see the dead peer's connection close anyway
    offs = split_offsets(H, world)
    new = _field(7)[1].numpy()
    if rank == 1:  # a slow reader of the resumed run's markers: it must read them before rank 0 unmarks step 1
        complete_steps = halo.io._steps.complete_steps

        def slow(*args, **kwargs):
            time.sleep(1.0)
            return complete_steps(*args, **kwargs)

        halo.io._steps.complete_steps = slow
    if rank == world - 1:
        open_array = zarr.open_array

        def die_once_rank_0_wrote(*args, **kwargs):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                if np.array_equal(open_array(store, path="pred", mode="r")[1, :, :4], new[:, :4]):
                    break
                time.sleep(0.05)
            os._exit(7)

        zarr.open_array = die_once_rank_0_wrote
    try:
        write_rows(store, "pred", _field(7)[1, :, offs[rank]:offs[rank + 1]], (T, C, H, W), (1,),
                   group=dist.group.WORLD, resume=True)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def _mixed(store, name, t, old, new, old_rows):
    """Step ``t`` on disk holds rows 0..4 of the new write and ``old_rows`` of the old one (what a reader must not be
    handed as complete)."""
    import zarr

    on_disk = zarr.open_array(store, path=name, mode="r")[t]
    return np.array_equal(on_disk[:, :4], new[t, :, :4]) and np.array_equal(on_disk[:, old_rows], old[t, :, old_rows])


def test_a_failed_rewrite_of_a_complete_step_is_not_complete(tmp_path):
    """Issue 30 item 4: rewriting a complete step marks it incomplete before the first byte, so a rank failing (same
    job) or dying (a job resumed with resume=True) in the rewrite leaves it not complete (before: still listed
    complete, and read_step returned rows of two writes)."""
    from halo.io import complete_steps, read_step

    store = str(tmp_path / "r.zarr")
    results = run_on_ranks(_rewrite_same_job, 3, store, timeout=120)
    for kind, msg in results:
        assert kind == "RuntimeError" and "the write failed on group rank 1 (global 1)" in msg, results
    old, new = _field(6).numpy(), _field(7).numpy()
    assert _mixed(store, "r", 1, old, new, slice(4, 8))  # rank 1's rows are the old ones
    assert complete_steps(store, "r") == [(0,), (2,), (3,)]
    with pytest.raises(ValueError, match="step \\(1,\\) of 'r' .* is not complete"):
        read_step(store, "r", 1)
    assert np.array_equal(read_step(store, "r", 2), old[2])

    store = str(tmp_path / "pred.zarr")
    assert run_on_ranks(_write_run, 3, store, 6, -1, timeout=120) == ["finished"] * 3
    results = _run_allow_failures(_resumed_rewrite, 3, store)
    assert results[2] == ("died", 7), results
    for status, (kind, msg) in results[:2]:
        assert status == "ok" and kind == "HaloCommError" and "write_rows('pred', index (1,))" in msg, results
    assert _mixed(store, "pred", 1, old, new, slice(8, 10))  # rank 2's chunk is the old one
    assert complete_steps(store, "pred") == [(0,), (2,), (3,)]  # the resumed run's other steps are kept
    with pytest.raises(ValueError, match="is not complete"):
        read_step(store, "pred", 1)
