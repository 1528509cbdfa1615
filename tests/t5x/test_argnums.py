"""``Partitioner.partition``'s positional arguments (``flax_escale/t5x/_argnums.py``).

``static_argnums``, ``donate_argnums`` and a tuple of specs that no call of the function could
match are refused with errors that name the argument and what to pass."""

import pytest
from support.mistakes import (
    MISTAKE,
    T,
    case,
    partitioner,
    raises_a_library_error,
)

import flax_escale as fe

CASES = [
    case(
        lambda: partitioner().partition(lambda a: a, (None,), None, static_argnums=1.5),
        T,
        "static_argnums",
        "float 1.5",
        r"pass e\.g\. 1 or \(0, 2\)",
        id="t5x-partition-static_argnums-float",
    ),
    case(
        lambda: partitioner().partition(lambda a: a, (None,), None, donate_argnums=float("nan")),
        T,
        "donate_argnums",
        "float nan",
        r"pass e\.g\. 1 or \(0, 2\)",
        id="t5x-partition-donate_argnums-nan",
    ),
    case(
        lambda: partitioner().partition(lambda a, n: a * n, (None,), None, static_argnums=True),
        T,
        "static_argnums",
        "bool True",
        r"pass e\.g\. 1 or \(0, 2\)",
        id="t5x-partition-static_argnums-bool",
    ),
    case(
        lambda: partitioner().partition(lambda a: a, (None,), None, static_argnums=-5),
        fe.EscaleError,
        "static_argnums",
        "-5",
        r"pass indices from 0 to 0 \(or -1 to -1",
        id="t5x-partition-static_argnums-out-of-range",
    ),
    case(
        lambda: partitioner().partition(
            lambda a, n: a * n, (None,), None, static_argnums=1, donate_argnums=-1
        ),
        fe.EscaleError,
        "donate_argnums",
        "(-1,)",
        "drop it from one of them",
        id="t5x-partition-static-and-donated",
    ),
    case(
        lambda: partitioner().partition(lambda: 1, (None,), None),
        T,
        "in_axis_resources",
        "<lambda>()",
        "give one spec per argument of fn",
        id="t5x-partition-fn-takes-no-arguments",
    ),
    case(
        lambda: partitioner().partition(lambda a, b: a, (None,), None),
        T,
        "in_axis_resources",
        "<lambda>(a, b)",
        "give one spec per argument of fn",
        id="t5x-partition-fewer-specs-than-arguments",
    ),
    case(
        lambda: partitioner().partition(lambda a, n: a * n, (None, None), None, static_argnums=1),
        T,
        "in_axis_resources",
        "static_argnums (1,)",
        "less the static ones",
        id="t5x-partition-spec-for-a-static-argument",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
