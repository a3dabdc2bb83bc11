"""benchmarks/gpu_check.sh --dry-run: the GPU script's plumbing on the CPU (gloo, tiny sizes), so that the first GPU
run does not spend its minutes on a typo. Every part runs under its own timeout and writes its results; what needs
CUDA reports "skipped: no CUDA"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "gpu_check_summary.txt").read_text().splitlines()
    verdicts = {line.split()[0]: line.split()[1] for line in summary}
    assert verdicts == {"env": "ok", "kernels": "skipped:", "pack": "ok", "step": "ok", "nccl2": "ok", "conv": "ok"}
    step = json.loads((tmp_path / "gpu_check_step.json").read_text())
    assert step["sync-free"]["ok"] and step["sync-free"]["sync_debug"] == "skipped: no CUDA"
    assert step["whole-step graph"]["skipped"] == "skipped: no CUDA"
    assert step["autocast bf16"]["ok"], step["autocast bf16"]
    pack = json.loads((tmp_path / "gpu_check_pack.json").read_text())
    (config,) = [v for k, v in pack.items() if isinstance(v, dict) and "ok" in v]
    assert set(config) >= {"pack 2 rows", "unpack into padded", "halo_exchange pole", "copy_", "F.pad"}
    assert config["F.pad"]["graph"] == "skipped: no CUDA" and config["F.pad"]["eager_host_us"] > 0
    nccl2 = json.loads((tmp_path / "gpu_check_nccl2.json").read_text())
    assert nccl2["workers"]["exit_codes"] == [0, 0]
    for rank in (0, 1):
        assert nccl2[f"rank{rank}"]["check_equivalence"]["ok"]
        assert nccl2[f"rank{rank}"]["host group"]["ok"]
    lines = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(line)["part"] for line in lines] == ["pack", "step", "nccl2", "conv"]
