"""Regex partition rules: a ``PartitionSpec`` for every array, chosen by its path.

Paths are the ``/``-joined keys from the root of the tree (dict keys, attribute names, list
indices), with Flax boxes treated as leaves (see :mod:`flax_escale._paths`), so a Linen
boxed parameter, an NNX ``State`` entry and a plain array at the same place all have the path
``params/mlp/wi/kernel`` and a rule ``kernel$`` matches each of them.
"""

from __future__ import annotations

import functools
import numbers
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from flax_escale import _checks as check
from flax_escale._checks import describe
from flax_escale._paths import flatten_with_paths
from flax_escale._regex import UserPattern
from flax_escale.errors import EscaleError, EscaleTypeError, ShardingCorrectionWarning
from flax_escale.resolve import Resolution, enforce, fit_spec

__all__ = ["DEFAULT_MIN_SIZE", "PartitionRuleError", "checked_min_size", "specs_from_regex"]

Rules = Sequence[tuple[str, PartitionSpec]]

DEFAULT_MIN_SIZE = 16384
"""The minimum array size ``min_size=None`` stands for (eformer's default minimum)."""


class PartitionRuleError(EscaleError):
    """No partition rule matches an array (or a rule or pattern is malformed)."""


def specs_from_regex(rules: Rules, tree: Any, min_size: int | None = 0, strict: bool = True) -> Any:
    """A ``PartitionSpec`` for every array of ``tree``, from the first rule whose regex matches.

    Each rule is ``(regex, spec)``; the regex is searched (``re.search``) in the array's path.
    Non-arrays and scalars get ``PartitionSpec()``; so do arrays with fewer than ``min_size``
    elements. A spec longer than the array's rank is cut to the rank (one rule may serve
    kernels and their biases); when the entries cut name mesh axes, or a spec names one mesh
    axis in two dimensions, those axes are dropped with a
    :class:`~flax_escale.ShardingCorrectionWarning` naming the path (the one policy of
    :func:`~flax_escale.resolve.enforce`; make it an error with ``warnings`` filters).
    Leaves may be arrays,
    ``jax.ShapeDtypeStruct`` (so the result can be the ``out_shardings`` of a sharded init), or
    Flax boxes, which are replaced by their spec.

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order.
        tree: Any pytree: dicts, lists, ``nnx.State``, Linen variables (boxed or not).
        min_size: Arrays with fewer elements stay unsharded; ``None`` means
            ``DEFAULT_MIN_SIZE`` (16384), as in eformer.
        strict: Raise if an array matches no rule; otherwise it is replicated, with a
            :class:`~flax_escale.ShardingCorrectionWarning` listing every such path.

    Returns:
        A tree of ``PartitionSpec`` shaped like ``tree``.

    Raises:
        PartitionRuleError: With ``strict``, for an array no rule matches (naming its path and
            shape); for a regex that does not compile.
        EscaleTypeError: If ``min_size`` is not a number or ``None``; if ``rules`` is not a
            sequence of ``(regex, spec)`` pairs (a string, a dict, a bare pair, an entry of
            another length, a regex that is not a string); if ``tree`` holds no array.

    Example:
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale.sharding import specs_from_regex
        >>> rules = [("embedding", PartitionSpec("tp", "fsdp")),
        ...          ("kernel$", PartitionSpec("fsdp", "tp")),
        ...          (".*", PartitionSpec())]
        >>> tree = {"embed": {"embedding": np.zeros((64, 8))},
        ...         "wi": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}}
        >>> specs = specs_from_regex(rules, tree)
        >>> specs["embed"]["embedding"], specs["wi"]["kernel"], specs["wi"]["bias"]
        (P('tp', 'fsdp'), P('fsdp', 'tp'), P())
    """
    min_size = checked_min_size(min_size, "specs_from_regex: min_size")
    rules = check.pairs(
        rules, "rules", "(regex, PartitionSpec)", "[('kernel$', PartitionSpec('fsdp', 'tp'))]"
    )
    check.tree_of_arrays(tree, "tree")
    strict = check.flag(strict, "strict")
    compiled = compile_rules(tuple((pat, as_rule_spec(spec, pat)) for pat, spec in rules))
    flat, treedef = flatten_with_paths(tree)
    _refuse_ambiguous_paths([path for path, _, _ in flat])
    unmatched = []
    specs = []
    for path, value, _ in flat:
        found = _spec_for(path, value, compiled, min_size)
        if found is None:
            unmatched.append(f"{path!r} {tuple(value.shape)}")
            specs.append(PartitionSpec())
            continue
        if not found.ok:
            enforce(found, strict=False, path=path)
        specs.append(found.spec)
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


def _refuse_ambiguous_paths(paths: list[str]) -> None:
    # A key holding "/" reads like nesting: {"a/b": x, "a": {"b": y}} gives two leaves one
    # path, which no rule can tell apart.
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise PartitionRuleError(
                f"tree: two arrays have the path {path!r} (a key holding '/' reads like "
                "nesting), so no rule can tell them apart; rename the key that holds '/'."
            )
        seen.add(path)


_REPLICATED = Resolution(None, PartitionSpec(), None, None, PartitionSpec())


def checked_min_size(min_size: Any, argument: str) -> float:
    """``min_size`` as a number of elements (``None``: :data:`DEFAULT_MIN_SIZE`).

    Raises:
        EscaleTypeError: If it is neither a number nor ``None``.
        EscaleError: If it is negative, infinite or NaN.
    """
    if min_size is None:
        return DEFAULT_MIN_SIZE
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Real):
        raise EscaleTypeError(
            f"{argument} must be a number of elements or None (the default minimum, "
            f"{DEFAULT_MIN_SIZE}), got {type(min_size).__name__} {min_size!r}."
        )
    return check.non_negative_number(min_size, argument)


def _spec_for(path: str, value: Any, compiled: tuple, min_size: int) -> Resolution | None:
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or int(np.prod(shape)) < min_size:
        return _REPLICATED
    for _, pattern, spec in compiled:
        if pattern.search(path):
            return fitted_spec(spec, tuple(shape))
    return None


@functools.lru_cache(maxsize=4096)
def fitted_spec(spec: PartitionSpec, shape: tuple[int, ...]) -> Resolution:
    """A rule's spec cut to the rank of ``shape`` (never padded), with every axis it loses."""
    fitted, corrections = fit_spec(spec, shape, None)
    cut = PartitionSpec(*tuple(fitted)[: len(spec)])
    return Resolution(None, cut, shape, None, spec, corrections)


def as_rule_spec(spec: Any, pattern: str | None = None, argument: str = "rules") -> PartitionSpec:
    """A rule's spec as a ``PartitionSpec`` (a tuple or ``None`` is made one), checked."""
    if isinstance(spec, (tuple, list)):
        spec = PartitionSpec(*spec)
    elif spec is None:
        spec = PartitionSpec()
    elif not isinstance(spec, PartitionSpec):
        where = argument if pattern is None else f"{argument}: the rule for {pattern!r}"
        example = f"PartitionSpec({spec!r})" if isinstance(spec, str) else "PartitionSpec('tp')"
        raise PartitionRuleError(
            f"{where}: {describe(spec)} is not a PartitionSpec; pass e.g. {example}."
        )
    if pattern is not None:
        check_rule_spec(spec, f"rules: the rule for {pattern!r}", None)
    return spec


@functools.lru_cache(maxsize=256)
def compile_rules(rules: tuple[tuple[str, PartitionSpec], ...]) -> tuple:
    """``(pattern, compiled regex, spec)`` for every rule, in order."""
    compiled = []
    for pattern, spec in rules:
        try:
            compiled.append((pattern, UserPattern(pattern, "rules"), spec))
        except re.error as error:
            raise PartitionRuleError(
                f"rules: {pattern!r} is not a valid regex: {error}; fix the regex, or pass "
                f"re.escape({pattern!r}) to match the text literally."
            ) from None
    return tuple(compiled)


def check_rule_spec(spec: PartitionSpec, where: str, mesh_shape: dict[str, int] | None) -> None:
    """Refuses a rule's spec that cannot apply to any array (or on the mesh, when known)."""
    _, corrections = fit_spec(spec, None, mesh_shape)
    if not corrections:
        return
    problem = corrections[0]
    if problem.kind == "not_in_mesh":
        fix = f"Use the axes of the mesh {mesh_shape}, or build the mesh with this axis."
    else:
        fix = "Name each mesh axis at most once in a spec."
    raise PartitionRuleError(
        f"{where} gives {spec}, which cannot apply: in dimension {problem.dim}, "
        f"{problem.detail}. {fix}"
    )
