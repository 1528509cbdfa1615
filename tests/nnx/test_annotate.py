from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import values
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.plain_reads import IDS, plain

import flax_escale as fe
from flax_escale import nnx as fen

X = jnp.ones((2, 8))
HIDDEN = ("fsdp", "sp")
KERNEL = ("hidden_state", "mlp_intermediate")


def names_of(module):
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and node.get_metadata().get("logical_axes"):
            out["/".join(str(p) for p in path)] = node.get_metadata("logical_axes")
    return out


def assert_same_values(a, b):
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Layers(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 4)))
        self.dense = nnx.Linear(8, 16, rngs=rngs)
        self.general = nnx.LinearGeneral(16, (2, 8), rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.rms = nnx.RMSNorm(16, rngs=rngs)
        self.embed = nnx.Embed(4, 16, rngs=rngs)

    def __call__(self, x):
        h = self.rms(self.ln(self.dense(x)))
        return self.general(h + self.embed(jnp.zeros(x.shape[:1], jnp.int32))).sum() + self.w.sum()


AXES = {
    "w": ("hidden_state", "mlp_intermediate"),
    "dense/kernel": ("hidden_state", "mlp_intermediate"),
    "dense/bias": ("mlp_intermediate",),
    "general/kernel": ("hidden_state", "head", "attention_dim"),
    "general/bias": ("head", "attention_dim"),
    "scale|bias": ("hidden_state",),
    "embedding": ("vocab", "hidden_state"),
}


def test_own_variables_and_flax_layers_get_names_and_keep_values():
    decorated = fe.sharded_module(AXES)(type("DecoratedLayers", (Layers,), {}))
    module = decorated(nnx.Rngs(0))
    assert names_of(module) == {
        "w": ("hidden_state", "mlp_intermediate"),
        "dense/kernel": ("hidden_state", "mlp_intermediate"),
        "dense/bias": ("mlp_intermediate",),
        "general/kernel": ("hidden_state", "head", "attention_dim"),
        "general/bias": ("head", "attention_dim"),
        "ln/scale": ("hidden_state",),
        "ln/bias": ("hidden_state",),
        "rms/scale": ("hidden_state",),
        "embed/embedding": ("vocab", "hidden_state"),
    }
    plain = Layers(nnx.Rngs(0))
    assert_same_values(module, plain)
    np.testing.assert_array_equal(module(X), plain(X))


@pytest.mark.parametrize("eager", [True, False])
def test_builds_and_runs_without_a_mesh_whatever_eager_sharding_is(eager):
    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x):
            return fe.constrain(self.wi(x), ("batch", "mlp_intermediate"))

    with nnx.use_eager_sharding(eager):
        module = Up(nnx.Rngs(0))
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    y = module(X)
    assert y.shape == (2, 16)
    assert len(y.sharding.device_set) == 1
    assert optimizer.step.get_value() == 0


def test_vmap_stack_gets_the_layers_name():
    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(8, 8, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=fen.stacked())
    def make(rngs):
        return Block(rngs)

    stack = make(nnx.Rngs(0))
    assert stack.wi.kernel.get_value().shape == (3, 8, 8)
    assert stack.wi.kernel.get_metadata("logical_axes") == (
        "layers",
        "hidden_state",
        "mlp_intermediate",
    )
    assert fen.stacked("depth") == {nnx.PARTITION_NAME: "depth", "logical_axes": "depth"}


def test_innermost_declaration_wins_and_flax_out_sharding_is_kept():
    @fe.sharded_module({"kernel": ("hidden_state", "vocab")})
    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Linear(8, 8, rngs=rngs)

    @fe.sharded_module({"kernel": ("mlp_intermediate", "hidden_state"), "bias": ("vocab",)})
    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.inner = Inner(rngs)
            self.own = nnx.Linear(8, 8, rngs=rngs)
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None))
            self.native = nnx.Linear(8, 8, kernel_init=init, use_bias=False, rngs=rngs)

    with nnx.use_eager_sharding(False):
        module = Outer(nnx.Rngs(0))
    assert names_of(module) == {
        "inner/d/kernel": ("hidden_state", "vocab"),
        "inner/d/bias": ("vocab",),
        "own/kernel": ("mlp_intermediate", "hidden_state"),
        "own/bias": ("vocab",),
    }
    assert module.native.kernel.get_metadata("out_sharding") == ("fsdp", None)


def test_mixin_inheritance_and_subclasses():
    class Base(fen.ShardedMixin, nnx.Module):
        patterns: ClassVar = {"kernel": ("hidden_state", "mlp_intermediate")}

        def __init__(self, rngs):
            self.d = nnx.Linear(8, 8, rngs=rngs)

    class Child(Base):
        patterns: ClassVar = {"bias": ("mlp_intermediate",)}

        def __init__(self, rngs):
            super().__init__(rngs)
            self.extra = nnx.Linear(8, 4, use_bias=False, rngs=rngs)

    assert names_of(Base(nnx.Rngs(0))) == {"d/kernel": ("hidden_state", "mlp_intermediate")}
    assert names_of(Child(nnx.Rngs(0))) == {
        "d/kernel": ("hidden_state", "mlp_intermediate"),
        "d/bias": ("mlp_intermediate",),
        "extra/kernel": ("hidden_state", "mlp_intermediate"),
    }

    @fe.sharded_module({"kernel": ("vocab", "hidden_state")})
    class Decorated(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Linear(8, 8, rngs=rngs)

    class Sub(Decorated):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.e = nnx.Linear(8, 8, rngs=rngs)

    assert names_of(Sub(nnx.Rngs(0))) == {
        "d/kernel": ("vocab", "hidden_state"),
        "e/kernel": ("vocab", "hidden_state"),
    }


def test_errors():
    @fe.sharded_module({"kernel": ("hidden_state",)})
    class Wrong(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Linear(8, 8, rngs=rngs)

    with pytest.raises(fe.EscaleError, match=r"'d/kernel' of shape \(8, 8\) matches pattern"):
        Wrong(nnx.Rngs(0))
    with pytest.raises(fe.EscaleTypeError, match=r"flax\.nnx\.Module classes"):
        fe.sharded_module({"kernel": ("hidden_state",)})(object)
    with pytest.raises(fe.EscaleTypeError, match="one logical name"):
        fe.sharded_module({"kernel": "hidden_state"})(type("Bad", (nnx.Module,), {}))


def test_unused_pattern_is_reported_by_the_plan():
    @fe.sharded_module({"kernel": ("hidden_state", "vocab"), "kernal": ("vocab",)})
    class Typo(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Linear(8, 8, use_bias=False, rngs=rngs)

    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(fe.ShardingCorrectionWarning, match="pattern 'kernal' matched no variable"):
        plan = fe.plan_sharding(Typo, mesh, 0)
    assert plan["d/kernel"].spec == jax.P(("fsdp", "sp"), None)
    with pytest.raises(fe.EscaleError, match="pattern 'kernal' matched no variable"):
        fe.plan_sharding(Typo, mesh, 0, strict=True)


def test_nnx_pattern_matching_nothing_names_the_variables_seen(devices):
    fsdp8 = fe.create_mesh((1, 8, 1, 1, 1))

    @fe.sharded_module({"kernel": KERNEL, "wq/kernel": ("hidden_state", "head")})
    class Seen(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(8, 16, rngs=rngs)

    expected = (
        r"Seen: pattern 'wq/kernel' matched no variable \(variables seen under it: w/bias, "
        r"w/kernel\)\. Fix the pattern or remove it\."
    )
    with pytest.raises(fe.EscaleError, match=expected):
        fe.init_sharded(Seen, fsdp8, 0, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=expected):
        fe.init_sharded(Seen, fsdp8, 0)


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
    values.assert_same_values(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(reference))
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


# Mistakes users make with stacked. What a case asserts, and the rest of the table:
# support/mistakes.py.
CASES = [
    case(
        lambda: fen.stacked(3),
        T,
        "name",
        "int 3",
        "'layers'",
        id="nnx-stacked-int",
    ),
    case(
        lambda: fen.stacked(""),
        fe.EscaleError,
        "name",
        "''",
        "pass e.g. 'layers'",
        id="nnx-stacked-empty",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
