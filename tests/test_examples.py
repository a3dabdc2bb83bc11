"""``examples/train.py`` runs as the README says: under torchrun, on CPU ranks (gloo), to its end.

Run as a subprocess (``python -m torch.distributed.run``, what ``torchrun`` is) with a timeout, so a hang fails
the test instead of stalling the suite. ``--standalone`` picks a free port: tests running side by side do not
collide on torchrun's default one. ``TRITON_INTERPRET`` is removed: the example runs the torch path on CPU.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def _torchrun(nproc: int, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (gloo), also on a machine with GPUs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(EXAMPLE), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _example_module():
    spec = importlib.util.spec_from_file_location("halo_example_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("nproc, args, layout", [
    (2, [], "1 data-parallel x 2 domain ranks; grid 37x72, boundary 'pole'"),
    # 2 replicas x 2 domain ranks, a cell-centred grid (no pole row): the other pole boundary
    (4, ["--domain", "2", "--grid", "36x72", "--steps", "5"],
     "2 data-parallel x 2 domain ranks; grid 36x72, boundary 'pole_centered'"),
])
def test_train_example_runs_under_torchrun(nproc, args, layout, tmp_path):
    saved = tmp_path / "model.pt"
    proc = _torchrun(nproc, [*args, "--save", str(saved)], tmp_path, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert layout in proc.stdout, log
    # the check ran with the boundary it trains with, and passed
    assert "OK: every module's output, the input gradient and every parameter gradient match" in proc.stdout, log
    assert "OK: trained sharded, and the sharded loss equals the unsharded one" in proc.stdout, log
    losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) >= 2 and losses[-1] < losses[0], log  # it trains
    # the saved weights load into the unconverted model (same state_dict keys)
    h, w = (int(v) for v in (args[args.index("--grid") + 1] if "--grid" in args else "37x72").split("x"))
    net = _example_module().UNet(3, 16, (h, w))
    net.load_state_dict(torch.load(saved, weights_only=True))
    if nproc == 4:  # the README's checkpoint calls: save the whole state, resume from it in a second job
        ckpt = tmp_path / "ckpt"
        first = _torchrun(nproc, [*args, "--ckpt", str(ckpt)], tmp_path, timeout=240)
        assert first.returncode == 0 and "saved the training state" in first.stdout, first.stdout + first.stderr
        again = _torchrun(nproc, [*args, "--steps", "2", "--ckpt", str(ckpt)], tmp_path, timeout=240)
        log = again.stdout + again.stderr
        assert again.returncode == 0, log
        assert "resumed from" in again.stdout and "at step 5 (epoch 1)" in again.stdout, log
        assert "saved the training state" in again.stdout and "(step 7)" in again.stdout, log


def test_train_example_pole_reference_is_the_pole_boundary():
    """The example's hand-padded reference pads as halo's pole boundary does (on one process, the whole field):
    so the check in the example compares with the boundary the example trains with, not with zero padding."""
    from halo.dist.comm import unsharded
    from halo.exchange import halo_exchange

    ex = _example_module()
    for h, boundary in ((9, "pole"), (8, "pole_centered")):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular").double()
        pole = ex.PoleConv2d(2, 3, 3, padding=1, padding_mode="circular", pole_on_grid=boundary == "pole").double()
        pole.load_state_dict(conv.state_dict())
        x = torch.randn(1, 2, h, 6, dtype=torch.float64)
        with unsharded():
            ext = halo_exchange(x, 1, boundary=boundary)  # rows across the poles, halo's way
        want = torch.nn.functional.conv2d(torch.nn.functional.pad(ext, (1, 1, 0, 0), mode="circular"),
                                          conv.weight, conv.bias)
        torch.testing.assert_close(pole(x), want, rtol=0, atol=1e-13)
        assert not torch.allclose(pole(x), conv(x))  # and it is not the zero/circular padding of nn.Conv2d
