"""NCAR CREDIT's real CrossFormer (``credit.models.wxformer.crossformer.CrossFormer``, miles-credit) at more sizes.

The zoo (``tests/test_zoo_real.py``) runs it at H=64 on 2 ranks and H=96 on 3. Here, float64, train mode, from the
same seed (parameters perturbed: the decoder's ICNR weights and zero biases would hide paths), converted unchanged by
``convert_to_domain_parallel`` and compared with the unsharded model in the same process (forward, input gradient,
parameter gradients summed over the domain group; 1e-9 of the largest magnitude); ``halo.check_equivalence`` on the
same model and input must agree (module by module):

* ``h128_p4``: H=128 on 4 ranks: 32 rows a rank, 16 / 8 / 4 / 2 at the four levels (windows 2: whole on every rank).
* ``h96_p2``: H=96 on 2 ranks: 24 / 12 / 6 / 3 rows a rank at the levels: the last level's 3 + 3 rows are not whole
  2-row short-distance windows, so that attention regroups the rows into whole windows (4 + 2) and back.
* ``credit_windows_p2``: CREDIT's own window and stride defaults (``global_window_size=(5, 5, 2, 1)``,
  ``local_window_size=10``, ``cross_embed_strides=(4, 2, 2, 2)``, kernels ``((4, 8, 16, 32), (2, 4), (2, 4),
  (2, 4))``) at 320 x 320, the smallest field those windows fit (levels of 80 / 40 / 20 / 10 rows), on 2 ranks: the
  last level is one 10-row window, so the short-distance attention there runs on rank 0 (10 + 0 rows) and the
  regroup brings the rows back. Widths 8..64 (four kernel scales need dim[0] >= 8 channels).

CREDIT's position-bias MLP at the first level has gradients that are 0 in exact arithmetic (its LayerNorm over
dim / 4 = 1 or 2 features is constant or a sign, so the bias it adds shifts whole softmax rows), ~1e-13 in float64:
check_equivalence's tolerance for a gradient is never below ``halo.check.GRAD_FLOOR_OF_MODEL`` of the model's
largest, so that noise is not flagged, and the report must be OK as it stands.
"""

from __future__ import annotations

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

pytestmark = [pytest.mark.timeout(700),  # above the 4-rank case's rank timeout
              pytest.mark.skipif(bool(tp.missing()), reason=f"the zoo's packages are not installed: {tp.missing()} "
                                                            f"(the install commands are in tests/_thirdparty.py)")]

RTOL = 1e-9
W = 32

#: name -> (CrossFormer kwargs beyond the tiny widths, H, W, world)
CONFIGS = {
    "h128_p4": ({}, 128, W, 4),
    "h96_p2": ({}, 96, W, 2),
    "credit_windows_p2": ({"dim": (8, 16, 32, 64), "global_window_size": (5, 5, 2, 1), "local_window_size": 10,
                           "cross_embed_kernel_sizes": ((4, 8, 16, 32), (2, 4), (2, 4), (2, 4)),
                           "cross_embed_strides": (4, 2, 2, 2)}, 320, 320, 2),
}


def _build(extra: dict, h: int, w: int) -> torch.nn.Module:
    tp.load()  # the torchvision stand-in first: credit imports torchvision
    from credit.models.wxformer.crossformer import CrossFormer

    kwargs = {"frames": 1, "channels": 1, "surface_channels": 2, "input_only_channels": 0, "levels": 1,
              "dim": (4, 8, 16, 32), "depth": (1, 1, 1, 1), "dim_head": 4, "global_window_size": (2, 1, 1, 1),
              "local_window_size": 2, "cross_embed_kernel_sizes": ((4, 8), (2, 4), (2, 4), (2, 4)),
              "cross_embed_strides": (2, 2, 2, 2), "use_spectral_norm": False, "interp": False}
    kwargs.update(extra)
    torch.manual_seed(0)
    model = CrossFormer(image_height=h, image_width=w, **kwargs).double().train()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the decoder's zero biases and ICNR weights: order-one values reach every path
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _run(rank: int, world: int, name: str) -> dict:
    import copy

    import torch.distributed as dist

    import halo
    from halo.nn import convert_to_domain_parallel

    extra, h, w, _ = CONFIGS[name]
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    ref = _build(extra, h, w)
    dom = convert_to_domain_parallel(copy.deepcopy(ref))
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 3, 1, h, w, generator=gen, dtype=torch.float64)
    out: dict = {}
    try:
        xr = full.clone().requires_grad_(True)
        yr = ref(xr)
        weight = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
        (yr * weight).sum().backward()
        offs = split_offsets(h, world)
        x = full[..., offs[rank]:offs[rank + 1], :].clone().requires_grad_(True)
        y = dom(x)
        mo = split_offsets(yr.shape[-2], world)
        (y * weight[..., mo[rank]:mo[rank + 1], :]).sum().backward()
        out["y"] = _rel(halo.gather(y.detach()), yr.detach())
        out["gx"] = _rel(halo.gather(x.grad), xr.grad)
        scale = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        worst, at = 0.0, ""
        for (n, p), q in zip(dom.named_parameters(), ref.parameters(), strict=True):
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            e = float((g - q.grad).abs().max()) / scale if q.grad is not None else float(g.abs().max())
            if e > worst:
                worst, at = e, n
        out["gp"], out["gp_at"] = worst, at
        report = halo.check_equivalence(_build(extra, h, w), full)
        out["check"] = report.ok
        out["report"] = str(report)[-1500:]
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    return out


def _run_all(rank: int, world: int, names: list[str]) -> dict:
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # halo's kernels: the torch reference (the interpreter: test_kernels.py)
    return {name: _run(rank, world, name) for name in names}


_RUNS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    """Every configuration of ``world`` ranks in one launch (cached): the 2-rank ones share their start-up (the
    ranks' imports of credit and the zoo's stand-ins)."""
    if world not in _RUNS:
        names = [n for n, c in CONFIGS.items() if c[3] == world]
        _RUNS[world] = run_on_ranks(_run_all, world, names, timeout=600)
    return _RUNS[world]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_crossformer_is_exact(name: str) -> None:
    world = CONFIGS[name][3]
    results = [r[name] for r in _results(world)]
    for rank, res in enumerate(results):
        assert "error" not in res, (rank, res["error"])
        assert res["y"] <= RTOL and res["gx"] <= RTOL and res["gp"] <= RTOL, (rank, res)
        assert res["check"], (rank, res["report"])
