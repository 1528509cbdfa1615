"""Every leaf of a variables tree with its path, its value and its annotation, read once.

The tree may be Linen variables (boxed, or plain beside a ``params_axes`` collection), a train
state, NNX modules, optimizers or states, or any pytree of those; each leaf's annotation is
read by :func:`~flax_escale.plan.read_annotation`'s rules, once per distinct annotation, and
optimizer state takes the annotation of the parameter it tracks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from flax_escale import _checks as check
from flax_escale._paths import is_box, leaves_with_paths, unbox
from flax_escale.plan._annotation import (
    AXES,
    GRAPH,
    LOGICAL,
    LOGICAL_AXES,
    OTHER_BOX,
    PLAIN,
    VARIABLE,
    Annotation,
    kind_of,
    kind_of_type,
    read_annotation,
)
from flax_escale.plan._follow import Followed, follow_params

__all__ = ["AnnotatedLeaf", "annotated_leaves", "arrays_only", "read_arrays"]

_PARAMS_AXES = "params_axes"
_OPT_STATE = "opt_state"
_AXES_SUFFIX = "_axes"


class AnnotatedLeaf(NamedTuple):
    """A leaf of a variables tree with its path and its annotation: what a plan is built from.

    :func:`annotated_leaves` gives one per leaf and :func:`~flax_escale.plan.build_plan` takes
    them; as a tuple it unpacks as ``path, leaf, annotation``.

    Attributes:
        path: The leaf's path, ``/``-joined (``params/Dense_0/kernel``).
        leaf: Its value, unboxed: an array or a ``jax.ShapeDtypeStruct`` (or, before
            :func:`arrays_only`, any other leaf).
        annotation: Its annotation, or ``None`` if it has none (it is replicated).
    """

    path: str
    leaf: Any
    annotation: Annotation | None


def annotated_leaves(
    tree: Any,
    *,
    sources: Mapping[str, str] | None = None,
    own_sharding: bool = False,
) -> tuple[Any, list[AnnotatedLeaf]]:
    """Every leaf of ``tree`` with its path, its value and its annotation.

    ``tree`` may be Linen variables (boxed, or plain with a ``params_axes`` collection from
    ``param_with_axes``), a train state, NNX modules, optimizers or states, or any pytree
    of those. Boxes count as leaves.
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
        The treedef (boxes and modules replaced by one entry) and one
        :class:`AnnotatedLeaf` per leaf, in flattening order.

    Raises:
        EscaleTypeError: If ``tree`` is a string, ``None``, a number, or a tree without arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax.linen import partitioning
        >>> from flax_escale.plan import annotated_leaves
        >>> variables = {"params": {"w": jnp.zeros((8, 4))},
        ...              "params_axes": {"w_axes": partitioning.AxisMetadata(("embed", "mlp"))}}
        >>> _, items = annotated_leaves(variables)
        >>> item = items[0]
        >>> item.path, item.annotation.logical_axes, item.annotation.source
        ('params/w', ('embed', 'mlp'), 'param_with_axes')
    """
    leaves = _Leaves(tree)
    if not leaves.leaves or not leaves.has_arrays():
        check.tree_of_arrays(tree, "annotated_leaves: tree")
    return leaves.treedef, leaves.read(sources or {}, own_sharding)


def read_arrays(tree: Any) -> tuple[Any, list[AnnotatedLeaf]] | None:
    """:func:`annotated_leaves` of ``tree``, or ``None`` if it has leaves but none is an array.

    For callers that take either annotated variables or a tree of logical specs (whose leaves
    are ``PartitionSpec`` s and names), and read the specs another way.
    """
    leaves = _Leaves(tree)
    if leaves.leaves and not leaves.has_arrays():
        return None
    return leaves.treedef, leaves.read({}, False)


def arrays_only(treedef: Any, items: list[AnnotatedLeaf]) -> tuple[Any, list[AnnotatedLeaf]]:
    """The items that are arrays, and the structure with the other leaves left out.

    Leaves that are not arrays (a step counter as a Python int, a string) have no layout; the
    structure returned has ``None`` where they were, so a plan of the arrays unflattens into it.
    """
    is_array = [hasattr(leaf, "shape") for _, leaf, _ in items]
    if all(is_array):
        return treedef, items
    kept = treedef.unflatten([0 if array else None for array in is_array])
    return jax.tree.structure(kept), [item for item, a in zip(items, is_array, strict=True) if a]


class _Leaves:
    """A tree flattened once, boxes (and NNX modules, as their state) as leaves.

    t5x's ``AxisMetadata`` (which holds no leaf) is read, with its path, from the same walk.
    """

    def __init__(self, tree: Any) -> None:
        seen: set[int] = set()

        def is_leaf(x: Any) -> bool:
            kind = kind_of_type(type(x))
            if kind is None:
                kind = kind_of(x)
            elif kind >= GRAPH:
                seen.add(kind)
            return kind != PLAIN

        paths, leaves, treedef = leaves_with_paths(tree, is_leaf)
        if GRAPH in seen:
            tree = _as_state(tree)
            paths, leaves, treedef = leaves_with_paths(tree, is_leaf)
        self.params_axes: dict[str, Annotation] = {}
        if AXES in seen:
            kept = [i for i, leaf in enumerate(leaves) if kind_of(leaf) != AXES]
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

    def read(self, sources: Mapping[str, str], own_sharding: bool) -> list[AnnotatedLeaf]:
        """One :class:`AnnotatedLeaf` per leaf, optimizer state following its parameter."""
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
            append(AnnotatedLeaf(path, value, annotation))
        return _follow_params(found)


class _Reader:
    """Reads leaves' annotations as :func:`read_annotation` does, once per distinct one."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self._sources = sources
        # What an annotation depends on -> the annotation; ids stand for the rules objects
        # of leaves that stay alive while the tree is read.
        self._made: dict[tuple[Any, ...], Annotation | None] = {}

    def __call__(self, path: str, leaf: Any) -> tuple[Any, Annotation | None]:
        kind = kind_of_type(type(leaf))
        if kind == PLAIN:
            return leaf, None
        if kind is None:
            kind = kind_of(leaf)
        source = self._sources.get(path) if self._sources else None
        if kind == VARIABLE:
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
        elif kind == OTHER_BOX:
            return unbox(leaf), None
        else:
            key = (kind, leaf.names, id(leaf.rules) if kind == LOGICAL else None, source)
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
        return kind_of(x) == GRAPH

    return jax.tree.map(lambda x: nnx.state(x) if graph(x) else x, tree, is_leaf=graph)


def _params_axes(paths: list[str], leaves: list[Any]) -> dict[str, Annotation]:
    # param_with_axes keeps 'w's names at params_axes/.../w_axes, beside params/.../w.
    found = {}
    made: dict[tuple[Any, ...], Annotation] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if kind_of(leaf) != AXES:
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
    found: list[AnnotatedLeaf],
) -> list[AnnotatedLeaf]:
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
        items[i] = AnnotatedLeaf(path, value, annotation)
    return items


def _shape(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    return shape if type(shape) is tuple else np.shape(value)


def _in_opt_state(path: str) -> bool:
    # (the substring first: splitting every path would cost more than reading it)
    return _OPT_STATE in path and _OPT_STATE in path.split("/")
