"""The argument checkers (``flax_escale/_checks.py``): what they refuse and accept; and the
table of mistakes as a whole.

The table of mistakes is split by module, each part beside the tests of the module whose
mistakes it lists (``tests/mesh/test_creation.py``, ``tests/t5x/test_partitioner.py``, ...):
what a case asserts is in ``support/mistakes.py``. Here are the cases of the checkers every
entry point calls, what those checkers accept, and that the cases of all parts are distinct.
"""

import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    all_cases,
    case,
    mesh_dp_tp,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import _checks as check

CASES = [
    # --- the checkers themselves, for arguments they guard -----------------------------------
    case(
        lambda: check.positive_int(0, "num_slices"),
        fe.EscaleError,
        "num_slices",
        "0",
        "positive int",
        id="positive_int-zero",
    ),
    case(
        lambda: check.positive_int("4", "num_slices"),
        T,
        "num_slices",
        "'4'",
        "positive int",
        id="positive_int-string",
    ),
    case(
        lambda: check.positive_int(2.0, "num_slices"),
        T,
        "num_slices",
        "float 2.0",
        "positive int",
        id="positive_int-float",
    ),
    case(
        lambda: check.callable_(None, "loss_fn"),
        T,
        "loss_fn",
        "None",
        "function",
        id="callable-none",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_cases_are_distinct():
    ids = [c.id for c in all_cases()]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 150


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["dp", "tp"], ("dp", "tp")),
        (("dp",), ("dp",)),
        ((), ()),
    ],
)
def test_names_accepts_sequences_of_strings(value, expected):
    assert check.names(value, "axis_names") == expected


@pytest.mark.parametrize(
    "value", [0, jax.random.key(0), jax.random.PRNGKey(0), {"params": 0, "dropout": 1}]
)
def test_rng_accepts_keys_and_seeds(value):
    assert check.rng(value) is value


def test_the_checkers_accept_what_they_should():
    assert check.shape([2, np.int64(3)], "shape") == (2, 3)
    assert check.shape((), "shape") == ()
    assert check.flag(np.bool_(True), "strict") is True
    assert check.path(pathlib.Path("/tmp/ckpt"), "directory") == "/tmp/ckpt"
    assert check.devices(np.array(jax.devices()).reshape(2, 4)) == tuple(jax.devices())
    assert check.devices_of(None) == tuple(jax.devices())
    assert check.non_negative_number(0, "tolerance") == 0
    assert check.transformation(TX) is TX
    spec = P(("dp", "tp"), None, P.UNCONSTRAINED)
    assert check.named_sharding_of(mesh_dp_tp(), spec, "spec").spec == spec
    assert check.pairs([["w", P()]], "rules", "(regex, spec)", "[]") == (("w", P()),)
