import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints

from flax_escale import (
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    constrain,
    create_mesh,
    logical_to_mesh_axes,
    use_sharding,
    with_sharding_constraint,
)
from flax_escale.resolve import as_logical_rules

AXIS_TYPES = ["auto", "explicit"]
RULES = [("batch", ("fsdp", "dp")), ("hidden_state", "tp"), ("mlp_intermediate", ["fsdp", "sp"])]


def _mesh(axis_types="auto"):
    return create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)


def _current_rules():
    return tuple(nn.get_logical_axis_rules())


def test_sets_mesh_and_rules_and_yields_frozen_rules(devices):
    mesh = _mesh()
    with use_sharding(mesh, RULES) as rules:
        assert rules == (
            ("batch", ("fsdp", "dp")),
            ("hidden_state", "tp"),
            ("mlp_intermediate", ("fsdp", "sp")),
        )
        assert rules == as_logical_rules(RULES)
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        assert _current_rules() == rules


def test_default_rules_are_partition_axis_rules(devices):
    mesh = _mesh()
    with use_sharding(mesh) as rules:
        assert rules == PartitionAxis().logical_axis_rules()
        assert _current_rules() == rules
        assert nn.logical_to_mesh_axes(("batch", "hidden_state")) == P(("fsdp", "dp"), "tp")


def test_partition_axis_is_translated(devices):
    mesh = _mesh()
    paxis = PartitionAxis(hidden_state_axis="fsdp", mlp_intermediate_axis="tp")
    with use_sharding(mesh, paxis) as rules:
        assert rules == as_logical_rules(paxis)
        assert rules == paxis.logical_axis_rules()
        assert ("hidden_state", "fsdp") in rules
        assert _current_rules() == rules
        assert logical_to_mesh_axes(("hidden_state", "mlp_intermediate")) == P("fsdp", "tp")


def test_defaults_to_the_rules_already_set(devices):
    mesh = _mesh()
    outer = (("hidden_state", "sp"),)
    with nn.logical_axis_rules(outer), use_sharding(mesh) as rules:
        assert rules == outer
        assert _current_rules() == outer


def test_restores_mesh_and_rules_on_exit(devices):
    mesh = _mesh()
    before_mesh = jax.sharding.get_abstract_mesh()
    before_rules = _current_rules()
    with use_sharding(mesh, RULES):
        pass
    assert jax.sharding.get_abstract_mesh() == before_mesh
    assert _current_rules() == before_rules
    assert jax.sharding.get_abstract_mesh() != mesh.abstract_mesh


def test_restores_on_exception(devices):
    mesh = _mesh()
    before_mesh = jax.sharding.get_abstract_mesh()
    before_rules = _current_rules()
    with pytest.raises(RuntimeError, match="boom"), use_sharding(mesh, RULES):
        raise RuntimeError("boom")
    assert jax.sharding.get_abstract_mesh() == before_mesh
    assert _current_rules() == before_rules


def test_nested_contexts_restore_the_outer_one(devices):
    outer_mesh = _mesh()
    inner_mesh = create_mesh((2, 4), ("dp", "tp"))
    inner_rules = (("hidden_state", "tp"),)
    with use_sharding(outer_mesh, RULES) as outer_rules:
        with use_sharding(inner_mesh, inner_rules):
            assert jax.sharding.get_abstract_mesh() == inner_mesh.abstract_mesh
            assert _current_rules() == inner_rules
        assert jax.sharding.get_abstract_mesh() == outer_mesh.abstract_mesh
        assert _current_rules() == outer_rules


def test_axes_the_mesh_lacks_go_to_none_for_flax(devices):
    mesh = create_mesh((2, 4), ("dp", "tp"))
    rules = [("batch", ("fsdp", "dp")), ("embed", "tp"), ("heads", "sp"), ("kv", None)]
    with contextlib.ExitStack() as stack:
        with pytest.warns(
            ShardingCorrectionWarning,
            match=r"the rules \[\('batch', \('fsdp', 'dp'\)\), \('heads', 'sp'\)\] name mesh "
            r"axes \['fsdp', 'sp'\] that the mesh \{'dp': 2, 'tp': 4\} lacks",
        ):
            frozen = stack.enter_context(use_sharding(mesh, rules))
        assert frozen == (("batch", ("fsdp", "dp")), ("embed", "tp"), ("heads", "sp"), ("kv", None))
        assert _current_rules() == (("batch", None), ("embed", "tp"), ("heads", None), ("kv", None))
        # Flax's own resolution no longer names axes the mesh lacks.
        assert nn.logical_to_mesh_axes(("batch", "heads", "embed")) == P(None, None, "tp")


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_under_jit(devices, axis_types):
    mesh = _mesh(axis_types)
    x = jnp.arange(32.0).reshape(8, 4)

    def f(x):
        return constrain(x * 2, ("batch", "hidden_state"))

    with use_sharding(mesh):
        jitted = jax.jit(f)
        y = jitted(x)
        text = jitted.lower(x).as_text()
    # Explicit axes put open constraints ([{}, {}]) of their own in the program: look for ours,
    # in which size-1 Explicit axes (dp) are left out.
    ours = '[{"fsdp"}, {"tp"}]' if axis_types == "explicit" else '[{"fsdp", "dp"}, {"tp"}]'
    assert (ours, "8x4xf32") in sharding_constraints(text)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tp")), 2)
    assert y.addressable_shards[0].data.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_under_jit_uses_the_given_rules(devices, axis_types):
    mesh = _mesh(axis_types)
    x = jnp.ones((8, 4))

    @jax.jit
    def f(x):
        return constrain(x + 1, ("hidden_state", "mlp_intermediate"))

    with use_sharding(mesh, [("hidden_state", "tp"), ("mlp_intermediate", "fsdp")]):
        y = f(x)
        text = f.lower(x).as_text()
    assert ('[{"tp"}, {"fsdp"}]', "8x4xf32") in sharding_constraints(text)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", "fsdp")), 2)
    assert y.addressable_shards[0].data.shape == (4, 1)


def test_explicit_mesh_puts_sharding_in_the_type(devices):
    mesh = _mesh("explicit")
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    x = jnp.ones((8, 4))
    seen = {}

    @jax.jit
    def f(x):
        y = constrain(x * 3, ("batch", "hidden_state"))
        seen["spec"] = jax.typeof(y).sharding.spec
        return y

    with use_sharding(mesh):
        y = f(x)
    # dp has size 1: in a type it would count as a split (a reduction over it is refused).
    assert seen["spec"] == P("fsdp", "tp")
    assert y.sharding.spec == P("fsdp", "tp")
    np.testing.assert_array_equal(np.asarray(y), np.full((8, 4), 3.0))


def test_without_use_sharding_constrain_does_nothing(devices):
    x = jnp.ones((8, 4))
    f = jax.jit(lambda x: constrain(x * 2, ("batch", "hidden_state")))
    assert "sharding_constraint" not in f.lower(x).as_text()
    y = f(x)
    assert y.addressable_shards[0].data.shape == (8, 4)


def test_flax_with_logical_constraint_takes_effect_on_auto_mesh(devices):
    mesh = _mesh("auto")
    x = jnp.arange(32.0).reshape(8, 4)

    @jax.jit
    def f(x):
        return nn.with_logical_constraint(x * 2, ("batch", "hidden_state"))

    with use_sharding(mesh):
        y = f(x)
        text = f.lower(x).as_text()
    assert sharding_constraints(text) == [('[{"fsdp", "dp"}, {"tp"}]', "8x4xf32")]
    assert y.addressable_shards[0].data.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_flax_with_logical_constraint_on_a_mesh_lacking_axes(devices):
    # Default rules name fsdp and sp, which this mesh lacks: Flax must not fail on them.
    mesh = create_mesh((2, 4), ("dp", "tp"))
    x = jnp.ones((8, 8))

    @jax.jit
    def f(x):
        return nn.with_logical_constraint(x, ("batch", "hidden_state"))

    with contextlib.ExitStack() as stack:
        with pytest.warns(ShardingCorrectionWarning, match=r"mesh axes \['ep', 'fsdp', 'sp'\]"):
            stack.enter_context(use_sharding(mesh))
        y = f(x)
    assert y.addressable_shards[0].data.shape == (8, 2)
    with pytest.raises(ShardingResolutionError, match=r"lacks.*strict=True"):
        use_sharding(mesh, strict=True).__enter__()


def test_flax_module_inside(devices):
    mesh = _mesh("auto")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, use_bias=False)(x)
            return nn.with_logical_constraint(x, ("batch", "mlp_intermediate"))

    x = jnp.ones((8, 4))
    model = Block()
    variables = model.init(jax.random.key(0), x)
    with use_sharding(mesh):
        y = jax.jit(model.apply)(variables, x)
    assert y.shape == (8, 16)
    assert y.addressable_shards[0].data.shape == (2, 8)
    expected = np.asarray(x) @ np.asarray(variables["params"]["Dense_0"]["kernel"])
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_a_function_jitted_once_follows_the_rules_in_force_at_each_call(devices, axis_types):
    mesh = _mesh(axis_types)
    training = [("batch", "fsdp"), ("hidden_state", "tp")]
    decoding = [("batch", None), ("hidden_state", "fsdp")]
    step = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))
    x = jnp.ones((8, 4))
    specs = []
    for rules in (training, decoding, training):
        with use_sharding(mesh, rules):
            specs.append(step(x).sharding.spec)
    assert specs == [P("fsdp", "tp"), P(None, "fsdp"), P("fsdp", "tp")]


def test_one_context_object_can_be_entered_again(devices):
    mesh = _mesh()
    context = use_sharding(mesh, RULES)
    with context as outer:
        with context as inner:
            assert inner == outer == as_logical_rules(RULES)
        assert nn.get_logical_axis_rules() != ()
    with context:
        assert jax.sharding.get_abstract_mesh().shape == mesh.shape
    assert nn.get_logical_axis_rules() == ()


@pytest.mark.parametrize("jitted", [False, True], ids=["placed", "in jit"])
def test_an_unconstrained_dimension_gives_up_the_axis_another_dimension_takes(devices, jitted):
    mesh = create_mesh((1, 8, 1, 1, 1), axis_types="explicit")
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("fsdp")))

    def move(a):
        return with_sharding_constraint(a, P(P.UNCONSTRAINED, "fsdp"))

    with use_sharding(mesh):
        y = (jax.jit(move) if jitted else move)(x)
    assert y.sharding.spec == P(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
