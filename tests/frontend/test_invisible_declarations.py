"""Declaring logical axes changes nothing the model's own code reads, in Linen and NNX.

Each model reads parameters the library declares axes for, as real models do (GPT-2's head tied
to its embedding by ``variables[...]["embedding"].T``, a child's variables read in ``setup`` or
compact code, a scanned stack's kernels) and checks, while it runs, that what it read is a plain
array. The declared specs still reach the arrays, and the values are those of the undecorated
model's ``jax.jit`` initializer.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.values import assert_same_values

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen

KEY = jax.random.key(0)
IDS = (jnp.arange(2 * 8).reshape(2, 8) * 5) % 32
X = jnp.ones((2, 16))
HIDDEN = ("fsdp", "sp")


def plain(x):
    """``x``, checked to be what the model reads without the library: an array, not a box."""
    assert isinstance(x, jax.Array), f"the model read a {type(x).__name__}, not an array"
    return x


def spec_of(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return tree.sharding.spec


# Linen: a GPT-2-like head tied to the embedding (transformers' FlaxGPT2LMHeadModule reads
# self.transformer.variables["params"]["wte"]["embedding"].T).


class Transformer(nn.Module):
    def setup(self):
        self.wte = nn.Embed(32, 16)
        self.h = nn.Dense(16)
        self.ln_f = nn.LayerNorm()

    def __call__(self, ids):
        return self.ln_f(nn.relu(self.h(self.wte(ids))))


class TiedLmHead(nn.Module):
    def setup(self):
        self.transformer = Transformer()

    def __call__(self, ids):
        hidden = self.transformer(ids)
        embedding = plain(self.transformer.variables["params"]["wte"]["embedding"])
        return hidden @ embedding.T


GPT_AXES = {
    "wte/embedding": ("vocab", "hidden_state"),
    "h/kernel": ("hidden_state", "mlp_intermediate"),
    "h/bias": ("mlp_intermediate",),
}


@fe.sharded_module(GPT_AXES)
class OurTiedLmHead(TiedLmHead):  # decorating a subclass, as for a model from elsewhere
    pass


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


def test_linen_plain_init_returns_boxes_the_model_never_saw(mesh):
    variables = OurTiedLmHead().init(KEY, IDS)
    params = variables["params"]["transformer"]
    assert params["wte"]["embedding"].names == ("vocab", "hidden_state")
    assert params["h"]["kernel"].names == ("hidden_state", "mlp_intermediate")
    assert not isinstance(params["ln_f"]["scale"], nn.Partitioned)
    assert_same_values(nn.unbox(variables), TiedLmHead().init(KEY, IDS))
    np.testing.assert_array_equal(
        OurTiedLmHead().apply(variables, IDS), TiedLmHead().apply(nn.unbox(variables), IDS)
    )
    bound = OurTiedLmHead().bind(variables)
    np.testing.assert_array_equal(bound(IDS), TiedLmHead().apply(nn.unbox(variables), IDS))
    # Flax's idiom on the boxes gives the plan's specs.
    abstract = jax.eval_shape(OurTiedLmHead().init, KEY, IDS)
    idiom = jax.tree.leaves(fe.logical_to_mesh_sharding(abstract, mesh))
    plan = fe.plan_sharding(OurTiedLmHead(), mesh, KEY, IDS)
    assert [sharding.spec for sharding in idiom] == [entry.spec for entry in plan]


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


# Linen: lifted transforms. The scan body reads its child's variables; the enclosing module
# reads the stacked kernels right after the scan.


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        wi = nn.Dense(16, name="wi")
        h = wi(x)
        return h + x @ plain(wi.variables["params"]["kernel"]), None


def stack_of(body, **metadata):
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
        **metadata,
    )


LAYERS = {"metadata_params": {nn.PARTITION_NAME: "layers"}}
KERNEL = ("hidden_state", "mlp_intermediate")


class Scanned(nn.Module):
    body: type = ScanBody

    @nn.compact
    def __call__(self, x):
        stack = stack_of(self.body, **LAYERS)(name="stack")
        y = stack(x, None)[0]
        return y @ plain(stack.variables["params"]["wi"]["kernel"])[0]


def declared_outside():
    return fe.sharded_module({"stack/wi/kernel": KERNEL})(type("Outside", (Scanned,), {}))()


def declared_in_the_body():
    # The enclosing module declares nothing, and is decorated so that it never sees a box.
    body = fe.sharded_module({"wi/kernel": KERNEL})(type("Body", (ScanBody,), {}))
    return fe.sharded_module({})(type("Enclosing", (Scanned,), {}))(body)


@pytest.mark.parametrize("make", [declared_outside, declared_in_the_body])
def test_linen_scan_reads_plain_kernels_inside_and_after(mesh, make):
    model = make()
    variables = fe.init_sharded(model, mesh, KEY, X)
    assert_same_values(variables, jax.jit(Scanned().init)(KEY, X))
    assert spec_of(variables, "params/stack/wi/kernel") == P(None, HIDDEN, "tp")
    plan = fe.plan_sharding(model, mesh, KEY, X)
    assert plan["params/stack/wi/kernel"].annotation.logical_axes == ("layers", *KERNEL)
    assert model.init(KEY, X)["params"]["stack"]["wi"]["kernel"].names == ("layers", *KERNEL)
    np.testing.assert_array_equal(model.apply(variables, X), Scanned().apply(variables, X))


def test_linen_scan_without_a_name_for_the_stacked_axis_is_refused(mesh):
    @fe.sharded_module({"kernel": KERNEL})
    class Unnamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stack_of(ScanBody)(name="stack")(x, None)[0]

    message = (
        r"parameter params/stack/wi/kernel: a Flax transform \(nn.scan or nn.vmap\) stacks it "
        r"along axis 0, and its declared logical axes \('hidden_state', 'mlp_intermediate'\) "
        r"have no name for that axis; pass metadata_params=\{nn.PARTITION_NAME: 'layers'\}"
    )
    with pytest.raises(fe.EscaleError, match=message):
        fe.plan_sharding(Unnamed(), mesh, KEY, X)
    with pytest.raises(fe.EscaleError, match=message):
        Unnamed().init(KEY, X)


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


# NNX: a model reading a (decorated) child's parameter while it builds and while it runs.

DeclaredEmbed = fe.sharded_module({"embedding": ("vocab", "hidden_state")})(
    type("DeclaredEmbed", (nnx.Embed,), {})
)


class NnxTied(nnx.Module):
    embed_class = nnx.Embed

    def __init__(self, rngs):
        self.wte = self.embed_class(32, 16, rngs=rngs)
        self.h = nnx.Linear(16, 16, rngs=rngs)
        # Built from the child's table: one bias per vocabulary entry (no sum over a split
        # dimension, whose order of addition would differ on the mesh).
        self.head_bias = nnx.Param(plain(self.wte.embedding[...])[:, 0] * 0.5)

    def __call__(self, ids):
        table = plain(self.wte.embedding[...])
        head = plain(self.wte.embedding.get_value())
        assert table is head
        return nnx.relu(self.h(self.wte(ids))) @ table.T + self.head_bias[...]


@fe.sharded_module({"h/kernel": KERNEL, "head_bias": ("vocab",)})
class OurNnxTied(NnxTied):
    embed_class = DeclaredEmbed


def test_nnx_tied_head_reads_plain_values_and_is_born_sharded(mesh):
    model = fe.init_sharded(OurNnxTied, mesh, 0)
    reference = jax.jit(lambda key: nnx.state(NnxTied(nnx.Rngs(key))))(jax.random.key(0))
    # Values only: the module's variables carry their specs in metadata.
    assert_same_values(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(reference))
    assert model.wte.embedding.get_value().sharding.spec == P("tp", HIDDEN)
    assert model.h.kernel.get_value().sharding.spec == P(HIDDEN, "tp")
    assert model.head_bias.get_value().sharding.spec == P("tp")
    plan = fe.plan_sharding(OurNnxTied, mesh, 0)
    assert plan["wte/embedding"].annotation.logical_axes == ("vocab", "hidden_state")
    unsharded = NnxTied(nnx.Rngs(0))
    # Sharded matmuls add in another order: equal to float32 rounding.
    np.testing.assert_allclose(model(IDS), unsharded(IDS), rtol=1e-5, atol=1e-6)

    optimizer = fen.init_optimizer(model, optax.adam(1e-2))
    assert optimizer.opt_state[0].mu["wte"]["embedding"].get_value().sharding.spec == P(
        "tp", HIDDEN
    )

    @nnx.jit
    def step(model, optimizer, ids):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(ids) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    loss = step(model, optimizer, IDS)
    np.testing.assert_allclose(loss, jnp.mean(unsharded(IDS) ** 2), rtol=1e-5)
    # nnx.jit gives the layout back in the compiler's spelling (sp has size 1).
    updated = model.wte.embedding.get_value().sharding
    assert updated.is_equivalent_to(NamedSharding(mesh, P("tp", HIDDEN)), 2)
