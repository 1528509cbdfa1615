"""``match_partition_rules`` and ``auto_partition_spec`` (``flax_escale/eformer/_functions.py``).

Expected values are what eformer 0.0.101 returns for the same call; where eformer's result
cannot be used, the test says what eformer gives and asserts the library's fix instead.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, X, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe
from flax_escale import eformer as escale


def test_match_partition_rules_raises_for_an_unmatched_array_in_both_modes():
    tree = {"w": np.zeros((4, 4)), "norm": {"scale": np.zeros(4)}}
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"no partition rule matches 'norm/scale' \(4,\)"):
            escale.match_partition_rules([("w", P("fsdp"))], tree, strict=strict)


def test_auto_partition_spec_signature():
    mesh = escale.create_mesh((2, 2, 1, 2, 1))
    x = np.zeros((64, 256), np.float32)
    assert escale.auto_partition_spec(x, mesh) == P(("fsdp", "dp"), "tp")
    assert escale.auto_partition_spec(x, mesh, names=["fsdp", "tp"]) == P("fsdp", "tp")
    assert escale.auto_partition_spec(x, mesh, names=[("fsdp", "tp")]) == P("fsdp", "tp")
    assert escale.auto_partition_spec(x, mesh, reverse=True) == P("tp", ("fsdp", "dp"))
    # The default minimum is the device count (8); one entry per dimension, as in eformer.
    assert escale.auto_partition_spec(np.zeros((2, 2)), mesh) == P(None, None)
    assert escale.auto_partition_spec(np.zeros((2, 4)), mesh, min_sharding_size=None) == P(
        "fsdp", ("tp", "dp")
    )
    with jax.set_mesh(mesh):
        assert escale.auto_partition_spec(jax.ShapeDtypeStruct((64, 256), "f4")) == P(
            ("fsdp", "dp"), "tp"
        )
    with pytest.raises(TypeError, match=r"x must be an array \(anything with a shape\), got list"):
        escale.auto_partition_spec([1, 2, 3], mesh)
    with pytest.raises(ValueError, match=r"axes: 'model' is not an axis of the mesh"):
        escale.auto_partition_spec(x, mesh, names=["model"])
    with pytest.raises(ValueError, match=r"No mesh is set"):
        escale.auto_partition_spec(x)


RULES = [("w", P("fsdp", "tp")), ("b", P("tp"))]


def mixed_tree():
    return {
        "w": np.zeros((64, 64)),
        "b": np.zeros(64),
        "n": 3,
        "s": "hello",
        "z": None,
        "f": 1.5,
        "sc": np.float32(2.0),
    }


def test_match_partition_rules_gives_leaves_without_a_shape_an_empty_spec():
    assert escale.match_partition_rules(RULES, mixed_tree()) == {
        "b": P("tp"),
        "f": P(),
        "n": P(),
        "s": P(),
        "sc": P(),
        "w": P("fsdp", "tp"),
        "z": None,
    }
    # With no array at all, as eformer: nothing to split, and None stays None.
    tree = {"step": 3, "name": "llama", "extra": None, "sizes": [1, None, "x"]}
    assert escale.match_partition_rules(RULES, tree) == {
        "step": P(),
        "name": P(),
        "extra": None,
        "sizes": [P(), None, P()],
    }
    assert escale.match_partition_rules(RULES, None) is None
    assert escale.match_partition_rules(RULES, {}) == {}


def test_match_partition_rules_strict_false_needs_a_rule_for_every_leaf():
    catch_all = [*RULES, (".*", P())]
    assert escale.match_partition_rules(catch_all, mixed_tree(), strict=False) == (
        escale.match_partition_rules(RULES, mixed_tree())
    )
    # eformer gives an int the rule's P('tp'); nothing can split it, so it gets P().
    assert escale.match_partition_rules([("q", P("tp"))], {"q": 3}, strict=False) == {"q": P()}
    with pytest.raises(ValueError, match=r"no partition rule matches 'q' \(4, 4\);.*strict=False"):
        escale.match_partition_rules(RULES, {"q": np.zeros((4, 4))}, strict=False)
    with pytest.raises(
        fe.sharding.PartitionRuleError,
        match=r"matches 'f' \(float\), 'n' \(int\), 's' \(str\), 'sc' \(\); rules tried: "
        r"\['w', 'b'\].*every leaf needs a rule",
    ):
        escale.match_partition_rules(RULES, mixed_tree(), strict=False)


def test_match_partition_rules_strict_unmatched_array_does_not_point_to_strict_false():
    with pytest.raises(ValueError, match=r"matches 'q' \(4, 4\)") as raised:
        escale.match_partition_rules(RULES, {"q": np.zeros((4, 4)), "n": 3})
    assert "strict=False" not in str(raised.value)  # eformer's strict=False raises too


def test_match_partition_rules_result_feeds_shard_functions():
    mesh = escale.create_mesh((1, 4, 1, 2, 1))
    params = {"w": np.ones((64, 32), np.float32), "step": 3, "extra": None}
    specs = escale.match_partition_rules(RULES, params)
    shard_fns, _ = escale.make_shard_and_gather_fns(specs, mesh)
    sharded = jax.tree_util.tree_map(lambda fn, x: fn(x), shard_fns, params)
    assert sharded["w"].addressable_shards[0].data.shape == (16, 16)
    assert sharded["extra"] is None
    assert int(sharded["step"]) == 3


def test_match_partition_rules_checks_rules_without_arrays_too():
    with pytest.raises(fe.sharding.PartitionRuleError, match=r"'\(' is not a valid regex"):
        escale.match_partition_rules([("(", P())], {"n": 3})
    with pytest.raises(TypeError, match=r"rules must be a sequence of .* got the string"):
        escale.match_partition_rules("w", {"n": 3})
    with pytest.raises(ValueError, match=r"min_size.*-1"):
        escale.match_partition_rules(RULES, {"n": 3}, min_size=-1)


CASES = [
    case(
        lambda: fe.eformer.match_partition_rules([("w", P())], params(), strict="no"),
        T,
        "strict",
        "'no'",
        "True or False",
        id="eformer-match_rules-strict-string",
    ),
    case(
        lambda: fe.eformer.auto_partition_spec(None, mesh=mesh_dp_tp()),
        T,
        "x",
        "None",
        r"jax\.ShapeDtypeStruct",
        id="eformer-auto_partition_spec-x-none",
    ),
    case(
        lambda: fe.eformer.auto_partition_spec(X, mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="eformer-auto_partition_spec-mesh-string",
    ),
    case(
        lambda: fe.eformer.auto_partition_spec(X, mesh=mesh_dp_tp(), names="dp"),
        T,
        "names",
        "'dp'",
        r"pass \('dp',\)",
        id="eformer-auto_partition_spec-names-string",
    ),
    case(
        lambda: fe.eformer.auto_partition_spec(X, mesh=mesh_dp_tp(), min_sharding_size="1"),
        T,
        "min_sharding_size",
        "'1'",
        "pass the int 1",
        id="eformer-auto_partition_spec-min-string",
    ),
    case(
        lambda: fe.eformer.match_partition_rules([(".*", P())], params(), min_size=-1),
        fe.EscaleError,
        "min_size",
        "-1",
        "finite number of at least 0",
        id="eformer-match_partition_rules-negative-min_size",
    ),
    case(
        lambda: fe.eformer.match_partition_rules(
            [(".*", P())], params(), min_size=-1, strict=False
        ),
        fe.EscaleError,
        "min_size",
        "-1",
        "finite number of at least 0",
        id="eformer-match_partition_rules-negative-min_size-unused",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
