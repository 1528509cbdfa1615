"""A tree's shardings from its logical annotations, in Flax's naming family."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleTypeError
from flax_escale.plan._collector import collector_paused
from flax_escale.plan._leaves import read_arrays
from flax_escale.plan._resolving import USE_IDLE_AXES, ResolveOptions, resolve_items, sharding_tree
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes

__all__ = ["logical_to_mesh_sharding"]


def logical_to_mesh_sharding(
    tree: Any,
    mesh: Mesh,
    rules: RulesLike = None,
    *,
    strict: bool = False,
    use_idle_axes: bool = USE_IDLE_AXES,
) -> Any:
    """The ``NamedSharding`` of every leaf of ``tree``, from logical axis names.

    Like Flax's ``nn.logical_to_mesh_sharding``, ``tree`` may hold one logical spec per leaf (a
    ``PartitionSpec`` or tuple of logical names, as ``nn.get_partition_spec`` gives them; a
    ``None`` leaf stays ``None``, as in Flax), resolved with the one resolver. It may also be
    the annotated variables themselves (``jax.eval_shape`` of a Linen ``init``, an NNX state or
    module, a train state, a tree with a ``params_axes`` collection): then they are planned
    exactly as :func:`~flax_escale.plan_sharding` plans a model's variables, with the same
    defaults (every annotation read the one way, resolution shape-aware so every sharding
    divides its array, optimizer state following its parameter, idle mesh axes put to use on
    large arrays), so the shardings are the ones ``init_sharded`` creates the variables in.
    Specs carry no shapes: they are never completed. What cannot apply warns, naming the path
    (``strict`` raises).

    Args:
        tree: Logical specs, or annotated (abstract) variables.
        mesh: The mesh.
        rules: The logical-axis rules; defaults to Flax's rules context, then to
            ``PartitionAxis()``'s.
        strict: Raise instead of correcting.
        use_idle_axes: For annotated variables: put the mesh axes the rules leave idle to use
            on every array of at least :data:`~flax_escale.plan.IDLE_AXES_MIN_BYTES`, as
            the entry points do (see :func:`~flax_escale.plan.build_plan`).

    Returns:
        A tree of ``NamedSharding`` shaped like ``tree`` (one per spec, box or variable).

    Raises:
        EscaleTypeError: If ``mesh`` is not a mesh, ``tree`` is a string or ``None``, a leaf
            is a bare string rather than a spec, or ``strict`` or ``use_idle_axes`` is not a
            bool.
        ShardingResolutionError: With ``strict``, if a spec had to be corrected or a logical
            name has no rule; always, if a logical name repeats or an array has fewer
            dimensions than its names (the message names the path).

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

        A large array the rules leave partly idle is completed, as ``plan_sharding`` does:

        >>> big = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
        ...                                     ("hidden_state", None))}
        >>> fe.logical_to_mesh_sharding(big, mesh)["w"].spec
        P('tp', 'fsdp')
        >>> fe.logical_to_mesh_sharding(big, mesh, use_idle_axes=False)["w"].spec
        P('tp', None)
    """
    mesh = check.mesh(mesh)
    strict = check.flag(strict, "strict")
    use_idle_axes = check.flag(use_idle_axes, "use_idle_axes")
    if isinstance(tree, str) or tree is None:
        raise EscaleTypeError(
            f"tree must be a tree of logical specs or annotated variables, got "
            f"{check.describe(tree)}; pass e.g. {{'kernel': PartitionSpec('hidden_state', "
            "'mlp_intermediate')}, or jax.eval_shape of the model's init."
        )
    frozen = as_logical_rules(rules)
    # Paused around a call, so that what the call made and dropped is gone before the
    # collector runs again: it then looks at the shardings only.
    with collector_paused():
        shardings = _planned(tree, mesh, frozen, strict, use_idle_axes)
    if shardings is not _SPECS:
        return shardings
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_spec)
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


_SPECS = object()


def _planned(tree: Any, mesh: Mesh, frozen: LogicalRules, strict: bool, use_idle_axes: bool) -> Any:
    # The shardings plan_sharding's plan holds, for annotated variables (without the plan's
    # entries); _SPECS for a tree of logical specs.
    annotated = read_arrays(tree)
    if annotated is None:
        return _SPECS
    treedef, items = annotated
    options = ResolveOptions(frozen, strict, (), use_idle_axes)
    resolutions = resolve_items(items, mesh, options, stacklevel=3)
    return sharding_tree(mesh, treedef, resolutions)


def _is_spec(x: Any) -> bool:
    # A plain tuple of names is a spec; other tuples (optax states, namedtuples) are containers.
    kind = type(x)
    if kind is PartitionSpec:
        return True
    return (
        kind is tuple
        and all(e is None or isinstance(e, (str, tuple)) for e in x)
        and all(isinstance(a, str) for e in x if isinstance(e, tuple) for a in e)
    )
