"""The house's layering rules (issue 22 item 5, docs/architecture.md), checked on the source by an AST scan.

The scan reads every module of ``halo/`` and of ``kernels/`` (installed as ``halo.kernels``) and every import in it:
module level and inside functions alike (a function-level import hides a cycle from Python at import time, not from
the reader, and it is how circles crept in), relative or absolute, and ``importlib.import_module("halo...")`` with
a literal name. The rules:

(a) no import cycle between halo modules;
(b) nothing outside ``halo.tools`` imports ``halo.tools``, except the thin aliases in :data:`ALIASES` (names users
    and old console scripts call), which must stay thin;
(c) the core (``halo/*.py`` except tools, nn, compat and the API tier) never imports ``halo.nn``;
(c') the API tier (:data:`API`: the package's facade and the calls that convert a model for you, ``check`` and
    ``parallel``) sits above nn: the core, nn and the kernels never import it;
(d) ``halo.nn`` never imports ``halo.compat`` or the tools, and neither the core nor the API tier imports
    ``halo.compat`` (a compat layer plugs into what it adapts, never the reverse);
(e) no private name (``_x``) imported from another module or read off one (``plans._STATE``); a private module
    (``_x.py``) is imported only inside its own package;
(f) ``halo.kernels`` imports nothing of halo outside itself (the kernels are the bottom of the house);
(g) the core's packages are ordered (:data:`TIERS`: dist, plan, exchange, parallel, io): a module of one never
    imports a later one, and ``halo.context`` imports no other halo module;
(h) the guard sits between the layers and the converter (issue 31 item 2): core < nn layers < ``halo.guard`` <
    the converter (:data:`CONVERTER`: the modules that start the guard) < the API tier. The guard imports the
    layers' exact functionals by name; a layer never imports the guard or the converter (it marks trusted code and
    places a tensor's H through :mod:`halo.context`); the core never imports the guard;
(i) no module slot is filled from another module at import (late binding: ``use_guard(SpatialGuard)`` at the end
    of the guard, ``reroute.provide(...)`` at the end of a layer): the tier that needs a thing imports it. A
    registry filled by decorators of its own package is code, not late binding.

What breaks a rule today is listed in :data:`EXPECTED_VIOLATIONS`, each with its reason (issue 22). A test fails when
a violation appears that is not listed, and when a listed one is gone: then remove it from the list, so that the
list only shrinks. The scanner itself is tested on a small package written for the purpose (a rule checker that
cannot see a violation would pass forever).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"halo": ROOT / "halo", "halo.kernels": ROOT / "kernels"}

#: modules outside ``halo.tools`` that may import it: re-exports of public names, nothing else (test_aliases_are_thin)
ALIASES = {
    "halo.__main__": "``python -m halo``: the command's entry point",
    "halo.cli": "``halo`` console scripts installed before the move run ``from halo.cli import main``",
    "halo.demo": "``from halo.demo import DemoNet`` in users' scripts (the demo's model, its field)",
}

#: the API tier (below the package name: ``halo`` itself, a facade importing every tier but nn and the tools): modules
#: that convert a model for their caller, so import ``halo.nn`` (lazily: ``import halo`` loads no layer); nothing
#: below imports them (test_the_api_tier_is_on_top)
API = {
    "check": "check_equivalence converts the model it checks (convert_to_domain_parallel); the package's "
             "modules with it",
    "parallel": "the parallel package's face re-exports parallelize beside the gradient sync",
    "parallel.wrap": "parallelize converts the model before wrapping it for data parallelism",
}

#: the core's packages, lowest first (docs/architecture.md): a module of one never imports a later one (rule g).
#: ``halo.context`` sits below them all; the other top-level core modules (shard, random, autocast, checkpoint, ...)
#: use them and are used by nn and the API tier
TIERS = ("dist", "plan", "exchange", "parallel", "io")

#: the nn modules above the guard (rule h): they start its watch (the root's config hands the planner the guard's
#: class) or reach it through the converter; every other ``halo.nn`` module is a layer, below the guard
CONVERTER = {
    "nn": "the package's face imports the converter (convert_to_domain_parallel) beside the layers",
    "nn.convert": "revert_domain_parallel uninstalls the guard's reroutes (halo.guard.reroute.uninstall)",
    "nn.root": "RootConfig.guard: the guard the planner enters at a converted model's first call",
}

_CYCLE, _TOOLS, _CORE_NN, _COMPAT, _PRIVATE, _KERNELS, _API, _TIER, _SLOT = (
    "cycle", "imports the tools", "core imports nn", "imports compat", "private name", "kernels import halo",
    "imports the api tier", "imports a higher tier", "fills a slot of another module at import")
_GUARD_TIER = "breaks nn layers < guard < converter"

#: today's violations, each with why it is there; the list may only shrink (see the module docstring). Empty since
#: issue 22: comm <-> mesh went with the one state object; compat/credit -> nn -> nn/convert -> compat/credit and
#: nn/convert -> compat/credit with CREDIT CrossFormer's padding object moving to the layers (halo.nn.convert,
#: re-exported by compat); check -> nn and parallel -> nn with the API tier (API above).
EXPECTED_VIOLATIONS: dict[tuple[str, ...], str] = {}
# (issue 22's 9 private cross-module imports: 3 went with the move to tools, 6 were made public names)


# -- the scanner ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    """One import of a halo module: ``importer`` imports ``target`` (a module), or ``name`` from it (not a module)."""
    importer: str
    target: str
    name: str | None
    path: Path
    line: int

    def where(self) -> str:
        """``file:line``, the file relative to the repository (or to the folder above a scanned package)."""
        top = next((p for p in self.path.parents if p.name == self.importer.split(".")[0]), None)
        base = ROOT if self.path.is_relative_to(ROOT) else (top.parent if top else self.path.parent)
        return f"{self.path.relative_to(base)}:{self.line}"


def discover(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under each package folder (a folder is a package by its name here,
    as ``pyproject.toml`` maps it); a package is named by its ``__init__.py``."""
    out: dict[str, Path] = {}
    for pkg, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([pkg, *parts])
            if any(name == p or name.startswith(p + ".") for p in packages if p != pkg and p.startswith(pkg + ".")):
                continue  # a folder mapped as its own package elsewhere
            out[name] = path
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` denotes, or the innermost module above it (``halo.nn.X`` for a name X of halo.nn)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(importer: str, node: ast.ImportFrom, mods: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    base = importer if mods[importer].name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _ours(name: str, roots: set[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def imports_of(importer: str, mods: dict[str, Path]) -> list[Import]:
    """Every import of a halo module in ``importer``'s file (unresolvable ones get ``target=''``)."""
    path = mods[importer]
    roots = {m.split(".")[0] for m in mods}
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found: list[tuple[str, str | None]] = []
        if isinstance(node, ast.Import):
            found = [(a.name, None) for a in node.names if _ours(a.name, roots)]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(importer, node, mods)
            if _ours(base, roots):
                found = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods else (base, a.name)
                         for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _ours(node.args[0].value, roots)):
            found = [(node.args[0].value, None)]
        for target, name in found:
            owner = _owner(target, mods)
            if owner != target and name is None and owner is not None:  # import halo.x.y where y is not a module
                target, name = owner, target[len(owner) + 1:]
            out.append(Import(importer, target if owner else "", name, path, node.lineno))
    return out


def private_reads(importer: str, mods: dict[str, Path]) -> list[Import]:
    """``mod._x`` where ``mod`` is a name this file bound to another halo module (``from . import plans``)."""
    path = mods[importer]
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(importer, node, mods)
            for a in node.names:
                if f"{base}.{a.name}" in mods:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in mods:
                    bound[a.asname] = a.name
    return [Import(importer, bound[n.value.id], n.attr, path, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
            and bound[n.value.id] != importer and _private(n.attr)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def tier(module: str, root: str = "halo") -> str:
    """Which part of the house ``module`` (of the package ``root``) is in: tools, alias, api, converter, guard, nn
    (the layers), compat, kernels, core."""
    if module in ALIASES:
        return "alias"
    if module == root or module in {f"{root}.{name}" for name in API} or module.startswith(f"{root}.check."):
        return "api"
    if module in {f"{root}.{name}" for name in CONVERTER}:
        return "converter"
    for sub in ("tools", "guard", "nn", "compat", "kernels"):
        prefix = f"{root}.{sub}"
        if module == prefix or module.startswith(prefix + "."):
            return sub
    return "core"


def core_rank(module: str, root: str = "halo") -> int | None:
    """The rank of a core module's package in :data:`TIERS` (``halo.context``: -1, below all), else None."""
    if module == f"{root}.context":
        return -1
    parts = module.split(".")
    return TIERS.index(parts[1]) if len(parts) > 2 and parts[1] in TIERS else None


def violations(edges: list[Import], reads: list[Import], mods: dict[str, Path],
               root: str = "halo") -> dict[tuple[str, ...], list[str]]:
    """Every broken rule: key (as in :data:`EXPECTED_VIOLATIONS`) -> where (``file:line`` and what)."""
    found: dict[tuple[str, ...], list[str]] = {}

    def add(key: tuple[str, ...], text: str) -> None:
        found.setdefault(key, []).append(text)

    for e in edges:
        src, dst = tier(e.importer, root), tier(e.target, root)
        what = f"{e.where()}: {e.importer} imports {e.target}" + (f".{e.name}" if e.name else "")
        if (dst in ("tools", "alias") and src not in ("tools", "alias")) or (src == "alias" and dst != "tools"):
            add((_TOOLS, e.importer, e.target), what)
        if src == "core" and dst in ("nn", "converter"):
            add((_CORE_NN, e.importer, e.target), what)
        if (src, dst) in (("core", "guard"), ("nn", "guard"), ("nn", "converter"), ("guard", "converter")):
            add((_GUARD_TIER, e.importer, e.target), what)
        if src in ("core", "api", "nn", "guard", "converter", "kernels") and dst == "compat":
            add((_COMPAT, e.importer, e.target), what)
        if src in ("core", "nn", "guard", "converter", "kernels") and dst == "api":
            add((_API, e.importer, e.target), what)
        if src == "kernels" and dst != "kernels":
            add((_KERNELS, e.importer, e.target), what)
        if src == "core" and dst == "core":
            a, b = core_rank(e.importer, root), core_rank(e.target, root)
            if a is not None and b is not None and b > a:
                add((_TIER, e.importer, e.target), what)
        private_module = next((p for p in e.target.split(".") if _private(p)), None)
        home = e.target.partition("." + private_module)[0] if private_module else ""
        if private_module and not (e.importer == home or e.importer.startswith(home + ".")):
            add((_PRIVATE, e.importer, e.target), f"{what} (a private module, outside its package)")
    for e in [e for e in edges if e.name and _private(e.name) and e.target != e.importer] + reads:
        add((_PRIVATE, e.importer, f"{e.target}.{e.name}"), f"{e.where()}: {e.importer} uses {e.target}.{e.name}")
    for cycle in cycles(mods, edges):
        add((_CYCLE, *sorted(cycle)), " -> ".join(cycle_path(cycle, edges)))
    return found


def cycles(mods: dict[str, Path], edges: list[Import]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if e.target and e.target != e.importer:
            graph[e.importer].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def cycle_path(members: set[str], edges: list[Import]) -> list[str]:
    """A shortest cycle through the first member, each step named with the file:line that makes it."""
    step: dict[tuple[str, str], Import] = {}
    for e in edges:
        if e.importer in members and e.target in members and e.target != e.importer:
            step.setdefault((e.importer, e.target), e)
    start = min(members)
    seen, queue = {start: [start]}, deque([start])
    while queue:
        v = queue.popleft()
        for (a, b), _ in sorted(step.items()):
            if a != v:
                continue
            if b == start:
                path = seen[v] + [start]
                return [f"{x} ({step[(x, y)].where()})" for x, y in zip(path, path[1:], strict=False)] + [start]
            if b not in seen:
                seen[b] = seen[v] + [b]
                queue.append(b)
    return sorted(members)


def scan(packages: dict[str, Path], root: str = "halo"
         ) -> tuple[dict[str, Path], list[Import], dict[tuple[str, ...], list[str]]]:
    """The modules, every import of theirs, and the violations of the rules (``root``: the top package's name)."""
    mods = discover(packages)
    edges = [e for m in mods for e in imports_of(m, mods)]
    reads = [r for m in mods for r in private_reads(m, mods)]
    return mods, edges, violations([e for e in edges if e.target], reads, mods, root)


# -- rule (i): no module slot filled from another module at import ---------------------------------------------------

_MUTATORS = {"append", "appendleft", "extend", "update", "add", "insert", "setdefault", "pop", "popitem", "clear",
             "remove", "discard", "__setitem__"}
_CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary",
               "WeakValueDictionary", "WeakSet"}


def _mutable_globals(tree: ast.Module) -> set[str]:
    """A module's top-level names bound to a mutable container (``_X: list = [None]``, ``_X = {}``, ``dict()``)."""
    out: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        call = value.func if isinstance(value, ast.Call) else None
        name = getattr(call, "id", getattr(call, "attr", None))
        if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp) or \
                name in _CONTAINERS:
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _fills(fn: ast.AST, slots: set[str]) -> set[str]:
    """The module globals that function ``fn`` changes: a container mutated, an item stored, a ``global`` rebound."""
    declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in slots:
            out.add(node.func.value.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del) \
                and isinstance(node.value, ast.Name) and node.value.id in slots:
            out.add(node.value.id)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in declared:
            out.add(node.id)
    return out


def _import_time(tree: ast.Module) -> list[tuple[ast.AST, bool]]:
    """Every node that runs when the module is imported, with whether it is a decorator: module-level statements
    and class bodies, not function bodies (they run when called)."""
    out: list[tuple[ast.AST, bool]] = []
    work: list[tuple[ast.AST, bool]] = [(n, False) for n in tree.body]
    while work:
        node, deco = work.pop()
        out.append((node, deco))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            work += [(d, True) for d in node.decorator_list]
            if isinstance(node, ast.ClassDef):
                work += [(n, False) for n in node.body]
            continue
        if isinstance(node, ast.Lambda):
            continue
        work += [(c, deco) for c in ast.iter_child_nodes(node)]
    return out


def _package_of(module: str, mods: dict[str, Path]) -> str:
    return module if mods[module].name == "__init__.py" else module.rpartition(".")[0]


def slot_fills(mods: dict[str, Path]) -> dict[tuple[str, ...], list[str]]:
    """Rule (i): module slots filled from another module at import (``use_guard(SpatialGuard)`` at the end of the
    guard, ``reroute.provide(...)`` at the end of a layer, ``other._X.append(...)``, ``other.X = ...``): key
    ``(kind, importer, slot's module.function or slot)`` -> where. A decorator of the slot's own package filling its
    registry (``@converts``) is code, not late binding: allowed."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    slots = {m: _mutable_globals(t) for m, t in trees.items()}
    fillers: dict[str, set[str]] = {}
    for m, t in trees.items():
        globals_ = slots[m] | {n for node in t.body if isinstance(node, ast.Assign) for n in
                               (x.id for x in node.targets if isinstance(x, ast.Name))}
        fillers[m] = {f.name for f in t.body if isinstance(f, ast.FunctionDef) and _fills(f, globals_)}
    found: dict[tuple[str, ...], list[str]] = {}
    for n, tree in trees.items():
        modules: dict[str, str] = {}
        names: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(n, node, mods)
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        modules[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in mods:
                        names[a.asname or a.name] = (base, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in mods:
                        modules[a.asname] = a.name
        for node, deco in _import_time(tree):
            hit = None
            if isinstance(node, ast.Call) or deco and isinstance(node, ast.Name | ast.Attribute):
                f = node.func if isinstance(node, ast.Call) else node  # (a decorator is called too: ``@register``)
                if isinstance(f, ast.Name) and f.id in names and names[f.id][1] in fillers.get(names[f.id][0], ()):
                    hit = names[f.id]
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules \
                        and f.attr in fillers[modules[f.value.id]]:
                    hit = modules[f.value.id], f.attr
                elif isinstance(f, ast.Attribute) and f.attr in _MUTATORS and isinstance(f.value, ast.Attribute) \
                        and isinstance(f.value.value, ast.Name) and f.value.value.id in modules:
                    hit = modules[f.value.value.id], f.value.attr
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                for t in getattr(node, "targets", None) or [getattr(node, "target", None)]:
                    t = t.value if isinstance(t, ast.Subscript) else t
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                        hit = modules[t.value.id], t.attr
            if hit is None or hit[0] == n:
                continue
            if deco and _package_of(n, mods) == _package_of(hit[0], mods):
                continue  # a registry filled by decorators in its own package
            path = mods[n]
            found.setdefault((_SLOT, n, f"{hit[0]}.{hit[1]}"), []).append(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}: {n} fills "
                f"{hit[0]}.{hit[1]} at import")
    return found


MODS, EDGES, FOUND = scan(PACKAGES)


def _check_rule(kind: str) -> None:
    """Found violations of ``kind`` == the listed ones: name the new (with file:line) and the gone."""
    found = {k: v for k, v in FOUND.items() if k[0] == kind}
    listed = {k for k in EXPECTED_VIOLATIONS if k[0] == kind}
    new = {k: v for k, v in found.items() if k not in listed}
    gone = listed - set(found)
    text = []
    if new:
        text.append(f"new {kind} violation(s), not in EXPECTED_VIOLATIONS:\n" + "\n".join(
            f"  {k[1:]}:\n    " + "\n    ".join(v) for k, v in sorted(new.items())))
    if gone:
        text.append(f"listed {kind} violation(s) gone: fixed (remove them from EXPECTED_VIOLATIONS and from "
                    f"docs/architecture.md){' or now part of a larger cycle above' if kind == _CYCLE else ''}:\n"
                    + "\n".join(f"  {k[1:]}" for k in sorted(gone)))
    assert not text, "\n".join(text)


# -- the rules on halo --------------------------------------------------------------------------------------------

def test_every_halo_import_resolves_to_a_module():
    """A halo import the scan cannot place (a stale name, a typo) would escape every rule below."""
    bad = [f"{e.where()}: {e.importer}" for e in EDGES if not e.target]
    assert not bad, f"imports of halo modules that do not exist: {bad}"
    assert {"halo", "halo.nn.convert", "halo.kernels.dispatch", "halo.tools.cli"} <= set(MODS)


def test_no_import_cycles():
    _check_rule(_CYCLE)


def test_nothing_outside_the_tools_imports_them():
    _check_rule(_TOOLS)


def test_the_core_never_imports_nn():
    _check_rule(_CORE_NN)


def test_nn_and_the_core_never_import_compat():
    _check_rule(_COMPAT)


def test_the_api_tier_is_on_top():
    _check_rule(_API)
    assert {f"halo.{name}" for name in API} <= set(MODS), sorted(API)


def test_no_private_names_across_modules():
    _check_rule(_PRIVATE)


def test_kernels_import_nothing_of_halo_outside_themselves():
    _check_rule(_KERNELS)


def test_the_core_packages_are_ordered():
    _check_rule(_TIER)
    assert {f"halo.{t}" for t in TIERS} <= set(MODS), TIERS


def test_the_guard_sits_between_the_layers_and_the_converter():
    """Rule (h): no layer imports the guard (``from ..guard import place`` was one), nor the core; the guard imports
    the layers it reroutes to (not the converter); the converter modules are real and import the guard."""
    _check_rule(_GUARD_TIER)
    assert {f"halo.{name}" for name in CONVERTER} <= set(MODS), sorted(CONVERTER)
    up = {(e.importer, e.target) for e in EDGES if e.target}
    assert ("halo.guard.reroute", "halo.nn.norm") in up and ("halo.guard.reroute", "halo.nn.upsample") in up
    assert ("halo.nn.root", "halo.guard") in up
    layers = sorted(m for m in MODS if tier(m) == "nn")
    assert "halo.nn.norm" in layers and "halo.nn.spectral_layers" in layers and "halo.nn.convert" not in layers


def test_no_module_slot_is_filled_from_another_module():
    """Rule (i): 0 late bindings (issue 31 item 2 counted 4 before: plans.use_guard, reroute.provide twice,
    comm.register_default_group)."""
    found = slot_fills(MODS)
    assert not found, "\n".join(f"{k[1:]}: {v}" for k, v in sorted(found.items()))


def test_every_violation_is_one_of_the_rules_and_says_why():
    kinds = {_CYCLE, _TOOLS, _CORE_NN, _COMPAT, _PRIVATE, _KERNELS, _API, _TIER, _GUARD_TIER}
    assert {k[0] for k in FOUND} <= kinds, sorted(FOUND)
    for key, reason in EXPECTED_VIOLATIONS.items():
        assert key[0] in kinds and len(reason) > 20, (key, reason)


def test_aliases_are_thin():
    """An alias holds a docstring, imports of public names from ``halo.tools`` (and ``sys``), ``__all__`` and the
    ``if __name__ == "__main__":`` guard: nothing to maintain twice, nothing the library could come to need."""
    for name in ALIASES:
        tree = ast.parse(MODS[name].read_text())
        for i, node in enumerate(tree.body):
            if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue
            if isinstance(node, ast.Import):
                assert [a.name for a in node.names] == ["sys"], (name, ast.dump(node))
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1 and (node.module or "").startswith("tools."), (name, node.module)
                assert not any(_private(a.name) for a in node.names), (name, [a.name for a in node.names])
            elif isinstance(node, ast.Assign):
                assert [getattr(t, "id", None) for t in node.targets] == ["__all__"], (name, ast.dump(node))
            else:
                assert isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'", \
                    (name, ast.unparse(node)[:80])
    extra = {e.importer for e in EDGES if e.target and tier(e.target) == "tools" and tier(e.importer) != "tools"}
    extra -= set(ALIASES)
    assert not extra, f"modules outside halo.tools that import it and are not ALIASES: {sorted(extra)}"


def test_pyproject_ships_every_package_and_the_command():
    """The wheel ships exactly the package folders there are (a subpackage missing from the list is missing from
    the wheel: ``halo bench`` from a wheel failed that way), and the ``halo`` script is the tools' entry point."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setup = meta["tool"]["setuptools"]
    packages = {m for m, p in MODS.items() if p.name == "__init__.py"}
    assert set(setup["packages"]) == packages, (sorted(setup["packages"]), sorted(packages))
    for pkg in packages:
        assert (ROOT / setup["package-dir"][pkg] / "__init__.py") == MODS[pkg], pkg
    assert meta["project"]["scripts"] == {"halo": "halo.tools.cli:main"}


def test_import_halo_loads_no_tool_and_no_layer():
    """At run time: ``import halo`` (a training job) loads neither the tools nor the layers until asked."""
    code = "import sys, halo; print(sorted(m for m in sys.modules if m.startswith(('halo.tools', 'halo.nn'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# -- the scanner sees what it must ----------------------------------------------------------------------------------

FAKE = {
    "__init__.py": "from .core import run\n",
    "core.py": "from .helper import _secret\n\ndef run():\n    from . import lazy\n    return lazy\n",
    "helper.py": "_secret = 1\n",
    "lazy.py": "import fake.core\nfrom .nn import Layer\n",
    "nn/__init__.py": "from .layer import Layer\n",
    "nn/layer.py": "from ..compat import shim\nfrom ._private_mod import x\nclass Layer: ...\n",
    "nn/_private_mod.py": "x = 1\n",
    "compat/__init__.py": "",
    "compat/shim.py": "import importlib\n\ndef f():\n    return importlib.import_module('fake.tools.cli')\n",
    "tools/__init__.py": "",
    "tools/cli.py": "from ..nn._private_mod import x\nfrom .. import helper\nhelper._secret\n",
    "check.py": "def run():\n    from .nn import Layer\n    return Layer\n",
    "nn/extra.py": "from .. import check\n",
    "dist/__init__.py": "",
    "dist/low.py": "from ..plan import high\n",
    "plan/__init__.py": "",
    "plan/high.py": "x = 1\n",
}


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("layering") / "fake"
    for rel, text in FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_scanner_finds_each_kind_of_violation(fake):
    mods, edges, found = scan({"fake": fake}, root="fake")
    assert {"fake", "fake.core", "fake.nn", "fake.nn.layer", "fake.tools.cli"} <= set(mods)
    assert all(e.target for e in edges)
    # a function-level relative import closes the circle core -> lazy -> core (``import fake.core``)
    assert (_CYCLE, "fake.core", "fake.lazy") in found, sorted(found)
    assert "fake/core.py:4" in found[(_CYCLE, "fake.core", "fake.lazy")][0]
    assert (_CORE_NN, "fake.lazy", "fake.nn") in found  # a core module importing the layers
    assert (_COMPAT, "fake.nn.layer", "fake.compat.shim") in found  # from ..compat import shim: a submodule
    assert (_TOOLS, "fake.compat.shim", "fake.tools.cli") in found  # importlib with a literal name counts
    assert (_PRIVATE, "fake.core", "fake.helper._secret") in found  # an imported private name
    assert (_PRIVATE, "fake.tools.cli", "fake.helper._secret") in found  # a private name read off a module
    assert (_PRIVATE, "fake.tools.cli", "fake.nn._private_mod") in found  # a private module outside its package
    assert (_PRIVATE, "fake.nn.layer", "fake.nn._private_mod") not in found  # inside its package: fine
    assert (_API, "fake.nn.extra", "fake.check") in found  # a layer importing the API tier
    assert not any(k[1] == "fake.check" for k in found)  # the API tier importing nn: fine
    assert (_TIER, "fake.dist.low", "fake.plan.high") in found  # a lower tier importing a higher one
    assert len(found) == 9, sorted(found)


SLOTS_FAKE = {
    "__init__.py": "",
    "low.py": ("_SLOT: list = [None]\n_TABLE = {}\nFLAG = None\n\n"
               "def provide(x):\n    _SLOT[0] = x\n\n"
               "def register(f):\n    _TABLE[f.__name__] = f\n    return f\n\n"
               "def use(x):\n    global FLAG\n    FLAG = x\n\n"
               "def pure(x):\n    return [x]\n"),
    "high.py": ("from . import low\nfrom .low import use, pure\n\nlow.provide(1)\nuse(2)\npure(3)\n"
                "low._TABLE.update(a=1)\nlow.FLAG = 4\n\n"
                "def later():\n    low.provide(5)\n"),
    "deco.py": "from .low import register\n\n@register\ndef f():\n    pass\n",
    "sub/__init__.py": "",
    "sub/deco.py": "from ..low import register\n\n@register\ndef g():\n    pass\n",
    "sub/reg.py": "_R = {}\n\ndef converts(c):\n    _R[c] = c\n    return c\n",
    "sub/layer.py": "from .reg import converts\n\n@converts\nclass L:\n    pass\n",
}


def test_the_slot_rule_finds_late_binding(tmp_path):
    """Rule (i) on a package written for it: calls at import of a function that fills its own module's slot, a
    ``global`` rebound, a slot mutated or a module attribute set from outside, a decorator of another package; not
    a call at run time (in a function), a pure function, or a decorator filling its own package's registry."""
    root = tmp_path / "fake"
    for rel, text in SLOTS_FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    found = slot_fills(discover({"fake": root}))
    assert set(found) == {(_SLOT, "fake.high", "fake.low.provide"), (_SLOT, "fake.high", "fake.low.use"),
                          (_SLOT, "fake.high", "fake.low._TABLE"), (_SLOT, "fake.high", "fake.low.FLAG"),
                          (_SLOT, "fake.sub.deco", "fake.low.register")}, sorted(found)
    assert found[(_SLOT, "fake.high", "fake.low.provide")] == ["high.py:4: fake.high fills fake.low.provide at import"]
