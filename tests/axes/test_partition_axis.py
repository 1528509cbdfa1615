import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, case, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    EscaleError,
    EscaleTypeError,
    PartitionAxis,
    create_mesh,
    logical_to_mesh_axes,
)

SEED_DEFAULTS = {
    "data_parallel_axis": "dp",
    "fully_sharded_data_parallel_axis": "fsdp",
    "tensor_parallel_axis": "tp",
    "sequence_parallel_axis": "sp",
    "expert_parallel_axis": "ep",
    "pipeline_parallel_axis": None,  # pipelines are opt-in (DESIGN.md decision 15)
    "batch_axis": ("fsdp", "dp"),
    "sequence_axis": "sp",
    "query_sequence_axis": "sp",
    "head_axis": "tp",
    "kv_head_axis": "tp",
    "key_sequence_axis": "sp",
    "hidden_state_axis": "tp",
    "mlp_intermediate_axis": "tp",
    "vocab_axis": "tp",
    "expert_axis": "ep",
    "expert_gate_axis": None,
    "expert_batch_axis": ("fsdp", "dp"),
    "attention_dim_axis": None,
    "attention_kv_dim_axis": None,
    "bias_head_sequence_axis": None,
    "bias_key_sequence_axis": None,
    "layers_axis": None,
    "generation_batch_axis": None,
    "generation_query_sequence_axis": None,
    "generation_head_axis": "tp",
    "generation_kv_head_axis": "tp",
    "generation_key_sequence_axis": "sp",
    "generation_attention_dim_axis": None,
    "generation_attention_kv_dim_axis": None,
    "ep_as_fsdp": False,
}

# DESIGN.md decision 2: one annotation, FSDP+TP parameters and eformer's activation layout.
DESIGN_TABLE = [
    (("batch", "sequence", "hidden_state"), P(("fsdp", "dp"), "sp", "tp")),
    (("hidden_state", "mlp_intermediate"), P(("fsdp", "sp"), "tp")),
    (("mlp_intermediate", "hidden_state"), P("tp", ("fsdp", "sp"))),
    (("vocab", "hidden_state"), P("tp", ("fsdp", "sp"))),
    (("expert", "hidden_state", "mlp_intermediate"), P("ep", ("fsdp", "sp"), "tp")),
]


def test_defaults_are_the_seeds():
    paxis = PartitionAxis()
    fields = {f.name: getattr(paxis, f.name) for f in dataclasses.fields(paxis) if f.init}
    assert fields.pop("aliases") == ()
    assert fields == SEED_DEFAULTS


def test_defaults_follow_renamed_mesh_axes():
    paxis = PartitionAxis(
        tensor_parallel_axis="model",
        data_parallel_axis="data",
        fully_sharded_data_parallel_axis="zero",
        sequence_parallel_axis="seq",
        expert_parallel_axis="experts",
    )
    assert paxis.batch_axis == ("zero", "data")
    for name in ("head", "kv_head", "hidden_state", "mlp_intermediate", "vocab", "generation_head"):
        assert getattr(paxis, f"{name}_axis") == "model"
    for name in ("sequence", "query_sequence", "key_sequence", "generation_key_sequence"):
        assert getattr(paxis, f"{name}_axis") == "seq"
    assert paxis.expert_axis == "experts"
    assert paxis.mesh_axis_names == ("data", "zero", "experts", "model", "seq")


def test_explicit_values_win_and_sequences_become_tuples():
    paxis = PartitionAxis(head_axis=["tp", "sp"], vocab_axis=None)
    assert paxis.head_axis == ("tp", "sp")
    assert paxis.vocab_axis is None
    assert paxis.hidden_state_axis == "tp"


def test_immutable_hashable_and_equal_by_value():
    a, b = PartitionAxis(), PartitionAxis(head_axis="tp")
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, PartitionAxis(head_axis=None)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.head_axis = "sp"


def test_decode_names_are_aliases_of_the_generation_fields():
    # eformer's decode_* keywords set the generation_* fields: no new fields, same value, hash.
    via_alias = PartitionAxis(decode_batch_axis="dp", decode_kv_head_axis=None)
    direct = PartitionAxis(generation_batch_axis="dp", generation_kv_head_axis=None)
    assert via_alias == direct
    assert hash(via_alias) == hash(direct)
    assert via_alias.decode_batch_axis == via_alias.generation_batch_axis == "dp"
    assert via_alias.decode_kv_head_axis is None
    assert via_alias.replace(decode_head_axis="sp").generation_head_axis == "sp"
    names = {f.name for f in dataclasses.fields(PartitionAxis)}
    assert not any(name.startswith("decode_") for name in names)
    with pytest.raises(EscaleError, match=r"decode_head_axis and generation_head_axis name the"):
        PartitionAxis(decode_head_axis="tp", generation_head_axis="sp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        via_alias.generation_batch_axis = "tp"
    with pytest.raises(AttributeError):
        via_alias.decode_batch_axis = "tp"


def test_generation_kv_head_follows_kv_head_unless_given():
    assert PartitionAxis(kv_head_axis="sp").generation_kv_head_axis == "sp"
    assert PartitionAxis(kv_head_axis="sp").replace(kv_head_axis=None).decode_kv_head_axis is None
    given = PartitionAxis(kv_head_axis="sp", generation_kv_head_axis="tp")
    assert given.replace(kv_head_axis="dp").generation_kv_head_axis == "tp"
    rules = PartitionAxis(generation_kv_head_axis="sp").logical_axis_rules(generation=True)
    assert nn.logical_to_mesh_axes(("batch", "kv_head", "attention_kv_dim"), rules) == P(
        None, "sp", None
    )


def test_replace_rederives_unset_fields_and_keeps_given_ones():
    paxis = PartitionAxis(vocab_axis=None, head_axis="sp")
    renamed = paxis.replace(tensor_parallel_axis="model")
    assert renamed.hidden_state_axis == "model"
    assert renamed.vocab_axis is None
    assert renamed.head_axis == "sp"
    assert paxis.hidden_state_axis == "tp"
    assert paxis.replace(batch_axis="dp").batch_axis == "dp"
    with pytest.raises(EscaleError, match=r"PartitionAxis has no field 'heads_axis'"):
        paxis.replace(heads_axis="tp")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_axis": None}, r"PartitionAxis.tensor_parallel_axis must be a mesh axis"),
        ({"tensor_parallel_axis": ""}, r"non-empty string\), got ''"),
        ({"head_axis": 3}, r"PartitionAxis.head_axis must be a mesh axis name.*got 3"),
        ({"batch_axis": ()}, r"PartitionAxis.batch_axis .*non-empty sequence.*got \(\)"),
        ({"batch_axis": ("dp", 1)}, r"PartitionAxis.batch_axis .*got \('dp', 1\)"),
    ],
)
def test_invalid_values(kwargs, match):
    with pytest.raises(EscaleError, match=match):
        PartitionAxis(**kwargs)


def test_static_under_jit():
    traces = []

    def scale(paxis, x):
        traces.append(paxis)
        return x * (2 if paxis.vocab_axis is None else 3)

    static = jax.jit(scale, static_argnums=0)
    assert static(PartitionAxis(), jnp.ones(2)).tolist() == [3.0, 3.0]
    assert static(PartitionAxis(head_axis="tp"), jnp.ones(2)).tolist() == [3.0, 3.0]
    assert len(traces) == 1  # equal instances hit the cache
    assert static(PartitionAxis(vocab_axis=None), jnp.ones(2)).tolist() == [2.0, 2.0]
    # A static pytree: it can also be passed as an ordinary argument.
    assert jax.jit(scale)(PartitionAxis(vocab_axis=None), jnp.ones(2)).tolist() == [2.0, 2.0]
    assert jax.tree_util.tree_leaves(PartitionAxis()) == []


@pytest.mark.parametrize(("axes", "spec"), DESIGN_TABLE)
def test_design_table_through_plain_flax(axes, spec):
    rules = PartitionAxis().logical_axis_rules()
    assert nn.logical_to_mesh_axes(axes, rules) == spec
    with nn.logical_axis_rules(rules):
        assert nn.logical_to_mesh_axes(axes) == spec


@pytest.mark.parametrize(("axes", "spec"), DESIGN_TABLE)
def test_design_table_on_the_default_mesh_with_shapes(axes, spec):
    mesh = create_mesh((1, 4, 1, 2, 1))  # fsdp=4, tp=2
    shape = tuple(64 for _ in axes)
    got = logical_to_mesh_axes(axes, shape=shape, mesh=mesh, strict=True)
    # ep has size 1 here: the expert rule splits nothing, so the spec may leave it out.
    assert NamedSharding(mesh, got).is_equivalent_to(NamedSharding(mesh, spec), len(axes))


def test_rule_order_wide_names_first_then_fallbacks():
    rules = PartitionAxis().logical_axis_rules()
    names = [name for name, _ in rules]
    assert names.index("vocab") < names.index("hidden_state")
    assert names.index("mlp_intermediate") < names.index("hidden_state")
    fallbacks = [(n, t) for n, t in rules if t == ("fsdp", "sp")]
    assert fallbacks == [
        ("hidden_state", ("fsdp", "sp")),
        ("vocab", ("fsdp", "sp")),
        ("head", ("fsdp", "sp")),
        ("kv_head", ("fsdp", "sp")),
        ("mlp_intermediate", ("fsdp", "sp")),
        ("expert", ("fsdp", "sp")),
    ]
    assert ("layers", None) in rules
    assert ("attention_dim", None) in rules


def test_attention_kernels():
    rules = PartitionAxis().logical_axis_rules()
    assert nn.logical_to_mesh_axes(("hidden_state", "head", "attention_dim"), rules) == P(
        ("fsdp", "sp"), "tp", None
    )
    assert nn.logical_to_mesh_axes(("head", "attention_dim", "hidden_state"), rules) == P(
        "tp", None, ("fsdp", "sp")
    )
    assert nn.logical_to_mesh_axes(("layers", "hidden_state", "mlp_intermediate"), rules) == P(
        None, ("fsdp", "sp"), "tp"
    )


def test_generation_rules_use_the_generation_fields():
    paxis = PartitionAxis(generation_batch_axis="dp", generation_head_axis="sp")
    rules = paxis.logical_axis_rules(generation=True)
    assert nn.logical_to_mesh_axes(("batch", "query_sequence", "head"), rules) == P(
        "dp", None, "sp"
    )
    assert nn.logical_to_mesh_axes(("batch", "key_sequence", "head"), rules) == P("dp", None, "sp")
    # Parameters resolve the same in both modes.
    train = paxis.logical_axis_rules()
    for axes, _ in DESIGN_TABLE[1:]:
        assert nn.logical_to_mesh_axes(axes, rules) == nn.logical_to_mesh_axes(axes, train)
    assert PartitionAxis().logical_axes(generation=True)["batch"] is None


def test_fallback_skipped_when_first_choice_is_the_fallback():
    rules = PartitionAxis(hidden_state_axis=("fsdp", "sp")).logical_axis_rules()
    assert rules.count(("hidden_state", ("fsdp", "sp"))) == 1
    assert ("hidden_state", ("fsdp", "sp")) in rules
    unsharded = PartitionAxis(vocab_axis=None).logical_axis_rules()
    assert ("vocab", ("fsdp", "sp")) not in unsharded


# Mixture of experts: expert_batch, and ep_as_fsdp.

MOE_TABLE = [
    # (logical axes, default spec, spec with ep_as_fsdp=True)
    (
        ("batch", "sequence", "hidden_state"),
        P(("fsdp", "dp"), "sp", "tp"),
        P(("fsdp", "dp", "ep"), "sp", "tp"),
    ),
    (("hidden_state", "mlp_intermediate"), P(("fsdp", "sp"), "tp"), P(("fsdp", "sp", "ep"), "tp")),
    (("mlp_intermediate", "hidden_state"), P("tp", ("fsdp", "sp")), P("tp", ("fsdp", "sp", "ep"))),
    (("vocab", "hidden_state"), P("tp", ("fsdp", "sp")), P("tp", ("fsdp", "sp", "ep"))),
    (
        ("hidden_state", "head", "attention_dim"),
        P(("fsdp", "sp"), "tp", None),
        P(("fsdp", "sp", "ep"), "tp", None),
    ),
    # The experts' kernels already use ep: their fallback stays (fsdp, sp).
    (
        ("expert", "hidden_state", "mlp_intermediate"),
        P("ep", ("fsdp", "sp"), "tp"),
        P("ep", ("fsdp", "sp"), "tp"),
    ),
    (
        ("expert", "mlp_intermediate", "hidden_state"),
        P("ep", "tp", ("fsdp", "sp")),
        P("ep", "tp", ("fsdp", "sp")),
    ),
    # Dispatched tokens: the experts over ep, their groups over the batch's axes without ep.
    (
        ("expert", "expert_batch", None, "hidden_state"),
        P("ep", ("fsdp", "dp"), None, "tp"),
        P("ep", ("fsdp", "dp"), None, "tp"),
    ),
    (("expert_batch", "sequence"), P(("fsdp", "dp"), "sp"), P(("fsdp", "dp"), "sp")),
]


def test_expert_batch_is_the_batch_without_ep():
    assert PartitionAxis().expert_batch_axis == ("fsdp", "dp")
    assert PartitionAxis(ep_as_fsdp=True).expert_batch_axis == ("fsdp", "dp")
    assert PartitionAxis(ep_as_fsdp=True).batch_axis == ("fsdp", "dp", "ep")
    renamed = PartitionAxis(
        data_parallel_axis="data", expert_parallel_axis="experts", ep_as_fsdp=True
    )
    assert renamed.expert_batch_axis == ("fsdp", "data")
    assert renamed.batch_axis == ("fsdp", "data", "experts")
    assert PartitionAxis(expert_batch_axis="dp").expert_batch_axis == "dp"
    assert PartitionAxis().logical_axes()["expert_batch"] == ("fsdp", "dp")


@pytest.mark.parametrize(("axes", "default", "moe"), MOE_TABLE)
def test_ep_as_fsdp_specs_through_plain_flax(axes, default, moe):
    assert nn.logical_to_mesh_axes(axes, PartitionAxis().logical_axis_rules()) == default
    rules = PartitionAxis(ep_as_fsdp=True).logical_axis_rules()
    assert nn.logical_to_mesh_axes(axes, rules) == moe
    with nn.logical_axis_rules(rules):
        assert nn.logical_to_mesh_axes(axes) == moe


@pytest.mark.parametrize(("axes", "default", "moe"), MOE_TABLE)
def test_ep_as_fsdp_specs_on_an_expert_mesh(axes, default, moe):
    mesh = create_mesh((1, 2, 2, 2, 1))  # fsdp=2, ep=2, tp=2: every axis splits
    shape = tuple(64 for _ in axes)
    for rules, spec in ((PartitionAxis(), default), (PartitionAxis(ep_as_fsdp=True), moe)):
        got = logical_to_mesh_axes(axes, rules, shape=shape, mesh=mesh, strict=True)
        assert NamedSharding(mesh, got).is_equivalent_to(NamedSharding(mesh, spec), len(axes))


def test_ep_as_fsdp_adds_a_first_fallback_tier_with_ep():
    rules = PartitionAxis(ep_as_fsdp=True).logical_axis_rules()
    wide = ["hidden_state", "vocab", "head", "kv_head", "mlp_intermediate", "expert"]
    with_ep = [name for name, target in rules if target == ("fsdp", "sp", "ep")]
    without = [name for name, target in rules if target == ("fsdp", "sp")]
    assert with_ep == wide
    assert without == wide
    # Every (fsdp, sp, ep) fallback comes before every (fsdp, sp) one.
    targets = [target for _, target in rules]
    assert max(i for i, t in enumerate(targets) if t == ("fsdp", "sp", "ep")) < min(
        i for i, t in enumerate(targets) if t == ("fsdp", "sp")
    )
    # Off by default: no rule names ep outside the expert axis itself.
    default = PartitionAxis().logical_axis_rules()
    assert [name for name, target in default if target and "ep" in target] == ["expert"]


def test_replace_keeps_ep_as_fsdp():
    moe = PartitionAxis(ep_as_fsdp=True)
    renamed = moe.replace(tensor_parallel_axis="model")
    assert renamed.ep_as_fsdp is True
    assert renamed.batch_axis == ("fsdp", "dp", "ep")
    assert renamed.hidden_state_axis == "model"
    assert moe.replace(expert_parallel_axis="experts").batch_axis == ("fsdp", "dp", "experts")
    # Turned off again, the batch is derived anew; a batch given explicitly stays.
    assert moe.replace(ep_as_fsdp=False).batch_axis == ("fsdp", "dp")
    given = PartitionAxis(ep_as_fsdp=True, batch_axis="dp")
    assert given.batch_axis == "dp"
    assert given.replace(tensor_parallel_axis="model").batch_axis == "dp"
    assert moe.with_aliases("maxtext").ep_as_fsdp is True
    assert moe != PartitionAxis()
    assert hash(moe) == hash(PartitionAxis(ep_as_fsdp=True))
    assert "ep_as_fsdp" not in moe.logical_axes()


@pytest.mark.parametrize(("value", "shown"), [(1, "1"), ("yes", "'yes'"), (None, "None")])
def test_ep_as_fsdp_must_be_a_bool(value, shown):
    with pytest.raises(
        EscaleTypeError, match=rf"PartitionAxis\.ep_as_fsdp must be True or False, got {shown}\."
    ):
        PartitionAxis(ep_as_fsdp=value)
    with pytest.raises(EscaleTypeError, match=r"PartitionAxis\.ep_as_fsdp must be True or False"):
        PartitionAxis().replace(ep_as_fsdp=value)


CASES = [
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fe.PartitionAxis(batch_axis=3),
        fe.EscaleError,
        "batch_axis",
        "3",
        "a mesh axis name",
        id="PartitionAxis-field-int",
    ),
    case(
        lambda: fe.PartitionAxis(tensor_parallel_axis=None),
        fe.EscaleError,
        "tensor_parallel_axis",
        "None",
        "non-empty string",
        id="PartitionAxis-axis-none",
    ),
    case(
        lambda: fe.PartitionAxis(hidden_state_axis=["fsdp", 3]),
        fe.EscaleError,
        "hidden_state_axis",
        "['fsdp', 3]",
        "sequence of names",
        id="PartitionAxis-field-list-with-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
