"""init_sharded keeps its compiled initializer: the same model again traces and compiles nothing."""

import gc
import weakref
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.compiles import counting

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale._frontend import _init_cache

KEY = jax.random.key(0)
X = jnp.ones((4, 16))
AXES = {"wi/kernel": ("hidden_state", "mlp_intermediate"), "wo/kernel": ("mlp_intermediate", None)}


@fe.sharded_module(AXES)
class Mlp(nn.Module):
    width: int = 32

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.width, use_bias=False, name="wi")(x))
        return nn.Dense(x.shape[-1], use_bias=False, name="wo")(h)


@fe.sharded_module(AXES)
class NnxMlp(nnx.Module):
    def __init__(self, width, rngs):
        self.wi = nnx.Linear(16, width, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(width, 16, use_bias=False, rngs=rngs)


class Listed(nn.Module):
    """A field that does not hash (a list): the module is compared by its fields' contents."""

    widths: list

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            x = nn.Dense(width)(x)
        return x


class Holding(nn.Module):
    """A field compared by identity only (an array): the module is kept by identity."""

    scale: jax.Array

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x * self.scale)


@pytest.fixture(autouse=True)
def empty_cache():
    fel.clear_init_cache()
    yield
    fel.clear_init_cache()


def traced_or_compiled(call):
    with counting() as seen:
        result = call()
    return result, seen


def assert_bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_linen_second_init_traces_and_compiles_nothing(mesh):
    first, seen = traced_or_compiled(lambda: fe.init_sharded(Mlp(), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen
    # An equal module (a new instance) and a new key of the same kind.
    second, seen = traced_or_compiled(lambda: fe.init_sharded(Mlp(), mesh, KEY, X))
    assert seen == []
    assert_bit_equal(first, second)
    assert second["params"]["wi"]["kernel"].sharding.spec == P(("fsdp", "sp"), "tp")
    other_key = fe.init_sharded(Mlp(), mesh, jax.random.key(1), X)
    assert not np.array_equal(other_key["params"]["wi"]["kernel"], first["params"]["wi"]["kernel"])

    info = fel.init_cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 1, 1)
    (entry,) = info.entries
    assert (entry.model, entry.runs) == ("Mlp", 3)
    assert entry.compile_seconds > 0
    assert entry.run_seconds > 0


@pytest.mark.parametrize(
    "change",
    ["input shape", "input dtype", "input sharding", "mesh", "rules", "strict", "field", "kwarg"],
)
def test_linen_what_changes_the_program_compiles_anew(mesh, change):
    fe.init_sharded(Mlp(), mesh, KEY, X)
    model, args, options = Mlp(), [mesh, KEY, X], {}
    if change == "input shape":
        args[2] = jnp.ones((8, 16))
    elif change == "input dtype":
        args[2] = X.astype(jnp.bfloat16)
    elif change == "input sharding":
        args[2] = jax.device_put(X, NamedSharding(mesh, P("fsdp")))
    elif change == "mesh":
        args[0] = fe.create_mesh((1, 2, 1, 4, 1))
    elif change == "rules":
        options["rules"] = fe.PartitionAxis(mlp_intermediate_axis="fsdp")
    elif change == "strict":
        options["strict"] = True
    elif change == "field":
        model = Mlp(width=64)
    else:
        options["method"] = "__call__"
    _, seen = traced_or_compiled(lambda: fe.init_sharded(model, *args, **options))
    assert ("compile", "jit(init)") in seen
    assert fel.init_cache_info().misses == 2


def test_nnx_second_init_traces_and_compiles_nothing(mesh):
    first, seen = traced_or_compiled(lambda: fe.init_sharded(NnxMlp, mesh, 0, 32))
    assert ("compile", "jit(<lambda>)") in seen
    second, seen = traced_or_compiled(lambda: fe.init_sharded(NnxMlp, mesh, 0, 32))
    assert seen == []
    assert_bit_equal(nnx.state(first), nnx.state(second))
    assert second.wi.kernel.get_value().sharding.spec == P(("fsdp", "sp"), "tp")
    assert second.wi.kernel.get_metadata("out_sharding") == (("fsdp", "sp"), "tp")
    assert second.wi.kernel is not first.wi.kernel
    info = fen.init_cache_info()
    assert (info.hits, info.misses, info.entries[0].model) == (1, 1, "NnxMlp")


@pytest.mark.parametrize("change", ["argument", "mesh", "rules", "key kind"])
def test_nnx_what_changes_the_program_compiles_anew(mesh, change):
    fe.init_sharded(NnxMlp, mesh, 0, 32)
    args, options = [mesh, 0, 32], {}
    if change == "argument":
        args[2] = 64
    elif change == "mesh":
        args[0] = fe.create_mesh((1, 8, 1, 1, 1))
    elif change == "rules":
        options["rules"] = fe.PartitionAxis(mlp_intermediate_axis="fsdp")
    else:
        args[1] = {"params": 0, "dropout": 1}
    _, seen = traced_or_compiled(lambda: fe.init_sharded(NnxMlp, *args, **options))
    assert ("compile", "jit(<lambda>)") in seen
    assert fen.init_cache_info().misses == 2


def test_rules_from_the_context_are_part_of_the_key(mesh):
    fe.init_sharded(Mlp(), mesh, KEY, X)
    with nn.logical_axis_rules(fe.PartitionAxis(mlp_intermediate_axis="fsdp").logical_axis_rules()):
        variables = fe.init_sharded(Mlp(), mesh, KEY, X)
    assert variables["params"]["wi"]["kernel"].sharding.spec == P("tp", "fsdp")
    assert fel.init_cache_info().misses == 2


def test_jax_configuration_is_part_of_the_key(mesh):
    fe.init_sharded(Mlp(), mesh, KEY, X)
    with jax.default_matmul_precision("highest"):
        _, seen = traced_or_compiled(lambda: fe.init_sharded(Mlp(), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen


def test_corrections_warn_on_every_call(mesh):
    # fsdp=4 does not divide 6: the correction is said again when the program is reused.
    init = nn.with_partitioning(nn.initializers.zeros, ("fsdp", None))
    model = nn.Dense(16, kernel_init=init, use_bias=False)
    for _ in range(2):
        with pytest.warns(fe.ShardingCorrectionWarning, match=r"'params/kernel'.*\(6, 16\)"):
            fe.init_sharded(model, mesh, KEY, jnp.ones((2, 6)))
    assert fel.init_cache_info().hits == 1


def test_unhashable_fields_compare_by_contents(mesh):
    fe.init_sharded(Listed([8, 4]), mesh, KEY, X)
    _, seen = traced_or_compiled(lambda: fe.init_sharded(Listed([8, 4]), mesh, KEY, X))
    assert seen == []
    fe.init_sharded(Listed([8, 2]), mesh, KEY, X)
    assert fel.init_cache_info().misses == 2


def test_a_model_kept_by_identity_is_held_weakly(mesh):
    model = Holding(jnp.full((16,), 2.0))
    fe.init_sharded(model, mesh, KEY, X)
    with counting() as seen:
        fe.init_sharded(model, mesh, KEY, X)
    assert seen == []
    # An equal but distinct module is not the same key (its array field compares by identity).
    fe.init_sharded(Holding(model.scale), mesh, KEY, X)
    assert fel.init_cache_info().misses == 2
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


class Scaled(nnx.Module):
    def __init__(self, scale, rngs):
        self.w = nnx.Param(scale * jax.random.normal(rngs.params(), (16, 8)))


def test_calls_that_cannot_be_keyed_are_not_kept(mesh):
    # An array argument is compared by neither value nor (safely) identity.
    for _ in range(2):
        fe.init_sharded(Scaled, mesh, 0, jnp.full((16, 8), 2.0))
    info = fen.init_cache_info()
    assert (info.hits, info.misses, info.currsize) == (0, 2, 0)


def test_size_is_bounded_least_recently_used_first(mesh, monkeypatch):
    monkeypatch.setattr(_init_cache, "MAXSIZE", 2)
    for width in (8, 16, 8, 24):
        fe.init_sharded(Mlp(width=width), mesh, KEY, X)
    info = fel.init_cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 3, 2)
    _, seen = traced_or_compiled(lambda: fe.init_sharded(Mlp(width=16), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen  # 16 was the least recently used, and went


def test_errors_are_not_kept(mesh):
    with pytest.raises(fe.ShardingResolutionError):
        fe.init_sharded(Mlp(width=33), mesh, KEY, X, strict=True)
    assert fel.init_cache_info().currsize == 0


def test_declaring_a_class_makes_kept_programs_stale(mesh):
    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, use_bias=False, name="wi")(x)

    before = fe.init_sharded(Plain(), mesh, KEY, X)
    assert before["params"]["wi"]["kernel"].sharding.spec == P(None, None)
    fe.sharded_module({"wi/kernel": ("hidden_state", "mlp_intermediate")})(Plain)
    after, seen = traced_or_compiled(lambda: fe.init_sharded(Plain(), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen
    assert after["params"]["wi"]["kernel"].sharding.spec == P(("fsdp", "sp"), "tp")


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
class ScannedLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(16, use_bias=False)(x), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            ScannedLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return stack(name="layers")(x, None)[0]


def test_a_scanned_stack_of_a_decorated_layer_is_kept(mesh):
    # nn.scan subclasses the decorated layer at every trace; that declares nothing new.
    first = fe.init_sharded(Scanned(), mesh, KEY, X)
    second, seen = traced_or_compiled(lambda: fe.init_sharded(Scanned(), mesh, KEY, X))
    assert seen == []
    assert_bit_equal(first, second)
    assert second["params"]["layers"]["Dense_0"]["kernel"].sharding.spec == P(
        None, ("fsdp", "sp"), "tp"
    )
    info = fel.init_cache_info()
    assert (info.hits, info.misses) == (1, 1)


class Widened(nn.Module):
    """Reads a class attribute that is no dataclass field (a ClassVar)."""

    WIDTH: ClassVar[int] = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.WIDTH, use_bias=False, name="wi")(x)


def test_a_changed_class_attribute_initializes_the_changed_model(mesh, monkeypatch):
    first = fe.init_sharded(Widened(), mesh, KEY, X)
    assert first["params"]["wi"]["kernel"].shape == (16, 8)
    monkeypatch.setattr(Widened, "WIDTH", 32)
    second, seen = traced_or_compiled(lambda: fe.init_sharded(Widened(), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen
    assert second["params"]["wi"]["kernel"].shape == (16, 32)
    # Unchanged, it is kept again.
    _, seen = traced_or_compiled(lambda: fe.init_sharded(Widened(), mesh, KEY, X))
    assert seen == []


def test_a_changed_closure_initializes_the_changed_model(mesh):
    width = 8

    class Closing(nn.Module):  # reads `width` from the enclosing function
        @nn.compact
        def __call__(self, x):
            return nn.Dense(width, use_bias=False, name="wi")(x)

    def make(rngs):  # an NNX callable reading the same variable
        return NnxMlp(width, rngs)

    assert fe.init_sharded(Closing(), mesh, KEY, X)["params"]["wi"]["kernel"].shape == (16, 8)
    assert fe.init_sharded(make, mesh, 0).wi.kernel.shape == (16, 8)
    width = 32
    linen = fe.init_sharded(Closing(), mesh, KEY, X)
    assert linen["params"]["wi"]["kernel"].shape == (16, 32)
    assert fe.init_sharded(make, mesh, 0).wi.kernel.shape == (16, 32)
    info = fel.init_cache_info()
    assert (info.hits, info.misses) == (0, 4)


def test_a_model_whose_class_attribute_cannot_be_compared_is_not_kept(mesh):
    class Tabled(nn.Module):
        TABLE = np.arange(16.0)  # an array compares by neither value nor (safely) identity

        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, use_bias=False)(x * self.TABLE)

    first = fe.init_sharded(Tabled(), mesh, KEY, X)
    Tabled.TABLE[:] = 0.0  # changed in place: a kept program would not see it
    _, seen = traced_or_compiled(lambda: fe.init_sharded(Tabled(), mesh, KEY, X))
    assert ("compile", "jit(init)") in seen
    info = fel.init_cache_info()
    assert (info.hits, info.misses, info.currsize) == (0, 2, 0)
    assert first["params"]["Dense_0"]["kernel"].shape == (16, 4)
