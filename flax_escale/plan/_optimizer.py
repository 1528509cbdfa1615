"""Optimizer state born sharded: each state leaf follows the sharding of its parameter.

The rule of what a state leaf inherits is :func:`~flax_escale.plan._follow.follow_params`;
here it is applied to shardings (Linen's :func:`opt_state_shardings`, NNX's optimizer init,
through :func:`follow_shardings`), and the state is made by them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._paths import flatten_with_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError
from flax_escale.plan._follow import follow_params

__all__ = [
    "add_data_axes",
    "create_checked",
    "follow_shardings",
    "init_opt_state",
    "opt_state_shardings",
    "sharding_of_param",
    "shardings_checked",
]


def opt_state_shardings(
    tx: optax.GradientTransformation, params: Any, *, shard_over: Sequence[str] = ()
) -> Any:
    """The sharding of every leaf of ``tx.init(params)``, computed without running it.

    Each state leaf follows the parameter its path ends with (see ``follow_params``): a
    leaf shaped like it (Adam's moments, momentum) takes its sharding, Adafactor's factored
    row and column statistics take it without the dimension optax factored away, and any
    other leaf (step counts, placeholders) is replicated. With ``shard_over`` (ZeRO-1), the
    leaves that follow a parameter are also split over those mesh axes, on the first dimension
    they divide, so each data-parallel replica keeps only its part of the state.

    Args:
        tx: The optax transformation.
        params: The parameters: arrays (or ``jax.ShapeDtypeStruct``) carrying ``NamedSharding``.
        shard_over: Mesh axes to also split optimizer state over, such as ``("dp",)``.

    Returns:
        A tree of ``NamedSharding`` shaped like the optimizer state.

    Raises:
        EscaleError: If a parameter has no ``NamedSharding``, the parameters are on several
            meshes (or none), or ``shard_over`` names an axis the mesh lacks.
        EscaleTypeError: If ``tx`` is not an optax transformation (``optax.adam`` rather
            than ``optax.adam(1e-3)``, say), or ``shard_over`` is a string.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import optax
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh, opt_state_shardings
        >>> mesh = create_mesh((2, 4, 1, 1, 1))
        >>> w = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, PartitionSpec("fsdp")))
        >>> s = opt_state_shardings(optax.adam(1e-3), {"w": w}, shard_over=("dp",))
        >>> s[0].mu["w"].spec, s[0].count.spec
        (P(('fsdp', 'dp'), None), P())
    """
    return shardings_checked(
        check.transformation(tx, "tx"), params, check.names(shard_over, "shard_over")
    )


def shardings_checked(
    tx: optax.GradientTransformation, params: Any, shard_over: tuple[str, ...]
) -> Any:
    """:func:`opt_state_shardings` for a transformation and axis names already checked."""
    flat, _ = flatten_with_paths(params)
    tracked = [(path, np.shape(value), sharding_of_param(value)) for path, value, _ in flat]
    meshes = {sharding.mesh for _, _, sharding in tracked}
    if not meshes:
        raise EscaleError("params: there are no parameters to create optimizer state for.")
    if len(meshes) != 1:
        raise EscaleError(
            f"params: the parameters must all be sharded on one mesh, found {len(meshes)}."
        )
    abstract = jax.eval_shape(tx.init, params)
    return follow_shardings(abstract, tracked, meshes.pop(), shard_over=shard_over)


def init_opt_state(
    tx: optax.GradientTransformation, params: Any, *, shard_over: Sequence[str] = ()
) -> Any:
    """``tx.init(params)``, created directly in the shardings of :func:`opt_state_shardings`.

    One ``jax.jit`` with ``out_shardings``: no state leaf is ever whole on one device.

    Example:
        >>> import jax
        >>> import optax
        >>> import flax_escale as fe
        >>> mesh = fe.create_mesh((1, 8, 1, 1, 1))
        >>> shardings = fe.logical_to_mesh_sharding({"embedding": ("vocab", None)}, mesh)
        >>> params = jax.device_put({"embedding": jax.numpy.ones((16, 4))}, shardings)
        >>> state = fe.init_opt_state(optax.sgd(0.1, momentum=0.9), params)
        >>> trace = state[0].trace["embedding"]  # the momentum, born split like its parameter
        >>> trace.sharding.spec, trace.addressable_shards[0].data.shape
        (P(('fsdp', 'sp'), None), (2, 4))
    """
    return create_checked(
        check.transformation(tx, "tx"), params, check.names(shard_over, "shard_over")
    )


def create_checked(
    tx: optax.GradientTransformation, params: Any, shard_over: tuple[str, ...]
) -> Any:
    """:func:`init_opt_state` for a transformation and axis names already checked."""
    shardings = shardings_checked(tx, params, shard_over)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def follow_shardings(
    state: Any,
    params: Sequence[tuple[str, Sequence[int], NamedSharding]],
    mesh: Mesh,
    *,
    shard_over: Sequence[str] = (),
) -> Any:
    """The sharding of every leaf of an (abstract) optimizer state, following its parameter.

    Each leaf of ``state`` is matched to a parameter by :func:`follow_params` and takes the
    spec entries it inherits, split over ``shard_over`` too (ZeRO-1, :func:`add_data_axes`);
    a leaf that follows no parameter is replicated. A leaf shaped like its parameter keeps the
    parameter's spec as written (no padding), so their shardings compare equal.

    Args:
        state: The state, or ``jax.eval_shape`` of it; Flax boxes and NNX variables count as
            leaves (see :func:`~flax_escale._paths.flatten_with_paths`), so paths read
            like ``0/mu/wi/kernel`` or, in an NNX optimizer, ``opt_state/0/mu/wi/kernel``.
        params: ``(path, shape, sharding)`` per parameter, paths ``/``-joined like
            ``wi/kernel``.
        mesh: The mesh of the parameters, which replicated leaves are placed on.
        shard_over: Mesh axes to also split the following leaves over, such as ``("dp",)``.

    Returns:
        A tree of ``NamedSharding`` shaped like ``state`` (one entry per box).

    Raises:
        EscaleError: If ``shard_over`` names an axis the mesh lacks or one twice, or a
            parameter is sharded on another mesh.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.plan._optimizer import follow_shardings
        >>> mesh = create_mesh((2, 4, 1, 1, 1))
        >>> kernel = NamedSharding(mesh, PartitionSpec("fsdp", None))
        >>> state = {"mu": {"wi": {"kernel": jnp.zeros((8, 16))}}, "count": jnp.zeros(())}
        >>> s = follow_shardings(state, [("wi/kernel", (8, 16), kernel)], mesh,
        ...                      shard_over=("dp",))
        >>> s["mu"]["wi"]["kernel"].spec, s["count"].spec
        (P(('fsdp', 'dp'), None), P())
    """
    repeated = sorted({a for a in shard_over if list(shard_over).count(a) > 1})
    if repeated:
        raise EscaleError(
            f"shard_over: mesh axis {repeated[0]!r} is named {list(shard_over).count(repeated[0])}"
            " times; name each axis once, such as shard_over=('dp',)."
        )
    missing = [a for a in shard_over if a not in mesh.shape]
    if missing:
        raise EscaleError(
            f"shard_over={tuple(shard_over)}: mesh axis {missing[0]!r} is not in the mesh "
            f"{dict(mesh.shape)}; name axes of the mesh."
        )
    per_dim = []
    for path, shape, sharding in params:
        if sharding.mesh != mesh:
            raise EscaleError(
                f"params: {path!r} is sharded on the mesh {dict(sharding.mesh.shape)}, not on "
                f"the optimizer's mesh {dict(mesh.shape)}; shard every parameter on one mesh."
            )
        # One entry per dimension: a spec may leave its trailing dimensions out.
        spec = tuple(sharding.spec)
        per_dim.append((path, tuple(shape), spec + (None,) * (len(shape) - len(spec))))
    flat, treedef = flatten_with_paths(state)
    leaves = [(path, tuple(np.shape(value))) for path, value, _ in flat]
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = []
    for (_, shape), followed in zip(leaves, follow_params(leaves, per_dim), strict=True):
        if followed is None or followed.entries is None:
            shardings.append(replicated)
            continue
        _, param_shape, param_sharding = params[followed.param]
        kept = followed.entries
        if shape == tuple(param_shape):
            kept = tuple(param_sharding.spec)
        spec = add_data_axes(PartitionSpec(*kept), shape, shard_over, mesh.shape)
        shardings.append(NamedSharding(mesh, spec))
    return treedef.unflatten(shardings)


def sharding_of_param(param: Any) -> NamedSharding:
    """The ``NamedSharding`` a parameter already has, which its optimizer state follows.

    Raises:
        EscaleError: If ``param`` carries no ``NamedSharding`` (it was not created sharded).
    """
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise EscaleError(
            f"params: a parameter of shape {getattr(param, 'shape', '?')} has sharding "
            f"{sharding!r}, not a NamedSharding; create the parameters with init_sharded (or "
            "jax.device_put them with a NamedSharding) first."
        )
    return sharding


def add_data_axes(
    spec: PartitionSpec, shape: Sequence[int], axes: Sequence[str], mesh_shape: Any
) -> PartitionSpec:
    """``spec`` also split over the data ``axes``, for ZeRO-1 optimizer state.

    The axes ``spec`` does not use yet (of size > 1) join the first dimension whose size they
    divide together with that dimension's own axes; if none does, ``spec`` is returned.

    Example:
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale.plan._optimizer import add_data_axes
        >>> add_data_axes(PartitionSpec("fsdp"), (8, 6), ("dp",), {"fsdp": 4, "dp": 2})
        P(('fsdp', 'dp'), None)
        >>> add_data_axes(PartitionSpec("fsdp"), (4, 6), ("dp",), {"fsdp": 4, "dp": 2})
        P('fsdp', 'dp')
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for entry in entries for a in mesh_axes_of(entry)}
    extra = tuple(a for a in axes if a not in used and mesh_shape[a] > 1)
    if not extra:
        return spec
    for dim, size in enumerate(shape):
        combined = mesh_axes_of(entries[dim]) + extra
        if size % math.prod(mesh_shape[a] for a in combined) == 0:
            entries[dim] = combined[0] if len(combined) == 1 else combined
            return PartitionSpec(*entries)
    return spec
