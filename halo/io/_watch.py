"""What tells :class:`halo.io.ShardedField` that a file changed under it: the version of the data a sample reads.

A reader of a zarr store that another process writes can see a sample whose variables (or whose rows) come from two
versions of the store, and the ranks of a domain group, reading at different moments, can see two versions between
them. zarr writes each chunk file whole (a new file renamed into place) and each metadata document the same way, so
the ``(inode, mtime, size)`` of the files a step is made of is the version of that step:

- the store's metadata documents (root and the variables': a resize, a rewrite, ``to_zarr(mode="w")``), fixed when
  the field was opened: a change raises (the opened dataset's shapes and chunks are stale: open it again);
- the chunk files of one time step of the variables read (all rows and columns: what the whole domain group reads),
  taken before and after the sample's reads: a change in between is a torn read, and the sample is read again (up
  to ``retries`` times, then ``RuntimeError``). Their digest is part of the sample's ``halo_sample_key``, so two
  ranks of a domain group that read the step on either side of a write have different keys (the converted model's
  entry refuses them).

For a netCDF/HDF5 file opened from a path, the file itself is the one document (its stat before and after).
A chunk rewritten twice within the clock's resolution with the same size on the same inode cannot be seen (zarr's
renames make a new inode each time); a writer that does not rename (writing a chunk file in place) can tear a chunk
itself. One ``os.stat`` per chunk file of the step per check (at 0.25 deg, 8-row chunks, 70 variables: 6300 stats).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["META_FILES", "StoreWatch", "fingerprint", "zarr_store_path"]

META_FILES = ("zarr.json", ".zmetadata", ".zgroup", ".zarray", ".zattrs")


def zarr_store_path(source: Any, engine: str | None) -> str | None:
    """The path of a zarr store opened from a path (``None`` for anything else)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = os.fspath(source)
    if engine == "zarr" or (os.path.isdir(path) and (os.path.exists(os.path.join(path, "zarr.json"))
                                                     or os.path.exists(os.path.join(path, ".zgroup")))):
        return path
    return None


def fingerprint(files: Sequence[str]) -> tuple:
    """Inode, modification time and size of each file (``None`` where absent)."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class _Array:
    """One zarr array's chunk grid: the files of its chunks along each dim (``dims``: the dims' names)."""

    def __init__(self, store: str, name: str, dims: Sequence[str]) -> None:
        import zarr

        arr = zarr.open_array(store, path=name, mode="r")
        meta = arr.metadata
        grid = getattr(meta, "chunk_grid", None)  # v3: the storage unit (a shard where sharded); v2: .chunks
        self.chunks = tuple(int(c) for c in (grid.chunk_shape if grid is not None else meta.chunks))
        self.shape = tuple(int(s) for s in arr.shape)
        self.encode = meta.encode_chunk_key
        self.root = os.path.join(store, name)
        self.dims = tuple(dims)

    def files(self, time_dim: str | None, t: int | None) -> list[str]:
        """The chunk files holding step ``t`` (every step where ``t`` is None, or for a variable without time)."""
        ranges = []
        for d, n, c in zip(self.dims, self.shape, self.chunks, strict=True):
            if d == time_dim and t is not None:
                ranges.append([t // c])
            else:
                ranges.append(range(-(-n // c)))
        return [os.path.join(self.root, self.encode(k)) for k in itertools.product(*ranges)]


class StoreWatch:
    """The version of a zarr store (or a netCDF file) opened from ``path``, for the variables ``names`` (module
    docstring). Pickles as its paths (a ``spawn`` DataLoader worker rebuilds nothing)."""

    def __init__(self, path: str, ds: Any, names: Sequence[str], coords: Sequence[str], time_dim: str | None,
                 zarr_store: bool) -> None:
        self.path, self.time = path, time_dim
        if zarr_store:
            self.meta = [os.path.join(path, f) for f in META_FILES] + [
                os.path.join(path, a, f) for a in [*names, *coords] for f in META_FILES]
            self.arrays = []
            if os.path.isdir(path):  # a local store (a remote one has no files to stat: not watched)
                self.arrays = [_Array(path, v, ds[v].dims) for v in names]
        else:
            self.meta, self.arrays = [path], []
        self.opened = fingerprint(self.meta)

    def check_meta(self) -> None:
        if fingerprint(self.meta) != self.opened:
            raise RuntimeError(f"halo.io: the store {self.path} changed since it was opened (its metadata or the "
                               f"file was rewritten): reading a store while it is written is not supported, a "
                               f"sample could mix two versions; open it again once the writer is done")

    def step_files(self, t: int | None) -> list[str]:
        return [f for a in self.arrays for f in a.files(self.time, t)]

    def version(self, files: Sequence[str]) -> tuple:
        """The fingerprint of the metadata and of ``files`` (compare two to see a change in between)."""
        return fingerprint(self.meta), fingerprint(files)

    @staticmethod
    def digest(version: tuple) -> str:
        """A short stable name of a version (the same on every rank that saw the same files)."""
        return hashlib.blake2b(repr(version).encode(), digest_size=8).hexdigest()
