"""Weather fields from files, read rank-locally: each rank reads only its latitude rows.

``halo.shard(x_full)`` needs the whole field on every rank first (0.3-0.8 GB per sample at 0.25 deg with 70-200
channels; at 0.1 deg or km scale it does not fit). :class:`ShardedField` opens a netCDF/HDF5 (or zarr) dataset
with xarray, and a sample is this rank's rows only: xarray reads lazily, so only the rank's latitude slab leaves
the file (a test counts the bytes: about 1/P of the data). Variables (and their levels) become channels,
``(time, [level,] lat, lon)`` -> ``(C, H_r, W)``; the split is halo's balanced split (any ``granularity``).

Normalisation statistics are exact over the global field: each rank sums its slab (float64), one all-reduce
adds them, every rank gets the same mean and standard deviation per channel.

Chunking decides what a slab read costs. A netCDF/HDF5 variable stored contiguously or chunked by a few latitude
rows reads ~1/P per rank; a store chunked **whole-globe per time step** (one chunk = all of lat x lon) makes every
rank read and decompress every chunk for its rows: no I/O saved. :func:`rechunk` writes a copy chunked for slabs.

Predictions go back per rank: :func:`write_rows` writes this rank's rows into one zarr array (chunks never span
two ranks' rows), with no gather.

Needs ``xarray`` and an engine (``h5netcdf``/``h5py`` or ``netCDF4``; ``zarr`` for zarr stores):
``pip install xarray h5netcdf`` (they are in the ``[io]`` and ``[test]`` extras).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .comm import all_reduce, comm_group
from .partition import split_offsets

__all__ = ["ShardedField", "rechunk", "write_rows"]

LAT_NAMES = ("lat", "latitude", "y")
LON_NAMES = ("lon", "longitude", "x")


def _dim(ds: Any, names: Sequence[str], what: str) -> str:
    for n in names:
        if n in ds.dims:
            return n
    raise ValueError(f"halo.io: no {what} dimension among {tuple(ds.dims)} (looked for {names}); pass {what}_dim=")


class ShardedField:
    """This rank's latitude rows of a dataset's variables, sample by sample (module docstring).

    Args:
        source: a path or an open file object (netCDF/HDF5), or an ``xarray.Dataset``.
        variables: the data variables to read, in channel order (default: every variable with lat and lon).
        group: the domain group (default: the manager's; none without torch.distributed: the whole field).
        granularity: rows come in blocks of this many (windows that must not straddle ranks).
        engine, time_dim, lat_dim, lon_dim: passed to / used with xarray (defaults: guessed).
    """

    def __init__(self, source: Any, variables: Sequence[str] | None = None, *, group: Any | None = None,
                 granularity: int = 1, engine: str | None = None, time_dim: str = "time", lat_dim: str | None = None,
                 lon_dim: str | None = None) -> None:
        import xarray as xr

        ds = source if isinstance(source, xr.Dataset) else xr.open_dataset(source, engine=engine, cache=False)
        self.lat = lat_dim or _dim(ds, LAT_NAMES, "lat")
        self.lon = lon_dim or _dim(ds, LON_NAMES, "lon")
        self.time = time_dim if time_dim in ds.dims else None
        names = list(variables) if variables is not None else [
            v for v in ds.data_vars if {self.lat, self.lon} <= set(ds[v].dims)]
        if not names:
            raise ValueError(f"halo.io: no variable with dims ({self.lat}, {self.lon}) in {list(ds.data_vars)}")
        self.ds, self.variables = ds, names
        self.cg = comm_group(group)
        h = ds.sizes[self.lat]
        if granularity < 1 or h % granularity:
            raise ValueError(f"halo.io: {h} latitude rows are not a whole number of blocks of {granularity}")
        offs = [o * granularity for o in split_offsets(h // granularity, self.cg.size)]
        self.rows = slice(offs[self.cg.index], offs[self.cg.index + 1])
        self.shape = (h, ds.sizes[self.lon])

    def __len__(self) -> int:
        return self.ds.sizes[self.time] if self.time else 1

    @property
    def channels(self) -> list[str]:
        """The channel names: ``var`` or ``var[level]`` for variables with a level dim."""
        out = []
        for v in self.variables:
            extra = [d for d in self.ds[v].dims if d not in (self.time, self.lat, self.lon)]
            if not extra:
                out.append(v)
            else:
                out += [f"{v}[{i}]" for i in range(int(np.prod([self.ds.sizes[d] for d in extra])))]
        return out

    def _slab(self, var: str, t: int | slice | None) -> np.ndarray:
        a = self.ds[var]
        sel = {self.lat: self.rows}
        if self.time is not None and t is not None:
            sel[self.time] = t
        a = a.isel(sel)  # lazy: only these rows are read
        lead = [d for d in a.dims if d not in (self.lat, self.lon)]
        a = a.transpose(*lead, self.lat, self.lon)
        values = np.asarray(a.values)
        return values.reshape(-1, values.shape[-2], values.shape[-1])

    def sample(self, t: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Time step ``t``: this rank's rows of every channel, ``(C, H_r, W)``."""
        if self.time is not None and not 0 <= t < len(self):
            raise IndexError(f"halo.io: time index {t} out of range for {len(self)} steps")
        parts = [self._slab(v, t) for v in self.variables]
        return torch.from_numpy(np.concatenate(parts, axis=0)).to(dtype)

    def __getitem__(self, t: int) -> torch.Tensor:
        return self.sample(t)

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and standard deviation over every time step and the *whole* field (population std),
        exact: each rank sums its slab in float64, one all-reduce adds the sums (same result on every rank)."""
        sums = []
        for v in self.variables:
            slab = self._slab(v, slice(None)).astype(np.float64)  # (time x levels, rows, W)
            lead = int(np.prod([self.ds.sizes[d] for d in self.ds[v].dims if d not in (self.time, self.lat,
                                                                                      self.lon)]))
            slab = slab.reshape(-1, lead, slab.shape[-2], slab.shape[-1])
            sums.append(np.stack([np.full(lead, slab[:, 0].size, dtype=np.float64),
                                  slab.sum(axis=(0, 2, 3)), (slab ** 2).sum(axis=(0, 2, 3))], axis=1))
        table = torch.from_numpy(np.concatenate(sums, axis=0))  # (C, 3): count, sum, sum of squares
        if self.cg.size > 1:
            all_reduce(table, self.cg, "halo.io statistics")
        count, total, squares = table.unbind(1)
        mean = total / count
        var = (squares / count - mean ** 2).clamp_min(0)
        return mean, var.sqrt()


def rechunk(source: Any, target: str, *, lat_chunk: int = 8, engine: str | None = None) -> None:
    """Write ``source`` (a path or ``xarray.Dataset``) to the zarr store ``target`` chunked ``lat_chunk`` rows by
    the whole longitude circle per time step: slab reads then cost ~1/P (needs ``zarr``)."""
    import xarray as xr

    ds = source if isinstance(source, xr.Dataset) else xr.open_dataset(source, engine=engine)
    lat = _dim(ds, LAT_NAMES, "lat")

    def chunks(var: Any) -> tuple[int, ...]:
        return tuple(min(lat_chunk, n) if d == lat else (1 if d == "time" else n) for d, n in zip(var.dims, var.shape,
                                                                                                 strict=True))

    encoding = {v: {"chunks": chunks(ds[v])} for v in ds.data_vars if lat in ds[v].dims}
    ds.to_zarr(target, mode="w", encoding=encoding)  # no dask needed: the chunking is the store's encoding


def write_rows(store: str, name: str, local: torch.Tensor, shape: tuple[int, ...], index: tuple[int, ...] = (), *,
               group: Any | None = None) -> None:
    """Write this rank's rows of a field into one zarr array shared by the domain group (predictions, per rank).

    ``local``: this rank's ``(..., H_r, W)`` rows of a field whose whole array has ``shape`` (leading dims, e.g.
    ``(time, channel, H, W)``); ``index``: where along the leading dims this field goes (``(t,)`` writes
    ``array[t, :, rows, :]``). The array is created on first use by group rank 0 (others wait), chunked so that no
    chunk spans two ranks' rows (its latitude chunk divides every rank's first row), so the ranks' writes never
    touch the same chunk. Every rank of the group calls it; ``halo.gather`` is never needed.
    """
    import math

    import zarr

    cg = comm_group(group)
    h = shape[-2]
    offs = split_offsets(h, cg.size)
    lat_chunk = 0
    for o in offs[1:-1]:
        lat_chunk = math.gcd(lat_chunk, o)
    lat_chunk = lat_chunk or h
    rows = slice(offs[cg.index], offs[cg.index + 1])
    if tuple(local.shape[-2:]) != (rows.stop - rows.start, shape[-1]):
        raise ValueError(f"halo.io.write_rows: rank {cg.index} holds rows {rows.start}..{rows.stop} of {h}, so "
                         f"expects ({rows.stop - rows.start}, {shape[-1]}) at the end, got {tuple(local.shape)}")
    chunks = (*([1] * len(index)), *shape[len(index):-2], lat_chunk, shape[-1])
    dtype = str(local.dtype).removeprefix("torch.")
    if cg.index == 0:
        root = zarr.open_group(store, mode="a")
        if name not in root:
            root.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)
    if cg.size > 1:
        import torch.distributed as dist

        dist.barrier(group=cg.group)
    arr = zarr.open_group(store, mode="a")[name]
    arr[(*index, ..., rows, slice(None))] = local.detach().cpu().numpy()
    if cg.size > 1:
        dist.barrier(group=cg.group)  # every rank's rows are in the store when any rank returns
