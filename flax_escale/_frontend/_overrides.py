"""Overrides: logical axes given at ``init_sharded`` for variables the model annotates itself.

A model one did not write carries annotations in its own files; ``overrides=`` corrects them
without editing those files. Its patterns match whole trailing components of a variable's path
in the plan (``"Dense_0/kernel"``, ``"blocks/0/.*/kernel"``), and win over every annotation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flax_escale._frontend._patterns import AxesPatterns
from flax_escale.plan import AnnotatedLeaf, Annotation

__all__ = ["Overrides", "apply_overrides"]

Overrides = Mapping[str, Sequence[str | None]]
"""``{path pattern: logical axes}``, one logical name (or ``None``) per dimension."""

_STACK_HINT = "a layer stack's arrays have the stacked dimension too: name it, e.g. 'layers'"


def apply_overrides(
    items: Sequence[AnnotatedLeaf], overrides: AxesPatterns | None
) -> tuple[list[AnnotatedLeaf], list[str]]:
    """``items`` with the annotation of every variable an override matches replaced.

    Args:
        items: ``(path, abstract array, annotation)`` per variable, as the plan takes them.
        overrides: ``{path pattern: logical axes}`` compiled (as
            :meth:`~flax_escale._frontend.InitOptions.create` compiles them), or ``None``.

    Returns:
        The items, and a note for every pattern that matched no variable.

    Raises:
        EscaleError: If a matched variable has another rank than its override names.
    """
    if overrides is None:
        return list(items), []
    patterns = overrides
    used: set[str] = set()
    replaced = []
    for path, leaf, annotation in items:
        found = None
        # Optimizer state follows its parameter, overridden or not.
        if annotation is None or annotation.follows is None:
            found = patterns.match_array(path, leaf.shape, shown_path=path, stack_hint=_STACK_HINT)
        if found is not None:
            used.add(found[0])
            source = f"overrides[{found[0]!r}]"
            if annotation is not None:
                source += f" (replacing {annotation.axes} from {annotation.source})"
            annotation = Annotation(logical_axes=found[1], source=source)
        replaced.append(AnnotatedLeaf(path, leaf, annotation))
    paths = ", ".join(path for path, _, _ in items[:6]) + (", ..." if len(items) > 6 else "")
    notes = [
        f"overrides: pattern {pattern!r} matched no variable (the variables' paths are like "
        f"{paths}). Fix the pattern or remove it."
        for pattern in patterns.patterns
        if pattern not in used
    ]
    return replaced, notes
