"""The target a checkpoint is restored into (``flax_escale/tools/_checkpoint_target.py``).

A target that does not match what was saved (its tree, a leaf's shape or dtype) is named leaf
by leaf; ``cast=True`` converts between types of one kind, in the target's sharding; shardings
that do not fit, or have no devices, are refused before anything is read.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.checkpoints import small_tree, target_like

import flax_escale as fe


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            lambda t: target_like(t, dtype=jnp.bfloat16),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is bfloat16[8, 2]; pass cast=True",
        ),
        (
            lambda t: target_like(t, dtype=jnp.int8),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is int8[8, 2]; pass cast=True",
        ),
        (
            lambda t: target_like(t, shape=(4, 4)),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is float32[4, 4]; shapes must match",
        ),
        (
            lambda t: {**t, "b": t["w"]},
            "target leaves not saved: ['b']; saved leaves not in the target: []",
        ),
        (
            lambda t: {"v": t["w"]},
            "target leaves not saved: ['v']; saved leaves not in the target: ['w']",
        ),
        (
            lambda t: {"w": {"x": t["w"]}},
            "target leaves not saved: ['w/x']; saved leaves not in the target: ['w']",
        ),
    ],
)
def test_mismatched_targets_name_the_leaf(tmp_path, target, message):
    tree = small_tree()
    d = tmp_path / "c"
    fe.save_checkpoint(d, tree)
    with pytest.raises(fe.EscaleError, match=re.escape(message.format(d=repr(str(d))))):
        fe.restore_checkpoint(d, target(tree))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_true_converts(tmp_path, dtype):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    restored = fe.restore_checkpoint(tmp_path / "c", target_like(tree, dtype=dtype), cast=True)["w"]
    assert restored.dtype == dtype
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(tree["w"]).astype(dtype))


def test_a_list_restored_into_a_dict_says_which_container_differs(tmp_path):
    w = small_tree()["w"]
    fe.save_checkpoint(tmp_path / "c", {"layers": [w, w]})
    target = {"layers": {"0": w, "1": w}}
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "at 'layers' the checkpoint holds a list of ['0', '1'] where the target has a dict "
            "of ['0', '1']; restore into a tree of the kind that was saved"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target)


def test_a_target_sharding_that_does_not_divide_names_the_leaf_and_dimension(tmp_path):
    fe.save_checkpoint(tmp_path / "c", {"w": jnp.ones((7, 2))})
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    target = {
        "w": jax.ShapeDtypeStruct((7, 2), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    }
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "restore_checkpoint: the target leaf 'w': P('fsdp',) on mesh {'dp': 1, 'fsdp': 8, "
            "'ep': 1, 'tp': 1, 'sp': 1} splits dimension 0 of shape (7, 2) into 8 parts"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target)


@pytest.mark.parametrize(
    ("dtype", "kinds"),
    [(jnp.int8, "floating point into integer"), (jnp.bool_, "floating point into bool")],
)
def test_cast_never_converts_floats_into_another_kind(tmp_path, dtype, kinds):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    with pytest.raises(fe.EscaleError, match=re.escape(f"{kinds} would change the values")):
        fe.restore_checkpoint(tmp_path / "c", target_like(tree, dtype=dtype), cast=True)


def test_cast_converts_in_the_targets_sharding(tmp_path):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    columns = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tp",)), P(None, "tp"))
    target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.bfloat16, sharding=columns)}
    restored = fe.restore_checkpoint(tmp_path / "c", target, cast=True)["w"]
    assert restored.dtype == jnp.bfloat16
    assert restored.sharding.is_equivalent_to(columns, 2)
    expected = np.asarray(tree["w"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(restored).view(np.uint16), expected.view(np.uint16))


def test_an_abstract_mesh_is_refused_in_target_and_shardings(tmp_path):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    abstract = NamedSharding(fe.create_mesh((1, 8, 1, 1, 1)).abstract_mesh, P("fsdp"))
    message = (
        "{argument}: the leaf 'w' has a NamedSharding on an AbstractMesh {{'dp': 1, 'fsdp': 8, "
        "'ep': 1, 'tp': 1, 'sp': 1}}, which has no devices to restore onto; build the shardings "
        "on a concrete jax.sharding.Mesh"
    )
    target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=abstract)}
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message.format(argument="target"))):
        fe.restore_checkpoint(tmp_path / "c", target)
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message.format(argument="shardings"))):
        fe.restore_checkpoint(tmp_path / "c", tree, shardings={"w": abstract})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (P(None, "fsdp"), "splits dimension 1 of shape (8, 2) into 8 parts, which do not divide"),
        (P(None, None, "fsdp"), "has 3 entries for the 2 dimensions of shape (8, 2)"),
    ],
)
def test_shardings_that_do_not_fit_name_the_argument_and_leaf(tmp_path, spec, message):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    sharding = NamedSharding(fe.create_mesh((1, 8, 1, 1, 1)), spec)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape("shardings: the sharding of the leaf 'w': ") + ".*" + re.escape(message),
    ):
        fe.restore_checkpoint(tmp_path / "c", tree, shardings=sharding)


def test_a_target_leaf_without_a_named_sharding_is_named(tmp_path):
    fe.save_checkpoint(tmp_path / "c", small_tree())
    with pytest.raises(
        fe.EscaleError,
        match=re.escape("restore_checkpoint: the target leaf 'w' of shape (8, 2) has sharding"),
    ):
        fe.restore_checkpoint(tmp_path / "c", {"w": np.zeros((8, 2), np.float32)})


def test_an_nnx_state_with_rng_keys_round_trips(tmp_path):
    # Keys are stored as their key data, and the counts live on one device, unsharded.
    from flax import nnx

    model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    model.rngs()  # the count moves on: a value worth restoring
    fe.save_checkpoint(tmp_path / "c", nnx.state(model))
    fresh = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=9))
    restored = fe.restore_checkpoint(tmp_path / "c", nnx.state(fresh))
    nnx.update(fresh, restored)
    key, saved_key = fresh.rngs.key.get_value(), model.rngs.key.get_value()
    assert key.dtype == saved_key.dtype
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(saved_key))
    assert int(fresh.rngs.count.get_value()) == 1
