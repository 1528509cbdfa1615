"""eformer's regex rules and automatic spec, whose signatures differ from the core's.

Each is a thin adapter: it translates eformer's arguments and calls the one implementation in
the core, so corrections, errors and results are the library's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.sharding import spec_from_shape, specs_from_regex
from flax_escale.sharding._rules import checked_min_size

__all__ = ["auto_partition_spec", "match_partition_rules"]


def match_partition_rules(
    rules: Sequence[tuple[str, PartitionSpec]],
    tree: Any,
    min_size: int | None = 0,
    strict: bool = True,
) -> Any:
    """A ``PartitionSpec`` for every array of ``tree``, from the first regex matching its path.

    :func:`flax_escale.sharding.specs_from_regex` with eformer's meaning of ``strict``:
    ``True`` applies ``min_size`` (``None`` is eformer's default minimum, 16384 elements),
    ``False`` applies every matched rule whatever the array's size. In both modes an array no
    rule matches raises, as in eformer; specs are always cut to the array's rank, and cutting
    mesh axes warns with :class:`~flax_escale.ShardingCorrectionWarning`.

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order.
        tree: Any pytree of arrays (paths are ``/``-joined keys).
        min_size: Arrays with fewer elements stay unsharded (with ``strict``).
        strict: Apply ``min_size``.

    Returns:
        A tree of ``PartitionSpec`` shaped like ``tree``.

    Raises:
        PartitionRuleError: For an array no rule matches (a ``ValueError``, as in eformer).
        EscaleTypeError: For malformed ``rules`` or ``tree`` (see
            :func:`flax_escale.sharding.specs_from_regex`), or ``strict`` not a bool.

    Example:
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale import eformer as escale
        >>> tree = {"w": np.zeros((64, 64)), "b": np.zeros(64)}
        >>> rules = [("w", P("fsdp", "tp")), (".*", P())]
        >>> escale.match_partition_rules(rules, tree, min_size=None)["w"]  # 4096 < 16384
        P()
        >>> escale.match_partition_rules(rules, tree, min_size=None, strict=False)["w"]
        P('fsdp', 'tp')
    """
    strict = check.flag(strict, "strict")
    checked_min_size(min_size, "match_partition_rules: min_size")  # checked even when unused
    return specs_from_regex(rules, tree, min_size=min_size if strict else 0, strict=True)


def auto_partition_spec(
    x: Any,
    mesh: Mesh | AbstractMesh | None = None,
    names: Sequence[str | tuple[str, ...]] | None = None,
    min_sharding_size: int | None = None,
    reverse: bool = False,
    *,
    paxis: PartitionAxis | None = None,
) -> PartitionSpec:
    """An automatic spec for the array ``x``, with eformer's signature.

    The spec is :func:`flax_escale.sharding.spec_from_shape`'s (tensor axes from the last
    dimension they divide, data axes from the first; always divides the shape), so it can differ
    from eformer's largest-dimension-first choice. As eformer's, it has one entry per dimension.

    Args:
        x: An array (anything with a ``shape``: ``jax.ShapeDtypeStruct`` too).
        mesh: The mesh; defaults to the current mesh.
        names: The mesh axes the spec may use (a tuple entry allows each of its axes); by
            default, all of them.
        min_sharding_size: Arrays with fewer elements are replicated; by default the mesh's
            device count, as in eformer.
        reverse: Mirror the placement: tensor axes from the first dimension, data axes from
            the last.
        paxis: Which mesh axes are tensor and data axes (see the core function).

    Returns:
        The ``PartitionSpec``.

    Raises:
        EscaleTypeError: If ``x`` has no shape (eformer raises ``TypeError`` too), ``mesh`` is
            not a mesh, ``names`` is a string rather than a sequence of names, or
            ``min_sharding_size`` is not an int.
        NoMeshError: If ``mesh`` is omitted and no mesh is set.
        MeshError: If ``names`` names an axis the mesh lacks.

    Example:
        >>> import numpy as np
        >>> from flax_escale import eformer as escale
        >>> mesh = escale.create_mesh((2, 2, 1, 2, 1))
        >>> escale.auto_partition_spec(np.zeros((64, 256)), mesh)
        P(('fsdp', 'dp'), 'tp')
        >>> escale.auto_partition_spec(np.zeros((64, 256)), mesh, names=["tp"], reverse=True)
        P('tp', None)
        >>> escale.auto_partition_spec(np.zeros((2,)), mesh)  # fewer elements than devices
        P(None,)
    """
    shape = getattr(x, "shape", None)
    if shape is None:
        raise EscaleTypeError(
            f"auto_partition_spec: x must be an array (anything with a shape), got "
            f"{check.describe(x)}; pass the array, or jax.ShapeDtypeStruct(shape, dtype)."
        )
    shape = tuple(shape)
    mesh = check.optional_mesh(mesh)
    mesh = current_mesh() if mesh is None else mesh
    if min_sharding_size is not None:
        min_sharding_size = check.non_negative_int(min_sharding_size, "min_sharding_size")
    axes = None
    if names is not None:
        names = check.sequence(names, "names", "mesh axis names", "('fsdp', 'tp')")
    if names:  # eformer reads an empty list as "every axis", like None
        axes = tuple(a for name in names for a in mesh_axes_of(name, argument="names entry"))
    spec = spec_from_shape(
        shape[::-1] if reverse else shape,
        mesh,
        min_shard_size=mesh.size if min_sharding_size is None else min_sharding_size,
        paxis=paxis,
        axes=axes,
    )
    entries = [*spec, *([None] * (len(shape) - len(spec)))]
    return PartitionSpec(*(entries[::-1] if reverse else entries))
