"""``PartitionManager`` (``flax_escale/eformer/_manager.py``): resolving and sharding by names."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, X, case, raises_a_library_error

import flax_escale as fe
from flax_escale import eformer as escale


def test_partition_manager_resolves_and_shards():
    mesh = escale.create_mesh((1, 4, 1, 2, 1))
    manager = escale.PartitionManager(escale.PartitionAxis())
    axes = ["batch", "sequence", "hidden_state"]
    assert manager.resolve(axes) == P(("fsdp", "dp"), "sp", "tp")
    # eformer's decode_batch_axis follows batch_axis.
    assert manager.resolve(axes, mode="decode") == P(("fsdp", "dp"), "sp", "tp")
    # eformer's mode constants and semantic axis constants, by value.
    eformer_axes = ["__BATCH__", "__LENGTH__", "__EMBED__"]
    assert manager.resolve(eformer_axes, mode="__train__") == manager.resolve(axes)
    assert manager.resolve(eformer_axes, "__autoregressive__") == manager.resolve(axes, "decode")
    assert manager.resolve(["batch", "_", None]) == P(("fsdp", "dp"), None, None)
    # Shape-aware with a mesh: a hidden size of 3 cannot be split over tp=2.
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"size 3 is not divisible"):
        spec = manager.resolve(axes, shape=(8, 4, 3), mesh=mesh)
    assert spec == P(("fsdp", "dp"), "sp", None)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: manager.shard(x, axes, mode=1))(jnp.ones((8, 1, 16)))
        with pytest.raises(ValueError, match=r"(?s)size 3 is not divisible.*strict=True"):
            manager.shard(jnp.ones((8, 4, 3)), axes, auto_correct=False)
    assert y.addressable_shards[0].data.shape == (2, 1, 8)  # decode: batch over (fsdp, dp)
    assert manager == escale.PartitionManager(escale.PartitionAxis())
    assert hash(manager) == hash(escale.PartitionManager(escale.PartitionAxis()))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: m.resolve(["batch", "heads"]), ValueError, r"unknown logical axis 'heads'"),
        (lambda m: m.resolve(["batch"], mode="serve"), ValueError, r"unknown mode 'serve'"),
        (lambda m: m.resolve(["batch"], mode=0), ValueError, r"mode=0 reads the size of dim"),
        (lambda m: m.resolve([("fsdp", "sp")]), TypeError, r"one logical name or None, got tup"),
        (lambda m: escale.PartitionManager("tp"), TypeError, r"must be a PartitionAxis, got str"),
    ],
)
def test_partition_manager_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(escale.PartitionManager(escale.PartitionAxis()))


CASES = [
    case(
        lambda: fe.eformer.PartitionManager("dp"),
        T,
        "paxis",
        "'dp'",
        r"PartitionAxis\(\)",
        id="eformer-PartitionManager-string",
    ),
    case(
        lambda: fe.eformer.PartitionManager(fe.PartitionAxis()).resolve("batch"),
        T,
        "axes",
        "'batch'",
        r"pass \('batch',\)",
        id="eformer-PartitionManager-resolve-string",
    ),
    case(
        lambda: fe.eformer.PartitionManager(fe.PartitionAxis()).shard(X, "batch"),
        T,
        "axes",
        "'batch'",
        r"pass \('batch',\)",
        id="eformer-PartitionManager-shard-string",
    ),
    # --- numbers and names that passed silently ------------------------------------------------
    case(
        lambda: fe.eformer.PartitionManager(fe.PartitionAxis()).shard(X, ["batch"]),
        fe.EscaleError,
        "axes",
        "('batch',) name 1 dimensions but x has shape (8, 4)",
        "one logical name \\(or None\\) per dimension",
        id="eformer-PartitionManager-shard-too-few-names",
    ),
    case(
        lambda: fe.eformer.PartitionManager(fe.PartitionAxis()).resolve(
            ("batch", None), mode=5, shape=(8, 4)
        ),
        fe.EscaleError,
        "mode=5",
        "the shape (8, 4) has 2",
        "a dimension index of x, or a mode name",
        id="eformer-PartitionManager-mode-out-of-range",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
