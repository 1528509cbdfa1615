"""Moving whole trees onto a mesh, off it to the host, and from one mesh layout to another."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._paths import path_of
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import enforce, fit_mesh_axes

__all__ = [
    "as_named_sharding",
    "is_spec_leaf",
    "make_shard_and_gather_fns",
    "reshard_tree",
]


def as_named_sharding(spec: Any, mesh: Mesh | None, argument: str = "the spec") -> NamedSharding:
    """One leaf of a specs tree as a ``NamedSharding`` (``None`` is replicated) on ``mesh``.

    Raises:
        EscaleError: If the leaf is not a ``PartitionSpec``, ``NamedSharding`` or ``None``, or
            names a mesh axis twice or one the mesh lacks.
        NoMeshError: If a ``PartitionSpec`` needs a mesh and none is given or set.
    """
    if isinstance(spec, NamedSharding):
        return spec
    if mesh is None:
        mesh = current_mesh()
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise EscaleError(
            "axis resources must be PartitionSpec, NamedSharding or None leaves (expected a "
            f"PartitionSpec or NamedSharding, got {spec!r}); resolve logical axes first "
            "(logical_to_mesh_axes, Partitioner.get_mesh_axes)."
        )
    return check.named_sharding_of(mesh, spec, argument)


def is_spec_leaf(x: Any) -> bool:
    """Whether ``x`` is a leaf of a specs tree (``PartitionSpec``, ``NamedSharding``, ``None``)."""
    return isinstance(x, (PartitionSpec, NamedSharding)) or x is None


def make_shard_and_gather_fns(
    partition_specs: Any, mesh: Mesh | None = None, *, strict: bool = False
) -> tuple[Any, Any]:
    """Functions that place arrays with a spec, and bring them back whole to the host.

    For a tree of ``PartitionSpec`` (or ``NamedSharding``), returns two trees of the same shape:
    ``shard_fns`` take a numpy or jax array and return a ``jax.Array`` with that sharding;
    ``gather_fns`` take such an array and return it whole as a host ``numpy`` array. Map them
    over a parameter tree with ``jax.tree.map(lambda f, x: f(x), fns, tree)``. In one process,
    sharding is ``jax.device_put``; with several processes it is a ``jax.jit`` with
    ``out_shardings`` (every process passes the same whole array) and gathering first
    replicates the array with ``jax.jit``. Round trips are bit-exact.

    A spec that cannot apply to the array a shard function is given (mesh axes that do not
    divide a dimension, entries past the array's rank that name mesh axes, an axis used twice)
    is corrected as :func:`~flax_escale.with_sharding_constraint` corrects it: those axes are
    dropped with a :class:`~flax_escale.ShardingCorrectionWarning` naming the leaf's path, or,
    with ``strict``, a :class:`~flax_escale.ShardingResolutionError` is raised.

    Args:
        partition_specs: A tree of ``PartitionSpec`` / ``NamedSharding`` (``None`` is replicated).
        mesh: The mesh for ``PartitionSpec`` entries; defaults to the current mesh.
        strict: Make the shard functions raise instead of correcting a spec that does not fit.

    Returns:
        ``(shard_fns, gather_fns)``.

    Raises:
        NoMeshError: If a spec needs a mesh and none is given or set.
        EscaleError: If a spec is not a ``PartitionSpec`` (or ``NamedSharding``, ``None``),
            names a mesh axis twice or one the mesh lacks.
        EscaleTypeError: If ``partition_specs`` is a string or ``mesh`` not a mesh.

    Example:
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> import flax_escale as fe
        >>> from flax_escale.sharding import make_shard_and_gather_fns
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> shard_fns, gather_fns = make_shard_and_gather_fns({"w": P("fsdp", "tp")}, mesh)
        >>> w = shard_fns["w"](np.arange(32.0).reshape(8, 4))
        >>> w.sharding.spec, w.addressable_shards[0].data.shape
        (P('fsdp', 'tp'), (2, 2))
        >>> np.array_equal(gather_fns["w"](w), np.arange(32.0).reshape(8, 4))
        True
    """
    mesh = check.optional_mesh(mesh)
    strict = check.flag(strict, "strict")
    if isinstance(partition_specs, str):
        raise EscaleTypeError(
            f"partition_specs must be a tree of PartitionSpec, got the string "
            f"{partition_specs!r}; pass e.g. {{'w': PartitionSpec({partition_specs!r})}}."
        )
    shardings = jax.tree.map(
        lambda s: as_named_sharding(s, mesh, "partition_specs"),
        partition_specs,
        is_leaf=is_spec_leaf,
    )
    multiprocess = jax.process_count() > 1

    def make_shard_fn(key_path: Any, sharding: NamedSharding) -> Callable[[Any], jax.Array]:
        path = path_of(key_path)

        def shard_fn(array: Any) -> jax.Array:
            resolution = fit_mesh_axes(
                tuple(sharding.spec), shape=np.shape(array), mesh=sharding.mesh
            )
            target = sharding
            if resolution.corrections:
                enforce(resolution, strict=strict, path=path or None)
                target = NamedSharding(sharding.mesh, resolution.spec)
            if multiprocess:
                host = array if isinstance(array, jax.Array) else np.asarray(array)
                return _placer(target)(host)
            return jax.device_put(array, target)

        return shard_fn

    def make_gather_fn(sharding: NamedSharding) -> Callable[[jax.Array], np.ndarray]:
        replicate = _placer(NamedSharding(sharding.mesh, PartitionSpec()))

        def gather_fn(array: jax.Array) -> np.ndarray:
            if multiprocess and not array.is_fully_addressable:
                return np.asarray(replicate(array).addressable_data(0))
            return np.asarray(jax.device_get(array))

        return gather_fn

    shard_fns = jax.tree_util.tree_map_with_path(make_shard_fn, shardings)
    gather_fns = jax.tree.map(make_gather_fn, shardings)
    return shard_fns, gather_fns


@functools.lru_cache(maxsize=256)
def _placer(sharding: NamedSharding) -> Callable[[Any], jax.Array]:
    # One compiled identity per target sharding, shared by every leaf and call that needs it.
    return jax.jit(lambda x: x, out_shardings=sharding)


def reshard_tree(tree: Any, shardings: Any, *, mesh: Mesh | None = None) -> Any:
    """Moves every array of ``tree`` to new shardings, on the same mesh or another one.

    For going from a training layout to a serving one (another mesh shape, another device
    count): values are copied, never changed.

    Args:
        tree: The arrays.
        shardings: One ``NamedSharding`` / ``PartitionSpec`` for all, or a tree of them shaped
            like ``tree``.
        mesh: The mesh for ``PartitionSpec`` entries; defaults to the current mesh.

    Returns:
        The tree, resharded.

    Raises:
        EscaleError: If ``shardings`` is not shaped like ``tree``, a spec names a mesh axis
            twice or one the mesh lacks, or its axes do not divide the array.
        EscaleTypeError: If ``tree`` holds no array, ``shardings`` is a string or ``mesh`` is
            not a mesh.

    Example:
        One spec places every array of a tree; a tree of specs moves each its own way, here
        from a training mesh of 8 devices to a serving mesh of 4:

        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale import create_mesh, reshard_tree
        >>> train = create_mesh((1, 8, 1, 1, 1))
        >>> params = reshard_tree({"w": np.arange(64.0).reshape(8, 8)}, P("fsdp"), mesh=train)
        >>> serve = create_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
        >>> moved = reshard_tree(params, {"w": P(None, "tp")}, mesh=serve)["w"]
        >>> moved.sharding.spec, len(moved.sharding.device_set), np.array_equal(moved, params["w"])
        (P(None, 'tp'), 4, True)
    """
    mesh = check.optional_mesh(mesh)
    check.tree_of_arrays(tree, "tree")
    if isinstance(shardings, str):
        raise EscaleTypeError(
            f"shardings must be a NamedSharding or PartitionSpec (or a tree of them), got the "
            f"string {shardings!r}; pass PartitionSpec({shardings!r})."
        )
    if is_spec_leaf(shardings):
        target = as_named_sharding(shardings, mesh, "shardings")
        return jax.tree_util.tree_map_with_path(lambda p, x: _put(p, x, target), tree)
    given = check.structure_like(shardings, tree, "shardings", "tree")
    named = [as_named_sharding(s, mesh, "shardings") for s in given]
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    moved = [_put(p, x, s) for (p, x), s in zip(leaves_with_paths, named, strict=True)]
    return treedef.unflatten(moved)


def _put(key_path: Any, x: Any, sharding: NamedSharding) -> Any:
    try:
        return jax.device_put(x, sharding)
    except ValueError as error:  # jax's IndivisibleError and kin
        shape = getattr(x, "shape", None)
        raise EscaleError(
            f"reshard_tree: shardings give {sharding.spec}, which cannot apply to "
            f"{path_of(key_path) or 'the array'!r} of shape {shape} on mesh "
            f"{dict(sharding.mesh.shape)}: {str(error).splitlines()[0]} Give it a spec whose "
            "mesh axes divide its dimensions."
        ) from None
