"""eformer 0.0.101's own results, call by call, from ``flax_escale.eformer``.

Each expected value below is what eformer 0.0.101 returns for the same call (run side by side
when these tests were written). Where eformer's result cannot be used (a spec that does not
divide its shape, an index error), the test says what eformer gives and asserts the library's
fix instead.
"""

import inspect

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import eformer as escale

DECODE_NAMES = [
    "batch",
    "query_sequence",
    "head",
    "kv_head",
    "key_sequence",
    "attention_dim",
    "attention_kv_dim",
]


def decode_fields(paxis):
    return [getattr(paxis, f"decode_{name}_axis") for name in DECODE_NAMES]


# --- PartitionAxis: eformer's decode_* keywords and defaults -------------------------------


@pytest.mark.parametrize(
    ("keywords", "expected"),
    [
        ({}, [("fsdp", "dp"), None, "tp", "tp", "sp", None, None]),
        (
            {
                "head_axis": "sp",
                "key_sequence_axis": None,
                "kv_head_axis": "dp",
                "batch_axis": "dp",
            },
            ["dp", None, "sp", "dp", None, None, None],
        ),
        (
            {"tensor_parallel_axis": "model", "sequence_parallel_axis": "seq"},
            [("fsdp", "dp"), None, "model", "model", "seq", None, None],
        ),
        (
            {"decode_batch_axis": None, "decode_query_sequence_axis": "dp"},
            [None, "dp", "tp", "tp", "sp", None, None],
        ),
        (
            {"batch_axis": ("dp",), "decode_head_axis": ("tp", "sp")},
            [("dp",), None, ("tp", "sp"), "tp", "sp", None, None],
        ),
    ],
)
def test_partition_axis_decode_fields_are_eformers(keywords, expected):
    assert decode_fields(escale.PartitionAxis(**keywords)) == expected


EFORMER_NONE_DEFAULTS = ["query_sequence", "attention_dim", "attention_kv_dim"]


@pytest.mark.parametrize("name", EFORMER_NONE_DEFAULTS)
def test_decode_fields_eformer_defaults_to_none_do_not_follow_their_training_field(name):
    # eformer 0.0.101 declares these three decode fields with the default None (the others
    # default to "derived"); giving the training field does not move them.
    training = {"query_sequence": "tp", "attention_dim": "tp", "attention_kv_dim": "sp"}[name]
    paxis = escale.PartitionAxis(**{f"{name}_axis": training})
    assert getattr(paxis, f"{name}_axis") == training
    assert getattr(paxis, f"decode_{name}_axis") is None
    assert paxis.logical_axes(generation=True)[name] is None
    assert escale.PartitionManager(paxis).resolve([name], mode="decode") == P(None)
    assert escale.PartitionManager(paxis).resolve([name], mode="train") == P(training)
    # The signature says so too, where the derived ones show the placeholder `...`.
    parameters = inspect.signature(escale.PartitionAxis).parameters
    assert parameters[f"decode_{name}_axis"].default is None
    assert parameters["decode_head_axis"].default is ...
    assert inspect.signature(fe.PartitionAxis).parameters[f"decode_{name}_axis"].default is None


def test_partition_axis_takes_every_decode_keyword():
    paxis = escale.PartitionAxis(
        decode_batch_axis="dp",
        decode_query_sequence_axis="sp",
        decode_head_axis=("tp", "sp"),
        decode_kv_head_axis=None,
        decode_key_sequence_axis="fsdp",
        decode_attention_dim_axis="ep",
        decode_attention_kv_dim_axis="ep",
    )
    assert decode_fields(paxis) == ["dp", "sp", ("tp", "sp"), None, "fsdp", "ep", "ep"]
    assert paxis.generation_head_axis == ("tp", "sp")  # the library's name for the same field
    parameters = inspect.signature(escale.PartitionAxis).parameters
    assert all(f"decode_{name}_axis" in parameters for name in DECODE_NAMES)
    assert "decode_batch_axis" in inspect.signature(fe.PartitionAxis).parameters


def test_eformer_partition_axis_is_usable_wherever_the_librarys_is():
    paxis = escale.PartitionAxis()
    assert isinstance(paxis, fe.PartitionAxis)
    # The library's own keeps its seed default: the batch unsharded while decoding.
    assert fe.PartitionAxis().decode_batch_axis is None
    rules = paxis.logical_axis_rules(generation=True)
    assert fe.logical_to_mesh_axes(("batch", "query_sequence", "head"), rules) == P(
        ("fsdp", "dp"), None, "tp"
    )
    assert escale.PartitionManager(paxis).resolve(["batch", "sequence"], mode="decode") == P(
        ("fsdp", "dp"), "sp"
    )
    # Copies stay eformer's; a static argument of jit, as the library's.
    assert type(paxis.replace(tensor_parallel_axis="model")) is escale.PartitionAxis
    assert paxis.replace(tensor_parallel_axis="model").decode_head_axis == "model"
    assert type(paxis.with_aliases("t5x")) is escale.PartitionAxis
    assert jax.jit(lambda x, p: x + len(p.decode_batch_axis), static_argnums=1)(1, paxis) == 3
    assert paxis == escale.PartitionAxis()
    assert hash(paxis) == hash(escale.PartitionAxis())


def test_partition_axis_decode_errors():
    with pytest.raises(ValueError, match=r"decode_batch_axis and generation_batch_axis name the"):
        escale.PartitionAxis(decode_batch_axis="dp", generation_batch_axis="dp")
    with pytest.raises(ValueError, match=r"generation_head_axis must be a mesh axis name"):
        escale.PartitionAxis(decode_head_axis=3)
    with pytest.raises(ValueError, match=r"PartitionAxis has no field 'decode_heads_axis'"):
        escale.PartitionAxis().replace(decode_heads_axis="tp")


# --- match_partition_rules: any leaf, and eformer's strict=False -------------------------

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


# --- MeshPartitionHelper: eformer's suggestions and their placement -----------------------


@pytest.mark.parametrize(
    ("dims", "vector"),
    # eformer gives P('dp') for a (1024,) vector on all three; where dp has size 1 that splits
    # nothing, and the library passes it over for the next method that does.
    [((1, 4, 1, 2, 1), P("tp")), ((2, 2, 1, 2, 1), P("dp")), ((1, 8, 1, 1, 1), P("fsdp"))],
)
def test_create_partition_spec_of_the_suggested_methods_is_eformers(dims, vector):
    helper = escale.MeshPartitionHelper(escale.create_mesh(dims))
    methods = helper._suggest_methods((1024, 4096))
    assert methods == [("fsdp", "sp"), ("dp",), ("tp",)]
    assert helper.create_partition_spec((1024, 4096), methods) == P("fsdp", "sp")
    assert helper.create_partition_spec((1024, 4096), [("fsdp", "sp"), ("tp",)]) == P("fsdp", "sp")
    assert helper._suggest_methods((8,)) == [("dp",), ("tp",), ("fsdp",)]
    assert helper.create_partition_spec((8,), helper._suggest_methods((8,))) == P(None)
    assert helper.create_partition_spec((1024,), helper._suggest_methods((1024,))) == vector
    tree = {"a": jax.ShapeDtypeStruct((1024, 4096), "f4"), "b": jax.ShapeDtypeStruct((8,), "f4")}
    assert helper.analyze_pytree(tree) == {
        (1024, 4096): [("fsdp", "sp"), ("dp",), ("tp",)],
        (8,): [("dp",), ("tp",), ("fsdp",)],
    }


def test_create_partition_spec_spends_no_dimension_on_a_size_one_axis(devices):
    # fsdp=8, dp=1: eformer suggests dp first for a 1,024-element vector and gives P('dp'),
    # which leaves every device a whole copy; fsdp splits it.
    mesh = escale.create_mesh((1, 8, 1, 1, 1))
    helper = escale.MeshPartitionHelper(mesh)
    methods = helper._suggest_methods((1024,))
    assert methods == [("dp",), ("tp",), ("fsdp",)]
    spec = helper.create_partition_spec((1024,), methods)
    assert spec == P("fsdp")
    placed = helper.shard_array(np.arange(1024.0, dtype=np.float32), spec)
    assert placed.addressable_shards[0].data.shape == (128,)
    np.testing.assert_array_equal(np.asarray(placed), np.arange(1024.0, dtype=np.float32))
    # The same on a rank-2 array whose pair does not fit: the size-1 sp and dp are passed over.
    assert helper.create_partition_spec((2, 4096), [("dp",), ("sp",), ("fsdp",)]) == P(None, "fsdp")
    # A size-1 axis given alone places nothing rather than a split of one.
    assert helper.create_partition_spec((1024,), [("dp",)]) == P(None)


def test_suggested_methods_follow_the_mesh_and_the_partition_axis():
    no_sp = escale.MeshPartitionHelper(escale.create_mesh((2, 4), ("dp", "fsdp")))
    assert no_sp._suggest_methods((64, 64)) == [("dp",), ("fsdp",)]
    paxis = fe.PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    renamed = escale.MeshPartitionHelper(escale.create_mesh((2, 4), ("data", "model")), paxis)
    assert renamed._suggest_methods((64, 64)) == [("data",), ("model",)]
    # The library's own placement, one tuple per dimension, stays under its own name.
    assert renamed.suggest_methods((64, 64)) == [("data",), ("model",)]


# --- get_incontext_mesh: eformer's empty Mesh --------------------------------------------


def test_get_incontext_mesh_outside_a_mesh_is_an_empty_mesh():
    empty = escale.get_incontext_mesh(raise_error=False)
    assert isinstance(empty, Mesh)
    assert empty.empty
    assert empty.size == 0
    assert empty.axis_names == ()
    assert dict(empty.shape) == {}
    assert empty == Mesh(np.empty((), dtype=object), ())  # JAX's own "no mesh"
    assert escale.get_mesh_axis_names(empty) == []
    mesh = escale.create_mesh()
    with jax.set_mesh(mesh):
        assert escale.get_incontext_mesh(raise_error=False) is mesh


@pytest.mark.parametrize(
    "call",
    [
        lambda m: escale.extract_shardings({"w": np.zeros(8)}, m),
        lambda m: escale.analyze_sharding_strategy({"w": np.zeros(8)}, {"w": P()}, m),
        lambda m: escale.MeshPartitionHelper(m),
        # The core's functions check every mesh they are given the same way.
        lambda m: fe.with_sharding_constraint(np.zeros(8), P(), mesh=m),
        lambda m: escale.make_shard_and_gather_fns({"w": P()}, m),
        lambda m: fe.batch_sharding(m, (8, 4)),
    ],
    ids=[
        "extract_shardings",
        "analyze_sharding_strategy",
        "MeshPartitionHelper",
        "with_sharding_constraint",
        "make_shard_and_gather_fns",
        "batch_sharding",
    ],
)
def test_the_empty_mesh_is_refused_where_a_mesh_places_arrays(call):
    empty = escale.get_incontext_mesh(raise_error=False)
    with pytest.raises(fe.MeshError, match=r"mesh is an empty mesh \(no axes, no devices\)"):
        call(empty)


def test_get_incontext_mesh_errors():
    with pytest.raises(fe.NoMeshError, match=r"No mesh is set in the current context"):
        escale.get_incontext_mesh()
    with pytest.raises(TypeError, match=r"raise_error must be True or False"):
        escale.get_incontext_mesh(raise_error="no")


# --- extract_sharding_structure / get_shardings_with_structure: pytree= -------------------


def test_sharding_structure_readers_take_pytree_keyword():
    mesh = escale.create_mesh((1, 4, 1, 2, 1))
    w = jax.device_put(np.zeros((8, 4)), NamedSharding(mesh, P("fsdp")))
    expected = {"w": NamedSharding(mesh, P("fsdp")), "n": None}
    assert escale.extract_sharding_structure(pytree={"w": w, "n": 3}) == expected
    assert escale.get_shardings_with_structure(pytree={"w": w, "n": 3}) == expected
    assert escale.get_shardings_with_structure({"w": w, "n": 3}) == expected
    with pytest.raises(TypeError, match=r"pytree must be a pytree of arrays, got the string"):
        escale.extract_sharding_structure(pytree="params")
    with pytest.raises(TypeError, match=r"pytree must be a pytree of arrays, got dict"):
        escale.get_shardings_with_structure(pytree={"n": 3})
