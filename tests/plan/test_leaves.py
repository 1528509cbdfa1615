"""One reading of annotations: every way of annotating gives the same plan through every consumer.

The same two-kernel model is annotated in each way Flax and the library offer; every consumer
(the front end's plan and init, the partitioner, the report, ``check_sharded``) must give the
specs written out below, which are the rules' answer worked out by hand.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.linen import partitioning
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import plan as fep
from flax_escale.t5x import AxisNames, Partitioner

UP = ("hidden_state", "mlp_intermediate")
DOWN = ("mlp_intermediate", "hidden_state")
# PartitionAxis() rules on fsdp=4 x tp=2, both kernels dividing: column- then row-wise.
EXPECTED = {"up/kernel": P(("fsdp", "sp"), "tp"), "down/kernel": P("tp", ("fsdp", "sp"))}
MESH_UP = (("fsdp", "sp"), "tp")
MESH_DOWN = ("tp", ("fsdp", "sp"))
INIT = nn.initializers.lecun_normal()
X = jnp.ones((2, 64))


def _linen(kernel_init_up, kernel_init_down):
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(256, use_bias=False, name="up", kernel_init=kernel_init_up)(x)
            return nn.Dense(64, use_bias=False, name="down", kernel_init=kernel_init_down)(h)

    return Mlp()


def linen_logical():
    return _linen(nn.with_logical_partitioning(INIT, UP), nn.with_logical_partitioning(INIT, DOWN))


def linen_mesh_axes():
    return _linen(nn.with_partitioning(INIT, MESH_UP), nn.with_partitioning(INIT, MESH_DOWN))


def linen_declared():
    @fe.sharded_module({"up/kernel": UP, "down/kernel": DOWN})
    class Declared(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(256, use_bias=False, name="up")(x)
            return nn.Dense(64, use_bias=False, name="down")(h)

    return Declared()


def linen_param_with_axes():
    class Dense(nn.Module):
        features: int
        axes: tuple

        @nn.compact
        def __call__(self, x):
            shape = (x.shape[-1], self.features)
            kernel = partitioning.param_with_axes("kernel", INIT, shape, axes=self.axes)
            return x @ kernel

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Dense(64, DOWN, name="down")(Dense(256, UP, name="up")(x))

    return Mlp()


def _nnx(up_init, down_init):
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 256, use_bias=False, kernel_init=up_init, rngs=rngs)
            self.down = nnx.Linear(256, 64, use_bias=False, kernel_init=down_init, rngs=rngs)

    return Mlp


def nnx_declared():
    @fe.sharded_module({"up/kernel": UP, "down/kernel": DOWN})
    class Declared(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 256, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(256, 64, use_bias=False, rngs=rngs)

    return Declared


def nnx_with_partitioning_logical():
    return _nnx(nnx.with_partitioning(INIT, UP), nnx.with_partitioning(INIT, DOWN))


def nnx_with_partitioning_mesh_axes():
    return _nnx(nnx.with_partitioning(INIT, MESH_UP), nnx.with_partitioning(INIT, MESH_DOWN))


def nnx_with_metadata():
    return _nnx(
        nnx.with_metadata(INIT, out_sharding=UP), nnx.with_metadata(INIT, out_sharding=DOWN)
    )


def nnx_logical_axes_metadata():
    return _nnx(
        nnx.with_metadata(INIT, logical_axes=UP), nnx.with_metadata(INIT, logical_axes=DOWN)
    )


LINEN = [linen_logical, linen_mesh_axes, linen_declared, linen_param_with_axes]
NNX = [
    nnx_declared,
    nnx_with_partitioning_logical,
    nnx_with_partitioning_mesh_axes,
    nnx_with_metadata,
    nnx_logical_axes_metadata,
]


def _by_name(specs):
    """``{"up/kernel": spec}`` from any tree of specs or arrays, specs padded to rank 2."""
    flat = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P) or hasattr(x, "sharding")
    )[0]
    found = {}
    for path, leaf in flat:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        spec = leaf.sharding.spec if hasattr(leaf, "sharding") else leaf
        if spec is not None and keys[-1] == "kernel":
            found["/".join(keys[-2:])] = P(*spec, *(None,) * (2 - len(spec)))
    return found


def _tree_consumers(abstract, mesh):
    partitioner = Partitioner(mesh=mesh)
    report = fe.sharding_report(abstract, mesh, show=False)
    fe.check_sharded(abstract, mesh, min_bytes=0)  # raises if any kernel was read as replicated
    return {
        "Partitioner.get_mesh_axes": _by_name(partitioner.get_mesh_axes(abstract)),
        "Partitioner.plan_sharding": _by_name(partitioner.plan_sharding(abstract).specs()),
        "sharding_report": _by_name(report.plan.specs()),
    }


@pytest.mark.parametrize("build", LINEN, ids=lambda f: f.__name__)
def test_linen_annotations_agree_everywhere(mesh, build):
    model, key = build(), jax.random.key(0)
    abstract = jax.eval_shape(model.init, key, X)
    results = {
        "linen.plan_sharding": _by_name(fe.plan_sharding(model, mesh, key, X).specs()),
        "linen.init_sharded": _by_name(fe.init_sharded(model, mesh, key, X)),
        "init_sharded": _by_name(fe.init_sharded(model, mesh, key, X)),
        **_tree_consumers(abstract, mesh),
    }
    for consumer, specs in results.items():
        assert specs == EXPECTED, consumer


@pytest.mark.parametrize("build", NNX, ids=lambda f: f.__name__)
def test_nnx_annotations_agree_everywhere(mesh, build):
    model = build()
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    results = {
        "nnx.plan_sharding": _by_name(fe.plan_sharding(model, mesh, 0).specs()),
        "nnx.init_sharded": _by_name(nnx.state(fe.init_sharded(model, mesh, 0))),
        "init_sharded": _by_name(nnx.state(fe.init_sharded(model, mesh, 0))),
        **_tree_consumers(abstract, mesh),
        "abstract state": _tree_consumers(nnx.state(abstract), mesh)["sharding_report"],
    }
    for consumer, specs in results.items():
        assert specs == EXPECTED, consumer


def test_partitioner_reads_param_with_axes_like_t5x(mesh):
    # t5x's own rules on its data x model mesh: embed unsharded, mlp over model.
    t5x_mesh = fe.create_mesh((2, 4), ("data", "model"))

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = partitioning.param_with_axes("w", INIT, (16, 32), axes=("embed", "mlp"))
            return x @ w

    abstract = jax.eval_shape(Layer().init, jax.random.key(0), jnp.ones((2, 16)))
    partitioner = Partitioner(mesh=t5x_mesh)
    assert partitioner.get_mesh_axes(abstract)["params"]["w"] == P(None, "model")
    assert partitioner.get_logical_axes(abstract)["params"]["w"] == AxisNames("embed", "mlp")


# Mistakes with annotated_leaves, one case each (what a case asserts: support/mistakes.py).
MISTAKES = [
    case(
        lambda: fep.annotated_leaves("params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="annotated_leaves-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, MISTAKES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
