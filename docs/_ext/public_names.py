"""Our objects under their public names on every page, never a private module's path.

Type hints, bases and tracebacks name a class by the module that defines it
(``flax_escale.tools._reshardings.Resharding``); a reader imports it from a namespace
(``flax_escale.tools.Resharding``). References to such a path are resolved to the entry of its
public name, and text that spells it (a doctest's traceback) is rewritten to that name. A
reference to one of our objects that no namespace exports shows its bare name, unlinked.
"""

from __future__ import annotations

import importlib
import re
from functools import cache

from api_pages import NAMESPACES, _is_shared, homes
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

# A dotted path with a private part under flax_escale: flax_escale.plan._entry.PlanEntry.
PRIVATE = re.compile(r"\bflax_escale(?:\.\w+)*\._\w+(?:\.\w+)*")


@cache
def public_paths() -> dict[str, str]:
    """Maps where each exported object is defined to the public name that documents it."""
    found: dict[str, str] = {}
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            defined = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if _is_shared(obj) and all(isinstance(part, str) for part in defined):
                found.setdefault(".".join(defined), ".".join(homes()[id(obj)]))
    return found


def public_path(path: str) -> str | None:
    """The public name of a defining path, or of an attribute under one (a method)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        public = public_paths().get(".".join(parts[:end]))
        if public is not None:
            return ".".join([public, *parts[end:]])
    return None


def public_text(text: str) -> str:
    """``text`` with every private path of an exported object spelled by its public name."""
    return PRIVATE.sub(lambda match: public_path(match.group()) or match.group(), text)


def _retext(node: nodes.Node, text: str) -> nodes.Node:
    """A copy of a reference's content node that reads ``text``."""
    if isinstance(node, nodes.Text):
        return nodes.Text(text)
    copy = node.deepcopy()
    for child in list(copy.findall(nodes.Text)):
        child.parent.replace(child, nodes.Text(""))
    first = next(iter(copy.findall(nodes.Text)), None)
    if first is None:
        return nodes.literal("", text)
    first.parent.replace(first, nodes.Text(text))
    return copy


def _resolve_private(
    app: Sphinx, env: BuildEnvironment, node: nodes.Element, contnode: nodes.Element
) -> nodes.Element | None:
    """Links a private path to its public entry; shows an unexported object's bare name."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not PRIVATE.fullmatch(target):
        return None
    public = public_path(target)
    shown = contnode.astext()
    if public is not None:
        text = public.rsplit(".", 1)[-1] if "." not in shown else public_text(shown)
        domain = env.domains["py"]
        found = domain.resolve_xref(
            env, node["refdoc"], app.builder, "obj", public, node, _retext(contnode, text)
        )
        if found is not None:
            return found
    return _retext(contnode, shown.rsplit(".", 1)[-1])


def _rewrite_text(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Rewrites the text that spells a private path (a traceback in an example)."""
    for text in list(doctree.findall(nodes.Text)):
        rewritten = public_text(text)
        if rewritten != text:
            text.parent.replace(text, nodes.Text(rewritten))


def setup(app: Sphinx) -> dict[str, object]:
    """Resolves before intersphinx (priority 500) and conf.py's own names (400) look."""
    app.connect("missing-reference", _resolve_private, priority=300)
    app.connect("doctree-resolved", _rewrite_text)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
