"""The import graph of ``flax_escale``, read from its source: acyclic, and each layer importing
only the layers below it (DESIGN.md, "Layers").

Every ``import`` and ``from ... import`` statement counts, wherever it stands: at the top of a
module, inside a function, under ``if TYPE_CHECKING:``. An import inside a function still ties
the two modules together; hiding a cycle there only moves the failure to run time. Docstring
examples (``>>>``) are strings, not statements, and do not count.

A module belongs to a *unit*: the subpackage it is in (``flax_escale.sharding._measure`` is in
``sharding``), or, directly under ``flax_escale``, the module itself (``_checks``, ``_api``);
``flax_escale/__init__.py`` is the unit ``__init__``. :data:`LAYERS` places every unit.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "flax_escale"

# Bottom to top. A unit may import the units of the layers listed before its own and its own
# modules (a package importing itself); nothing else: no import between two units of one layer,
# except in the base layer, whose modules are the floor of one package, flax_escale itself (they
# import one another without a cycle, as test_the_import_graph_has_no_cycle checks).
LAYERS: dict[str, tuple[str, ...]] = {
    "base": (
        "errors",
        "_checks",
        "_compat",
        "_dataclasses",
        "_paths",
        "_regex",
        "_specs",
        "_tables",
        "_units",
    ),
    "mesh": ("mesh",),
    "axes": ("axes",),
    "resolve": ("resolve",),
    # The static plan and placement at run time stand side by side: neither imports the other.
    "plan and sharding": ("plan", "sharding"),
    # Schedules over a mesh axis (pipelines, context parallelism), below the front ends that wrap
    # them.
    "schedules": ("context", "pipeline"),
    "front-end floor": ("_frontend",),
    "front ends": ("linen", "nnx"),
    "entry points": ("_api",),
    "tools": ("moe", "testing", "tools"),
    # Sizing runs workloads through the entry points and measures them with the tools.
    "sizing": ("sizing",),
    # Other systems' vocabularies, over everything else; nothing below imports them.
    "compat": ("eformer", "t5x"),
    "top": ("__init__", "__main__"),
}

LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}


def source_modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its ``__init__.py``."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None, PACKAGE
    assert spec.submodule_search_locations, PACKAGE
    root = Path(next(iter(spec.submodule_search_locations)))
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = source_modules()


def imported_names(module: str, source: str, is_package: bool) -> Iterator[str]:
    """The dotted names each import statement of ``module`` asks for, wherever it stands."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from a.b import c` imports the module a.b.c when there is one, else names of a.b.
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in MODULES else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (not itself)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = set()
        source = path.read_text(encoding="utf-8")
        for name in imported_names(module, source, path.name == "__init__.py"):
            while name and name not in MODULES:  # `import a.b.name` of a name, not a module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


GRAPH = import_graph()


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def tied_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that each reach all the others by imports: the
    strongly connected components (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    member = None
                    while member != node:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def cycle_within(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the group's first module: its modules in import order, the
    first repeated last (a breadth-first search)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        reached = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child not in came_from:
                    came_from[child] = node
                    reached.append(child)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def test_the_import_graph_has_no_cycle() -> None:
    found = [
        f"{' -> '.join(cycle_within(group, GRAPH))} (tied together: {', '.join(sorted(group))})"
        for group in tied_groups(GRAPH)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        unit = unit_of(module)
        for target in sorted(targets):
            other = unit_of(target)
            if other == unit or unit not in LAYER_OF or other not in LAYER_OF:
                continue  # a package importing itself; unplaced units fail the test below
            layer, other_layer = LAYER_OF[unit], LAYER_OF[other]
            if RANK[other_layer] > RANK[layer]:
                why = f"layer {layer!r} imports layer {other_layer!r} above it"
            elif other_layer == layer and layer != "base":
                why = f"layer {layer!r}: {unit} imports {other} beside it"
            else:
                continue
            wrong.append(f"{module} imports {target} ({why})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_layers_place_every_unit_of_the_package_and_nothing_else() -> None:
    units = {unit_of(module) for module in MODULES}
    unplaced = sorted(units - LAYER_OF.keys())
    assert not unplaced, f"place these in LAYERS (tests/test_imports.py): {unplaced}"
    gone = sorted(LAYER_OF.keys() - units)
    assert not gone, f"LAYERS (tests/test_imports.py) names units the package lacks: {gone}"


def test_imports_inside_functions_under_type_checking_and_relative_ones_are_read() -> None:
    # The graph is only as good as its reader: an import in a function body, under
    # TYPE_CHECKING, or relative, is an edge like any other; a docstring example is not.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flax_escale.plan import ShardingPlan\n"
        "def f():\n    from . import _measure\n    import flax_escale.mesh._context\n"
        "def g():\n    '>>> import flax_escale.tools'\n"
        "from ..resolve import _fit\n"
    )
    names = set(imported_names("flax_escale.sharding._probe", source, is_package=False))
    assert names == {
        "typing",
        "flax_escale.plan",
        "flax_escale.sharding._measure",
        "flax_escale.mesh._context",
        "flax_escale.resolve._fit",
    }


def test_a_cycle_is_found_and_named_in_import_order() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    (group,) = tied_groups(graph)
    assert group == {"a", "b", "c"}
    assert cycle_within(group, graph) == ["a", "b", "c", "a"]
