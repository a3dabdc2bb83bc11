"""Data files that say what they hold (issue 30 item 4) and samples that work in a DataLoader (issue 33 item 6).

A (time 3, lat 9, lon 24) float64 dataset on a global 15-degree grid: ``sst`` with NaN over "land" (a fixed mask),
``t2m`` without, ``empty`` all NaN. One 3-rank pool (``_pool``) checks against numpy on the whole file: NaN-aware
statistics, samples as stored and normalised with NaN filled, the same columns from a file on 0..345, one on
-180..165 stored south to north and one stored 345..0 (on rows and on a 1 x 3 latitude x longitude mesh), one rank
opening another file or a missing variable refused on every rank, and the sample key: the same on the ranks of
a domain group, different across a write. In one process: a store written between a sample's reads is read again
(or refused), and ``sample()`` makes no CUDA call in DataLoader workers (fork and spawn) with CUDA faked present.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

xr = pytest.importorskip("xarray")
pytest.importorskip("h5netcdf")
pytest.importorskip("zarr")

T, H, W = 3, 9, 24
LATS = np.linspace(80, -80, H)
LONS = np.arange(W) * 15.0  # 0..345


def _values():
    rng = np.random.default_rng(7)
    sst = rng.standard_normal((T, H, W)) * 3 + 290
    land = np.zeros((H, W), dtype=bool)
    land[2:5, 3:9] = True
    land[7, 20:] = True
    sst[:, land] = np.nan
    t2m = rng.standard_normal((T, H, W)) * 10 + 270
    return {"sst": sst, "t2m": t2m, "empty": np.full((T, H, W), np.nan)}


def _dataset(values=None, lons=LONS, roll=0):
    values = _values() if values is None else values
    data = {k: (("time", "lat", "lon"), np.roll(v, -roll, axis=-1)) for k, v in values.items()}
    return xr.Dataset(data, coords={"lat": LATS, "lon": np.roll(lons, -roll), "time": np.arange(T) * 6})


def _files(tmp_path):
    """The same field on 0..345 (north to south), on -180..165 (south to north), on 345..0, on 11 rows."""
    paths = {k: str(tmp_path / f"{k}.nc") for k in ("east", "west", "down", "other", "later")}
    _dataset().to_netcdf(paths["east"], engine="h5netcdf")
    _dataset().assign_coords(time=np.arange(T) * 6 + 1).to_netcdf(paths["later"], engine="h5netcdf")  # other times
    west = _dataset(lons=np.where(LONS >= 180, LONS - 360, LONS), roll=W // 2)  # -180, -165, ..., 165
    west.isel(lat=slice(None, None, -1)).to_netcdf(paths["west"], engine="h5netcdf")
    _dataset().isel(lon=slice(None, None, -1)).to_netcdf(paths["down"], engine="h5netcdf")
    other = xr.Dataset({"sst": (("time", "lat", "lon"), np.zeros((T, H + 2, W)))},
                       coords={"lat": np.linspace(80, -80, H + 2), "lon": LONS})
    other.to_netcdf(paths["other"], engine="h5netcdf")
    return paths


def _attempt(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - every rank's outcome is compared
        return type(exc).__name__, str(exc)


def _pool(rank, world, paths, store):
    import torch.distributed as dist
    import zarr

    import halo
    from halo.dist.mesh import DomainMesh
    from halo.io import ShardedField

    halo.initialize_domain_parallel(world, world)
    out = {}
    # NaN-aware statistics, samples as stored, normalised with NaN filled, the mask
    f = ShardedField(paths["east"], ["sst", "t2m"], engine="h5netcdf")
    mean, std = f.stats(torch.float64)
    out["stats"] = (mean, std)
    out["raw"], out["mask"] = f.sample(1, torch.float64), f.nan_mask(1)
    out["key"] = out["raw"].halo_sample_key
    f.normalize(mean, std)
    out["norm"] = f.sample(1, torch.float64)
    out["kept"] = ShardedField(paths["east"], ["sst"], engine="h5netcdf").normalize(
        mean[:1], std[:1], fill_nan=None).sample(1, torch.float64)
    out["empty"] = _attempt(lambda: ShardedField(paths["east"], ["empty", "t2m"], engine="h5netcdf").stats())
    out["bad_std"] = _attempt(lambda: f.normalize(mean, torch.zeros(2)))
    broken = ShardedField(paths["east"], ["sst"], engine="h5netcdf")
    if rank == 1:  # a read error on one rank only: every rank raises (none waits alone in the sums' all-gather)
        def unreadable(var, t):
            raise OSError("Input/output error")
        broken._read = unreadable
    out["unreadable"] = _attempt(broken.stats)
    # a copy for a spawn DataLoader worker: samples alike, no process group (stats refused)
    copy = pickle.loads(pickle.dumps(f))
    out["copy"] = (torch.equal(copy.sample(1, torch.float64), out["norm"]), _attempt(copy.stats))
    # longitudes: every file gives the same columns (rows split, then a 1 x 3 latitude x longitude mesh)
    mesh = DomainMesh((1, 3))
    for name in ("east", "west", "down"):
        g = ShardedField(paths[name], ["t2m"], engine="h5netcdf")
        b = ShardedField(paths[name], ["t2m"], engine="h5netcdf", mesh=mesh)
        out[name] = (g.sample(2, torch.float64), g.longitudes, g.latitudes, b.sample(2, torch.float64), b.longitudes)
    h = ShardedField(paths["east"], ["t2m"], engine="h5netcdf", longitude="-180..180", mesh=mesh)
    out["minus180"] = (h.sample(2, torch.float64), h.longitudes)
    # one rank's file or variables differ: the same error on every rank
    out["other_file"] = _attempt(lambda: ShardedField(paths["other" if rank == 2 else "east"], ["sst"],
                                                      engine="h5netcdf"))
    out["later"] = _attempt(lambda: ShardedField(paths["later" if rank == 0 else "east"], ["sst"],
                                                 engine="h5netcdf"))
    out["watch"] = _attempt(lambda: ShardedField(paths["east"], ["sst"], engine="h5netcdf", watch=rank != 0))
    out["missing"] = _attempt(lambda: ShardedField(paths["east"], ["nope" if rank == 1 else "sst"],
                                                   engine="h5netcdf"))
    # the sample key of a zarr store: the same on every rank, different across a write
    z = ShardedField(store, ["sst", "t2m"], engine="zarr")
    keys = {}
    if rank == 0:
        keys["before"] = z.sample(0).halo_sample_key
    dist.barrier()
    if rank == 0:
        arr = zarr.open_array(store, path="t2m", mode="r+")
        arr[0, 6:, :] = arr[0, 6:, :] + 1.0  # another process writes step 0 (the last chunk of rows)
    dist.barrier()
    if rank != 0:
        keys["before"] = None
    keys["after"] = z.sample(0).halo_sample_key
    keys["step1"] = z.sample(1).halo_sample_key
    out["zkeys"] = keys
    return out


def test_nan_longitudes_agreement_and_keys(tmp_path):
    from halo.io import rechunk

    paths = _files(tmp_path)
    store = str(tmp_path / "live.zarr")
    rechunk(_dataset(), store, lat_chunk=3)
    results = run_on_ranks(_pool, 3, paths, store, timeout=240)
    v = _values()
    full = np.stack([v["sst"], v["t2m"]], axis=1)  # (T, 2, H, W)
    mean = np.nanmean(full.transpose(1, 0, 2, 3).reshape(2, -1), axis=1)
    std = np.nanstd(full.transpose(1, 0, 2, 3).reshape(2, -1), axis=1)
    norm = (full - mean[None, :, None, None]) / std[None, :, None, None]
    offs, cols = split_offsets(H, 3), split_offsets(W, 3)
    keys = {r["key"] for r in results}
    assert len(keys) == 1 and "t=1" in keys.pop()  # the same sample key on every rank of the domain group
    for rank, r in enumerate(results):
        rows = slice(offs[rank], offs[rank + 1])
        m, s = r["stats"]
        assert np.allclose(m.numpy(), mean, rtol=1e-12) and np.allclose(s.numpy(), std, rtol=1e-10)
        assert np.array_equal(r["raw"].numpy(), full[1, :, rows], equal_nan=True)  # as stored, NaN kept
        assert np.array_equal(r["mask"].numpy(), np.isnan(full[1, :, rows]))
        want = np.where(np.isnan(norm[1, :, rows]), 0.0, norm[1, :, rows])  # normalised, NaN -> 0 (the mean)
        assert np.allclose(r["norm"].numpy(), want, rtol=1e-12, atol=1e-12) and not r["norm"].isnan().any()
        assert np.allclose(r["kept"].numpy(), norm[1, :1, rows], rtol=1e-12, equal_nan=True)
        assert r["empty"][0] == "ValueError" and "channel(s) ['empty'] have no valid (non-NaN) value" in r["empty"][1]
        kind, msg = r["unreadable"]
        assert kind == "RuntimeError" and "reading the field failed on group rank 1 (global 1)" in msg, msg
        assert r["bad_std"][0] == "ValueError" and "sst (std 0.0), t2m (std 0.0)" in r["bad_std"][1]
        assert r["copy"][0] and r["copy"][1][0] == "RuntimeError" and "was pickled" in r["copy"][1][1]
        block = slice(cols[rank], cols[rank + 1])
        for name in ("east", "west", "down"):
            g, g_lon, g_lat, b, b_lon = r[name]
            assert np.array_equal(g.numpy()[0], v["t2m"][2, rows]), name  # every column 0..345, north to south
            assert np.array_equal(g_lon, LONS) and np.array_equal(g_lat, LATS[rows]), name
            assert np.array_equal(b.numpy()[0], v["t2m"][2, :, block]) and np.array_equal(b_lon, LONS[block]), name
        h, h_lon = r["minus180"]
        west = np.roll(v["t2m"][2], W // 2, axis=-1)  # -180..165
        assert np.array_equal(h.numpy()[0], west[:, block]) and np.array_equal(h_lon, (LONS - 180)[block])
        kind, msg = r["other_file"]
        assert kind == "ValueError" and "opened different fields" in msg and "latitude rows 9 vs 11" in msg, msg
        kind, msg = r["later"]  # the same grid and sizes, other time values: one word, a digest of the coordinates
        assert kind == "ValueError" and msg.endswith("differ in coordinates; every rank must open the same file "
                                                     "with the same variables and options"), msg
        kind, msg = r["watch"]
        assert kind == "ValueError" and "watch= 0 vs 1" in msg, msg
        kind, msg = r["missing"]
        assert kind == "ValueError" and "opening the field failed on group rank 1 (global 1)" in msg, msg
        assert "no variable 'nope'" in msg
    assert len({r["watch"][1] for r in results}) == 1
    assert len({r["other_file"][1] for r in results}) == 1 and len({r["missing"][1] for r in results}) == 1
    z = [r["zkeys"] for r in results]
    assert z[0]["before"] != z[1]["after"] == z[2]["after"] == z[0]["after"]  # a write between ranks' reads
    assert len({k["step1"] for k in z}) == 1  # a step nobody wrote: one key


def test_store_written_between_a_samples_reads(tmp_path, monkeypatch):
    """Another process rewrites both variables of step 0 after this rank read the first (a hook on the per-variable
    read, no timing): the sample is read again and is the new version whole, never the old ``sst`` with the new
    ``t2m``; a writer that never stops gives a clear error after the retries."""
    import zarr

    from halo.io import ShardedField, rechunk

    store = str(tmp_path / "live.zarr")
    rechunk(_dataset(), store, lat_chunk=3)
    field = ShardedField(store, ["sst", "t2m"], engine="zarr")
    old = field.sample(0, torch.float64)
    read = ShardedField._read
    writes = {"left": 1, "reads": 0}

    def write():
        for name in ("sst", "t2m"):
            arr = zarr.open_array(store, path=name, mode="r+")
            arr[0] = arr[0] + 100.0

    def hooked(self, var, t):
        out = read(self, var, t)
        writes["reads"] += 1
        if var == "sst" and writes["left"]:
            writes["left"] -= 1
            write()  # between this sample's read of sst and of t2m
        return out

    monkeypatch.setattr(ShardedField, "_read", hooked)
    got = field.sample(0, torch.float64)
    assert writes["reads"] == 4  # two attempts of two variables
    assert np.allclose(got.numpy(), old.numpy() + 100.0, equal_nan=True)  # the new version, whole
    assert got.halo_sample_key != old.halo_sample_key
    writes["left"] = 10**6
    with pytest.raises(RuntimeError, match="changed while step 0 was read, on each of 3 attempts"):
        field.sample(0)
    monkeypatch.setattr(ShardedField, "_read", read)
    assert np.allclose(field.sample(0, torch.float64).numpy(), old.numpy() + 100.0 * 4, equal_nan=True)  # 1 + 3 writes


def _fake_cuda(*_):
    """CUDA looks available and every CUDA call raises, as in a forked worker after NCCL started CUDA."""

    def refuse(*a, **k):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess (a CUDA call in the sample path)")

    torch.cuda.is_available = lambda: True
    torch.cuda._lazy_init = refuse
    torch.cuda.init = refuse
    torch.cuda.current_device = refuse
    torch.Tensor.pin_memory = refuse
    torch.Tensor.cuda = refuse
    torch.Tensor.is_pinned = refuse


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_make_no_cuda_call(tmp_path, context):
    """``ShardedField`` as a DataLoader dataset with a worker (fork; spawn: the field pickled), CUDA faked present:
    before, ``sample()`` pinned its output itself (a CUDA call: the worker crashed); the batches and their keys."""
    import halo
    from halo.io import ShardedField, collate

    path = str(tmp_path / "east.nc")
    _dataset().to_netcdf(path, engine="h5netcdf")
    field = ShardedField(path, ["sst", "t2m"], engine="h5netcdf")
    loader = torch.utils.data.DataLoader(field, batch_size=2, sampler=halo.DomainSampler(field, shuffle=False),
                                         num_workers=1, multiprocessing_context=context, worker_init_fn=_fake_cuda,
                                         collate_fn=collate)
    batches = list(loader)
    v = _values()
    full = np.stack([v["sst"], v["t2m"]], axis=1).astype(np.float32)
    assert [x.shape for x, _ in batches] == [(2, 2, H, W), (1, 2, H, W)]
    assert np.array_equal(torch.cat([x for x, _ in batches]).numpy(), full, equal_nan=True)
    key = [field.sample(t).halo_sample_key for t in range(T)]
    assert [k for _, k in batches] == [f"{key[0]};{key[1]}", key[2]]
    assert "time=6" in batches[0][1]  # the time coordinate's value rides in the key


def test_sample_makes_no_cuda_call_in_process(tmp_path, monkeypatch):
    from halo.io import ShardedField

    path = str(tmp_path / "east.nc")
    _dataset().to_netcdf(path, engine="h5netcdf")
    field = ShardedField(path, ["t2m"], engine="h5netcdf")
    with monkeypatch.context() as m:
        for obj, name in [(torch.cuda, "is_available"), (torch.cuda, "_lazy_init"), (torch.cuda, "init"),
                          (torch.cuda, "current_device"), (torch.Tensor, "pin_memory"), (torch.Tensor, "cuda"),
                          (torch.Tensor, "is_pinned")]:
            m.setattr(obj, name, getattr(obj, name))  # restored after the fake
        _fake_cuda()
        x = field.sample(0)
    assert x.shape == (1, H, W) and x.halo_sample_key.startswith(field.sample_key(0))
