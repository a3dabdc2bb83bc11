"""Checkpoints that never mix (``halo.checkpoint``): a new directory per save, complete only with its marker.

A save/load round trip on 2 gloo ranks gives back the saved weights exactly; a save in which a rank dies before
its file is written leaves no marker, so ``latest`` and ``load`` find the previous complete checkpoint (and a
load on one process, resharded by DCP, gets exactly its weights).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_io_atomic import _run_allow_failures

from halo.testing import run_on_ranks

pytest.importorskip("torch.distributed.checkpoint")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.GroupNorm(1, 3),
                               torch.nn.Conv2d(3, 1, 1)).double()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _round_trip(rank, world, root):
    import halo
    from halo import checkpoint

    halo.set_timeout(20.0)
    out = {}
    try:
        checkpoint.save({"model": _model(0).state_dict()}, root, 3 + rank)  # the ranks disagree on the step
    except ValueError as exc:
        out["disagree"] = str(exc)
    model = _model(1)
    saved = _weights(model)
    first = checkpoint.save({"model": model.state_dict()}, root, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = checkpoint.save({"model": model.state_dict()}, root, 2)
    latest = checkpoint.latest(root)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded_1 = checkpoint.load({"model": model.state_dict()}, root, step=1)
    out["step1"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    loaded = checkpoint.load({"model": model.state_dict()}, root)
    out["latest"] = all(torch.equal(v, saved[k] + (1.0 if "weight" in k or "bias" in k else 0.0))
                        for k, v in model.state_dict().items())
    out["paths"] = (first.path.name, second.path.name, latest.path.name, loaded_1.path.name, loaded.path.name)
    return out


def test_save_load_round_trip(tmp_path):
    results = run_on_ranks(_round_trip, 2, str(tmp_path), timeout=120)
    for out in results:
        assert "the ranks save different steps: group rank 0 (global 0): 3, group rank 1 (global 1): 4" in \
            out["disagree"], out
        assert out["step1"] and out["latest"], out
        first, second, latest, loaded_1, loaded = out["paths"]
        assert first.startswith("step-0000000001-") and second.startswith("step-0000000002-")
        assert latest == second == loaded and loaded_1 == first
    assert results[0]["paths"] == results[1]["paths"]  # one directory per save, the same on every rank


def _save_then_die(rank, world, root, seed, step, die):
    import torch.distributed.checkpoint.filesystem as fs

    import halo
    from halo import checkpoint

    halo.set_timeout(5.0)
    if die and rank == world - 1:  # dies before its file is written
        fs.FileSystemWriter.write_data = lambda *a, **k: os._exit(7)
    try:
        checkpoint.save({"model": _model(seed).state_dict()}, root, step)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "saved"


def test_rank_dies_mid_save_load_finds_the_previous(tmp_path):
    from halo import checkpoint

    root = str(tmp_path)
    assert run_on_ranks(_save_then_die, 2, root, 1, 1, False, timeout=120) == ["saved", "saved"]
    results = _run_allow_failures(_save_then_die, 2, root, 2, 2, True)
    assert results[1] == ("died", 7), results
    assert results[0][0] == "ok" and results[0][1][0] in ("HaloCommError", "RuntimeError"), results
    assert "halo.checkpoint.save(step 2)" in results[0][1][1], results
    names = sorted(os.listdir(root))
    assert len(names) == 2 and names[1].startswith("step-0000000002-")  # the failed save's directory, no marker
    assert not os.path.exists(os.path.join(root, names[1], checkpoint.MARKER))
    found = checkpoint.latest(root)
    assert found is not None and found.step == 1 and found.path.name == names[0]
    model = _model(3)  # other weights, loaded over on one process (DCP reshards the 2-rank save)
    got = checkpoint.load({"model": model.state_dict()}, root)
    want = _weights(_model(1))
    assert got.step == 1 and all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load({"model": model.state_dict()}, root, step=2)
