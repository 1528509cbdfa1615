"""Resolving every array of a plan: each distinct annotation and shape once.

The one resolution of a variables tree's arrays, which :func:`~flax_escale.plan.build_plan`
records in a plan and ``logical_to_mesh_sharding`` turns into shardings directly: logical
annotations resolve through the resolver of their rules (which keeps what it resolved), mesh
axes are fitted, optimizer state follows the spec its parameter resolved to, and mesh axes the
rules leave idle are put to use on large parameters. Arrays annotated and shaped alike share
their resolution, so the work is done once per distinct pair, not once per array.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale._checks import describe
from flax_escale._dataclasses import replace_checked
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import (
    EscaleError,
    EscaleTypeError,
    ShardingCorrectionWarning,
    ShardingResolutionError,
)
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._leaves import AnnotatedLeaf
from flax_escale.resolve import Resolution, complete_spec, enforce, fit_mesh_axes
from flax_escale.resolve._resolution import at_path
from flax_escale.resolve._resolver import Resolver, resolver

__all__ = [
    "IDLE_AXES_MIN_BYTES",
    "STACKED_NAMES",
    "USE_IDLE_AXES",
    "ResolveOptions",
    "array_dtype",
    "array_shape",
    "resolve_items",
    "sharding_tree",
]

USE_IDLE_AXES = True
"""The one default of every ``use_idle_axes`` option: parameters reach their ideal share."""
IDLE_AXES_MIN_BYTES = 1 << 20
"""Variables smaller than this keep the rules' spec: splitting them saves little and costs
collectives."""
STACKED_NAMES = frozenset({"layers", "stack"})
"""Logical names of a layer stack's dimension (``nn.scan``'s ``PARTITION_NAME``, t5x's
``stack``), which completion never splits."""


class ResolveOptions(NamedTuple):
    """How a plan's arrays are resolved, every value already checked.

    Attributes:
        rules: The plan's rules, frozen.
        strict: Raise at the first correction, unknown logical name or note.
        notes: Problems that concern no single array.
        use_idle_axes: Complete large parameters (see :func:`~flax_escale.plan.build_plan`).
    """

    rules: LogicalRules
    strict: bool
    notes: tuple[str, ...]
    use_idle_axes: bool


def resolve_items(
    items: Sequence[AnnotatedLeaf], mesh: Mesh, options: ResolveOptions, *, stacklevel: int = 2
) -> list[Resolution]:
    """The resolution of every item, as a plan records it, without the plan.

    What a plan's entries hold, warned about or raised the same way, for callers that want
    only the specs or shardings (``logical_to_mesh_sharding``). Arrays that share an
    annotation (the same :class:`Annotation` object, as
    :func:`~flax_escale.plan.annotated_leaves` gives alike annotated leaves) and a shape
    share one :class:`Resolution`: each distinct pair is resolved (the resolver keeps what it
    resolved), and completed, once.

    Args:
        items: One :class:`~flax_escale.plan.AnnotatedLeaf` per leaf (an array or abstract
            array), in flattening order.
        mesh: The mesh.
        options: The rules, strict mode, notes and whether idle axes are put to use.
        stacklevel: Of the warning, counted from the caller of this function.

    Returns:
        One resolution per item.
    """
    frozen, strict, notes, use_idle_axes = options
    shapes = [_shape_at(path, leaf) for path, leaf, _ in items]
    resolve = _Resolving(mesh, frozen, strict)
    resolutions: list[Resolution | None] = []
    following = []
    # Parameters first: optimizer state that follows one takes the spec it resolved to.
    for i, ((path, _, annotation), shape) in enumerate(zip(items, shapes, strict=True)):
        if annotation is not None and annotation.follows is not None:
            following.append(i)
            resolutions.append(None)
        else:
            resolutions.append(resolve(path, shape, annotation))
    if use_idle_axes:
        _complete(resolutions, items, mesh, frozen)
    if following:
        resolved = {items[i][0]: r for i, r in enumerate(resolutions) if r is not None}
        for i in following:
            path, _, annotation = items[i]
            param_path, kept = annotation.follows
            param = resolved.get(param_path)
            if param is None:
                resolution = resolve(path, shapes[i], annotation)
            else:
                resolution = resolve.following(path, shapes[i], param, kept)
            resolutions[i] = resolved[path] = resolution
    if strict and notes:
        raise EscaleError("\n".join(notes) + "\n(strict=True; pass strict=False to go on.)")
    problems = _problems(items, resolutions)
    if problems or notes:
        warnings.warn(
            "\n".join([*problems, *notes]) + "\n(Pass strict=True to make these errors.)",
            ShardingCorrectionWarning,
            stacklevel=stacklevel + 1,
        )
    return resolutions


def _problems(items: Sequence[AnnotatedLeaf], resolutions: Sequence[Resolution]) -> list[str]:
    # What each array's resolution could not apply, naming its path. Arrays that share a
    # resolution (every layer's query kernel) share the text after the path: it is built once.
    described: dict[int, str] = {}
    problems = []
    for (path, _, _), resolution in zip(items, resolutions, strict=True):
        if resolution.ok:
            continue
        text = described.get(id(resolution))
        if text is None:
            text = described[id(resolution)] = resolution.describe()
        problems.append(at_path(path, text))
    return problems


def sharding_tree(mesh: Mesh, treedef: Any, resolutions: Sequence[Resolution]) -> Any:
    """The ``NamedSharding`` of every resolution, unflattened with ``treedef``.

    One ``NamedSharding`` per distinct spec, looked up once per distinct resolution (arrays
    annotated and shaped alike share theirs).
    """
    by_spec: dict[PartitionSpec, NamedSharding] = {}
    by_resolution: dict[int, NamedSharding] = {}
    shardings = []
    for resolution in resolutions:
        found = by_resolution.get(id(resolution))
        if found is None:
            found = by_spec.get(resolution.spec)
            if found is None:
                found = by_spec[resolution.spec] = NamedSharding(mesh, resolution.spec)
            by_resolution[id(resolution)] = found
        shardings.append(found)
    return treedef.unflatten(shardings)


def _shape_at(path: str, leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, Sequence) or not hasattr(leaf, "dtype"):
        # A Python number (a step count kept in the state, say) has no layout to give.
        raise EscaleTypeError(
            f"the leaf {path!r} is {describe(leaf)}, which is not an array; a sharding is "
            "laid out for arrays: keep it out of the tree, or make it one (jnp.asarray(...), "
            "or jax.ShapeDtypeStruct for an abstract one)."
        )
    return array_shape(leaf)


def array_shape(leaf: Any) -> tuple[int, ...]:
    """An (abstract) array's shape, as a tuple."""
    shape = leaf.shape
    return shape if type(shape) is tuple else tuple(shape)


def array_dtype(leaf: Any) -> np.dtype:
    """An (abstract) array's dtype, as a ``numpy`` dtype."""
    dtype = leaf.dtype
    return dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)


class _Resolving:
    """Resolves the arrays of one plan: each distinct (annotation, shape) once.

    Logical annotations (and none) resolve through the resolver of their rules, which keeps
    what it resolved; mesh-axes annotations are fitted once per shape here. Annotations are
    told apart by id (the plan's items keep them alive while it is built). Errors and strict
    mode apply to every array, naming its path.
    """

    def __init__(self, mesh: Mesh, rules: LogicalRules, strict: bool) -> None:
        self._mesh = mesh
        self._rules = rules
        self._strict = strict
        self._mesh_shape = tuple(mesh.shape.items())
        self._axis_names = tuple(mesh.axis_names)
        self._resolvers: dict[int, Resolver] = {}
        self._fitted: dict[tuple[int, tuple[int, ...]], Resolution] = {}
        self._followed: dict[tuple[Any, ...], Resolution] = {}

    def __call__(
        self, path: str, shape: tuple[int, ...], annotation: Annotation | None
    ) -> Resolution:
        """The resolution of an array with ``annotation`` (``None``: replicated)."""
        if annotation is not None and annotation.mesh_axes is not None:
            key = (id(annotation), shape)
            found = self._fitted.get(key)
            if found is None:
                found = self._fitted[key] = fit_mesh_axes(
                    annotation.mesh_axes, shape=shape, mesh=self._mesh
                )
        else:
            # The annotation's names were checked when it was made, and the mesh and rules by
            # the caller: the resolver takes them as they are.
            resolve = self._resolvers.get(id(annotation))
            if resolve is None:
                rules = self._rules
                if annotation is not None:
                    rules = annotation.rules_with(rules, self._axis_names)
                resolve = self._resolvers[id(annotation)] = resolver(rules, self._mesh_shape)
            names = None if annotation is None else annotation.logical_axes
            found = resolve.resolve(names, shape)
        if type(found) is str or (self._strict and not found.ok):
            self._raise(found, path)
        return found

    def following(
        self, path: str, shape: tuple[int, ...], param: Resolution, kept: tuple[int, ...]
    ) -> Resolution:
        """The resolution of optimizer state keeping the dimensions ``kept`` of ``param``."""
        # (the parameter's resolution stays alive while the plan is made: its id names it)
        key = (id(param), kept, shape)
        found = self._followed.get(key)
        if found is None:
            rank = len(param.shape or ())
            padded = (*param.spec, *(None,) * (rank - len(param.spec)))
            entries = tuple(padded[d] for d in kept)
            if param.shape is not None and shape == tuple(param.shape[d] for d in kept):
                # The kept dimensions have the parameter's sizes, which its fitted spec
                # divides: nothing to fit (Adam's moments of every parameter come here).
                spec = PartitionSpec(*entries)
                found = Resolution(None, spec, shape, param.mesh_shape, spec)
            else:
                found = fit_mesh_axes(entries, shape=shape, mesh=self._mesh)
            self._followed[key] = found
        if self._strict and not found.ok:
            self._raise(found, path)
        return found

    @staticmethod
    def _raise(found: Resolution | str, path: str) -> None:
        if type(found) is str:
            raise ShardingResolutionError(at_path(path, found))
        enforce(found, strict=True, path=path)


def _complete(
    resolutions: list[Resolution | None],
    items: Sequence[AnnotatedLeaf],
    mesh: Mesh,
    rules: LogicalRules,
) -> None:
    # Completes the resolutions given (the parameters'; None: optimizer state, left to follow)
    # in place. Each distinct one is looked at once, and only the arrays of those that leave
    # an axis idle are, for their size.
    complete = _IdleAxes({id(r): r for r in resolutions if r is not None}.values(), mesh, rules)
    if not complete.candidates:
        return
    done: dict[tuple[int, np.dtype], Resolution] = {}
    for i, resolution in enumerate(resolutions):
        count = None if resolution is None else complete.candidates.get(id(resolution))
        if count is None:
            continue
        dtype = array_dtype(items[i][1])
        if count * dtype.itemsize < IDLE_AXES_MIN_BYTES:
            continue
        key = (id(resolution), dtype)
        found = done.get(key)
        if found is None:
            found = done[key] = complete(resolution)
        resolutions[i] = found


class _IdleAxes:
    """Puts the mesh axes the rules leave idle to use on a plan's large parameters.

    A parameter axis is one the rules split some variable over, or one the rules of this
    variable's own names name (they meant to use it, and a shape kept them from it). An axis
    that only the batch's rules name (data parallelism) stays a replica axis. Which axes an
    array could take depends only on its spec and names: it is worked out once per pair.

    Attributes:
        candidates: For each resolution given that leaves an axis its array could take (by
            id), the number of elements of its arrays.
    """

    def __init__(self, made: Collection[Resolution], mesh: Mesh, rules: LogicalRules) -> None:
        specs = {id(r.spec): r.spec for r in made}.values()
        self._used = {a for spec in specs for entry in spec for a in mesh_axes_of(entry)}
        self._mesh = mesh
        self._rules = rules
        # id(spec) -> id(names) -> (spec, names, the axes left idle): the ids are of objects
        # the resolutions keep alive.
        self._idle: dict[int, dict[int, tuple[Any, Any, list[str]]]] = {}
        self.candidates = {id(r): math.prod(r.shape) for r in made if self._idle_axes(r)}

    def __call__(self, resolution: Resolution) -> Resolution:
        """``resolution`` completed (a large array's)."""
        names = resolution.logical_axes or ()
        keep = [dim for dim, name in enumerate(names) if name in STACKED_NAMES]
        spec, added = complete_spec(
            resolution.spec,
            resolution.shape,
            self._mesh.shape,
            self._idle_axes(resolution),
            keep=keep,
        )
        if not added:
            return resolution
        return replace_checked(resolution, spec=spec, completed=added)

    def _idle_axes(self, resolution: Resolution) -> list[str]:
        spec, names = resolution.spec, resolution.logical_axes
        by_names = self._idle.get(id(spec))
        if by_names is None:
            by_names = self._idle[id(spec)] = {}
        found = by_names.get(id(names))
        if found is None:
            rules, sizes, named = self._rules, self._mesh.shape, names or ()
            meant = {a for name, target in rules if name in named for a in mesh_axes_of(target)}
            taken = {a for entry in spec for a in mesh_axes_of(entry)}
            idle = [
                a
                for a in self._mesh.axis_names
                if (a in self._used or a in meant) and a not in taken and sizes[a] > 1
            ]
            found = by_names[id(names)] = (spec, names, idle)
        return found[2]
