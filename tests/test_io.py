"""Rank-local reads of a netCDF/HDF5 field (``halo.io.ShardedField``): each rank reads its rows only.

A (time 3, level 2, lat 45, lon 64) float64 dataset with two variables (one with levels: 3 channels) is written
with h5netcdf, contiguous storage. On 3 gloo ranks each rank opens it through a file object that counts the bytes
read: every sample equals ``halo.shard`` of the whole field, the statistics equal the whole field's (float64,
exact to rounding), and the samples each rank reads are its share of the data (its rows, rounded up to the read
buffer) where a whole-field reader reads all of it; the file's metadata is read once on open by any reader.
"""

import io

import numpy as np
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

xr = pytest.importorskip("xarray")
pytest.importorskip("h5netcdf")

T, L, H, W = 3, 2, 45, 64


def _dataset():
    rng = np.random.default_rng(0)
    return xr.Dataset({"t": (("time", "level", "lat", "lon"), rng.standard_normal((T, L, H, W)) * 10 + 280),
                       "u": (("time", "lat", "lon"), rng.standard_normal((T, H, W)) * 5)},
                      coords={"lat": np.linspace(90, -90, H), "lon": np.arange(W) * 22.5})


class Counting(io.RawIOBase):
    """A read-only file that counts the bytes handed out."""

    def __init__(self, data: bytes):
        self.buf, self.pos, self.read_bytes = data, 0, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.buf) + offset
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        chunk = self.buf[self.pos:self.pos + len(b)]
        b[:len(chunk)] = chunk
        self.pos += len(chunk)
        self.read_bytes += len(chunk)
        return len(chunk)


def _file_bytes(tmp_path):
    path = tmp_path / "field.nc"
    _dataset().to_netcdf(path, engine="h5netcdf")
    return path.read_bytes()


def _read(rank, world, data):
    import halo
    from halo.io import ShardedField

    halo.initialize_domain_parallel(world, world)
    f = Counting(data)
    field = ShardedField(io.BufferedReader(f, buffer_size=512), engine="h5netcdf")
    opened = f.read_bytes  # the file's metadata: the same for any reader
    samples = [field.sample(t, dtype=torch.float64) for t in range(len(field))]
    read_samples = f.read_bytes - opened
    mean, std = field.stats(torch.float64)
    return {"samples": samples, "mean": mean, "std": std, "bytes": read_samples, "channels": field.channels,
            "rows": (field.rows.start, field.rows.stop)}


def test_each_rank_reads_its_rows_only(tmp_path):
    data = _file_bytes(tmp_path)
    results = run_on_ranks(_read, 3, data, timeout=120)
    ds = _dataset()
    full = torch.from_numpy(np.concatenate([ds["t"].values, ds["u"].values[:, None]], axis=1))  # (T, 3, H, W)
    offs = split_offsets(H, 3)
    payload = full.numel() * 8
    for rank, r in enumerate(results):
        assert r["channels"] == ["t[0]", "t[1]", "u"]
        assert r["rows"] == (offs[rank], offs[rank + 1])
        for t in range(T):
            assert torch.equal(r["samples"][t], full[t, :, offs[rank]:offs[rank + 1]])
        mean = full.permute(1, 0, 2, 3).reshape(3, -1).mean(1)
        std = full.permute(1, 0, 2, 3).reshape(3, -1).std(1, unbiased=False)
        assert torch.allclose(r["mean"], mean, rtol=1e-12) and torch.allclose(r["std"], std, rtol=1e-10)
        # A third of the data (whole rows of 64 columns; reads are rounded up to the 512-byte buffer), not all.
        share = (offs[rank + 1] - offs[rank]) / H
        assert share * payload <= r["bytes"] < (share + 0.05) * payload, (rank, r["bytes"], payload)
    from halo.io import ShardedField

    whole = Counting(data)  # one process, no torch.distributed: the whole field, all of the data
    field = ShardedField(io.BufferedReader(whole, buffer_size=512), engine="h5netcdf")
    opened = whole.read_bytes
    for t in range(T):
        field.sample(t)
    assert whole.read_bytes - opened >= payload


def test_granularity_and_errors(tmp_path):
    from halo.io import ShardedField

    path = tmp_path / "f.nc"
    _dataset().to_netcdf(path, engine="h5netcdf")
    with pytest.raises(ValueError, match="not a whole number of blocks of 4"):
        ShardedField(str(path), engine="h5netcdf", granularity=4)
    field = ShardedField(str(path), engine="h5netcdf", granularity=9, variables=["u"])
    assert field.rows == slice(0, H) and field.sample(1).shape == (1, H, W)  # one process: the whole field
    with pytest.raises(IndexError):
        field.sample(T)


def test_stats_of_a_variable_whose_time_dim_is_not_first():
    """dims (level, time, lat, lon): every channel's statistics are its own level's (before: the slab of every
    step was cut into channels as if time came first, mixing the levels' values, silently)."""
    from halo.io import ShardedField

    rng = np.random.default_rng(1)
    values = rng.standard_normal((L, T, H, W)) + 100 * np.arange(L)[:, None, None, None]
    ds = xr.Dataset({"t": (("level", "time", "lat", "lon"), values), "u": (("lat", "lon"), values[0, 0] * 3)},
                    coords={"lat": np.linspace(90, -90, H)})
    field = ShardedField(ds)
    assert field.channels == ["t[0]", "t[1]", "u"]
    mean, std = field.stats(torch.float64)
    levels = values.reshape(L, -1)
    assert np.allclose(mean.numpy(), [*levels.mean(1), 3 * values[0, 0].mean()], rtol=1e-12)
    assert np.allclose(std.numpy(), [*levels.std(1), 3 * values[0, 0].std()], rtol=1e-10)
    want = np.concatenate([values[:, 1], 3 * values[None, 0, 0]])  # (t[0], t[1], u) at step 1
    assert np.array_equal(field.sample(1, torch.float64).numpy(), want)


def test_rechunk_writes_a_store_chunked_for_slabs(tmp_path):
    pytest.importorskip("zarr")
    from halo.io import ShardedField, rechunk

    rechunk(_dataset(), str(tmp_path / "r.zarr"), lat_chunk=8)
    ds = xr.open_zarr(tmp_path / "r.zarr")
    assert ds["t"].encoding["chunks"] == (1, L, 8, W) and ds["u"].encoding["chunks"] == (1, 8, W)
    field = ShardedField(ds)
    want = _dataset()
    got = field.sample(2, dtype=torch.float64)
    assert np.array_equal(got[:2].numpy(), want["t"].values[2]) and np.array_equal(got[2].numpy(), want["u"].values[2])


def _write(rank, world, store):
    import halo
    from halo.io import write_rows

    halo.initialize_domain_parallel(world, world)
    ds = _dataset()
    full = torch.from_numpy(ds["t"].values)  # (T, L, H, W)
    offs = split_offsets(H, world)
    for t in range(T):
        write_rows(store, "pred", full[t, :, offs[rank]:offs[rank + 1]], (T, L, H, W), (t,))
    return True


def test_ranks_write_their_rows_into_one_store(tmp_path):
    zarr = pytest.importorskip("zarr")
    store = str(tmp_path / "pred.zarr")
    assert all(run_on_ranks(_write, 3, store, timeout=120))
    got = zarr.open_group(store, mode="r")["pred"]
    assert np.array_equal(got[...], _dataset()["t"].values)
    assert got.chunks[-2] == 15  # 45 rows on 3 ranks: chunk boundaries at every rank's first row


def _read_blocks(rank, world, data, store):
    from halo.dist.mesh import DomainMesh
    from halo.io import ShardedField, write_rows

    mesh = DomainMesh((2, 2))
    f = Counting(data)
    field = ShardedField(io.BufferedReader(f, buffer_size=512), engine="h5netcdf", mesh=mesh)
    opened = f.read_bytes
    samples = [field.sample(t, dtype=torch.float64) for t in range(len(field))]
    read_samples = f.read_bytes - opened
    mean, std = field.stats(torch.float64)
    for t in range(T):  # each rank writes back its block of the first variable
        write_rows(store, "pred", samples[t][:L].float(), (T, L, H, W), (t,), mesh=mesh)
    return {"samples": samples, "mean": mean, "std": std, "bytes": read_samples,
            "block": (field.rows.start, field.rows.stop, field.cols.start, field.cols.stop)}


def test_latitude_longitude_blocks(tmp_path):
    """On a 2 x 2 mesh each rank reads its block (about a quarter of the data), the statistics are the whole
    field's, and the ranks write their blocks into one store whose chunks never span two ranks."""
    zarr = pytest.importorskip("zarr")
    data = _file_bytes(tmp_path)
    store = str(tmp_path / "blocks.zarr")
    results = run_on_ranks(_read_blocks, 4, data, store, timeout=120)
    ds = _dataset()
    full = torch.from_numpy(np.concatenate([ds["t"].values, ds["u"].values[:, None]], axis=1))
    oh, ow = split_offsets(H, 2), split_offsets(W, 2)
    payload = full.numel() * 8
    for rank, r in enumerate(results):
        i, j = divmod(rank, 2)
        assert r["block"] == (oh[i], oh[i + 1], ow[j], ow[j + 1])
        for t in range(T):
            assert torch.equal(r["samples"][t], full[t, :, oh[i]:oh[i + 1], ow[j]:ow[j + 1]])
        mean = full.permute(1, 0, 2, 3).reshape(3, -1).mean(1)
        assert torch.allclose(r["mean"], mean, rtol=1e-12)
        # About a quarter of the payload: its rows, half of each row (row-major storage: contiguous half-rows).
        share = (oh[i + 1] - oh[i]) * (ow[j + 1] - ow[j]) / (H * W)
        assert share * payload <= r["bytes"] < (2 * share + 0.05) * payload, (rank, r["bytes"], payload)
    got = zarr.open_group(store, mode="r")["pred"]
    assert np.array_equal(got[...], ds["t"].values.astype(np.float32))
    assert got.chunks[-2:] == (23, 32)


def _two_orders(tmp_path):
    """The same physical field stored north to south (input) and south to north (target), with a static field."""
    ds = _dataset()
    ds["lsm"] = (("lat", "lon"), np.random.default_rng(1).random((H, W)))  # no time dim: the same every step
    ds["other"] = (("lat2", "lon"), np.zeros((H + 1, W)))  # on another grid
    north, south = tmp_path / "north.nc", tmp_path / "south.nc"
    ds.to_netcdf(north, engine="h5netcdf")
    ds.isel(lat=slice(None, None, -1)).to_netcdf(south, engine="h5netcdf")
    return str(north), str(south)


def _pairs(rank, world, north, south):
    import torch.distributed as dist

    import halo
    from halo.io import ShardedField

    halo.initialize_domain_parallel(world, world)

    def refuse(*a, **k):
        raise AssertionError("ShardedField.stats must not all-reduce on the domain group (NCCL: CPU table)")

    dist.all_reduce = refuse
    x = ShardedField(north, ["t", "u", "lsm"], engine="h5netcdf")
    y = ShardedField(south, ["t", "u", "lsm"], engine="h5netcdf")  # default: rows north to south too
    stored = ShardedField(south, ["t", "u", "lsm"], engine="h5netcdf", latitude="file")
    up = ShardedField(north, ["u"], engine="h5netcdf", latitude="ascending")
    mean, std = y.stats()
    mean64, _ = y.stats(torch.float64)
    try:
        ShardedField(north, ["t", "other"], engine="h5netcdf")
        grid_error = None
    except ValueError as exc:
        grid_error = str(exc)
    sample = x.sample(1)
    return {"x": [x.sample(t, torch.float64) for t in range(T)], "y": [y.sample(t, torch.float64) for t in range(T)],
            "stored": stored.sample(0, torch.float64), "up": up.sample(0, torch.float64),
            "lat": (x.latitudes, y.latitudes, stored.latitudes, up.latitudes), "dtypes": (mean.dtype, std.dtype),
            "norm_dtype": ((sample - mean[:, None, None]) / std[:, None, None]).dtype, "mean64": mean64,
            "pinned": sample.is_pinned(), "grid_error": grid_error, "channels": x.channels}


def test_latitude_order_static_fields_and_dtypes(tmp_path):
    """An input stored 90..-90 and a target stored -90..90 give the same rows on every rank (north to south); a
    static field is the same channel at every step; a variable on another grid is named in the error; stats come
    in the samples' dtype, added on the host group; no pinning without CUDA."""
    north, south = _two_orders(tmp_path)
    results = run_on_ranks(_pairs, 2, north, south, timeout=120)
    ds = _dataset()
    lsm = np.random.default_rng(1).random((H, W))
    full = np.concatenate([ds["t"].values, ds["u"].values[:, None], np.broadcast_to(lsm, (T, 1, H, W))], axis=1)
    lats = np.linspace(90, -90, H)
    offs = split_offsets(H, 2)
    for rank, r in enumerate(results):
        rows = slice(offs[rank], offs[rank + 1])
        assert r["channels"] == ["t[0]", "t[1]", "u", "lsm"]
        for t in range(T):
            assert np.array_equal(r["x"][t].numpy(), full[t, :, rows]) and torch.equal(r["x"][t], r["y"][t])
        assert np.array_equal(r["stored"].numpy(), full[0, :, ::-1][:, rows])  # latitude="file": as stored
        assert np.array_equal(r["up"].numpy(), full[0, 2:3, ::-1][:, rows])  # latitude="ascending"
        x_lat, y_lat, stored_lat, up_lat = r["lat"]
        assert np.array_equal(x_lat, lats[rows]) and np.array_equal(y_lat, lats[rows])
        assert np.array_equal(stored_lat, lats[::-1][rows]) and np.array_equal(up_lat, lats[::-1][rows])
        assert r["dtypes"] == (torch.float32, torch.float32) and r["norm_dtype"] == torch.float32
        means = [full[:, c].mean() for c in range(3)] + [lsm.mean()]
        assert np.allclose(r["mean64"].numpy(), means, rtol=1e-12)
        assert r["pinned"] is False  # no CUDA here: pageable (with CUDA: pinned, for non_blocking copies)
        assert "variable 'other' has dims ('lat2', 'lon'), not on the grid (lat: 45, lon: 64)" in r["grid_error"]


def test_zarr_store_rewritten_while_read_is_refused(tmp_path):
    pytest.importorskip("zarr")
    from halo.io import ShardedField, rechunk

    store = str(tmp_path / "live.zarr")
    rechunk(_dataset(), store, lat_chunk=8)
    field = ShardedField(store, engine="zarr")
    first = field.sample(0, torch.float64)
    assert np.array_equal(first[2].numpy(), _dataset()["u"].values[0])
    changed = _dataset()
    changed["u"] = changed["u"] + 1
    rechunk(changed, store, lat_chunk=8)  # another process rewrites the store
    with pytest.raises(RuntimeError, match="changed since it was opened"):
        field.sample(0)
    with pytest.raises(ValueError, match="latitude= takes one of"):
        ShardedField(store, engine="zarr", latitude="north")
