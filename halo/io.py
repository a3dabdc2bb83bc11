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
in, or a step of an older run in the same store, is never reported complete.

Needs ``xarray`` and an engine (``h5netcdf``/``h5py`` or ``netCDF4``; ``zarr`` for zarr stores):
``pip install xarray h5netcdf`` (they are in the ``[io]`` and ``[test]`` extras).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import context, transport
from .comm import CommGroup, all_gather_host, comm_group, gather_words
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
        parts_h, index_h, self.cols = _layout(group, mesh, w)
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
        lead = [d for d in a.dims if d not in (self.lat, self.lon)]
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


# -- all-or-nothing writes --------------------------------------------------------------------------------------

_STORABLE = (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
             torch.uint8, torch.bool)
_NP_NAMES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
_MAX_DIMS = 8
_STEPS = "halo_steps"  # the zarr group holding one marker array per written array: the run id of each complete step


@dataclass(frozen=True)
class _Run:
    run: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    lead: int
    chunks: tuple[int, int]


@dataclass
class _IOState:
    """What the writers remember (the :mod:`halo.context` slot ``"io"``): ``runs``, (store, name, group ranks) ->
    the run this process writes, created (or resumed) at its first ``write_rows`` call. One entry per array
    written; a :func:`halo.context.reset` starts new runs (as a new process would)."""

    runs: dict = field(default_factory=dict)


def _state() -> _IOState:
    return context.state("io", _IOState)


def _pad(values: Sequence[int], fill: int = -1) -> list[int]:
    values = [int(v) for v in values][:_MAX_DIMS]
    return values + [fill] * (_MAX_DIMS - len(values))


def _agree(words: Sequence[int], cg: CommGroup, what: str) -> np.ndarray:
    """Every rank's words in group order (bounded by ``halo.set_timeout``; one process: its own row)."""
    if cg.size == 1:
        return np.asarray([list(words)], dtype=np.int64)
    return gather_words(words, cg, what)


def _store_key(store: Any) -> Any:
    return os.path.abspath(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else id(store)


def _describe(row: np.ndarray) -> str:
    nd, nl, code = int(row[0]), int(row[1]), int(row[2])
    shape = "more than 8 dims" if nd < 0 else tuple(int(v) for v in row[9:9 + nd])
    index = "more than 8 dims" if nl < 0 else tuple(int(v) for v in row[17:17 + nl])
    dtype = _NP_NAMES[code] if code >= 0 else "a dtype zarr cannot store"
    return f"shape {shape}, index {index}, dtype {dtype}{', resume=True' if row[8] else ''}"


def _owned(start: int, stop: int, chunk: int, n: int) -> tuple[int, int]:
    """The rows ``[a, b)`` of the chunks whose first row lies in ``[start, stop)`` (this rank writes them)."""
    k0, k1 = -(-start // chunk), -(-stop // chunk)
    return (k0 * chunk, min(k1 * chunk, n)) if stop > start and k1 > k0 else (0, 0)


def _meet(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r1 > r0 and c1 > c0 else None


def write_rows(store: str | os.PathLike, name: str, local: torch.Tensor, shape: tuple[int, ...],
               index: tuple[int, ...] | int = (), *, group: Any | None = None, mesh: Any | None = None,
               resume: bool = False) -> None:
    """Write this rank's rows of one step of a field into a zarr array shared by the domain group, all or nothing.

    ``local``: this rank's ``(..., H_r, W)`` rows of a field whose whole array has ``shape`` (leading dims, e.g.
    ``(time, channel, H, W)``); ``index``: the step, where along the leading dims this field goes (``(t,)`` writes
    ``array[t, :, rows, :]``). Every rank of the group calls it for the same step; ``halo.gather`` is never
    needed. With ``mesh=`` (a latitude x longitude ``DomainMesh``) each rank writes its block.

    What a reader can count on (:func:`complete_steps`, :func:`read_step`):

    - **All or nothing per step.** After every rank's rows are in the store (a bounded confirmation on the host
      group), group rank 0 writes the step's marker: the run id, in ``halo_steps/<name>`` of the store. A step a
      rank died in (or that failed on any rank) has no marker of this run and is never reported complete; the
      complete steps before it are intact.
    - **Runs never mix.** A process's first call for ``(store, name)`` starts a new run: a fresh run id is recorded
      before any of its rows are written, so the steps an older run wrote into the same store are no longer
      reported complete (they are overwritten step by step). ``resume=True`` continues the store's last run
      instead (a restarted job that keeps the steps written before the restart).
    - **Agreed, checked.** Every rank's ``shape``, ``index``, dtype and rows are agreed on before anything is
      written: a difference (one rank's ``T=5`` vs the others' ``T=6``), a wrong shard shape or a dtype zarr cannot
      store (bfloat16: convert first) raises the same ``ValueError``/``TypeError`` on every rank. An existing
      array of another shape or dtype is refused on every rank (never resized, never a dropped channel).
    - **Bounded.** Every wait (the agreements, the boundary rows, the confirmation) is bounded by
      ``halo.set_timeout`` (else the process group's timeout): a dead or stalled peer gives
      :class:`halo.HaloCommError` naming the ranks, on every survivor.

    Chunks: ``ceil(H / P_h)`` rows by ``ceil(W / P_w)`` columns, one step per chunk along the leading index dims
    (721 rows on 4 ranks: 181-row chunks, 4 chunk files per step and channel block). With a balanced split not every
    rank's first row is on a chunk boundary (rows 0, 181, 361, 541): each chunk is written whole by the rank that
    holds its first row, after the rank holding the chunk's other rows sent them (a few rows, bounded waits), so no
    two ranks ever write one chunk. An existing array keeps its own latitude/longitude chunks.
    """
    import zarr

    index = (index,) if isinstance(index, (int, np.integer)) else tuple(int(i) for i in index)
    shape = tuple(int(s) for s in shape)
    what = f"halo.io.write_rows({name!r}, index {index})"
    h, w = (shape[-2], shape[-1]) if len(shape) >= 2 else (0, 0)
    parts_h, index_h, cols = _layout(group, mesh, w)
    cg = comm_group(group if mesh is None else mesh.domain_group)
    if parts_h is None:
        parts_h, index_h = cg.size, cg.index
    offs = split_offsets(h, parts_h)
    rows = (offs[index_h], offs[index_h + 1])
    code = _STORABLE.index(local.dtype) if local.dtype in _STORABLE else -1
    words = [len(shape) if len(shape) <= _MAX_DIMS else -1, len(index) if len(index) <= _MAX_DIMS else -1, code,
             local.ndim if local.ndim <= _MAX_DIMS else -1, rows[0], rows[1], cols.start, cols.stop, int(resume),
             *_pad(shape), *_pad(index), *_pad(local.shape)]
    table = _agree(words, cg, what)
    _check_agreed(table, cg, what, local.dtype)
    lead = len(index)
    run = _start_run(store, name, shape, local.dtype, lead, table, cg, what, resume)

    # -- this rank's rows, and the boundary rows of the chunks it writes whole ------------------------------------
    blocks = [tuple(int(v) for v in row[4:8]) for row in table]
    ch, cw = run.chunks
    regions = [(*_owned(b[0], b[1], ch, h), *_owned(b[2], b[3], cw, w)) for b in blocks]
    me, mine = cg.index, blocks[cg.index]
    data = np.ascontiguousarray(local.detach().cpu().numpy())
    lead_shape = tuple(data.shape[:-2])
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    received: list[tuple[tuple[int, int, int, int], torch.Tensor]] = []
    if cg.size > 1:
        for j in range(cg.size):
            if j == me:
                continue
            out = _meet(mine, regions[j])
            if out is not None:
                piece = torch.from_numpy(np.ascontiguousarray(
                    data[..., out[0] - mine[0]:out[1] - mine[0], out[2] - mine[2]:out[3] - mine[2]]))
                sends.append((j, piece))
            inc = _meet(blocks[j], regions[me])
            if inc is not None:
                buf = torch.empty((*lead_shape, inc[1] - inc[0], inc[3] - inc[2]), dtype=local.dtype)
                recvs.append((j, buf))
                received.append((inc, buf))
        transport.wait(transport.post(cg, f"{what}: boundary rows", sends, recvs, host=True))
    region = regions[me]
    failed: BaseException | None = None
    try:
        if region[1] > region[0] and region[3] > region[2]:
            block = np.empty((*lead_shape, region[1] - region[0], region[3] - region[2]), dtype=data.dtype)
            own = _meet(mine, region)
            pieces = [(own, data[..., own[0] - mine[0]:own[1] - mine[0], own[2] - mine[2]:own[3] - mine[2]])] \
                if own is not None else []
            pieces += [(inc, buf.numpy()) for inc, buf in received]
            for (r0, r1, c0, c1), values in pieces:
                block[..., r0 - region[0]:r1 - region[0], c0 - region[2]:c1 - region[2]] = values
            arr = zarr.open_array(store, path=name, mode="r+")
            arr[(*index, ..., slice(region[0], region[1]), slice(region[2], region[3]))] = block
    except Exception as exc:  # noqa: BLE001 - every rank learns that this step failed
        failed = exc
    status = _agree([0 if failed is None else 1], cg, f"{what}: confirming every rank's rows")
    bad = [j for j in range(cg.size) if status[j, 0]]
    if bad:
        text = (f"{what}: the write failed on {', '.join(cg.describe(j) for j in bad)}"
                f"{f' ({type(failed).__name__}: {failed})' if failed is not None else ' (see its error)'}; this "
                f"step is not marked complete, the store's complete steps are unchanged")
        raise RuntimeError(text) from failed
    if me == 0:
        marks = zarr.open_array(store, path=f"{_STEPS}/{name}", mode="r+")
        marks[index if lead else ()] = run.run  # last: the step is complete


def _check_agreed(table: np.ndarray, cg: CommGroup, what: str, dtype: torch.dtype) -> None:
    """The same checks, on the same table, on every rank: the same error everywhere."""
    ref = table[0]
    for j in range(1, cg.size):
        if not np.array_equal(np.r_[table[j, :3], table[j, 8:25]], np.r_[ref[:3], ref[8:25]]):
            raise ValueError(f"{what}: the group's ranks disagree: {cg.describe(0)} writes {_describe(ref)}, "
                             f"{cg.describe(j)} writes {_describe(table[j])}; every rank must write the same step "
                             f"of the same array")
    nd, nl, code = int(ref[0]), int(ref[1]), int(ref[2])
    shape = tuple(int(v) for v in ref[9:9 + nd]) if nd >= 0 else ()
    index = tuple(int(v) for v in ref[17:17 + nl]) if nl >= 0 else ()
    if nd < 2:
        raise ValueError(f"{what}: shape needs at most {_MAX_DIMS} dims ending in (H, W), got "
                         f"{'more' if nd < 0 else shape}")
    if nl < 0 or nl > nd - 2:
        raise ValueError(f"{what}: index {index} has more dims than the leading dims of shape {shape}")
    if any(s < 0 for s in shape) or any(not 0 <= i < s for i, s in zip(index, shape, strict=False)):
        raise ValueError(f"{what}: index {index} out of range for shape {shape}")
    if code < 0:
        raise TypeError(f"{what}: zarr/numpy cannot store {dtype}; convert first (e.g. local.float())")
    bad = []
    for j in range(cg.size):
        r0, r1, c0, c1 = (int(v) for v in table[j, 4:8])
        want = (*shape[nl:-2], r1 - r0, c1 - c0)
        got = tuple(int(v) for v in table[j, 25:25 + int(table[j, 3])]) if table[j, 3] >= 0 else "more than 8 dims"
        if got != want:
            bad.append(f"{cg.describe(j)} holds rows {r0}..{r1} and columns {c0}..{c1} of {shape[-2:]}, so expects "
                       f"{want}, got {got}")
    if bad:
        raise ValueError(f"{what}: wrong shard shape: {'; '.join(bad)}")


def _start_run(store: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype, lead: int, table: np.ndarray,
               cg: CommGroup, what: str, resume: bool) -> _Run:
    """This process's run of ``(store, name)``: made (rank 0 creates or checks the array, records a fresh run id)
    and agreed at the first call; checked against the call after that."""
    key = (_store_key(store), name, cg.ranks)
    runs = _state().runs
    known = runs.get(key)
    if known is not None:  # the same on every rank: the same error everywhere
        if (known.shape, known.dtype, known.lead) != (shape, dtype, lead):
            raise ValueError(f"{what}: this run writes {name!r} with shape {known.shape}, dtype {known.dtype}, "
                             f"{known.lead} index dims; got shape {shape}, dtype {dtype}, {lead} index dims")
        return known
    rows = sorted({(int(r[4]), int(r[5])) for r in table})
    cols = sorted({(int(r[6]), int(r[7])) for r in table})
    ch = max(1, -(-shape[-2] // len(rows)))
    cw = max(1, -(-shape[-1] // len(cols)))
    words = [0] * (6 + _MAX_DIMS)
    failed: BaseException | None = None
    if cg.index == 0:
        try:
            words = _open_or_create(store, name, shape, np.dtype(_NP_NAMES[_STORABLE.index(dtype)]), lead, (ch, cw),
                                    resume)
        except Exception as exc:  # noqa: BLE001 - every rank learns that the store could not be opened
            failed, words = exc, [9] + [0] * (5 + _MAX_DIMS)
    got = _agree(words, cg, f"{what}: opening the store")[0]
    status = int(got[0])
    if status == 9:
        raise RuntimeError(f"{what}: {cg.describe(0)} could not open or create the array in {store}"
                           f"{f': {type(failed).__name__}: {failed}' if failed is not None else ' (see its error)'}"
                           ) from failed
    if status in (1, 2):
        nd = int(got[4])
        old = tuple(int(v) for v in got[6:6 + nd])
        old_dtype = _NP_NAMES[int(got[5])] if got[5] >= 0 else "another dtype"
        if status == 1:
            raise ValueError(f"{what}: {store} already has an array {name!r} of shape {old}, dtype {old_dtype}; this "
                             f"write is shape {shape}, dtype {_NP_NAMES[_STORABLE.index(dtype)]}: refused (never "
                             f"resized, nothing dropped); write to another name or store, or delete it first")
        raise ValueError(f"{what}: {store}'s array {name!r} is chunked {old} along its leading dims; write_rows "
                         f"needs one step per chunk along the {lead} index dims and whole leading dims after them "
                         f"(a step's chunks are written whole); write to another name or store")
    if status == 3:
        raise ValueError(f"{what}: resume=True but {store} has no run of {name!r} recorded by write_rows to resume")
    run = _Run(int(got[1]), shape, dtype, lead, (int(got[2]), int(got[3])))
    runs[key] = run
    return run


def _open_or_create(store: Any, name: str, shape: tuple[int, ...], npdtype: np.dtype, lead: int,
                    chunks: tuple[int, int], resume: bool) -> list[int]:
    """On group rank 0: create (or check) the array and its step markers, record the run. The words agreed on:
    ``[status, run id, lat chunk, lon chunk, existing ndim, existing dtype, *existing shape or chunks]``."""
    import zarr

    root = zarr.open_group(store, mode="a")
    want = (*([1] * lead), *shape[lead:-2], *chunks)
    if name in root:
        arr = root[name]
        old_dtype = _NP_NAMES.index(str(np.dtype(arr.dtype))) if str(np.dtype(arr.dtype)) in _NP_NAMES else -1
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != npdtype:
            return [1, 0, 0, 0, len(arr.shape), old_dtype, *_pad(arr.shape, 0)]
        if tuple(arr.chunks[:-2]) != want[:-2]:
            return [2, 0, 0, 0, len(arr.chunks) - 2, old_dtype, *_pad(arr.chunks[:-2], 0)]
        chunks = tuple(int(c) for c in arr.chunks[-2:])
    else:
        root.create_array(name, shape=shape, chunks=want, dtype=npdtype, fill_value=0)
    steps = root.require_group(_STEPS)
    marks = steps[name] if name in steps else None
    if marks is not None and tuple(marks.shape) != shape[:lead]:
        marks = None  # the steps of another layout: none of them is complete for this run
    if resume:
        run = int(marks.attrs.get("run", 0)) if marks is not None else 0
        if not run:
            return [3] + [0] * (5 + _MAX_DIMS)
    else:
        if marks is None:
            marks = steps.create_array(name, shape=shape[:lead], chunks=(1,) * lead, dtype="int64", fill_value=0,
                                       overwrite=True)
        run = secrets.randbits(62) | 1
        marks.attrs["run"] = run  # before any row of this run: the older run's steps stop being complete
    return [0, run, chunks[0], chunks[1], 0, 0, *([0] * _MAX_DIMS)]


def _markers(store: Any, name: str) -> tuple[Any, int]:
    import zarr

    root = zarr.open_group(store, mode="r")
    if name not in root:
        raise ValueError(f"halo.io: no array {name!r} in {store} (it has {sorted(root.array_keys())})")
    if _STEPS not in root or name not in root[_STEPS]:
        raise ValueError(f"halo.io: {store}'s array {name!r} has no step markers: it was not written by "
                         f"halo.io.write_rows (or by a version without them), so no step is known to be complete")
    marks = root[_STEPS][name]
    return marks, int(marks.attrs.get("run", 0))


def complete_steps(store: str | os.PathLike, name: str) -> list[tuple[int, ...]]:
    """The steps (``index`` tuples of :func:`write_rows`) of ``name`` that the store's current run wrote
    completely, in order. A step a rank died in, one still being written, or one of an older run is not listed."""
    marks, run = _markers(store, name)
    values = np.asarray(marks[...])
    return [tuple(int(i) for i in ix) for ix in np.argwhere(values == run)] if run else []


def read_step(store: str | os.PathLike, name: str, index: tuple[int, ...] | int = ()) -> np.ndarray:
    """Step ``index`` of ``name`` (the whole field: every rank's rows), only if it is complete for the store's
    current run (else ``ValueError``); a step overwritten while it was read raises too."""
    import zarr

    index = (index,) if isinstance(index, (int, np.integer)) else tuple(int(i) for i in index)
    marks, run = _markers(store, name)
    if len(index) != marks.ndim:
        raise ValueError(f"halo.io: {name!r} is written in steps of {marks.ndim} index dims, got index {index}")

    def complete() -> bool:
        return bool(run) and int(marks[index if index else ()]) == run

    if not complete():
        raise ValueError(f"halo.io: step {index} of {name!r} in {store} is not complete (a rank died or failed "
                         f"while writing it, it is being written, or an older run wrote it); complete steps: "
                         f"{complete_steps(store, name)}")
    values = np.asarray(zarr.open_array(store, path=name, mode="r")[index])
    now = _markers(store, name)
    if now[1] != run or int(now[0][index if index else ()]) != run:
        raise ValueError(f"halo.io: step {index} of {name!r} in {store} was rewritten while it was read")
    return values
