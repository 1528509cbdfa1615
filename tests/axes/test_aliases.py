"""Foreign vocabularies (``PartitionAxis.with_aliases``), Flax's short annotations, and t5x's
standard rules pointed at the library's mesh axes."""

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support import MESHES

import flax_escale as fe
from flax_escale.axes import VOCABULARIES
from flax_escale.t5x import standard_logical_axis_rules

ALIASED = fe.PartitionAxis().with_aliases("t5x", "maxtext")
NATIVE = fe.PartitionAxis()
NAMED = [
    (vocabulary, foreign, target)
    for vocabulary, aliases in VOCABULARIES.items()
    for foreign, target in aliases.items()
]


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


# Flax's short form: fewer names than dimensions, the trailing dimensions unsharded.


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


# t5x's standard rules over the library's axes.


def test_standard_rules_target_the_mesh_axes_given():
    rules = standard_logical_axis_rules(2, 2, data_axis=("fsdp", "dp"), model_axis="tp")
    assert ("batch", ("fsdp", "dp")) in rules
    assert ("embed", "tp") in rules
    assert ("embed", ("fsdp", "dp")) in rules
    assert ("kv", None) in rules
    assert not any(target in ("data", "model") for _, target in rules)
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P(("fsdp", "dp"), "tp")


def test_standard_rules_keep_t5x_axes_by_default():
    assert standard_logical_axis_rules()[:2] == [("batch", "data"), ("vocab", "model")]


def test_standard_rules_refuse_a_bad_mesh_axis():
    with pytest.raises(
        fe.EscaleTypeError, match=r"model_axis must be None, a mesh axis name.*int 3"
    ):
        standard_logical_axis_rules(model_axis=3)


# MaxText's mixture-of-experts names, on a Mixtral-shaped model (scaled down: 8 experts).

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
