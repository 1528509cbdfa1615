"""``logical_shard_map``'s axes: each argument's and output's logical names, checked and resolved.

A logical name names one dimension across the whole mapped function: where an argument's
dimension of that name is split (or, corrected, is not), an output's dimension of the same
name is split alike, so that the blocks the body returns assemble into the shape they came
from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of, without_unit_explicit_axes
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, EscaleTypeError, ShardingResolutionError
from flax_escale.resolve import (
    Correction,
    Resolution,
    enforce,
    fit_spec,
    resolve_logical_axes,
)

__all__ = ["MapAxes", "arrays_of"]

_EXAMPLE = "e.g. ('batch', 'hidden_state')"


@dataclasses.dataclass(frozen=True)
class _Split:
    """How the first argument naming a logical name split that dimension."""

    entry: Any  # the dimension's spec entry
    where: str  # the in_axes entry, e.g. "in_axes[0]['kernel']"
    correction: Correction | None  # what was dropped there, if anything


def _is_axes(node: Any) -> bool:
    """Whether ``node`` is one array's entry: a tuple of names, None or a ``PartitionSpec``.

    A plain tuple holding no containers counts as one, so that a wrong name in it
    (``("batch", 3)``) is reported as such rather than as a tree of the wrong structure.
    """
    return (
        node is None
        or isinstance(node, PartitionSpec)
        or (
            type(node) is tuple  # a NamedTuple is a structure of arrays, as for JAX
            and not any(isinstance(n, tuple | list | dict | PartitionSpec) for n in node)
        )
    )


def _length(axes: Any) -> int:
    return 0 if axes is None else len(axes)


class MapAxes:
    """The ``in_axes`` and ``out_axes`` of one call, resolved on its mesh with its rules.

    Args:
        name: The mapped function's name, for messages.
        mesh: The mesh of the call.
        rules: The rules of the call.
        strict: Raise instead of correcting.
    """

    def __init__(
        self, name: str, mesh: Mesh | AbstractMesh, rules: LogicalRules, strict: bool
    ) -> None:
        self._name, self._mesh, self._rules, self._strict = name, mesh, rules, strict
        self._split: dict[str, _Split] = {}

    def _named(self, where: str) -> str:
        return f"logical_shard_map({self._name!r}): {where}"

    def _on(self) -> str:
        return f"on mesh {dict(self._mesh.shape)}"

    def inputs(self, in_axes: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``in_specs`` for ``args``; remembers how each logical name was split.

        Raises:
            EscaleTypeError: For an entry that is not a tuple of names, or an argument leaf
                that is not an array.
            EscaleError: For an entry shaped unlike its argument, or a ``PartitionSpec`` that
                does not fit its array.
            ShardingResolutionError: For names that cannot mean anything for the array (more
                names than dimensions, a name twice) and, with ``strict``, corrections.
        """
        specs = []
        for i, (axes, arg) in enumerate(zip(in_axes, args, strict=True)):
            specs.append(self._per_array(f"in_axes[{i}]", axes, arg, self._input))
        return tuple(specs)

    def outputs(self, out_axes: Any) -> Any:
        """``out_specs``: each name split as the arguments split it (the rules otherwise)."""
        return self._per_array("out_axes", out_axes, None, self._output)

    def check_outputs(self, out_axes: Any, out: Any) -> None:
        """Refuses outputs of the body that ``out_axes`` does not fit (structure, rank).

        Raises:
            EscaleError: Naming the ``out_axes`` entry, its axes, the output's block shape and
                the mesh.
        """

        def check_block(where: str, axes: Any, value: Any) -> None:
            for leaf in jax.tree.leaves(value):
                shape = tuple(np.shape(leaf))
                if _length(axes) > len(shape):
                    raise EscaleError(
                        f"{self._named(where)} is {axes!r}, longer than the rank"
                        f" of the block of shape {shape} the body returns there "
                        f"{self._on()}; give at most one logical name (or None) per dimension "
                        "of the output."
                    )

        self._per_array("out_axes", out_axes, out, check_block, role="output")

    def _input(self, where: str, axes: Any, value: Any) -> PartitionSpec:
        shape = tuple(value.shape)
        if isinstance(axes, PartitionSpec):
            spec = check.spec_on(self._mesh, axes, self._named(where))
            check.sharding_fits(NamedSharding(self._mesh, spec), shape, self._named(where))
            return without_unit_explicit_axes(spec, self._mesh)
        resolution = self._resolve(where, axes, shape)
        for dim, name in enumerate(resolution.logical_axes or ()):
            if isinstance(name, str) and name not in self._split:
                dropped = [c for c in resolution.corrections if c.dim == dim]
                entry = resolution.spec[dim] if dim < len(resolution.spec) else None
                self._split[name] = _Split(entry, where, dropped[0] if dropped else None)
        return without_unit_explicit_axes(resolution.spec, self._mesh)

    def _output(self, where: str, axes: Any, _: Any) -> PartitionSpec:
        if isinstance(axes, PartitionSpec):
            spec = check.spec_on(self._mesh, axes, self._named(where))
            return without_unit_explicit_axes(spec, self._mesh)
        resolution = self._follow_inputs(self._resolve(where, axes, None, enforced=False))
        # Warned from the call of the mapped function (through outputs and _per_array).
        enforce(resolution, strict=self._strict, path=where, stacklevel=5)
        return without_unit_explicit_axes(resolution.spec, self._mesh)

    def _resolve(
        self, where: str, axes: Any, shape: tuple[int, ...] | None, enforced: bool = True
    ) -> Resolution:
        try:
            resolution = resolve_logical_axes(axes, self._rules, shape=shape, mesh=self._mesh)
        except ShardingResolutionError as error:
            of = "" if shape is None else f" (an argument of shape {shape})"
            raise ShardingResolutionError(
                f"{self._named(where)}{of} {self._on()}: {error}"
            ) from None
        if enforced:  # warned from the call (through inputs, _per_array and _input)
            enforce(resolution, strict=self._strict, path=where, stacklevel=6)
        return resolution

    def _follow_inputs(self, resolution: Resolution) -> Resolution:
        # An output's dimension named like an argument's is that dimension: split alike, or
        # the blocks would assemble into another shape (a name corrected to unsplit in the
        # argument, split over fsdp=4 in the output, would make 6 rows 24).
        names = resolution.logical_axes or ()
        entries = [*resolution.spec, *(None,) * (len(names) - len(resolution.spec))]
        corrections = list(resolution.corrections)
        for dim, name in enumerate(names):
            split = self._split.get(name) if isinstance(name, str) else None
            if split is None or mesh_axes_of(entries[dim]) == mesh_axes_of(split.entry):
                continue
            if split.correction is not None:
                dropped = tuple(
                    a for a in mesh_axes_of(entries[dim]) if a not in mesh_axes_of(split.entry)
                )
                corrections.append(
                    Correction(
                        split.correction.kind,
                        dim,
                        dropped,
                        None,
                        f"it is the dimension {name!r} of {split.where}, where "
                        f"{split.correction.detail}, so the output's blocks are split alike",
                    )
                )
            entries[dim] = split.entry
        spec, reused = fit_spec(PartitionSpec(*entries), None, dict(self._mesh.shape))
        return dataclasses.replace(resolution, spec=spec, corrections=(*corrections, *reused))

    def _per_array(
        self,
        where: str,
        axes: Any,
        values: Any,
        resolve: Callable[[str, Any, Any], Any],
        role: str = "argument",
    ) -> Any:
        """``resolve(path, names, value)`` for each array entry of ``axes`` (a pytree of them).

        ``values``, when given, has ``axes``'s structure down to each entry (the array, or
        arrays, there).
        """
        entries, treedef = jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)
        try:
            found = [None] * len(entries) if values is None else treedef.flatten_up_to(values)
        except (ValueError, TypeError):
            raise EscaleError(
                f"{self._named(where)} is {axes!r}, whose structure does not match"
                f" the {role}'s ({jax.tree.structure(values)}); give one tuple of "
                f"logical names per array, {_EXAMPLE}, in a tree shaped like the {role} (or "
                "one tuple for all its arrays)."
            ) from None
        resolved = []
        for (path, entry), value in zip(entries, found, strict=True):
            at = f"{where}{jax.tree_util.keystr(path)}"
            if not (
                entry is None
                or isinstance(entry, PartitionSpec)
                or (
                    isinstance(entry, tuple) and all(n is None or isinstance(n, str) for n in entry)
                )
            ):
                raise EscaleTypeError(
                    f"{self._named(at)} is {check.describe(entry)}; each array takes"
                    f" a tuple of logical names (or None), {_EXAMPLE}."
                )
            resolved.append(resolve(at, entry, value))
        return treedef.unflatten(resolved)


def arrays_of(name: str, in_axes: Sequence[Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every leaf a JAX array (numpy arrays and Python numbers converted).

    Raises:
        EscaleError: If there are not as many arguments as ``in_axes`` has entries.
        EscaleTypeError: For a leaf that is not an array or a number, naming where it is.
    """
    if len(args) != len(in_axes):
        raise EscaleError(
            f"logical_shard_map({name!r}): {len(args)} arguments but {len(in_axes)} entries in "
            "in_axes; give one logical-axes entry per argument."
        )

    def as_array(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            return leaf
        try:
            return jnp.asarray(leaf)
        except (TypeError, ValueError):
            raise EscaleTypeError(
                f"logical_shard_map({name!r}): args{jax.tree_util.keystr(path)} is "
                f"{check.describe(leaf)}; the mapped function takes arrays (numpy arrays "
                "and Python numbers are converted), of which the body receives blocks."
            ) from None

    return tuple(jax.tree.map_with_path(as_array, args))
