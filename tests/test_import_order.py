"""No late binding (issue 31 item 2): whichever public module a process imports first, a converted model's first
call runs under the guard. Before, the guard registered itself with the planner at import (``plans.use_guard``) and
the layers plugged their exact functionals into the reroute (``reroute.provide``): a process that imported
``halo.nn.norm`` (or ``halo.plan``) alone got "the guard (halo.guard) is not imported", or a reroute with nothing
to call. Each case runs in a fresh interpreter that imports one module and nothing else of halo first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the public modules a script may import first (package faces and the public modules the layers and guard use)
FIRST = ["halo", "halo.context", "halo.dist", "halo.dist.comm", "halo.dist.mesh", "halo.plan", "halo.plan.plans",
         "halo.exchange", "halo.parallel", "halo.guard", "halo.guard.reroute", "halo.nn", "halo.nn.norm",
         "halo.nn.upsample", "halo.nn.conv", "halo.nn.spectral_layers", "halo.nn.root", "halo.nn.convert",
         "halo.check"]

#: one process: the guard is entered (off: nothing is sharded) and its epoch is recorded as guarded
_ONE = """
import importlib, sys, warnings
warnings.simplefilter("ignore")
importlib.import_module(sys.argv[1])
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from halo.nn import convert_to_domain_parallel
from halo.plan import plans
model = convert_to_domain_parallel(torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3, padding=1)), dist.group.WORLD)
model(torch.randn(1, 2, 7, 5))
assert plans.guarded_epochs(model), "the first call was not guarded"
print("guarded")
"""

#: two ranks (gloo): the guard refuses F.pad over H on every rank, and computes F.group_norm over H exactly
_TWO = """
import importlib, sys, warnings
warnings.simplefilter("ignore")
importlib.import_module(sys.argv[1])


def worker(rank, world):
    import torch
    import torch.nn.functional as F
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=world)
    from halo.nn import convert_to_domain_parallel
    from halo.nn.convert import INSIDE

    class Pad(torch.nn.Module):
        def forward(self, x):
            return F.pad(x, (0, 0, 1, 1))

    class Norm(torch.nn.Module):
        def forward(self, x):
            return F.group_norm(x, 1)

    full = torch.arange(2 * 7 * 3, dtype=torch.float64).reshape(1, 2, 7, 3).sin()
    x = torch.tensor_split(full, world, dim=-2)[rank]
    try:
        convert_to_domain_parallel(Pad(), dist.group.WORLD, {Pad: INSIDE})(x)
        raise SystemExit("F.pad over H was not refused")
    except ValueError as exc:
        assert "pads H (the sharded dim)" in str(exc), exc
    y = convert_to_domain_parallel(Norm(), dist.group.WORLD, {Norm: INSIDE})(x)
    ref = torch.tensor_split(F.group_norm(full, 1), world, dim=-2)[rank]
    assert torch.allclose(y, ref, atol=1e-12), (y - ref).abs().max()
    # both ranks are done before either tears gloo down: a rank that destroyed its group while the peer was still
    # in a collective aborted once in CI ("terminate called without an active exception", SIGABRT)
    dist.barrier()
    dist.destroy_process_group()
    # and then leave without the interpreter's teardown: under load (CI at load 8+) gloo's threads still aborted
    # it at exit, twice, after every check above had passed (a teardown race of torch's, not what this tests)
    import os
    os._exit(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(2,), nprocs=2, join=True)
    print("guarded")
"""


def _run(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "first.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("first", FIRST)
def test_a_first_call_is_guarded_whichever_module_is_imported_first(first, tmp_path):
    out = _run(_ONE, tmp_path, first, str(tmp_path / "store"))
    assert out.returncode == 0 and out.stdout.strip() == "guarded", (first, out.stderr[-3000:])


@pytest.mark.parametrize("first", ["halo.nn.norm", "halo.plan.plans", "halo.guard"])
def test_the_guard_refuses_and_computes_exactly_whichever_module_is_imported_first(first, tmp_path):
    out = _run(_TWO, tmp_path, first, str(tmp_path / "store"))
    assert out.returncode == 0 and out.stdout.strip().endswith("guarded"), (first, out.stderr[-3000:])
