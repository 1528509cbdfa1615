"""Mistakes users make with placement at run time, one case each.

Cases for ``constrain``, ``with_sharding_constraint``, ``use_sharding``, ``reshard_tree``,
``apply_spec``, regex rules (``specs_from_regex``) and ``spec_from_shape``. What a case asserts,
and the rest of the table: ``support/mistakes.py``.
"""

import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import (
    MISTAKE,
    T,
    X,
    case,
    enter,
    mesh5,
    mesh_dp_tp,
    params,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import _regex as user_patterns
from flax_escale import sharding as fes

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fe.constrain(X, "batch"),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="constrain-string-no-mesh",
    ),
    case(
        lambda: fe.constrain(X, "batch", mesh=mesh_dp_tp()),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="constrain-string",
    ),
    case(
        lambda: enter(fe.use_sharding(mesh_dp_tp(), "batch")),
        T,
        "rules",
        "'batch'",
        r"pairs",
        id="use_sharding-rules-string",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, "dp", mesh=mesh_dp_tp()),
        T,
        "sharding",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="with_sharding_constraint-spec-string",
    ),
    # --- a wrong type where a mesh is expected ---------------------------------------------
    case(
        lambda: enter(fe.use_sharding(None)),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="use_sharding-none",
    ),
    case(
        lambda: enter(fe.use_sharding("dp:8")),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="use_sharding-string",
    ),
    case(
        lambda: enter(fe.use_sharding({"dp": 2, "tp": 4})),
        T,
        "mesh",
        "dict",
        r"create_mesh\(",
        id="use_sharding-dict",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="with_sharding_constraint-mesh-string",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=8),
        T,
        "mesh",
        "int 8",
        r"create_mesh\(",
        id="with_sharding_constraint-mesh-int",
    ),
    case(
        lambda: fe.constrain(X, ("batch",), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="constrain-mesh-string",
    ),
    # --- malformed rules, named where they enter -------------------------------------------
    case(
        lambda: enter(fe.use_sharding(mesh_dp_tp(), [("batch", ("dp", 3))])),
        T,
        "rules",
        "('batch', ('dp', 3))",
        "a name",
        id="use_sharding-rule-tuple-with-int",
    ),
    case(
        lambda: fe.constrain(X, ("batch", None), rules=[("kernel",)], mesh=mesh_dp_tp()),
        T,
        "rules",
        "('kernel',)",
        "pair",
        id="constrain-rule-one-element",
    ),
    # --- regex partition rules and pattern strings -----------------------------------------
    case(
        lambda: fes.specs_from_regex("kernel", params()),
        T,
        "rules",
        "'kernel'",
        r"\[\('kernel\$', PartitionSpec",
        id="match_rules-bare-string",
    ),
    case(
        lambda: fes.specs_from_regex(("w", P("tp")), params()),
        T,
        "rules",
        "('w', P('tp',))",
        r"pass \[\('w', P\('tp',\)\)\]",
        id="match_rules-bare-pair",
    ),
    case(
        lambda: fes.specs_from_regex([("w",)], params()),
        T,
        "rules",
        "('w',)",
        "not a pair",
        id="match_rules-one-element",
    ),
    case(
        lambda: fes.specs_from_regex([(3, P())], params()),
        T,
        "rules",
        "int 3",
        "must be a string",
        id="match_rules-regex-int",
    ),
    case(
        lambda: fes.specs_from_regex({"w": P("tp")}, params()),
        T,
        "rules",
        "{'w': P('tp',)}",
        "items in order",
        id="match_rules-dict",
    ),
    case(
        lambda: fes.specs_from_regex([("w", "tp")], params()),
        fes.PartitionRuleError,
        "rules",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="match_rules-spec-string",
    ),
    case(
        lambda: fes.specs_from_regex([("w", P("tp", "tp"))], params()),
        fes.PartitionRuleError,
        "rules",
        "P('tp', 'tp')",
        "at most once",
        id="match_rules-axis-twice",
    ),
    case(
        lambda: fes.specs_from_regex([("w[", P())], params()),
        fes.PartitionRuleError,
        "rules",
        "'w['",
        r"re\.escape",
        id="match_rules-bad-regex",
    ),
    case(
        lambda: fes.specs_from_regex([("w", P())], "params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="match_rules-tree-string",
    ),
    case(
        lambda: fes.specs_from_regex([("w", P())], None),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="match_rules-tree-none",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fe.reshard_tree(params(), P("dp", "dp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "P('dp', 'dp')",
        "twice",
        id="reshard_tree-axis-twice",
    ),
    case(
        lambda: fe.reshard_tree(params(), P("fsdp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "'fsdp'",
        r"the mesh's axes \('dp', 'tp'\)",
        id="reshard_tree-axis-not-in-mesh",
    ),
    case(
        lambda: fe.reshard_tree(params(), {"v": P()}, mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "{'v': P()}",
        "same keys",
        id="reshard_tree-other-keys",
    ),
    case(
        lambda: fe.reshard_tree({"w": jnp.zeros((3, 4))}, P("dp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "(3, 4)",
        "divide its dimensions",
        id="reshard_tree-indivisible",
    ),
    case(
        lambda: fe.reshard_tree(params(), "tp", mesh=mesh_dp_tp()),
        T,
        "shardings",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="reshard_tree-string",
    ),
    case(
        lambda: fe.reshard_tree("params", P(), mesh=mesh_dp_tp()),
        T,
        "tree",
        "'params'",
        "not its name",
        id="reshard_tree-tree-string",
    ),
    case(
        lambda: fe.reshard_tree(params(), P(), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="reshard_tree-mesh-string",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=mesh_dp_tp(), strict="yes"),
        T,
        "strict",
        "'yes'",
        "True or False",
        id="with_sharding_constraint-strict-string",
    ),
    case(
        lambda: fe.with_sharding_constraint("x", P("dp"), mesh=mesh_dp_tp()),
        T,
        "x",
        "'x'",
        "arrays to constrain",
        id="with_sharding_constraint-x-string",
    ),
    case(
        lambda: fe.with_sharding_constraint({"a": X}, {"b": P()}, mesh=mesh_dp_tp()),
        fe.EscaleError,
        "sharding",
        "{'b': P()}",
        "same keys",
        id="with_sharding_constraint-other-keys",
    ),
    case(
        lambda: fe.constrain(X, ("batch", None), mesh=mesh5(), fallback="unsharded"),
        T,
        "fallback",
        "'unsharded'",
        r"RulesFallback\.AXIS_IS_UNSHARDED",
        id="constrain-fallback-string",
    ),
    case(
        lambda: fe.constrain(X, ("batch", None), mesh=mesh5(), strict="yes"),
        T,
        "strict",
        "'yes'",
        "True or False",
        id="constrain-strict-string",
    ),
    case(
        lambda: fe.constrain(None, ("batch",), mesh=mesh5()),
        T,
        "x",
        "None",
        "activation",
        id="constrain-x-none",
    ),
    case(
        lambda: enter(fe.use_sharding(mesh5(), strict="yes")),
        T,
        "strict",
        "'yes'",
        "True or False",
        id="use_sharding-strict-string",
    ),
    case(
        lambda: fes.apply_spec(jnp.zeros((8, 4)), "dp", mesh_dp_tp()),
        T,
        "spec",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="apply_spec-string",
    ),
    case(
        lambda: fes.apply_spec(jnp.zeros((8, 4)), P("dp", "dp"), mesh_dp_tp()),
        fe.EscaleError,
        "spec",
        "P('dp', 'dp')",
        "twice",
        id="apply_spec-axis-twice",
    ),
    case(
        lambda: fes.apply_spec(jnp.zeros((8, 4)), P("dp"), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="apply_spec-mesh-string",
    ),
    # --- an AbstractMesh where a concrete array must be placed, outside jax.jit ---------------
    case(
        lambda: fe.constrain(X, ("batch", None), mesh=mesh5().abstract_mesh),
        T,
        "mesh",
        "AbstractMesh",
        r"pass the concrete jax.sharding.Mesh",
        id="constrain-abstract-mesh-outside-jit",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=mesh_dp_tp().abstract_mesh),
        T,
        "mesh",
        "AbstractMesh",
        r"or constrain inside a jitted function",
        id="with_sharding_constraint-abstract-mesh-outside-jit",
    ),
    case(
        lambda: fes.spec_from_shape(8, mesh_dp_tp()),
        T,
        "shape",
        "int 8",
        r"pass \(8,\)",
        id="spec_from_shape-shape-int",
    ),
    case(
        lambda: fes.spec_from_shape((8, 4), None),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="spec_from_shape-mesh-none",
    ),
    case(
        lambda: fes.spec_from_shape((8, 4), mesh_dp_tp(), min_shard_size="1"),
        T,
        "min_shard_size",
        "'1'",
        "pass the int 1",
        id="spec_from_shape-min-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


# --- a user's regular expression that backtracks without end is bounded ---------------------

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
        "specs_from_regex": lambda: fes.specs_from_regex([(SLOW, P())], tree),
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
        "specs_from_regex": lambda: fes.specs_from_regex([(NESTED, P())], tree),
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


def test_two_arrays_of_one_path_are_refused_rather_than_matched_alike():
    tree = {"a/b": np.zeros((8, 8)), "a": {"b": np.ones((8, 8))}}
    with pytest.raises(fe.EscaleError, match=r"two arrays have the path 'a/b' \(a key holding"):
        fes.specs_from_regex([("a/b", P("fsdp")), (".*", P())], tree)
