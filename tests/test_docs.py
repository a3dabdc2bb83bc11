"""The docs a user navigates stay true to the tree: a short README whose links resolve, every guide page in the
site's navigation, and every invariant the code cites defined, by number and name, in docs/design.md."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= 250, f"README.md is {lines} lines; the rest belongs in docs/ (issue 31 item 6: at most ~250)"
    missing = [link for link in re.findall(r"\]\(([^)#\s]+)", text)
               if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_guide_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    absent = [p for p in pages if f": {p}" not in nav]
    assert not absent, f"docs pages missing from mkdocs.yml's nav (unreachable on the site): {absent}"


def test_cited_invariants_are_defined_in_the_design_document():
    design = (ROOT / "docs" / "design.md").read_text()
    defined = {int(n): name for n, name in re.findall(r"^### (\d+)\. (.+?) \{#", design, re.M)}
    assert sorted(defined) == list(range(1, len(defined) + 1)) and len(defined) >= 10, defined
    cited = set()
    for folder in ("halo", "kernels", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            found = re.findall(r"[Ii]nvariants? (\d+)", path.read_text())
            cited |= {(int(n), str(path.relative_to(ROOT))) for n in found}
    unknown = sorted((n, where) for n, where in cited if n not in defined)
    assert not unknown, f"code cites invariants docs/design.md does not define: {unknown}"
    stale = sorted({str(p.relative_to(ROOT)) for folder in ("halo", "kernels", "tests", "benchmarks")
                    for p in (ROOT / folder).rglob("*.py") if re.search(r"(?<![/\w])DESIGN\.md", p.read_text())})
    assert not stale, f"these files cite the shared design page, not the project's docs/design.md: {stale}"


# -- the registry is the one list of halo's layers (issue 31 item 5) ----------------------------------------------

def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("halo_docs_registry_hook", ROOT / "docs" / "hooks" / "registry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_halo_nn_exports_exactly_the_registry():
    import inspect
    import pkgutil

    import halo.nn
    from halo.nn.registry import entries, exports, layer_modules

    assert sorted(halo.nn.__all__) == sorted(exports()), set(halo.nn.__all__) ^ set(exports())
    assert all(getattr(halo.nn, name) is obj for name, obj in exports().items())
    assert {e.halo_class.__name__ for e in entries(ours=True).values()} <= set(exports())  # @converts exports it
    # every non-private module of halo/nn is imported by the package (a new layer module needs no edit there)
    found = sorted(m.name for m in pkgutil.iter_modules(halo.nn.__path__) if not m.name.startswith("_"))
    assert list(layer_modules()) == found
    missing = [n for n in found if f"halo.nn.{n}" not in __import__("sys").modules]
    assert not missing, missing
    # the public layers: every class exported is a torch module, and a DomainLayer (halo.nn.base) but for these three,
    # which hold halo layers rather than being one (issue 31 counted 6): the list can only shrink
    from halo.nn.base import DomainLayer

    classes = {n: o for n, o in exports().items() if inspect.isclass(o)}
    assert all(issubclass(o, __import__("torch").nn.Module) for o in classes.values())
    others = {n for n, o in classes.items() if not issubclass(o, DomainLayer)}
    assert others <= {"DomainSelectAdaptivePool2d", "DomainSqueezeExcite", "DomainLPPool2d"}, others


def test_the_converters_tables_are_the_registry():
    from torch import nn

    import halo.nn
    from halo.nn import convert, pool
    from halo.nn.registry import entries, functional_twins, twin_hint

    table = entries()
    assert set(convert.MESH_2D) == {k for k, e in table.items() if e.axes >= 2}
    assert pool.pools() == {k: e.halo_class for k, e in table.items() if e.halo_class.__module__ == "halo.nn.pool"}
    for kind, halo_class in pool.pools().items():  # halo_pool builds the registered class
        module = table[kind].example(kind)[0]
        assert type(pool.halo_pool(module)) is halo_class, kind
    # no registered class is also in the converter's lists of kept or refused layers
    assert not set(table) & (set(convert.POINTWISE) | set(convert.GLOBAL)), set(table) & set(convert.GLOBAL)
    twins = functional_twins()
    assert twins[nn.functional.pixel_unshuffle] is halo.nn.DomainPixelUnshuffle
    assert twins[nn.functional.max_pool2d] is halo.nn.DomainMaxPool2d
    assert twin_hint(nn.functional.pixel_shuffle) == ("use nn.PixelShuffle in the model (converted exactly, to "
                                                      "halo.nn.DomainPixelShuffle)")
    assert twin_hint(nn.functional.gelu) is None
    assert set(twins.values()) <= {e.halo_class for e in table.values()}
    assert {f for e in table.values() for f in e.functional} == set(twins)


def test_the_registry_refuses_a_second_claim():
    import pytest
    from torch import nn

    from halo.nn.registry import converts

    class Other(nn.Module):
        pass

    with pytest.raises(ValueError, match="PixelShuffle is converted by DomainPixelShuffle already, not also by Other"):
        converts(nn.PixelShuffle)(Other)
    with pytest.raises(ValueError, match="pixel_shuffle is the functional twin of DomainPixelShuffle already"):
        converts(nn.Identity, functional=(nn.functional.pixel_shuffle,))(Other)
    with pytest.raises(TypeError, match="functional= takes a tuple of torch functions"):
        converts(nn.Identity, functional=nn.functional.gelu)


def test_the_docs_lists_of_layers_are_generated_from_the_registry():
    import halo.nn
    from halo.nn.registry import entries, exports, layer_modules

    hook = _hook()
    page = (ROOT / "docs" / "converting.md").read_text()
    for marker in (hook.MARKER, hook.EXPORTS, hook.MODULES):
        assert marker in page, marker
    table = hook.registry_table()
    assert table.count("\n") == 1 + len(entries(ours=True))  # header, rule, one row per torch class
    for kind, entry in entries(ours=True).items():
        assert f"`nn.{kind.__name__}` | `{entry.halo_class.__name__}` |" in table, kind
    listed = hook.exports_table()
    converted = {e.halo_class.__name__ for e in entries(ours=True).values()}
    assert all(f"`halo.nn.{n}`" in listed for n in exports() if n not in converted)
    modules = hook.modules_table()
    assert all(f"`halo/nn/{n}.py`" in modules for n in layer_modules())
    assert "| `nn.ReflectionPad3d` | `DomainPad3d` | yes |" in table and halo.nn.DomainPad3d
    # the API reference shows every public name at its definition (halo.nn's names come from the registry at import)
    blocks = hook.reference_blocks()
    assert all(f"::: {obj.__module__}.{name}\n" in blocks + "\n" for name, obj in exports().items())
    assert hook.REFERENCE.search((ROOT / "docs" / "api.md").read_text())
    # the README lists no layers by hand: it links to the generated page
    readme = (ROOT / "README.md").read_text()
    assert "docs/converting.md" in readme
    handwritten = [n for n in converted if n in readme]
    assert not handwritten, f"README.md names layers by hand (the list is docs/converting.md's): {handwritten}"
