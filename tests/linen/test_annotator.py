"""The Linen annotator: declaring logical axes changes nothing the model's own code reads.

Each model reads parameters the library declares axes for, as real models do (GPT-2's head tied
to its embedding by ``variables[...]["embedding"].T``, a child's variables read in ``setup`` or
compact code, a remat's body and its caller) and checks, while it runs, that what it read is a
plain array. The declared specs still reach the arrays, and the values are those of the
undecorated model's ``jax.jit`` initializer. (Scanned stacks and the boxes ``model.init``
returns: ``test_boxes.py``; NNX: ``tests/nnx/test_annotate.py``.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from support.plain_reads import GPT_AXES, IDS, OurTiedLmHead, TiedLmHead, plain, spec_of
from support.values import assert_same_values

import flax_escale as fe
from flax_escale import linen as fel

KEY = jax.random.key(0)
X = jnp.ones((2, 16))
HIDDEN = ("fsdp", "sp")
KERNEL = ("hidden_state", "mlp_intermediate")


# Linen: a GPT-2-like head tied to the embedding (support/plain_reads.py).


def test_linen_tied_head_reads_a_plain_embedding_and_is_born_sharded(mesh):
    model = OurTiedLmHead()
    variables = fe.init_sharded(model, mesh, KEY, IDS)
    assert_same_values(variables, jax.jit(TiedLmHead().init)(KEY, IDS))
    assert spec_of(variables, "params/transformer/wte/embedding") == P("tp", HIDDEN)
    assert spec_of(variables, "params/transformer/h/kernel") == P(HIDDEN, "tp")
    plan = fe.plan_sharding(model, mesh, KEY, IDS)
    entry = plan["params/transformer/wte/embedding"]
    assert entry.spec == P("tp", HIDDEN)
    assert entry.annotation.source == "OurTiedLmHead['wte/embedding']"
    # The same patterns given as overrides= to the undecorated model: the same plan.
    overridden = fe.plan_sharding(TiedLmHead(), mesh, KEY, IDS, overrides=GPT_AXES)
    assert [e.spec for e in overridden] == [e.spec for e in plan]
    # Applied with the decorated class, as users do.
    np.testing.assert_array_equal(
        jax.jit(model.apply)(variables, IDS), jax.jit(TiedLmHead().apply)(variables, IDS)
    )


def test_linen_train_state_path_with_a_tied_head(mesh):
    state = fel.init_train_state(OurTiedLmHead(), mesh, KEY, IDS, tx=optax.adam(1e-2))
    reference = jax.jit(TiedLmHead().init)(KEY, IDS)["params"]
    assert_same_values(state.params, reference)
    assert spec_of(state.params, "transformer/wte/embedding") == P("tp", HIDDEN)
    assert spec_of(state.opt_state[0].mu, "transformer/wte/embedding") == P("tp", HIDDEN)

    def step(state, ids):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(state.apply_fn({"params": p}, ids) ** 2)
        )(state.params)
        return state.apply_gradients(grads=grads), loss

    state, loss = fel.jit_train_step(step, state, has_aux=True)(state, IDS)
    expected = jnp.mean(TiedLmHead().apply({"params": reference}, IDS) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert spec_of(state.params, "transformer/wte/embedding") == P("tp", HIDDEN)


# Linen: a child's variables read in setup and in compact code, during init.


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        up = nn.Dense(16, name="up")
        h = up(x)
        kernel = plain(up.variables["params"]["kernel"])
        bias = plain(self.variables["params"]["up"]["bias"])
        return h + x @ kernel.T + bias


class Net(nn.Module):
    def setup(self):
        self.embed = nn.Embed(32, 16)
        self.block = Block()
        self.gain = self.param("gain", nn.initializers.ones, (16,))
        _ = self.embed.embedding  # runs the child's setup, which creates its table
        self.rows = plain(self.embed.variables["params"]["embedding"]).shape[0]

    def __call__(self, ids):
        h = self.block(self.embed(ids))
        gain = plain(self.variables["params"]["gain"])
        table = plain(self.embed.variables["params"]["embedding"])
        return (h * gain) @ table[: self.rows].T


NET_AXES = {
    "embedding": ("vocab", "hidden_state"),
    "up/kernel": ("hidden_state", "mlp_intermediate"),
    "up/bias": ("mlp_intermediate",),
    "gain": ("hidden_state",),
}


def test_linen_variables_read_in_setup_and_compact_code_are_plain(mesh):
    model = fe.sharded_module(NET_AXES)(type("DeclaredNet", (Net,), {}))()
    variables = fe.init_sharded(model, mesh, KEY, IDS)
    assert_same_values(variables, jax.jit(Net().init)(KEY, IDS))
    assert spec_of(variables, "params/embed/embedding") == P("tp", HIDDEN)
    assert spec_of(variables, "params/block/up/kernel") == P(HIDDEN, "tp")
    plan = fe.plan_sharding(model, mesh, KEY, IDS)
    assert plan["params/gain"].annotation.logical_axes == ("hidden_state",)
    boxed = model.init(KEY, IDS)
    assert boxed["params"]["gain"].names == ("hidden_state",)
    np.testing.assert_array_equal(model.apply(variables, IDS), Net().apply(variables, IDS))


def test_linen_a_decorated_child_called_twice_reads_plain_arrays_both_times():
    declared = fe.sharded_module({"up/kernel": KERNEL})(type("DeclaredBlock", (Block,), {}))

    class Twice(nn.Module):  # not decorated: each call of the block declares on its own
        block: type = Block

        @nn.compact
        def __call__(self, x):
            block = self.block(name="block")
            return block(block(x))

    variables = Twice(declared).init(KEY, X)
    assert variables["params"]["block"]["up"]["kernel"].names == KERNEL
    assert_same_values(nn.unbox(variables), jax.jit(Twice().init)(KEY, X))


class Rematted(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block)(name="block")
        h = nn.Dense(16, name="out")(block(x))
        # Read after the next module call: the remat's outputs are plain by then.
        return h @ plain(block.variables["params"]["up"]["kernel"])


def test_linen_remat_body_and_its_caller_read_plain_arrays(mesh):
    axes = {"up/kernel": NET_AXES["up/kernel"], "up/bias": NET_AXES["up/bias"]}
    model = fe.sharded_module(axes)(type("DeclaredRematted", (Rematted,), {}))()
    variables = fe.init_sharded(model, mesh, KEY, X)
    assert_same_values(variables, jax.jit(Rematted().init)(KEY, X))
    assert spec_of(variables, "params/block/up/kernel") == P(HIDDEN, "tp")
    assert model.init(KEY, X)["params"]["block"]["up"]["bias"].names == ("mlp_intermediate",)
