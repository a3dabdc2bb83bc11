"""Sharded autoregressive rollouts and their scores: the state stays on its shards from step to step.

:func:`rollout` feeds a converted model its own output for ``steps`` steps (with optional forcings appended as
channels), keeping every state H-sharded — no gather inside a step; the halo layers exchange only their halo rows.
:func:`scores` gives WeatherBench's latitude-weighted RMSE and anomaly correlation (ACC) per sample, variable and
lead time, exact over the global field (one all-reduce of the weighted sums per lead): the same numbers as the
unsharded rollout's. Predictions can go to disk per rank (:func:`halo.io.write_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .parallel.reduce import latitude_weighted_mean

__all__ = ["rollout", "scores"]


@torch.no_grad()
def rollout(model: nn.Module, state: torch.Tensor, steps: int,
            forcings: Callable[[int], torch.Tensor] | Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``steps`` autoregressive steps from this rank's rows of ``state`` ``(B, C, H_r, W)``; returns the predicted
    states (this rank's rows). ``forcings``: per step ``k`` a local ``(B, F, H_r, W)`` appended to the input as
    channels (a list, or a function of ``k``)."""
    if steps < 1:
        raise ValueError(f"rollout: steps must be positive, got {steps}")
    out = []
    for k in range(steps):
        inp = state
        if forcings is not None:
            extra = forcings(k) if callable(forcings) else forcings[k]
            inp = torch.cat([state, extra.to(state.dtype)], dim=1)
        state = model(inp)
        out.append(state)
    return out


def scores(predictions: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
           climatology: torch.Tensor | None = None, *, group: Any | None = None, mesh: Any | None = None,
           **weight_kwargs: Any) -> dict[str, torch.Tensor]:
    """Latitude-weighted RMSE and ACC of sharded forecasts, every lead time.

    ``predictions[k]`` / ``targets[k]``: this rank's rows ``(B, C, H_r, W)`` at lead ``k``; ``climatology``: this
    rank's rows of the climatology (``(C, H_r, W)`` or broadcastable), default zeros (ACC of the raw fields).
    Returns ``rmse`` and ``acc`` of shape ``(leads, B, C)`` — per lead, sample and variable, the same on every rank:
    ``rmse = sqrt(mean_w (p - t)^2)``, ``acc = mean_w(p' t') / sqrt(mean_w(p'^2) mean_w(t'^2))`` with ``'`` the
    anomaly from the climatology and ``mean_w`` the latitude-weighted mean over the global field
    (:func:`halo.parallel.latitude_weighted_mean`; its keywords choose the weights). ``mesh``: a latitude x longitude
    ``DomainMesh`` (each tensor is then this rank's block).
    """
    if len(predictions) != len(targets):
        raise ValueError(f"scores: {len(predictions)} predictions but {len(targets)} targets")
    rmse, acc = [], []
    for p, t in zip(predictions, targets, strict=True):
        if p.shape != t.shape:
            raise ValueError(f"scores: prediction {tuple(p.shape)} and target {tuple(t.shape)} differ")
        acc_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        p, t = p.to(acc_dtype), t.to(acc_dtype)
        clim = torch.zeros((), dtype=acc_dtype, device=p.device) if climatology is None else climatology.to(acc_dtype)
        pa, ta = p - clim, t - clim
        # One weighted reduction for the four sums a lead needs (stacked along a leading dim).
        stacked = torch.stack([(p - t).square(), pa * ta, pa.square(), ta.square()])
        means = latitude_weighted_mean(stacked, group, dim=(-2, -1), mesh=mesh, **weight_kwargs)  # (4, B, C)
        rmse.append(means[0].sqrt())
        acc.append(means[1] / (means[2] * means[3]).sqrt())
    return {"rmse": torch.stack(rmse), "acc": torch.stack(acc)}
