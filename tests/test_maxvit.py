"""timm's MaxViT on latitude shards (``halo.nn.maxvit``) against timm's own classes (``timm.models.maxxvit``), float64.

- Pure: every rank's plan of the regroup (``halo.nn.longrange`` plans from ``halo.nn.maxvit``'s window order),
  applied row by row as its messages would, moves the rows onto whole windows in timm's partition order (block and
  grid, uneven shards, a rank with no row, a rank with no window), and the plan back returns every row home.
- The regroup on 2 and 3 ranks (H = 12 uneven, windows of 3 rows): gathered, it is the global rows in window order;
  the plan back undoes it bitwise; and the dot-product test of the adjoint, <R x, y> = <x, R^T y> summed over ranks,
  with R^T the autograd backward.
- timm's ``PartitionAttentionCl`` and ``PartitionAttention2d``, block and grid, on uneven shards (H = 12: 7 + 5 and
  5 + 4 + 3, windows of 3 rows: cut by the shards) and a grid block on shards of whole windows (H = 18: 9 + 9,
  6 + 6 + 6): output, input gradient and parameter gradients summed over ranks equal the unsharded block's; on the
  latter, timm's grid block run on each shard as it is (grid attention kept local: what halo must not do) differs
  from the unsharded one by more than 1e-3, so these comparisons can fail.
- A whole timm ``MaxxVit`` built from ``MaxxVitCfg`` (3 stages of 'M' blocks: MBConv with SE and BatchNorm, block
  windows 2 x 2, grid 3 x 2; 96 x 32 input), converted, with channels-last attention at P = 2 and 3, NCHW attention
  in MaxxViT's form (ConvNeXt conv blocks, the relative position MLP) at P = 3 and 'PM' blocks
  (``ParallelPartitionAttention``: block and grid side by side, 2 x 2) at P = 2: logits,
  input gradient and every parameter gradient equal the unsharded model's (at P = 3 the last stage's two grid
  windows leave a rank without one); ``state_dict`` keys unchanged; ``revert_domain_parallel`` puts timm's blocks
  back; the converted model (at P = 2) pickles and its copy computes the same logits. The layer pickles and its copy
  computes the same.
- Refused on every rank alike, by name: rows not a multiple of the partition; CoAtNet's 'T' block
  (``TransformerBlock2d``: attention over the whole field); a latitude x longitude mesh; the attention's dropout in
  training.
"""

import _thirdparty as tp
import pytest
import torch

from halo.plan.partition import offsets, split_offsets
from halo.testing import run_on_ranks

_MISSING = [p for p in tp.missing() if p in ("timm", "torchvision")]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING} (tests/_thirdparty.py)")

TIMEOUT = 120
RTOL = 1e-10  # float64; the sharded and unsharded runs sum in different orders (norm statistics, pools, grads)


def _order(h: int, window: int, grid: bool) -> list[int]:
    """The global rows in timm's window order: window after window, positions within each."""
    n = h // window
    return [i * n + k if grid else k * window + i for k in range(n) for i in range(window)]


# -- pure -----------------------------------------------------------------------------------------------------------

def _apply(plans: list, data: list[list[int]]) -> list[list[int]]:
    """Every rank's regroup plan applied to ``data[r]`` (rank r's rows) as the messages would: a sender's rows for
    a peer pair up, in order, with the rows the peer places them at. Each output row is filled exactly once."""
    out: list[list] = [[None] * p.rows_out for p in plans]
    for q, p in enumerate(plans):
        moves = [(q, s, d) for s, d in zip(p.own_src, p.own_dst, strict=True)]
        for r, rows in p.recvs:
            if r != q:
                sent = dict(plans[r].sends)[q]
                assert len(sent) == len(rows), (r, q)
                moves += [(r, s, d) for s, d in zip(sent, rows, strict=True)]
        for r, s, d in moves:
            assert out[q][d] is None, (q, d)  # every target row filled once
            out[q][d] = data[r][s]
    assert all(v is not None for rows in out for v in rows)
    return out


@pytest.mark.parametrize("sizes", [[12], [7, 5], [5, 4, 3], [4, 0, 8], [1, 1, 1, 9], [3, 3, 3, 3]])
@pytest.mark.parametrize("grid", [False, True])
def test_regroup_plan_is_the_window_permutation(sizes: list[int], grid: bool) -> None:
    from halo.dist.comm import CommGroup
    from halo.nn.maxvit import _plan

    window, h, parts = 3, sum(sizes), len(sizes)
    plans = [_plan(CommGroup(None, parts, r, tuple(range(parts))), (tuple(sizes),), (window, 2), grid, 4, 1, "t")
             for r in range(parts)]
    if parts == 1:
        assert plans[0].plain  # one rank: timm's own partition
        return
    if plans[0].to is None:  # shards of whole block windows: they stay, and that is window order already
        assert not grid and all(o % window == 0 for o in offsets(sizes)) and _order(h, window, grid) == list(range(h))
        return
    offs = offsets(sizes)
    rows = [list(range(offs[r], offs[r + 1])) for r in range(parts)]
    there = _apply([p.to for p in plans], rows)
    win_off = split_offsets(h // window, parts)
    assert [len(t) for t in there] == [(win_off[q + 1] - win_off[q]) * window for q in range(parts)]  # balanced
    assert [row for t in there for row in t] == _order(h, window, grid)
    assert _apply([p.back for p in plans], there) == rows


# -- the ranks ------------------------------------------------------------------------------------------------------

def _tiny(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # biases start at 0, norms at 1, bias tables near 0: make every parameter matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.double()


def _block(kind: str, grid: bool, drop: float = 0.0) -> torch.nn.Module:
    from timm.models.maxxvit import MaxxVitTransformerCfg, PartitionAttention2d, PartitionAttentionCl

    torch.manual_seed(0)
    cfg = MaxxVitTransformerCfg(dim_head=4, window_size=(3, 2), grid_size=(3, 2), attn_drop=drop)
    cls = PartitionAttentionCl if kind == "cl" else PartitionAttention2d
    return _tiny(cls(8, partition_type="grid" if grid else "block", cfg=cfg))


def _model(nchw: bool = False, block_type: str = "M", height: int = 96, grid: tuple = (3, 2),
           convnext: bool = False) -> torch.nn.Module:
    """A tiny MaxViT ('M' blocks: MBConv, SE, BatchNorm; relative position bias) or, ``convnext``, MaxxViT's
    form (ConvNeXt conv blocks with LayerNorm2d, the relative position MLP: its dropout set to 0)."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg

    conv = MaxxVitConvCfg(block_type="convnext") if convnext else \
        MaxxVitConvCfg(expand_output=False, attn_ratio=0.25, act_layer="silu")
    cfg = MaxxVitCfg(
        embed_dim=(16, 32, 64) if convnext else (16, 24, 32), depths=(1, 1, 1), block_type=(block_type,) * 3,
        stem_width=(8, 16), conv_cfg=conv,
        transformer_cfg=MaxxVitTransformerCfg(expand_first=False, dim_head=8, window_size=(2, 2), grid_size=grid,
                                              norm_layer="layernorm2d", norm_layer_cl="layernorm",
                                              use_nchw_attn=nchw, rel_pos_type="mlp" if convnext else "bias",
                                              rel_pos_dim=16))
    torch.manual_seed(0)
    model = _tiny(MaxxVit(cfg, img_size=(height, 32), num_classes=5))
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # timm's RelPosMlp has a dropout of 0.125: halo refuses it in training (see _refusals)
    return model


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the domain group (a rank that saw none of a parameter adds zeros)."""
    import torch.distributed as dist

    out = {}
    for n, p in module.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[n] = g
    return out


def _adjoint(rank: int, sizes: list[int], grid: bool) -> dict:
    import torch.distributed as dist

    from halo.nn.longrange import regroup
    from halo.nn.maxvit import partition_plan

    lo, hi = offsets(sizes)[rank], offsets(sizes)[rank + 1]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, sum(sizes), 4, 3, dtype=torch.float64, generator=g)
    xs = x[:, lo:hi].clone().requires_grad_(True)
    plan = partition_plan(xs, (3, 2), grid, 1)
    rx = regroup(xs, plan.to)
    back = regroup(rx, plan.back)
    y = torch.randn(rx.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    (rty,) = torch.autograd.grad(rx, xs, y)
    dots = torch.stack([(rx * y).sum(), (xs * rty).sum()]).detach()
    dist.all_reduce(dots)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rx.detach())
    rows = torch.cat(parts, 1)  # every rank's windows in rank order: the global rows in window order
    return {"moved": plan.to is not None, "dots": dots.tolist(), "back": torch.equal(back, xs),
            "rows": torch.equal(rows, x[:, _order(sum(sizes), 3, grid)])}


def _run_block(rank: int, kind: str, grid: bool, sizes: list[int]) -> dict:
    import pickle

    from halo.nn.maxvit import DomainPartitionAttention

    # the layer itself (a converted model's entry takes dim -2 of its input for H; this block is channels-last)
    ref, local, block = _block(kind, grid), _block(kind, grid), DomainPartitionAttention(_block(kind, grid))
    dim = 1 if kind == "cl" else 2
    lo, hi = offsets(sizes)[rank], offsets(sizes)[rank + 1]
    g = torch.Generator().manual_seed(3)
    shape = (2, sum(sizes), 4, 8) if kind == "cl" else (2, 8, sum(sizes), 4)
    x, w = torch.randn(shape, dtype=torch.float64, generator=g), torch.randn(shape, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_(True)
    (ref(xr) * w).sum().backward()
    xs = x.narrow(dim, lo, hi - lo).clone().requires_grad_(True)
    y = block(xs)
    (y * w.narrow(dim, lo, hi - lo)).sum().backward()
    with torch.no_grad():  # timm's block on this shard as it is: what the conversion must not compute
        local_y = local(x.narrow(dim, lo, hi - lo)) if (hi - lo) % 3 == 0 else None
    want = ref(x).detach().narrow(dim, lo, hi - lo)
    twin = pickle.loads(pickle.dumps(block))  # the layer pickles (torch.save) and its copy computes the same
    with torch.no_grad():
        same = torch.equal(twin(xs.detach()), block(xs.detach()))  # (no_grad both: SDPA picks its kernel by it)
    return {"y": y.detach(), "want": want, "halo": same, "g": xs.grad, "want_g": xr.grad.narrow(dim, lo, hi - lo),
            "p": _grads(block), "want_p": {n: p.grad for n, p in ref.named_parameters()},
            "local": None if local_y is None else float((local_y - want).abs().max()),
            }


def _run_model(rank: int, world: int, nchw: bool, block_type: str = "M", convnext: bool = False) -> dict:
    import pickle

    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel
    from halo.nn.maxvit import DomainPartitionAttention

    grid = (2, 2) if block_type == "PM" else (3, 2)  # a 'PM' block's window and grid are one size (timm asserts)
    ref, model = (_model(nchw, block_type, grid=grid, convnext=convnext).train() for _ in range(2))
    keys = list(model.state_dict())
    convert_to_domain_parallel(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 96, 32, dtype=torch.float64, generator=g)
    w = torch.randn(2, 5, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_(True)
    (ref(xr) * w).sum().backward()
    xs = halo.shard(x, -2).requires_grad_(True)
    y = model(xs)
    ((y * w).sum() * (1.0 if rank == 0 else 0.0)).backward()  # the logits are whole: rank 0 backpropagates them
    out = {"y": y.detach(), "want": ref(x).detach(), "g": halo.gather(xs.grad, -2), "want_g": xr.grad,
           "p": _grads(model), "want_p": {n: p.grad for n, p in ref.named_parameters()},
           "keys": list(model.state_dict()) == keys,
           "layers": sum(isinstance(m, DomainPartitionAttention) for m in model.modules())}
    if world == 2 and block_type == "M":  # a whole converted classifier (global pool hooks, head dropout) pickles
        twin = pickle.loads(pickle.dumps(model))
        with torch.no_grad():
            out["pickled"] = torch.equal(twin(xs.detach()), model(xs.detach()))
    revert_domain_parallel(model)
    out["halo"] = not any(isinstance(m, DomainPartitionAttention) for m in model.modules())
    return out


def _refusals(rank: int, world: int) -> dict:
    import halo
    from halo.nn import convert_to_domain_parallel

    out = {}

    def attempt(name, build, x, dim=-2, *mesh):
        try:
            model = build()
            convert_to_domain_parallel(model, *mesh)
            model(halo.shard(x, dim))
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)

    image = torch.randn(1, 3, 96, 32, dtype=torch.float64)
    rows = torch.randn(1, 8, 12, 4, dtype=torch.float64)
    # 80 rows: 20 after the stem and the first stage's stride, whole block windows of 2 rows, not grid windows of 3
    attempt("rows", lambda: _model(height=80).eval(), torch.randn(1, 3, 80, 32, dtype=torch.float64))
    attempt("coatnet", lambda: _model(block_type="T"), image)
    attempt("drop", lambda: torch.nn.Sequential(_block("2d", True, drop=0.1)).train(), rows)
    attempt("mesh", lambda: torch.nn.Sequential(_block("2d", True)), rows, -2, halo.DomainMesh((1, world)))
    return out


def _worker(rank: int, world: int, cases: list[tuple]) -> list:
    import os

    import halo

    os.environ["TRITON_INTERPRET"] = "0"  # halo's torch kernels: the interpreter is tested in test_kernels
    tp._torchvision_schemas()
    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(60)
    runs = {"adjoint": _adjoint, "block": _run_block, "model": lambda r, *a: _run_model(r, world, *a),
            "refused": lambda r: _refusals(r, world)}
    return [runs[case[0]](rank, *case[1:]) for case in cases]


SIZES = {2: [7, 5], 3: [5, 4, 3]}


def _cases(world: int) -> list[tuple]:
    sizes = SIZES[world]
    cases = [("adjoint", sizes, grid) for grid in (False, True)]
    cases += [("block", kind, grid, sizes) for kind in ("cl", "2d") for grid in (False, True)]
    cases += [("block", "cl", True, [18 // world] * world)]  # shards of whole 3-row windows: timm's block runs on them
    cases += [("model", False), ("model", True, "M", True) if world == 3 else ("model", False, "PM")]
    return cases + [("refused",)]


def _close(got: torch.Tensor, want: torch.Tensor, scale: float) -> bool:
    return float((got - want).abs().max()) <= RTOL * max(scale, 1e-300)


@pytest.mark.parametrize("world", [2, 3])
def test_maxvit_on_shards(world: int) -> None:
    cases = _cases(world)
    runs = run_on_ranks(_worker, world, cases, timeout=TIMEOUT)
    for i, case in enumerate(cases):
        res = [r[i] for r in runs]
        if case[0] == "adjoint":
            assert all(r["moved"] for r in res), case  # uneven shards cut the windows: rows travel
            lhs, rhs = res[0]["dots"]
            assert abs(lhs - rhs) <= 1e-12 * abs(lhs), (case, lhs, rhs)
            assert all(r["back"] and r["rows"] for r in res), case
        elif case[0] == "refused":
            for r in res:
                assert r == res[0], "every rank raises the same error"
            r = res[0]
            assert all(w in r["rows"] for w in ("stages.0.blocks.0.attn_grid", "20 rows", "grid partition's 3 rows")), \
                r["rows"]
            assert "TransformerBlock2d" in r["coatnet"] and "whole field" in r["coatnet"], r["coatnet"]
            assert "attn_drop (p=0.1)" in r["drop"], r["drop"]
            assert "PartitionAttention2d" in r["mesh"] and "latitude x longitude" in r["mesh"], r["mesh"]
        else:
            assert all(r.get("halo", True) and r.get("keys", True) and r.get("pickled", True) for r in res), case
            if case[0] == "model":
                assert res[0]["layers"] == (3 if case[-1] == "PM" else 6), res[0]["layers"]
            for r in res:
                assert _close(r["y"], r["want"], float(r["want"].abs().max())), case
                assert _close(r["g"], r["want_g"], float(r["want_g"].abs().max())), case
                top = max(float(g.abs().max()) for g in r["want_p"].values())
                bad = [n for n, g in r["p"].items() if not _close(g, r["want_p"][n], top)]
                assert not bad, (case, bad)
            if case[0] == "block" and case[2] and all(n % 3 == 0 for n in case[3]):
                # grid windows reach every rank: timm's grid attention within each shard, as it is, differs
                assert all(r["local"] is not None and r["local"] > 1e-3 for r in res), [r["local"] for r in res]
