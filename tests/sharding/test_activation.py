"""Tests of ``constrain`` (``flax_escale/sharding/_activation.py``): activations constrained by
logical names, in and out of ``jax.jit``, on Auto and Explicit axes; the mistakes it refuses.

Constraints mean what Flax's mean: the differential cases lower the same function twice, once
constrained by ``constrain`` and once by Flax's ``nn.with_logical_constraint``, under the same
mesh and rules, and compare the sharding constraints the two programs contain (shapes are chosen
so that every rule divides, where the library's shape awareness and Flax agree by construction).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen.spmd import RulesFallback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import MISTAKE, T, X, case, mesh5, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    constrain,
    create_mesh,
    use_sharding,
)

AXIS_TYPES = ["auto", "explicit"]
RULES = [("batch", "fsdp"), ("hidden_state", "tp"), ("mlp_intermediate", "tp")]
ACTIVATIONS = jnp.ones((8, 16))


def _equivalent(array, mesh, spec):
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_in_jit_reaches_the_compiled_program(axis_types):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    x = jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16)

    @jax.jit
    def f(x):
        return constrain(jnp.sin(x), ("batch", "sequence", "hidden_state"))

    with jax.set_mesh(mesh):
        y = f(x)
        lowered = f.lower(x)
        compiled = lowered.compile()
        compiled_text = compiled.as_text()
    expected = P(("fsdp", "dp"), "sp", "tp")
    assert _equivalent(y, mesh, expected)
    assert y.addressable_shards[0].data.shape == (2, 4, 8)
    # On Explicit axes those of size 1 (dp, sp) stay out of the type: JAX would count them.
    layout = (
        '[{"fsdp"}, {}, {"tp"}]' if axis_types == "explicit" else '[{"fsdp", "dp"}, {"sp"}, {"tp"}]'
    )
    assert sharding_constraints(lowered.as_text()) == [(layout, "8x4x16xf32")]
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, expected), 3)
    assert "f32[2,4,8]" in compiled_text  # the per-device shape in the partitioned program
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(jnp.sin)(x)))


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_outside_jit_and_with_explicit_mesh(axis_types):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    y = constrain(np.ones((8, 16)), ("hidden_state", "mlp_intermediate"), mesh=mesh)
    assert _equivalent(y, mesh, P(("fsdp", "sp"), "tp"))


def test_constrain_is_corrected_for_the_shape():
    mesh = create_mesh((1, 2, 1, 4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingCorrectionWarning)  # a fallback is not a warning
        y = constrain(jnp.ones((6,)), ("hidden_state",), mesh=mesh)
    assert _equivalent(y, mesh, P("fsdp"))


def test_constrain_uses_the_given_or_context_rules():
    mesh = create_mesh((2, 4), ("data", "model"))
    x = jnp.ones((8, 8))
    y = constrain(x, ("embed", "mlp"), rules=[("embed", "data"), ("mlp", "model")], mesh=mesh)
    assert _equivalent(y, mesh, P("data", "model"))
    with nn.logical_axis_rules([("embed", "model")]), jax.set_mesh(mesh):
        z = constrain(x, (None, "embed"))
    assert _equivalent(z, mesh, P(None, "model"))
    renamed = PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    w = constrain(x, ("vocab", None), rules=renamed, mesh=mesh)
    assert _equivalent(w, mesh, P("model", None))


def test_constrain_unknown_names_warn_or_raise():
    mesh = create_mesh()
    with pytest.warns(ShardingCorrectionWarning, match=r"logical name 'embed' has no rule"):
        constrain(jnp.ones((8, 8)), ("batch", "embed"), mesh=mesh)
    with pytest.raises(ShardingResolutionError, match=r"logical name 'embed' has no rule"):
        constrain(jnp.ones((8, 8)), ("batch", "embed"), mesh=mesh, strict=True)


def test_constrain_without_a_mesh_is_the_identity():
    x = jnp.ones((4, 4))
    assert constrain(x, ("batch", "hidden_state")) is x


# --- the same constraints as Flax's -----------------------------------------------------


def constraints(fn, x=ACTIVATIONS):
    """The sharding constraints in ``jax.jit(fn)``'s lowered program."""
    return sharding_constraints(jax.jit(fn).lower(x).as_text())


def both(names, **kwargs):
    ours = constraints(lambda x: constrain(x * 2, names, **kwargs))
    flax = constraints(lambda x: nn.with_logical_constraint(x * 2, names, **kwargs))
    return ours, flax


def test_the_constraint_is_in_the_program(mesh):
    with use_sharding(mesh, RULES):
        ours, flax = both(("batch", "hidden_state"))
    assert len(ours) == 1
    assert ours == flax
    assert ours == [('[{"fsdp"}, {"tp"}]', "8x16xf32")]


def test_none_adds_no_constraint(mesh):
    with use_sharding(mesh, RULES):
        ours, flax = both(None)
    assert ours == flax == []


def test_unconstrained_stays_unconstrained(mesh):
    names = (P.UNCONSTRAINED, "hidden_state")
    with use_sharding(mesh, RULES):
        ours, flax = both(names)
    assert len(ours) == 1
    assert ours == flax
    # Open (unconstrained) first dimension, not a closed replicated one.
    assert ours == [('[{?}, {"tp"}]', "8x16xf32")]
    with use_sharding(mesh, RULES):
        closed = constraints(lambda x: constrain(x * 2, (None, "hidden_state")))
    assert closed != ours


def test_unconstrained_keeps_an_explicit_sharding(devices):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
    x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("fsdp", None)))

    @jax.jit
    def f(x):
        return constrain(x * 2, (P.UNCONSTRAINED, "hidden_state"), rules=RULES)

    with jax.set_mesh(mesh):
        y = f(x)
    assert y.sharding.spec == P("fsdp", "tp")
    placed = constrain(x, (P.UNCONSTRAINED, "hidden_state"), rules=RULES, mesh=mesh)
    assert placed.sharding.spec == P("fsdp", "tp")
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(x))


def test_an_empty_rules_context_means_no_rules(mesh):
    with jax.set_mesh(mesh), nn.logical_axis_rules(()):
        ours, flax = both(("batch", "hidden_state"))
    assert ours == flax == []


def test_unknown_names_are_unsharded_with_a_warning(mesh):
    names = ("batch", "embed")
    with use_sharding(mesh, RULES):
        with pytest.warns(ShardingCorrectionWarning, match=r"logical name 'embed' has no rule"):
            ours = constraints(lambda x: constrain(x * 2, names))
        flax = constraints(lambda x: nn.with_logical_constraint(x * 2, names))
    assert len(ours) == 1
    assert ours == flax


def test_fallback_no_constraint(mesh):
    names = ("batch", "embed")
    with use_sharding(mesh, RULES):
        ours, flax = both(names, fallback=RulesFallback.NO_CONSTRAINT)
    assert ours == flax == []


def test_fallback_raise_error(mesh):
    names = ("batch", "embed")
    with use_sharding(mesh, RULES):
        with pytest.raises(ValueError, match="embed"):
            nn.with_logical_constraint(ACTIVATIONS, names, fallback=RulesFallback.RAISE_ERROR)
        with pytest.raises(
            ShardingResolutionError, match=r"logical name 'embed' has no rule.*\n.*RAISE_ERROR"
        ):
            constrain(ACTIVATIONS, names, fallback=RulesFallback.RAISE_ERROR)


def test_only_rule_not_dividing_warns_instead_of_dropping_in_silence(devices):
    mesh = create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(ShardingCorrectionWarning, match=r"size 6 is not divisible"):
        y = constrain(jnp.ones(6), ("batch",), mesh=mesh)
    assert y.sharding.spec == P(None)
    with pytest.raises(ShardingResolutionError, match=r"\('batch',\) with shape \(6,\)"):
        constrain(jnp.ones(6), ("batch",), mesh=mesh, strict=True)


# --- mistakes: each raises a library error naming the argument and showing the value ----

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
    # --- a wrong type where a mesh is expected ---------------------------------------------
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
        lambda: fe.constrain(X, ("batch", None), rules=[("kernel",)], mesh=mesh_dp_tp()),
        T,
        "rules",
        "('kernel',)",
        "pair",
        id="constrain-rule-one-element",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
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
    # --- an AbstractMesh where a concrete array must be placed, outside jax.jit ---------------
    case(
        lambda: fe.constrain(X, ("batch", None), mesh=mesh5().abstract_mesh),
        T,
        "mesh",
        "AbstractMesh",
        r"pass the concrete jax.sharding.Mesh",
        id="constrain-abstract-mesh-outside-jit",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
