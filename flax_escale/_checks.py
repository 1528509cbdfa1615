"""Argument checkers shared by the public entry points.

Each checker takes the value and the name of the argument it came in as, returns the value in
the form the caller works with, and otherwise raises an :class:`~flax_escale.EscaleTypeError`
(or :class:`~flax_escale.EscaleError` for a value of the right type that cannot be right) whose
message names the argument and the value and says what to pass instead. They sit at the
bottom, beside the errors, so every layer can use them.

Example:
    >>> from flax_escale import _checks as check
    >>> check.names(["dp", "tp"], "axis_names")
    ('dp', 'tp')
    >>> check.names("dp", "axis_names")
    Traceback (most recent call last):
    ...
    flax_escale.errors.EscaleTypeError: axis_names must be ... got the string 'dp'; pass ('dp',).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError

__all__ = [
    "array",
    "callable_",
    "describe",
    "devices",
    "devices_of",
    "flag",
    "instance",
    "logical_names",
    "mesh",
    "named_sharding",
    "named_sharding_of",
    "names",
    "non_negative_int",
    "non_negative_number",
    "optional_mesh",
    "pairs",
    "path",
    "positive_int",
    "rng",
    "sequence",
    "shape",
    "sizes",
    "spec_on",
    "string",
    "structure_like",
    "transformation",
    "tree_of_arrays",
]


def describe(value: Any) -> str:
    """The value as error messages show it: its type and a short ``repr``.

    Example:
        >>> from flax_escale._checks import describe
        >>> describe(0.5), describe(None)
        ('float 0.5', 'None')
    """
    if value is None:
        return "None"
    shape = getattr(value, "shape", None)
    # Only a tuple of sizes is a shape: an nnx.Rngs answers any attribute with a stream.
    if isinstance(shape, tuple) and hasattr(value, "dtype") and len(shape) > 0:
        # An array's repr spans lines and says little; its type, shape and dtype say it all.
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _sequence(value: Any, argument: str, what: str, example: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a sequence of {what}, got the string {value!r}; pass ({value!r},)."
        )
    if isinstance(value, (bytes, dict, set, frozenset)) or not isinstance(value, Sequence):
        if isinstance(value, np.ndarray) and value.ndim == 1:
            return tuple(value.tolist())
        raise EscaleTypeError(
            f"{argument} must be a sequence (tuple or list) of {what}, got {describe(value)}; "
            f"pass e.g. {example}."
        )
    return tuple(value)


def sequence(value: Any, argument: str, what: str, example: str) -> tuple[Any, ...]:
    """A tuple from a sequence; a bare string, a dict, a set or a non-sequence raises.

    ``what`` says what the entries are (``"mesh axis names"``), ``example`` a valid value.

    Raises:
        EscaleTypeError: For a string (``"dp"``: pass ``("dp",)``) or a non-sequence.
    """
    return _sequence(value, argument, what, example)


def instance(value: Any, kind: type | tuple[type, ...], argument: str, example: str) -> Any:
    """``value`` if it is an instance of ``kind``; otherwise raises, with ``example`` to pass.

    Raises:
        EscaleTypeError: For anything else (a class where an instance is expected included).
    """
    if isinstance(value, kind):
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    wanted = " or ".join(k.__name__ for k in kinds)
    if isinstance(value, type) and issubclass(value, kinds):
        raise EscaleTypeError(
            f"{argument} must be a {wanted} instance, got the class {value.__name__}; pass "
            f"{value.__name__}(...), e.g. {example}."
        )
    raise EscaleTypeError(
        f"{argument} must be a {wanted}, got {describe(value)}; pass e.g. {example}."
    )


def kind(
    value: Any,
    kinds: type | tuple[type, ...],
    argument: str,
    what: str,
    *,
    string_fix: str,
    fix: str = "",
) -> Any:
    """``value`` if it is one of ``kinds`` and not a string, which is told ``string_fix``.

    ``what`` says what ``value`` must be; ``fix`` ends the message for another type.

    Raises:
        EscaleTypeError: For a string or anything that is not one of ``kinds``.
    """
    if isinstance(value, str):
        raise EscaleTypeError(f"{argument} must be {what}, got the string {value!r}; {string_fix}.")
    if not isinstance(value, kinds):
        raise EscaleTypeError(f"{argument} must be {what}, got {describe(value)}{fix}.")
    return value


def names(value: Any, argument: str) -> tuple[str, ...]:
    """A tuple of names (strings) from a sequence of them; a bare string is refused.

    Raises:
        EscaleTypeError: For a string (``"dp"``: pass ``("dp",)``), a non-sequence, or an entry
            that is not a string.
    """
    items = _sequence(value, argument, "names", "('dp', 'tp')")
    for item in items:
        if not isinstance(item, str):
            raise EscaleTypeError(
                f"{argument} must be a sequence of names (strings), got {value!r} whose entry "
                f"{describe(item)} is not a string."
            )
        if not item:
            raise EscaleError(
                f"{argument} must be a sequence of non-empty names, got {value!r} with the "
                "empty name ''; give every entry a name such as 'dp'."
            )
    return items


def logical_names(value: Any, argument: str) -> tuple[Any, ...]:
    """Logical axes: per dimension a name, ``None``, ``UNCONSTRAINED`` or a tuple of names.

    Each entry is read as ``mesh_axes_of`` reads a ``PartitionSpec`` entry.

    Raises:
        EscaleTypeError: For a string (``"batch"``: pass ``("batch",)``), a non-sequence, or an
            entry of another type.
    """
    items = _sequence(value, argument, "logical axis names", "('batch', 'hidden_state')")
    for item in items:
        try:
            mesh_axes_of(item)
        except EscaleTypeError:
            raise EscaleTypeError(
                f"{argument} must have one logical name (a string), a tuple of names or None "
                f"per dimension, got {value!r} whose entry {describe(item)} is none of these."
            ) from None
    return items


def _not_one_value(value: Any, argument: str, what: str, string_hint: str) -> None:
    # A bare int or a string where a sequence of ints is expected: say what to pass instead.
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        raise EscaleTypeError(
            f"{argument} must be {what}, got the int {value!r}; pass ({value!r},)."
        )
    if isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be {what}, got the string {value!r}; {string_hint}."
        )


def sizes(value: Any, argument: str) -> tuple[Any, ...]:
    """A tuple of sizes from a sequence of them; a bare int is refused.

    Entries are only checked to be neither strings, bools nor ``None``; whether they are valid
    sizes is the caller's to say (``create_mesh`` names the bad size).

    Raises:
        EscaleTypeError: For an int (``8``: pass ``(8,)``), a string, ``None``, or an entry
            that is not an integer.
    """
    _not_one_value(
        value,
        argument,
        "a sequence of sizes",
        "pass a tuple of ints such as (2, 4), or parse the string with parse_mesh_from_string",
    )
    items = _sequence(value, argument, "sizes", "(2, 4)")
    for item in items:
        if isinstance(item, (bool, str, bytes)) or item is None:
            raise EscaleTypeError(
                f"{argument} must be a sequence of int sizes, got {value!r} whose entry "
                f"{describe(item)} is not an int."
            )
    return items


def string(value: Any, argument: str, example: str) -> str:
    """A string; anything else raises, with ``example`` as what to pass."""
    if not isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a string such as {example}, got {describe(value)}."
        )
    return value


def mesh(value: Any, argument: str = "mesh") -> Mesh | AbstractMesh:
    """A ``jax.sharding.Mesh`` or ``AbstractMesh``.

    Raises:
        EscaleTypeError: For anything else, naming the argument and value; a string is told to
            go through ``parse_mesh_from_string``.
        MeshError: For the empty mesh (no devices, no axes), which JAX gives where no mesh is
            set and which nothing can be placed on.
    """
    if isinstance(value, (Mesh, AbstractMesh)):
        if value.empty:
            # JAX fails on it in ways that do not say why, or aborts the process.
            raise MeshError(
                f"{argument} is an empty mesh (no axes, no devices), as "
                "get_incontext_mesh(raise_error=False) and jax.sharding.get_mesh() give where no "
                "mesh is set; pass a mesh built with create_mesh(...), or set one with "
                "jax.set_mesh(mesh) first."
            )
        return value
    if isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a jax.sharding.Mesh, got the string {value!r}; parse it with "
            f"parse_mesh_from_string({value!r}, names) first."
        )
    raise EscaleTypeError(
        f"{argument} must be a jax.sharding.Mesh, got {describe(value)}; build one with "
        "create_mesh(...)."
    )


def optional_mesh(value: Any, argument: str = "mesh") -> Mesh | AbstractMesh | None:
    """``None`` (the current mesh) or a mesh, as :func:`mesh` checks it."""
    return None if value is None else mesh(value, argument)


def positive_int(value: Any, argument: str) -> int:
    """An int of at least 1.

    Raises:
        EscaleTypeError: If ``value`` is not an int (``bool`` is not one).
        EscaleError: If it is below 1.
    """
    return _int_at_least(value, argument, 1, "a positive int")


def non_negative_int(value: Any, argument: str) -> int:
    """An int of at least 0.

    Raises:
        EscaleTypeError: If ``value`` is not an int (``bool`` is not one).
        EscaleError: If it is negative.
    """
    return _int_at_least(value, argument, 0, "an int of at least 0")


def _int_at_least(value: Any, argument: str, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise EscaleTypeError(
            f"{argument} must be {what}, got {describe(value)}{_as_int_hint(value)}."
        )
    if value < low:
        raise EscaleError(f"{argument} must be {what}, got {value!r}.")
    return int(value)


def _as_int_hint(value: Any) -> str:
    # "4" or 4.0 where 4 was meant: say so.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return f"; pass the int {int(value)}, not a string"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return f"; pass the int {int(value)}"
    return ""


def non_negative_number(value: Any, argument: str) -> float:
    """A finite int or float of at least 0.

    Raises:
        EscaleTypeError: If ``value`` is not a number (``bool`` is not one).
        EscaleError: If it is negative, infinite or NaN.
    """
    return _finite_number(value, argument, "of at least 0", lambda v: v >= 0)


def positive_number(value: Any, argument: str) -> float:
    """A finite int or float above 0.

    Raises:
        EscaleTypeError: If ``value`` is not a number (``bool`` is not one).
        EscaleError: If it is 0, negative, infinite or NaN.

    Example:
        >>> from flax_escale._checks import positive_number
        >>> positive_number(989e12, "flops_per_second")
        989000000000000.0
        >>> positive_number(float("nan"), "flops_per_second")
        Traceback (most recent call last):
        ...
        flax_escale.errors.EscaleError: flops_per_second must be a finite number above 0, got nan.
    """
    return _finite_number(value, argument, "above 0", lambda v: v > 0)


def _finite_number(value: Any, argument: str, what: str, within: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        hint = ""
        if isinstance(value, str):
            hint = "; pass a number such as 0.1, not a string"
        raise EscaleTypeError(f"{argument} must be a number {what}, got {describe(value)}{hint}.")
    if not (np.isfinite(value) and within(value)):
        raise EscaleError(f"{argument} must be a finite number {what}, got {value!r}.")
    return value


def flag(value: Any, argument: str) -> bool:
    """``True`` or ``False``; a string such as ``"no"`` would be silently true, so it raises.

    Raises:
        EscaleTypeError: For anything but a ``bool`` (or a numpy bool).
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise EscaleTypeError(f"{argument} must be True or False, got {describe(value)}.")


def shape(value: Any, argument: str) -> tuple[int, ...]:
    """An array shape: a sequence of ints of at least 0; a bare int is refused.

    Raises:
        EscaleTypeError: For an int (``8``: pass ``(8,)``), a string, ``None``, an array (pass
            its ``.shape``), or an entry that is not an int.
        EscaleError: For a negative size.
    """
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        raise EscaleTypeError(
            f"{argument} must be a shape (a tuple of ints), got an array "
            f"{type(value).__name__} of shape {tuple(value.shape)}; pass its .shape, "
            f"{tuple(value.shape)}."
        )
    _not_one_value(value, argument, "a shape (a tuple of ints)", "pass e.g. (16, 128)")
    items = _sequence(value, argument, "ints (a shape)", "(16, 128)")
    return int_entries(value, items, argument, "a shape (a tuple of ints)", low=0)


def int_entries(
    value: Any,
    items: Sequence[Any],
    argument: str,
    what: str,
    *,
    low: int,
    hint: str = "",
    error: type[EscaleError] = EscaleError,
) -> tuple[int, ...]:
    """``items``, the entries of ``value``, as ints of at least ``low``.

    ``what`` says what ``value`` must be; ``hint`` what to pass for an entry that is not an int
    (a whole float is told its int instead).

    Raises:
        EscaleTypeError: For an entry that is not an int (``bool`` is not one).
        EscaleError: (``error``) For an entry below ``low``.
    """
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise EscaleTypeError(
                f"{argument} must be {what}, got {value!r} whose entry {describe(item)} is "
                f"not an int{_as_int_hint(item) or hint}."
            )
        if item < low:
            bound = "a positive int" if low == 1 else f"an int of at least {low}"
            raise error(f"{argument} {value!r}: every size must be {bound}, got {item!r}.")
    return tuple(int(item) for item in items)


def path(value: Any, argument: str) -> str:
    """A filesystem path: a non-empty ``str`` or ``os.PathLike`` naming text; returned as str.

    Raises:
        EscaleTypeError: For ``None``, bytes, a number, or anything not path-like.
        EscaleError: For the empty string, or a path with a NUL character.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a path (a str or pathlib.Path), got {describe(value)}; pass "
            "e.g. '/tmp/checkpoints/step_100'."
        )
    if not value:
        raise EscaleError(
            f"{argument} must be a non-empty path, got ''; pass e.g. '/tmp/checkpoints/step_100'."
        )
    # A NUL byte ends a name at the system call: os and tempfile raise a bare ValueError, and
    # a lookup would say only that nothing is there.
    if "\0" in value:
        raise EscaleError(
            f"{argument} must be a path without NUL characters, got {value!r} (a NUL at "
            f"position {value.index(chr(0))}); no file system can name it: remove the '\\x00'."
        )
    return value


def named_sharding(value: Any, argument: str) -> NamedSharding:
    """A ``jax.sharding.NamedSharding``; a bare ``PartitionSpec`` is told to add its mesh.

    Raises:
        EscaleTypeError: For anything else.
    """
    if isinstance(value, NamedSharding):
        return value
    if isinstance(value, PartitionSpec):
        raise EscaleTypeError(
            f"{argument} must be a NamedSharding, got the PartitionSpec {value!r}, which has no "
            f"mesh; pass NamedSharding(mesh, {value!r}) (or batch_sharding(mesh, shape))."
        )
    raise EscaleTypeError(
        f"{argument} must be a NamedSharding, got {describe(value)}; pass NamedSharding(mesh, "
        "spec) (or batch_sharding(mesh, shape))."
    )


def sharding_fits(sharding: NamedSharding, shape: Sequence[int], argument: str) -> None:
    """Refuses a sharding whose spec is longer than ``shape`` or splits a dimension unevenly.

    Raises:
        EscaleError: Naming ``argument``, the spec, the shape and the mesh.

    Example:
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale._checks import sharding_fits
        >>> rows = NamedSharding(create_mesh((1, 8, 1, 1, 1)), PartitionSpec("fsdp"))
        >>> sharding_fits(rows, (16, 4), "sharding")
        >>> sharding_fits(rows, (12, 4), "sharding")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flax_escale.errors.EscaleError: sharding: P('fsdp',) on mesh {...} splits dimension 0 ...
    """
    spec, sizes = sharding.spec, sharding.mesh.shape
    where = f"{argument}: {spec} on mesh {dict(sizes)}"
    misfit = spec_misfit(sharding, shape)
    if misfit is None:
        return
    dim, parts = misfit
    if dim is None:
        raise EscaleError(
            f"{where} has {len(spec)} entries for the {len(shape)} dimensions of shape "
            f"{tuple(shape)}; give at most one entry per dimension."
        )
    raise EscaleError(
        f"{where} splits dimension {dim} of shape {tuple(shape)} into {parts} parts, "
        "which do not divide it; give a spec whose mesh axes divide each dimension."
    )


def spec_misfit(sharding: NamedSharding, shape: Sequence[int]) -> tuple[int | None, int] | None:
    """How a sharding does not fit ``shape``, for callers that word it their own way.

    Returns:
        ``None`` if it fits; ``(None, entries)`` if its spec is longer than ``shape``;
        otherwise ``(dim, parts)`` for the first dimension its ``parts`` do not divide.
    """
    spec, sizes = sharding.spec, sharding.mesh.shape
    if len(spec) > len(shape):
        return None, len(spec)
    for dim, entry in enumerate(spec):
        parts = int(np.prod([sizes[a] for a in mesh_axes_of(entry)]))
        if shape[dim] % parts:
            return dim, parts
    return None


def named_sharding_of(mesh: Any, spec: Any, argument: str) -> NamedSharding:
    """``NamedSharding(mesh, spec)``, with JAX's refusals of the spec as library errors.

    JAX raises ``DuplicateSpecError`` (not a ``ValueError``) for a mesh axis named twice, and a
    bare ``ValueError`` for an axis the mesh lacks; both name neither the argument nor a fix.

    Raises:
        EscaleError: For a spec naming a mesh axis twice or an axis not in the mesh.
        EscaleTypeError: For a spec that is not a ``PartitionSpec``.
    """
    return NamedSharding(mesh, spec_on(mesh, spec, argument))


def spec_on(mesh: Any, spec: Any, argument: str) -> PartitionSpec:
    """``spec``, checked as :func:`named_sharding_of` checks it, without building a sharding."""
    kind(
        spec,
        PartitionSpec,
        argument,
        "a PartitionSpec",
        string_fix=f"pass PartitionSpec({spec!r})",
        fix="; pass e.g. PartitionSpec('dp')",
    )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        for axis in mesh_axes_of(entry, argument=f"{argument} entry {dim}"):
            if axis in seen:
                raise EscaleError(
                    f"{argument} {spec!r} names mesh axis {axis!r} twice; an array can use each "
                    "mesh axis for one dimension only: drop it from one of them."
                )
            if axis not in mesh.axis_names:
                raise EscaleError(
                    f"{argument} {spec!r} names mesh axis {axis!r}, which is not in the mesh "
                    f"{dict(mesh.shape)}; use the mesh's axes {tuple(mesh.axis_names)}."
                )
            seen.add(axis)
    return spec


def array(value: Any, argument: str) -> jax.Array:
    """A ``jax.Array``; a numpy array or anything else raises.

    Raises:
        EscaleTypeError: For a numpy array (already on the host), ``None`` or another type.
    """
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, np.ndarray):
        raise EscaleTypeError(
            f"{argument} must be a jax.Array, got a numpy array of shape {value.shape}, which "
            "is already on the host; pass the global jax.Array (host_local_to_global makes one)."
        )
    raise EscaleTypeError(
        f"{argument} must be a jax.Array, got {describe(value)}; pass a global jax.Array."
    )


def _is_device(value: Any) -> bool:
    # Duck-typed, so that tests and planners can pass stand-ins with the same attributes.
    return hasattr(value, "id") and hasattr(value, "process_index") and hasattr(value, "platform")


def devices(value: Any, argument: str = "devices") -> tuple[Any, ...]:
    """A tuple of JAX devices from a sequence (or array) of them.

    Raises:
        EscaleTypeError: For a string (a platform name: pass ``jax.devices(name)``), a count, or
            an entry that is not a device.
    """
    if isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a sequence of JAX devices, got the string {value!r}; pass "
            f"jax.devices({value!r})."
        )
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        raise EscaleTypeError(
            f"{argument} must be a sequence of JAX devices, got the int {value!r}; pass "
            f"jax.devices()[:{value!r}]."
        )
    if isinstance(value, np.ndarray):
        value = value.ravel().tolist()
    items = _sequence(value, argument, "JAX devices", "jax.devices()")
    for item in items:
        if not _is_device(item):
            raise EscaleTypeError(
                f"{argument} must be a sequence of JAX devices, got an entry {describe(item)}; "
                "pass e.g. jax.devices()."
            )
    return items


def devices_of(backend: Any, argument: str = "backend") -> tuple[Any, ...]:
    """``jax.devices(backend)``, with an unknown or mistyped backend as a library error.

    Raises:
        EscaleTypeError: For a backend that is neither ``None`` nor a string.
        EscaleError: For a platform JAX does not have here.
    """
    if backend is not None and not isinstance(backend, str):
        raise EscaleTypeError(
            f"{argument} must be a platform name such as 'cpu', 'gpu' or 'tpu' (or None), got "
            f"{describe(backend)}."
        )
    try:
        return tuple(jax.devices(backend))
    except RuntimeError as error:
        raise EscaleError(
            f"{argument} {backend!r} is not available here ({error}); pass one of the platforms "
            "JAX lists, or None for the default."
        ) from None


def pairs(value: Any, argument: str, what: str, example: str) -> tuple[tuple[Any, Any], ...]:
    """A sequence of ``(name, value)`` pairs whose first items are strings.

    ``what`` names a pair (``"(regex, PartitionSpec)"``), ``example`` shows a valid sequence.

    Raises:
        EscaleTypeError: For a string, a dict, ``None``, a bare pair, or an entry that is not
            a pair starting with a string.
    """
    if isinstance(value, str):
        raise EscaleTypeError(
            f"{argument} must be a sequence of {what} pairs, got the string {value!r}; pass "
            f"e.g. {example}."
        )
    if isinstance(value, dict):
        raise EscaleTypeError(
            f"{argument} must be a sequence of {what} pairs, got {describe(value)}; pass "
            f"its items in order, e.g. {example}."
        )
    items = _sequence(value, argument, f"{what} pairs", example)
    if len(items) == 2 and isinstance(items[0], str):
        raise EscaleTypeError(
            f"{argument} must be a sequence of {what} pairs, got the single pair {value!r}; "
            f"pass [{value!r}]."
        )
    for item in items:
        if isinstance(item, str) or not isinstance(item, (tuple, list)) or len(item) != 2:
            raise EscaleTypeError(
                f"{argument} must be a sequence of {what} pairs, got the entry {item!r}, "
                f"which is not a pair; pass e.g. {example}."
            )
        if not isinstance(item[0], str):
            raise EscaleTypeError(
                f"{argument}: in the entry {item!r} the first item {describe(item[0])} must be "
                f"a string; pass e.g. {example}."
            )
    return tuple((first, second) for first, second in items)


def structure_like(
    value: Any, reference: Any, argument: str, reference_name: str, is_leaf: Any = None
) -> list[Any]:
    """``value``'s subtrees at the leaves of ``reference``, as a list; a mismatch raises.

    Raises:
        EscaleError: If ``value`` is not a prefix-compatible tree of ``reference`` (other keys,
            other lengths, a different container), naming both structures.
    """
    treedef = jax.tree.structure(reference, is_leaf=is_leaf)
    try:
        return treedef.flatten_up_to(value)
    except (ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0]
        raise EscaleError(
            f"{argument} must be a tree shaped like {reference_name} (or one value for all), "
            f"got {describe(value)}: {first} Give one entry per leaf of {reference_name}, "
            "with the same keys."
        ) from None


def transformation(value: Any, argument: str = "tx") -> Any:
    """An optax ``GradientTransformation`` (anything with ``init`` and ``update``).

    Raises:
        EscaleTypeError: For ``None``, a name, or a transformation's factory not yet called
            (``optax.adam`` rather than ``optax.adam(1e-3)``).
    """
    if hasattr(value, "init") and hasattr(value, "update"):
        return value
    if isinstance(value, str):
        hint = f"pass the transformation itself, e.g. optax.{value}(1e-3), not its name"
    elif callable(value):
        name = getattr(value, "__name__", "it")
        hint = f"call the factory first, e.g. optax.{name}(1e-3)"
    else:
        hint = "pass e.g. optax.adam(1e-3)"
    raise EscaleTypeError(
        f"{argument} must be an optax GradientTransformation, got {describe(value)}; {hint}."
    )


def callable_(value: Any, argument: str, hint: str = "") -> Callable[..., Any]:
    """A callable; a string (a function's name) or anything else raises."""
    if callable(value) and not isinstance(value, str):
        return value
    what = f"the string {value!r}" if isinstance(value, str) else describe(value)
    raise EscaleTypeError(
        f"{argument} must be a function, got {what}" + (f"; {hint}" if hint else ".")
    )


def takes_positional(fn: Callable[..., Any], count: int, argument: str, call: str) -> None:
    """Raises unless ``fn`` can be called with ``count`` positional arguments, as ``call`` says.

    Functions whose signature cannot be read (some builtins) pass: their call says what is
    wrong.
    """
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError as error:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise EscaleTypeError(
            f"{argument}: {name}{inspect.signature(fn)} cannot be called as {call} ({error}); "
            f"give it exactly those {count} parameters."
        ) from None
    except ValueError:
        pass


def _has_shape(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def tree_of_arrays(value: Any, argument: str) -> Any:
    """A pytree with at least one array leaf (or an empty container); returned unchanged.

    Raises:
        EscaleTypeError: For ``None``, a string, a number, or a tree none of whose leaves is an
            array, which would otherwise pass having checked nothing.
    """
    if isinstance(value, (str, bytes)):
        raise EscaleTypeError(
            f"{argument} must be a pytree of arrays, got the string {value!r}; pass the tree "
            "itself (e.g. variables['params']), not its name."
        )
    if value is None or isinstance(value, (int, float, complex, np.number)):
        raise EscaleTypeError(
            f"{argument} must be a pytree of arrays (a dict of jax.Arrays, a module's state), "
            f"got {describe(value)}."
        )
    leaves = jax.tree.leaves(value, is_leaf=_has_shape)
    if leaves and not any(_has_shape(leaf) for leaf in leaves):
        raise EscaleTypeError(
            f"{argument} must be a pytree of arrays, got {describe(value)} with no array leaf."
        )
    return value


def rng(value: Any, argument: str = "rng") -> Any:
    """A PRNG key, an int seed, or a dict of them by stream name; returned unchanged.

    A key is one typed key (``jax.random.key``) or one raw ``uint32`` key of shape ``(2,)``
    (``jax.random.PRNGKey``).

    Raises:
        EscaleTypeError: For ``None``, a bool, a float, a string, a list, an ``nnx.Rngs``
            (the entry points build it from the seed), an array of keys or of floats, or an
            integer array (a seed is a Python int).
    """
    if isinstance(value, dict):
        for stream, seed in value.items():
            rng(seed, f"{argument}[{stream!r}]")
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return value
    fix, shown = "pass jax.random.key(0) or 0", describe(value)
    if type(value).__module__.startswith("flax.nnx"):
        # nnx.Rngs answers any attribute (dtype, shape) with a stream, so it is told apart
        # by where its class lives, before anything reads its attributes.
        fix = (
            "the entry points build the module's nnx.Rngs from a seed or key themselves (as "
            "model(..., rngs=nnx.Rngs(rng))), so pass the seed or key you would give nnx.Rngs: "
            "0 or jax.random.key(0), or a dict of them by stream name such as "
            "{'params': 0, 'dropout': 1}"
        )
        shown = f"an nnx.{type(value).__name__}"  # whose repr runs for lines
    elif isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        dtype, shape = value.dtype, tuple(value.shape)
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
            return value
        if dtype == np.uint32 and shape == (2,):
            return value
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            fix = "pass one key, e.g. keys[0]; a model is initialized from one key per stream"
        elif np.issubdtype(dtype, np.integer) and shape == ():
            fix = "pass the seed as a Python int, int(seed), or make it a key: jax.random.key(seed)"
    raise EscaleTypeError(f"{argument} must be a PRNG key or an int seed, got {shown}; {fix}.")
