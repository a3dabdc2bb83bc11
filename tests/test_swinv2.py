"""Swin V2 window attention on latitude shards (``halo.nn.swinv2``) against the real third-party classes: timm's
``SwinTransformerV2Block`` (FuXi's), NCAR CREDIT's Swin (``credit.models.swin.SwinTransformerV2Cr``) and FuXi
(``credit.models.fuxi.Fuxi``), tiny widths, float64.

- timm's block on its own, 2 and 3 ranks, shards of whole windows with a partial last window (H = 10, window 4:
  rows 4 + 6 and 4 + 4 + 2, padded from the global H on the last rank): no shift, shifted, shifted with
  ``dynamic_mask``: the output, the input gradient and the parameter gradients summed over ranks equal the
  unsharded block's.
- The converted models, 2 and 3 ranks: CREDIT's Swin on an uneven block split (56 rows: 32 + 24 and 24 + 16 + 16,
  windows of 4 patches of 2 rows), FuXi on an even split (48 rows) and on its padded form (FuXi pads the Swin
  level to a window multiple and crops after it): output, input gradient and every parameter gradient equal the
  unsharded model's; ``state_dict`` keys unchanged; the Swin V2 blocks are halo's; the converted model pickles and
  its copy computes the same; ``revert_domain_parallel`` gives the models their classes back.
- Refusals, the same message on every rank, naming the block, the window, the rows per rank and what would fit:
  CREDIT's Swin and FuXi on balanced splits whose windows straddle ranks; CREDIT's Swin as built (its position-bias
  MLP has a dropout of 0.125) in training.
"""

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import offsets, split_sizes
from halo.testing import run_on_ranks

_MISSING = [p for p in tp.missing() if p in ("timm", "miles-credit", "torchvision")]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING} (tests/_thirdparty.py)")

TIMEOUT = 300
RTOL = 1e-9


# -- builders ----------------------------------------------------------------------------------------------------

def _block(shift: int, dynamic: bool) -> torch.nn.Module:
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    torch.manual_seed(0)
    block = SwinTransformerV2Block(dim=8, input_resolution=(10, 8), num_heads=2, window_size=4, shift_size=shift,
                                   dynamic_mask=dynamic).double()
    with torch.no_grad():  # q/v biases start at 0 and norms at 1: make every parameter matter
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block


def _model(name: str, h: int) -> torch.nn.Module:
    tp.load()
    torch.manual_seed(0)
    model = tp.credit_swin(h) if name.startswith("swin") else tp.credit_fuxi(h, pad=name == "fuxi_pad")
    model = model.double().train()
    for m in model.modules() if name != "swin_drop" else ():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0  # CREDIT's position-bias MLP has a dropout: halo refuses it in training (p > 0)
    return model


def _frames(name: str) -> int:
    return 1 if name.startswith("swin") else 2


def _data(name: str, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, _frames(name), h, 16, dtype=torch.float64, generator=g)
    return x, torch.randn(2, 3, 1, h, 16, dtype=torch.float64, generator=g)


# -- the ranks -----------------------------------------------------------------------------------------------------

def _run_block(rank: int, sizes: list[int], shift: int, dynamic: bool) -> dict:
    from halo.nn.swinv2 import DomainSwinV2Block

    block = DomainSwinV2Block(_block(shift, dynamic))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 10, 8, 8, dtype=torch.float64, generator=g), torch.randn(2, 10, 8, 8, dtype=torch.float64,
                                                                                 generator=g)
    lo, hi = offsets(sizes)[rank], offsets(sizes)[rank + 1]
    xs = x[:, lo:hi].clone().requires_grad_(True)
    y = block(xs)
    (y * w[:, lo:hi]).sum().backward()
    return {"y": y.detach(), "g": xs.grad, "p": {n: p.grad for n, p in block.named_parameters()}}


def _run_model(rank: int, name: str, h: int, sizes: list[int]) -> dict:
    import pickle

    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.nn.swinv2 import DomainSwinV2Block

    model = _model(name, h)
    keys, kind = list(model.state_dict()), type(model)
    try:
        convert_to_domain_parallel(model)
        x, w = _data(name, h)
        lo, hi = offsets(sizes)[rank], offsets(sizes)[rank + 1]
        xs = x[..., lo:hi, :].clone().requires_grad_(True)
        y = model(xs)
        (y * w[..., lo:hi, :]).sum().backward()
    except ValueError as exc:
        return {"refused": str(exc)}
    blocks = sum(isinstance(m, DomainSwinV2Block) for m in model.modules())
    twin = pickle.loads(pickle.dumps(model))  # a converted model pickles (torch.save) and computes the same
    with torch.no_grad():
        same = torch.equal(twin(xs.detach()), y.detach())
    out = {"y": halo.gather(y.detach()), "g": halo.gather(xs.grad), "blocks": blocks,
           "p": {n: p.grad for n, p in model.named_parameters()}, "keys": list(model.state_dict()) == keys,
           "swapped": type(model) is not kind and isinstance(model, kind),
           "pickled": type(twin) is type(model) and same}
    revert_domain_parallel(model)
    out["reverted"] = type(model) is kind
    return out


def _worker(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"
    tp.load()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    return [_run_block(rank, *case[1:]) if case[0] == "block" else _run_model(rank, *case) for case in cases]


#: per world size: timm's block (sizes, shift, dynamic_mask), then the models (name, H, rows per rank)
BLOCKS = {2: [4, 6], 3: [4, 4, 2]}
MODELS = {
    2: [("swin", 56, [32, 24]), ("fuxi", 48, [24, 24]), ("fuxi_pad", 56, [28, 28])],
    3: [("swin", 56, [24, 16, 16]), ("fuxi", 48, [16, 16, 16]), ("fuxi_pad", 40, [14, 13, 13])],
}
#: (name, H): balanced splits whose windows straddle ranks -> what the refusal must say at P = 2 and P = 3
REFUSED = {
    2: [("swin", 40, "stages.0.blocks.0", "[10, 10]", "multiple of 8"),
        ("fuxi", 40, "u_transformer.layer.blocks.0", "[5, 5]", "multiple of 4")],
    3: [("swin", 40, "stages.0.blocks.0", "[7, 7, 6]", "multiple of 12"),
        ("fuxi", 56, "u_transformer.layer.blocks.0", "[5, 5, 4]", "multiple of 6")],
}
#: CREDIT's Swin as built (its position-bias MLP's dropout p=0.125), trained: refused, naming that dropout
DROPOUT = ("swin_drop", 48)

_RUNS: dict[int, list[list[dict]]] = {}


def _cases(world: int) -> list[tuple]:
    blocks = [("block", BLOCKS[world], s, d) for s, d in ((0, False), (2, False), (2, True))]
    models = [(n, h, s) for n, h, s in MODELS[world]]
    refused = [(n, h, split_sizes(h, world)) for n, h, *_ in REFUSED[world]]
    return blocks + models + refused + [(*DROPOUT, split_sizes(DROPOUT[1], world))]


def _results(world: int) -> list[list[dict]]:
    """Every case on ``world`` ranks, once per session: ``[case][rank]``."""
    if world not in _RUNS:
        per_rank = run_on_ranks(_worker, world, _cases(world), timeout=TIMEOUT)
        _RUNS[world] = [list(r) for r in zip(*per_rank, strict=True)]
    return _RUNS[world]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def _check_params(results: list[dict], ref: torch.nn.Module, what: str) -> None:
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for n, p in ref.named_parameters():
        grads = [r["p"][n] for r in results if r["p"][n] is not None]
        assert grads and p.grad is not None, f"{what}: no gradient for {n}"
        err = float((sum(grads) - p.grad).abs().max()) / scale
        assert err <= RTOL, f"{what}: param grad {n} relative error {err:.2e}"


# -- tests ---------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("shift", "dynamic"), [(0, False), (2, False), (2, True)])
def test_timm_swinv2_block_partial_window_exact(world, shift, dynamic):
    tp.load()
    i = [(0, False), (2, False), (2, True)].index((shift, dynamic))
    results = _results(world)[i]
    block = _block(shift, dynamic)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 10, 8, 8, dtype=torch.float64, generator=g), torch.randn(2, 10, 8, 8, dtype=torch.float64,
                                                                                 generator=g)
    x.requires_grad_(True)
    y = block(x)
    (y * w).sum().backward()
    what = f"timm SwinTransformerV2Block shift={shift} dynamic_mask={dynamic} on rows {BLOCKS[world]}"
    _close(torch.cat([r["y"] for r in results], 1), y.detach(), f"{what}: output")
    _close(torch.cat([r["g"] for r in results], 1), x.grad, f"{what}: input grad")
    _check_params(results, block, what)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("index", range(3), ids=[c[0] for c in MODELS[2]])
def test_credit_swin_and_fuxi_exact(world, index):
    name, h, sizes = MODELS[world][index]
    results = _results(world)[3 + index]
    assert all("refused" not in r for r in results), results[0].get("refused")
    model = _model(name, h)
    x, w = _data(name, h)
    x.requires_grad_(True)
    y = model(x)
    (y * w).sum().backward()
    what = f"{name} H={h} on rows {sizes}"
    for r in results:
        assert r["keys"] and r["swapped"] and r["reverted"] and r["pickled"], what
        assert r["blocks"] == 2, f"{what}: {r['blocks']} Swin V2 blocks converted"
        _close(r["y"], y.detach(), f"{what}: output")
        _close(r["g"], x.grad, f"{what}: input grad")
    _check_params(results, model, what)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("index", range(2), ids=["swin", "fuxi"])
def test_straddling_windows_refused_on_every_rank(world, index):
    name, h, where, rows, fits = REFUSED[world][index]
    results = _results(world)[3 + len(MODELS[world]) + index]
    errors = [r.get("refused") for r in results]
    assert errors[0] is not None, f"{name} H={h} at P={world} ran; it must be refused"
    assert len(set(errors)) == 1, f"ranks disagree: {errors}"
    for part in (where, "windows are", rows, fits, "halo.shard"):
        assert part in errors[0], f"{part!r} not in: {errors[0]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_credit_position_bias_dropout_refused_in_training(world):
    """CREDIT's ``WindowMultiHeadAttention`` builds its bias MLP with ``drop=(0.125, 0.0)`` (not configurable): in
    training each rank would draw its own mask of the bias table, so the converted model refuses it on every rank."""
    errors = [r.get("refused") for r in _results(world)[-1]]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    for part in ("meta_mlp.drop1 (p=0.125)", "draws per window", "set p to 0"):
        assert part in errors[0], f"{part!r} not in: {errors[0]}"
