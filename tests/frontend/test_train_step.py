"""Training steps compile once: the states the library builds are fixed points of a step.

A jitted step whose output state differs from its input state in type (a Python ``int`` step
that comes back an ``int32`` array) or sharding (a spec the compiler chose) compiles a second
program at the second step. Each test runs three steps and counts XLA compilations.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.compiles import compiles_of, counting

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale.t5x import Partitioner

pytestmark = pytest.mark.slow

KEY = jax.random.key(0)
HIDDEN = ("fsdp", "sp")
AXES = {
    "wi/kernel": ("hidden_state", "mlp_intermediate"),
    "wi/bias": ("mlp_intermediate",),
    "wo/kernel": ("mlp_intermediate", "hidden_state"),
    "wo/bias": ("hidden_state",),
}


class Mlp(nn.Module):
    """Kernels annotated, biases not: the plan replicates the biases."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="wi")(x))
        return nn.Dense(x.shape[-1], name="wo")(h)


Annotated = fe.sharded_module(AXES)(type("Annotated", (Mlp,), {}))
Partial = fe.sharded_module({k: v for k, v in AXES.items() if k.endswith("kernel")})(
    type("Partial", (Mlp,), {})
)


@fe.sharded_module(AXES)
class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(16, 32, rngs=rngs)
        self.wo = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.wo(nnx.relu(self.wi(x)))


@pytest.fixture
def batch(mesh):
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    return jax.device_put(x, NamedSharding(mesh, P("fsdp")))


def train_step(state, x):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def three_steps(step, state, x):
    """The state and losses after three steps, and how many times ``train_step`` compiled."""
    losses = []
    with counting() as seen:
        for _ in range(3):
            state, loss = step(state, x)
            losses.append(float(loss))
    return state, losses, compiles_of(seen, "train_step")


def shardings(tree):
    return jax.tree.map(lambda leaf: leaf.sharding, tree)


def test_linen_train_state_compiles_once_where_an_int_step_compiled_twice(mesh, batch):
    state = fel.init_train_state(Annotated(), mesh, KEY, batch, tx=optax.adam(1e-2))
    assert state.step.dtype == jnp.int32
    assert state.step.sharding == NamedSharding(mesh, P())
    # The step TrainState.create makes (and init_train_state made): a second compile.
    _, int_losses, compiles = three_steps(
        jax.jit(train_step, donate_argnums=0), state.replace(step=0), batch
    )
    assert compiles == 2
    state = fel.init_train_state(Annotated(), mesh, KEY, batch, tx=optax.adam(1e-2))
    state, losses, compiles = three_steps(jax.jit(train_step, donate_argnums=0), state, batch)
    assert compiles == 1
    assert int(state.step) == 3
    np.testing.assert_allclose(losses, int_losses, rtol=1e-6)


def test_nnx_model_and_optimizer_compile_once(mesh, batch):
    model = fe.init_sharded(NnxMlp, mesh, 0)
    optimizer = fen.init_optimizer(model, optax.adam(1e-2))
    assert optimizer.step.get_value().sharding == NamedSharding(mesh, P())

    def train_step(state, x):
        model, optimizer = state
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
        optimizer.update(model, grads)
        return (model, optimizer), loss

    (model, optimizer), losses, compiles = three_steps(
        jax.jit(train_step, donate_argnums=0), (model, optimizer), batch
    )
    assert compiles == 1
    assert int(optimizer.step.get_value()) == 3
    assert losses[-1] < losses[0]


def test_t5x_partitioner_states_compile_once(mesh, batch):
    partitioner = Partitioner(mesh=mesh)
    model, tx = Annotated(), optax.adam(1e-2)

    def init(rng):
        params = model.init(rng, jnp.zeros((8, 16)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    axes = partitioner.get_mesh_axes(jax.eval_shape(init, KEY))
    p_init = partitioner.partition(init, None, axes)
    p_step = partitioner.partition(
        train_step, (axes, partitioner.data_partition_spec), (axes, None), donate_argnums=(0,)
    )
    plain = jax.jit(train_step, donate_argnums=0)
    host = jax.tree.map(np.asarray, nn.unbox(jax.jit(init)(KEY)))
    states = {
        "partitioned init, partitioned step": (p_init(KEY), p_step),
        "partitioned init, plain step": (p_init(KEY), plain),
        "moved to devices, partitioned step": (
            partitioner.move_params_to_devices(host, axes),
            p_step,
        ),
        "moved to devices, plain step": (partitioner.move_params_to_devices(host, axes), plain),
    }
    for name, (state, step) in states.items():
        _, _, compiles = three_steps(step, state, batch)
        assert compiles == 1, name


def test_plain_jit_rewrites_the_plan_specs_and_compiles_again(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.adam(1e-2))
    assert state.params["wi"]["kernel"].sharding.spec == P(HIDDEN, "tp")
    state, _, compiles = three_steps(jax.jit(train_step, donate_argnums=0), state, batch)
    # sp has size 1: the compiler's equivalent spec drops it; and it splits a replicated bias.
    assert state.params["wi"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert state.params["wo"]["bias"].sharding.spec != P(None)
    assert compiles == 2


def test_jit_train_step_keeps_the_plan_specs_and_compiles_once(mesh, batch):
    tx = optax.adam(1e-2)
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=tx)
    planned = shardings(state)
    step = fel.jit_train_step(train_step, state, has_aux=True)
    state, losses, compiles = three_steps(step, state, batch)
    assert compiles == 1
    assert shardings(state) == planned
    assert state.params["wi"]["kernel"].sharding.spec == P(HIDDEN, "tp")
    assert state.params["wo"]["bias"].sharding.spec == P(None)

    reference = fel.init_train_state(Partial(), mesh, KEY, batch, tx=tx)
    reference, ref_losses, _ = three_steps(jax.jit(train_step), reference, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_jit_train_step_places_the_batch_and_donates_the_state(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    data = fe.batch_sharding(mesh, (8, 16), ("batch", None))
    step = fel.jit_train_step(lambda s, x: train_step(s, x)[0], state, batch_sharding=data)
    compiled = step.lower(state, np.asarray(batch)).compile()
    assert compiled.input_shardings[0][1] == data
    kernel = state.params["wi"]["kernel"]
    new = step(state, np.asarray(batch))
    assert kernel.is_deleted()
    assert new.params["wi"]["kernel"].sharding == kernel.sharding


def test_jit_train_step_needs_arrays_with_shardings(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    with pytest.raises(fe.EscaleTypeError, match=r"state\.step is 0, not an array"):
        fel.jit_train_step(train_step, state.replace(step=0))


def test_a_step_called_again_on_the_donated_state_is_refused_naming_it(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    step = fel.jit_train_step(train_step, state, has_aux=True)
    new, _ = step(state, batch)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape("jit_train_step: state.step was donated to an earlier call of this step"),
    ):
        step(state, batch)  # the old state, whose buffers the first call took
    newer, _ = step(new, batch)
    assert int(newer.step) == 2


@pytest.mark.parametrize(
    ("make_step", "has_aux", "message"),
    [
        (lambda: lambda s, x: train_step(s, x)[0], True, r"must return \(new_state, aux\)"),
        (lambda: train_step, False, r"shaped like state \(a \(new_state, aux\) pair\? pass has"),
        (lambda: lambda s, x: (train_step(s, x)[1],), False, r"a new state shaped like state"),
    ],
    ids=["aux missing", "aux not declared", "no state"],
)
def test_a_step_that_returns_the_wrong_thing_says_what_it_returned(
    mesh, batch, make_step, has_aux, message
):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    step = fel.jit_train_step(make_step(), state, has_aux=has_aux)
    with pytest.raises(fe.EscaleTypeError, match=message):
        step(state, batch)


def test_jit_train_step_refuses_what_is_not_a_step_or_a_sharding(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    with pytest.raises(fe.EscaleTypeError, match=r"step_fn must be a function, got the string"):
        fel.jit_train_step("train_step", state)
    with pytest.raises(fe.EscaleTypeError, match=r"batch_sharding: .* is a PartitionSpec"):
        fel.jit_train_step(train_step, state, batch_sharding=P("dp"))


def test_a_step_that_cannot_take_state_and_batch_is_refused_naming_its_signature(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    with pytest.raises(
        fe.EscaleTypeError,
        match=re.escape(
            "jit_train_step: <lambda>(state) cannot be called as step_fn(state, batch)"
        ),
    ):
        fel.jit_train_step(lambda state: state, state)
    with pytest.raises(fe.EscaleTypeError, match=r"missing a required argument: 'rng'"):
        fel.jit_train_step(lambda state, batch, rng: state, state)


def test_a_loss_that_is_not_a_scalar_is_named_with_its_shape(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))

    def per_example_loss_step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2, axis=-1))(
            state.params
        )
        return state.apply_gradients(grads=grads)

    step = fel.jit_train_step(per_example_loss_step, state)
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"gradient of a loss that is not a scalar \(Output had shape: \(8,\)\); reduce it",
    ):
        step(state, batch)


def test_a_state_of_another_structure_is_refused_before_jax_compares_shardings(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    step = fel.jit_train_step(train_step, state, has_aux=True)
    # The same model and optimizer made again: another tx object, so another static field.
    other = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    with pytest.raises(
        fe.EscaleTypeError, match=r"the state passed is not shaped like the state the step"
    ):
        step(other, batch)
    new, _ = step(state, batch)
    assert int(new.step) == 1
