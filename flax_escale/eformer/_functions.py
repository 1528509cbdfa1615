"""eformer's regex rules and automatic spec, whose signatures differ from the core's.

Each is a thin adapter: it translates eformer's arguments and calls the one implementation in
the core, so corrections, errors and results are the library's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._paths import flatten_with_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.sharding import spec_from_shape, specs_from_regex
from flax_escale.sharding._regex_rules import (
    PartitionRuleError,
    as_rule_spec,
    checked_min_size,
    compile_rules,
)

__all__ = ["auto_partition_spec", "match_partition_rules"]


def match_partition_rules(
    rules: Sequence[tuple[str, PartitionSpec]],
    tree: Any,
    min_size: int | None = 0,
    strict: bool = True,
) -> Any:
    """A ``PartitionSpec`` for every leaf of ``tree``, from the first regex matching its path.

    :func:`flax_escale.sharding.specs_from_regex` with eformer's meaning of ``strict``. Leaves
    without a shape (ints, floats, strings) and scalars get ``P()``, and ``None`` stays
    ``None``, as in eformer. ``strict=True`` replicates arrays under ``min_size`` elements
    (``None`` is eformer's default minimum, 16384) and needs a rule for every other array.
    ``strict=False`` applies every matched rule whatever the array's size and, as in eformer,
    needs a rule for every leaf, those without a shape included; they still get ``P()``, since
    nothing can split a value without dimensions (eformer hands them the rule's spec). Specs
    are cut to the array's rank in both modes, and cutting mesh axes warns with
    :class:`~flax_escale.ShardingCorrectionWarning` (eformer cuts only with ``strict``).

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order.
        tree: Any pytree (paths are ``/``-joined keys).
        min_size: Arrays with fewer elements stay unsharded (with ``strict``).
        strict: Apply ``min_size``, and ask rules of arrays only.

    Returns:
        A tree of ``PartitionSpec`` shaped like ``tree``.

    Raises:
        PartitionRuleError: For a leaf that needs a rule and matches none (a ``ValueError``,
            as in eformer), or a regex that does not compile.
        EscaleTypeError: For malformed ``rules`` (see
            :func:`flax_escale.sharding.specs_from_regex`), or ``strict`` not a bool.

    Example:
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale import eformer as escale
        >>> tree = {"w": np.zeros((64, 64)), "b": np.zeros(64), "step": 3, "note": None}
        >>> rules = [("w", P("fsdp", "tp")), (".*", P())]
        >>> escale.match_partition_rules(rules, tree, min_size=None)  # 4096 < 16384
        {'b': P(), 'note': None, 'step': P(), 'w': P()}
        >>> escale.match_partition_rules(rules, tree, min_size=None, strict=False)["w"]
        P('fsdp', 'tp')
    """
    strict = check.flag(strict, "strict")
    min_size = checked_min_size(min_size, "match_partition_rules: min_size")
    pairs = check.pairs(
        rules, "rules", "(regex, PartitionSpec)", "[('kernel$', PartitionSpec('fsdp', 'tp'))]"
    )
    compiled = compile_rules(
        tuple((pattern, as_rule_spec(spec, pattern)) for pattern, spec in pairs)
    )
    flat, treedef = flatten_with_paths(tree)
    unmatched = [
        f"{path!r} {_described(value)}"
        for path, value, _ in flat
        if (not strict or _shardable(value, min_size))
        and not any(pattern.search(path) for _, pattern, _ in compiled)
    ]
    if unmatched:
        every_leaf = (
            " With strict=False every leaf needs a rule, as in eformer, even one without a shape."
            if not strict
            else ""
        )
        raise PartitionRuleError(
            f"match_partition_rules: no partition rule matches {', '.join(unmatched)}; rules "
            f"tried: {[pattern for pattern, _, _ in compiled]}. Add a rule for these paths (a "
            f"last ('.*', PartitionSpec()) replicates everything else).{every_leaf}"
        )
    if not any(hasattr(value, "shape") for _, value, _ in flat):
        # Nothing to split (the core refuses such a tree as a likely mistake; eformer does not).
        return treedef.unflatten([PartitionSpec() for _ in flat])
    return specs_from_regex(pairs, tree, min_size=min_size if strict else 0, strict=True)


def _shardable(value: Any, min_size: float) -> bool:
    # The arrays specs_from_regex looks a rule up for: the others are replicated before that.
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) > 0 and math.prod(shape) >= min_size


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"({type(value).__name__})" if shape is None else str(tuple(shape))


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
