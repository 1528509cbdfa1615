"""Mistakes users make with the vocabulary, one case each.

Cases for ``PartitionAxis`` and its fields. What a case asserts, and the rest of the table:
``support/mistakes.py``.
"""

import pytest
from support.mistakes import (
    MISTAKE,
    case,
    raises_a_library_error,
)

import flax_escale as fe

CASES = [
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fe.PartitionAxis(batch_axis=3),
        fe.EscaleError,
        "batch_axis",
        "3",
        "a mesh axis name",
        id="PartitionAxis-field-int",
    ),
    case(
        lambda: fe.PartitionAxis(tensor_parallel_axis=None),
        fe.EscaleError,
        "tensor_parallel_axis",
        "None",
        "non-empty string",
        id="PartitionAxis-axis-none",
    ),
    case(
        lambda: fe.PartitionAxis(hidden_state_axis=["fsdp", 3]),
        fe.EscaleError,
        "hidden_state_axis",
        "['fsdp', 3]",
        "sequence of names",
        id="PartitionAxis-field-list-with-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
