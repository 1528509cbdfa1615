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
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.linen import partitioning
from jax.sharding import NamedSharding

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.plan._follow import follow_params
from flax_escale.plan._paths import flatten_with_paths, path_of
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
        # A string would read as one logical name per letter.
        if self.logical_axes is not None:
            names = check.logical_names(self.logical_axes, "Annotation: logical_axes")
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
        axes = tuple(self.axes[d] for d in kept)
        field = "logical_axes" if self.logical_axes is not None else "mesh_axes"
        source = f"{self.source} (follows {path})"
        return dataclasses.replace(self, **{field: axes}, source=source, follows=(path, kept))


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
    if isinstance(leaf, nn.LogicallyPartitioned):
        rules = None if leaf.rules is None else as_logical_rules(leaf.rules)
        return Annotation(
            tuple(leaf.names), source=source or "nn.with_logical_partitioning", rules=rules
        )
    if isinstance(leaf, nn.Partitioned):
        return Annotation(mesh_axes=tuple(leaf.names), source=source or "nn.with_partitioning")
    if isinstance(leaf, nnx.Variable):
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
    state = check.tree_of_arrays(_as_state(tree), "annotated_leaves: tree")
    flat, treedef = flatten_with_paths(state)
    params_axes = _params_axes(state)
    sources = sources or {}
    found = []
    for path, value, leaf in flat:
        annotation = read_annotation(leaf, source=sources.get(path))
        if annotation is None and path in params_axes:
            annotation = Annotation(params_axes[path], source="param_with_axes")
        if annotation is None and own_sharding:
            sharding = getattr(value, "sharding", None)
            if isinstance(sharding, NamedSharding):
                spec = (*sharding.spec, *(None,) * (np.ndim(value) - len(sharding.spec)))
                annotation = Annotation(mesh_axes=spec, source="array sharding")
        found.append((path, value, annotation))
    return treedef, _follow_params(found)


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


def _as_state(tree: Any) -> Any:
    def graph(x: Any) -> bool:
        # Plain containers first: checking against NNX's classes goes through a metaclass hook.
        return type(x) not in (dict, list, tuple) and isinstance(x, (nnx.Module, nnx.Optimizer))

    return jax.tree.map(lambda x: nnx.state(x) if graph(x) else x, tree, is_leaf=graph)


def _params_axes(tree: Any) -> dict[str, tuple[Any, ...]]:
    # param_with_axes keeps 'w's names at params_axes/.../w_axes, beside params/.../w.
    def is_axes(x: Any) -> bool:
        return isinstance(x, partitioning.AxisMetadata)

    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_axes)[0]
    found = {}
    for key_path, leaf in flat:
        if not is_axes(leaf):  # (before the path: most leaves are arrays)
            continue
        keys = path_of(key_path).split("/")
        if _PARAMS_AXES not in keys or not keys[-1].endswith(_AXES_SUFFIX):
            continue
        at = len(keys) - 1 - keys[::-1].index(_PARAMS_AXES)
        keys[at] = "params"
        keys[-1] = keys[-1][: -len(_AXES_SUFFIX)]
        found["/".join(keys)] = tuple(leaf.names)
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
    at = [i for i, (path, _, _) in enumerate(found) if _OPT_STATE in path.split("/")]
    if not at:
        return found
    params = [
        (path, tuple(np.shape(value)), a)
        for path, value, a in found
        if a is not None and _OPT_STATE not in path.split("/")
    ]
    # The entries followed are the parameter's dimensions themselves: which ones a leaf keeps.
    followed = follow_params(
        [(found[i][0], np.shape(found[i][1])) for i in at],
        [(path, shape, tuple(range(len(shape)))) for path, shape, _ in params],
    )
    items = list(found)
    for i, follow in zip(at, followed, strict=True):
        path, value, annotation = found[i]
        if follow is None:
            # Tracks no parameter of this tree: its own annotation stands if it fits.
            if annotation is not None and len(annotation.axes) != np.ndim(value):
                annotation = None
        elif follow.entries is None:
            annotation = None
        else:
            param_path, _, param_annotation = params[follow.param]
            annotation = param_annotation.following(param_path, follow.entries)
        items[i] = (path, value, annotation)
    return items
