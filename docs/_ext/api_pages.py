"""The ``api-namespace`` directive: one API page per public namespace, from its ``__all__``.

A page opens with the namespace's docstring and a summary: one table per kind of name
(functions, classes, constants, errors and warnings), each row a linked name and the first line
of its docstring. The entries follow in the same order, the main functions first and the errors
last.

A name exported from several namespaces is one object (``tests/test_public_api.py`` pins that),
so it is documented once, in the first namespace of :data:`NAMESPACES` that exports it, and the
others list it with a link there. Every exported name still gets an entry of its own, under its
own namespace, so ``:func:`flax_escale.eformer.with_sharding_constraint``` resolves too. Another
project's object that a namespace re-exports (``flax_escale.eformer.NamedSharding``) gets an
entry that links to that project's reference.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from dataclasses import dataclass
from functools import cache

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

# Page order and documentation home order: the core first, then the Flax APIs, the layers from
# the bottom up, and the compatibility vocabularies last.
NAMESPACES = (
    "flax_escale",
    "flax_escale.linen",
    "flax_escale.nnx",
    "flax_escale.moe",
    "flax_escale.sizing",
    "flax_escale.tools",
    "flax_escale.testing",
    "flax_escale.mesh",
    "flax_escale.axes",
    "flax_escale.resolve",
    "flax_escale.plan",
    "flax_escale.sharding",
    "flax_escale.pipeline",
    "flax_escale.context",
    "flax_escale.t5x",
    "flax_escale.eformer",
)

# The kinds of names, in page order: what one calls, then what one gets, then what goes wrong.
GROUPS = {
    "func": "Functions",
    "class": "Classes",
    "data": "Constants and types",
    "exc": "Errors and warnings",
}

# The functions a page leads with, in the order a reader meets them; the rest follow by name.
LEADS = {
    "flax_escale": (
        "sharded_module",
        "init_sharded",
        "plan_sharding",
        "create_mesh",
        "constrain",
        "sharding_report",
    ),
}


def _is_shared(obj: object) -> bool:
    """Whether identity says two exports are one thing (not numbers, strings or type aliases).

    A type alias such as ``tuple[int, ...]`` or ``Literal[...]`` is callable, but it is
    documented as data, by the docstring under its assignment.
    """
    return callable(obj) and typing.get_origin(obj) is None


@cache
def homes() -> dict[int, tuple[str, str]]:
    """Maps each shared exported object to the (namespace, name) that documents it."""
    found: dict[int, tuple[str, str]] = {}
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if _is_shared(obj):
                found.setdefault(id(obj), (namespace, name))
    return found


def _kind(obj: object) -> tuple[str, str]:
    """The autodoc directive and the Python domain role for an exported object."""
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "autoexception", "exc"
        return "autoclass", "class"
    if _is_shared(obj):
        return "autofunction", "func"
    return "autodata", "data"


@dataclass(frozen=True)
class Entry:
    """One exported name of a namespace, as its page shows it."""

    namespace: str
    name: str
    obj: object
    directive: str
    role: str

    @property
    def home(self) -> tuple[str, str]:
        """Where the object is described: here, or the namespace that first exports it."""
        if not _is_shared(self.obj):
            return self.namespace, self.name
        return homes().get(id(self.obj), (self.namespace, self.name))

    @property
    def foreign(self) -> bool:
        """Whether the object is another project's, re-exported here."""
        module = getattr(self.obj, "__module__", None) or ""
        return _is_shared(self.obj) and not module.startswith("flax_escale")

    def summary(self) -> str:
        """The first line of its docstring (a constant's: the one under its assignment)."""
        if self.foreign:
            return f"Re-exported from {self.obj.__module__.split('.')[0]}."
        if self.directive == "autodata":
            lines = constant_doc(self.namespace, self.name)
        else:
            lines = (inspect.getdoc(self.obj) or "").splitlines()
        first = []
        for line in lines:
            if not line.strip():
                break
            first.append(line.strip())
        return " ".join(first)


def entries(namespace: str) -> list[Entry]:
    """The namespace's exported names in page order: by kind, the leads first, then by name."""
    module = importlib.import_module(namespace)
    found = [
        Entry(namespace, name, getattr(module, name), *_kind(getattr(module, name)))
        for name in module.__all__
    ]
    leads = LEADS.get(namespace, ())
    order = list(GROUPS)

    def key(entry: Entry) -> tuple[int, int, str]:
        lead = leads.index(entry.name) if entry.name in leads else len(leads)
        return order.index(entry.role), lead, entry.name.lower()

    return sorted(found, key=key)


def constant_doc(namespace: str, name: str) -> list[str]:
    """The docstring under a constant's assignment, read from the module that assigns it.

    autodoc reads such docstrings from the module it is asked about, which for a re-exported
    constant is the namespace's ``__init__``, and would show the docstring of the value's type.
    """
    obj = getattr(sys.modules[namespace], name)
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("flax_escale.") or vars(module).get(name) is not obj:
            continue
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        if ("", name) in docs:
            return list(docs["", name])
    return []


def shown_bases(cls: type) -> list[type]:
    """The bases a class's entry names: not ``object``, not our unexported classes.

    An unexported base has no entry to link to; what the class inherits from it is shown on
    the class's own entry (:func:`inherited_option`).
    """
    return [
        base
        for base in cls.__bases__
        if base is not object
        and (not base.__module__.startswith("flax_escale") or id(base) in homes())
    ]


def inherited_option(cls: type) -> list[str]:
    """Shows what a class inherits from our unexported bases, which have no entry of their own.

    autodoc's ``:inherited-members:`` names the bases whose members stay out: every other one.
    """
    hidden = [
        base
        for base in cls.__mro__[1:]
        if base.__module__.startswith("flax_escale") and id(base) not in homes()
    ]
    if not hidden:
        return []
    shown = sorted({base.__name__ for base in cls.__mro__[1:] if base not in hidden})
    return [f"   :inherited-members: {', '.join(shown)}"]


def summary_lines(namespace: str) -> list[str]:
    """A table per kind of name: the linked name and its docstring's first line."""
    lines = ["Summary", "-------", ""]
    for role, title in GROUPS.items():
        group = [entry for entry in entries(namespace) if entry.role == role]
        if not group:
            continue
        lines += [f".. rubric:: {title}", "", ".. list-table::", "   :widths: 30 70", ""]
        for entry in group:
            lines += [
                f"   * - :py:{role}:`~{namespace}.{entry.name}`",
                f"     - {entry.summary()}",
            ]
        lines.append("")
    return lines


def entry_lines(entry: Entry) -> list[str]:
    """The reStructuredText of one name's entry."""
    if entry.directive == "autodata":
        doc = constant_doc(entry.namespace, entry.name)
        if not doc:
            logger.warning("%s.%s has no docstring under its assignment", *entry.home)
        return [f".. py:data:: {entry.name}", "", *(f"   {line}" for line in doc), ""]
    if entry.foreign:
        # Another project's object, re-exported: its own reference documents it.
        target = f"{entry.obj.__module__}.{entry.obj.__qualname__}"
        return _alias_lines(entry.name, entry.role, target)
    if entry.home != (entry.namespace, entry.name):
        return _alias_lines(entry.name, entry.role, ".".join(entry.home))
    options = []
    if entry.directive in ("autoclass", "autoexception"):
        options = ["   :members:", *inherited_option(entry.obj)]
        if shown_bases(entry.obj):
            options.append("   :show-inheritance:")
    return [f".. {entry.directive}:: {entry.namespace}.{entry.name}", *options, ""]


def namespace_lines(namespace: str) -> list[str]:
    """The reStructuredText of one namespace's page body."""
    lines = [f".. automodule:: {namespace}", "", *summary_lines(namespace)]
    for role, title in GROUPS.items():
        group = [entry for entry in entries(namespace) if entry.role == role]
        if group:
            lines += [title, "-" * len(title), ""]
            lines += [line for entry in group for line in entry_lines(entry)]
    return lines


def _alias_lines(name: str, role: str, target: str) -> list[str]:
    """An entry of its own for a name whose object is described at ``target``."""
    domain = {"exc": "exception", "func": "function"}.get(role, role)
    return [f".. py:{domain}:: {name}", "", f"   The same object as :py:{role}:`{target}`.", ""]


def _drop_hidden_bases(app, name, obj, options, bases) -> None:
    """``Bases:`` names only what :func:`shown_bases` keeps."""
    if inspect.isclass(obj) and obj.__module__.startswith("flax_escale"):
        bases[:] = [base for base in bases if base in shown_bases(obj)]


class ApiNamespace(SphinxDirective):
    """``.. api-namespace:: flax_escale.linen`` documents every name in its ``__all__``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        """The namespace's module docstring, its summary, then an entry for every name."""
        namespace = self.arguments[0]
        if namespace not in NAMESPACES:
            raise self.error(f"{namespace!r} is not a public namespace: one of {NAMESPACES}")
        self.env.note_dependency(importlib.import_module(namespace).__file__)
        container = nodes.section()
        nested_parse_with_titles(
            self.state,
            StringList(namespace_lines(namespace), source=f"<api-namespace {namespace}>"),
            container,
            self.content_offset,
        )
        return container.children


def setup(app: Sphinx) -> dict[str, object]:
    """Registers the directive and the filter of the bases an entry names."""
    app.add_directive("api-namespace", ApiNamespace)
    app.connect("autodoc-process-bases", _drop_hidden_bases)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
