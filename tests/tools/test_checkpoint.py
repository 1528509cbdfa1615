import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import CKPT, MISTAKE, T, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe
from flax_escale import linen as fel

KERNEL_AXES = ("hidden_state", "mlp_intermediate")


def dense():
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), KERNEL_AXES)
    return nn.Dense(64, kernel_init=init)


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_train_state_restores_onto_a_mesh_of_another_shape(tmp_path):
    x = jnp.ones((4, 32))
    key = jax.random.key(0)
    saved_mesh = fe.create_mesh((1, 8, 1, 1, 1))
    state = fel.init_train_state(dense(), saved_mesh, key, x, tx=optax.adam(1e-3))
    state, _ = jax.jit(lambda s: (s.apply_gradients(grads=s.params), 0))(state)  # non-zero moments
    fe.save_checkpoint(tmp_path / "ckpt", state)

    serve_mesh = fe.create_mesh((2, 2, 1, 2, 1))
    target = fel.init_train_state(dense(), serve_mesh, key, x, tx=optax.adam(1e-3))
    restored = fe.restore_checkpoint(tmp_path / "ckpt", target)
    assert_bit_equal(restored, state)
    kernel = restored.params["kernel"]
    assert kernel.sharding.mesh == serve_mesh
    assert kernel.sharding.is_equivalent_to(NamedSharding(serve_mesh, P(("fsdp", "sp"), "tp")), 2)
    assert restored.opt_state[0].mu["kernel"].sharding.mesh == serve_mesh
    assert int(restored.step) == 1


def test_restore_with_plan_shardings_and_abstract_targets(tmp_path):
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    x = jnp.ones((4, 32))
    variables = fe.init_sharded(dense(), mesh, jax.random.key(1), x)
    fe.save_checkpoint(tmp_path / "v", variables)
    other = fe.create_mesh((2, 4, 1, 1, 1))
    plan = fe.plan_sharding(dense(), other, jax.random.key(1), x)
    abstract = jax.eval_shape(lambda: variables)
    restored = fe.restore_checkpoint(tmp_path / "v", abstract, shardings=plan.shardings())
    assert_bit_equal(restored, variables)
    assert restored["params"]["kernel"].sharding.spec == plan["params/kernel"].spec


def test_nnx_state_round_trip(tmp_path):
    @fe.sharded_module({"kernel": KERNEL_AXES})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(32, 64, rngs=rngs)

    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    model = fe.init_sharded(Up, mesh, 0)
    fe.save_checkpoint(tmp_path / "m", nnx.state(model))
    fresh = fe.init_sharded(Up, fe.create_mesh((1, 8, 1, 1, 1)), 1)
    restored = fe.restore_checkpoint(tmp_path / "m", nnx.state(fresh))
    nnx.update(fresh, restored)
    assert_bit_equal(nnx.state(fresh), nnx.state(model))
    assert fresh.wi.kernel.get_value().sharding.mesh.shape["fsdp"] == 8


def test_nnx_state_restores_into_an_abstract_model_with_plan_shardings(tmp_path):
    # The variables stay variables: an NNX state saves each value under ".../value".
    @fe.sharded_module({"kernel": KERNEL_AXES})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(32, 64, rngs=rngs)

    model = fe.init_sharded(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    fe.save_checkpoint(tmp_path / "m", nnx.state(model))
    other = fe.create_mesh((2, 4, 1, 1, 1))
    plan = fe.plan_sharding(Up, other, 0)
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Up(nnx.Rngs(0))))
    restored = fe.restore_checkpoint(tmp_path / "m", abstract, shardings=plan.shardings())
    assert_bit_equal(restored, nnx.state(model))
    assert restored["wi"]["kernel"].get_value().sharding.spec == plan["wi/kernel"].spec
    assert nnx.merge(graph, restored).wi.kernel.get_value().sharding.mesh == other


def test_errors(tmp_path):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    tree = {"w": jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, P("fsdp")))}
    fe.save_checkpoint(tmp_path / "c", tree)
    with pytest.raises(fe.EscaleError, match="exists; pass force=True"):
        fe.save_checkpoint(tmp_path / "c", tree)
    fe.save_checkpoint(tmp_path / "c", tree, force=True)
    with pytest.raises(fe.EscaleError, match="no checkpoint at"):
        fe.restore_checkpoint(tmp_path / "missing", tree)
    with pytest.raises(fe.EscaleError, match="NamedSharding"):
        fe.restore_checkpoint(tmp_path / "c", {"w": np.zeros((8, 2))})


def test_a_path_with_a_nul_character_is_refused_before_anything_is_written(tmp_path):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    tree = {"w": jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, P("fsdp")))}
    bad = str(tmp_path / "c\0k")
    message = r"directory must be a path without NUL characters, got '.*c\\x00k'.*remove"
    with pytest.raises(fe.EscaleError, match=message):
        fe.save_checkpoint(bad, tree)
    with pytest.raises(fe.EscaleError, match=message):
        fe.restore_checkpoint(bad, tree)
    assert list(tmp_path.iterdir()) == []


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.save_checkpoint(None, params()),
        T,
        "directory",
        "None",
        "/tmp/checkpoints",
        id="save_checkpoint-directory-none",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT.encode(), params()),
        T,
        "directory",
        "bytes b'",
        r"str or pathlib\.Path",
        id="save_checkpoint-directory-bytes",
    ),
    case(
        lambda: fe.save_checkpoint("", params()),
        fe.EscaleError,
        "directory",
        "''",
        "non-empty path",
        id="save_checkpoint-directory-empty",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, "params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="save_checkpoint-tree-string",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, None),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="save_checkpoint-tree-none",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, params(), force="yes"),
        T,
        "force",
        "'yes'",
        "True or False",
        id="save_checkpoint-force-string",
    ),
    case(
        lambda: fe.restore_checkpoint(3, params()),
        T,
        "directory",
        "int 3",
        "/tmp/checkpoints",
        id="restore_checkpoint-directory-int",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, "params"),
        T,
        "target",
        "'params'",
        "not its name",
        id="restore_checkpoint-target-string",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, None),
        T,
        "target",
        "None",
        "pytree of arrays",
        id="restore_checkpoint-target-none",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), shardings={"w": P("dp")}),
        T,
        "shardings",
        "P('dp',)",
        r"NamedSharding\(mesh, P\('dp',\)\)",
        id="restore_checkpoint-shardings-spec",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), shardings="dp"),
        fe.EscaleError,
        "shardings",
        "'dp'",
        "shaped like target",
        id="restore_checkpoint-shardings-string",
    ),
    case(
        lambda: fe.restore_checkpoint(
            CKPT, params(), shardings={"v": NamedSharding(mesh_dp_tp(), P())}
        ),
        fe.EscaleError,
        "shardings",
        "{'v': NamedSharding",
        "same keys",
        id="restore_checkpoint-shardings-other-keys",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), cast="yes"),
        T,
        "cast",
        "'yes'",
        "True or False",
        id="restore_checkpoint-cast-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
