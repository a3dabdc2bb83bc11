"""How a file's grid is oriented, and the order :class:`halo.io.ShardedField` reads it in: latitude rows and
longitude columns normalised, so that two files stored differently pair the same points.

Latitude (``latitude=``): rows north to south (``"descending"``, the default, ERA5's order) or south to north
(``"ascending"``) whatever the file's order (a file in the other order is read mirrored), or ``"file"``.

Longitude (``longitude=``): columns ascending east from 0 (``"0..360"``, the default: 0, 0.25, ..., 359.75) or from
-180 (``"-180..180"``), whatever the file's convention: a *global* grid (evenly spaced, the whole circle: ``n``
columns ``360 / n`` degrees apart) stored on -180..175 and one stored on 0..355 are both read 0..355, the columns
rolled by half the circle (a file stored descending is read mirrored as well). A regional grid (not the whole
circle) is never rolled (that would put its two edges side by side); it is read ascending, its
:attr:`~halo.io.ShardedField.longitudes` reported in the convention's range. ``"file"``: as stored. A longitude
coordinate that is neither monotonic nor a rolled circle is refused unless ``longitude="file"``.

Pure functions of the coordinates: the same answer on every rank that opened the same file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["LATITUDE_ORDERS", "LONGITUDE_ORDERS", "file_runs", "latitude_order", "longitude_order"]

LATITUDE_ORDERS = ("descending", "ascending", "file")
LONGITUDE_ORDERS = ("0..360", "-180..180", "file")


def _coord(ds: Any, name: str) -> np.ndarray | None:
    if name not in ds.coords:
        return None
    return np.asarray(ds[name].values, dtype=np.float64).reshape(-1)


def latitude_order(ds: Any, lat: str, order: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(perm, latitudes)``: row ``i`` read is the file's row ``perm[i]``; the latitudes in the read order (or
    ``None`` without a coordinate)."""
    n = ds.sizes[lat]
    lats = _coord(ds, lat)
    ident = np.arange(n)
    if lats is None or lats.size < 2:
        return ident, lats
    steps = np.diff(lats)
    if not (np.all(steps > 0) or np.all(steps < 0)):
        if order == "file":
            return ident, lats
        raise ValueError(f"halo.io: the latitude coordinate {lat!r} is not strictly monotonic (first values "
                         f"{lats[:4].tolist()}); pass latitude='file' to read rows as stored")
    if order == "file" or bool(steps[0] < 0) == (order == "descending"):
        return ident, lats
    return ident[::-1].copy(), lats[::-1].copy()


def longitude_order(ds: Any, lon: str, order: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(perm, longitudes)``: column ``j`` read is the file's column ``perm[j]``; the longitudes in the read order,
    in the convention's range (or ``None`` without a coordinate). Module docstring."""
    n = ds.sizes[lon]
    lons = _coord(ds, lon)
    ident = np.arange(n)
    if lons is None or lons.size < 2 or order == "file":
        return ident, lons
    base = 0.0 if order == "0..360" else -180.0
    wrapped = (lons - base) % 360.0 + base  # in [base, base + 360)
    step = 360.0 / n
    for perm in (ident, ident[::-1]):  # a global grid (mirrored if stored descending): start at the first longitude
        rolled = np.roll(perm, -int(np.argmin(wrapped[perm])))
        circle = np.r_[wrapped[rolled], wrapped[rolled[0]] + 360.0]
        if np.allclose(np.diff(circle), step, rtol=0, atol=1e-6 * step):
            return rolled.copy(), wrapped[rolled]
    steps = np.diff(lons)
    if np.all(steps > 0):  # regional (or not evenly spaced): never rolled
        return ident, wrapped
    if np.all(steps < 0):
        return ident[::-1].copy(), wrapped[::-1].copy()
    raise ValueError(f"halo.io: the longitude coordinate {lon!r} is neither monotonic nor a whole circle rolled "
                     f"(first values {lons[:4].tolist()}); pass longitude='file' to read columns as stored")


def file_runs(perm: np.ndarray) -> list[tuple[int, int, bool]]:
    """``perm`` (file indices in read order) as contiguous runs ``(start, stop, reversed)`` of the file: each run
    read as one slice ``[start, stop)`` (mirrored when ``reversed``), the runs concatenated in order."""
    runs: list[tuple[int, int, bool]] = []
    i, n = 0, len(perm)
    while i < n:
        j = i + 1
        step = int(perm[j] - perm[i]) if j < n else 1
        if step not in (1, -1):
            step = 1
        while j < n and int(perm[j] - perm[j - 1]) == step:
            j += 1
        a, b = int(perm[i]), int(perm[j - 1])
        runs.append((a, b + 1, False) if step == 1 else (b, a + 1, True))
        i = j
    return runs


def read_block(values_of: Any, row_runs: Sequence[tuple[int, int, bool]],
               col_runs: Sequence[tuple[int, int, bool]]) -> np.ndarray:
    """The block ``(..., rows, cols)`` in read order: ``values_of(row slice, col slice)`` (a lazy read of the file's
    rows and columns, ``(..., r, c)``) for each pair of runs, mirrored where a run is reversed, concatenated."""
    rows = []
    for r0, r1, rrev in row_runs:
        cols = []
        for c0, c1, crev in col_runs:
            v = values_of(slice(r0, r1), slice(c0, c1))
            if rrev:
                v = v[..., ::-1, :]
            if crev:
                v = v[..., ::-1]
            cols.append(v)
        rows.append(cols[0] if len(cols) == 1 else np.concatenate(cols, axis=-1))
    return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=-2)
