"""The ``halo`` command end to end: ``halo demo`` on a small grid and ``halo bench --quick`` on 2 gloo ranks.

Both run as subprocesses (``python -m halo``, the console script's code path) with a timeout, so a hang
fails the test instead of stalling the suite. ``TRITON_INTERPRET`` is removed from their environment: the
interpreter is a correctness tool, and the CLI runs the torch reference path on CPU tensors.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from halo.cli import main


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return subprocess.run([sys.executable, "-m", "halo", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_small_grid_two_ranks(tmp_path):
    out = tmp_path / "demo"
    proc = _run(["demo", "--grid", "37x72", "--nproc", "2", "--steps", "1", "--dtype", "float64",
                 "--out", str(out)], tmp_path, timeout=60)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "max error:" in proc.stdout, log
    assert "building field" in proc.stdout and "reference step" in proc.stdout, log  # progress lines
    png = out / "halo_demo.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", log


def test_demo_on_a_latitude_longitude_mesh(tmp_path):
    out = tmp_path / "demo2d"
    proc = _run(["demo", "--grid", "37x72", "--mesh", "2x2", "--steps", "1", "--dtype", "float64",
                 "--out", str(out)], tmp_path, timeout=90)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "4 ranks as a 2x2 latitude x longitude mesh" in proc.stdout, log
    assert "within tolerance" in proc.stdout and "OK: every module's output" in proc.stdout, log


def test_bench_quick_writes_csvs(tmp_path):
    out = tmp_path / "bench"
    proc = _run(["bench", "--quick", "--nproc", "2", "--only", "bandwidth,conv,scaling", "--out", str(out)],
                tmp_path, timeout=90)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    for name in ("halo_bandwidth", "conv_overhead", "scaling"):
        path = out / f"{name}.csv"
        assert path.exists(), f"{path} missing\n{log}"
        rows = list(csv.DictReader(path.open()))
        assert rows and {"device", "backend", "world", "torch", "triton", "date"} <= set(rows[0]), rows[:1]
        assert all(r["backend"] == "gloo" for r in rows)
    impls = {r["impl"] for r in csv.DictReader((out / "halo_bandwidth.csv").open())}
    assert {"wire", "floor", "exchange", "unplanned", "inplace", "naive"} <= impls


def test_png_writer_without_matplotlib(tmp_path):
    """The demo's fallback PNG writer produces a valid file (no matplotlib needed)."""
    import struct
    import zlib

    from halo.demo import _png_bytes

    rows = [bytes([10 * y, 0, 255 - 10 * y]) * 5 for y in range(4)]  # 4 rows of 5 RGB pixels
    data = _png_bytes(rows, 5)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (5, 4)
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    assert len(zlib.decompress(data[idat + 4:idat + 4 + length])) == 4 * (1 + 15)


@pytest.mark.parametrize("argv", [["demo", "--grid", "10x"], ["demo", "--grid", "37x71"], ["bench", "--only", "x"],
                                  ["demo", "--mesh", "2x0"], ["demo", "--mesh", "2"],
                                  ["demo", "--grid", "37x72", "--mesh", "10x2"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0


ZOO = '''
import torch.nn.functional as F
from torch import nn


class Good(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.p = nn.MaxPool2d(2)
        self.u = nn.Upsample(scale_factor=2)
        self.b = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        return self.b(self.u(self.p(F.relu(self.a(x)))))


class Resized(Good):
    def forward(self, x):
        return self.b(F.interpolate(self.p(F.relu(self.a(x))), scale_factor=2, mode="bilinear"))


def good():
    return Good()


def resized():
    return Resized()
'''


def test_check_command(tmp_path):
    (tmp_path / "zoo_cli.py").write_text(ZOO)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}" if env_path else str(tmp_path)
    try:
        ok = _run(["check", "zoo_cli:good", "--shape", "2,3,24,16", "--nproc", "3"], tmp_path, timeout=90)
        bad = _run(["check", "zoo_cli:resized", "--shape", "2,3,24,16", "--nproc", "2"], tmp_path, timeout=90)
        wrong = _run(["check", "zoo_cli:nothing", "--shape", "2,3,24,16"], tmp_path, timeout=60)
        mesh = _run(["check", "zoo_cli:good", "--shape", "2,3,23,17", "--mesh", "2x2"], tmp_path, timeout=90)
    finally:
        if env_path:
            os.environ["PYTHONPATH"] = env_path
        else:
            del os.environ["PYTHONPATH"]
    assert ok.returncode == 0 and "OK: every module's output" in ok.stdout, ok.stdout + ok.stderr
    assert bad.returncode == 1 and "REFUSED: interpolate at zoo_cli.py:" in bad.stdout, bad.stdout + bad.stderr
    assert wrong.returncode != 0 and "cannot load 'zoo_cli:nothing'" in wrong.stderr, wrong.stdout + wrong.stderr
    assert mesh.returncode == 0 and "4 ranks" in mesh.stdout and "OK: every module's output" in mesh.stdout, \
        mesh.stdout + mesh.stderr


def test_demo_with_a_netcdf_file(tmp_path):
    np = pytest.importorskip("numpy")
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    t, h, w = 4, 37, 72
    lat, lon = np.linspace(90, -90, h), np.arange(w) * 5.0
    base = np.cos(np.deg2rad(lat))[:, None] * np.sin(np.deg2rad(lon))[None, :]
    rng = np.random.default_rng(0)
    data = {"t2m": (("time", "lat", "lon"), np.stack([280 + 10 * np.roll(base, k, 1) + rng.standard_normal((h, w))
                                                       for k in range(t)])),
            "u": (("time", "level", "lat", "lon"), rng.standard_normal((t, 2, h, w)))}
    path = tmp_path / "era_like.nc"
    xr.Dataset(data, coords={"lat": lat, "lon": lon}).to_netcdf(path, engine="h5netcdf")
    out = tmp_path / "roll"
    proc = _run(["demo", "--data", str(path), "--nproc", "3", "--leads", "2", "--dtype", "float64", "--out", str(out)],
                tmp_path, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "channels ['t2m', 'u[0]', 'u[1]']" in proc.stdout and "RMSE t2m" in proc.stdout, log
    assert "OK: the sharded rollout equals the unsharded one" in proc.stdout, log
    for k in (1, 2):
        assert (out / f"halo_rollout_lead{k}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
