"""A tree's shardings from its logical annotations, in Flax's naming family."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleTypeError
from flax_escale.plan._annotation import Annotation, annotated_leaves, read_annotation
from flax_escale.plan._paths import is_box
from flax_escale.plan._plan import build_plan
from flax_escale.resolve import (
    RulesLike,
    as_logical_rules,
    enforce,
    resolve_logical_axes,
    resolve_mesh_axes,
)
from flax_escale.resolve._logical import Resolver, resolver

__all__ = ["logical_to_mesh_sharding"]


def logical_to_mesh_sharding(
    tree: Any, mesh: Mesh, rules: RulesLike = None, *, strict: bool = False
) -> Any:
    """The ``NamedSharding`` of every leaf of ``tree``, from logical axis names.

    Like Flax's ``nn.logical_to_mesh_sharding``, ``tree`` may hold one logical spec per leaf (a
    ``PartitionSpec`` or tuple of logical names, as ``nn.get_partition_spec`` gives them; a
    ``None`` leaf stays ``None``, as in Flax), resolved with the one resolver. It may also be
    the annotated variables themselves (``jax.eval_shape`` of a Linen ``init``, an NNX state or
    module, a train state): then every annotation is read the one way and resolution is
    shape-aware, so every sharding divides its array, and optimizer state follows its parameter.
    What cannot apply warns (``strict`` raises).

    Args:
        tree: Logical specs, or annotated (abstract) variables.
        mesh: The mesh.
        rules: The logical-axis rules; defaults to Flax's rules context, then to
            ``PartitionAxis()``'s.
        strict: Raise instead of correcting.

    Returns:
        A tree of ``NamedSharding`` shaped like ``tree`` (one per spec, box or variable).

    Raises:
        EscaleTypeError: If ``mesh`` is not a mesh, ``tree`` is a string or ``None``, or a
            leaf is a bare string rather than a spec.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import flax_escale as fe
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> specs = {"w": P("hidden_state", "mlp_intermediate"), "b": P()}
        >>> shardings = fe.logical_to_mesh_sharding(specs, mesh)
        >>> shardings["w"].spec, shardings["b"].spec
        (P(('fsdp', 'sp'), 'tp'), P())
        >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8)))
        >>> fe.logical_to_mesh_sharding(abstract, mesh)["params"]["kernel"].spec  # 6 % tp=2
        P(('fsdp', 'sp'), 'tp')
    """
    mesh = check.mesh(mesh)
    strict = check.flag(strict, "strict")
    if isinstance(tree, str) or tree is None:
        raise EscaleTypeError(
            f"tree must be a tree of logical specs or annotated variables, got "
            f"{check.describe(tree)}; pass e.g. {{'kernel': PartitionSpec('hidden_state', "
            "'mlp_intermediate')}, or jax.eval_shape of the model's init."
        )
    shardings = _plain_shardings(tree, mesh, rules)
    if shardings is not None:
        return shardings
    if isinstance(tree, (nnx.Module, nnx.Optimizer)):
        return _annotated_shardings(tree, mesh, rules, strict)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_box_or_spec)
    if any(_is_array_or_box(leaf) for leaf in leaves):
        return _annotated_shardings(tree, mesh, rules, strict)
    frozen = as_logical_rules(rules)
    # A spec resolved without a problem gives the same sharding wherever it repeats.
    made: dict[Any, NamedSharding] = {}
    shardings = []
    for names in leaves:
        key = names if type(names) is PartitionSpec or type(names) is tuple else None
        found = None if key is None else made.get(key)
        if found is None:
            if isinstance(names, str):
                raise EscaleTypeError(
                    f"tree: a leaf is the string {names!r}, not a logical spec; pass "
                    f"PartitionSpec({names!r}) or ({names!r},) for a one-dimensional array."
                )
            resolution = resolve_logical_axes(tuple(names), frozen, mesh=mesh, strict=strict)
            found = NamedSharding(mesh, enforce(resolution, strict=strict, stacklevel=2).spec)
            if key is not None and resolution.ok:
                made[key] = found
        shardings.append(found)
    return treedef.unflatten(shardings)


def _annotated_shardings(tree: Any, mesh: Mesh, rules: RulesLike, strict: bool) -> Any:
    treedef, items = annotated_leaves(tree)
    return build_plan(treedef, items, mesh, rules=rules, strict=strict).shardings()


_OPT_STATE = "opt_state"
_ARRAYS = (jax.ShapeDtypeStruct, jax.Array, np.ndarray)


class _NotPlain(Exception):
    pass


def _plain_shardings(tree: Any, mesh: Mesh, rules: RulesLike) -> Any | None:
    """The shardings of a plain tree of Linen boxes and arrays, or ``None`` to go the long way.

    A plain tree is what ``jax.eval_shape`` of a Linen ``init`` gives: dicts (with string keys),
    lists and tuples of ``nn.LogicallyPartitioned`` (without rules of their own) and
    ``nn.Partitioned`` boxes and arrays, no optimizer state and no ``params_axes``. There no
    leaf's spec depends on another leaf, so each leaf's sharding is the one
    :func:`read_annotation` and the resolver give for its box kind, names and shape, and is
    worked out once per distinct ``(kind, names, shape)``. When every leaf resolves without a
    correction or an unknown name, that is exactly what ``build_plan`` gives; otherwise (and for
    anything else, including a tree this cannot read) ``None`` is returned and the caller takes
    the general path, which warns or raises naming the path.
    """
    boxes = (nn.LogicallyPartitioned, nn.Partitioned)

    def is_leaf(x: Any) -> bool:
        kind = type(x)
        if kind is dict:
            # A key that is not a string, or that may be optimizer state: the long way.
            if _OPT_STATE in "/".join(x):  # (a TypeError for other keys)
                raise _NotPlain
            return False
        if kind is list or kind is tuple or x is None:
            return False
        if kind in boxes or isinstance(x, _ARRAYS):
            return True
        raise _NotPlain  # anything else (a spec, a module, params_axes): stop at once

    try:
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    except (_NotPlain, TypeError):
        return None
    if not leaves:
        return None
    frozen = as_logical_rules(rules)
    # (kind, names) -> how its arrays resolve: the annotation read once, and the resolver of
    # its rules (None for mesh axes).
    readings: dict[tuple[Any, Any], tuple[Annotation | None, Resolver | None]] = {}
    made: dict[tuple[Any, Any, Any], NamedSharding] = {}
    by_spec: dict[PartitionSpec, NamedSharding] = {}
    shardings = []
    append = shardings.append
    try:
        for leaf in leaves:
            kind = type(leaf)
            if kind in boxes:
                if kind is nn.LogicallyPartitioned and leaf.rules is not None:
                    return None
                names = leaf.names
                if type(names) is not tuple:
                    names = tuple(names)
                shape = leaf.value.shape
            else:
                kind, names, shape = None, None, leaf.shape
            key = (kind, names, shape)
            found = made.get(key)
            if found is None:
                reading = readings.get((kind, names))
                if reading is None:
                    reading = readings[kind, names] = _reading(leaf, kind, frozen, mesh)
                annotation, resolve = reading
                shape = tuple(shape)
                if resolve is None:
                    resolution = resolve_mesh_axes(annotation.mesh_axes, shape=shape, mesh=mesh)
                    spec = resolution.spec if resolution.ok else None
                else:
                    axes = None if annotation is None else annotation.logical_axes
                    spec = resolve.spec_if_ok(axes, shape)
                if spec is None:
                    return None
                found = by_spec.get(spec)
                if found is None:
                    found = by_spec[spec] = NamedSharding(mesh, spec)
                made[key] = found
            append(found)
    except Exception:  # the general path raises it again, naming the leaf
        return None
    return treedef.unflatten(shardings)


def _reading(
    leaf: Any, kind: Any, rules: LogicalRules, mesh: Mesh
) -> tuple[Annotation | None, Resolver | None]:
    # What build_plan does with the annotation (see _plan._resolve), once per kind and names.
    mesh_shape = tuple(mesh.shape.items())
    if kind is None:
        return None, resolver(rules, mesh_shape)
    annotation = read_annotation(leaf)
    if annotation.mesh_axes is not None:
        return annotation, None
    return annotation, resolver(annotation.rules_with(rules, tuple(mesh.axis_names)), mesh_shape)


def _is_logical_spec(x: Any) -> bool:
    # A plain tuple of names is a spec; other tuples (optax states, namedtuples) are containers.
    if isinstance(x, PartitionSpec):
        return True
    return (
        type(x) is tuple
        and all(e is None or isinstance(e, (str, tuple)) for e in x)
        and all(isinstance(a, str) for e in x if isinstance(e, tuple) for a in e)
    )


# Plain types first: is_box goes through NNX's metaclass hook.
def _box_or_spec(x: Any) -> bool:
    kind = type(x)
    if kind is dict or kind is list:
        return False
    return kind is PartitionSpec or is_box(x) or _is_logical_spec(x)


def _is_array_or_box(leaf: Any) -> bool:
    return type(leaf) is not PartitionSpec and (is_box(leaf) or hasattr(leaf, "shape"))
