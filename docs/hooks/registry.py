"""mkdocs hook: the lists of halo's layers come from the registry (``halo.nn.registry``), so they cannot drift.

Markers a page may hold, each replaced at build time:

- ``<!-- halo:registry -->``: one row per torch class halo converts: the class, the halo layer that replaces it,
  whether it also has a latitude x longitude form, the torch functions it is the exact form of (``functional=``:
  what the guard points to), and the first sentence of the layer's docstring;
- ``<!-- halo:exports -->``: every other public name of ``halo.nn`` (:func:`halo.nn.registry.exports`: layers made
  from third-party classes by name, and functions), with its module and first sentence;
- ``<!-- halo:nn-modules -->``: the modules of ``halo.nn`` the package imports (:func:`halo.nn.registry.layer_modules`),
  each with the first sentence of its docstring.

And the API reference's ``::: halo.nn`` block (a line of its own) becomes the package's docstring followed by one block
per public name, at its definition (``::: halo.nn.pad3d.DomainPad3d``): ``halo.nn`` exports the registry's names at
import, which the reference's static reading of the source cannot see.

A layer added with ``@converts`` (or a name marked ``@public``) appears at the next build, with no edit to any page.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

MARKER = "<!-- halo:registry -->"
EXPORTS = "<!-- halo:exports -->"
MODULES = "<!-- halo:nn-modules -->"


def _first_sentence(obj: Any) -> str:
    doc = " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())
    return doc.split(". ")[0].rstrip(".").replace("``", "`").replace("|", "\\|")


def _torch_name(kind: type) -> str:
    return f"{kind.__module__.replace('torch.nn.modules.', 'nn.').split('.')[0]}.{kind.__name__}"


def _function_name(f: Any) -> str:
    module = getattr(f, "__module__", None) or ""
    short = {"torch.nn.functional": "F", "torch": "torch", "torch._C._nn": "F"}.get(module, module or "torch")
    return f"{short}.{getattr(f, '__name__', f)}"


def registry_table() -> str:
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import entries

    rows = ["| torch class | halo layer | latitude x longitude mesh | exact form of | what it is |",
            "|---|---|---|---|---|"]
    for kind, entry in sorted(entries(ours=True).items(), key=lambda kv: (kv[1].halo_class.__name__, kv[0].__name__)):
        mesh = "yes" if entry.axes >= 2 else "rows only"
        twins = ", ".join(sorted({f"`{_function_name(f)}`" for f in entry.functional})) or "—"
        rows.append(f"| `{_torch_name(kind)}` | `{entry.halo_class.__name__}` | {mesh} | {twins} "
                    f"| {_first_sentence(entry.halo_class)} |")
    return "\n".join(rows)


def exports_table() -> str:
    """The public names of ``halo.nn`` that are not in :func:`registry_table`."""
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import entries, exports

    converted = {e.halo_class.__name__ for e in entries(ours=True).values()}
    rows = ["| name | kind | module | what it is |", "|---|---|---|---|"]
    for name, obj in sorted(exports().items(), key=lambda kv: (not inspect.isclass(kv[1]), kv[0].lower())):
        if name in converted:
            continue
        kind = "layer" if inspect.isclass(obj) else "function"
        rows.append(f"| `halo.nn.{name}` | {kind} | `{obj.__module__}` | {_first_sentence(obj)} |")
    return "\n".join(rows)


def modules_table() -> str:
    """The modules of ``halo.nn`` (what the package imports), each with the first sentence of its docstring."""
    from halo.nn.registry import layer_modules

    rows = ["| module | what it holds |", "|---|---|"]
    for name in layer_modules():
        module = importlib.import_module(f"halo.nn.{name}")
        rows.append(f"| `halo/nn/{name}.py` | {_first_sentence(module)} |")
    return "\n".join(rows)


def reference_blocks() -> str:
    """``::: halo.nn`` as the API reference shows it: the package docstring, then every public name at its
    definition (layers first, then functions; by module, in source order within one)."""
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import exports

    def order(item: tuple[str, Any]) -> tuple:
        obj = item[1]
        try:
            line = inspect.getsourcelines(obj)[1]
        except (OSError, TypeError):
            line = 0
        return not inspect.isclass(obj), obj.__module__, line

    blocks = ["::: halo.nn\n    options:\n      members: false"]
    blocks += [f"::: {obj.__module__}.{name}" for name, obj in sorted(exports().items(), key=order)]
    return "\n\n".join(blocks)


REFERENCE = re.compile(r"^::: halo\.nn[ \t]*$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, table in ((MARKER, registry_table), (EXPORTS, exports_table), (MODULES, modules_table)):
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    if REFERENCE.search(markdown):
        markdown = REFERENCE.sub(lambda _: reference_blocks(), markdown)
    return markdown
