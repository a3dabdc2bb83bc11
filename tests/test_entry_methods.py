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
