"""eformer's compact rule strings: ``"attention|mlp->fsdp.tp,embed->tp"`` to a spec function.

The rules are the core's regex rules (:func:`~flax_escale.sharding.specs_from_regex`), checked
and cut to each array's rank the same way; only the string syntax is eformer's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._regex import UserPattern
from flax_escale.errors import EscaleError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import enforce
from flax_escale.sharding._regex_rules import (
    PartitionRuleError,
    as_rule_spec,
    check_rule_spec,
    fitted_spec,
)

__all__ = ["create_pattern_based_partition_spec"]

# The string is cut at every ',' and '|' before any regex is read, so a regex holding one of
# them arrives in pieces: the errors such pieces cause say so, and how to write it instead.
_GRAMMAR = (
    "In a pattern string ',' separates rules and '|' separates the regexes of one rule, so no "
    "regex can contain either: write alternatives as separate regexes ('attn/kernel|mlp/kernel"
    "->tp' rather than '(attn|mlp)/kernel->tp'), and spell out a {m,n} repeat (r'\\d\\d?' "
    "rather than r'\\d{1,2}'); or pass the rules as (regex, PartitionSpec) pairs to "
    "flax_escale.eformer.match_partition_rules, where any regex is allowed."
)


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
    ``mlp`` to ``P('fsdp', 'tp')`` and those containing ``embed`` to ``P('tp')``. The string is
    cut at every ``,`` and ``|`` before any regex is read, so a regex cannot contain either:
    write alternatives as separate regexes, and use no ``{m,n}`` repeat. The first rule
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
        PartitionRuleError: For a rule without exactly one ``->``, an empty or invalid regex
            (such as a piece of one cut at a ``,`` or ``|``), a spec that names one mesh axis
            twice, or an axis the mesh lacks (naming ``pattern`` and the rule).
        EscaleTypeError: If ``pattern`` is not a string, ``mesh`` not a mesh or ``strict``
            not a bool.

    Example:
        >>> import numpy as np
        >>> from flax_escale.eformer import create_pattern_based_partition_spec
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
    default = as_rule_spec(default_spec, argument="default_spec")
    if mesh is None:
        try:
            mesh = current_mesh()
        except EscaleError:
            mesh = None
    mesh_shape = None if mesh is None else dict(mesh.shape)
    check_rule_spec(default, f"pattern {pattern!r}: default_spec", mesh_shape)
    compiled = []
    for rule in (r.strip() for r in pattern.split(",") if r.strip()):
        if rule.count("->") != 1:
            raise PartitionRuleError(
                f"pattern {pattern!r}: the rule {rule!r} (as cut at the ',' separators) must be "
                f"'regex|regex->axis.axis', with one '->'. {_GRAMMAR}"
            )
        regexes, spec_text = (part.strip() for part in rule.split("->"))
        texts = [e.strip() for e in spec_text.split(".")]
        if "" in texts:
            raise PartitionRuleError(
                f"pattern {pattern!r}: rule {rule!r} has an empty mesh axis name in "
                f"{spec_text!r}; write None for a dimension left unsharded (such as "
                "'mlp->fsdp.None.tp')."
            )
        entries = [None if e == "None" else e for e in texts]
        spec = PartitionSpec(*entries)
        check_rule_spec(spec, f"pattern {pattern!r}: rule {rule!r}", mesh_shape)
        for regex in (r.strip() for r in regexes.split("|")):
            if not regex:
                raise PartitionRuleError(f"pattern {pattern!r}: rule {rule!r} has an empty regex.")
            try:
                found = UserPattern(regex, f"pattern {pattern!r}: rule {rule!r}")
            except re.error as error:
                raise PartitionRuleError(
                    f"pattern {pattern!r}: in the rule {rule!r}, {regex!r} is not a valid regex "
                    f"({error}). {_GRAMMAR}"
                ) from None
            compiled.append((regex, found, spec))

    def spec_of(path: str, array: Any) -> PartitionSpec:
        chosen = next((spec for _, found, spec in compiled if found.search(path)), default)
        shape = getattr(array, "shape", None)
        if shape is None:
            return chosen
        if len(shape) == 0:
            return PartitionSpec()
        resolution = fitted_spec(chosen, tuple(shape))
        if not resolution.ok:
            enforce(resolution, strict=strict, path=path)
        return resolution.spec

    return spec_of
