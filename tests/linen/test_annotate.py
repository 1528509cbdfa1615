import functools
import re
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import linen as fel

KEY = jax.random.key(0)
X = jnp.ones((2, 8))


def names_of(variables):
    """The names of every boxed parameter, nested like the parameters; unboxed ones left out."""

    def walk(tree):
        out = {}
        for key, value in tree.items():
            if isinstance(value, nn.Partitioned):
                out[key] = value.names
            elif hasattr(value, "items") and walk(value):
                out[key] = walk(value)
        return out

    return walk(variables["params"])


def assert_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class OwnParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(), (x.shape[-1], 16))
        b = self.param("b", nn.initializers.zeros, (16,))
        return x @ w + b


class Layers(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="dense")(x)
        x = nn.DenseGeneral((2, 8), name="general")(x)
        x = nn.DenseGeneral(16, axis=(-2, -1), name="merge")(x)
        x = nn.LayerNorm(name="ln")(x)
        x = nn.RMSNorm(name="rms")(x)
        return x + nn.Embed(4, 16, name="embed")(jnp.zeros(x.shape[:1], jnp.int32))


LAYER_AXES = {
    "dense/kernel": ("hidden_state", "mlp_intermediate"),
    "dense/bias": ("mlp_intermediate",),
    "general/kernel": ("hidden_state", "head", "attention_dim"),
    "general/bias": ("head", "attention_dim"),
    "merge/kernel": ("head", "attention_dim", "hidden_state"),
    "merge/bias": ("hidden_state",),
    "scale|bias": ("hidden_state",),
    "embedding": ("vocab", "hidden_state"),
}


def test_self_param_module_gets_names_and_keeps_values():
    @fe.sharded_module({"w": ("hidden_state", "mlp_intermediate"), "b": ("mlp_intermediate",)})
    class Decorated(OwnParam):
        pass

    boxed = Decorated().init(KEY, X)
    assert names_of(boxed) == {
        "w": ("hidden_state", "mlp_intermediate"),
        "b": ("mlp_intermediate",),
    }
    assert_bit_equal(nn.unbox(boxed), OwnParam().init(KEY, X))


def test_flax_layers_are_covered_without_rewriting_them():
    decorated = fe.sharded_module(LAYER_AXES)(type("DecoratedLayers", (Layers,), {}))
    boxed = decorated().init(KEY, X)
    assert names_of(boxed) == {
        "dense": {"kernel": ("hidden_state", "mlp_intermediate"), "bias": ("mlp_intermediate",)},
        "general": {
            "kernel": ("hidden_state", "head", "attention_dim"),
            "bias": ("head", "attention_dim"),
        },
        "merge": {"kernel": ("head", "attention_dim", "hidden_state"), "bias": ("hidden_state",)},
        "ln": {"scale": ("hidden_state",), "bias": ("hidden_state",)},
        "rms": {"scale": ("hidden_state",)},
        "embed": {"embedding": ("vocab", "hidden_state")},
    }
    assert_bit_equal(nn.unbox(boxed), Layers().init(KEY, X))
    y_boxed = decorated().apply(boxed, X)
    np.testing.assert_array_equal(y_boxed, Layers().apply(nn.unbox(boxed), X))


def test_setup_style_module():
    @fe.sharded_module({"proj/kernel": ("hidden_state", "vocab"), "gain": ("vocab",)})
    class SetupModule(nn.Module):
        def setup(self):
            self.proj = nn.Dense(4, use_bias=False)
            self.gain = self.param("gain", nn.initializers.ones, (4,))

        def __call__(self, x):
            return self.proj(x) * self.gain

    variables = SetupModule().init(KEY, X)
    assert names_of(variables) == {
        "proj": {"kernel": ("hidden_state", "vocab")},
        "gain": ("vocab",),
    }


class Body(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(8, name="wi")(x), None


def scan_of(body):
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


def test_scan_stack_gets_the_layers_name_on_its_stacked_axis():
    decorated_body = fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})(
        type("DecoratedBody", (Body,), {})
    )

    class Stack(nn.Module):
        body: type

        @nn.compact
        def __call__(self, x):
            return scan_of(self.body)(name="stack")(x, None)[0]

    variables = Stack(decorated_body).init(KEY, X)
    kernel = variables["params"]["stack"]["wi"]["kernel"]
    assert kernel.names == ("layers", "hidden_state", "mlp_intermediate")
    assert kernel.value.shape == (3, 8, 8)
    assert_bit_equal(nn.unbox(variables), Stack(Body).init(KEY, X))
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    plan = fe.plan_sharding(Stack(decorated_body), mesh, KEY, X)
    assert plan["params/stack/wi/kernel"].spec == jax.P(None, ("fsdp", "sp"), "tp")


def test_parent_patterns_reach_into_a_scan_with_per_layer_names():
    @fe.sharded_module({"stack/wi/kernel": ("hidden_state", "mlp_intermediate")})
    class Parent(nn.Module):
        @nn.compact
        def __call__(self, x):
            return scan_of(Body)(name="stack")(x, None)[0]

    kernel = Parent().init(KEY, X)["params"]["stack"]["wi"]["kernel"]
    assert kernel.names == ("layers", "hidden_state", "mlp_intermediate")


def test_innermost_declaration_wins_and_outer_fills_the_rest():
    @fe.sharded_module({"kernel": ("hidden_state", "vocab")})
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="d")(x)

    @fe.sharded_module({"kernel": ("mlp_intermediate", "hidden_state"), "bias": ("vocab",)})
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="own")(Inner(name="inner")(x))

    assert names_of(Outer().init(KEY, X)) == {
        "inner": {"d": {"kernel": ("hidden_state", "vocab"), "bias": ("vocab",)}},
        "own": {"kernel": ("mlp_intermediate", "hidden_state"), "bias": ("vocab",)},
    }


def test_first_matching_pattern_wins():
    @fe.sharded_module({"wi/kernel": ("hidden_state", "vocab"), "kernel": ("vocab", None)})
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="wo")(nn.Dense(8, name="wi")(x))

    names = names_of(Two().init(KEY, X))
    assert names["wi"]["kernel"] == ("hidden_state", "vocab")
    assert names["wo"]["kernel"] == ("vocab", None)


def test_flax_native_annotations_are_kept():
    init = nn.initializers.lecun_normal()

    @fe.sharded_module({"kernel": ("vocab", "vocab2"), "b/bias": ("head",)})
    class Native(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.Dense(
                8, kernel_init=nn.with_logical_partitioning(init, ("hidden_state", "head"))
            )
            b = nn.Dense(8, kernel_init=nn.with_partitioning(init, ("fsdp", "tp")), name="b")
            w = nn_partitioning.param_with_axes(
                "w", init, (8, 8), axes=("mlp_intermediate", "hidden_state")
            )
            return b(a(x)) @ w

    variables = Native().init(KEY, X)
    params = variables["params"]
    assert params["Dense_0"]["kernel"].names == ("hidden_state", "head")
    assert type(params["b"]["kernel"]) is nn.Partitioned
    assert params["b"]["kernel"].names == ("fsdp", "tp")
    assert not isinstance(params["w"], nn.Partitioned)
    assert variables["params_axes"]["w_axes"].names == ("mlp_intermediate", "hidden_state")
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    kept = (
        "pattern 'kernel' matched params/Dense_0/kernel, params/b/kernel, "
        "which keep the annotations the model gives them, so it changed nothing. To replace "
    )
    with pytest.warns(fe.ShardingCorrectionWarning, match=re.escape(kept)):
        plan = fe.plan_sharding(Native(), mesh, KEY, X)
    assert plan["params/Dense_0/kernel"].spec == jax.P(("fsdp", "sp"), "tp")
    assert plan["params/b/kernel"].spec == jax.P("fsdp", "tp")
    assert plan["params/w"].spec == jax.P("tp", ("fsdp", "sp"))
    assert plan["params/w"].annotation.source == "param_with_axes"
    assert plan["params/Dense_0/bias"].annotation is None
    assert plan["params/b/bias"].annotation.logical_axes == ("head",)


def test_mixin_class_attribute_and_inheritance():
    class Base(fel.ShardedMixin, nn.Module):
        patterns: ClassVar = {"kernel": ("hidden_state", "mlp_intermediate")}

        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="d")(x)

    class Child(Base):
        patterns: ClassVar = {"bias": ("mlp_intermediate",)}

    class Override(Base):
        patterns: ClassVar = {"kernel": ("vocab", "hidden_state")}

        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="d")(x) * 2

    assert names_of(Base().init(KEY, X)) == {"d": {"kernel": ("hidden_state", "mlp_intermediate")}}
    assert names_of(Child().init(KEY, X)) == {
        "d": {"kernel": ("hidden_state", "mlp_intermediate"), "bias": ("mlp_intermediate",)}
    }
    assert names_of(Override().init(KEY, X)) == {"d": {"kernel": ("vocab", "hidden_state")}}


def test_subclass_of_a_decorated_class_is_decorated_too():
    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Parent(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    class Sub(Parent):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x) + 1

    assert names_of(Sub().init(KEY, X)) == {
        "Dense_0": {"kernel": ("hidden_state", "mlp_intermediate")}
    }


def test_keyword_and_top_level_forms():
    axes = {"kernel": ("hidden_state", "mlp_intermediate")}

    @fe.sharded_module(axes)
    class A(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    @fe.sharded_module(patterns=axes)
    class B(A):
        pass

    class C(nn.Module):
        patterns = axes

        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    fe.sharded_module(C)
    for cls in (A, B, C):
        assert names_of(cls().init(KEY, X))["Dense_0"]["kernel"] == axes["kernel"]


def test_runs_without_a_mesh_and_constraints_are_no_ops():
    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            return fe.constrain(nn.Dense(8)(x), ("batch", "mlp_intermediate"))

    variables = Constrained().init(KEY, X)
    y = Constrained().apply(variables, X)
    assert y.shape == (2, 8)
    assert len(y.sharding.device_set) == 1


def test_rank_mismatch_names_path_shape_and_pattern():
    @fe.sharded_module({"kernel": ("hidden_state",)})
    class Wrong(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="d")(x)

    with pytest.raises(
        fe.EscaleError, match=r"'d/kernel' of shape \(8, 8\) matches pattern 'kernel'"
    ):
        Wrong().init(KEY, X)


def test_decorating_something_else_fails_clearly():
    with pytest.raises(fe.EscaleTypeError, match=r"flax\.linen\.Module classes"):
        fe.sharded_module({"kernel": ("hidden_state",)})(object)
    with pytest.raises(fe.EscaleTypeError, match="Flax module classes"):
        fe.sharded_module(int)
    with pytest.raises(fe.EscaleTypeError, match="one logical name"):
        fe.sharded_module({"kernel": "hidden_state"})(type("Bad", (nn.Module,), {}))
    with pytest.raises(fe.EscaleError, match="not a valid regular expression"):
        fe.sharded_module({"kernel(": ("hidden_state",)})(type("Bad2", (nn.Module,), {}))


def test_unused_pattern_is_reported_and_strict_raises():
    @fe.sharded_module({"kernel": ("hidden_state", "vocab"), "kernal": ("vocab",)})
    class Typo(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, use_bias=False)(x)

    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(fe.ShardingCorrectionWarning, match="pattern 'kernal' matched no parameter"):
        plan = fe.plan_sharding(Typo(), mesh, KEY, X)
    assert any("kernal" in note for note in plan.notes)
    with pytest.raises(fe.EscaleError, match="pattern 'kernal' matched no parameter"):
        fe.plan_sharding(Typo(), mesh, KEY, X, strict=True)


# A model whose own __call__ runs under nn.jit (as DeepMind gemma's Transformer does): Flax takes
# nn.jit's wrapper as already wrapped, so no interceptor sees the outermost call, and the body
# runs in a scope tree of its own; a second init replays nn.jit's kept trace without running it.


class JittedCall(nn.Module):
    def setup(self):
        self.embedding = self.param("embedding", nn.initializers.normal(), (32, 8))
        self.blocks = [nn.Dense(8, name=f"layer_{i}") for i in range(2)]

    @functools.partial(nn.jit, static_argnames=("self",))
    def __call__(self, ids):
        x = self.embedding[ids]
        for block in self.blocks:
            x = block(x)
        return x @ self.embedding.T


JITTED_AXES = {
    "embedding": ("vocab", "hidden_state"),
    "kernel": ("hidden_state", "mlp_intermediate"),
}


def test_a_root_call_under_nn_jit_is_annotated_at_every_init(mesh):
    @fe.sharded_module(JITTED_AXES)
    class Decorated(JittedCall):
        pass

    ids = jnp.arange(8).reshape(2, 4)
    expected = {
        "embedding": ("vocab", "hidden_state"),
        "layer_0": {"kernel": ("hidden_state", "mlp_intermediate")},
        "layer_1": {"kernel": ("hidden_state", "mlp_intermediate")},
    }
    for _ in range(2):  # the second init runs nn.jit's kept trace
        variables = Decorated().init(KEY, ids)
        assert names_of(variables) == expected
        # No box of the library's own making leaves init but Flax's logical one.
        leaves = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
        assert all(isinstance(x, (nn.LogicallyPartitioned, jax.Array)) for x in leaves)
    sharded = fe.init_sharded(Decorated(), mesh, KEY, ids, strict=True)
    assert sharded["params"]["embedding"].sharding.spec == P("tp", ("fsdp", "sp"))
    assert sharded["params"]["layer_1"]["kernel"].sharding.spec == P(("fsdp", "sp"), "tp")
    assert_bit_equal(sharded, jax.jit(JittedCall().init)(KEY, ids))


def test_a_pattern_nothing_matches_under_nn_jit_names_what_was_seen(mesh):
    @fe.sharded_module({**JITTED_AXES, "wte/embedding": ("vocab", "hidden_state")})
    class Decorated(JittedCall):
        pass

    ids = jnp.arange(8).reshape(2, 4)
    expected = (
        r"Decorated: pattern 'wte/embedding' matched no parameter \(parameters seen under it: "
        r"params/embedding, params/layer_0/bias, params/layer_0/kernel, params/layer_1/bias, "
        r"params/layer_1/kernel; annotated by it: params/embedding, params/layer_0/kernel, "
        r"params/layer_1/kernel\)\. Fix the pattern or remove it\."
    )
    with pytest.raises(fe.EscaleError, match=expected):
        fe.init_sharded(Decorated(), mesh, KEY, ids, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=expected):
        fe.init_sharded(Decorated(), mesh, KEY, ids)
