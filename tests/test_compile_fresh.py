"""``torch.compile`` where users meet it first: a process whose first halo call is compiled, and new input shapes.

* A fresh interpreter (a subprocess: nothing of halo's state made before; checked, the context is empty) whose
  first call of bare halo layers is ``torch.compile(..., fullgraph=True)``: the context's states are first asked
  for inside dynamo's trace (a ``WeakKeyDictionary`` dynamo cannot make: it failed unless an earlier test had made
  them, so these passed in file order only). Pixel (un)shuffle equal to torch's; dropout and drop path regenerate
  their mask in backward; one compile, no recompile at steady calls; again after ``halo.context.reset()`` and in a
  fresh ``halo.context.use()`` (the graph that read the old states must not run on the new ones).
* A converted model (convs, GroupNorm, average and max pooling, bilinear upsampling) compiled whole
  (``fullgraph=True``) with torch's default ``dynamic=None`` and called at three input shapes in a row on 2 ranks
  (fresh processes: the first halo call is the compiled one): from the second shape on, dynamo makes the sizes
  symbolic, and every plan call specializes them (``halo.plan.plans._constant``); before, the plan's
  ``assume_constant_result`` failed ("argument conversion failed"; without ``fullgraph``, a graph break at every
  layer). Output, input gradient and parameter gradients (summed over ranks) equal the unsharded model's in
  float64; then ``dynamic=True`` at two shapes (every size and the upsampling's scale factor symbolic from the
  first call).

Tolerance: the compiled graph may reorder float64 sums: 1e-12 relative.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from halo.plan.partition import split_offsets
from halo.testing import run_on_ranks

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-12

_FIRST_CALL = r"""
import json, torch, torch.nn as nn
import torch._dynamo.testing
import halo
from halo import context
from halo.nn import DomainDropout, DomainDropPath
from halo.nn.shuffle import DomainPixelShuffle, DomainPixelUnshuffle

out = {"fresh": list(context.current().names())}

def shuffles(tag):
    x = torch.randn(1, 8, 6, 4)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    layers = (DomainPixelShuffle(nn.PixelShuffle(2)), DomainPixelUnshuffle(nn.PixelUnshuffle(2)))
    refs = (nn.PixelShuffle(2), nn.PixelUnshuffle(2))
    compiled = [torch.compile(layer, backend=counter, fullgraph=True) for layer in layers]
    equal = [torch.equal(c(x), ref(x)) for _ in range(3) for c, ref in zip(compiled, refs)]
    out[tag] = {"equal": all(equal), "frames": counter.frame_count, "names": list(context.current().names())}

def dropout():
    torch.manual_seed(3)
    model = nn.Sequential(DomainDropout(0.4), DomainDropPath(0.3))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = (torch.rand(16, 2, 9, 6, dtype=torch.float64) + 0.5).requires_grad_(True)
    y = compiled(x)
    y.backward(torch.ones_like(y))
    ratio = y.detach() / x.detach()
    out["dropout"] = {"mask": bool(torch.equal(x.grad == 0, ratio == 0)),
                      "grad": bool(torch.allclose(x.grad, ratio, rtol=1e-14, atol=0)),
                      "kept": float((ratio != 0).double().mean())}

shuffles("first")
dropout()
context.reset()
shuffles("reset")
with context.use():
    shuffles("use")
print("RESULT " + json.dumps(out))
"""


def test_a_fresh_process_whose_first_halo_call_is_compiled(tmp_path):
    script = tmp_path / "first_call.py"
    script.write_text(_FIRST_CALL)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["fresh"] == [], out  # nothing of halo's state before the first call: the test can fail
    for tag in ("first", "reset", "use"):
        assert out[tag]["equal"], (tag, out)
        assert out[tag]["frames"] == 2, (tag, out)  # one graph per layer, no recompile at its steady calls
        assert {"plans", "comm"} <= set(out[tag]["names"]), (tag, out)  # made while dynamo traced
    assert out["dropout"]["mask"] and out["dropout"]["grad"], out
    assert 0.1 < out["dropout"]["kept"] < 0.75, out  # 0.6 * 0.7 kept (16 samples)


# -- a converted model at new shapes -----------------------------------------------------------------------------

SHAPES = ((13, 8), (17, 10), (22, 6))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.AvgPool2d(2),
                         nn.MaxPool2d(3, stride=1, padding=1), nn.Upsample(scale_factor=2, mode="bilinear"),
                         nn.Conv2d(4, 2, 3, padding=1)).double()


def _inputs(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(h * 100 + w)
    x = torch.randn(2, 2, h, w, dtype=torch.float64, generator=g)
    return x, torch.randn(2, 2, 2 * (h // 2), 2 * (w // 2), dtype=torch.float64, generator=g)


def _shapes(rank, world, dynamics):
    import warnings

    import halo
    from halo import context
    from halo.nn import convert_to_domain_parallel

    warnings.simplefilter("ignore")  # (halo's note that a compiled first call of an epoch is not guarded)
    fresh = context.current().names()
    manager = halo.initialize_domain_parallel(world, world)
    out = {"fresh": fresh}
    for dynamic in dynamics:
        model = convert_to_domain_parallel(_net(), manager)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        runs = []
        for h, w in SHAPES if dynamic is None else SHAPES[:2]:
            x, gy = _inputs(h, w)
            xo, go = split_offsets(h, world), split_offsets(gy.shape[-2], world)
            xs = x[..., xo[rank]:xo[rank + 1], :].clone().requires_grad_(True)
            y = compiled(xs)
            y.backward(gy[..., go[rank]:go[rank + 1], :])
            runs.append((y.detach(), xs.grad, [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        out[dynamic] = runs
    return out


def _reference(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model = _net()
    x, gy = _inputs(h, w)
    x.requires_grad_(True)
    y = model(x)
    y.backward(gy)
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def test_a_compiled_converted_model_at_three_shapes_equals_the_unsharded_one():
    world = 2
    results = run_on_ranks(_shapes, world, (None, True), timeout=240)
    assert all(r["fresh"] == () for r in results), [r["fresh"] for r in results]
    for dynamic in (None, True):
        for i, (h, w) in enumerate(SHAPES if dynamic is None else SHAPES[:2]):
            y_ref, gx_ref, gp_ref = _reference(h, w)
            y = torch.cat([r[dynamic][i][0] for r in results], dim=-2)
            gx = torch.cat([r[dynamic][i][1] for r in results], dim=-2)
            assert y.shape == y_ref.shape and _rel(y, y_ref) < TOL, (dynamic, h, w, _rel(y, y_ref))
            assert _rel(gx, gx_ref) < TOL, (dynamic, h, w, _rel(gx, gx_ref))
            for k, ref in enumerate(gp_ref):  # each rank holds its rows' share of a parameter's gradient
                got = sum(r[dynamic][i][2][k] for r in results)
                assert _rel(got, ref) < TOL, (dynamic, h, w, k, _rel(got, ref))


def test_plan_arguments_are_made_plain_numbers():
    """Eager, ``_constant`` keeps values (an int subclass becomes an int of its value, which ``guard_scalar``
    refused: smp's Unet under compile failed so; bools stay bools; NamedTuples keep their type): what it does to
    symbolic ones is tested above, under dynamo."""
    import collections

    from halo.plan.plans import _constant

    class Sub(int):
        pass

    pair = collections.namedtuple("pair", "a b")
    got = _constant((Sub(10), True, 2.5, [3, (4,)], pair(5, "x"), None, "s"))
    assert got == (10, True, 2.5, [3, (4,)], pair(5, "x"), None, "s")
    assert type(got[0]) is int and got[1] is True and type(got[4]) is pair and type(got[3]) is list
