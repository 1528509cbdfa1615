"""The checks of :meth:`~flax_escale.t5x.Partitioner.partition`'s positional arguments.

``jax.jit`` reports a bad ``static_argnums``, ``donate_argnums`` or a tuple of specs that does
not fit the function (if at all) with errors that name neither the argument nor what to pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["check_arity", "jit_argnums"]

_Positional = tuple[int, int | None] | None


def jit_argnums(
    fn: Callable[..., Any], static_argnums: Any, donate_argnums: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``static_argnums`` and ``donate_argnums`` as tuples of indices of ``fn``'s parameters.

    Raises:
        EscaleTypeError: For a value that is not an int or a sequence of ints.
        EscaleError: For an index past ``fn``'s positional parameters, or one argument both
            static and donated.
    """
    positional = _positional_parameters(fn)
    static = _argnums(static_argnums, "static_argnums", fn, positional)
    donate = _argnums(donate_argnums, "donate_argnums", fn, positional)
    _check_not_both(static, donate, positional)
    return static, donate


def _positional_parameters(fn: Callable[..., Any]) -> _Positional:
    """``(required, most)`` positional parameters of ``fn`` (``most`` None with ``*args``).

    None when ``fn``'s signature cannot be read (some builtins): then nothing is checked.
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return required, None
    return required, len(positional)


def _signature_text(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"{name}{inspect.signature(fn)}"


def _argnums(
    value: Any, argument: str, fn: Callable[..., Any], positional: _Positional
) -> tuple[int, ...]:
    """``value`` (an index or a sequence of them) as a tuple of ints within ``fn``'s parameters.

    A bool is refused: jax.jit would take ``True`` as the index 1.
    """
    items = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise EscaleTypeError(
                f"{argument} must be an int or a sequence of ints (indices of fn's positional "
                f"arguments), got {check.describe(value)}; pass e.g. 1 or (0, 2), or () for none."
            )
    indices = tuple(int(item) for item in items)
    most = None if positional is None else positional[1]
    if most is None:
        return indices
    for index in indices:
        if not -most <= index < most:
            allowed = (
                f"indices from 0 to {most - 1} (or -{most} to -1, from the end)"
                if most
                else "() (it takes none)"
            )
            raise EscaleError(
                f"{argument} {value!r} names the positional argument {index}, but fn "
                f"{_signature_text(fn)} takes {most} positional argument(s); pass {allowed}."
            )
    return indices


def _check_not_both(
    static: tuple[int, ...], donate: tuple[int, ...], positional: _Positional
) -> None:
    # Without a known count, negative indices cannot be compared with positive ones.
    most = None if positional is None else positional[1]
    normal = (lambda i: i % most) if most else (lambda i: i)
    both = sorted({normal(i) for i in static} & {normal(i) for i in donate})
    if both:
        raise EscaleError(
            f"static_argnums {static} and donate_argnums {donate} both name the positional "
            f"argument {both[0]}; a static argument is a compile-time constant, not a buffer to "
            "donate: drop it from one of them."
        )


def check_arity(
    fn: Callable[..., Any],
    resources: Any,
    static: tuple[int, ...],
) -> None:
    """Refuses a tuple of specs that no call of ``fn`` could match one to one.

    jax.jit wants one spec per positional argument that is not static, and takes none by
    keyword; so a call passes ``k`` positional arguments, ``required <= k <= most``, of which
    those not in ``static`` (negative indices counting from ``k``) get the specs.
    """
    positional = _positional_parameters(fn)
    if type(resources) is not tuple or positional is None:  # a PartitionSpec is a tuple too
        return
    required, most = positional
    count = len(resources)
    # Each call's non-static count is at least k - len(static), so larger k cannot match.
    highest = count + len(static) if most is None else min(most, count + len(static))

    def dynamic(k: int) -> int:
        taken = {i + k if i < 0 else i for i in static}
        return k - len({i for i in taken if 0 <= i < k})

    if any(dynamic(k) == count for k in range(required, highest + 1)):
        return
    takes = f"{required}" if most == required else f"{required} to {most or 'any number of'}"
    raise EscaleTypeError(
        f"in_axis_resources gives {count} spec(s) (a tuple of {count}), one per positional "
        f"argument that is not static, but fn {_signature_text(fn)} takes {takes} positional "
        f"argument(s) with static_argnums {static}; give one spec per argument of fn, less the "
        "static ones (e.g. (None,) * n), or one spec (not a tuple) for all of them."
    )
