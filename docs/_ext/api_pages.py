"""The ``api-namespace`` directive: one API page per public namespace, from its ``__all__``.

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
from functools import cache

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

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
    "flax_escale.t5x",
    "flax_escale.eformer",
)


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


def namespace_lines(namespace: str) -> list[str]:
    """The reStructuredText of one namespace's page body."""
    module = importlib.import_module(namespace)
    lines = [f".. automodule:: {namespace}", ""]
    for name in module.__all__:
        obj = getattr(module, name)
        directive, role = _kind(obj)
        home = homes().get(id(obj), (namespace, name)) if _is_shared(obj) else (namespace, name)
        if directive == "autodata":
            doc = constant_doc(namespace, name)
            if not doc:
                logger.warning("%s.%s has no docstring under its assignment", namespace, name)
            lines += [f".. py:data:: {name}", "", *(f"   {line}" for line in doc), ""]
        elif not getattr(obj, "__module__", "").startswith("flax_escale"):
            # Another project's object, re-exported: its own reference documents it.
            lines += _alias_lines(name, role, f"{obj.__module__}.{obj.__qualname__}")
        elif home == (namespace, name):
            options = []
            if directive in ("autoclass", "autoexception"):
                options = ["   :members:", *inherited_option(obj)]
            lines += [f".. {directive}:: {namespace}.{name}", *options, ""]
        else:
            lines += _alias_lines(name, role, f"{home[0]}.{home[1]}")
    return lines


def _alias_lines(name: str, role: str, target: str) -> list[str]:
    """An entry of its own for a name whose object is described at ``target``."""
    domain = {"exc": "exception", "func": "function"}.get(role, role)
    return [f".. py:{domain}:: {name}", "", f"   The same object as :py:{role}:`{target}`.", ""]


class ApiNamespace(SphinxDirective):
    """``.. api-namespace:: flax_escale.linen`` documents every name in its ``__all__``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        """The namespace's module docstring, then an entry for every name it exports."""
        namespace = self.arguments[0]
        if namespace not in NAMESPACES:
            raise self.error(f"{namespace!r} is not a public namespace: one of {NAMESPACES}")
        self.env.note_dependency(importlib.import_module(namespace).__file__)
        container = nodes.container()
        self.state.nested_parse(
            StringList(namespace_lines(namespace), source=f"<api-namespace {namespace}>"),
            self.content_offset,
            container,
        )
        return container.children


def setup(app: Sphinx) -> dict[str, object]:
    """Registers the directive."""
    app.add_directive("api-namespace", ApiNamespace)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
