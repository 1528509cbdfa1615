"""Tests of ``specs_from_regex`` (``flax_escale/sharding/_regex_rules.py``): the first rule whose
regex matches a parameter's path gives its spec; the mistakes it refuses. The pattern strings
that ``eformer``'s ``create_pattern_based_partition_spec`` compiles into these rules:
``tests/eformer/test_pattern.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, params, raises_a_library_error

import flax_escale as fe

RULES = [
    ("embedding", P("tp", "fsdp")),
    ("kernel$", P("fsdp", "tp")),
    ("bias$", P("tp", None)),
    (".*", P()),
]


def test_first_matching_rule_wins_and_special_cases():
    tree = {
        "embed": {"embedding": np.zeros((64, 8))},
        "wi": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)},
        "scalar": np.float32(3.0),
        "step": 7,
        "name": "not an array",
        "layers": [np.zeros((4, 4)), np.zeros((4, 4, 4))],
    }
    specs = fe.sharding.specs_from_regex(RULES, tree)
    assert specs["embed"]["embedding"] == P("tp", "fsdp")
    assert specs["wi"]["kernel"] == P("fsdp", "tp")
    assert specs["wi"]["bias"] == P("tp")  # the None past the rank is cut
    assert specs["scalar"] == P()
    assert specs["step"] == P()
    assert specs["name"] == P()
    assert specs["layers"] == [P(), P()]


def test_rules_see_slash_joined_paths_with_indices():
    tree = {"blocks": [{"w": np.zeros((4, 4))}, {"w": np.zeros((4, 4))}]}
    specs = fe.sharding.specs_from_regex([("blocks/1/w", P("tp")), ("w$", P("fsdp"))], tree)
    assert specs == {"blocks": [{"w": P("fsdp")}, {"w": P("tp")}]}


def test_min_size_leaves_small_arrays_unsharded():
    tree = {"big": np.zeros((32, 32)), "small": np.zeros((4, 4))}
    specs = fe.sharding.specs_from_regex([(".*", P("fsdp"))], tree, min_size=100)
    assert specs == {"big": P("fsdp"), "small": P()}


def test_min_size_none_is_the_default_minimum():
    from flax_escale.sharding._regex_rules import DEFAULT_MIN_SIZE

    tree = {"big": np.zeros((128, 128)), "small": np.zeros((127, 128))}
    assert DEFAULT_MIN_SIZE == 128 * 128
    specs = fe.sharding.specs_from_regex([(".*", P("fsdp"))], tree, min_size=None)
    assert specs == {"big": P("fsdp"), "small": P()}
    with pytest.raises(fe.EscaleTypeError, match=r"min_size must be a number .*got str '1'"):
        fe.sharding.specs_from_regex([(".*", P("fsdp"))], tree, min_size="1")


def test_unmatched_array_raises_naming_the_path_or_warns_when_not_strict():
    tree = {"wi": {"kernel": np.zeros((8, 4))}, "norm": {"scale": np.zeros(8)}}
    rules = [("kernel$", P("fsdp"))]
    with pytest.raises(fe.sharding.PartitionRuleError, match=r"'norm/scale' \(8,\)"):
        fe.sharding.specs_from_regex(rules, tree)
    with pytest.warns(fe.ShardingCorrectionWarning, match="norm/scale"):
        specs = fe.sharding.specs_from_regex(rules, tree, strict=False)
    assert specs["norm"]["scale"] == P()
    assert isinstance(fe.sharding.PartitionRuleError("x"), ValueError)


def test_a_spec_that_drops_mesh_axes_past_the_rank_warns():
    tree = {"wi": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}}
    rules = [("kernel$", P("fsdp", "tp")), ("bias$", P("tp", "fsdp"))]
    message = (
        r"(?s)parameter 'wi/bias': mesh axes P\('tp', 'fsdp'\) with shape \(32,\) .*corrected "
        r"to P\('tp',\).*dimension 1: the spec has 2 entries but the array has rank 1; "
        r"dropped \('fsdp',\)"
    )
    # One rule may serve kernels and their biases (eformer's semantics): a warning, not an error.
    for strict in (True, False):
        with pytest.warns(fe.ShardingCorrectionWarning, match=message):
            specs = fe.sharding.specs_from_regex(rules, tree, strict=strict)
        assert specs == {"wi": {"kernel": P("fsdp", "tp"), "bias": P("tp")}}


def test_a_spec_naming_one_axis_twice_is_refused_where_it_enters():
    tree = {"w": np.zeros((8, 8))}
    with pytest.raises(
        fe.sharding.PartitionRuleError,
        match=r"rules: the rule for 'w' gives P\('tp', 'tp'\), which cannot apply: in dimension "
        r"1, mesh axis 'tp' already shards another dimension",
    ):
        fe.sharding.specs_from_regex([("w", P("tp", "tp"))], tree, strict=False)


def test_a_spec_entry_of_the_wrong_type_is_refused():
    with pytest.raises(fe.EscaleTypeError, match=r"entry 0 of spec P\(3,?\) must be None"):
        fe.sharding.specs_from_regex([("w", P(3))], {"w": np.zeros(4)})


def test_bad_rules_raise():
    with pytest.raises(fe.sharding.PartitionRuleError, match="not a valid regex"):
        fe.sharding.specs_from_regex([("kernel(", P())], {"a": np.zeros(4)})
    with pytest.raises(fe.sharding.PartitionRuleError, match="not a PartitionSpec"):
        fe.sharding.specs_from_regex([("a", "fsdp")], {"a": np.zeros(4)})


def test_flax_boxes_nnx_state_and_shape_structs_match_like_plain_arrays():
    boxed = {
        "params": {
            "wi": {"kernel": nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp"))},
            "b": nn.Partitioned(jnp.zeros(4), ("tp",)),
        }
    }
    specs = fe.sharding.specs_from_regex([("kernel$", P("fsdp", "tp")), (".*", P())], boxed)
    assert specs == {"params": {"wi": {"kernel": P("fsdp", "tp")}, "b": P()}}

    class Module(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(8, 4, rngs=rngs)

    state = nnx.state(Module(nnx.Rngs(0)))
    nnx_specs = fe.sharding.specs_from_regex([("kernel$", P("fsdp", "tp")), (".*", P())], state)
    assert nnx_specs["wi"]["kernel"] == P("fsdp", "tp")
    assert nnx_specs["wi"]["bias"] == P()

    abstract = {"kernel": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    assert fe.sharding.specs_from_regex(RULES, abstract) == {"kernel": P("fsdp", "tp")}


def test_specs_drive_a_sharded_init():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    model = nn.Dense(16)
    x = jnp.ones((2, 8))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    specs = fe.sharding.specs_from_regex(RULES, abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    assert variables["params"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert variables["params"]["bias"].sharding.spec == P("tp")


def test_two_arrays_of_one_path_are_refused_rather_than_matched_alike():
    tree = {"a/b": np.zeros((8, 8)), "a": {"b": np.ones((8, 8))}}
    with pytest.raises(fe.EscaleError, match=r"two arrays have the path 'a/b' \(a key holding"):
        fe.sharding.specs_from_regex([("a/b", P("fsdp")), (".*", P())], tree)


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    # --- regex partition rules and pattern strings -----------------------------------------
    case(
        lambda: fe.sharding.specs_from_regex("kernel", params()),
        T,
        "rules",
        "'kernel'",
        r"\[\('kernel\$', PartitionSpec",
        id="match_rules-bare-string",
    ),
    case(
        lambda: fe.sharding.specs_from_regex(("w", P("tp")), params()),
        T,
        "rules",
        "('w', P('tp',))",
        r"pass \[\('w', P\('tp',\)\)\]",
        id="match_rules-bare-pair",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w",)], params()),
        T,
        "rules",
        "('w',)",
        "not a pair",
        id="match_rules-one-element",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([(3, P())], params()),
        T,
        "rules",
        "int 3",
        "must be a string",
        id="match_rules-regex-int",
    ),
    case(
        lambda: fe.sharding.specs_from_regex({"w": P("tp")}, params()),
        T,
        "rules",
        "{'w': P('tp',)}",
        "items in order",
        id="match_rules-dict",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w", "tp")], params()),
        fe.sharding.PartitionRuleError,
        "rules",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="match_rules-spec-string",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w", P("tp", "tp"))], params()),
        fe.sharding.PartitionRuleError,
        "rules",
        "P('tp', 'tp')",
        "at most once",
        id="match_rules-axis-twice",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w[", P())], params()),
        fe.sharding.PartitionRuleError,
        "rules",
        "'w['",
        r"re\.escape",
        id="match_rules-bad-regex",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w", P())], "params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="match_rules-tree-string",
    ),
    case(
        lambda: fe.sharding.specs_from_regex([("w", P())], None),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="match_rules-tree-none",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
