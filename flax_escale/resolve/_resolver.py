"""The resolver: one set of frozen rules on one mesh shape, each distinct question once.

Rules apply with the priority semantics of ``flax.linen.logical_to_mesh_axes``: in order, a rule
fills a dimension that is still free, and only with mesh axes the array does not use yet; names
without a rule stay unsharded. With a shape and a mesh, a rule whose mesh axes do not divide the
dimension is passed over, so a later rule for the same name can apply, and so is a rule whose axes
all have size 1 when such a later rule exists (it would split nothing); what still does not fit
is corrected by :func:`~flax_escale.resolve.fit_spec` and recorded.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec

from flax_escale._dataclasses import replace_checked
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.resolve._fit import Correction, fit_spec
from flax_escale.resolve._resolution import PassedOver, Resolution

__all__ = ["Resolver", "RuleStep", "resolver"]

_FREE = object()


@functools.lru_cache(maxsize=64)
def resolver(rules: LogicalRules, mesh_shape: tuple[tuple[str, int], ...] | None) -> Resolver:
    """The :class:`Resolver` for frozen ``rules`` on a mesh of ``mesh_shape`` (kept, per pair)."""
    return Resolver(rules, mesh_shape)


class Resolver:
    """Resolution with one set of frozen rules on one mesh shape, doing repeated work once.

    The rules are read once, into each logical name's rules in priority order with their mesh
    axes' total size on the mesh. Per distinct logical axes, the rules that can apply are merged
    once (Flax's priority order, restricted to the names present); per distinct ``(logical axes,
    shape)``, the :class:`Resolution` is kept (up to :attr:`MEMO_SIZE` of them). What the rules
    give depends on the shape only through its rank and which of the dimensions the candidate
    rules' mesh axes divide: a shape that divides like one resolved before without anything
    passed over or corrected resolves like it, and only its shape is new. Callers that resolve
    many arrays fetch the resolver once (:func:`resolver`) and call :meth:`resolve` per array,
    with names they have checked.
    """

    MEMO_SIZE = 1 << 16
    __slots__ = (
        "_by_name",
        "_candidates",
        "_known",
        "_like",
        "_memo",
        "_mesh",
        "_mesh_shape",
        "_rules",
        "_specs",
    )

    def __init__(self, rules: LogicalRules, mesh_shape: tuple[tuple[str, int], ...] | None) -> None:
        self._rules = rules
        self._mesh_shape = mesh_shape
        mesh = self._mesh = None if mesh_shape is None else dict(mesh_shape)
        self._known = frozenset(name for name, _ in rules)
        self._memo: dict[tuple[Any, Any], Resolution | str] = {}
        self._candidates: dict[tuple[Any, ...], _Candidates | str] = {}
        self._like: dict[tuple[Any, ...], Resolution] = {}
        self._specs: dict[tuple[Any, ...], PartitionSpec] = {}
        # Per logical name, its rules in order: (index, target, mesh axes, their total size on
        # the mesh or None (no mesh, or an axis it lacks: left to fit_spec), whether fit_spec
        # keeps the target as it is, whether it is trivial (total size 1) with a later rule for
        # the same name to leave the dimension to).
        by_name: dict[str, list[list[Any]]] = {}
        for index, (name, target) in enumerate(rules):
            axes = mesh_axes_of(target)
            size = None
            if mesh is not None and all(a in mesh for a in axes):
                size = math.prod(mesh[a] for a in axes)
            valid = size is not None and len(set(axes)) == len(axes)
            by_name.setdefault(name, []).append([index, target, axes, size, valid, False])
        for found in by_name.values():
            for rule in found[:-1]:
                rule[5] = rule[3] == 1 and bool(rule[2])
        self._by_name = {name: [tuple(r) for r in found] for name, found in by_name.items()}

    def resolve(
        self, names: tuple[Any, ...] | None, shape: tuple[int, ...] | None
    ) -> Resolution | str:
        """The :class:`Resolution` of checked ``names`` for ``shape``, or an error message."""
        key = (names, shape)
        found = self._memo.get(key)
        if found is None:
            found = self._resolve_like(names, shape)
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = found
        return found

    def trace(self, names: tuple[Any, ...], shape: tuple[int, ...] | None) -> tuple[RuleStep, ...]:
        """What each rule that could apply did to checked ``names`` of ``shape``, in order.

        The same placement :meth:`resolve` makes, recorded step by step (for explanations):
        call it for names that resolve (:meth:`resolve` gives no message for them).
        """
        matched = self._candidates_of(names)
        if isinstance(matched, str):
            return ()
        padded = (*names, *(None,) * max(0, len(shape or ()) - len(names)))
        steps: list[RuleStep] = []
        _place(matched, padded, shape, steps)
        return tuple(steps)

    def _resolve_like(
        self, names: tuple[Any, ...] | None, shape: tuple[int, ...] | None
    ) -> Resolution | str:
        # A resolution made for a shape that divides alike, with nothing passed over or
        # corrected (so no size in it), holds for this shape too.
        matched = None if names is None or shape is None else self._candidates_of(names)
        if not isinstance(matched, _Candidates) or matched.through or len(shape) < len(names):
            return self._resolve(names, shape)
        key = (names, len(shape), *[shape[dim] % size == 0 for dim, size in matched.checks])
        like = self._like.get(key)
        if like is None:
            found = self._resolve(names, shape)
            if isinstance(found, Resolution) and not found.corrections and not found.passed_over:
                if len(self._like) >= self.MEMO_SIZE:
                    self._like.clear()
                self._like[key] = found
            return found
        return replace_checked(like, shape=shape)

    def _spec(self, entries: tuple[Any, ...]) -> PartitionSpec:
        spec = self._specs.get(entries)
        if spec is None:
            spec = self._specs[entries] = PartitionSpec(*entries)
        return spec

    def _candidates_of(self, names: tuple[Any, ...]) -> _Candidates | str:
        found = self._candidates.get(names)
        if found is None:
            found = self._candidates[names] = self._find_candidates(names)
        return found

    def _find_candidates(self, names: tuple[Any, ...]) -> _Candidates | str:
        named = [n for n in names if isinstance(n, str)]
        if len(set(named)) != len(named):
            repeated = sorted({n for n in named if named.count(n) > 1})
            return (
                f"logical axes {names}: {repeated[0]!r} names more than one dimension; each "
                "logical name can shard at most one dimension of an array. Give the dimensions "
                "distinct names."
            )
        # Flax's priority semantics take the rules in order, each filling a dimension still
        # free: only the rules of the names present can, merged back into rule order.
        candidates = sorted(
            (rule, dim)
            for dim, name in enumerate(names)
            if isinstance(name, str)
            for rule in self._by_name.get(name, ())
        )
        # The divisions the answer depends on (by axes of size 1, always exact, it does not).
        checks = tuple(
            dict.fromkeys((dim, rule[3]) for rule, dim in candidates if (rule[3] or 1) > 1)
        )
        # With no rules at all (an explicitly empty rules context) nothing is meant to be
        # sharded.
        unknown = tuple(n for n in named if n not in self._known) if self._rules else ()
        # Entries that are neither names nor unsharded pass through for fit_spec to check.
        through = any(
            not (n is None or n is PartitionSpec.UNCONSTRAINED or isinstance(n, str)) for n in names
        )
        return _Candidates(tuple(candidates), checks, unknown, through)

    def _resolve(
        self, names: tuple[Any, ...] | None, shape: tuple[int, ...] | None
    ) -> Resolution | str:
        mesh_shape = self._mesh_shape
        if names is None:
            rank = 0 if shape is None else len(shape)
            spec = self._spec((None,) * rank)
            return Resolution(None, spec, shape, mesh_shape, spec)
        matched = self._candidates_of(names)
        if isinstance(matched, str):
            return matched
        if shape is not None and len(shape) < len(names):
            return (
                f"logical axes {names} name {len(names)} dimensions but the shape {shape} has "
                f"{len(shape)}: give one logical name (or None) per dimension."
            )
        # Fewer names than dimensions is Flax's own short form (DenseGeneral calls its
        # initializer on the flattened shape, so its annotation names two of the kernel's three
        # dimensions): as in Flax, the dimensions left unnamed are unsharded.
        padded = 0 if shape is None else len(shape) - len(names)
        if padded:
            names = (*names, *(None,) * padded)
        result, passed, fit = _place(matched, names, shape)
        rules_spec = self._spec(tuple(None if r is _FREE else r for r in result))
        spec, corrections = rules_spec, ()
        mesh = self._mesh
        if mesh is not None:
            if fit:
                spec, corrections = fit_spec(rules_spec, shape, mesh)
            if passed:
                corrections = _unplaced(result, passed, mesh) + corrections
        return Resolution(
            names,
            spec,
            shape,
            mesh_shape,
            rules_spec,
            corrections,
            tuple(passed),
            matched.unknown,
            padded,
        )


class _Candidates(NamedTuple):
    # The rules that can apply to one set of logical axes, and what their answer depends on,
    # whatever the shape.
    rules: tuple[tuple[tuple[Any, ...], int], ...]  # (rule, dim) in rule order
    checks: tuple[tuple[int, int], ...]  # (dim, size): the divisions the answer depends on
    unknown: tuple[str, ...]  # names without a rule
    through: bool  # entries that pass through unresolved, for fit_spec


def _unplaced(
    result: list[Any], passed: list[PassedOver], mesh: dict[str, int]
) -> tuple[Correction, ...]:
    # A dimension whose every rule was passed over stays whole although the rules meant to
    # split it: that is a correction like any other (strict raises, otherwise it warns).
    found: dict[int, list[PassedOver]] = {}
    for p in passed:
        if result[p.dim] is _FREE and math.prod(mesh[a] for a in p.mesh_axes) > 1:
            found.setdefault(p.dim, []).append(p)
    return tuple(
        Correction(
            "not_divisible",
            dim,
            group[0].mesh_axes,
            group[0].size,
            f"size {group[0].size} is not divisible by the mesh axes of any of its rules ("
            + ", ".join(
                f"{p.mesh_axes} of size {math.prod(mesh[a] for a in p.mesh_axes)}" for p in group
            )
            + ")",
        )
        for dim, group in sorted(found.items())
    )


class RuleStep(NamedTuple):
    """What one rule did to one dimension while an array's logical axes were resolved.

    Attributes:
        rule: The rule's index in the rules it was taken from.
        dim: The dimension its logical name names.
        outcome: ``"applied"``, ``"filled"`` (an earlier rule already set the dimension),
            ``"used"`` (one of its mesh axes already splits another dimension),
            ``"indivisible"`` (its mesh axes do not divide the size: passed over),
            ``"trivial"`` (its mesh axes have size 1 and a later rule for the name exists) or
            ``"absent"`` (applied, but names an axis the mesh lacks: the spec drops it).
        by: For ``"filled"`` and ``"used"``: the dimension that took the place or axes.
    """

    rule: int
    dim: int
    outcome: str
    by: int | None = None


def _place(
    matched: _Candidates,
    names: tuple[Any, ...],
    shape: tuple[int, ...] | None,
    steps: list[RuleStep] | None = None,
) -> tuple[list[Any], list[PassedOver], bool]:
    # Flax's priority semantics: the rules in order, each filling a dimension still free with
    # mesh axes no dimension uses yet. Returns each dimension's entry (_FREE where no rule
    # applied), the rules passed over, and whether fit_spec must run; `steps`, when given,
    # records what each candidate rule did (for explanations; resolving records nothing).
    result: list[Any] = [_FREE if isinstance(n, str) else n for n in names]
    used: dict[str, int] = {}
    passed: list[PassedOver] = []
    # fit_spec keeps what the rules give when every target they place is valid on the mesh
    # and no entry passes through: it need not run then.
    fit = matched.through
    for (index, target, axes, size, valid, trivial), dim in matched.rules:
        if result[dim] is not _FREE or not used.keys().isdisjoint(axes):
            if steps is not None:
                if result[dim] is not _FREE:
                    steps.append(RuleStep(index, dim, "filled"))
                else:
                    taken = next(used[a] for a in axes if a in used)
                    steps.append(RuleStep(index, dim, "used", taken))
            continue
        if size is not None and shape is not None and shape[dim] % size:
            passed.append(PassedOver(dim, names[dim], axes, shape[dim]))
            if steps is not None:
                steps.append(RuleStep(index, dim, "indivisible"))
            continue
        if trivial:
            # Axes of total size 1 split nothing: leave the dimension to a later rule.
            if steps is not None:
                steps.append(RuleStep(index, dim, "trivial"))
            continue
        result[dim] = target
        used.update((a, dim) for a in axes)
        fit = fit or not valid
        if steps is not None:
            steps.append(RuleStep(index, dim, "applied" if size is not None else "absent"))
    return result, passed, fit
