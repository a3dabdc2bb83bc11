"""Weather fields from files, read rank-locally: each rank reads only its latitude rows; writes all-or-nothing.

``halo.shard(x_full)`` needs the whole field on every rank first (0.3-0.8 GB per sample at 0.25 deg with 70-200
channels; at 0.1 deg or km scale it does not fit). :class:`ShardedField` opens a netCDF/HDF5 (or zarr) dataset
with xarray, and a sample is this rank's rows only: xarray reads lazily, so only the rank's latitude slab leaves
the file (a test counts the bytes: about 1/P of the data). Variables (and their levels) become channels,
``(time, [level,] lat, lon)`` -> ``(C, H_r, W)``; the split is halo's balanced split (any ``granularity``).
Rows come north to south whatever the file's order (``latitude="descending"``, the ERA5 order), so an input file
stored 90..-90 and a target file stored -90..90 pair the same latitudes; columns come east from 0 whatever the
file's convention (``longitude="0..360"``: a global grid on -180..175 is read 0..355, rolled), so a file on
-180..175 and one on 0..355 pair the same longitudes (:mod:`halo.io._grid`). A variable without a time dim (a
land-sea mask, orography) is the same channel at every step. Every rank of the domain group must open the same
field: its grid, steps, channels, coordinates and options are agreed when it is opened (the same error on every
rank otherwise).

Normalisation statistics are exact over the global field and NaN-aware: each rank counts and sums the valid
(non-NaN) points of its slab (float64), the ranks' tables are all-gathered on the host side group and combined in
group order, every rank gets the same mean and standard deviation per channel (returned in the samples' dtype, so
``(x - mean) / std`` stays float32). A sample holds the data as stored, NaN where the file has no value (SST over
land); :meth:`ShardedField.normalize` makes samples ``(x - mean) / std`` with NaN filled (0 by default, the mean),
:meth:`ShardedField.nan_mask` says where. Each sample carries ``halo_sample_key`` (which sample, which version of the
store) for the converted model's check that the ranks of a domain group look at the same sample; sampling over the
data-parallel ranks is :class:`halo.DomainSampler`. The sample path makes no CUDA call (DataLoader workers: pin with
``DataLoader(pin_memory=True)``), and a store written while it is read is detected (:mod:`halo.io._watch`).

Chunking decides what a slab read costs. A netCDF/HDF5 variable stored contiguously or chunked by a few latitude
rows reads ~1/P per rank; a store chunked **whole-globe per time step** (one chunk = all of lat x lon) makes every
rank read and decompress every chunk for its rows: no I/O saved. :func:`rechunk` writes a copy chunked for slabs.

Predictions go back per rank: :func:`write_rows` writes this rank's rows into one zarr array, with no gather,
**all or nothing per step**: a step is marked complete (a per-step marker of this run, written last by one rank
after every rank's rows are in) and readers ask :func:`complete_steps` / :func:`read_step`; a step a rank died
in, or a step of an older run in the same store, is never reported complete. (The writes are
:mod:`halo.io._write`, the runs and step markers :mod:`halo.io._steps`; their public names are re-exported here.)

Needs ``xarray`` and an engine (``h5netcdf``/``h5py`` or ``netCDF4``; ``zarr`` for zarr stores):
``pip install xarray h5netcdf`` (they are in the ``[io]`` and ``[test]`` extras).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..dist.comm import all_gather_host, comm_group
from ..dist.transport import all_gather_object
from ..plan.partition import split_offsets
from ._grid import LATITUDE_ORDERS, LONGITUDE_ORDERS, file_runs, latitude_order, longitude_order, read_block
from ._steps import agree_words, complete_steps, read_step
from ._watch import StoreWatch, zarr_store_path
from ._write import rank_block, write_rows
from .sampler import DomainSampler, data_parallel_sampler_args

__all__ = ["DomainSampler", "ShardedField", "collate", "complete_steps", "data_parallel_sampler_args", "read_step",
           "rechunk", "write_rows"]

LAT_NAMES = ("lat", "latitude", "y")
LON_NAMES = ("lon", "longitude", "x")


def _dim(ds: Any, names: Sequence[str], what: str) -> str:
    for n in names:
        if n in ds.dims:
            return n
    raise ValueError(f"halo.io: no {what} dimension among {tuple(ds.dims)} (looked for {names}); pass {what}_dim=")


def _digest(*parts: Any) -> int:
    """A signed 63-bit digest of ``parts`` (what ranks compare in one int64 word); arrays by their bytes (a repr
    would summarise a long coordinate as its first and last values)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p.astype(str) if p.dtype.kind in "OUSMm" else p)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little", signed=True) >> 1


#: what the ranks of a domain group agree on when they open a field (the words of :meth:`ShardedField._agree`)
_AGREED = ("failed", "latitude rows", "longitude columns", "time steps", "channels", "granularity", "latitude=",
           "longitude=", "variables and channels", "coordinates", "watch=")


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
        longitude: the column order: ``"0..360"`` (default: east from 0) or ``"-180..180"`` (east from -180),
            whatever the file's convention: a global grid stored on -180..175 is read 0..355, its columns rolled
            (:mod:`halo.io._grid`; a regional grid is never rolled); ``"file"``: as stored. :attr:`longitudes` are
            this rank's columns' longitudes, in the convention's range.
        retries: how many times a sample whose store changed while it was read is read again before
            ``RuntimeError`` (zarr stores and files opened from a path: :mod:`halo.io._watch`).
        watch: check the store's version around each sample (default). Costs two ``os.stat`` per chunk file of
            the step (1820 files, 20 variables of 91 chunks: ~20 ms each time on the shared CI machine); ``False``
            for an archive nobody writes (and then ``halo_sample_key`` carries no version).
        engine: xarray's engine (default: guessed).
        time_dim: the name of the time dim (default: guessed).
        lat_dim: the name of the latitude dim (default: guessed).
        lon_dim: the name of the longitude dim (default: guessed).

    Every rank of the domain group opens the same field: the grid, the number of steps and channels, the variables,
    the coordinates and the options are agreed when it is opened (a file that differs on one rank, or an error
    opening it there, raises the same ``ValueError`` on every rank).

    **Missing values.** A variable with NaNs (SST over land) keeps them: :meth:`sample` returns the values as
    stored, NaN included; :meth:`stats` is NaN-aware (over the valid points only, exact across ranks; a channel
    without a single valid point is refused, named); :meth:`normalize` makes later samples ``(x - mean) / std``
    with NaN replaced by ``fill_nan`` (default 0: the mean, what weather pipelines feed a model where a field has
    no value), and :meth:`nan_mask` gives where the data was missing (to feed as a channel or mask a loss).

    **Samples carry their identity.** Each sample has the attribute ``halo_sample_key`` (a ``str``: the variables,
    the time index and time value, and the version of the store's files that were read): the converted model's
    entry compares it over the domain group, so ranks that read different samples (or one sample on either side of
    a write) are refused. A tensor attribute does not survive a DataLoader worker or a copy: :func:`collate` gives
    the batch's keys beside the batch.

    **No CUDA in the sample path** (it runs in forked DataLoader workers, where CUDA cannot be re-initialised): the
    samples are in pageable memory; pin them with ``DataLoader(pin_memory=True)``.

    **A store written while it is read** is detected (:mod:`halo.io._watch`): a metadata change raises; chunk files
    of the step that change between a sample's first and last read make it be read again (``retries``), then raise.
    Read stores written by :func:`write_rows` through :func:`read_step` (complete steps only).
    """

    def __init__(self, source: Any, variables: Sequence[str] | None = None, *, group: Any | None = None,
                 granularity: int = 1, engine: str | None = None, time_dim: str = "time", lat_dim: str | None = None,
                 lon_dim: str | None = None, mesh: Any | None = None, latitude: str = "descending",
                 longitude: str = "0..360", retries: int = 2, watch: bool = True) -> None:
        if latitude not in LATITUDE_ORDERS:
            raise ValueError(f"halo.io: latitude= takes one of {LATITUDE_ORDERS}, got {latitude!r}")
        if longitude not in LONGITUDE_ORDERS:
            raise ValueError(f"halo.io: longitude= takes one of {LONGITUDE_ORDERS}, got {longitude!r}")
        self.cg = comm_group(group if mesh is None else mesh.domain_group)
        self.retries = int(retries)
        self._norm: tuple[np.ndarray, np.ndarray, float | None] | None = None
        failed: Exception | None = None
        try:
            self._open(source, variables, group, granularity, engine, time_dim, lat_dim, lon_dim, mesh, latitude,
                       longitude, watch)
        except Exception as exc:  # noqa: BLE001 - the same error on every rank: agreed below
            failed = exc
        self._agree(failed, (latitude, longitude, granularity, watch))

    def _open(self, source: Any, variables: Sequence[str] | None, group: Any, granularity: int, engine: str | None,
              time_dim: str, lat_dim: str | None, lon_dim: str | None, mesh: Any, latitude: str,
              longitude: str, watch: bool) -> None:
        import xarray as xr

        store = zarr_store_path(source, engine)
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
        path = None if not watch else source if store is not None else (source if isinstance(source, str) else None)
        coords = [c for c in (self.lat, self.lon, self.time) if c is not None and c in ds.coords]
        self._watch = None if path is None else StoreWatch(str(path), ds, names, coords, self.time, store is not None)
        h, w = ds.sizes[self.lat], ds.sizes[self.lon]
        if granularity < 1 or h % granularity:
            raise ValueError(f"halo.io: {h} latitude rows are not a whole number of blocks of {granularity}")
        parts_h, index_h, self.cols = rank_block(group, mesh, w)
        if parts_h is None:
            parts_h, index_h = self.cg.size, self.cg.index
        offs = [o * granularity for o in split_offsets(h // granularity, parts_h)]
        self.rows = slice(offs[index_h], offs[index_h + 1])
        self.shape = (h, w)
        row_perm, lats = latitude_order(ds, self.lat, latitude)
        col_perm, lons = longitude_order(ds, self.lon, longitude)
        self.flipped = bool(h > 1 and row_perm[0] > row_perm[-1])  # rows read mirrored
        self.rolled = int(col_perm[0])  # the file's column read first (0: not rolled)
        # the file's rows and columns this rank reads, as contiguous runs (mirrored, or two runs where rolled)
        self._row_runs = file_runs(row_perm[self.rows])
        self._col_runs = file_runs(col_perm[self.cols])
        self.latitudes = None if lats is None else lats[self.rows].copy()
        self.longitudes = None if lons is None else lons[self.cols].copy()
        tvals = np.asarray(ds[self.time].values) if self.time is not None and self.time in ds.coords else None
        self._times = tvals
        self._name = f"{','.join(names)}" if len(names) <= 4 else f"{len(names)} variables {_digest(names):x}"
        self._words = [0, h, w, len(self), len(self.channels), granularity, 0, 0, _digest(names, self.channels),
                       _digest(lats, lons, tvals)]

    def _agree(self, failed: Exception | None, options: tuple) -> None:
        """Every rank opened the same field, or every rank raises the same error (class docstring)."""
        what = "halo.io.ShardedField"
        words = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0] if failed is not None else [*self._words, 0]
        words[6], words[7] = LATITUDE_ORDERS.index(options[0]), LONGITUDE_ORDERS.index(options[1])
        words[5], words[10] = int(options[2]), int(bool(options[3]))
        cg = self.cg
        if cg.size == 1:
            if failed is not None:
                raise failed
            return
        table = agree_words(words, cg, what)
        bad = [j for j in range(cg.size) if table[j, 0]]
        if bad:
            texts = all_gather_object(None if failed is None else f"{type(failed).__name__}: {failed}", cg, what)
            j = bad[0]
            others = f" (and on {', '.join(cg.describe(q) for q in bad[1:])})" if len(bad) > 1 else ""
            raise ValueError(f"{what}: opening the field failed on {cg.describe(j)}{others}: {texts[j]}") from failed
        for j in range(1, cg.size):
            diff = [f"{n} {int(table[0, k])} vs {int(table[j, k])}" if k < 8 or k == 10 else n
                    for k, n in enumerate(_AGREED) if table[j, k] != table[0, k]]
            if diff:
                raise ValueError(f"{what}: the ranks of the domain group opened different fields: {cg.describe(0)} "
                                 f"and {cg.describe(j)} differ in {'; '.join(diff)}; every rank must open the same "
                                 f"file with the same variables and options")

    def __getstate__(self) -> dict:
        """Pickled without the process group (a ``spawn`` DataLoader worker reads samples; :meth:`stats` runs in
        the training process)."""
        state = dict(self.__dict__)
        state["cg"] = None
        return state

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

    def _read(self, var: str, t: int | slice | None) -> np.ndarray:
        """This rank's block of ``var`` at step ``t`` (every step for a slice), ``([time x] levels, rows, cols)`` in
        the read order: the file's rows and columns it needs only (lazy reads of contiguous runs)."""
        a = self.ds[var]
        static = self.time is None or self.time not in a.dims
        if not static and t is not None:
            a = a.isel({self.time: t})
        # time first, then the levels in the file's order (the channels): stats() reads every step as one slab
        lead = [d for d in a.dims if d == self.time] + [d for d in a.dims if d not in (self.time, self.lat, self.lon)]
        a = a.transpose(*lead, self.lat, self.lon)

        def values_of(rows: slice, cols: slice) -> np.ndarray:
            return np.asarray(a.isel({self.lat: rows, self.lon: cols}).values)  # lazy: only these rows are read

        values = read_block(values_of, self._row_runs, self._col_runs)
        values = values.reshape(-1, values.shape[-2], values.shape[-1])
        if static and isinstance(t, slice) and self.time is not None:  # every step: the same field, once per step
            values = values[None]
        return values

    def _raw(self, t: int) -> tuple[np.ndarray, str]:
        """Step ``t``'s channels ``(C, H_r, W_r)`` as stored, and the version read (one consistent version: read
        again while the store changed during the reads)."""
        if self.time is not None and not 0 <= t < len(self):
            raise IndexError(f"halo.io: time index {t} out of range for {len(self)} steps")
        watch = self._watch
        if watch is None:
            return np.concatenate([self._read(v, t) for v in self.variables], axis=0), ""
        watch.check_meta()
        files = watch.step_files(t)
        for _ in range(self.retries + 1):
            before = watch.version(files)
            parts = [self._read(v, t) for v in self.variables]
            after = watch.version(files)
            if after == before:
                return np.concatenate(parts, axis=0), watch.digest(after)
            watch.check_meta()  # a metadata change: raise (the opened dataset is stale)
        raise RuntimeError(f"halo.io: the store {watch.path} changed while step {t} was read, on each of "
                           f"{self.retries + 1} attempts (another process is writing it): a sample would mix two "
                           f"versions; read it once the writer is done (or raise retries=)")

    def sample(self, t: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Time step ``t``: this rank's rows of every channel, ``(C, H_r, W)``, with ``halo_sample_key`` set (class
        docstring). As stored (NaN where the data is missing), or normalised after :meth:`normalize`. Pageable
        memory, no CUDA call (pin in the DataLoader)."""
        values, version = self._raw(t)
        if self._norm is not None:
            mean, std, fill = self._norm
            values = (values.astype(np.float64) - mean) / std
            if fill is not None:
                values = np.where(np.isnan(values), fill, values)
        out = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        out.halo_sample_key = self.sample_key(t, version)
        return out

    def sample_key(self, t: int, version: str = "") -> str:
        """The identity of step ``t`` (what ``sample(t).halo_sample_key`` holds): the variables, the index, the time
        coordinate's value and the version of the files read; the same on every rank of the domain group."""
        when = f" time={self._times[t]}" if self._times is not None and self._times.ndim == 1 else ""
        return f"halo.io[{self._name}] t={t}{when}{f' v={version}' if version else ''}"

    def __getitem__(self, t: int) -> torch.Tensor:
        return self.sample(t)

    def nan_mask(self, t: int = 0) -> torch.Tensor:
        """Where step ``t``'s data is missing (NaN in the file), ``(C, H_r, W)`` bool: True where it is NaN."""
        return torch.from_numpy(np.isnan(self._raw(t)[0]))

    def normalize(self, mean: torch.Tensor, std: torch.Tensor, *, fill_nan: float | None = 0.0) -> ShardedField:
        """Make later samples ``(x - mean) / std`` per channel (computed in float64, returned in the sample's dtype)
        with NaN replaced by ``fill_nan`` (``None``: kept). ``mean``/``std``: ``C`` values, e.g. :meth:`stats`'s
        (the same on every rank); a non-positive or non-finite ``std`` is refused, naming the channel. Returns
        ``self``."""
        m = np.asarray(torch.as_tensor(mean, dtype=torch.float64).reshape(-1))
        s = np.asarray(torch.as_tensor(std, dtype=torch.float64).reshape(-1))
        names = self.channels
        if m.shape != (len(names),) or s.shape != (len(names),):
            raise ValueError(f"halo.io.ShardedField.normalize: expected {len(names)} means and stds (one per channel "
                             f"{names}), got {m.size} and {s.size}")
        bad = [f"{names[c]} (std {s[c]})" for c in range(len(names)) if not (np.isfinite(s[c]) and s[c] > 0)]
        bad += [f"{names[c]} (mean {m[c]})" for c in range(len(names)) if not np.isfinite(m[c])]
        if bad:
            raise ValueError(f"halo.io.ShardedField.normalize: expected a finite mean and a positive finite std per "
                             f"channel, got {', '.join(bad)}")
        self._norm = (m[:, None, None], s[:, None, None], None if fill_nan is None else float(fill_nan))
        return self

    def stats(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and standard deviation over every time step and the *whole* field (population std),
        over the valid (non-NaN) points only, exact: each rank counts and sums its slab in float64, the tables are
        all-gathered on the host side group (CPU, bounded by ``halo.set_timeout``; a gloo group beside an NCCL
        domain group) and added in group order, so every rank gets the same numbers. A channel without one valid
        point is refused, named (the same ``ValueError`` on every rank). Returned in ``dtype`` (default float32,
        the samples' default: ``(x - mean) / std`` keeps the samples' dtype); ask ``torch.float64`` for the exact
        values. Collective over the domain group: call it in the training process, on every rank."""
        if self.cg is None:
            raise RuntimeError("halo.io.ShardedField.stats: this copy of the field was pickled (a DataLoader "
                               "worker) and has no process group; call stats() in the training process")
        failed: Exception | None = None
        table = torch.zeros(len(self.channels), 3, dtype=torch.float64)
        try:
            if self._watch is not None:
                self._watch.check_meta()
            sums = []
            for v in self.variables:
                slab = self._read(v, slice(None)).astype(np.float64)  # (time x levels, rows, W)
                lead = int(np.prod([self.ds.sizes[d] for d in self.ds[v].dims if d not in (self.time, self.lat,
                                                                                          self.lon)]))
                slab = slab.reshape(-1, lead, slab.shape[-2], slab.shape[-1])
                valid = ~np.isnan(slab)
                count = valid.sum(axis=(0, 2, 3)).astype(np.float64)
                total = np.where(valid, slab, 0.0).sum(axis=(0, 2, 3))
                local = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
                dev = np.where(valid, slab - local[None, :, None, None], 0.0)
                sums.append(np.stack([count, total, (dev ** 2).sum(axis=(0, 2, 3))], axis=1))
            # (C, 3): valid count, sum, squared deviations from this rank's own mean (no cancellation: 290 K
            # with a 3 K spread loses 4 digits as a sum of squares)
            table = torch.from_numpy(np.concatenate(sums, axis=0))
            if self._watch is not None:
                self._watch.check_meta()
        except Exception as exc:  # noqa: BLE001 - every rank learns that a rank could not read its slab
            failed = exc
        if self.cg.size > 1:
            status = agree_words([int(failed is not None)], self.cg, "halo.io statistics")
            bad = [j for j in range(self.cg.size) if status[j, 0]]
            if bad:
                raise RuntimeError(f"halo.io.ShardedField.stats: reading the field failed on "
                                   f"{', '.join(self.cg.describe(j) for j in bad)}"
                                   f"{f' ({type(failed).__name__}: {failed})' if failed else ' (see its error)'}"
                                   ) from failed
            every = torch.zeros(self.cg.size, *table.shape, dtype=torch.float64)
            tables = all_gather_host(table, every, self.cg, "halo.io statistics")
        elif failed is not None:
            raise failed
        else:
            tables = table[None]
        # Chan et al.'s combination, in group order (the same numbers on every rank): M2 = sum of the ranks' M2 +
        # sum of n_r (mean_r - mean)^2
        counts, totals = tables[..., 0], tables[..., 1]
        count, total = counts.sum(0), totals.sum(0)
        empty = [self.channels[c] for c in range(len(count)) if count[c] == 0]
        if empty:
            raise ValueError(f"halo.io.ShardedField.stats: channel(s) {empty} have no valid (non-NaN) value at any "
                             f"point or step of the field ({self.shape[0]} x {self.shape[1]} x {len(self)} steps): "
                             f"no mean or std; leave them out of variables=")
        mean = total / count
        means = torch.where(counts > 0, totals / counts.clamp_min(1), mean)
        var = (tables[..., 2].sum(0) + (counts * (means - mean) ** 2).sum(0)) / count
        return mean.to(dtype), var.sqrt().to(dtype)


def collate(samples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, str]:
    """``DataLoader(collate_fn=halo.io.collate)``: the samples stacked ``(B, C, H_r, W)`` and their keys joined
    (``";"``). A tensor attribute does not survive a worker process or a copy to the GPU, so the batch's
    ``halo_sample_key`` travels beside it: ``x, key = batch; x = x.to(device); x.halo_sample_key = key``."""
    keys = [str(getattr(s, "halo_sample_key", "")) for s in samples]
    return torch.stack(list(samples)), ";".join(keys)


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
