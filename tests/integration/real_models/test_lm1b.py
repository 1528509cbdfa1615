"""Flax's lm1b decoder (Linen, t5x logical names, short DenseGeneral annotations), unchanged.

The model file (``lm1b_model.py``) is annotated exactly as the example is; nothing here adds to
it. It is sharded three ways: with the t5x aliases of the library's vocabulary, with the rules
the example's own config writes for a ``("data", "fsdp", "tensor")`` mesh, and with t5x's
standard rules pointed at the library's axes. Each time the values are bit-equal to the
unsharded init and three training steps match the unsharded ones.
"""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import MESHES
from support.real_models import lm1b_model as lm
from support.real_models.harness import (
    KEY,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    SLACK,
    assert_bit_equal,
    assert_close,
    assert_ideal_share,
    flat,
    flat_shardings,
    linen_reference,
    linen_sharded,
    lm_loss,
    place_batch,
    token_batch,
)

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale.t5x import standard_logical_axis_rules

pytestmark = [pytest.mark.slow, pytest.mark.xla]

RULES = fe.PartitionAxis().with_aliases("t5x")
TOKENS = token_batch()
# SGD with momentum: its state is sharded like the parameters, and unlike Adam (whose update
# has the sign of even a rounding-sized gradient) it keeps sharded and unsharded runs close.
TX = optax.sgd(0.5, momentum=0.9)
CONFIGS = {"unscanned": lm.small_config(), "scanned": lm.small_config(scan_layers=True)}
# The unscanned model on every mesh; the scanned one (the same blocks stacked) on the mesh that
# uses every kind of axis, to keep this directory's compile time down (its plan on fsdp=8 is
# checked below without compiling).
CASES = [("unscanned", name) for name in MESHES] + [("scanned", "dp2_fsdp2_tp2")]
ATTENTION = ("query", "key", "value", "out")
HIDDEN = ("fsdp", "sp")


def model_of(variant):
    return lm.TransformerLM(CONFIGS[variant])


def loss_of(model):
    # lm1b shifts the inputs right itself: the targets are the inputs.
    return lambda params, batch: lm_loss(model.apply({"params": params}, batch[0]), batch[0])


@functools.cache
def reference(variant):
    model = model_of(variant)
    return linen_reference(model, (TOKENS,), TX, loss_of(model))


@functools.cache
def sharded(variant, mesh_name):
    model, mesh = model_of(variant), fe.create_mesh(MESHES[mesh_name])
    batch = (place_batch(mesh, TOKENS, rules=RULES),)
    lowered = mesh_name == "fsdp8"  # there, also measure the compiled init
    return linen_sharded(model, mesh, (TOKENS,), TX, loss_of(model), RULES, batch, lowered=lowered)


def attention_kernels(plan):
    return [e for e in plan if e.path.split("/")[-2] in ATTENTION]


@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_short_attention_annotations_keep_flax_meaning(variant):
    mesh = fe.create_mesh(MESHES["fsdp8"])
    plan = fe.plan_sharding(model_of(variant), mesh, KEY, TOKENS, rules=RULES)
    assert plan.corrections == ()
    assert plan.unannotated == ()
    kernels = attention_kernels(plan)
    stacked = variant == "scanned"
    assert len(kernels) == 4 * (1 if stacked else 2)
    for entry in kernels:
        # ('embed', 'kv') on a rank-3 kernel (rank 4 with the scanned 'layers' axis in front):
        # the two names apply to the leading dimensions, the last one is unsharded.
        names = ("layers", "embed", "kv") if stacked else ("embed", "kv")
        assert entry.annotation.logical_axes == names, entry.path
        assert entry.resolution.padded == 1, entry.path
        assert len(entry.shape) == len(names) + 1
        lead = (None,) if stacked else ()
        assert entry.spec == P(*lead, HIDDEN, None, None), (entry.path, entry.spec)
    assert "Flax's short form" in plan.describe()


@pytest.mark.parametrize(("variant", "mesh_name"), CASES)
def test_init_is_bit_equal_to_unsharded(variant, mesh_name):
    result = sharded(variant, mesh_name)
    count = assert_bit_equal(result["initial"], reference(variant)["variables"]["params"])
    assert count == (17 if variant == "scanned" else 29)
    mesh = fe.create_mesh(MESHES[mesh_name])
    plan = fe.plan_sharding(model_of(variant), mesh, KEY, TOKENS, rules=RULES)
    params = flat(result["initial"])
    for entry in plan:
        leaf = params[entry.path.removeprefix("params/")]
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, entry.spec), leaf.ndim)


@pytest.mark.parametrize(("variant", "mesh_name"), CASES)
def test_three_steps_match_unsharded(variant, mesh_name):
    result, expected = sharded(variant, mesh_name), reference(variant)
    np.testing.assert_allclose(result["losses"], expected["losses"], **LOSS_TOLERANCE)
    assert result["losses"][-1] < result["losses"][0] - 0.1  # it learns something
    assert_close(result["params"], expected["params"], **PARAM_TOLERANCE)
    initial = flat(result["initial"])
    unchanged = [p for p, x in flat(result["params"]).items() if np.array_equal(x, initial[p])]
    assert unchanged == []


def test_each_device_holds_an_eighth_on_fsdp8():
    result = sharded("unscanned", "fsdp8")  # built with fe.lower_init(...).compile()
    largest, total = assert_ideal_share(result["state"].params)
    assert largest == total // 8  # every dimension divides: exactly an eighth
    assert_ideal_share(result["state"].opt_state)
    assert total == sum(x.nbytes for x in flat(reference("unscanned")["variables"]).values())
    output = result["memory"].output_size_in_bytes
    assert total / 8 <= output <= SLACK * total / 8, (output, total)


def test_the_scanned_plan_gives_each_device_an_eighth_on_fsdp8():
    mesh = fe.create_mesh(MESHES["fsdp8"])
    plan = fe.plan_sharding(model_of("scanned"), mesh, KEY, TOKENS, rules=RULES)
    assert plan.nbytes == plan.nbytes_per_device * 8
    # The stacked axis is named 'layers' and stays unsharded; the rest is as unscanned.
    for entry in plan:
        stacked = "encoderdecoderblock/" in entry.path
        assert (entry.annotation.logical_axes[0] == "layers") == stacked, entry.path
        assert (entry.spec[0] is None) or not stacked, entry.path


def test_own_config_rules_on_a_mesh_named_like_lm1b():
    """The rules of lm1b's configs/default.py, as written, on its ('data', 'fsdp', 'tensor')."""
    model = model_of("unscanned")
    mesh = fe.create_mesh((2, 2, 2), lm.MESH_AXES)
    rules = lm.LOGICAL_AXIS_RULES
    # lm1b's rules have no 'kv': as in Flax it stays unsharded, but not in silence.
    with pytest.warns(fe.ShardingCorrectionWarning, match="'kv' has no rule"):
        state = fel.init_train_state(model, mesh, KEY, TOKENS, tx=TX, rules=rules)
    assert_bit_equal(state.params, reference("unscanned")["variables"]["params"])

    # The same layout as lm1b's own setup: Flax's logical_to_mesh_sharding with these rules.
    abstract = jax.eval_shape(model.init, KEY, TOKENS)
    flax_shardings = flat_shardings(
        nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    )
    params = flat(state.params)
    assert len(params) == 29
    for path, leaf in params.items():
        assert leaf.sharding.is_equivalent_to(flax_shardings[f"params/{path}"], leaf.ndim), path
    kernel = params["decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0/kernel"]
    assert kernel.sharding.spec == P("fsdp", "tensor")

    # lm1b shards its batch over 'data' (config.data_sharding): the library's data helpers
    # give that layout once 'batch' is sent there.
    batch = place_batch(mesh, TOKENS, logical_axes=("batch", None), rules=[("batch", "data")])
    assert batch.sharding.is_equivalent_to(NamedSharding(mesh, P(*lm.DATA_SHARDING)), 2)


def test_t5x_standard_rules_pointed_at_fsdp_and_tp():
    """t5x's standard rules (2-D parameters) on the library's axes match Flax's own lookup."""
    model, mesh = model_of("unscanned"), fe.create_mesh(MESHES["fsdp4_tp2"])
    rules = standard_logical_axis_rules(1, 2, data_axis="fsdp", model_axis="tp")
    assert ("embed", "fsdp") in rules
    assert ("mlp", "tp") in rules
    plan = fe.plan_sharding(model, mesh, KEY, TOKENS, rules=rules)
    assert plan.corrections == ()
    abstract = jax.eval_shape(model.init, KEY, TOKENS)
    flax_shardings = flat_shardings(
        nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    )
    for entry in plan:
        expected = flax_shardings[entry.path]
        assert NamedSharding(mesh, entry.spec).is_equivalent_to(expected, len(entry.shape)), (
            entry.path,
            entry.spec,
            expected.spec,
        )
    block = "params/decoder/encoderdecoderblock_0"
    assert plan[f"{block}/MlpBlock_0/Dense_0/kernel"].spec == P("fsdp", "tp")
    assert plan[f"{block}/MultiHeadDotProductAttention_0/query/kernel"].spec == P(
        "fsdp", None, None
    )
    assert plan["params/decoder/Embed_0/embedding"].spec == P("tp", "fsdp")
