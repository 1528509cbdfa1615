"""Constraints mean what Flax's mean: a differential test against ``nn.with_logical_constraint``.

Each case lowers the same function twice, once constrained by ``constrain`` and once by Flax's
``nn.with_logical_constraint``, under the same mesh and rules, and compares the sharding
constraints the two programs contain (shapes are chosen so that every rule divides, where the
library's shape awareness and Flax agree by construction).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen.spmd import RulesFallback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints

from flax_escale import (
    ShardingCorrectionWarning,
    ShardingResolutionError,
    constrain,
    create_mesh,
    use_sharding,
    with_sharding_constraint,
)

RULES = [("batch", "fsdp"), ("hidden_state", "tp"), ("mlp_intermediate", "tp")]
X = jnp.ones((8, 16))


def constraints(fn, x=X):
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


def test_unconstrained_in_a_spec_stays_unconstrained(mesh):
    with jax.set_mesh(mesh):
        ours = constraints(lambda x: with_sharding_constraint(x * 2, P(P.UNCONSTRAINED, "tp")))
        jax_own = constraints(
            lambda x: jax.lax.with_sharding_constraint(x * 2, P(P.UNCONSTRAINED, "tp"))
        )
    assert len(ours) == 1
    assert ours == jax_own


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
            nn.with_logical_constraint(X, names, fallback=RulesFallback.RAISE_ERROR)
        with pytest.raises(
            ShardingResolutionError, match=r"logical name 'embed' has no rule.*\n.*RAISE_ERROR"
        ):
            constrain(X, names, fallback=RulesFallback.RAISE_ERROR)


def test_only_rule_not_dividing_warns_instead_of_dropping_in_silence(devices):
    mesh = create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(ShardingCorrectionWarning, match=r"size 6 is not divisible"):
        y = constrain(jnp.ones(6), ("batch",), mesh=mesh)
    assert y.sharding.spec == P(None)
    with pytest.raises(ShardingResolutionError, match=r"\('batch',\) with shape \(6,\)"):
        constrain(jnp.ones(6), ("batch",), mesh=mesh, strict=True)


def test_logical_to_mesh_sharding_agrees_with_flax(mesh):
    from flax_escale import logical_to_mesh_sharding

    specs = {"w": P("batch", "hidden_state"), "b": P("mlp_intermediate"), "s": None}
    ours = logical_to_mesh_sharding(specs, mesh, RULES)
    flax = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    assert jax.tree.map(lambda s: s.spec, ours) == jax.tree.map(lambda s: s.spec, flax)


def test_logical_to_mesh_sharding_reads_annotated_variables(mesh):
    from flax_escale import logical_to_mesh_sharding

    # 6 is not divisible by tp=2's partner fsdp=4: shape-aware where Flax's cannot be.
    model = nn.Dense(
        16,
        kernel_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed", "hidden_state")),
    )
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 6)))
    with pytest.warns(ShardingCorrectionWarning, match=r"logical name 'embed' has no rule"):
        shardings = logical_to_mesh_sharding(abstract, mesh, RULES)
    assert shardings["params"]["kernel"].spec == P(None, "tp")
    assert shardings["params"]["bias"].spec == P(None)
