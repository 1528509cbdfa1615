"""The built-in vocabularies cover every name of the rules they come from, each with its meaning
here: a model written in MaxText's or t5x's names resolves with no name left without a rule."""

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

NATIVE = frozenset(fe.PartitionAxis().logical_axes())
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


@pytest.mark.parametrize("vocabulary", sorted(SOURCES))
def test_every_name_of_a_vocabulary_has_a_rule(vocabulary):
    rules = fe.PartitionAxis().with_aliases(vocabulary)
    missing = [n for n in SOURCES[vocabulary] if n not in NATIVE | set(VOCABULARIES[vocabulary])]
    assert missing == []
    for name in SOURCES[vocabulary]:
        resolution = fe.resolve_logical_axes((name,), rules)
        assert not resolution.unknown_names, name
        assert resolution.ok, name


@pytest.mark.parametrize("vocabulary", sorted(SOURCES))
def test_a_vocabulary_holds_its_source_names_and_no_others(vocabulary):
    # The tables are the rules' own names, so a name nobody uses, or a library name aliased
    # away from its meaning, cannot creep in.
    assert set(VOCABULARIES[vocabulary]) == set(SOURCES[vocabulary]) - NATIVE


def test_without_the_vocabulary_maxtext_names_have_no_rule():
    unknown = fe.resolve_logical_axes(("vocab", "embed_vocab"), fe.PartitionAxis()).unknown_names
    assert unknown == ("embed_vocab",)


# The case: the token embedding and the logits kernel, vocab on tp and the hidden
# dimension (MaxText's embed_vocab) on fsdp.


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


def test_the_maxtext_aliases_split_what_maxtext_splits():
    here = {name: fe.logical_to_mesh_axes((name,), MAXTEXT) != P(None) for name in MAXTEXT_BASE}
    there = {name: name not in MAXTEXT_BASE_UNSPLIT for name in MAXTEXT_BASE}
    differ = {name for name in MAXTEXT_BASE if here[name] != there[name]}
    assert differ == set(SPLIT_THERE_NOT_HERE) | set(SPLIT_HERE_NOT_THERE)
    aliases = {**VOCABULARIES["maxtext"], "layers": "layers"}
    for name, target in {**SPLIT_THERE_NOT_HERE, **SPLIT_HERE_NOT_THERE}.items():
        assert aliases[name] == target, name


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


def _activation_constraints(mesh, rules):
    x = jax.ShapeDtypeStruct((B, S, E), jnp.float32)
    variables = nn.unbox(jax.eval_shape(MaxTextNames().init, jax.random.key(0), x))
    with fe.use_sharding(mesh, rules):
        text = jax.jit(MaxTextNames().apply).lower(variables, x).as_text()
    return sharding_constraints(text)


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


# A mixture-of-experts block written twice, in MaxText's names and in the library's: the same
# shardings, the expert kernels split over ep and over fsdp and tp.

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
