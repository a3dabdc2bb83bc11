"""The guard's one op policy (issue 31 item 3): one table from torch function to its policy, written once per axis
and applied to H and W alike (no rewrite of H's messages into W's), and no other op table in the guard package."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from halo.guard._policy import POLICY, H, Policy, W

GUARD = Path(__file__).resolve().parents[1] / "halo" / "guard"
OLD_TABLES = ("PASS", "LAYOUT", "MERGES", "MATMUL", "STACK", "SIZE_READS", "INTERPOLATES", "MEANS", "RULES",
              "SPECIAL", "SPECIAL_FOLLOW", "EXACT")


def test_no_other_op_table_remains_in_the_guard():
    """The names of the 11 old tables are gone from the guard's code (``on_w``'s regex rewrite too)."""
    for path in sorted(GUARD.glob("*.py")):
        code = path.read_text()
        for name in OLD_TABLES:
            assert not re.search(rf"^\s*{name}\s*[:=]|\b{name}\[|in {name}\b|\b{name}\.get\(", code, re.M), \
                (path.name, name)
        assert "re.sub" not in code and "def on_w" not in code, path.name


def test_every_entry_has_a_kind_and_what_its_kind_needs():
    kinds = {"pass", "follow", "exact", "refuse"}
    assert {p.kind for p in POLICY.values()} == kinds
    for f, p in POLICY.items():
        assert isinstance(p, Policy) and p.kind in kinds, f
        if p.kind == "exact":
            assert (p.rule is not None or p.check is not None) and callable(p.exact), f
            assert p.how in ("norm", "mean", "vector_norm", "interpolate", "attention", "dropout", "pool", "sum",
                             "softmax", "contract"), f
        if p.kind == "refuse":
            assert p.rule is not None or p.check is not None, f
        if p.kind == "pass":
            assert p.rule is None and p.check is None and p.after is None, f


def _words(text: str) -> str:
    return text.replace("H", "<axis>").replace("W", "<axis>").replace("rows", "<unit>").replace("columns", "<unit>")


def test_a_rule_is_written_once_and_worded_for_each_axis():
    """The same rule, on H (dim -2) and on W (dim -1) of a (B, C, H, W) field: the same words, each axis' own name,
    unit and gather, W's with the mesh's prefix; a window rule reads the axis' own entry of the kernel."""
    x = torch.zeros(1, 2, 6, 8)
    w = torch.zeros(2, 2, 1, 3)  # a kernel of 1 along H, 3 along W
    calls = [(F.pad, (x, (1, 1, 1, 1)), {}), (torch.roll, (x, 1), {"dims": (2, 3)}), (torch.flip, (x, (2, 3)), {}),
             (torch.cat, ([x, x],), {"dim": 2}), (F.interpolate, (x,), {"scale_factor": 1.5, "mode": "bilinear"})]
    for func, args, kwargs in calls:
        p = POLICY[func]
        on_h, on_w = p.problem(args, kwargs, x, 2, H), p.problem(args, kwargs if func is not torch.cat else
                                                                 {"dim": 3}, x, 3, W)
        assert on_h and on_w and not on_h.startswith("acts on W"), (func, on_h, on_w)
        assert on_w.startswith(W.prefix) and "W" in on_w and " H " not in on_w, (func, on_w)
        assert _words(on_w.removeprefix(W.prefix)).replace("halo.gather_2d", "halo.gather") == \
            _words(on_h).replace("halo.gather_2d", "halo.gather"), func
    conv = POLICY[F.conv2d]
    assert conv.problem((x, w), {}, x, 2, H) is None  # kernel 1 along H: pointwise in H
    assert "kernel 3" in conv.problem((x, w), {}, x, 3, W)  # kernel 3 along W: a window over the sharded W


def test_default_deny_an_unlisted_op_has_no_entry():
    assert torch.trapezoid not in POLICY and torch.cdist not in POLICY
    assert POLICY[torch.add].kind == "pass" and POLICY[torch.Tensor.permute].kind == "follow"
    assert POLICY[F.group_norm].kind == "exact" and POLICY[torch.fft.rfft2].kind == "refuse"


def test_a_layers_functional_twin_is_hinted_from_the_registry():
    """Every torch function a halo layer declares itself the exact form of (``@converts(functional=...)``) is
    classified by the one table (never default-denied as unknown), and a refusal of it whose rule names no way out
    gets the registry's (the torch module to use, the halo layer it becomes): a new layer needs no guard edit."""
    import halo.nn  # noqa: F401 - fills the registry
    from halo.guard import POLICY, with_twin_hint
    from halo.nn.registry import functional_twins

    twins = functional_twins()
    assert twins, "no functional twins registered"
    for func, cls in twins.items():
        assert func in POLICY, f"{getattr(func, '__name__', func)} (the twin of {cls.__name__}) is not in POLICY"
        hinted = with_twin_hint(func, "acts on H")
        assert f"halo.nn.{cls.__name__}" in hinted and hinted.startswith("acts on H; use nn."), hinted
        already = "acts on H; use nn.X (converted to halo.nn.Y)"
        assert with_twin_hint(func, already) == already  # a rule's own way out is kept, not doubled
    assert with_twin_hint(torch.roll, "rolls H") == "rolls H"  # no twin: unchanged
