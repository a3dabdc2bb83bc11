"""Weather fields from files, read rank-locally: each rank reads only its latitude rows; writes all-or-nothing.

``halo.shard(x_full)`` needs the whole field on every rank first (0.3-0.8 GB per sample at 0.25 deg with 70-200
channels; at 0.1 deg or km scale it does not fit). :class:`ShardedField` opens a netCDF/HDF5 (or zarr) dataset
with xarray, and a sample is this rank's rows only: xarray reads lazily, so only the rank's latitude slab leaves
the file (a test counts the bytes: about 1/P of the data). Variables (and their levels) become channels,
``(time, [level,] lat, lon)`` -> ``(C, H_r, W)``; the split is halo's balanced split (any ``granularity``).
Rows come north to south whatever the file's order (``latitude="descending"``, the ERA5 order), so an input file
stored 90..-90 and a target file stored -90..90 pair the same latitudes. A variable without a time dim (a
land-sea mask, orography) is the same channel at every step.

Normalisation statistics are exact over the global field: each rank sums its slab (float64), the ranks' sums are
all-gathered on the host side group and added in group order, every rank gets the same mean and standard
deviation per channel (returned in the samples' dtype, so ``(x - mean) / std`` stays float32).

Chunking decides what a slab read costs. A netCDF/HDF5 variable stored contiguously or chunked by a few latitude
rows reads ~1/P per rank; a store chunked **whole-globe per time step** (one chunk = all of lat x lon) makes every
rank read and decompress every chunk for its rows: no I/O saved. :func:`rechunk` writes a copy chunked for slabs.

Predictions go back per rank: :func:`write_rows` writes this rank's rows into one zarr array, with no gather,
**all or nothing per step**: a step is marked complete (a per-step marker of this run, written last by one rank
after every rank's rows are in) and readers ask :func:`complete_steps` / :func:`read_step`; a step a rank died
in, or a step of an older run in the same store, is never reported complete. (The writes are
:mod:`halo.io_write`, the runs and step markers :mod:`halo.io_steps`; their public names are re-exported here.)

Needs ``xarray`` and an engine (``h5netcdf``/``h5py`` or ``netCDF4``; ``zarr`` for zarr stores):
``pip install xarray h5netcdf`` (they are in the ``[io]`` and ``[test]`` extras).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .comm import all_gather_host, comm_group
from .io_steps import complete_steps, read_step
from .io_write import rank_block, write_rows
from .partition import split_offsets

__all__ = ["ShardedField", "complete_steps", "read_step", "rechunk", "write_rows"]

LAT_NAMES = ("lat", "latitude", "y")
LON_NAMES = ("lon", "longitude", "x")
LATITUDE_ORDERS = ("descending", "ascending", "file")


def _dim(ds: Any, names: Sequence[str], what: str) -> str:
    for n in names:
        if n in ds.dims:
            return n
    raise ValueError(f"halo.io: no {what} dimension among {tuple(ds.dims)} (looked for {names}); pass {what}_dim=")


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory where CUDA is available (so ``.to(cuda, non_blocking=True)`` is asynchronous);
    as it is without CUDA (pinning needs a CUDA driver)."""
    return t.pin_memory() if torch.cuda.is_available() else t


class ShardedField:
    """This rank's latitude rows of a dataset's variables, sample by sample (module docstring).

    Args:
        source: a path or an open file object (netCDF/HDF5), or an ``xarray.Dataset``.
        variables: the data variables to read, in channel order (default: every variable with lat and lon). Each
            must have the latitude and longitude dims; one without the time dim is the same at every step.
        group: the domain group (default: the manager's; none without torch.distributed: the whole field).
        granularity: rows come in blocks of this many (windows that must not straddle ranks).
        mesh: a latitude x longitude ``halo.DomainMesh((ph, pw))`` instead of ``group``: this rank reads its block,
            rows over the mesh's first axis and longitudes over the second (both balanced splits), ``(C, H_r, W_r)``
            as ``halo.shard_2d`` would cut it.
        latitude: the row order of samples: ``"descending"`` (default: north to south, 90..-90, as ERA5 stores it)
            or ``"ascending"``, whatever the file's order (a file in the other order is read mirrored: rank 0
            still gets the northernmost rows); ``"file"``: as stored. Needs a monotonic latitude coordinate; a
            dataset without one is read as stored. :attr:`latitudes` are this rank's rows' latitudes.
        engine, time_dim, lat_dim, lon_dim: passed to / used with xarray (defaults: guessed).

    Reading a zarr store while another process writes it is not supported: for a store opened from a path, a
    changed array metadata (a resize, a rewrite, ``to_zarr(mode="w")``) is detected at the next sample and raises;
    chunks rewritten in place without a metadata change cannot be seen. Read stores written by
    :func:`write_rows` through :func:`read_step` (complete steps only).
    """

    def __init__(self, source: Any, variables: Sequence[str] | None = None, *, group: Any | None = None,
                 granularity: int = 1, engine: str | None = None, time_dim: str = "time", lat_dim: str | None = None,
                 lon_dim: str | None = None, mesh: Any | None = None, latitude: str = "descending") -> None:
        import xarray as xr

        if latitude not in LATITUDE_ORDERS:
            raise ValueError(f"halo.io: latitude= takes one of {LATITUDE_ORDERS}, got {latitude!r}")
        store = _zarr_store_path(source, engine)
        ds = source if isinstance(source, xr.Dataset) else xr.open_dataset(source, engine=engine, cache=False)
        self.lat = lat_dim or _dim(ds, LAT_NAMES, "lat")
        self.lon = lon_dim or _dim(ds, LON_NAMES, "lon")
        self.time = time_dim if time_dim in ds.dims else None
        grid = {self.lat, self.lon}
        if variables is not None:
            names = list(variables)
            for v in names:
                if v not in ds.data_vars:
                    raise ValueError(f"halo.io: no variable {v!r} in the dataset; it has {list(ds.data_vars)}")
                if not grid <= set(ds[v].dims):
                    raise ValueError(f"halo.io: variable {v!r} has dims {tuple(ds[v].dims)}, not on the grid "
                                     f"({self.lat}: {ds.sizes[self.lat]}, {self.lon}: {ds.sizes[self.lon]}) of the "
                                     f"other variables (another grid, or pass lat_dim=/lon_dim=); read it with its "
                                     f"own ShardedField")
        else:
            names = [v for v in ds.data_vars if grid <= set(ds[v].dims)]
        if not names:
            raise ValueError(f"halo.io: no variable with dims ({self.lat}, {self.lon}) in {list(ds.data_vars)}")
        self.ds, self.variables = ds, names
        # (store, metadata files, their fingerprint) of a zarr store opened from a path: checked at every read
        files = [] if store is None else _meta_files(store, [*names, self.lat, self.lon])
        self._watch = None if store is None else (store, files, _fingerprint(files))
        h, w = ds.sizes[self.lat], ds.sizes[self.lon]
        if granularity < 1 or h % granularity:
            raise ValueError(f"halo.io: {h} latitude rows are not a whole number of blocks of {granularity}")
        parts_h, index_h, self.cols = rank_block(group, mesh, w)
        self.cg = comm_group(group if mesh is None else mesh.domain_group)
        if parts_h is None:
            parts_h, index_h = self.cg.size, self.cg.index
        offs = [o * granularity for o in split_offsets(h // granularity, parts_h)]
        self.rows = slice(offs[index_h], offs[index_h + 1])
        self.shape = (h, w)
        self.flipped, lats = _latitude_order(ds, self.lat, latitude)
        # the file's rows this rank reads (mirrored when the file's order is the other one)
        self._file_rows = slice(h - self.rows.stop, h - self.rows.start) if self.flipped else self.rows
        self.latitudes = None if lats is None else (lats[::-1] if self.flipped else lats)[self.rows].copy()

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
        sel = {self.lat: self._file_rows, self.lon: self.cols}
        static = self.time is None or self.time not in a.dims
        if not static and t is not None:
            sel[self.time] = t
        a = a.isel(sel)  # lazy: only these rows are read
        # time first, then the levels in the file's order (the channels): stats() reads every step as one slab
        lead = [d for d in a.dims if d == self.time] + [d for d in a.dims if d not in (self.time, self.lat, self.lon)]
        a = a.transpose(*lead, self.lat, self.lon)
        values = np.asarray(a.values)
        if self.flipped:
            values = values[..., ::-1, :]
        values = values.reshape(-1, values.shape[-2], values.shape[-1])
        if static and isinstance(t, slice) and self.time is not None:  # every step: the same field, once per step
            values = values[None]
        return values

    def _check_unchanged(self) -> None:
        if self._watch is not None:
            if _fingerprint(self._watch[1]) != self._watch[2]:
                raise RuntimeError(f"halo.io: the zarr store {self._watch[0]} changed since it was opened (array "
                                   f"metadata rewritten): reading a store while it is written is not supported, a "
                                   f"sample could mix two versions; open it again once the writer is done")

    def sample(self, t: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Time step ``t``: this rank's rows of every channel, ``(C, H_r, W)`` (pinned memory where CUDA is
        available)."""
        if self.time is not None and not 0 <= t < len(self):
            raise IndexError(f"halo.io: time index {t} out of range for {len(self)} steps")
        self._check_unchanged()
        parts = [self._slab(v, t) for v in self.variables]
        out = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0))).to(dtype)
        self._check_unchanged()
        return _pinned(out)

    def __getitem__(self, t: int) -> torch.Tensor:
        return self.sample(t)

    def stats(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and standard deviation over every time step and the *whole* field (population std),
        exact: each rank sums its slab in float64, the sums are all-gathered on the host side group (CPU, bounded
        by ``halo.set_timeout``; a gloo group beside an NCCL domain group) and added in group order, so every rank
        gets the same numbers. Returned in ``dtype`` (default float32, the samples' default: ``(x - mean) / std``
        keeps the samples' dtype); ask ``torch.float64`` for the exact values."""
        self._check_unchanged()
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
            every = torch.zeros(self.cg.size, *table.shape, dtype=torch.float64)
            table = all_gather_host(table, every, self.cg, "halo.io statistics").sum(0)
        count, total, squares = table.unbind(1)
        mean = total / count
        var = (squares / count - mean ** 2).clamp_min(0)
        return mean.to(dtype), var.sqrt().to(dtype)


def _latitude_order(ds: Any, lat: str, order: str) -> tuple[bool, np.ndarray | None]:
    """``(read mirrored?, the file's latitudes or None)`` for the wanted row order."""
    if lat not in ds.coords:
        return False, None
    lats = np.asarray(ds[lat].values, dtype=np.float64).reshape(-1)
    if lats.size < 2:
        return False, lats
    steps = np.diff(lats)
    if not (np.all(steps > 0) or np.all(steps < 0)):
        if order == "file":
            return False, lats
        raise ValueError(f"halo.io: the latitude coordinate {lat!r} is not strictly monotonic (first values "
                         f"{lats[:4].tolist()}); pass latitude='file' to read rows as stored")
    descending = bool(steps[0] < 0)
    if order == "file":
        return False, lats
    return descending != (order == "descending"), lats


def _zarr_store_path(source: Any, engine: str | None) -> str | None:
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = os.fspath(source)
    if engine == "zarr" or (os.path.isdir(path) and (os.path.exists(os.path.join(path, "zarr.json"))
                                                     or os.path.exists(os.path.join(path, ".zgroup")))):
        return path
    return None


_META = ("zarr.json", ".zmetadata", ".zgroup", ".zarray", ".zattrs")


def _meta_files(path: str, arrays: Sequence[str]) -> list[str]:
    """The metadata files of a zarr store's root and of ``arrays`` (v2 or v3 names; a few stats per check, no
    directory listing)."""
    return [os.path.join(path, f) for f in _META] + [os.path.join(path, a, f) for a in arrays for f in _META]


def _fingerprint(files: Sequence[str]) -> tuple:
    """Inode, modification time and size of each file (``None`` where absent): zarr rewrites metadata by rename,
    a new inode."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


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
