"""``expert_capacity`` (``flax_escale/moe/_capacity.py``): the slots per expert of a group of
tokens under a capacity factor, and the arguments it refuses.
"""

import math

import pytest

import flax_escale as fe
from flax_escale.moe import expert_capacity


@pytest.mark.parametrize(
    ("group_size", "num_experts", "top_k", "factor", "capacity"),
    [
        (32, 8, 2, 1.25, 10),
        (16, 8, 2, 1.0, 4),
        (16, 8, 2, 0.5, 2),
        (7, 4, 2, 1.0, 4),  # 3.5 rounds up
        (10, 4, 2, 1.0, 5),
        (4, 8, 1, 0.1, 1),  # never below one slot
        (16, 8, 2, 8.0, 32),  # every assignment of the group fits one expert
    ],
)
def test_expert_capacity(group_size, num_experts, top_k, factor, capacity):
    assert expert_capacity(group_size, num_experts, top_k, factor) == capacity
    assert capacity == max(1, math.ceil(factor * group_size * top_k / num_experts))


# --- its arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (
            (-4, 8, 2, 1.0),
            fe.EscaleError,
            r"expert_capacity: group_size must be an int of at least 0, got -4\.",
        ),
        ((16, 8, 0, 1.0), fe.EscaleError, r"expert_capacity: top_k must be a positive int, got 0"),
        ((16, 0, 1, 1.0), fe.EscaleError, r"expert_capacity: num_experts must be a positive int"),
        (
            (16, 8, 9, 1.0),
            fe.EscaleError,
            r"expert_capacity: top_k must be at most num_experts \(8\), got 9: a token goes to "
            r"top_k different experts; pass a top_k from 1 to num_experts\.",
        ),
        (
            (16, 8, 2, 0.0),
            fe.EscaleError,
            r"expert_capacity: capacity_factor must be a finite number above 0, got 0\.0",
        ),
        (
            (16, 8, 2, float("nan")),
            fe.EscaleError,
            r"expert_capacity: capacity_factor must be a finite number above 0, got nan",
        ),
        (
            (16.0, 8, 2, 1.0),
            fe.EscaleTypeError,
            r"expert_capacity: group_size must be an int of at least 0, got float 16\.0; pass "
            r"the int 16\.",
        ),
        ((16, 8, True, 1.0), fe.EscaleTypeError, r"expert_capacity: top_k must be a positive"),
        (
            (16, 8, 2, "1.25"),
            fe.EscaleTypeError,
            r"expert_capacity: capacity_factor must be a number above 0, got str '1\.25'",
        ),
    ],
)
def test_expert_capacity_checks_every_argument(arguments, error, match):
    with pytest.raises(error, match=match):
        expert_capacity(*arguments)


def test_a_group_of_no_tokens_has_one_slot():
    assert expert_capacity(0, 8, 2, 1.25) == 1
