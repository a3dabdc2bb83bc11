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
        mesh: a latitude x longitude ``halo.DomainMesh((ph, pw))`` instead of ``group``: this rank reads its block,
            rows over the mesh's first axis and longitudes over the second (both balanced splits), ``(C, H_r, W_r)``
            as ``halo.shard_2d`` would cut it.
        engine, time_dim, lat_dim, lon_dim: passed to / used with xarray (defaults: guessed).
    """

    def __init__(self, source: Any, variables: Sequence[str] | None = None, *, group: Any | None = None,
                 granularity: int = 1, engine: str | None = None, time_dim: str = "time", lat_dim: str | None = None,
                 lon_dim: str | None = None, mesh: Any | None = None) -> None:
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
        h, w = ds.sizes[self.lat], ds.sizes[self.lon]
        if granularity < 1 or h % granularity:
            raise ValueError(f"halo.io: {h} latitude rows are not a whole number of blocks of {granularity}")
        parts_h, index_h, self.cols = _layout(group, mesh, w)
        self.cg = comm_group(group if mesh is None else mesh.domain_group)
        if parts_h is None:
            parts_h, index_h = self.cg.size, self.cg.index
        offs = [o * granularity for o in split_offsets(h // granularity, parts_h)]
        self.rows = slice(offs[index_h], offs[index_h + 1])
        self.shape = (h, w)

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
        sel = {self.lat: self.rows, self.lon: self.cols}
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


def _layout(group: Any | None, mesh: Any | None, w: int) -> tuple[int | None, int, slice]:
    """``(parts along H, this rank's H index, its longitudes)``; ``parts`` ``None``: H over the whole group."""
    if mesh is None:
        return None, 0, slice(0, w)
    from .mesh import mesh_2d

    if mesh_2d(mesh) is None:
        raise ValueError(f"halo.io: mesh= takes a DomainMesh with two domain axes, got {mesh!r}")
    if group is not None:
        raise ValueError("halo.io: pass group= (latitude rows) or mesh= (latitude x longitude blocks), not both")
    offs = split_offsets(w, mesh.axis_size(1))
    j = mesh.axis_rank(1)
    return mesh.axis_size(0), mesh.axis_rank(0), slice(offs[j], offs[j + 1])


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
               group: Any | None = None, mesh: Any | None = None) -> None:
    """Write this rank's rows of a field into one zarr array shared by the domain group (predictions, per rank).

    ``local``: this rank's ``(..., H_r, W)`` rows of a field whose whole array has ``shape`` (leading dims, e.g.
    ``(time, channel, H, W)``); ``index``: where along the leading dims this field goes (``(t,)`` writes
    ``array[t, :, rows, :]``). The array is created on first use by group rank 0 (others wait), chunked so that no
    chunk spans two ranks' rows (its latitude chunk divides every rank's first row), so the ranks' writes never
    touch the same chunk. Every rank of the group calls it; ``halo.gather`` is never needed. With ``mesh=`` (a
    latitude x longitude ``DomainMesh``) each rank writes its block, chunks split along longitude the same way.
    """
    import math

    import zarr

    h, w = shape[-2], shape[-1]
    parts_h, index_h, cols = _layout(group, mesh, w)
    cg = comm_group(group if mesh is None else mesh.domain_group)
    if parts_h is None:
        parts_h, index_h = cg.size, cg.index
    offs = split_offsets(h, parts_h)

    def chunk(starts: list[int], n: int) -> int:  # divides every rank's first row (column): no chunk spans two ranks
        c = 0
        for o in starts:
            c = math.gcd(c, o)
        return c or n

    lat_chunk = chunk(offs[1:-1], h)
    lon_chunk = chunk(split_offsets(w, mesh.axis_size(1))[1:-1], w) if mesh is not None else w
    rows = slice(offs[index_h], offs[index_h + 1])
    if tuple(local.shape[-2:]) != (rows.stop - rows.start, cols.stop - cols.start):
        raise ValueError(f"halo.io.write_rows: rank {cg.index} holds rows {rows.start}..{rows.stop} of {h} and "
                         f"columns {cols.start}..{cols.stop} of {w}, so expects ({rows.stop - rows.start}, "
                         f"{cols.stop - cols.start}) at the end, got {tuple(local.shape)}")
    chunks = (*([1] * len(index)), *shape[len(index):-2], lat_chunk, lon_chunk)
    dtype = str(local.dtype).removeprefix("torch.")
    if cg.index == 0:
        root = zarr.open_group(store, mode="a")
        if name not in root:
            root.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)
    if cg.size > 1:
        import torch.distributed as dist

        dist.barrier(group=cg.group)
    arr = zarr.open_group(store, mode="a")[name]
    arr[(*index, ..., rows, cols)] = local.detach().cpu().numpy()
    if cg.size > 1:
        dist.barrier(group=cg.group)  # every rank's rows are in the store when any rank returns
