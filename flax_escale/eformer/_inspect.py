"""eformer's readers of a tree's shardings, and its dict-shaped analysis of a layout.

In JAX a leaf's sharding is ``leaf.sharding`` (``jax.tree.map`` over a tree); Flax reads the
logical axes of boxed parameters with ``nn.get_partition_spec`` and NNX's with
``nnx.get_partition_spec``. eformer's own names for reading mesh specs are these, and its
analysis is the core's measurement (:class:`~flax_escale.ShardingReport`'s figures) read as
eformer's dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._checks import describe
from flax_escale._paths import is_box, unbox
from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, EscaleTypeError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.sharding._measure import LayoutFigures, measure_layout

__all__ = [
    "ShardingAnalysis",
    "analyze_sharding_strategy",
    "extract_sharding_structure",
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
        MeshError: If ``mesh`` is empty (:func:`get_incontext_mesh` outside any mesh).
        EscaleTypeError: If ``mesh`` is not a mesh, or ``tree`` holds no array (a string or
            ``None``, say), which would otherwise give ``None`` as if nothing were sharded.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import linen as nn
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale.eformer import create_mesh, extract_shardings
        >>> fsdp = NamedSharding(create_mesh((1, 8, 1, 1, 1)), PartitionSpec("fsdp"))
        >>> abstract = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=fsdp)
        >>> shardings = extract_shardings({"w": nn.LogicallyPartitioned(abstract, ("embed", None)),
        ...                                "n": 3})
        >>> shardings["w"].spec, shardings["n"]
        (PartitionSpec('fsdp',), None)
    """
    return _shardings(tree, check.optional_mesh(mesh), "extract_shardings", "tree")


def extract_sharding_structure(pytree: Any) -> Any:
    """:func:`extract_shardings` under eformer's other names, which take the tree as ``pytree``.

    ``get_shardings_with_structure`` is this function too. eformer's reads only placed
    ``jax.Array`` leaves; this one also reads a ``jax.ShapeDtypeStruct``'s sharding and Flax
    boxes, as :func:`extract_shardings` does.

    Raises:
        NoMeshError: If a leaf carries a ``PartitionSpec`` and no mesh is set.
        EscaleTypeError: If ``pytree`` holds no array.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import eformer as escale
        >>> mesh = escale.create_mesh((1, 8, 1, 1, 1))
        >>> w = jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, PartitionSpec("fsdp")))
        >>> escale.get_shardings_with_structure(pytree={"w": w})["w"].spec
        P('fsdp',)
    """
    return _shardings(pytree, None, "extract_sharding_structure", "pytree")


def _shardings(tree: Any, mesh: Mesh | None, caller: str, argument: str) -> Any:
    check.tree_of_arrays(tree, argument)

    def sharding_of(leaf: Any) -> NamedSharding | None:
        sharding = getattr(unbox(leaf), "sharding", None)
        if isinstance(sharding, PartitionSpec):
            return check.named_sharding_of(_mesh(mesh, caller), sharding, argument)
        return sharding if isinstance(sharding, NamedSharding) else None

    return jax.tree.map(sharding_of, tree, is_leaf=is_box)


def _mesh(mesh: Mesh | None, caller: str) -> Mesh:
    if mesh is not None:
        return mesh
    try:
        return current_mesh()
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
        >>> from flax_escale.eformer import get_names_from_partition_spec
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
class ShardingAnalysis(LayoutFigures, Mapping):
    """What a layout costs, readable as the dict eformer returns.

    Its attributes are the figures of a :class:`~flax_escale.ShardingReport`
    (``total_parameters``, ``sharded_parameters``, ``total_bytes``, ``bytes_per_device``,
    ``max_device_bytes``, ``min_device_bytes``, ``balance_score``, ``ideal_device_bytes``,
    ``partition_stats``). Its keys are eformer's: ``analysis["total_parameters"]``,
    ``"sharded_parameters"``, ``"memory_per_device"`` (the attribute ``bytes_per_device``),
    ``"balance_score"`` and ``"partition_stats"``.
    """

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
        MeshError: If ``mesh`` is empty (:func:`get_incontext_mesh` outside any mesh).
        EscaleTypeError: If ``pytree`` holds no array, ``mesh`` is not a mesh, or a spec is
            not a ``PartitionSpec``.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.eformer import analyze_sharding_strategy
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
    return measure_layout(pytree, partition_specs, mesh, into=ShardingAnalysis)
