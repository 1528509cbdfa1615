"""Foreign vocabularies (``PartitionAxis.with_aliases``) and Flax's short annotations.

The built-in vocabularies (``VOCABULARIES``) cover every name of the rules they come from, each
with its meaning here: a model written in MaxText's or t5x's names resolves with no name left
without a rule.
"""

import itertools
import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import MESHES
from support.lowered import sharding_constraints

import flax_escale as fe
from flax_escale.axes import VOCABULARIES

ALIASED = fe.PartitionAxis().with_aliases("t5x", "maxtext")


NATIVE = fe.PartitionAxis()


NAMED = [
    (vocabulary, foreign, target)
    for vocabulary, aliases in VOCABULARIES.items()
    for foreign, target in aliases.items()
]


MIXTRAL_EXPERTS = {
    "wi_0": (("exp", "embed_moe", "mlp_moe"), (8, 1024, 3584)),
    "wi_1": (("exp", "embed_moe", "mlp_moe"), (8, 1024, 3584)),
    "wo": (("exp", "mlp_moe", "embed_moe"), (8, 3584, 1024)),
}


MIXTRAL_DENSE = {
    "query": (("embed", "q_heads", "kv"), (1024, 32, 128)),
    "key": (("embed", "kv_heads", "kv_head_dim"), (1024, 8, 128)),
    "out": (("heads", "kv", "embed"), (32, 128, 1024)),
    "embedding": (("vocab", "embed"), (32000, 1024)),
    "logits_dense": (("embed", "vocab"), (1024, 32000)),
}


MIXTRAL_GATE = (("embed", None), (1024, 8))


def _split(mesh, spec):
    """Into how many pieces a spec splits an array on ``mesh``."""
    axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    assert len(axes) == len(set(axes)), spec
    return math.prod(mesh.shape[a] for a in axes)


NATIVE_NAMES = frozenset(fe.PartitionAxis().logical_axes())


MAXTEXT = fe.PartitionAxis().with_aliases("maxtext")


# MaxText 0.2.4 (the release pip installs beside jax 0.10), maxtext/configs/base.yml: every
# logical name of logical_axis_rules, in the order of first appearance (76 rules, 70 names).
MAXTEXT_BASE = (
    "circular_repeats",
    "activation_embed_and_logits_batch",
    "activation_embed_and_logits_batch_sequence",
    "activation_vocab",
    "vocab",
    "embed_vocab",
    "activation_batch_attn",
    "activation_input_length_attn",
    "activation_heads",
    "activation_kv_heads",
    "activation_length_attn",
    "activation_q_length",
    "activation_kv_length",
    "activation_embed_attn",
    "activation_kv",
    "activation_kv_batch",
    "activation_kv_head_dim",
    "heads",
    "q_heads",
    "kv_heads",
    "qkv",
    "kv",
    "kv_head_dim",
    "q_lora",
    "q_lora_up_proj",
    "kv_lora",
    "kv_lora_up_proj",
    "activation_batch_moe",
    "activation_length_moe",
    "activation_norm_length_moe",
    "activation_embed_moe",
    "activation_mlp_moe",
    "activation_exp",
    "exp",
    "mlp_moe",
    "embed_moe",
    "activation_mlp",
    "activation_batch",
    "activation_length",
    "activation_norm_length",
    "activation_embed",
    "activation_stage",
    "mlp",
    "gdn_head",
    "embed",
    "norm",
    "layers",
    "diloco",
    "engram_dim",
    "dense_layers",
    "moe_layers",
    "local_layers",
    "mhc",
    "prefill_activation_length",
    "prefill_activation_norm_length",
    "activation_prefill_kv_batch",
    "decode_batch",
    "decode_length",
    "cache_heads",
    "paged_kv_heads",
    "cache_batch_prefill",
    "cache_batch",
    "cache_heads_none",
    "cache_kv",
    "cache_sequence",
    "num_pages",
    "tokens_per_page",
    "paged_kv_head_dim_size",
    "mlp_no_fsdp",
    "exp_with_fsdp",
)


# Of those, the names whose every rule there is [] (MaxText leaves them unsplit).
MAXTEXT_BASE_UNSPLIT = (
    "circular_repeats",
    "activation_kv_length",
    "qkv",
    "kv",
    "kv_head_dim",
    "q_lora_up_proj",
    "kv_lora_up_proj",
    "dense_layers",
    "moe_layers",
    "local_layers",
    "mhc",
    "decode_length",
    "cache_batch_prefill",
    "cache_batch",
    "cache_heads_none",
    "cache_kv",
    "cache_sequence",
    "num_pages",
    "tokens_per_page",
    "paged_kv_head_dim_size",
)


# MaxText 0.2.4's code (maxtext/common/common_types.py) names a quantized cache's scales, which
# no base rule names.
MAXTEXT_CODE = ("cache_scale_batch", "cache_scale_sequence", "cache_scale_heads", "cache_scale_kv")


# The names of the base configs of MaxText 0.1.0, 0.2.0 and 0.2.5 that 0.2.4's lacks.
MAXTEXT_OTHER_RELEASES = (
    "activation_batch_no_exp",
    "activation_length_no_exp",
    "activation_q_length_no_exp",
    "activation_kv_batch_no_exp",
    "embed_no_exp",
    "embed_tensor_transpose",
    "activation_attn_length",
    "activation_attn_length_no_exp",
    "activation_attn_embed",
    "embed_attn",
    "embed_router",
    "segment_ids_batch",
)


# t5x (google-research/t5x, commit cc342d4): the names of standard_logical_axis_rules in
# t5x/partitioning.py, then those of the mixture-of-experts rules in
# t5x/contrib/moe/partitioning.py (expert_group from that file's earlier versions).
T5X_STANDARD = (
    "batch",
    "vocab",
    "embed",
    "mlp",
    "heads",
    "kv",
    "joined_kv",
    "relpos_buckets",
    "abspos_buckets",
    "length",
    "layers",
    "stack",
    "mlp_activations",
)


T5X_MOE = ("expert", "expert_mlp", "expert_replicas", "unmodeled", "expert_group")


SOURCES = {
    "maxtext": MAXTEXT_BASE + MAXTEXT_CODE + MAXTEXT_OTHER_RELEASES,
    "t5x": T5X_STANDARD + T5X_MOE,
}


# What MaxText splits and what it leaves whole, against what the aliases do with the default
# PartitionAxis. Where they differ, it is on purpose, for the reason given.
SPLIT_THERE_NOT_HERE = {
    # The dimension inside a head: MaxText's fallback for heads that tp does not divide; the
    # library never splits inside a head.
    "activation_kv": "attention_dim",
    "activation_kv_head_dim": "attention_kv_dim",
    # Normalization scales stay replicated, as the library's own are.
    "norm": None,
    # Pipeline stages and DiLoCo replicas: mesh axes the library's meshes do not have (stage is
    # what layers_axis names, unset by default).
    "activation_stage": "layers",
    "layers": "layers",
    "diloco": None,
}


SPLIT_HERE_NOT_THERE = {
    # Keys' length and the cache: the library's key_sequence and batch, whose axes
    # PartitionAxis sets (MaxText's inference config splits these too).
    "activation_kv_length": "key_sequence",
    "cache_sequence": "key_sequence",
    "cache_batch": "batch",
    "cache_batch_prefill": "batch",
}


# A model written in MaxText's names, every name of its base config among its variables and
# activations. Sizes: batch 8, length 16, embed 64, heads 8, head dim 16, mlp 128, vocab 256,
# experts 8, layers 4, latent (LoRA) rank 32.
B, S, E, H, D, M, V, X, L, Q = 8, 16, 64, 8, 16, 128, 256, 8, 4, 32


PARAMS = {
    "embedding": (("vocab", "embed_vocab"), (V, E)),
    "logits": (("embed_vocab", "vocab"), (E, V)),
    "query": (("embed", "q_heads", "kv"), (E, H, D)),
    "key": (("embed", "kv_heads", "kv_head_dim"), (E, H, D)),
    "out": (("heads", "kv", "embed"), (H, D, E)),
    "fused_qkv": (("embed", "qkv", "heads", "kv"), (E, 3, H, D)),
    "wq_a": (("embed", "q_lora_up_proj"), (E, Q)),
    "q_norm": (("norm",), (Q,)),
    "wq_b": (("q_lora", "q_heads", "kv"), (Q, H, D)),
    "wkv_a": (("embed", "kv_lora_up_proj"), (E, Q)),
    "wkv_b": (("kv_lora", "kv_heads", "kv_head_dim"), (Q, H, D)),
    "wi": (("embed", "mlp"), (E, M)),
    "wo": (("mlp", "embed"), (M, E)),
    "gdn_in": (("embed", "gdn_head"), (E, M)),
    "gdn_out": (("gdn_head", "embed"), (M, E)),
    "engram_key": (("engram_dim", "mhc", "embed"), (M, 4, E)),
    "gate": (("embed", None), (E, X)),
    "wi_0": (("exp", "embed_moe", "mlp_moe"), (X, E, M)),
    "wo_moe": (("exp", "mlp_moe", "embed_moe"), (X, M, E)),
    "scanned": (("layers", "embed", "mlp"), (L, E, M)),
    "dense_stack": (("dense_layers", "embed", "mlp"), (L, E, M)),
    "moe_stack": (("moe_layers", "exp", "embed_moe", "mlp_moe"), (L, X, E, M)),
    "local_stack": (("local_layers", "embed", "mlp"), (L, E, M)),
    "circular": (("circular_repeats", "layers", "embed", "mlp"), (2, L, E, M)),
    "diloco": (("diloco", "embed", "mlp"), (2, E, M)),
}


CACHE = {
    "key": (("cache_batch", "cache_sequence", "cache_heads", "cache_kv"), (B, S, H, D)),
    "latent": (
        ("cache_batch_prefill", "cache_sequence", "cache_heads_none", "cache_kv"),
        (B, S, 1, Q),
    ),
    "pages": (
        ("paged_kv_heads", "num_pages", "tokens_per_page", "paged_kv_head_dim_size"),
        (H, 8, 8, D),
    ),
    "scale": (
        ("cache_scale_batch", "cache_scale_sequence", "cache_scale_heads", "cache_scale_kv"),
        (B, S, H, 1),
    ),
}


ACTIVATIONS = (
    (("activation_embed_and_logits_batch", "activation_length", "activation_embed"), (B, S, E)),
    (("activation_embed_and_logits_batch", "activation_length", "activation_vocab"), (B, S, V)),
    (("activation_embed_and_logits_batch_sequence", "activation_vocab"), (B * S, V)),
    (("activation_batch_attn", "activation_input_length_attn", "activation_embed_attn"), (B, S, E)),
    (
        ("activation_batch", "activation_q_length", "activation_heads", "activation_kv"),
        (B, S, H, D),
    ),
    (
        (
            "activation_kv_batch",
            "activation_kv_length",
            "activation_kv_heads",
            "activation_kv_head_dim",
        ),
        (B, S, H, D),
    ),
    (
        (
            "activation_kv_batch",
            "activation_length_attn",
            "activation_kv_heads",
            "activation_kv_head_dim",
        ),
        (B, S, H, D),
    ),
    (
        ("activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv"),
        (B, S, H, D),
    ),
    (("activation_batch", "activation_norm_length", "activation_embed"), (B, S, E)),
    (("activation_batch", "activation_length", "activation_mlp"), (B, S, M)),
    (("activation_batch_moe", "activation_length_moe", "activation_embed_moe"), (B, S, E)),
    (("activation_batch_moe", "activation_norm_length_moe", None), (B, S, X)),
    (("activation_exp", None, None, "activation_mlp_moe"), (X, B, S, M)),
    (("exp_with_fsdp", None, "mlp_no_fsdp"), (X, E, M)),
    (
        ("activation_stage", "activation_batch", "activation_length", "activation_embed"),
        (2, B, S, E),
    ),
    (("activation_prefill_kv_batch", "prefill_activation_length", "activation_embed"), (B, S, E)),
    (("activation_batch", "prefill_activation_norm_length", "activation_embed"), (B, S, E)),
    (("decode_batch", "decode_length", "activation_embed"), (B, 1, E)),
)


class MaxTextNames(nn.Module):
    """Declares :data:`PARAMS` and :data:`CACHE`, and constrains one activation per entry of
    :data:`ACTIVATIONS`, all in MaxText's names."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        for name, (axes, shape) in PARAMS.items():
            self.param(name, nn.with_logical_partitioning(init, axes), shape)
        for name, (axes, shape) in CACHE.items():
            self.variable("cache", name, nn.with_logical_partitioning(jnp.zeros, axes), shape)
        total = jnp.zeros((), x.dtype)
        for axes, shape in ACTIVATIONS:
            activation = fe.constrain(jnp.broadcast_to(jnp.mean(x), shape), axes)
            total = total + jnp.sum(activation)
        return total


def _activation_constraints(mesh, rules):
    x = jax.ShapeDtypeStruct((B, S, E), jnp.float32)
    variables = nn.unbox(jax.eval_shape(MaxTextNames().init, jax.random.key(0), x))
    with fe.use_sharding(mesh, rules):
        text = jax.jit(MaxTextNames().apply).lower(variables, x).as_text()
    return sharding_constraints(text)


MOE_MAXTEXT = (
    ("gate", ("embed", None)),
    ("wi_0", ("exp", "embed_moe", "mlp_moe")),
    ("wi_1", ("exp", "embed_moe", "mlp_moe")),
    ("wo", ("exp", "mlp_moe", "embed_moe")),
    ("tokens", ("activation_batch_moe", "activation_length_moe", "activation_embed_moe")),
    ("hidden", ("activation_exp", None, None, "activation_mlp_moe")),
)


MOE_LIBRARY = (
    ("gate", ("hidden_state", None)),
    ("wi_0", ("expert", "hidden_state", "mlp_intermediate")),
    ("wi_1", ("expert", "hidden_state", "mlp_intermediate")),
    ("wo", ("expert", "mlp_intermediate", "hidden_state")),
    ("tokens", ("batch", "sequence", "hidden_state")),
    ("hidden", ("expert", None, None, "mlp_intermediate")),
)


class DenseMoe(nn.Module):
    """Every expert on every token, weighted by a softmax gate; ``names`` gives the axes."""

    names: tuple[tuple[str, tuple[str | None, ...]], ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        axes = dict(self.names)
        init = nn.initializers.normal(0.02)

        def param(name, shape):
            return self.param(name, nn.with_logical_partitioning(init, axes[name]), shape)

        gate, wi_0, wi_1 = param("gate", (E, X)), param("wi_0", (X, E, M)), param("wi_1", (X, E, M))
        wo = param("wo", (X, M, E))
        x = fe.constrain(x, axes["tokens"])
        weights = jax.nn.softmax(x @ gate)
        hidden = jax.nn.silu(jnp.einsum("bse,xem->xbsm", x, wi_0))
        hidden = fe.constrain(hidden * jnp.einsum("bse,xem->xbsm", x, wi_1), axes["hidden"])
        out = jnp.einsum("xbsm,xme,bsx->bse", hidden, wo, weights)
        return fe.constrain(out, axes["tokens"])


@pytest.mark.parametrize(("vocabulary", "foreign", "target"), NAMED)
@pytest.mark.parametrize("dims", MESHES.values(), ids=str)
def test_an_alias_resolves_as_its_library_name(vocabulary, foreign, target, dims):
    rules = fe.PartitionAxis().with_aliases(vocabulary)
    mesh = fe.create_mesh(dims)
    # Alone and beside names that compete for the same mesh axes, on shapes that divide and
    # shapes that do not: the alias must always get exactly its library name's spec.
    for other, shape in itertools.product(
        (None, "mlp_intermediate", "hidden_state", "batch"), ((16, 32), (6, 32), (32, 3))
    ):
        if other == target:
            continue
        native = (target, other) if target else (None, other)
        got = fe.resolve_logical_axes((foreign, other), rules, shape=shape, mesh=mesh)
        want = fe.resolve_logical_axes(native, rules, shape=shape, mesh=mesh)
        assert got.spec == want.spec, (foreign, other, shape)
        assert not got.unknown_names


def test_aliased_rules_are_plain_flax_rules():
    rules = ALIASED.logical_axis_rules()
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P(("fsdp", "sp"), "tp")
    assert nn.logical_to_mesh_axes(("mlp", "embed"), rules) == P("tp", ("fsdp", "sp"))
    assert nn.logical_to_mesh_axes(("vocab", "embed"), rules) == P("tp", ("fsdp", "sp"))
    assert nn.logical_to_mesh_axes(
        ("activation_batch", "activation_length", "activation_embed"), rules
    ) == P(("fsdp", "dp"), "sp", "tp")
    assert nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules) == P(("fsdp", "sp"), "tp", None)


def test_the_library_rules_are_unchanged_by_aliases():
    native = NATIVE.logical_axis_rules()
    aliased = ALIASED.logical_axis_rules()
    assert [rule for rule in aliased if rule[0] in NATIVE.logical_axes()] == list(native)


def test_user_aliases_extend_and_override_the_built_in_ones():
    rules = fe.PartitionAxis().with_aliases("t5x", {"ffn": "mlp_intermediate", "kv": "head"})
    assert fe.logical_to_mesh_axes(("embed", "ffn"), rules) == P(("fsdp", "sp"), "tp")
    assert fe.logical_to_mesh_axes(("embed", "kv"), rules) == P(("fsdp", "sp"), "tp")
    assert dict(rules.aliases)["kv"] == "head"
    assert dict(fe.PartitionAxis().with_aliases("t5x").aliases)["kv"] == "attention_dim"


def test_aliases_follow_renamed_mesh_axes_and_stay_hashable():
    renamed = ALIASED.replace(tensor_parallel_axis="model")
    assert renamed.aliases == ALIASED.aliases
    assert fe.logical_to_mesh_axes(("embed", "mlp"), renamed) == P(("fsdp", "sp"), "model")
    assert hash(renamed) != hash(ALIASED)
    assert fe.PartitionAxis().with_aliases("t5x").with_aliases("maxtext") == ALIASED


def test_an_alias_to_none_is_known_and_unsharded():
    r = fe.resolve_logical_axes(("relpos_buckets", "heads"), fe.PartitionAxis().with_aliases("t5x"))
    assert r.spec == P(None, "tp")
    assert r.ok


def test_unknown_foreign_names_say_which_vocabulary_has_them():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(
        fe.ShardingCorrectionWarning,
        match=r"with_aliases\('t5x'\) makes it sharded like 'hidden_state'",
    ):
        fe.logical_to_mesh_axes(("embed", "mlp"), shape=(8, 8), mesh=mesh)
    with pytest.raises(
        fe.ShardingResolutionError, match=r"'activation_kv_heads'.*with_aliases\('maxtext'\)"
    ):
        fe.logical_to_mesh_axes(("activation_kv_heads",), strict=True)


@pytest.mark.parametrize(
    ("vocabularies", "error", "match"),
    [
        (("flaxformer",), fe.EscaleError, r"unknown vocabulary 'flaxformer'.*\['maxtext', 't5x'\]"),
        (({"ffn": "mlp"},), fe.EscaleError, r"alias 'ffn' maps to 'mlp', which is not a library"),
        (
            ({"hidden_state": "head"},),
            fe.EscaleError,
            r"'hidden_state' is one of the library's own.*hidden_state_axis",
        ),
        (({"": "head"},), fe.EscaleTypeError, r"non-empty string, got ''"),
        (
            ({"ffn": 3},),
            fe.EscaleTypeError,
            r"alias 'ffn' must map to a library logical name or None, got 3",
        ),
        ((["t5x"],), fe.EscaleTypeError, r"vocabulary names such as 't5x' or mappings.*\['t5x'\]"),
    ],
)
def test_bad_aliases_are_refused(vocabularies, error, match):
    with pytest.raises(error, match=match):
        fe.PartitionAxis().with_aliases(*vocabularies)


def test_an_identity_alias_is_accepted_and_adds_nothing():
    assert fe.PartitionAxis().with_aliases({"vocab": "vocab"}).aliases == ()


def test_short_logical_axes_pad_like_flax():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    rules = [("embed", "fsdp"), ("kv", "tp")]
    r = fe.resolve_logical_axes(("embed", "kv"), rules, shape=(64, 4, 16), mesh=mesh)
    assert r.spec == P("fsdp", "tp", None)
    assert r.padded == 1
    assert r.logical_axes == ("embed", "kv", None)
    assert r.ok
    flax_spec = nn.logical_to_mesh_axes(("embed", "kv"), rules)
    assert jax.sharding.NamedSharding(mesh, flax_spec).is_equivalent_to(
        jax.sharding.NamedSharding(mesh, r.spec), 3
    )


def test_more_names_than_dimensions_is_still_an_error():
    with pytest.raises(
        fe.ShardingResolutionError, match=r"name 3 dimensions but the shape \(4, 4\) has 2"
    ):
        fe.resolve_logical_axes(("embed", "kv", "mlp"), [("embed", "fsdp")], shape=(4, 4))


def test_dense_general_with_flax_short_annotation_initializes_and_the_plan_says_so():
    model = nn.DenseGeneral(
        features=(4, 16),
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "kv")),
    )
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    x = jnp.ones((2, 64))
    rules = fe.PartitionAxis().with_aliases("t5x", {"kv": "head"})
    plan = fe.plan_sharding(model, mesh, jax.random.key(0), x, rules=rules, strict=True)
    assert plan["params/kernel"].spec == P(("fsdp", "sp"), "tp", None)
    assert "last 1 dim(s) unnamed, unsharded (Flax's short form)" in plan.describe()
    variables = fe.init_sharded(model, mesh, jax.random.key(0), x, rules=rules, strict=True)
    kernel = variables["params"]["kernel"]
    assert kernel.sharding.spec == P(("fsdp", "sp"), "tp", None)
    expected = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))["params"]["kernel"]
    assert (kernel == expected).all()


@pytest.mark.parametrize("name", [*MIXTRAL_EXPERTS, *MIXTRAL_DENSE, "gate"])
def test_maxtext_mixtral_kernels_split_over_every_device(name):
    mesh = fe.create_mesh((1, 4, 2, 1, 1))  # fsdp=4, ep=2
    rules = fe.PartitionAxis(ep_as_fsdp=True).with_aliases("maxtext")
    axes, shape = {**MIXTRAL_EXPERTS, **MIXTRAL_DENSE, "gate": MIXTRAL_GATE}[name]
    r = fe.resolve_logical_axes(axes, rules, shape=shape, mesh=mesh, strict=True)
    assert r.ok
    assert not r.unknown_names
    # Sharded 8 ways: no device holds more than 1/8 of any of these kernels.
    assert _split(mesh, r.spec) == 8, r.spec
    if name in MIXTRAL_EXPERTS:
        # The experts over ep, their hidden dimension over fsdp.
        assert r.spec[0] == "ep"
        assert "fsdp" in r.spec[list(axes).index("embed_moe")]
    else:
        # The rest over ep too, with fsdp: that is what ep_as_fsdp is for.
        assert set(r.spec[list(axes).index("embed")]) == {"fsdp", "sp", "ep"}


def test_without_ep_as_fsdp_the_dense_kernels_repeat_over_ep():
    mesh = fe.create_mesh((1, 4, 2, 1, 1))
    rules = fe.PartitionAxis().with_aliases("maxtext")
    for axes, shape in MIXTRAL_DENSE.values():
        spec = fe.resolve_logical_axes(axes, rules, shape=shape, mesh=mesh, strict=True).spec
        assert _split(mesh, spec) == 4, (axes, spec)
    for axes, shape in MIXTRAL_EXPERTS.values():
        spec = fe.resolve_logical_axes(axes, rules, shape=shape, mesh=mesh, strict=True).spec
        assert _split(mesh, spec) == 8, (axes, spec)


@pytest.mark.parametrize("ep_as_fsdp", [False, True])
def test_maxtext_moe_activations_resolve_like_the_library_names(ep_as_fsdp):
    mesh = fe.create_mesh((1, 4, 2, 1, 1))
    rules = fe.PartitionAxis(ep_as_fsdp=ep_as_fsdp).with_aliases("maxtext", "t5x")
    pairs = [
        # activation_batch_no_exp and t5x's expert_group are expert_batch: no ep.
        (("activation_batch_no_exp", None), ("expert_batch", None)),
        (("expert_group", None), ("expert_batch", None)),
        (
            ("activation_exp", "activation_batch_no_exp", None, "activation_embed"),
            ("expert", "expert_batch", None, "hidden_state"),
        ),
        (
            ("activation_batch_moe", "activation_length_moe", "activation_embed_moe"),
            ("batch", "sequence", "hidden_state"),
        ),
        (("exp", "embed_moe", "mlp_moe"), ("expert", "hidden_state", "mlp_intermediate")),
    ]
    shape = (8, 16, 40, 64)
    for foreign, native in pairs:
        dims = shape[: len(foreign)]
        got = fe.resolve_logical_axes(foreign, rules, shape=dims, mesh=mesh)
        want = fe.resolve_logical_axes(native, rules, shape=dims, mesh=mesh)
        assert got.spec == want.spec, (foreign, got.spec, want.spec)
    no_exp = fe.resolve_logical_axes(("activation_batch_no_exp",), rules, shape=(8,), mesh=mesh)
    assert no_exp.spec == P(("fsdp", "dp"))  # never ep
    batch = fe.resolve_logical_axes(("activation_batch",), rules, shape=(8,), mesh=mesh)
    assert batch.spec == (P(("fsdp", "dp", "ep")) if ep_as_fsdp else P(("fsdp", "dp")))
    # Without a mesh: the names' mesh axes as the rules give them.
    assert fe.logical_to_mesh_axes(("activation_batch_no_exp",), rules) == P(("fsdp", "dp"))


@pytest.mark.parametrize("vocabulary", sorted(SOURCES))
def test_every_name_of_a_vocabulary_has_a_rule(vocabulary):
    rules = fe.PartitionAxis().with_aliases(vocabulary)
    missing = [
        n for n in SOURCES[vocabulary] if n not in NATIVE_NAMES | set(VOCABULARIES[vocabulary])
    ]
    assert missing == []
    for name in SOURCES[vocabulary]:
        resolution = fe.resolve_logical_axes((name,), rules)
        assert not resolution.unknown_names, name
        assert resolution.ok, name


@pytest.mark.parametrize("vocabulary", sorted(SOURCES))
def test_a_vocabulary_holds_its_source_names_and_no_others(vocabulary):
    # The tables are the rules' own names, so a name nobody uses, or a library name aliased
    # away from its meaning, cannot creep in.
    assert set(VOCABULARIES[vocabulary]) == set(SOURCES[vocabulary]) - NATIVE_NAMES


def test_without_the_vocabulary_maxtext_names_have_no_rule():
    unknown = fe.resolve_logical_axes(("vocab", "embed_vocab"), fe.PartitionAxis()).unknown_names
    assert unknown == ("embed_vocab",)


def test_the_vocabulary_embedding_splits_over_tp_and_fsdp():
    mesh = fe.create_mesh(MESHES["fsdp4_tp2"])
    embedding = fe.resolve_logical_axes(
        ("vocab", "embed_vocab"), rules=MAXTEXT, shape=(256, 64), mesh=mesh
    )
    logits = fe.resolve_logical_axes(
        ("embed_vocab", "vocab"), rules=MAXTEXT, shape=(64, 256), mesh=mesh, strict=True
    )
    assert embedding.spec == P("tp", ("fsdp", "sp"))
    assert embedding.ok
    assert logits.spec == P(("fsdp", "sp"), "tp")


def test_the_maxtext_aliases_split_what_maxtext_splits():
    here = {name: fe.logical_to_mesh_axes((name,), MAXTEXT) != P(None) for name in MAXTEXT_BASE}
    there = {name: name not in MAXTEXT_BASE_UNSPLIT for name in MAXTEXT_BASE}
    differ = {name for name in MAXTEXT_BASE if here[name] != there[name]}
    assert differ == set(SPLIT_THERE_NOT_HERE) | set(SPLIT_HERE_NOT_THERE)
    aliases = {**VOCABULARIES["maxtext"], "layers": "layers"}
    for name, target in {**SPLIT_THERE_NOT_HERE, **SPLIT_HERE_NOT_THERE}.items():
        assert aliases[name] == target, name


def test_the_model_uses_every_name_of_maxtext_base_config():
    tables = [*PARAMS.values(), *CACHE.values(), *ACTIVATIONS]
    used = {name for axes, _ in tables for name in axes}
    assert set(MAXTEXT_BASE) - used == set()


@pytest.mark.parametrize("dims", [*MESHES.values(), (1, 2, 2, 2, 1)], ids=str)
def test_a_model_in_maxtext_names_plans_with_no_name_left_unknown(dims):
    mesh = fe.create_mesh(dims)
    x = jnp.ones((B, S, E))
    plan = fe.plan_sharding(MaxTextNames(), mesh, jax.random.key(0), x, rules=MAXTEXT, strict=True)
    assert not plan.corrections
    expected = {
        "params/embedding": P("tp", ("fsdp", "sp")),
        "params/logits": P(("fsdp", "sp"), "tp"),
        # The latent of multi-head latent attention takes fsdp where the heads hold tp.
        "params/wq_b": P(("fsdp", "sp"), "tp", None),
        "params/wi_0": P("ep", ("fsdp", "sp"), "tp"),
        "cache/key": P(("fsdp", "dp"), "sp", "tp", None),
    }
    for path, spec in expected.items():
        # Equivalent on meshes where some of those axes have size 1 (and so are left out).
        got, want = (jax.sharding.NamedSharding(mesh, s) for s in (plan[path].spec, spec))
        assert got.is_equivalent_to(want, len(plan[path].shape)), (path, plan[path].spec)


def test_without_the_vocabulary_the_model_names_what_has_no_rule():
    mesh = fe.create_mesh(MESHES["fsdp4_tp2"])
    x = jnp.ones((B, S, E))
    # Tracing the model warns about its activations too: that is the subject of the tests below.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        with pytest.raises(fe.ShardingResolutionError, match=r"has no rule.* It is maxtext's"):
            fe.plan_sharding(
                MaxTextNames(), mesh, jax.random.key(0), x, rules=fe.PartitionAxis(), strict=True
            )


def test_maxtext_activation_constraints_resolve_with_no_warning():
    mesh = fe.create_mesh(MESHES["dp2_fsdp2_tp2"])
    # filterwarnings = error: a name without a rule or a correction would fail here.
    constraints = _activation_constraints(mesh, MAXTEXT)
    assert len(constraints) == len(ACTIVATIONS)
    batch = '{"fsdp", "dp"}'
    for (axes, _), (sharding, _) in zip(ACTIVATIONS, constraints, strict=True):
        # Every batch of MaxText's names is split over the batch axes (none is replicated).
        batch_dims = [i for i, name in enumerate(axes) if name and "batch" in name]
        dims = re.findall(r"\{[^}]*\}", sharding)
        for i in batch_dims:
            assert dims[i] == batch, (axes, sharding)
    attention_input = constraints[3]
    assert attention_input == ('[{"fsdp", "dp"}, {"sp"}, {"tp"}]', f"{B}x{S}x{E}xf32")


def test_maxtext_activation_constraints_warn_without_the_vocabulary():
    mesh = fe.create_mesh(MESHES["dp2_fsdp2_tp2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fe.ShardingCorrectionWarning)
        constraints = _activation_constraints(mesh, fe.PartitionAxis())
    messages = [str(w.message) for w in caught]
    assert any("'activation_batch_attn' has no rule" in m for m in messages), messages
    # The symptom: the attention's input replicated over the batch.
    assert constraints[3] == ("[{}, {}, {}]", f"{B}x{S}x{E}xf32")


@pytest.mark.parametrize("ep_as_fsdp", [False, True])
def test_a_maxtext_moe_block_shards_as_the_library_names_do(ep_as_fsdp):
    mesh = fe.create_mesh((1, 2, 2, 2, 1))  # fsdp=2, ep=2, tp=2
    rules = fe.PartitionAxis(ep_as_fsdp=ep_as_fsdp).with_aliases("maxtext")
    x = jax.random.normal(jax.random.key(1), (B, S, E))
    outputs, specs = [], []
    for names in (MOE_MAXTEXT, MOE_LIBRARY):
        model = DenseMoe(names)
        variables = fe.init_sharded(model, mesh, jax.random.key(0), x, rules=rules, strict=True)
        params = variables["params"]
        specs.append({name: params[name].sharding.spec for name in params})
        with fe.use_sharding(mesh, rules):
            outputs.append(jax.jit(model.apply)(variables, x))
    assert specs[0] == specs[1]
    for name in ("wi_0", "wi_1"):
        assert specs[0][name] == P("ep", ("fsdp", "sp"), "tp")
    assert specs[0]["wo"] == P("ep", "tp", ("fsdp", "sp"))
    assert specs[0]["gate"] == P("tp", None)
    # Each expert kernel is split over all 8 devices.
    shard = params["wi_0"].addressable_shards[0].data.shape
    assert math.prod(shard) * 8 == X * E * M
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6)
