"""Regex partition rules: a ``PartitionSpec`` for every array, chosen by its path.

Paths are the ``/``-joined keys from the root of the tree (dict keys, attribute names, list
indices), with Flax boxes treated as leaves (see :mod:`flax_escale.sharding._paths`), so a Linen
boxed parameter, an NNX ``State`` entry and a plain array at the same place all have the path
``params/mlp/wi/kernel`` and a rule ``kernel$`` matches each of them.
"""

from __future__ import annotations

import functools
import numbers
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flax_escale.errors import EscaleError, EscaleTypeError, ShardingCorrectionWarning
from flax_escale.mesh import _validate as check
from flax_escale.mesh import get_incontext_mesh
from flax_escale.mesh._validate import describe
from flax_escale.resolve import Resolution, enforce, fit_spec
from flax_escale.sharding._paths import flatten_with_paths

__all__ = [
    "DEFAULT_MIN_SIZE",
    "PartitionRuleError",
    "create_pattern_based_partition_spec",
    "match_partition_rules",
]

Rules = Sequence[tuple[str, PartitionSpec]]

DEFAULT_MIN_SIZE = 16384
"""The minimum array size ``min_size=None`` stands for (eformer's default minimum)."""


class PartitionRuleError(EscaleError):
    """No partition rule matches an array (or a rule or pattern is malformed)."""


def match_partition_rules(
    rules: Rules, tree: Any, min_size: int | None = 0, strict: bool = True
) -> Any:
    """A ``PartitionSpec`` for every array of ``tree``, from the first rule whose regex matches.

    Each rule is ``(regex, spec)``; the regex is searched (``re.search``) in the array's path.
    Non-arrays and scalars get ``PartitionSpec()``; so do arrays with fewer than ``min_size``
    elements. A spec longer than the array's rank is cut to the rank (one rule may serve
    kernels and their biases); when the entries cut name mesh axes, or a spec names one mesh
    axis in two dimensions, those axes are dropped with a
    :class:`~flax_escale.ShardingCorrectionWarning` naming the path (the one policy of
    :func:`~flax_escale.resolve._logical.enforce`; make it an error with ``warnings`` filters).
    Leaves may be arrays,
    ``jax.ShapeDtypeStruct`` (so the result can be the ``out_shardings`` of a sharded init), or
    Flax boxes, which are replaced by their spec.

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order.
        tree: Any pytree: dicts, lists, ``nnx.State``, Linen variables (boxed or not).
        min_size: Arrays with fewer elements stay unsharded; ``None`` means
            :data:`DEFAULT_MIN_SIZE` (16384), as in eformer.
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
        >>> from flax_escale.sharding import match_partition_rules
        >>> rules = [("embedding", PartitionSpec("tp", "fsdp")),
        ...          ("kernel$", PartitionSpec("fsdp", "tp")),
        ...          (".*", PartitionSpec())]
        >>> tree = {"embed": {"embedding": np.zeros((64, 8))},
        ...         "wi": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}}
        >>> specs = match_partition_rules(rules, tree)
        >>> specs["embed"]["embedding"], specs["wi"]["kernel"], specs["wi"]["bias"]
        (P('tp', 'fsdp'), P('fsdp', 'tp'), P())
    """
    if min_size is None:
        min_size = DEFAULT_MIN_SIZE
    elif isinstance(min_size, bool) or not isinstance(min_size, numbers.Real):
        raise EscaleTypeError(
            f"match_partition_rules: min_size must be a number of elements or None "
            f"(the default minimum, {DEFAULT_MIN_SIZE}), got {type(min_size).__name__} "
            f"{min_size!r}."
        )
    rules = check.pairs(
        rules, "rules", "(regex, PartitionSpec)", "[('kernel$', PartitionSpec('fsdp', 'tp'))]"
    )
    check.tree_of_arrays(tree, "tree")
    strict = check.flag(strict, "strict")
    compiled = _compile(tuple((pattern, _as_spec(spec, pattern)) for pattern, spec in rules))
    flat, treedef = flatten_with_paths(tree)
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


_REPLICATED = Resolution(None, PartitionSpec(), None, None, PartitionSpec())


def _spec_for(path: str, value: Any, compiled: tuple, min_size: int) -> Resolution | None:
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or int(np.prod(shape)) < min_size:
        return _REPLICATED
    for _, regex, spec in compiled:
        if regex.search(path):
            return _fitted(spec, tuple(shape))
    return None


@functools.lru_cache(maxsize=4096)
def _fitted(spec: PartitionSpec, shape: tuple[int, ...]) -> Resolution:
    # The spec cut to the rank (never padded: P() stays P()), with every mesh axis it loses.
    fitted, corrections = fit_spec(spec, shape, None)
    cut = PartitionSpec(*tuple(fitted)[: len(spec)])
    return Resolution(None, cut, shape, None, spec, corrections)


def _as_spec(spec: Any, pattern: str | None = None, argument: str = "rules") -> PartitionSpec:
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
        _check_spec(spec, f"rules: the rule for {pattern!r}", None)
    return spec


@functools.lru_cache(maxsize=256)
def _compile(rules: tuple[tuple[str, PartitionSpec], ...]) -> tuple:
    compiled = []
    for pattern, spec in rules:
        try:
            compiled.append((pattern, re.compile(pattern), spec))
        except re.error as error:
            raise PartitionRuleError(
                f"rules: {pattern!r} is not a valid regex: {error}; fix the regex, or pass "
                f"re.escape({pattern!r}) to match the text literally."
            ) from None
    return tuple(compiled)


def create_pattern_based_partition_spec(
    pattern: str,
    mesh: Mesh | None = None,
    default_spec: PartitionSpec | None = None,
    *,
    strict: bool = False,
) -> Callable[[str, Any], PartitionSpec]:
    """A function ``(path, array) -> PartitionSpec`` from a compact rule string.

    The string is rules separated by ``,``; a rule is ``regexes->spec``, several regexes joined
    by ``|`` sharing one spec, and the spec's entries joined by ``.`` (``None`` for an unsharded
    dimension). ``"attention|mlp->fsdp.tp,embed->tp"`` sends paths containing ``attention`` or
    ``mlp`` to ``P('fsdp', 'tp')`` and those containing ``embed`` to ``P('tp')``. The first rule
    whose regex is found in the path wins; otherwise ``default_spec`` (replicated). Scalars
    get ``P()``. A spec longer than the array's rank is cut to it when the entries cut name
    no mesh axis; cutting mesh axes is a correction (a
    :class:`~flax_escale.ShardingCorrectionWarning`, or an error with ``strict``).

    Args:
        pattern: The rule string.
        mesh: If given (or set as the current mesh), every axis is checked against it.
        default_spec: The spec when no rule matches.
        strict: Make the returned function raise, rather than warn, when a spec names mesh
            axes past the rank of the array it is asked about.

    Returns:
        The function.

    Raises:
        PartitionRuleError: For a rule without ``->``, an empty regex, a spec that names one
            mesh axis twice, or an axis the mesh lacks (naming the rule).
        EscaleTypeError: If ``pattern`` is not a string, ``mesh`` not a mesh or ``strict``
            not a bool.

    Example:
        >>> import numpy as np
        >>> from flax_escale.sharding import create_pattern_based_partition_spec
        >>> spec_of = create_pattern_based_partition_spec("attention|mlp->fsdp.tp,embed->tp.None")
        >>> spec_of("layer_0/mlp/kernel", np.zeros((4, 4)))
        P('fsdp', 'tp')
        >>> spec_of("embed/table", np.zeros((8, 2)))
        P('tp', None)
        >>> spec_of("embed/bias", np.zeros(2))  # the None past the rank is simply cut
        P('tp',)
        >>> spec_of("norm/scale", np.zeros(4))
        P()
    """
    pattern = check.string(pattern, "pattern", "'attention|mlp->fsdp.tp,embed->tp'")
    mesh = check.optional_mesh(mesh)
    strict = check.flag(strict, "strict")
    default = _as_spec(default_spec, argument="default_spec")
    if mesh is None:
        try:
            mesh = get_incontext_mesh()
        except EscaleError:
            mesh = None
    mesh_shape = None if mesh is None else dict(mesh.shape)
    _check_spec(default, f"pattern {pattern!r}: default_spec", mesh_shape)
    rules = []
    for rule in (r.strip() for r in pattern.split(",") if r.strip()):
        if rule.count("->") != 1:
            raise PartitionRuleError(
                f"pattern {pattern!r}: rule {rule!r} must be 'regex|regex->axis.axis'."
            )
        regexes, spec_text = (part.strip() for part in rule.split("->"))
        entries = [None if e.strip() in ("None", "") else e.strip() for e in spec_text.split(".")]
        spec = PartitionSpec(*entries)
        _check_spec(spec, f"pattern {pattern!r}: rule {rule!r}", mesh_shape)
        for regex in regexes.split("|"):
            if not regex.strip():
                raise PartitionRuleError(f"pattern {pattern!r}: rule {rule!r} has an empty regex.")
            rules.append((regex.strip(), spec))
    compiled = _compile(tuple(rules))

    def spec_of(path: str, array: Any) -> PartitionSpec:
        chosen = next((spec for _, regex, spec in compiled if regex.search(path)), default)
        shape = getattr(array, "shape", None)
        if shape is None:
            return chosen
        if len(shape) == 0:
            return PartitionSpec()
        resolution = _fitted(chosen, tuple(shape))
        if not resolution.ok:
            enforce(resolution, strict=strict, path=path)
        return resolution.spec

    return spec_of


def _check_spec(spec: PartitionSpec, where: str, mesh_shape: dict[str, int] | None) -> None:
    # A rule's spec must be valid on its own (and on the mesh, when known): no shape needed.
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
