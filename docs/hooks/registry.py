"""mkdocs hook: the tables of converted layers come from the registry (``halo.nn.registry``), so they cannot drift.

A page that holds the marker ``<!-- halo:registry -->`` gets, in its place, one row per torch class halo converts:
the class, the halo layer that replaces it, and whether it also has a latitude x longitude form. A layer added with
``@converts`` appears here at the next build, with no edit to any page."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- halo:registry -->"


def registry_table() -> str:
    import halo.nn  # noqa: F401 - fills the registry
    from halo.nn.registry import entries

    rows = ["| torch class | halo layer | latitude x longitude mesh | what it is |", "|---|---|---|---|"]
    for kind, entry in sorted(entries().items(), key=lambda kv: (kv[1].halo_class.__name__, kv[0].__name__)):
        doc = " ".join((entry.halo_class.__doc__ or "").split("\n\n")[0].split())
        doc = doc.split(". ")[0].rstrip(".").replace("``", "`").replace("|", "\\|")
        mesh = "yes" if entry.axes >= 2 else "rows only"
        rows.append(f"| `{kind.__module__.replace('torch.nn.modules.', 'nn.').split('.')[0]}.{kind.__name__}` "
                    f"| `{entry.halo_class.__name__}` | {mesh} | {doc} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, registry_table())
    return markdown
