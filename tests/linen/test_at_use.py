"""``gather_at_use``: a Linen train state whose ``apply_fn`` gathers each parameter as read."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.lowered import sharding_constraints

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen._at_use import data_axes
from flax_escale.sizing import Workload

part = nn.with_logical_partitioning


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(
            32,
            kernel_init=part(nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")),
        )(x)
        y = nn.Dense(
            16,
            kernel_init=part(nn.initializers.lecun_normal(), ("mlp_intermediate", "hidden_state")),
        )(jax.nn.relu(h))
        scale = self.param("scale", part(nn.initializers.ones, ("hidden_state",)), (16,))
        return (x + y) * scale, None


class Stack(nn.Module):
    """Two blocks under ``nn.scan`` (the stacked dimension named ``layers``), a norm scale."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(name="blocks")(x, None)
        return x * self.param("final", part(nn.initializers.ones, ("hidden_state",)), (16,))


X = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100


def loss(state, params, x):
    return jnp.mean(state.apply_fn({"params": params}, x) ** 2)


def state_on(mesh, gather_at_use):
    return fel.init_train_state(
        Stack(), mesh, jax.random.key(0), X, tx=optax.sgd(0.1), gather_at_use=gather_at_use
    )


def test_data_axes_are_those_the_batch_and_sequence_are_split_over():
    assert data_axes(fe.PartitionAxis()) == {"dp", "fsdp", "sp"}
    assert data_axes(fe.PartitionAxis(batch_axis="dp")) == {"dp", "sp"}
    assert data_axes([("batch", "data"), ("hidden_state", "model")]) == {"data"}
    assert data_axes(fe.PartitionAxis().with_aliases("t5x")) == {"dp", "fsdp", "sp"}


def test_rules_that_split_no_batch_axis_are_refused(mesh):
    with pytest.raises(
        EscaleError, match=r"gather_at_use: the rules .*'hidden_state'.* no mesh axis"
    ):
        data_axes([("hidden_state", "tp")])
    with pytest.raises(EscaleError, match="nothing to gather the parameters over"):
        fel.init_train_state(
            Stack(),
            mesh,
            jax.random.key(0),
            X,
            tx=optax.sgd(0.1),
            rules=[("hidden_state", "tp")],
            gather_at_use=True,
        )
    with pytest.raises(EscaleError, match="nothing to gather the parameters over"):
        Workload(
            Stack(),
            jax.random.key(0),
            (X,),
            tx=optax.sgd(0.1),
            rules=[("hidden_state", "tp")],
            gather_at_use=True,
        )


def test_each_parameter_is_gathered_over_the_data_axes_where_it_is_read(mesh):
    state = state_on(mesh, True)
    assert state.params["blocks"]["Dense_0"]["kernel"].sharding.spec == jax.P(
        None, ("fsdp", "sp"), "tp"
    )
    x = jax.device_put(X, fe.batch_sharding(mesh, X.shape))
    text = jax.jit(lambda p: loss(state, p, x)).lower(state.params).as_text()
    constraints = sharding_constraints(text)
    # Inside the scanned body, one layer's weights: fsdp gathered, tp kept; the scales whole.
    assert ('[{}, {"tp"}]', "16x32xf32") in constraints
    assert ('[{"tp"}, {}]', "32x16xf32") in constraints
    assert ("[{}]", "16xf32") in constraints
    # Without the option, no parameter is constrained.
    plain = state_on(mesh, False)
    assert (
        sharding_constraints(jax.jit(lambda p: loss(plain, p, x)).lower(plain.params).as_text())
        == []
    )


def test_values_and_gradients_are_those_of_the_plain_apply(mesh):
    gathered, plain = state_on(mesh, True), state_on(mesh, False)
    x = jax.device_put(X, fe.batch_sharding(mesh, X.shape))

    def grad(state):
        return jax.jit(jax.value_and_grad(lambda p: loss(state, p, x)))(state.params)

    value, grads = grad(gathered)
    expected_value, expected_grads = grad(plain)
    assert value == pytest.approx(float(expected_value), rel=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        # Summed in another order (the gradients reduce-scattered from the gathered layout).
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    # The gradients come back in the parameters' own layout (reduce-scattered), so that a
    # step jitted without out_shardings keeps the parameters in it too.
    for got, param in zip(jax.tree.leaves(grads), jax.tree.leaves(gathered.params), strict=True):
        assert got.sharding.is_equivalent_to(param.sharding, param.ndim)


def test_other_params_are_refused_with_the_structure_expected(mesh):
    state = state_on(mesh, True)
    with pytest.raises(EscaleTypeError, match=r"gather_at_use=True.*was given no 'params'"):
        state.apply_fn({}, X)
    with pytest.raises(EscaleTypeError, match=r"was given params of structure .*the model's apply"):
        state.apply_fn({"params": {"final": state.params["final"]}}, X)


def test_the_flag_must_be_a_bool(mesh):
    with pytest.raises(EscaleTypeError, match="gather_at_use"):
        fel.init_train_state(
            Stack(), mesh, jax.random.key(0), X, tx=optax.sgd(0.1), gather_at_use="yes"
        )


def test_a_workload_gathers_only_for_linen():
    with pytest.raises(EscaleTypeError, match="gather_at_use is for Linen models"):
        Workload(
            lambda rngs: None,
            0,
            tx=optax.sgd(0.1),
            batch=(jax.ShapeDtypeStruct((8, 16), jnp.float32),),
            gather_at_use=True,
        )
