"""Checkpoints of the whole training state (issue 30 item 5): ``halo.checkpoint.save/load`` restore the model and
the optimizer (through torch's ``get_state_dict``/``set_state_dict`` helpers), the LR scheduler, the GradScaler,
halo's RNG state, the step and any object with ``state_dict``/``load_state_dict``; what it cannot restore is
refused, on every rank alike (item 7).

Models: a tiny converted net (float64, 11 rows over 2 domain ranks: uneven shards) trained two Adam steps, saved on
4 ranks (2 dp x 2 domain) for each wrapping ``halo.parallelize`` makes (none, DDP, FSDP2, HSDP), then loaded into a
*fresh* model and optimizer on 2 ranks and on 1 process: the full model and optimizer state (``full_state_dict``)
after the load equals the one saved, bitwise (no arithmetic happens in between).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halo.testing import run_on_ranks

pytest.importorskip("torch.distributed.checkpoint.state_dict")

H, W, C = 11, 6, 3
MODES = ("none", "ddp", "fsdp", "hsdp")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(C, C, 3, padding=1)
        self.b = nn.Conv2d(C, 1, 1)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class Position:
    """A data position as a sampler keeps it (epoch, offset): any object with state_dict/load_state_dict."""

    def __init__(self, epoch=0, offset=0):
        self.epoch, self.offset = epoch, offset

    def state_dict(self):
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, sd):
        self.epoch, self.offset = sd["epoch"], sd["offset"]


def _full(model, opt):
    """The whole model and optimizer state, unsharded and keyed by names (what must survive a save/load)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                 flatten_optimizer_state_dict=True))
    def plain(v):
        return v.full_tensor().clone() if hasattr(v, "full_tensor") else (v.clone() if torch.is_tensor(v) else v)
    return {k: plain(v) for k, v in msd.items()}, {k: plain(v) for k, v in osd.items()}


def _equal(a, b):
    if a.keys() != b.keys():
        return f"keys {sorted(a)} vs {sorted(b)}"
    for k in a:
        x, y = a[k], b[k]
        same = torch.equal(x, y) if torch.is_tensor(x) else x == y
        if not same:
            return f"{k}: {x} vs {y}"
    return None


def _train(model, opt, sched, manager, steps=2):
    from halo.parallel.reduce import local_share, sync_domain_gradients
    from halo.plan.partition import split_offsets

    g = torch.Generator().manual_seed(5)
    offs = split_offsets(H, manager.domain_parallel_size)
    r = manager.domain_rank
    for _ in range(steps):
        x = torch.randn(2, C, H, W, dtype=torch.float64, generator=g)[..., offs[r]:offs[r + 1], :]
        local_share((model(x) ** 2).sum()).backward()  # this rank's share of a global sum
        sync_domain_gradients(model)
        opt.step()
        opt.zero_grad()
        sched.step()


def _build(world, domain, mode):
    import halo

    manager = halo.initialize_domain_parallel(world, domain)
    torch.manual_seed(0)
    model = halo.parallelize(Net().double(), manager, data_parallel=mode,
                             **({"hsdp_shards": 1} if mode == "hsdp" else {}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return manager, model, opt, sched


def _save_on_4(rank, world, root):
    import halo
    from halo import checkpoint

    halo.set_timeout(60.0)
    out = {}
    for mode in MODES:
        manager, model, opt, sched = _build(world, 2, mode)
        _train(model, opt, sched, manager)
        torch.manual_seed(7)  # the RNG state the checkpoint must carry (the same on every rank)
        checkpoint.save({"model": model, "optim": opt, "sched": sched, "step": 2, "pos": Position(3, 17)},
                        f"{root}/{mode}", 2)
        out[mode] = (*_full(model, opt), sched.state_dict(), torch.get_rng_state())
        halo.destroy_domain_parallel()
    return out


def _load_on_2(rank, world, root):
    import halo
    from halo import checkpoint

    halo.set_timeout(60.0)
    out = {}
    for mode in MODES:
        manager, model, opt, sched = _build(world, 2, mode)
        pos = Position()
        state = {"model": model, "optim": opt, "sched": sched, "step": 0, "pos": pos}
        torch.manual_seed(99)
        checkpoint.load(state, f"{root}/{mode}")
        out[mode] = (*_full(model, opt), sched.state_dict(), torch.get_rng_state(), state["step"],
                     pos.state_dict(), len(opt.state))
        halo.destroy_domain_parallel()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_state"))
    return root, run_on_ranks(_save_on_4, 4, root, timeout=400)[0]


def test_saved_on_4_loads_on_2_optimizer_included(saved):
    root, want = saved
    got = run_on_ranks(_load_on_2, 2, root, timeout=300)
    for mode in MODES:
        model_sd, optim_sd, sched_sd, rng = want[mode]
        for r, res in enumerate(got):
            g_model, g_optim, g_sched, g_rng, step, pos, entries = res[mode]
            assert entries == 2 * 2, (mode, r, entries)  # 4 parameters, each with its Adam moments and step
            assert _equal(model_sd, g_model) is None, (mode, r, _equal(model_sd, g_model))
            assert _equal(optim_sd, g_optim) is None, (mode, r, _equal(optim_sd, g_optim))
            assert g_sched == sched_sd and g_sched["last_epoch"] == 2, (mode, g_sched)
            assert torch.equal(g_rng, rng), mode
            assert step == 2 and pos == {"epoch": 3, "offset": 17}, (mode, step, pos)


def test_saved_on_4_loads_on_1_process(saved):
    from halo import checkpoint

    root, want = saved
    for mode in MODES:
        torch.manual_seed(1)
        model = Net().double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        state = {"model": model, "optim": opt, "sched": sched, "step": 0, "pos": Position()}
        checkpoint.load(state, f"{root}/{mode}")
        model_sd, optim_sd, sched_sd, rng = want[mode]
        g_model, g_optim = _full(model, opt)
        assert len(opt.state) == 4, (mode, len(opt.state))
        assert _equal(model_sd, g_model) is None, (mode, _equal(model_sd, g_model))
        assert _equal(optim_sd, g_optim) is None, (mode, _equal(optim_sd, g_optim))
        assert sched.state_dict() == sched_sd and state["step"] == 2, mode
        assert state["pos"].state_dict() == {"epoch": 3, "offset": 17}
        assert torch.equal(torch.get_rng_state(), rng), mode


def test_one_process_round_trip_of_everything(tmp_path):
    """Model, Adam, scheduler, GradScaler, plain values and halo's RNG in one process: a fresh set gets them all."""
    from halo import checkpoint, random

    torch.manual_seed(3)
    model = Net().double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(1, C, H, W, dtype=torch.float64)
    for _ in range(3):
        scaler.scale(model(x).square().sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
    scaler.update(512.0)  # a scale the fresh scaler would not have
    rng = random.get_rng_state()
    checkpoint.save({"model": model, "optim": opt, "sched": sched, "scaler": scaler, "epoch": 4,
                     "meta": {"name": "run", "lrs": [0.1, 0.2]}}, tmp_path, 3)
    want_model, want_optim = _full(model, opt)
    torch.manual_seed(4)
    model2 = Net().double()
    opt2 = torch.optim.Adam(model2.parameters(), lr=5.0)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    scaler2 = torch.amp.GradScaler("cpu")
    state = {"model": model2, "optim": opt2, "sched": sched2, "scaler": scaler2, "epoch": 0, "meta": None}
    torch.rand(5)  # move the generator on
    found = checkpoint.load(state, tmp_path)
    assert found.step == 3
    got_model, got_optim = _full(model2, opt2)
    assert _equal(want_model, got_model) is None and _equal(want_optim, got_optim) is None
    assert len(opt2.state) == 4 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == 512.0 and scaler2.state_dict() == scaler.state_dict()
    assert state["epoch"] == 4 and state["meta"] == {"name": "run", "lrs": [0.1, 0.2]}
    assert torch.equal(torch.get_rng_state(), rng["cpu"])
    torch.manual_seed(11)
    checkpoint.load({"model": model2}, tmp_path, rng=False)  # rng=False leaves the generator alone
    assert not torch.equal(torch.get_rng_state(), rng["cpu"])


def test_one_process_refusals(tmp_path):
    """The README's old recipe (the model as a state dict beside its optimizer) and objects that cannot be restored
    are refused, naming the entry; so is a load of an entry the checkpoint does not hold."""
    from halo import checkpoint

    model = Net().double()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(TypeError, match=r"state\['optim'\] is a torch.optim.adam.Adam but no module .* pass the "
                                        r"model itself"):
        checkpoint.save({"model": model.state_dict(), "optim": opt}, tmp_path, 1)
    with pytest.raises(TypeError, match=r"state\['gen'\] is a builtins.generator: halo.checkpoint cannot restore"):
        checkpoint.save({"model": model, "gen": (i for i in range(3))}, tmp_path, 1)
    with pytest.raises(TypeError, match=r"state\['train'\]\['optim'\] is a torch.optim.adam.Adam inside a dict"):
        checkpoint.save({"model": model, "train": {"optim": opt}}, tmp_path, 1)
    with pytest.raises(TypeError, match="'halo.rng'"):
        checkpoint.save({"halo.rng": 1}, tmp_path, 1)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        checkpoint.save({"model": model}, tmp_path, -1)
    assert checkpoint.latest(tmp_path) is None  # nothing was written by a refused save
    checkpoint.save({"model": model, "optim": opt}, tmp_path, 1)
    with pytest.raises(KeyError, match=r"it holds \['model', 'optim'\], not \['sched'\]"):
        checkpoint.load({"model": model, "sched": torch.optim.lr_scheduler.StepLR(opt, 1)}, tmp_path)
    with pytest.raises(ValueError, match=r"'optim' \(saved as optim, asked as object\)"):
        checkpoint.load({"model": model, "optim": 3}, tmp_path)


def _one_rank_wrong(rank, world, root):
    import halo
    from halo import checkpoint

    halo.set_timeout(30.0)
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.Adam(model.parameters())
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "passed"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"

    wrong = rank == world - 1
    attempt("optim_without_model", lambda: checkpoint.save(
        {"model": model.state_dict() if wrong else model, "optim": opt}, root, 1))
    attempt("other_keys", lambda: checkpoint.save({"model": model, **({"extra": 1} if wrong else {})}, root, 1))
    attempt("bad_step", lambda: checkpoint.save({"model": model}, root, -1 if wrong else 1))
    checkpoint.save({"model": model, "optim": opt}, root, 1)
    checkpoint.save({"model": model, "optim": opt}, root, 2)
    attempt("load_other_step", lambda: checkpoint.load({"model": model}, root, step=2 if wrong else 1))
    attempt("load_missing", lambda: checkpoint.load({"model": model, **({"sched": 1} if wrong else {})}, root))
    torch.manual_seed(rank)  # now the ranks' generators differ: kept per rank
    checkpoint.save({"model": model}, root, 3)
    return out


def test_bad_input_on_one_rank_same_error_everywhere(tmp_path):
    from halo import checkpoint

    results = run_on_ranks(_one_rank_wrong, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1], results  # the same message on every rank, nothing passed on one rank only
    out = results[0]
    assert out["optim_without_model"].startswith("TypeError: halo.checkpoint.save: group rank 1 (global 1): "
                                                 "state['optim'] is a torch.optim.adam.Adam but no module"), out
    assert out["other_keys"].startswith("ValueError: halo.checkpoint.save: the ranks pass different "
                                        "states: group rank 0 (global 0): [('model', 'model')]; group rank 1 "
                                        "(global 1): [('extra', 'object'), ('model', 'model')]"), out
    assert out["bad_step"].startswith("ValueError: halo.checkpoint.save: group rank 1 (global 1): step must be an "
                                      "int >= 0, got -1"), out
    assert "the ranks pass different states" in out["load_other_step"] and "step=1" in out["load_other_step"] \
        and "step=2" in out["load_other_step"], out
    assert out["load_missing"].startswith("ValueError: halo.checkpoint.load: the ranks pass different states"), out
    # the RNG states differed at step 3: kept one per rank, so one process cannot take them (rng=False can)
    model = Net().double()
    with pytest.raises(ValueError, match=r"\['halo.rng'\] differed between the 2 ranks that saved it .* cannot be "
                                         r"restored on 1 ranks; load on 2 ranks, or pass rng=False"):
        checkpoint.load({"model": model}, tmp_path, step=3)
    assert checkpoint.load({"model": model}, tmp_path, step=3, rng=False).step == 3


def test_saving_a_fresh_optimizer_leaves_it_fresh(tmp_path):
    """torch's get_optimizer_state_dict steps an optimizer without state once (zero gradients, lr 0) to make one:
    a save before the first step must not leave that behind (Adam's first step would be its second), and the
    load gives a fresh optimizer back, so training from the loaded one equals training from the original."""
    from halo import checkpoint

    torch.manual_seed(2)
    model = Net().double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    checkpoint.save({"model": model, "optim": opt}, tmp_path, 0)
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    torch.manual_seed(9)
    model2 = Net().double()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    checkpoint.load({"model": model2, "optim": opt2}, tmp_path)
    assert len(opt2.state) == 0
    x = torch.randn(1, C, H, W, dtype=torch.float64)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert int(opt.state[next(model.parameters())]["step"]) == 1


def test_load_refuses_an_optimizer_it_cannot_fill(tmp_path):
    """A fresh optimizer whose parameters hold gradients gets no state from torch's helper (it only makes one for
    an optimizer without gradients): the load would give 0 of its entries, silently. Refused, naming the fix."""
    from halo import checkpoint

    model = Net().double()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(1, C, H, W, dtype=torch.float64)
    model(x).sum().backward()
    opt.step()
    checkpoint.save({"model": model, "optim": opt}, tmp_path, 1)
    model2 = Net().double()
    opt2 = torch.optim.Adam(model2.parameters())
    model2(x).sum().backward()
    with pytest.raises(ValueError, match=r"optimizer 'optim' has no state to load 4 entries into: .*"
                                         r"zero_grad\(set_to_none=True\) before loading"):
        checkpoint.load({"model": model2, "optim": opt2}, tmp_path)
    opt2.zero_grad(set_to_none=True)
    checkpoint.load({"model": model2, "optim": opt2}, tmp_path)
    assert len(opt2.state) == 4


def test_rng_state_refusals():
    from halo import random

    with pytest.raises(TypeError, match=r"expected the dict get_rng_state\(\) returns \(key 'cpu'\), got list"):
        random.set_rng_state([1])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state = {"cpu": torch.get_rng_state(), "cuda": [torch.get_rng_state()] * (have + 1)}
    with pytest.raises(ValueError, match=f"holds {have + 1} CUDA generators, this process sees {have} CUDA devices"):
        random.set_rng_state(state)
