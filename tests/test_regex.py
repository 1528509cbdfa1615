"""Tests of the bound on users' regular expressions (``flax_escale/_regex.py``): a pattern that
backtracks without end is an error naming the pattern, the path and the bound, on every surface
that matches users' patterns (regex partition rules, ``match_partition_rules``, the pattern-based
spec, ``sharded_module`` patterns and ``overrides``).
"""

import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import _regex as user_patterns

SLOW = "(a|aa)+$"  # exponential in re on a path of a's that does not end in one
LONG = "a" * 60 + "b"


class _Named(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name=LONG)(x)


def _slow_everywhere():
    # (create_pattern_based_partition_spec compiles its regexes as these rules do; its syntax
    # splits on "|", so the pattern cannot be written there.)
    tree = {LONG: np.zeros((8, 8))}
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    return {
        "match_partition_rules": lambda: fe.eformer.match_partition_rules([(SLOW, P())], tree),
        "specs_from_regex": lambda: fe.sharding.specs_from_regex([(SLOW, P())], tree),
        "overrides": lambda: fe.plan_sharding(
            _Named(), mesh, jax.random.key(0), jnp.ones((2, 8)), overrides={SLOW: (None, None)}
        ),
        "sharded_module": lambda: fe.plan_sharding(
            fe.sharded_module({SLOW: (None, None)})(type("Slow", (_Named,), {}))(),
            mesh,
            jax.random.key(0),
            jnp.ones((2, 8)),
        ),
    }


@pytest.mark.parametrize("surface", list(_slow_everywhere()))
def test_a_pattern_that_backtracks_without_end_is_an_error_within_seconds(surface):
    start = time.perf_counter()
    with pytest.raises(
        fe.EscaleError, match=re.escape(f"the pattern {SLOW!r} took over 1 s against")
    ):
        _slow_everywhere()[surface]()
    assert time.perf_counter() - start < 30  # re alone takes minutes (2**60 paths)


# The issue's own pattern, (a+)+ searched for in a long path, on the surfaces that search (the
# regex package fullmatches it in polynomial time, so sharded_module patterns and overrides,
# which fullmatch, answer "no match" there, and say so: see tests/frontend/test_patterns.py).
NESTED = "(a+)+$"
LONG_PATH = "a" * 2000 + "b"  # well over the bound below on any machine


def _searching_surfaces():
    tree = {LONG_PATH: np.zeros((8, 8))}
    return {
        "match_partition_rules": lambda: fe.eformer.match_partition_rules([(NESTED, P())], tree),
        "specs_from_regex": lambda: fe.sharding.specs_from_regex([(NESTED, P())], tree),
        "pattern_based": lambda: fe.eformer.create_pattern_based_partition_spec(f"{NESTED}->fsdp")(
            LONG_PATH, np.zeros((8, 8))
        ),
    }


@pytest.mark.parametrize("surface", list(_searching_surfaces()))
def test_a_nested_repetition_past_the_bound_is_an_error_naming_pattern_path_and_bound(
    surface, monkeypatch
):
    monkeypatch.setattr(user_patterns, "MATCH_SECONDS", 0.05)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(f"the pattern {NESTED!r} took over 0.05 s against {LONG_PATH!r}: a ")
        + r"repetition of a repetition .* write it with one repetition",
    ):
        _searching_surfaces()[surface]()
