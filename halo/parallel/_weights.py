"""The latitude grid of the reductions: which global rows a shard holds, their latitudes and their weights.

Pure functions of the grid (``grid_latitudes``, ``latitude_weights``) and the look-ups the latitude-weighted
losses of :mod:`halo.parallel.reduce` make per call: a block's rows on a latitude x longitude mesh (:func:`mesh_rows`,
learned once per epoch by :func:`halo.plan.plans.resolve`) and the weights of a generated grid, made once per grid,
device and dtype (:func:`row_weights`; under ``torch.compile`` a constant of the graph).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..dist.comm import CommGroup, comm_group
from ..dist.mesh import mesh_2d, mesh_coords
from ..plan.partition import local_range
from ..plan.plans import resolve

__all__ = ["LAT_METHODS", "check_mesh", "grid_latitudes", "latitude_weights", "local_latitude_weights", "mesh_rows",
           "row_weights"]

LAT_METHODS = ("cos", "area")


def _weights_of(lat: torch.Tensor, method: str) -> torch.Tensor:
    """Mean-1 weights (float64) of rows at latitudes ``lat`` (degrees)."""
    if method == "cos":
        w = torch.cos(torch.deg2rad(lat)).clamp_min(0)
    else:  # cell area: |sin(upper) - sin(lower)| between midpoints, outer bounds half a spacing out (<= 90)
        if lat.numel() < 2:
            raise ValueError(f"area weights need at least 2 latitudes, got {lat.numel()}")
        mid = (lat[1:] + lat[:-1]) / 2
        first = (lat[0] + (lat[0] - lat[1]) / 2).clamp(-90, 90)
        last = (lat[-1] + (lat[-1] - lat[-2]) / 2).clamp(-90, 90)
        bounds = torch.deg2rad(torch.cat([first.view(1), mid, last.view(1)]))
        w = (torch.sin(bounds[1:]) - torch.sin(bounds[:-1])).abs()
    if not w.sum() > 0:
        raise ValueError(f"latitude weights sum to zero for {lat.numel()} rows from {lat[0]:g} to {lat[-1]:g}")
    return w / w.mean()


@functools.lru_cache(maxsize=64)
def _grid_weights(n_lat: int, lat_range: tuple[float, float], poles_included: bool | None, method: str,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Cached (never mutate): the weights of a generated grid on ``device`` (no host copy per step)."""
    lat = grid_latitudes(n_lat, lat_range=lat_range, poles_included=poles_included)
    return _weights_of(lat, method).to(device=device, dtype=dtype)


@torch._dynamo.assume_constant_result
def _grid_weights_constant(n_lat: int, lat_range: tuple[float, float], poles_included: bool | None, method: str,
                           device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_grid_weights` under ``torch.compile``: made (and cached) outside the trace, a constant of the graph.
    Traced, dynamo would skip the cache and recompute the weights every call, and break the graph at their
    data-dependent check (a loss inside a ``fullgraph=True`` model would not compile)."""
    return _grid_weights(n_lat, lat_range, poles_included, method, device, dtype)


def grid_latitudes(n_lat: int, *, lat_range: tuple[float, float] = (90.0, -90.0),
                   poles_included: bool | None = None) -> torch.Tensor:
    """Latitudes (degrees, float64) of ``n_lat`` equally spaced rows spanning ``lat_range``.

    ``poles_included=True``: rows on both ends of the range (721 rows: 90, 89.75, ..., -90). ``False``:
    cell-centred rows half a spacing inside (720 rows: 89.875, ..., -89.875). ``None`` (default): ``True``
    for odd ``n_lat`` (721, 181, 121: grids with both poles), ``False`` for even (720, 64, 32: cell-centred).
    Exactly antisymmetric for a symmetric range (integer row offsets, divided once).
    """
    if n_lat <= 0:
        raise ValueError(f"n_lat must be positive, got {n_lat}")
    if poles_included is None:
        poles_included = bool(n_lat % 2)
    a, b = (float(v) for v in lat_range)
    i = torch.arange(n_lat, dtype=torch.float64)
    if poles_included:
        if n_lat == 1:
            raise ValueError("a grid with both ends of lat_range on it needs at least 2 rows")
        return a + (i * (b - a)) / (n_lat - 1)
    return a + ((2 * i + 1) * (b - a)) / (2 * n_lat)


def latitude_weights(n_lat: int | None = None, *, latitudes: Sequence[float] | torch.Tensor | None = None,
                     lat_range: tuple[float, float] = (90.0, -90.0), poles_included: bool | None = None,
                     method: str = "cos", dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Per-row latitude weights of the global grid, normalised to mean 1 over the rows (WeatherBench).

    Either ``n_lat`` equally spaced rows (``lat_range``, ``poles_included``: see :func:`grid_latitudes`; the
    default takes odd ``n_lat`` to include both poles, even ``n_lat`` to be cell-centred) or explicit
    ``latitudes`` in degrees (then ``lat_range``/``poles_included`` are unused). ``method="cos"``: ``cos(lat)``
    (WeatherBench 1; 0 on a pole row); ``"area"``: the cell area between midpoints (WeatherBench 2; a pole row
    gets its polar cap). Returns a fresh tensor.
    """
    if method not in LAT_METHODS:
        raise ValueError(f"unknown latitude weight method {method!r}; expected one of {', '.join(LAT_METHODS)}")
    if latitudes is not None:
        lat = torch.as_tensor(latitudes, dtype=torch.float64).flatten().cpu()
        if n_lat is not None and lat.numel() != n_lat:
            raise ValueError(f"n_lat={n_lat} but {lat.numel()} latitudes were given")
        return _weights_of(lat, method).to(device=device, dtype=dtype)
    if n_lat is None:
        raise ValueError("latitude_weights needs n_lat or latitudes")
    lat_range = (float(lat_range[0]), float(lat_range[1]))
    w = _grid_weights(int(n_lat), lat_range, poles_included, method, torch.device("cpu"), torch.float64)
    return w.to(device=device, dtype=dtype, copy=True)


def local_latitude_weights(n_lat: int, group: Any | None = None, **kwargs: Any) -> torch.Tensor:
    """This rank's rows of :func:`latitude_weights` under the balanced split of ``n_lat`` over ``group``."""
    info = comm_group(group)
    if n_lat < info.size:
        raise ValueError(f"{n_lat} latitude rows cannot be split over {info.size} ranks (a rank would get none)")
    start, stop = local_range(n_lat, info.size, info.index)
    return latitude_weights(n_lat, **kwargs)[start:stop]



# -- the rows of a block on a latitude x longitude mesh -----------------------------------------------------

def check_mesh(mesh: Any | None, op: str) -> Any | None:
    """``mesh`` if it is a latitude x longitude ``DomainMesh`` (or ``None``), else ``ValueError`` naming ``op``."""
    if mesh is None:
        return None
    if mesh_2d(mesh) is None:
        raise ValueError(f"{op}: mesh= takes a DomainMesh with two domain axes (latitude x longitude), got {mesh!r}; "
                         f"for latitude only pass group=")
    return mesh


def _rows_2d(cg: CommGroup, extents: tuple[tuple[int, ...], ...], width: int) -> tuple[int, int, int]:
    sizes_h = extents[0]
    h = cg.index // width
    return sum(sizes_h), sum(sizes_h[:h]), sizes_h[h]


def mesh_rows(x: torch.Tensor, mesh: Any, op: str) -> tuple[int, int, int]:
    """``(global latitude rows, this rank's first row, its rows)`` of a block on a latitude x longitude mesh."""
    shape = tuple(mesh.domain_shape)
    return resolve(x, mesh.domain_group, op, _rows_2d, (shape[1],), spec=((-2,), (-1,)), coords=mesh_coords(shape))


def row_weights(n_lat: int, weights: torch.Tensor | None, weight_kwargs: dict, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """The global per-row weights a latitude-weighted loss uses: ``weights`` as given, else those of a generated
    grid (``lat_range``, ``poles_included``, ``method``: made once per grid, device and dtype; never mutate them),
    else :func:`latitude_weights` of ``weight_kwargs`` (explicit ``latitudes``). Checked: one per global row."""
    if weights is not None:
        if weight_kwargs:
            raise TypeError(f"pass either weights or {sorted(weight_kwargs)}, not both")
        weights = torch.as_tensor(weights)
    elif set(weight_kwargs) <= {"lat_range", "poles_included", "method"}:  # a generated grid: cached on device
        lat_range = tuple(float(v) for v in weight_kwargs.get("lat_range", (90.0, -90.0)))
        method = weight_kwargs.get("method", "cos")
        if method not in LAT_METHODS:
            raise ValueError(f"unknown latitude weight method {method!r}; expected one of {', '.join(LAT_METHODS)}")
        grid = _grid_weights_constant if torch.compiler.is_compiling() else _grid_weights
        weights = grid(n_lat, lat_range, weight_kwargs.get("poles_included"), method, device, dtype)
    else:
        weights = latitude_weights(n_lat, **weight_kwargs)
    if weights.dim() != 1 or weights.numel() != n_lat:
        raise ValueError(f"weights must be one per global latitude row ({n_lat}), got shape {tuple(weights.shape)}")
    return weights
