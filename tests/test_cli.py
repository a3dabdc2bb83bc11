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

from halo.tools.cli import main


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
    assert "untrained model of" in proc.stdout, log  # says what the model is
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
    # its own picture: a run on a mesh does not overwrite the latitude-rows picture
    assert (out / "halo_demo_mesh2x2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", log
    assert not (out / "halo_demo.png").exists(), log


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
    # progress while it runs, and the machine's load said
    assert "bandwidth: case 1/4" in proc.stdout and "conv: case 1/1" in proc.stdout, log
    assert "load average now:" in proc.stdout, log


def test_bench_runs_from_an_installed_wheel(tmp_path):
    """Issue 22 item 5: ``halo bench`` loaded ``benchmarks/`` by path and could not run from a wheel. Build the wheel
    from a copy of the source (``pip wheel``: what ``pyproject.toml`` ships), unpack it as an installed package,
    and run ``halo bench``'s quickest benchmark from a folder with no checkout above it: it imports the benchmark
    from the package and writes its CSV to ``./benchmarks_out``, never into the installed package."""
    import shutil
    import zipfile

    root = Path(__file__).resolve().parents[1]
    src, site, run = tmp_path / "src", tmp_path / "site", tmp_path / "run"
    for folder in ("halo", "kernels"):
        shutil.copytree(root / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("halo_exchange-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        whl.extractall(site)
    assert {"halo/tools/cli.py", "halo/tools/bench.py", "halo/tools/benchmarks/pack_kernels.py",
            "halo/kernels/dispatch.py"} <= names, sorted(names)
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "halo = halo.tools.cli:main" in (site / entry).read_text()
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(site)  # the unpacked wheel first: the checkout's halo is not seen
    where = subprocess.run([sys.executable, "-c", "import halo.tools.bench as b; print(b.__file__); "
                            "print(b.checkout_dir())"], cwd=run, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.split() == [str(site / "halo" / "tools" / "bench.py"), "None"], where.stdout + where.stderr
    proc = subprocess.run([sys.executable, "-m", "halo", "bench", "--quick", "--only", "pack"], cwd=run, env=env,
                          capture_output=True, text=True, timeout=180)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "--- pack: ok" in proc.stdout, log
    rows = list(csv.DictReader((run / "benchmarks_out" / "pack_kernels.csv").open()))
    assert rows and {r["impl"] for r in rows} >= {"reference", "copy"}, rows[:2]
    assert not list(site.rglob("*.csv")), "halo bench wrote into the installed package"


def test_old_module_names_still_work():
    """The thin aliases users' scripts and older console scripts call (tests/test_layering.py keeps them thin)."""
    import halo.cli
    import halo.demo
    import halo.tools.cli
    import halo.tools.demo
    from halo.tools.bench import load_benchmark

    assert halo.cli.main is halo.tools.cli.main
    assert halo.demo.DemoNet is halo.tools.demo.DemoNet and halo.demo.make_field is halo.tools.demo.make_field
    assert load_benchmark("scaling").__name__ == "halo.tools.benchmarks.scaling"
    with pytest.raises(ValueError, match="unknown benchmark module 'nope': expected one of"):
        load_benchmark("nope")


def test_bench_flags_a_busy_machine_and_notes_points_above_the_ceiling():
    from halo.tools.bench import LoadWatch, load_benchmark

    quiet, busy = LoadWatch(own=2), LoadWatch(own=2)
    quiet.cores = busy.cores = 2
    quiet.samples, busy.samples = [1.5, 2.2], [3.0, 9.5]
    assert quiet.warning() is None
    text = busy.warning()
    assert text.startswith("WARNING") and "9.5" in text and "2 cores" in text and "2 of it" in text, text
    with LoadWatch(own=1, interval=0.05) as watch:  # samples while it runs
        assert LoadWatch.active[-1] is watch
    assert watch.samples and LoadWatch.active == []

    rows = [{"impl": "plain", "domain": 1, "time_s": "1.0", "speedup": "1.00"},
            {"impl": "halo P=1", "domain": 1, "time_s": "1.2", "speedup": "0.83"},
            {"impl": "halo P=2", "domain": 2, "time_s": "0.38", "speedup": "2.62"},
            {"impl": "ceiling P=2", "domain": 2, "time_s": "0.55", "speedup": "1.82"},
            {"impl": "halo P=3", "domain": 3, "time_s": "0.6", "speedup": "1.67"},
            {"impl": "ceiling P=3", "domain": 3, "time_s": "0.5", "speedup": "2.00"}]
    scaling = load_benchmark("scaling")
    assert scaling.ceiling_notes(rows, cores=4) == [(2, 2.62, "2.62x: above its ceiling 1.82x")]
    rows[3]["time_s"] = "0.42"  # the ceiling itself above the ideal: the ideal is the limit
    assert scaling.ceiling_notes(rows, cores=4) == [(2, 2.62, "2.62x: above the ideal 2x")]
    rows[2]["speedup"] = "1.50"
    assert scaling.ceiling_notes(rows, cores=4) == []


def test_png_writer_without_matplotlib(tmp_path):
    """The demo's fallback PNG writer produces a valid file (no matplotlib needed)."""
    import struct
    import zlib

    from halo.tools.demo import png_bytes

    rows = [bytes([10 * y, 0, 255 - 10 * y]) * 5 for y in range(4)]  # 4 rows of 5 RGB pixels
    data = png_bytes(rows, 5)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (5, 4)
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    assert len(zlib.decompress(data[idat + 4:idat + 4 + length])) == 4 * (1 + 15)


def test_fallback_error_map_is_sequential():
    """Without matplotlib |error| is drawn black (0) to white (max), brighter for larger: a sequential scale,
    not the upper half of the blue-white-red map of the fields."""
    import torch

    from halo.tools.demo import rgb_rows_sequential

    (row,) = rgb_rows_sequential(torch.tensor([[0.0, 0.25, 0.5, 0.75, 1.0]]), 1.0)
    pixels = [tuple(row[i:i + 3]) for i in range(0, 15, 3)]
    assert pixels[0] == (0, 0, 0) and pixels[-1] == (255, 255, 255), pixels
    assert all(sum(a) < sum(b) for a, b in zip(pixels[:-1], pixels[1:], strict=True)), pixels


def _figures_saved(monkeypatch) -> list:
    """Record every matplotlib figure saved (and still write its file)."""
    figure = pytest.importorskip("matplotlib.figure")
    saved = []
    real = figure.Figure.savefig

    def record(fig, path, *args, **kwargs):
        saved.append(fig)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", record)
    return saved


def _texts(fig) -> tuple[list[str], list[str], list[str]]:
    """(panel titles, axis labels of every axes, colour bars included, free texts) of a figure."""
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    labels = [lab for ax in fig.axes for lab in (ax.get_xlabel(), ax.get_ylabel()) if lab]
    texts = [t.get_text() for ax in fig.axes for t in ax.texts] + [fig.get_suptitle()]
    return titles, labels, texts


@pytest.mark.parametrize("mesh", [None, (2, 2)])
def test_demo_picture_is_readable(mesh, tmp_path, monkeypatch):
    """The demo's picture: a title per panel, latitude/longitude axes in degrees, colour bars with units, every
    shard labelled with its rank, the untrained model said, a sequential map for |error|, its own file per layout."""
    import numpy as np

    from halo.plan.partition import split_offsets
    from halo.tools.demo import latitudes, picture_name, write_png

    saved = _figures_saved(monkeypatch)
    h, w = 37, 72
    world = 4 if mesh else 3
    rng = np.random.default_rng(0)
    res = {"grid": (h, w), "world": world, "mesh": mesh, "dtype": "float32", "boundary": "pole",
           "lat": latitudes(h).numpy(), "field": rng.standard_normal((h, w)), "output": rng.standard_normal((h, w)),
           "diff": np.abs(rng.standard_normal((h, w))) * 1e-7,
           "offsets": split_offsets(h, mesh[0] if mesh else world),
           "col_offsets": split_offsets(w, mesh[1]) if mesh else [0, w]}
    path = write_png(res, tmp_path / picture_name(res))
    assert path.name == ("halo_demo_mesh2x2.png" if mesh else "halo_demo.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    titles, labels, texts = _texts(fig)
    assert len(titles) == 3 and any("|sharded - unsharded|" in t for t in titles), titles
    assert labels.count("latitude (degrees north)") == 3 and labels.count("longitude (degrees east)") == 3, labels
    assert sum("normalised value" in lab for lab in labels) == 2 and "|difference| (same units)" in labels, labels
    assert all(any(f"rank {r}\n" in t for t in texts) for r in range(world)), texts
    assert "untrained" in fig.get_suptitle()
    assert ("2x2 latitude x longitude mesh" in fig.get_suptitle()) == bool(mesh), fig.get_suptitle()
    error_map = fig.axes[2].images[0]
    assert error_map.get_cmap().name == "viridis" and error_map.get_clim()[0] == 0  # sequential, from 0


def test_data_demo_pictures_are_readable(tmp_path, monkeypatch):
    import torch

    from halo.plan.partition import split_offsets
    from halo.tools.demo_data import _pictures

    saved = _figures_saved(monkeypatch)
    h, w, leads = 19, 36, 2
    gen = torch.Generator().manual_seed(0)
    res = {"grid": (h, w), "leads": leads, "world": 2, "channels": ["t2m"], "dtype": "float32", "units": "t2m (K)",
           "rmse": torch.rand(leads, 1, generator=gen), "offsets": split_offsets(h, 2),
           "coords": ([-90 + 10.0 * i for i in range(h)], [10.0 * j for j in range(w)]),  # south first
           "maps": [(280 + torch.randn(h, w, generator=gen), 280 + torch.randn(h, w, generator=gen), 1e-6)
                    for _ in range(leads)]}
    paths = _pictures(res, tmp_path)
    assert [p.name for p in paths] == ["halo_rollout_lead1.png", "halo_rollout_lead2.png"]
    assert len(saved) == leads
    titles, labels, texts = _texts(saved[0])
    assert len(titles) == 3 and "lead 1" in titles[1], titles
    assert labels.count("latitude (degrees north)") == 3 and labels.count("t2m (K)") == 2, labels
    assert "|error| of t2m (K)" in labels, labels
    assert "untrained" in saved[0].get_suptitle()
    # drawn north up although the file is south first: rank 0 (the first rows, the south) is labelled below rank 1
    y = {t.get_text().split("\n")[0]: t.get_position()[1] for t in saved[0].axes[1].texts}
    assert y["rank 0"] < 0 < y["rank 1"], y
    lo, hi = saved[0].axes[0].get_ylim()
    assert lo < hi and hi >= 85, (lo, hi)  # north at the top
    assert saved[0].axes[2].images[0].get_cmap().name == "viridis"


@pytest.mark.parametrize("argv", [["demo", "--grid", "10x"], ["demo", "--grid", "37x71"], ["bench", "--only", "x"],
                                  ["demo", "--mesh", "2x0"], ["demo", "--mesh", "2"],
                                  ["demo", "--grid", "37x72", "--mesh", "10x2"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0


ZOO = '''
import torch
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


class Spectral(Good):  # an FFT along H: every output row reads every input row, which no halo gives
    def forward(self, x):
        y = self.p(F.relu(self.a(x)))
        return self.b(self.u(torch.fft.ifft(torch.fft.fft(y, dim=-2), dim=-2).real))


def good():
    return Good()


def spectral():
    return Spectral()
'''


def test_check_command(tmp_path):
    (tmp_path / "zoo_cli.py").write_text(ZOO)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}" if env_path else str(tmp_path)
    try:
        ok = _run(["check", "zoo_cli:good", "--shape", "2,3,24,16", "--nproc", "3"], tmp_path, timeout=90)
        bad = _run(["check", "zoo_cli:spectral", "--shape", "2,3,24,16", "--nproc", "2"], tmp_path, timeout=90)
        wrong = _run(["check", "zoo_cli:nothing", "--shape", "2,3,24,16"], tmp_path, timeout=60)
        mesh = _run(["check", "zoo_cli:good", "--shape", "2,3,23,17", "--mesh", "2x2"], tmp_path, timeout=90)
    finally:
        if env_path:
            os.environ["PYTHONPATH"] = env_path
        else:
            del os.environ["PYTHONPATH"]
    assert ok.returncode == 0 and "OK: every module's output" in ok.stdout, ok.stdout + ok.stderr
    assert bad.returncode == 1 and "REFUSED: " in bad.stdout and "fft at zoo_cli.py:" in bad.stdout, \
        bad.stdout + bad.stderr
    assert wrong.returncode != 0 and "cannot load 'zoo_cli:nothing'" in wrong.stderr, wrong.stdout + wrong.stderr
    assert mesh.returncode == 0 and "4 ranks" in mesh.stdout and "OK: every module's output" in mesh.stdout, \
        mesh.stdout + mesh.stderr


POLE_ZOO = '''
from halo.tools.demo import DemoNet


def demo():
    return DemoNet(3, 4, (37, 16))


def zero_padded(model):  # the model itself: zero padding at the poles, what `halo check --boundary pole` used to use
    return model
'''


def test_check_pole_boundary_against_a_pole_reference(tmp_path):
    """``halo check --boundary pole`` compares with the model whose convs pad latitude across the poles
    (``halo.check.boundary_reference``), so the demo's model is reported OK; ``--reference MODULE:FACTORY``
    replaces that reference: the zero-padded model is reported different, at the first conv. (That the built-in
    reference is the demo's hand-written pole model is tested in test_check_real.py.)"""
    (tmp_path / "zoo_pole.py").write_text(POLE_ZOO)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env_path}" if env_path else str(tmp_path)
    base = ["check", "zoo_pole:demo", "--shape", "2,3,37,16", "--boundary", "pole"]
    try:
        built_in = _run([*base, "--nproc", "3"], tmp_path, timeout=120)
        zeros = _run([*base, "--nproc", "2", "--reference", "zoo_pole:zero_padded"], tmp_path, timeout=120)
        missing = _run([*base, "--reference", "zoo_pole:nothing"], tmp_path, timeout=60)
    finally:
        if env_path:
            os.environ["PYTHONPATH"] = env_path
        else:
            del os.environ["PYTHONPATH"]
    assert built_in.returncode == 0 and "3 ranks" in built_in.stdout, built_in.stdout + built_in.stderr
    assert "OK: every module's output" in built_in.stdout, built_in.stdout + built_in.stderr
    assert zeros.returncode == 1, zeros.stdout + zeros.stderr
    assert "FIRST DIFFERENCE: DIFFERS output of enc (Conv2d)" in zeros.stdout, zeros.stdout + zeros.stderr
    assert missing.returncode != 0 and "cannot load 'zoo_pole:nothing'" in missing.stderr, \
        missing.stdout + missing.stderr

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
    assert "leads of an untrained model" in proc.stdout and "global statistics of 3 channels" in proc.stdout, log
    for k in (1, 2):
        assert (out / f"halo_rollout_lead{k}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
