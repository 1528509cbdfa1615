"""Reading shardings back out of trees, and measuring what a layout costs each device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale.errors import EscaleError, EscaleTypeError, NoMeshError
from flax_escale.mesh import _validate as check
from flax_escale.mesh import get_incontext_mesh
from flax_escale.mesh._validate import describe
from flax_escale.resolve._fit import fit_spec, mesh_axes_of
from flax_escale.sharding._paths import flatten_with_paths, is_box, unbox

__all__ = [
    "ShardingAnalysis",
    "analyze_sharding_strategy",
    "extract_shardings",
    "get_names_from_partition_spec",
    "get_partition_spec",
]


def extract_shardings(tree: Any, mesh: Mesh | None = None) -> Any:
    """The ``NamedSharding`` of every leaf (``None`` where there is none).

    A leaf's ``.sharding`` counts when it is a ``NamedSharding``, or a ``PartitionSpec`` (made
    into one on ``mesh``, else the current mesh). Flax boxes count as their array.

    Raises:
        NoMeshError: If a leaf carries a ``PartitionSpec`` and there is no mesh.
        EscaleTypeError: If ``mesh`` is not a mesh, or ``tree`` holds no array (a string or
            ``None``, say), which would otherwise give ``None`` as if nothing were sharded.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import extract_shardings
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> w = jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, PartitionSpec("fsdp")))
        >>> extract_shardings({"w": w, "n": 3})["n"] is None
        True
    """
    mesh = check.optional_mesh(mesh)
    check.tree_of_arrays(tree, "tree")

    def sharding_of(leaf: Any) -> NamedSharding | None:
        sharding = getattr(unbox(leaf), "sharding", None)
        if isinstance(sharding, PartitionSpec):
            return check.named_sharding_of(_mesh(mesh, "extract_shardings"), sharding, "tree")
        return sharding if isinstance(sharding, NamedSharding) else None

    return jax.tree.map(sharding_of, tree, is_leaf=is_box)


def _mesh(mesh: Mesh | None, caller: str) -> Mesh:
    if mesh is not None:
        return mesh
    try:
        return get_incontext_mesh()
    except NoMeshError:
        raise NoMeshError(
            f"{caller}: a leaf carries a PartitionSpec and no mesh is given; pass mesh= or set "
            "one with jax.set_mesh."
        ) from None


def get_partition_spec(tree: Any) -> Any:
    """The ``PartitionSpec`` of every leaf: a ``jax.Array``'s, or ``P()`` for Python scalars.

    Raises:
        EscaleError: For any other leaf, or an array whose sharding has no spec.
    """

    def spec_of(leaf: Any) -> PartitionSpec:
        if isinstance(leaf, jax.Array):
            spec = getattr(leaf.sharding, "spec", None)
            if spec is None:
                raise EscaleError(
                    f"get_partition_spec: an array of shape {leaf.shape} has sharding "
                    f"{leaf.sharding!r}, which has no PartitionSpec."
                )
            return spec
        if isinstance(leaf, (int, float)):
            return PartitionSpec()
        raise EscaleError(
            f"get_partition_spec: unsupported leaf {type(leaf).__name__} in tree: "
            f"{describe(leaf)}; expected jax.Array, int or float. Place arrays on the mesh "
            "first (jax.device_put with a NamedSharding), or use extract_shardings for trees "
            "that mix them with other leaves."
        )

    return jax.tree.map(spec_of, tree)


def get_names_from_partition_spec(partition_specs: Any) -> list[str]:
    """Every mesh axis name used in a spec, a tree or dict of specs, sorted.

    Example:
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale.sharding import get_names_from_partition_spec
        >>> get_names_from_partition_spec({"a": PartitionSpec(("fsdp", "sp"), "tp"), "b": None})
        ['fsdp', 'sp', 'tp']

    Raises:
        EscaleTypeError: For a leaf that is neither a spec, a name nor ``None``.
    """
    names: set[str] = set()

    def visit(item: Any) -> None:
        if item is None:
            return
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, PartitionSpec):
            for dim, entry in enumerate(item):
                names.update(mesh_axes_of(entry, argument=f"entry {dim} of {item}"))
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, Iterable):
            for value in item:
                visit(value)
        else:
            holding = "" if item is partition_specs else f" holding {describe(item)}"
            raise EscaleTypeError(
                f"partition_specs must be a PartitionSpec, a mesh axis name or a tree of them, "
                f"got {describe(partition_specs)}{holding}; pass e.g. "
                "PartitionSpec('fsdp', 'tp') or {'w': PartitionSpec('tp')}."
            )

    visit(partition_specs)
    return sorted(names)


@dataclasses.dataclass(frozen=True)
class ShardingAnalysis(Mapping):
    """What a layout costs: element counts, bytes on every device, balance.

    Also readable as the dict eformer returns: ``analysis["total_parameters"]``, with the keys
    ``total_parameters``, ``sharded_parameters``, ``memory_per_device`` (this class's
    ``bytes_per_device``), ``balance_score`` and ``partition_stats``.

    Attributes:
        total_parameters: Elements of all arrays.
        sharded_parameters: Elements of arrays split over at least one mesh axis.
        total_bytes: Bytes of all arrays.
        bytes_per_device: Bytes each device holds, by device id.
        max_device_bytes: The fullest device's bytes.
        min_device_bytes: The emptiest device's bytes.
        balance_score: ``min / max`` device bytes (1.0 is perfect balance).
        ideal_device_bytes: ``total_bytes / devices``.
        partition_stats: For each spec (as text): arrays, elements and bytes using it.
    """

    total_parameters: int
    sharded_parameters: int
    total_bytes: int
    bytes_per_device: dict[int, int]
    max_device_bytes: int
    min_device_bytes: int
    balance_score: float
    ideal_device_bytes: float
    partition_stats: dict[str, dict[str, int]]

    # eformer's dict keys, and the attribute each one reads.
    _KEYS: ClassVar[dict[str, str]] = {
        "total_parameters": "total_parameters",
        "sharded_parameters": "sharded_parameters",
        "memory_per_device": "bytes_per_device",
        "balance_score": "balance_score",
        "partition_stats": "partition_stats",
    }

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(
                f"ShardingAnalysis has no key {key!r}; the keys are {list(self._KEYS)}, and "
                "every figure is also an attribute (total_bytes, max_device_bytes, ...)."
            )
        return getattr(self, self._KEYS[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


def analyze_sharding_strategy(
    pytree: Any, partition_specs: Any, mesh: Mesh | None = None
) -> ShardingAnalysis:
    """Measures a layout: how many elements are split, and the bytes on every device.

    Per-device bytes are exact: each device's block of every array is computed from its place
    in the mesh, so replication counts fully and a spec that does not divide its dimension
    (which XLA pads) shows as the imbalance it causes.

    Args:
        pytree: Arrays (or ``jax.ShapeDtypeStruct``).
        partition_specs: A tree of specs shaped like ``pytree`` (or one spec for all).
        mesh: The mesh; defaults to the current mesh.

    Returns:
        A :class:`ShardingAnalysis`.

    Raises:
        EscaleError: If ``partition_specs`` is not shaped like ``pytree``, or a spec cannot
            exist on the mesh (an axis it lacks or used twice, more entries than dimensions).
        EscaleTypeError: If ``pytree`` holds no array, ``mesh`` is not a mesh, or a spec is
            not a ``PartitionSpec``.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import analyze_sharding_strategy
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> params = {"w": jax.ShapeDtypeStruct((16, 8), np.float32),
        ...           "b": jax.ShapeDtypeStruct((8,), np.float32)}
        >>> specs = {"w": PartitionSpec("fsdp", "tp"), "b": None}
        >>> a = analyze_sharding_strategy(params, specs, mesh)
        >>> a.total_bytes, a.max_device_bytes, a.balance_score
        (544, 96, 1.0)
        >>> a["total_parameters"], a["memory_per_device"][0]  # eformer's keys
        (136, 96)
    """
    mesh = check.optional_mesh(mesh)
    mesh = _mesh(mesh, "analyze_sharding_strategy") if mesh is None else mesh
    check.tree_of_arrays(pytree, "pytree")
    flat, treedef = flatten_with_paths(pytree)
    if isinstance(partition_specs, PartitionSpec) or partition_specs is None:
        specs = [partition_specs] * len(flat)
    elif isinstance(partition_specs, str):
        raise EscaleTypeError(
            f"partition_specs must be a PartitionSpec or a tree of them shaped like pytree, got "
            f"the string {partition_specs!r}; pass PartitionSpec({partition_specs!r})."
        )
    else:
        try:
            specs = treedef.flatten_up_to(partition_specs)
        except (ValueError, TypeError) as error:
            raise EscaleError(
                f"partition_specs must be a PartitionSpec or a tree of them shaped like pytree, "
                f"got {describe(partition_specs)}: {str(error).splitlines()[0]} Give one spec "
                "per array, with the same keys."
            ) from None
    for spec in specs:
        if spec is not None and not isinstance(spec, PartitionSpec):
            raise EscaleTypeError(
                f"partition_specs must hold a PartitionSpec (or None) per array, got "
                f"{describe(spec)}; pass e.g. PartitionSpec('fsdp', 'tp')."
            )
    per_device = {device.id: 0 for device in mesh.devices.flat}
    stats: dict[str, dict[str, int]] = {}
    total = sharded = total_bytes = 0
    for (path, value, _), spec in zip(flat, specs, strict=True):
        shape = tuple(getattr(value, "shape", ()))
        itemsize = np.dtype(getattr(value, "dtype", np.float32)).itemsize
        spec = PartitionSpec() if spec is None else spec
        elements = math.prod(shape)
        total += elements
        total_bytes += elements * itemsize
        entry = stats.setdefault(str(spec), {"arrays": 0, "parameters": 0, "bytes": 0})
        entry["arrays"] += 1
        entry["parameters"] += elements
        entry["bytes"] += elements * itemsize
        for device_id, elements_here in _elements_per_device(path, shape, spec, mesh):
            per_device[device_id] += elements_here * itemsize
        if any(mesh_axes_of(part) for part in spec):  # checked by _elements_per_device
            sharded += elements
    largest, smallest = max(per_device.values()), min(per_device.values())
    return ShardingAnalysis(
        total_parameters=total,
        sharded_parameters=sharded,
        total_bytes=total_bytes,
        bytes_per_device=per_device,
        max_device_bytes=largest,
        min_device_bytes=smallest,
        balance_score=smallest / largest if largest else 1.0,
        ideal_device_bytes=total_bytes / mesh.size,
        partition_stats=stats,
    )


def _elements_per_device(
    path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> Iterable[tuple[int, int]]:
    # A spec that does not divide its dimension is a layout XLA pads, measured as it is; one
    # that cannot exist (an axis the mesh lacks or used twice, axes past the rank) is refused.
    _, corrections = fit_spec(spec, shape, mesh.shape)
    for problem in corrections:
        if problem.kind != "not_divisible":
            raise EscaleError(
                f"{path!r}: spec {spec} cannot apply to shape {shape} on mesh "
                f"{dict(mesh.shape)}: in dimension {problem.dim}, {problem.detail}. Give the "
                "spec the array would have: one entry per dimension, axes of this mesh, each "
                "axis at most once."
            )
    entries = (list(spec) + [None] * len(shape))[: len(shape)]
    names = list(mesh.axis_names)
    for coords in np.ndindex(*mesh.devices.shape):
        elements = 1
        for size, entry in zip(shape, entries, strict=True):
            axes = mesh_axes_of(entry)
            parts = math.prod(mesh.shape[a] for a in axes)
            index = 0
            for axis in axes:
                index = index * mesh.shape[axis] + coords[names.index(axis)]
            block = -(-size // parts)
            elements *= min(max(size - index * block, 0), block)
        yield int(mesh.devices[coords].id), elements
