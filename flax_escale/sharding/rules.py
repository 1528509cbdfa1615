"""Regex partition rules: a ``PartitionSpec`` for every array, chosen by its path.

Paths are the ``/``-joined keys from the root of the tree (dict keys, attribute names, list
indices), with Flax boxes treated as leaves (see :mod:`flax_escale.sharding.paths`), so a Linen
boxed parameter, an NNX ``State`` entry and a plain array at the same place all have the path
``params/mlp/wi/kernel`` and a rule ``kernel$`` matches each of them.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flax_escale.errors import EscaleError, ShardingCorrectionWarning
from flax_escale.mesh.context import get_incontext_mesh
from flax_escale.resolve.fit import mesh_axes_of
from flax_escale.sharding.paths import flatten_with_paths

__all__ = ["PartitionRuleError", "create_pattern_based_partition_spec", "match_partition_rules"]

Rules = Sequence[tuple[str, PartitionSpec]]


class PartitionRuleError(EscaleError):
    """No partition rule matches an array (or a rule or pattern is malformed)."""


def match_partition_rules(rules: Rules, tree: Any, min_size: int = 0, strict: bool = True) -> Any:
    """A ``PartitionSpec`` for every array of ``tree``, from the first rule whose regex matches.

    Each rule is ``(regex, spec)``; the regex is searched (``re.search``) in the array's path.
    Non-arrays and scalars get ``PartitionSpec()``; so do arrays with fewer than ``min_size``
    elements. A spec longer than the array's rank is cut to the rank. Leaves may be arrays,
    ``jax.ShapeDtypeStruct`` (so the result can be the ``out_shardings`` of a sharded init), or
    Flax boxes, which are replaced by their spec.

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order.
        tree: Any pytree: dicts, lists, ``nnx.State``, Linen variables (boxed or not).
        min_size: Arrays with fewer elements stay unsharded.
        strict: Raise if an array matches no rule; otherwise it is replicated, with a
            :class:`~flax_escale.ShardingCorrectionWarning` listing every such path.

    Returns:
        A tree of ``PartitionSpec`` shaped like ``tree``.

    Raises:
        PartitionRuleError: With ``strict``, for an array no rule matches (naming its path and
            shape); for a regex that does not compile.

    Example:
        >>> rules = [("embedding", PartitionSpec("tp", "fsdp")),
        ...          ("kernel$", PartitionSpec("fsdp", "tp")),
        ...          (".*", PartitionSpec())]
        >>> tree = {"embed": {"embedding": np.zeros((64, 8))},
        ...         "wi": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}}
        >>> specs = match_partition_rules(rules, tree)
        >>> specs["embed"]["embedding"], specs["wi"]["kernel"], specs["wi"]["bias"]
        (P('tp', 'fsdp'), P('fsdp', 'tp'), P())
    """
    compiled = _compile(tuple((pattern, _as_spec(spec)) for pattern, spec in rules))
    flat, treedef = flatten_with_paths(tree)
    unmatched = []
    specs = []
    for path, value, _ in flat:
        spec = _spec_for(path, value, compiled, min_size)
        if spec is None:
            unmatched.append(f"{path!r} {tuple(value.shape)}")
            spec = PartitionSpec()
        specs.append(spec)
    if unmatched:
        message = (
            f"no partition rule matches {', '.join(unmatched)}; rules tried: "
            f"{[pattern for pattern, _, _ in compiled]}. Add a rule for these paths (a last "
            "('.*', PartitionSpec()) replicates everything else)"
        )
        if strict:
            raise PartitionRuleError(message + ", or pass strict=False.")
        warnings.warn(message + ".", ShardingCorrectionWarning, stacklevel=2)
    return treedef.unflatten(specs)


def _spec_for(path: str, value: Any, compiled: tuple, min_size: int) -> PartitionSpec | None:
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or int(np.prod(shape)) < min_size:
        return PartitionSpec()
    for _, regex, spec in compiled:
        if regex.search(path):
            return PartitionSpec(*tuple(spec)[: len(shape)])
    return None


def _as_spec(spec: Any) -> PartitionSpec:
    if isinstance(spec, PartitionSpec):
        return spec
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, (tuple, list)):
        return PartitionSpec(*spec)
    raise PartitionRuleError(f"rules: {spec!r} is not a PartitionSpec.")


@functools.lru_cache(maxsize=256)
def _compile(rules: tuple[tuple[str, PartitionSpec], ...]) -> tuple:
    compiled = []
    for pattern, spec in rules:
        try:
            compiled.append((pattern, re.compile(pattern), spec))
        except re.error as error:
            raise PartitionRuleError(f"rules: {pattern!r} is not a valid regex: {error}.") from None
    return tuple(compiled)


def create_pattern_based_partition_spec(
    pattern: str,
    mesh: Mesh | None = None,
    default_spec: PartitionSpec | None = None,
) -> Callable[[str, Any], PartitionSpec]:
    """A function ``(path, array) -> PartitionSpec`` from a compact rule string.

    The string is rules separated by ``,``; a rule is ``regexes->spec``, several regexes joined
    by ``|`` sharing one spec, and the spec's entries joined by ``.`` (``None`` for an unsharded
    dimension). ``"attention|mlp->fsdp.tp,embed->tp"`` sends paths containing ``attention`` or
    ``mlp`` to ``P('fsdp', 'tp')`` and those containing ``embed`` to ``P('tp')``. The first rule
    whose regex is found in the path wins; otherwise ``default_spec`` (replicated).

    Args:
        pattern: The rule string.
        mesh: If given (or set as the current mesh), every axis is checked against it.
        default_spec: The spec when no rule matches.

    Returns:
        The function.

    Raises:
        PartitionRuleError: For a rule without ``->``, an empty regex, or an axis the mesh lacks.

    Example:
        >>> spec_of = create_pattern_based_partition_spec("attention|mlp->fsdp.tp,embed->tp.None")
        >>> spec_of("layer_0/mlp/kernel", np.zeros((4, 4)))
        P('fsdp', 'tp')
        >>> spec_of("embed/table", np.zeros((8, 2)))
        P('tp', None)
        >>> spec_of("norm/scale", np.zeros(4))
        P()
    """
    default = PartitionSpec() if default_spec is None else default_spec
    if mesh is None:
        try:
            mesh = get_incontext_mesh()
        except EscaleError:
            mesh = None
    rules = []
    for rule in (r.strip() for r in pattern.split(",") if r.strip()):
        if rule.count("->") != 1:
            raise PartitionRuleError(
                f"pattern {pattern!r}: rule {rule!r} must be 'regex|regex->axis.axis'."
            )
        regexes, spec_text = (part.strip() for part in rule.split("->"))
        entries = [None if e.strip() in ("None", "") else e.strip() for e in spec_text.split(".")]
        spec = PartitionSpec(*entries)
        if mesh is not None:
            missing = [a for e in spec for a in mesh_axes_of(e) if a not in mesh.axis_names]
            if missing:
                raise PartitionRuleError(
                    f"pattern {pattern!r}: rule {rule!r} names axis {missing[0]!r}, which the "
                    f"mesh {dict(mesh.shape)} lacks."
                )
        for regex in regexes.split("|"):
            if not regex.strip():
                raise PartitionRuleError(f"pattern {pattern!r}: rule {rule!r} has an empty regex.")
            rules.append((regex.strip(), spec))
    compiled = _compile(tuple(rules))

    def spec_of(path: str, array: Any) -> PartitionSpec:
        for _, regex, spec in compiled:
            if regex.search(path):
                rank = len(getattr(array, "shape", spec))
                return PartitionSpec(*tuple(spec)[:rank])
        return default

    return spec_of
