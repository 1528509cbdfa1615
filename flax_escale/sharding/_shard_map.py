"""``jax.shard_map`` with its specs given as logical names, resolved by the one resolver."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import without_unit_explicit_axes
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes
from flax_escale.sharding._constraint import apply_spec

__all__ = ["logical_shard_map"]


def logical_shard_map(
    f: Callable[..., Any],
    *,
    in_axes: Sequence[Any],
    out_axes: Any,
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    strict: bool = False,
    check_vma: bool = True,
) -> Callable[..., Any]:
    """``jax.shard_map`` whose ``in_specs`` and ``out_specs`` are logical names.

    The names resolve as parameters' and activations' do (shape-aware for the inputs, whose
    shapes are known at the call), so a body written once runs on any mesh the rules map its
    names onto: ``("batch", "sequence", None)`` is split over ``(fsdp, dp)`` and ``sp`` on one
    mesh and over ``(fsdp, dp, ep)`` on another. Each input is first constrained to its spec
    (a ``jax.sharding.reshard`` on Explicit mesh axes, which ``jax.shard_map`` would otherwise
    refuse), so the layout change is a visible step of the program.

    Args:
        f: The per-device body, as for ``jax.shard_map``.
        in_axes: One entry per positional argument: a tuple of logical names (or ``None``) per
            dimension, or a pytree (dict, list) whose leaves are such tuples. A
            ``PartitionSpec`` leaf is taken as it is (for a layout the body computes itself).
        out_axes: The same for the outputs: one tuple of names, or a pytree of them.
        mesh: The mesh; defaults to the current mesh.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        strict: Raise instead of correcting (a name whose mesh axes do not divide its
            dimension); otherwise corrections warn.
        check_vma: Passed to ``jax.shard_map``.

    Returns:
        A function of the same arguments as ``f``, running ``f`` on each device's blocks.

    Raises:
        NoMeshError: At the call, if there is no mesh.
        EscaleError: At the call, if ``in_axes`` has not one entry per argument.
        EscaleTypeError: If ``in_axes`` is not a sequence, or a leaf is not a tuple of names.
        ShardingResolutionError: With ``strict``, if a name's axes do not fit its dimension.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import logical_shard_map
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> def local_sum(x):  # the sum of each device's rows, kept per block
        ...     return x.sum(axis=0, keepdims=True)
        >>> f = logical_shard_map(local_sum, in_axes=[("batch", "hidden_state")],
        ...                       out_axes=("batch", "hidden_state"), mesh=mesh)
        >>> jax.jit(f)(jnp.ones((8, 6))).shape  # one row per fsdp device, tp keeps the columns
        (4, 6)
    """
    if isinstance(in_axes, str) or not isinstance(in_axes, Sequence):
        raise EscaleTypeError(
            f"in_axes must be a sequence with one entry per argument, got "
            f"{check.describe(in_axes)}; e.g. in_axes=[('batch', 'hidden_state')]."
        )
    in_axes = tuple(in_axes)
    strict = check.flag(strict, "strict")
    mesh = check.optional_mesh(mesh)

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        if len(args) != len(in_axes):
            raise EscaleError(
                f"logical_shard_map({getattr(f, '__name__', f)!r}): {len(args)} arguments but "
                f"{len(in_axes)} entries in in_axes; give one logical-axes entry per argument."
            )
        on = mesh if mesh is not None else current_mesh()
        frozen = as_logical_rules(rules)

        def spec(where: str, axes: Any, shape: Sequence[int] | None) -> PartitionSpec:
            if isinstance(axes, PartitionSpec):
                given = check.spec_on(on, axes, f"logical_shard_map: {where}")
            elif axes is None or (
                isinstance(axes, tuple) and all(n is None or isinstance(n, str) for n in axes)
            ):
                resolution = resolve_logical_axes(axes, frozen, shape=shape, mesh=on, strict=strict)
                given = enforce(resolution, strict=strict, path=where, stacklevel=4).spec
            else:
                raise EscaleTypeError(
                    f"logical_shard_map: {where} is {check.describe(axes)}; each array takes a "
                    "tuple of logical names (or None), e.g. ('batch', 'hidden_state')."
                )
            # As apply_spec places it: JAX types an array on Explicit axes without their
            # size-1 axes, and jax.shard_map wants the spec to match that type exactly.
            return without_unit_explicit_axes(given, on)

        in_specs = tuple(
            _per_array(f"in_axes[{i}]", axes, arg, lambda w, a, x: spec(w, a, jax.numpy.shape(x)))
            for i, (axes, arg) in enumerate(zip(in_axes, args, strict=True))
        )
        out_specs = _per_array("out_axes", out_axes, None, lambda w, a, _: spec(w, a, None))
        placed = jax.tree.map(lambda s, x: apply_spec(x, s, on), in_specs, args)
        body = jax.shard_map(
            f, mesh=on, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
        return body(*placed)

    return mapped


def _is_axes(node: Any) -> bool:
    """Whether ``node`` is one array's entry: a tuple of names, None or a ``PartitionSpec``.

    A plain tuple holding no containers counts as one, so that a wrong name in it
    (``("batch", 3)``) is reported as such rather than as a tree of the wrong structure.
    """
    return (
        node is None
        or isinstance(node, PartitionSpec)
        or (
            type(node) is tuple  # a NamedTuple is a structure of arrays, as for JAX
            and not any(isinstance(n, tuple | list | dict | PartitionSpec) for n in node)
        )
    )


def _per_array(
    where: str, axes: Any, values: Any, resolve: Callable[[str, Any, Any], PartitionSpec]
) -> Any:
    """``resolve(path, names, value)`` for each tuple of names in ``axes`` (a pytree of them).

    ``values``, when given, has ``axes``'s structure down to each tuple (the array there).
    """
    if values is None:
        values = jax.tree.map(lambda _: None, axes, is_leaf=_is_axes)
    try:
        return jax.tree.map_with_path(
            lambda path, a, x: resolve(f"{where}{jax.tree_util.keystr(path)}", a, x),
            axes,
            values,
            is_leaf=_is_axes,
        )
    except ValueError as error:
        if "structure" not in str(error) and "match" not in str(error):
            raise
        raise EscaleError(
            f"logical_shard_map: {where} is {axes!r}, whose structure does not match the "
            f"argument's ({jax.tree.structure(values)}); give one tuple of logical names per "
            "array."
        ) from None
