"""Applying a ``PartitionSpec`` to arrays: constraints that work on Auto and Explicit axes."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of, without_unit_explicit_axes
from flax_escale.errors import EscaleTypeError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import Correction, Resolution, enforce, fit_mesh_axes
from flax_escale.sharding._use_sharding import no_mesh_in_this_thread

__all__ = ["apply_spec", "enforce_unconstrained", "with_sharding_constraint"]


def _split_by_type(
    spec: PartitionSpec, mesh: Mesh | AbstractMesh, current: PartitionSpec
) -> tuple[list, list]:
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    kept = _kept_where_unconstrained(spec, current)
    explicit, auto = [], []
    for dim, entry in enumerate(spec):
        if entry is PartitionSpec.UNCONSTRAINED:
            # Left to the compiler on Auto axes; on Explicit axes it keeps what it has.
            explicit.append(kept[dim])
            auto.append(entry)
            continue
        axes = mesh_axes_of(entry)
        explicit.append(tuple(a for a in axes if types[a] == AxisType.Explicit) or None)
        auto.append(tuple(a for a in axes if types[a] != AxisType.Explicit) or None)
    return list(without_unit_explicit_axes(PartitionSpec(*explicit), mesh)), auto


def _kept_where_unconstrained(spec: PartitionSpec, current: PartitionSpec) -> list[Any]:
    # Per dimension, what an UNCONSTRAINED entry keeps of the array's current sharding: its
    # axes, less those another entry of the spec takes (an axis shards one dimension only;
    # P(UNCONSTRAINED, "fsdp") moves fsdp to the second dimension).
    taken = {
        a for entry in spec if entry is not PartitionSpec.UNCONSTRAINED for a in mesh_axes_of(entry)
    }
    kept = []
    for dim in range(len(spec)):
        axes = mesh_axes_of(current[dim]) if dim < len(current) else ()
        left = tuple(a for a in axes if a not in taken)
        kept.append(left[0] if len(left) == 1 else (left or None))
    return kept


def _current_spec(x: Any) -> PartitionSpec:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def _placed(x: Any, mesh: Mesh | AbstractMesh) -> bool:
    # A concrete array on a concrete mesh is placed with device_put (no compiler to leave an
    # UNCONSTRAINED dimension to); anything else is constrained in a traced program.
    return isinstance(mesh, Mesh) and not isinstance(x, jax.core.Tracer)


def enforce_unconstrained(
    x: Any, resolution: Resolution, mesh: Mesh | AbstractMesh, *, strict: bool, stacklevel: int
) -> None:
    """Says where an ``UNCONSTRAINED`` dimension loses axes it has, as the one policy says.

    On Explicit mesh axes (and when a concrete array is placed) nothing is left to a compiler:
    an ``UNCONSTRAINED`` dimension keeps the array's current axes (see :func:`apply_spec`). An
    axis the spec gives to another dimension cannot stay, so the dimension loses it, which is
    not what ``UNCONSTRAINED`` asks: that is warned (or, with ``strict``, raised).

    Args:
        x: The array about to be constrained.
        resolution: Its resolution, whose ``spec`` is about to be applied.
        mesh: The mesh.
        strict: Raise instead of warning.
        stacklevel: Passed to :func:`~flax_escale.resolve.enforce`.

    Raises:
        ShardingResolutionError: With ``strict``, if a dimension loses axes.
    """
    spec = resolution.spec
    if not any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        return
    if _placed(x, mesh):
        current = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
        where = "an array placed outside jax.jit"
    else:
        # While tracing, an array's type holds its Explicit axes only: Auto ones are the
        # compiler's to choose, as UNCONSTRAINED asks.
        current, where = _current_spec(x), "Explicit mesh axes"
    kept = _kept_where_unconstrained(spec, current)
    corrections = []
    for dim, entry in enumerate(spec):
        had = mesh_axes_of(current[dim]) if dim < len(current) else ()
        lost = tuple(a for a in had if a not in mesh_axes_of(kept[dim]))
        if entry is PartitionSpec.UNCONSTRAINED and lost:
            corrections.append(
                Correction(
                    "reused",
                    dim,
                    lost,
                    x.shape[dim],
                    f"it is PartitionSpec.UNCONSTRAINED, which on {where} keeps the array's "
                    f"axes there ({', '.join(map(repr, had))}): nothing is left to the "
                    f"compiler; but the spec gives {lost} to another dimension, so this one "
                    "loses them. To choose its axes, name them instead of UNCONSTRAINED, or "
                    "use Auto mesh axes to leave them to the compiler",
                )
            )
    if corrections:
        applied = PartitionSpec(
            *(kept[d] if e is PartitionSpec.UNCONSTRAINED else e for d, e in enumerate(spec))
        )
        enforce(
            dataclasses.replace(
                resolution,
                spec=applied,
                rules_spec=spec,
                corrections=tuple(corrections),
                unknown_names=(),
                passed_over=(),
            ),
            strict=strict,
            stacklevel=stacklevel + 1,
        )


def apply_spec(x: jax.Array, spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> jax.Array:
    """Constrains ``x`` to ``spec`` on ``mesh``, in or out of ``jax.jit``.

    A concrete array on a concrete mesh is simply placed with ``jax.device_put``. While
    tracing, ``jax.lax.with_sharding_constraint`` only acts on Auto mesh axes and
    ``jax.sharding.reshard`` only on Explicit ones, so the spec is split by axis type and each
    part goes to the call that acts on it. ``PartitionSpec.UNCONSTRAINED`` entries stay
    unconstrained on Auto axes and keep the array's current sharding on Explicit ones (and when
    a concrete array is placed). ``spec`` must already be valid for ``x`` (see
    :func:`~flax_escale.resolve.fit_spec`).

    Raises:
        EscaleError: If ``spec`` names a mesh axis twice or one the mesh lacks.
        EscaleTypeError: If ``spec`` is not a ``PartitionSpec``, ``mesh`` not a mesh, or an
            ``AbstractMesh`` where a concrete array must be placed (outside ``jax.jit``).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import apply_spec
        >>> mesh = create_mesh((2, 4), ("dp", "tp"), axis_types="explicit")
        >>> apply_spec(jnp.zeros((4, 8)), PartitionSpec(None, "tp"), mesh).sharding.spec
        P(None, 'tp')
    """
    mesh = check.mesh(mesh)
    spec = check.spec_on(mesh, spec, "spec")
    if not isinstance(mesh, Mesh) and not isinstance(x, jax.core.Tracer):
        # A constant closed over by a jitted function is concrete too: a copy of it is staged
        # into the program (a tracer) under jit, and stays concrete only outside.
        x = jnp.copy(x)
    if not isinstance(mesh, Mesh) and not isinstance(x, jax.core.Tracer):
        # An abstract mesh names no devices, so an array outside jit has nowhere to go.
        raise EscaleTypeError(
            f"mesh is an AbstractMesh {dict(mesh.shape)}, which has no devices to place the "
            f"array of shape {tuple(x.shape)} on outside jax.jit; pass the concrete "
            "jax.sharding.Mesh (create_mesh(...)), or constrain inside a jitted function."
        )
    if isinstance(mesh, Mesh) and not isinstance(x, jax.core.Tracer):
        current = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
        kept = _kept_where_unconstrained(spec, current)
        placed = [
            kept[dim] if entry is PartitionSpec.UNCONSTRAINED else entry
            for dim, entry in enumerate(spec)
        ]
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*placed)))
    explicit, auto = _split_by_type(spec, mesh, _current_spec(x))
    if AxisType.Explicit in mesh.axis_types:
        x = jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*explicit)))
    if any(t != AxisType.Explicit for t in mesh.axis_types):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*auto)))
    return x


def _as_array(leaf: Any) -> jax.Array:
    try:
        return jnp.asarray(leaf)
    except (TypeError, ValueError):
        raise EscaleTypeError(
            f"arr must be an array or a pytree of arrays, got a leaf {check.describe(leaf)}; pass "
            "the arrays to constrain (numpy and Python numbers are converted)."
        ) from None


def with_sharding_constraint(
    arr: Any,
    sharding: Any,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    strict: bool = False,
) -> Any:
    """Constrains every array in ``arr`` to a sharding, made to fit the array and the mesh.

    This is ``jax.lax.with_sharding_constraint(x, shardings)`` (the same arguments, by
    position), made shape-aware and never silent. ``sharding`` is a ``PartitionSpec`` or
    ``NamedSharding`` for every leaf, or a tree of them (``None`` meaning replicated) with the
    structure of ``arr``. Each spec is padded or truncated to the array's rank, and a
    dimension's mesh axes are dropped when the mesh lacks one of them, another dimension
    already uses one, or they do not divide the dimension; each such correction raises a
    :class:`~flax_escale.ShardingCorrectionWarning` (or, with ``strict``, a
    :class:`~flax_escale.ShardingResolutionError`).

    The mesh is the ``NamedSharding``'s, else ``mesh=``, else the current mesh (``jax.set_mesh``
    or the legacy ``with mesh:``). With no mesh at all ``arr`` is returned unchanged, so the same
    model code runs on a single device; the mesh is per thread, and with none here while
    :func:`~flax_escale.use_sharding` is open in another thread (a thread started inside it),
    that nothing is constrained is said the same way. Numpy and Python inputs become
    ``jax.Array``s. On Explicit mesh axes the constraint is a ``jax.sharding.reshard``, which
    leaves nothing to the compiler: a ``PartitionSpec.UNCONSTRAINED`` dimension keeps the axes
    the array has there (as it does outside ``jax.jit``), and one it loses to another dimension
    of the spec is a correction too.

    Args:
        arr: An array or a pytree of arrays.
        sharding: A ``PartitionSpec``, a ``NamedSharding``, or a tree of them matching ``arr``.
        mesh: The mesh for ``PartitionSpec`` shardings; defaults to the current mesh.
        strict: Raise instead of correcting a spec that does not fit.

    Returns:
        ``arr`` with the constraints applied.

    Raises:
        ShardingResolutionError: With ``strict=True``, if a spec does not fit, an
            ``UNCONSTRAINED`` dimension loses its axes, or there is no mesh in this thread while
            ``use_sharding`` is open in another.
        EscaleTypeError: If ``sharding`` is a string or not a spec (or a tree of them shaped
            like ``arr``), ``mesh`` is not a mesh, ``strict`` not a bool, or a leaf of ``arr``
            not an array.
        EscaleError: If ``sharding`` is a tree not shaped like ``arr``.

    Example:
        >>> import warnings
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh, with_sharding_constraint
        >>> mesh = create_mesh((2, 4), ("dp", "tp"))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     y = with_sharding_constraint(np.ones((8, 6)), PartitionSpec("dp", "tp"), mesh=mesh)
        >>> y.sharding.spec  # 6 is not divisible by tp=4: that dimension stays replicated
        P('dp', None)
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        mesh axes P('dp', 'tp') with shape (8, 6) on mesh {'dp': 2, 'tp': 4} resolve to ...
          - dimension 1: size 6 is not divisible by ('tp',) of total size 4; dropped ('tp',). ...
    """
    mesh = check.optional_mesh(mesh)
    if isinstance(sharding, str):
        raise EscaleTypeError(
            f"sharding must be a PartitionSpec, a NamedSharding or a tree of them, got the "
            f"string {sharding!r}; pass PartitionSpec({sharding!r})."
        )
    strict = check.flag(strict, "strict")
    leaves, treedef = jax.tree_util.tree_flatten(arr)
    if isinstance(sharding, (PartitionSpec, NamedSharding)) or sharding is None:
        shardings = [sharding] * len(leaves)
    else:
        shardings = check.structure_like(sharding, arr, "sharding", "arr")
        for leaf_sharding in shardings:
            if not isinstance(leaf_sharding, (PartitionSpec, NamedSharding, tuple, list)) and (
                leaf_sharding is not None
            ):
                raise EscaleTypeError(
                    f"sharding must be a PartitionSpec, a NamedSharding or a tree of them "
                    f"shaped like arr, got {check.describe(sharding)}; pass e.g. "
                    "PartitionSpec('dp')."
                )
    if mesh is None and not all(isinstance(s, NamedSharding) for s in shardings):
        try:
            mesh = current_mesh()
        except NoMeshError:
            no_mesh_in_this_thread("with_sharding_constraint", strict=strict, stacklevel=2)
    out = [
        _constrain_leaf(leaf, s, mesh, strict) for leaf, s in zip(leaves, shardings, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _constrain_leaf(
    leaf: Any,
    sharding: PartitionSpec | NamedSharding | None,
    mesh: Mesh | AbstractMesh | None,
    strict: bool,
) -> Any:
    if isinstance(sharding, NamedSharding):
        mesh, spec = sharding.mesh, sharding.spec
    else:
        spec = PartitionSpec() if sharding is None else sharding
        if mesh is None:  # no mesh set (said by with_sharding_constraint if one is elsewhere)
            return leaf
    array = leaf if isinstance(leaf, jax.Array) else _as_array(leaf)
    resolution = fit_mesh_axes(tuple(spec), shape=array.shape, mesh=mesh)
    enforce(resolution, strict=strict, stacklevel=4)
    enforce_unconstrained(array, resolution, mesh, strict=strict, stacklevel=4)
    return apply_spec(array, resolution.spec, mesh)
