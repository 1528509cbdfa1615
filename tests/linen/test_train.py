"""Training steps compile once: the states the library builds are fixed points of a step.

A jitted step whose output state differs from its input state in type (a Python ``int`` step
that comes back an ``int32`` array) or sharding (a spec the compiler chose) compiles a second
program at the second step. Each test runs three steps and counts XLA compilations.
"""

import re
import subprocess
import sys
import textwrap

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
from support import ROOT
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
        match=re.escape("jit_train_step: state.step was donated to an earlier call of a step"),
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
    with pytest.raises(
        fe.EscaleTypeError, match=r"jit_train_step: batch_sharding: P\(.dp.,\) is a PartitionSpec"
    ):
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


# Two threads step from one state, through one step and through two steps built from it, a few
# rounds each. Run in its own process: before the lock, this killed the process (SIGSEGV).
TWO_THREADS = textwrap.dedent(
    """
    import threading

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax

    import flax_escale as fe
    from flax_escale.linen import init_train_state, jit_train_step

    kernel_init = nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
    )
    model, x = nn.Dense(16, use_bias=False, kernel_init=kernel_init), jnp.ones((8, 16))
    mesh = fe.create_mesh((1, 4, 1, 2, 1))


    def step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)


    def fresh():
        return init_train_state(model, mesh, jax.random.key(0), x, tx=optax.sgd(0.1))


    state = fresh()
    # Two step objects on the same state: the threads race through one, then through both.
    steps = [jit_train_step(step, state), jit_train_step(step, state)]
    state = steps[0](state, x)  # compiled before the threads start
    rounds = 0
    for pair in ([steps[0], steps[0]], steps) * 4:
        barrier, results = threading.Barrier(2), []

        def worker(train_step):
            barrier.wait()
            try:
                results.append(train_step(state, x))
            except fe.EscaleError as error:
                results.append(error)

        threads = [threading.Thread(target=worker, args=(each,)) for each in pair]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        errors = [r for r in results if isinstance(r, fe.EscaleError)]
        assert len(results) == 2 and len(errors) == 1, results
        assert "was donated to an earlier call of a step" in str(errors[0]), errors[0]
        (state,) = [r for r in results if not isinstance(r, fe.EscaleError)]
        rounds += 1

    # The winners' chain is the sequential one, bit for bit.
    reference = fresh()
    sequential = jit_train_step(step, reference)
    for _ in range(rounds + 1):
        reference = sequential(reference, x)
    assert int(state.step) == rounds + 1
    np.testing.assert_array_equal(
        np.asarray(state.params["kernel"]), np.asarray(reference.params["kernel"])
    )
    print("rounds:", rounds)
    """
)


def test_two_threads_stepping_from_one_state_one_steps_the_other_is_refused(devices):
    done = subprocess.run(
        [sys.executable, "-c", TWO_THREADS],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "rounds: 8" in done.stdout


def test_a_batch_the_sharding_does_not_divide_is_named_with_its_path_shape_spec_and_mesh(
    mesh, batch
):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    rows = NamedSharding(mesh, P("fsdp"))
    step = fel.jit_train_step(lambda s, b: train_step(s, b["x"]), state, batch_sharding=rows)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "jit_train_step: batch['x'] of shape (6, 16) does not fit batch_sharding P('fsdp',) "
            "on mesh {'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1}: its dimension 0 (6) is "
            "split into 4 parts, which do not divide it; make that dimension a multiple of 4"
        ),
    ):
        step(state, {"x": np.ones((6, 16), np.float32)})
    assert not state.params["wi"]["kernel"].is_deleted()  # refused before anything ran


def test_a_batch_sharding_longer_than_the_batch_rank_is_named(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    too_long = NamedSharding(mesh, P("fsdp", "tp", None))
    step = fel.jit_train_step(train_step, state, has_aux=True, batch_sharding=too_long)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "jit_train_step: batch of shape (8, 16) has 2 dimension(s), fewer than the 3 entries "
            "of batch_sharding P('fsdp', 'tp', None) on mesh {'dp': 1, 'fsdp': 4, 'ep': 1, "
            "'tp': 2, 'sp': 1}; give batch_sharding at most one entry per dimension"
        ),
    ):
        step.lower(state, np.asarray(batch))
    with pytest.raises(fe.EscaleError, match=r"fewer than the 3 entries of batch_sharding"):
        step(state, np.asarray(batch))


def test_a_batch_sharding_on_other_devices_than_the_state_is_refused_when_built(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    half = fe.create_mesh((1, 4, 1, 1, 1), devices=jax.devices()[4:])
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "jit_train_step: batch_sharding['x'] (P('fsdp',) on mesh {'dp': 1, 'fsdp': 4, "
            "'ep': 1, 'tp': 1, 'sp': 1}) is on devices [4, 5, 6, 7], the state on devices "
            "[0, 1, 2, 3, 4, 5, 6, 7]; one step runs on one set of devices: build "
            "batch_sharding on the state's mesh"
        ),
    ):
        fel.jit_train_step(train_step, state, batch_sharding={"x": NamedSharding(half, P("fsdp"))})
    reversed_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("fsdp",))
    with pytest.raises(fe.EscaleError, match=r"\(the same devices in another order\)"):
        fel.jit_train_step(
            train_step, state, batch_sharding=NamedSharding(reversed_mesh, P("fsdp"))
        )


def test_a_batch_committed_to_other_devices_is_named(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    step = fel.jit_train_step(train_step, state, has_aux=True)
    elsewhere = jax.device_put(np.asarray(batch), jax.devices()[7])
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "jit_train_step: batch of shape (8, 16) is on devices [7], the state on devices "
            "[0, 1, 2, 3, 4, 5, 6, 7]; put the batch on the state's mesh: pass batch_sharding="
        ),
    ):
        step(state, elsewhere)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda step, state, x: step(state, batch=x),
            "the step takes (state, batch) by position, got the keyword argument(s) batch=; "
            "call step(state, batch).",
        ),
        (
            lambda step, state, x: step(state, x, KEY),
            "the step takes 2 arguments, (state, batch), got 3; put what else the step needs "
            "in the batch (a dict of arrays) or the state; call step(state, batch).",
        ),
        (
            lambda step, state, x: step(state),
            "the step takes 2 arguments, (state, batch), got 1; call step(state, batch).",
        ),
        (
            lambda step, state, x: step.lower(state, x, KEY),
            "got 3; put what else the step needs in the batch (a dict of arrays) or the state; "
            "call step.lower(state, batch).",
        ),
    ],
    ids=["keyword batch", "third argument", "no batch", "lower, third argument"],
)
def test_a_step_called_other_than_state_and_batch_says_how_to_call_it(mesh, batch, call, message):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    step = fel.jit_train_step(train_step, state, has_aux=True)
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message)):
        call(step, state, batch)
    assert not state.params["wi"]["kernel"].is_deleted()


def test_a_batch_not_shaped_like_batch_sharding_or_a_sharding_that_is_none_is_named(mesh, batch):
    state = fel.init_train_state(Partial(), mesh, KEY, batch, tx=optax.sgd(0.1))
    rows = NamedSharding(mesh, P("fsdp"))
    step = fel.jit_train_step(train_step, state, has_aux=True, batch_sharding={"x": rows})
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"jit_train_step: the batch \(ArrayImpl of shape \(8, 16\) .*\) is not shaped "
        r"like batch_sharding \(dict ",
    ):
        step(state, batch)
    with pytest.raises(
        fe.EscaleTypeError,
        match=re.escape(
            "jit_train_step: batch_sharding['x'] must be a jax.sharding.Sharding (or None to "
            "leave that part of the batch where it is), got str 'fsdp'; pass e.g. "
            "flax_escale.batch_sharding(mesh, batch.shape)"
        ),
    ):
        fel.jit_train_step(train_step, state, batch_sharding={"x": "fsdp"})
    with pytest.raises(fe.EscaleTypeError, match=r"state must hold .* got None, which holds none"):
        fel.jit_train_step(train_step, None)
