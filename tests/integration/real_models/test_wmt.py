"""Flax's wmt encoder-decoder (Linen, shared embedding made in ``setup``), unchanged.

The example carries no sharding annotation at all (it trains with ``jax.pmap``), so as written
it can only be replicated. The library can annotate it without touching its file:
``fe.sharded_module`` patterns in t5x's names on a subclass, which leaves the class itself
alone; with the t5x aliases that model is then sharded, bit-equal to the unsharded init, and
trains like it.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from support import MESHES
from support.real_models import wmt_model as wmt
from support.real_models.harness import (
    KEY,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    SLACK,
    assert_bit_equal,
    assert_close,
    assert_ideal_share,
    flat,
    linen_reference,
    linen_sharded,
    lm_loss,
    place_batch,
    token_batch,
)
from support.real_models.wmt_annotated import AnnotatedTransformer

import flax_escale as fe

pytestmark = [pytest.mark.slow, pytest.mark.xla]

RULES = fe.PartitionAxis().with_aliases("t5x")
INPUTS = token_batch(seed=1)
TARGETS = token_batch(seed=2)
TX = optax.sgd(0.5, momentum=0.9)
# One encoder and one decoder layer (the decoder's has three attentions): two layers in all,
# which keeps the compile time of this, the largest of the models, in bounds.
CONFIG = wmt.small_config(num_layers=1)
HIDDEN = ("fsdp", "sp")


def loss_of(model):
    # The decoder shifts the targets right itself: they are also the labels.
    def loss(params, batch):
        inputs, targets = batch
        return lm_loss(model.apply({"params": params}, inputs, targets), targets)

    return loss


@functools.cache
def reference():
    model = wmt.Transformer(CONFIG)
    return linen_reference(model, (INPUTS, TARGETS), TX, loss_of(model))


@functools.cache
def sharded(mesh_name):
    model, mesh = AnnotatedTransformer(CONFIG), fe.create_mesh(MESHES[mesh_name])
    batch = tuple(place_batch(mesh, tokens, rules=RULES) for tokens in (INPUTS, TARGETS))
    lowered = mesh_name == "fsdp8"
    return linen_sharded(
        model, mesh, (INPUTS, TARGETS), TX, loss_of(model), RULES, batch, lowered=lowered
    )


@functools.cache
def unannotated_plan():
    model, mesh = wmt.Transformer(CONFIG), fe.create_mesh(MESHES["fsdp8"])
    return fe.plan_sharding(model, mesh, KEY, INPUTS, TARGETS, rules=RULES)


def test_the_example_as_written_is_replicated():
    plan = unannotated_plan()
    params = flat(reference()["variables"]["params"])
    assert "shared_embedding/embedding" in params  # made in setup, used by both halves
    assert not any(path.endswith("Embed_0/embedding") for path in params)
    assert len(plan.unannotated) == len(plan) == len(params) == 35
    assert plan.corrections == ()
    assert all(axes is None for entry in plan for axes in entry.spec)
    # Its values are those of the annotated subclass below (a declaration only names axes):
    # the bit-equality tests of that model hold for this one.


def test_the_example_as_written_gets_no_idle_axes_either():
    # Idle axes are those the rules split some variable over; with no annotation anywhere no
    # axis is a parameter axis, so nothing is completed: patterns (below) or overrides shard it.
    plan = unannotated_plan()
    assert plan.completions == ()
    assert plan.nbytes_per_device == plan.nbytes


def test_patterns_from_outside_leave_the_class_alone():
    mesh = fe.create_mesh(MESHES["fsdp8"])
    annotated = fe.plan_sharding(
        AnnotatedTransformer(CONFIG), mesh, KEY, INPUTS, TARGETS, rules=RULES
    )
    plain = fe.plan_sharding(wmt.Transformer(CONFIG), mesh, KEY, INPUTS, TARGETS, rules=RULES)
    assert annotated.unannotated == ()
    assert annotated.corrections == ()
    assert len(plain.unannotated) == len(plain)
    assert annotated["params/shared_embedding/embedding"].annotation.logical_axes == (
        "vocab",
        "embed",
    )


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_init_is_bit_equal_to_unsharded(mesh_name):
    result = sharded(mesh_name)
    assert assert_bit_equal(result["initial"], reference()["variables"]["params"]) == 35
    params = flat(result["initial"])
    mesh = fe.create_mesh(MESHES[mesh_name])
    query = params["encoder/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"]
    embedding = params["shared_embedding/embedding"]
    if mesh.shape["tp"] == 1:
        # heads -> tp is passed over (tp has size 1); embed's fallback takes fsdp.
        assert query.sharding.spec == P(HIDDEN, None, None)
    else:
        assert query.sharding.spec == P(HIDDEN, "tp", None)
        assert embedding.sharding.spec == P("tp", HIDDEN)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_three_steps_match_unsharded(mesh_name):
    result, expected = sharded(mesh_name), reference()
    np.testing.assert_allclose(result["losses"], expected["losses"], **LOSS_TOLERANCE)
    assert result["losses"][-1] < result["losses"][0] - 0.1
    assert_close(result["params"], expected["params"], **PARAM_TOLERANCE)
    initial = flat(result["initial"])
    unchanged = [p for p, x in flat(result["params"]).items() if np.array_equal(x, initial[p])]
    assert unchanged == []


def test_each_device_holds_an_eighth_on_fsdp8():
    result = sharded("fsdp8")
    largest, total = assert_ideal_share(result["state"].params)
    assert largest == total // 8
    assert_ideal_share(result["state"].opt_state)
    output = result["memory"].output_size_in_bytes
    assert total / 8 <= output <= SLACK * total / 8, (output, total)
    assert jax.tree.structure(result["variables"]) == jax.tree.structure(reference()["variables"])
