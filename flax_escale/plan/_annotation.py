"""The one reader of sharding annotations, whatever wrote them.

An array's annotation can come from many places: Linen boxes (``nn.with_logical_partitioning``
gives ``nn.LogicallyPartitioned`` with logical names and maybe its own rules;
``nn.with_partitioning`` gives ``nn.Partitioned`` with mesh axes), t5x's ``param_with_axes``
(names kept beside the parameters in the ``params_axes`` collection), NNX variable metadata
(this library's ``logical_axes``; Flax's ``out_sharding``, formerly ``sharding_names``, with the
variable's own ``sharding_rules``), and the library's ``sharded_module`` declarations (which
write one of those). Every consumer (both front ends' plans and inits, the partitioner, the
report, ``check_sharded``) reads them here, so the same annotation gives the same spec through
every entry point.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import meta
from flax.linen import partitioning
from jax.sharding import NamedSharding

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.plan._follow import Followed, follow_params
from flax_escale.plan._paths import is_box, leaves_with_paths, unbox
from flax_escale.resolve import as_logical_rules

__all__ = ["LOGICAL_AXES", "Annotation", "annotated_leaves", "arrays_only", "read_annotation"]

LOGICAL_AXES = "logical_axes"
"""The NNX variable-metadata key holding a variable's logical axes (set by ``sharded_module``)."""

_PARAMS_AXES = "params_axes"
_OPT_STATE = "opt_state"
_AXES_SUFFIX = "_axes"


@dataclasses.dataclass(frozen=True)
class Annotation:
    """How one array was annotated: logical names or mesh axes, and where that came from.

    Attributes:
        logical_axes: One logical name (or ``None``) per dimension, if annotated logically.
        mesh_axes: One spec entry per dimension, if annotated directly in mesh axes.
        source: Who annotated it, for reports (a ``sharded_module`` pattern, a Flax box, ...).
        rules: Rules the annotation carries itself, replacing the plan's (a Linen
            ``nn.LogicallyPartitioned`` with ``rules``).
        local_rules: Rules that go before the plan's (an NNX variable's ``sharding_rules``).
        names_may_be_mesh_axes: A logical name that no rule maps but that is a mesh axis stands
            for that axis (NNX ``out_sharding`` semantics, as in Flax).
        follows: For optimizer state: the path of the parameter it tracks and the parameter's
            dimensions it keeps; it takes the parameter's resolved spec on those dimensions.
    """

    logical_axes: tuple[Any, ...] | None = None
    mesh_axes: tuple[Any, ...] | None = None
    source: str = ""
    rules: LogicalRules | None = None
    local_rules: LogicalRules = ()
    names_may_be_mesh_axes: bool = False
    follows: tuple[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        # A string would read as one logical name per letter. A tuple of names and Nones (what
        # every reader makes, tens of thousands of times for a large model) is valid as it is.
        names = self.logical_axes
        if names is not None and (
            type(names) is not tuple or not all(type(n) is str or n is None for n in names)
        ):
            names = check.logical_names(names, "Annotation: logical_axes")
            object.__setattr__(self, "logical_axes", names)

    @property
    def axes(self) -> tuple[Any, ...]:
        """The per-dimension entries, logical or mesh, whichever the annotation has."""
        if self.logical_axes is not None:
            return self.logical_axes
        return self.mesh_axes or ()

    def rules_with(self, rules: LogicalRules, mesh_axis_names: tuple[str, ...]) -> LogicalRules:
        """The rules this annotation resolves with, given the plan's ``rules`` and mesh."""
        own = rules if self.rules is None else self.rules
        identity = tuple((a, a) for a in mesh_axis_names) if self.names_may_be_mesh_axes else ()
        return self.local_rules + own + identity

    def following(self, path: str, kept: tuple[int, ...]) -> Annotation:
        """The annotation of state that tracks this parameter (at ``path``), keeping ``kept``."""
        axes = self.axes
        if len(kept) != len(axes) or kept != tuple(range(len(axes))):
            axes = tuple(axes[d] for d in kept)
        logical = self.logical_axes is not None
        # Made without __init__: the entries were checked when this annotation was, and a
        # large model's optimizer state makes tens of thousands of these.
        made = object.__new__(Annotation)
        made.__dict__.update(
            logical_axes=axes if logical else None,
            mesh_axes=self.mesh_axes if logical else axes,
            source=f"{self.source} (follows {path})",
            rules=self.rules,
            local_rules=self.local_rules,
            names_may_be_mesh_axes=self.names_may_be_mesh_axes,
            follows=(path, kept),
        )
        return made


def read_annotation(leaf: Any, *, source: str | None = None) -> Annotation | None:
    """The annotation a leaf carries, or ``None``.

    Args:
        leaf: A Linen box (``nn.LogicallyPartitioned``, ``nn.Partitioned``), an NNX
            ``Variable`` (``logical_axes``, ``out_sharding`` / ``sharding_names`` and
            ``sharding_rules`` metadata) or anything else (no annotation).
        source: Names who made the annotation, for reports (a ``sharded_module`` pattern).

    Returns:
        The :class:`Annotation`, or ``None``.

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> from flax_escale.plan import read_annotation
        >>> box = nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp"))
        >>> read_annotation(box).logical_axes
        ('embed', 'mlp')
        >>> read_annotation(nn.Partitioned(jnp.zeros((8, 4)), ("fsdp", None))).mesh_axes
        ('fsdp', None)
    """
    if source is not None:
        check.string(source, "read_annotation: source", "'sharded_module'")
    kind = _kind(leaf)
    if kind == _LOGICAL:
        rules = None if leaf.rules is None else as_logical_rules(leaf.rules)
        return Annotation(
            tuple(leaf.names), source=source or "nn.with_logical_partitioning", rules=rules
        )
    if kind == _MESH:
        return Annotation(mesh_axes=tuple(leaf.names), source=source or "nn.with_partitioning")
    if kind == _VARIABLE:
        return _variable_annotation(leaf.get_metadata(), source)
    return None


def _variable_annotation(metadata: Mapping[str, Any], source: str | None) -> Annotation | None:
    names = metadata.get(LOGICAL_AXES)
    if names is not None:
        return Annotation(tuple(names), source=source or "sharded_module")
    names = metadata.get("out_sharding") or metadata.get("sharding_names")
    if not names:
        return None
    local = metadata.get("sharding_rules")
    return Annotation(
        tuple(names),
        source=source or "nnx out_sharding",
        local_rules=as_logical_rules(local) if local else (),
        names_may_be_mesh_axes=True,
    )


def annotated_leaves(
    tree: Any,
    *,
    sources: Mapping[str, str] | None = None,
    own_sharding: bool = False,
) -> tuple[Any, list[tuple[str, Any, Annotation | None]]]:
    """Every leaf of ``tree`` with its path, its value and its annotation.

    ``tree`` may be Linen variables (boxed, or plain with a ``params_axes`` collection from
    ``param_with_axes``), a train state, NNX modules, optimizers or states, or any pytree
    of those. Boxes count as leaves (see :func:`~flax_escale.plan._paths.flatten_with_paths`).
    A leaf under an ``opt_state`` (a train state's or an ``nnx.Optimizer``'s) follows the
    parameter it tracks, whose annotation optax and NNX copy onto it whatever its shape (and
    which it lacks when the names are in ``params_axes``): it keeps the names of the dimensions
    it shares with the parameter (Adafactor's factored statistics lose one), and none when it
    is no copy of the parameter's shape (a placeholder).

    Each distinct annotation is read (and its names checked) once: leaves annotated alike share
    one :class:`Annotation`.

    Args:
        tree: The tree to read.
        sources: Who annotated which path (a ``sharded_module`` pattern), for reports.
        own_sharding: Whether an unannotated array's own ``NamedSharding`` counts as its
            annotation (in mesh axes), for looking at arrays that already exist.

    Returns:
        The treedef (boxes and modules replaced by one entry) and ``[(path, value,
        annotation)]`` in flattening order.

    Raises:
        EscaleTypeError: If ``tree`` is a string, ``None``, a number, or a tree without arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax.linen import partitioning
        >>> from flax_escale.plan import annotated_leaves
        >>> variables = {"params": {"w": jnp.zeros((8, 4))},
        ...              "params_axes": {"w_axes": partitioning.AxisMetadata(("embed", "mlp"))}}
        >>> _, items = annotated_leaves(variables)
        >>> [(path, a.logical_axes, a.source) for path, _, a in items]
        [('params/w', ('embed', 'mlp'), 'param_with_axes')]
    """
    leaves = _Leaves(tree)
    if not leaves.leaves or not leaves.has_arrays():
        check.tree_of_arrays(tree, "annotated_leaves: tree")
    return leaves.treedef, leaves.read(sources or {}, own_sharding)


def read_arrays(tree: Any) -> tuple[Any, list[tuple[str, Any, Annotation | None]]] | None:
    """:func:`annotated_leaves` of ``tree``, or ``None`` if it has leaves but none is an array.

    For callers that take either annotated variables or a tree of logical specs (whose leaves
    are ``PartitionSpec`` s and names), and read the specs another way.
    """
    leaves = _Leaves(tree)
    if leaves.leaves and not leaves.has_arrays():
        return None
    return leaves.treedef, leaves.read({}, False)


def arrays_only(
    treedef: Any, items: list[tuple[str, Any, Annotation | None]]
) -> tuple[Any, list[tuple[str, Any, Annotation | None]]]:
    """The items that are arrays, and the structure with the other leaves left out.

    Leaves that are not arrays (a step counter as a Python int, a string) have no layout; the
    structure returned has ``None`` where they were, so a plan of the arrays unflattens into it.
    """
    arrays = [(path, value, a) for path, value, a in items if hasattr(value, "shape")]
    if len(arrays) == len(items):
        return treedef, items
    kept = treedef.unflatten([0 if hasattr(v, "shape") else None for _, v, _ in items])
    return jax.tree.structure(kept), arrays


# How a node of a tree is read, by its type (see _kind).
_PLAIN, _LOGICAL, _MESH, _OTHER_BOX, _VARIABLE, _GRAPH, _AXES = range(7)


@functools.lru_cache(maxsize=1024)
def _kind_of_type(kind: type) -> int | None:
    # Kept per type: isinstance against Flax's classes goes through ABC and NNX metaclass hooks.
    if issubclass(kind, jax.core.Tracer):
        return None  # NNX counts some tracers as variables: it depends on the instance
    if issubclass(kind, nn.LogicallyPartitioned):
        return _LOGICAL
    if issubclass(kind, nn.Partitioned):
        return _MESH
    if issubclass(kind, meta.AxisMetadata):
        return _OTHER_BOX
    if issubclass(kind, nnx.Variable):
        return _VARIABLE
    if issubclass(kind, (nnx.Module, nnx.Optimizer)):
        return _GRAPH
    return _AXES if issubclass(kind, partitioning.AxisMetadata) else _PLAIN


def _kind(x: Any) -> int:
    found = _kind_of_type(type(x))
    if found is None:
        return _VARIABLE if isinstance(x, nnx.Variable) else _PLAIN
    return found


class _Leaves:
    """A tree flattened once, boxes (and NNX modules, as their state) as leaves.

    t5x's ``AxisMetadata`` (which holds no leaf) is read, with its path, from the same walk.
    """

    def __init__(self, tree: Any) -> None:
        seen: set[int] = set()

        def is_leaf(x: Any) -> bool:
            kind = _kind_of_type(type(x))
            if kind is None:
                kind = _kind(x)
            elif kind >= _GRAPH:
                seen.add(kind)
            return kind != _PLAIN

        paths, leaves, treedef = leaves_with_paths(tree, is_leaf)
        if _GRAPH in seen:
            tree = _as_state(tree)
            paths, leaves, treedef = leaves_with_paths(tree, is_leaf)
        self.params_axes: dict[str, Annotation] = {}
        if _AXES in seen:
            kept = [i for i, leaf in enumerate(leaves) if _kind(leaf) != _AXES]
            self.params_axes = _params_axes(paths, leaves)
            paths = [paths[i] for i in kept]
            leaves = [leaves[i] for i in kept]
            treedef = jax.tree_util.tree_structure(tree, is_leaf=is_box)
        self.paths = paths
        self.leaves = leaves
        self.treedef = treedef

    def has_arrays(self) -> bool:
        """Whether a leaf (unboxed) is an array."""
        return any(hasattr(unbox(leaf), "shape") for leaf in self.leaves)

    def read(
        self, sources: Mapping[str, str], own_sharding: bool
    ) -> list[tuple[str, Any, Annotation | None]]:
        """``[(path, value, annotation)]``, optimizer state following its parameter."""
        read = _Reader(sources)
        params_axes = self.params_axes
        found = []
        append = found.append
        for path, leaf in zip(self.paths, self.leaves, strict=True):
            value, annotation = read(path, leaf)
            if annotation is None and params_axes:
                annotation = params_axes.get(path)
            if annotation is None and own_sharding:
                sharding = getattr(value, "sharding", None)
                if isinstance(sharding, NamedSharding):
                    spec = (*sharding.spec, *(None,) * (np.ndim(value) - len(sharding.spec)))
                    annotation = Annotation(mesh_axes=spec, source="array sharding")
            append((path, value, annotation))
        return _follow_params(found)


class _Reader:
    """Reads leaves' annotations as :func:`read_annotation` does, once per distinct one."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self._sources = sources
        # What an annotation depends on -> the annotation; ids stand for the rules objects
        # of leaves that stay alive while the tree is read.
        self._made: dict[tuple[Any, ...], Annotation | None] = {}

    def __call__(self, path: str, leaf: Any) -> tuple[Any, Annotation | None]:
        kind = _kind_of_type(type(leaf))
        if kind == _PLAIN:
            return leaf, None
        if kind is None:
            kind = _kind(leaf)
        source = self._sources.get(path) if self._sources else None
        if kind == _VARIABLE:
            metadata = leaf.get_metadata()
            key = (
                kind,
                metadata.get(LOGICAL_AXES),
                metadata.get("out_sharding"),
                metadata.get("sharding_names"),
                id(metadata.get("sharding_rules")),
                source,
            )
            value = leaf.get_value()
        elif kind == _OTHER_BOX:
            return unbox(leaf), None
        else:
            key = (kind, leaf.names, id(leaf.rules) if kind == _LOGICAL else None, source)
            value = leaf.value  # (unboxed without the constraint Flax's unbox adds)
        try:
            found = self._made.get(key, _UNREAD)
        except TypeError:  # unhashable names (a list): read them as they are
            return value, read_annotation(leaf, source=source)
        if found is _UNREAD:
            found = self._made[key] = read_annotation(leaf, source=source)
        return value, found


_UNREAD = object()


def _as_state(tree: Any) -> Any:
    def graph(x: Any) -> bool:
        return _kind(x) == _GRAPH

    return jax.tree.map(lambda x: nnx.state(x) if graph(x) else x, tree, is_leaf=graph)


def _params_axes(paths: list[str], leaves: list[Any]) -> dict[str, Annotation]:
    # param_with_axes keeps 'w's names at params_axes/.../w_axes, beside params/.../w.
    found = {}
    made: dict[tuple[Any, ...], Annotation] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if _kind(leaf) != _AXES:
            continue
        keys = path.split("/")
        if _PARAMS_AXES not in keys or not keys[-1].endswith(_AXES_SUFFIX):
            continue
        at = len(keys) - 1 - keys[::-1].index(_PARAMS_AXES)
        keys[at] = "params"
        keys[-1] = keys[-1][: -len(_AXES_SUFFIX)]
        names = tuple(leaf.names)
        if names not in made:
            made[names] = Annotation(names, source="param_with_axes")
        found["/".join(keys)] = made[names]
    return found


def _follow_params(
    found: list[tuple[str, Any, Annotation | None]],
) -> list[tuple[str, Any, Annotation | None]]:
    # optax and NNX copy a parameter's box or metadata onto every optimizer-state leaf made from
    # it, whatever that leaf's shape (Adafactor's factored statistics, its (1,) placeholders):
    # the names are right only where the shapes agree, so state leaves re-derive theirs from
    # the parameter they track, by the one rule for optimizer state.
    # Unannotated state leaves follow too: beside t5x's `param_with_axes` (names in a separate
    # collection) optax's state carries no names at all.
    at = [i for i, (path, _, _) in enumerate(found) if _in_opt_state(path)]
    if not at:
        return found
    in_state = set(at)
    params = [item for i, item in enumerate(found) if item[2] is not None and i not in in_state]
    # The entries followed are the parameter's dimensions themselves: which ones a leaf keeps.
    shapes = [_shape(value) for _, value, _ in params]
    dims = {rank: tuple(range(rank)) for rank in {len(shape) for shape in shapes}}
    followed = follow_params(
        ((found[i][0], _shape(found[i][1])) for i in at),
        [(item[0], shape, dims[len(shape)]) for item, shape in zip(params, shapes, strict=True)],
    )
    items = list(found)
    # State leaves that keep the same dimensions of one parameter (Adam's two moments) share
    # one annotation.
    made: dict[Followed, Annotation] = {}
    for i, follow in zip(at, followed, strict=True):
        path, value, annotation = found[i]
        if follow is None:
            # Tracks no parameter of this tree: its own annotation stands if it fits.
            if annotation is None or len(annotation.axes) == np.ndim(value):
                continue
            annotation = None
        elif follow.entries is None:
            annotation = None
        else:
            annotation = made.get(follow)
            if annotation is None:
                param_path, _, param_annotation = params[follow.param]
                annotation = made[follow] = param_annotation.following(param_path, follow.entries)
        items[i] = (path, value, annotation)
    return items


def _shape(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    return shape if type(shape) is tuple else np.shape(value)


def _in_opt_state(path: str) -> bool:
    # (the substring first: splitting every path would cost more than reading it)
    return _OPT_STATE in path and _OPT_STATE in path.split("/")
