"""A converted model's other entries (``forward_features``, ``forward_head``, ``forward_intermediates``: the methods
of its class named ``forward_*``, which users call instead of ``model(x)``) are calls of the model
(``halo.nn.root.RootMethod``): exact where ``model(x)`` is, and their own code, which ``forward`` never runs, is
watched by the guard at its first call. Before, such a call ran unguarded: timm's EfficientFormer
``forward_intermediates`` reshapes with the shard's rows and returned a wrong shape on one rank, silently.

2 gloo ranks, 9 rows (5 + 4), float64: forward, input and parameter gradients against the unsharded model; the
refusal on every rank; later calls (rerouted, unguarded) equal the first; copies and pickles keep the entries;
``revert_domain_parallel`` removes them.
"""

import copy
import os
import pickle

import torch
from torch import nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward_features(self, x):
        return torch.tanh(self.conv(x))

    def forward_head(self, f):
        return self.head(f.mean((2, 3)))

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x):
        f = self.forward_features(x)
        return [f, f[:, :, : f.shape[2] // 2]]  # the first half of the shard's rows: not the field's


def _case(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel, revert_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(10)
    torch.manual_seed(0)
    model = Features().double()
    convert_to_domain_parallel(model)
    full = torch.randn(2, 2, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(9, world)
    x = full[:, :, offs[rank]:offs[rank + 1]].clone().requires_grad_(True)
    out = {}
    f = model.forward_features(x)
    logits = model.forward_head(f)
    (f.sum() * 0.5 + logits.sum() / world).backward()  # (the logits are whole: each rank's share of their loss)
    out["features"], out["logits"], out["dx"] = f.detach(), logits.detach(), x.grad
    out["dw"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["steady"] = [bool(torch.equal(model.forward_head(f.detach()), logits.detach())) for _ in range(2)]
    copies = (("model", model), ("deepcopy", copy.deepcopy(model)), ("pickle", pickle.loads(pickle.dumps(model))))
    for name, m in copies:
        try:
            m.forward_intermediates(x.detach())
            out[name] = "ran"
        except ValueError as exc:
            out[name] = str(exc)
    revert_domain_parallel(model)
    out["reverted"] = "forward_features" not in model.__dict__
    return out


def test_other_entries_are_calls_of_the_model():
    results = run_on_ranks(_case, 2, timeout=90)
    torch.manual_seed(0)
    ref = Features().double()
    full = torch.randn(2, 2, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    f = ref.forward_features(full)
    logits = ref.forward_head(f)
    (f.sum() * 0.5 + logits.sum()).backward()
    offs = split_offsets(9, 2)
    torch.testing.assert_close(torch.cat([r["features"] for r in results], 2), f.detach(), rtol=0, atol=1e-12)
    for r in results:
        torch.testing.assert_close(r["logits"], logits.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["dx"] for r in results], 2), full.grad, rtol=0, atol=1e-12)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sum(r["dw"][n] for r in results), p.grad, rtol=0, atol=1e-12)
    assert offs == [0, 5, 9]
    for name in ("model", "deepcopy", "pickle"):
        errors = [r[name] for r in results]
        assert errors[0] == errors[1] and "f.shape[2] // 2" in errors[0] and "indexes H" in errors[0], errors
    assert all(r["reverted"] and r["steady"] == [True, True] for r in results), results


class Pooled(nn.Module):
    """A mean over H in the method's own code (rerouted: computed exactly), and a method that slices the shard."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward_features(self, x):
        y = self.conv(x)
        return y * y.mean(2, keepdim=True)

    def forward_intermediates(self, x):
        y = self.conv(x)
        return y[:, :, : y.shape[2] // 2]

    def forward(self, x):
        return self.forward_features(x)


def _compiled(rank, world):
    os.environ["TRITON_INTERPRET"] = "0"
    import halo
    from halo.nn import convert_to_domain_parallel

    halo.initialize_domain_parallel(world, world)
    halo.set_timeout(10)
    full = torch.randn(2, 2, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    offs = split_offsets(9, world)
    out = {}
    for backend in ("eager", "aot_eager"):
        torch.manual_seed(0)
        model = convert_to_domain_parallel(Pooled().double())
        f = torch.compile(model.forward_features, backend=backend)
        x = full[:, :, offs[rank]:offs[rank + 1]].clone().requires_grad_(True)
        y = f(x)  # the first call compiled
        y.sum().backward()
        out[backend] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()},
                        f(x.detach()).detach())
        try:
            torch.compile(model.forward_intermediates, backend=backend)(x.detach())
            out[backend + " refused"] = None
        except ValueError as exc:
            out[backend + " refused"] = str(exc)
        out[backend + " after"] = f(x.detach()).detach()  # a refusal leaves no call open (the next is guarded)
    return out


def test_a_compiled_entry_is_guarded_at_its_first_call():
    """``torch.compile(model.forward_features)``: its first call runs the method once eagerly under the guard
    (``halo.plan.plans.guarded_eager_call``), so the mean over H in its own code is exact, compiled, forward and
    backward; a slice of the shard's rows in another method is refused on every rank, and leaves no call open
    (the model's next calls are exact: a first version left the refused call's depth behind, and every later call
    then ran unguarded, 1.07 off). Before, a compiled entry skipped the model's call altogether: the mean ran per
    shard, 0.40-0.55 off, with no warning."""
    results = run_on_ranks(_compiled, 2, timeout=120)
    torch.manual_seed(0)
    ref = Pooled().double()
    full = torch.randn(2, 2, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    y = ref.forward_features(full)
    y.sum().backward()
    for backend in ("eager", "aot_eager"):
        torch.testing.assert_close(torch.cat([r[backend][0] for r in results], 2), y.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(torch.cat([r[backend][3] for r in results], 2), y.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(torch.cat([r[backend + " after"] for r in results], 2), y.detach(), rtol=0,
                                   atol=1e-12)
        torch.testing.assert_close(torch.cat([r[backend][1] for r in results], 2), full.grad, rtol=0, atol=1e-12)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(sum(r[backend][2][n] for r in results), p.grad, rtol=0, atol=1e-12)
        errors = [r[backend + " refused"] for r in results]
        assert errors[0] is not None and errors[0] == errors[1] and "indexes H" in errors[0], errors
