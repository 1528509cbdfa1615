"""flax_escale.eformer: eformer.escale code runs with only its import line changed.

PROGRAM is written the way eformer's documentation uses escale (meshes, regex rules, shard and
gather functions, analysis, constraints, PartitionAxis, PartitionManager, the helper); the
tests run it with ``from eformer import escale`` replaced, then check each difference the
compatibility layer smooths over, with its error cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import eformer as escale

PROGRAM = """
import jax
import jax.numpy as jnp
import numpy as np
from eformer import escale

P = escale.PartitionSpec
rng = np.random.default_rng(0)

# eformer's create_mesh order: dims, names, dcn_mesh_dims, should_sort_granules_by_key,
# allow_split_physical_axes, backend.
mesh = escale.create_mesh((1, -1, 1, 2, 1), ("dp", "fsdp", "ep", "tp", "sp"), None, True, True,
                          "cpu")
serving = escale.parse_mesh_from_string("dp:2,tp:4", ["dp", "tp"])

params = {
    "embed": {"embedding": rng.standard_normal((256, 64)).astype(np.float32)},
    "mlp": {"kernel": rng.standard_normal((64, 256)).astype(np.float32),
            "bias": rng.standard_normal(256).astype(np.float32)},
    "odd": {"kernel": rng.standard_normal((7, 6)).astype(np.float32)},
    "norm": {"scale": np.ones(64, np.float32)},
}
rules = [
    ("embedding", P("tp", "fsdp")),
    ("kernel", P("fsdp", "tp")),
    ("bias", P("tp")),
    (".*", P()),
]
specs = escale.match_partition_rules(rules, params, min_size=None)
eager_specs = escale.match_partition_rules(rules, params, min_size=None, strict=False)
shard_fns, gather_fns = escale.make_shard_and_gather_fns(eager_specs, mesh)
sharded = jax.tree_util.tree_map(lambda fn, x: fn(x), shard_fns, params)
gathered = jax.tree_util.tree_map(lambda fn, x: fn(x), gather_fns, sharded)

analysis = escale.analyze_sharding_strategy(params, specs, mesh)
report = {key: analysis[key] for key in ("total_parameters", "sharded_parameters")}

structure = escale.extract_sharding_structure(sharded)
same_structure = escale.get_shardings_with_structure(pytree=sharded)
shardings = escale.extract_shardings(sharded, mesh)
specs_back = escale.get_partition_spec(sharded)
used_axes = escale.get_names_from_partition_spec(eager_specs)
spec_of = escale.create_pattern_based_partition_spec("kernel->fsdp.tp,embedding->tp", mesh)
pattern_spec = spec_of("mlp/kernel", params["mlp"]["kernel"])

no_mesh = escale.get_incontext_mesh(raise_error=False)
with jax.set_mesh(mesh):
    current = escale.get_incontext_mesh()
    has_names = escale.names_in_current_mesh("fsdp", "tp")
    data_size = escale.get_axes_size_in_mesh(("dp", "fsdp"))
    axis_names = escale.get_mesh_axis_names()
    constrained = escale.with_sharding_constraint(arr=jnp.ones((8, 64)), sharding=P("fsdp", "tp"))


def device_index(x):
    index = escale.get_submesh_device_index(("fsdp", "tp"))
    return x + index + 100 * escale.get_mesh_axis_size(("fsdp", "tp"))


indices = jax.shard_map(device_index, mesh=mesh, in_specs=P(("fsdp", "tp")),
                        out_specs=P(("fsdp", "tp")))(jnp.zeros(8, jnp.int32))

paxis = escale.PartitionAxis(decode_batch_axis="dp", decode_kv_head_axis=None)
manager = escale.PartitionManager(paxis)


@jax.jit
def block(hidden):
    return manager.shard(hidden * 2, ["batch", "sequence", "hidden_state"], mode="train")


with jax.set_mesh(mesh):
    hidden = block(jnp.ones((8, 4, 64)))
decode_spec = manager.resolve(["batch", "query_sequence", "kv_head"], mode=1, shape=(8, 1, 4))

helper = escale.MeshPartitionHelper(mesh)
methods = helper.analyze_pytree(params)
kernel_spec = helper.create_partition_spec((64, 256), [("fsdp", "sp"), ("dp",), ("tp",)], 1)
auto_sharded = helper.auto_shard_pytree(params, min_shard_size=1)
auto_spec = escale.auto_partition_spec(params["mlp"]["kernel"], mesh)
"""


def run_program() -> dict:
    source = PROGRAM.replace(
        "from eformer import escale", "from flax_escale import eformer as escale"
    )
    assert source.count("flax_escale") == 1  # the one line that changed
    namespace: dict = {}
    # The odd (7, 6) kernel meets P('fsdp', 'tp'), and 7 is not divisible by fsdp=4: eformer
    # corrects it; so does the library, saying so.
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"parameter 'odd/kernel'"):
        exec(compile(source, "eformer_program", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def program() -> dict:
    return run_program()


def test_program_meshes_and_rules(program):
    mesh = program["mesh"]
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}
    assert dict(program["serving"].shape) == {"dp": 2, "tp": 4}
    specs = program["specs"]
    # min_size=None is eformer's default minimum (16384): exactly-16384 arrays are sharded.
    assert specs["embed"]["embedding"] == P("tp", "fsdp")
    assert specs["mlp"]["kernel"] == P("fsdp", "tp")
    assert specs["mlp"]["bias"] == P()
    assert specs["odd"]["kernel"] == P()
    # strict=False: eformer applies every matched rule, whatever the size.
    assert program["eager_specs"]["mlp"]["bias"] == P("tp")
    assert program["eager_specs"]["odd"]["kernel"] == P("fsdp", "tp")


def test_program_round_trips_bit_exactly(program):
    sharded, mesh = program["sharded"], program["mesh"]
    assert sharded["mlp"]["kernel"].sharding == NamedSharding(mesh, P("fsdp", "tp"))
    assert sharded["mlp"]["bias"].addressable_shards[0].data.shape == (128,)
    assert sharded["odd"]["kernel"].sharding.spec == P(None, "tp")  # corrected, not an error
    for path, original in jax.tree_util.tree_leaves_with_path(program["params"]):
        back = program["gathered"]
        for key in path:
            back = back[key.key]
        assert isinstance(back, np.ndarray)
        assert back.dtype == original.dtype
        assert back.tobytes() == original.tobytes(), path


def test_program_reads_layouts_back(program):
    total = 16384 * 2 + 256 + 42 + 64
    assert program["report"] == {"total_parameters": total, "sharded_parameters": 16384 * 2}
    assert program["analysis"].sharded_parameters == 16384 * 2
    sharded = program["sharded"]
    assert program["structure"] == program["same_structure"] == program["shardings"]
    assert program["structure"]["mlp"]["kernel"] == sharded["mlp"]["kernel"].sharding
    assert program["specs_back"]["mlp"]["kernel"] == P("fsdp", "tp")
    assert program["used_axes"] == ["fsdp", "tp"]
    assert program["pattern_spec"] == P("fsdp", "tp")


def test_program_mesh_queries(program):
    assert program["no_mesh"].empty  # eformer's empty Mesh, not None
    assert program["no_mesh"].axis_names == ()
    assert program["current"] is program["mesh"]
    assert program["has_names"] is True
    assert program["data_size"] == 4
    assert program["axis_names"] == ["dp", "fsdp", "ep", "tp", "sp"]
    assert program["constrained"].addressable_shards[0].data.shape == (2, 32)
    np.testing.assert_array_equal(program["indices"], 800 + np.arange(8))


def test_program_activations_and_automatic_specs(program):
    assert program["hidden"].addressable_shards[0].data.shape == (2, 4, 32)
    np.testing.assert_array_equal(program["hidden"], np.full((8, 4, 64), 2.0, np.float32))
    # Dimension 1 has size 1: decode mode, so the decode_* fields apply.
    assert program["decode_spec"] == P("dp", None, None)
    # eformer's suggestions, and its placement of them: the pair (fsdp, sp) spreads over the
    # first two dimensions and ends the first pass.
    assert program["methods"][(64, 256)] == [("fsdp", "sp"), ("dp",), ("tp",)]
    assert program["kernel_spec"] == P("fsdp", "sp")
    assert program["auto_sharded"]["mlp"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert program["auto_spec"] == P("fsdp", "tp")


def test_match_partition_rules_raises_for_an_unmatched_array_in_both_modes():
    tree = {"w": np.zeros((4, 4)), "norm": {"scale": np.zeros(4)}}
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"no partition rule matches 'norm/scale' \(4,\)"):
            escale.match_partition_rules([("w", P("fsdp"))], tree, strict=strict)


def test_shard_fns_correct_indivisible_and_too_long_specs_bit_exactly():
    mesh = escale.create_mesh((2, 4), ("dp", "tp"))
    specs = {"a": P("dp", "tp"), "b": P("dp", None, "tp")}
    shard_fns, gather_fns = escale.make_shard_and_gather_fns(specs, mesh)
    a = np.random.default_rng(1).standard_normal((7, 6)).astype(np.float32)
    b = np.arange(32, dtype=np.int32).reshape(8, 4)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"size 7 is not divisible by \('dp',\)"):
        sharded_a = shard_fns["a"](a)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"the spec has 3 entries but the array"):
        sharded_b = shard_fns["b"](b)
    assert sharded_a.sharding.is_fully_replicated
    assert sharded_b.sharding.spec == P("dp", None)
    assert gather_fns["a"](sharded_a).tobytes() == a.tobytes()
    assert gather_fns["b"](sharded_b).tobytes() == b.tobytes()


def test_partition_axis_takes_eformers_decode_names():
    paxis = escale.PartitionAxis(
        decode_batch_axis="dp",
        decode_query_sequence_axis=None,
        decode_head_axis="tp",
        decode_kv_head_axis="sp",
        decode_key_sequence_axis=None,
        decode_attention_dim_axis=None,
        decode_attention_kv_dim_axis=None,
        attention_kv_dim_axis=None,
    )
    assert paxis.generation_batch_axis == paxis.decode_batch_axis == "dp"
    assert paxis.generation_kv_head_axis == paxis.decode_kv_head_axis == "sp"
    assert paxis.attention_kv_dim_axis is None
    assert paxis == escale.PartitionAxis(
        generation_batch_axis="dp", generation_kv_head_axis="sp", generation_key_sequence_axis=None
    )
    rules = paxis.logical_axis_rules(generation=True)
    assert fe.logical_to_mesh_axes(("batch", "kv_head", "attention_kv_dim"), rules) == P(
        "dp", "sp", None
    )
    # eformer's default: decode follows the kv_head mapping.
    assert escale.PartitionAxis(kv_head_axis="sp").decode_kv_head_axis == "sp"


def test_get_incontext_mesh_errors_and_the_legacy_context():
    with pytest.raises(ValueError, match=r"No mesh is set in the current context"):
        escale.get_incontext_mesh()
    mesh = escale.create_mesh()
    with pytest.warns(DeprecationWarning, match=r"`with mesh:` context manager"), mesh:
        found = escale.get_incontext_mesh(raise_error=False)
    assert found is mesh


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


def test_with_sharding_constraint_keywords_trees_and_corrections():
    mesh = escale.create_mesh((2, 4), ("dp", "tp"))
    tree = {"a": np.ones((8, 8)), "b": np.ones((8, 6))}
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"size 6 is not divisible by \('tp',\)"):
        out = escale.with_sharding_constraint(arr=tree, sharding=P("dp", "tp"), mesh=mesh)
    assert out["a"].sharding.spec == P("dp", "tp")
    assert out["b"].sharding.spec == P("dp", None)
    with pytest.raises(ValueError, match=r"strict=True"):
        escale.with_sharding_constraint(tree["b"], P("dp", "tp"), mesh=mesh, strict=True)
    named = NamedSharding(mesh, P(None, "tp"))
    assert escale.with_sharding_constraint(arr=tree["a"], sharding=named).sharding == named


def test_helper_places_methods_as_eformer_does():
    # Each spec here is the one eformer 0.0.101 gives for the same call.
    helper = escale.MeshPartitionHelper(escale.create_mesh((2, 2, 1, 2, 1)))
    # First pass: a dimension must hold at least elements // (2 * devices); a pair spreads
    # over dimensions 0 and 1 and ends the pass, whatever comes after it.
    assert helper.create_partition_spec((64, 256), [("fsdp",), ("dp",), ("tp",)], 1) == P(
        "fsdp", "dp"
    )
    assert helper.create_partition_spec((64, 256), [("tp",), ("fsdp", "dp")], 1) == P("fsdp", "dp")
    assert helper.create_partition_spec((1024, 1024, 4), [("dp",), ("fsdp", "sp"), ("tp",)]) == P(
        "fsdp", "sp", None
    )
    # A pair whose second axis exceeds dimension 1 is not spread; groups of three are passed
    # over; one entry per dimension, as eformer's.
    assert helper.create_partition_spec((12, 1), [("fsdp", "tp")], 1) == P(None, None)
    assert helper.create_partition_spec((64, 256), [("fsdp", "sp", "dp")], 1) == P(None, None)
    assert helper.create_partition_spec((8, 0), [("fsdp", "tp")], 1) == P(("fsdp", "tp"), None)
    assert helper.create_partition_spec((), [("fsdp",)], 0) == P()
    # Second pass, when nothing was placed: min_shard_size is the bar, the (fsdp, sp) pair the
    # only pair.
    assert helper.create_partition_spec((2048, 2048), [("fsdp",), ("tp",)]) == P("fsdp", "tp")
    assert helper.create_partition_spec((8, 1024), [("tp",), ("fsdp", "sp")]) == P(None, "tp")
    assert helper.create_partition_spec((16, 16), [("fsdp",)]) == P(None, None)


def test_helper_passes_over_what_eformer_would_place_wrongly():
    helper = escale.MeshPartitionHelper(escale.create_mesh((1, 4, 1, 2, 1)))
    # eformer: P('fsdp', 'sp') (6 rows over fsdp=4, which jax.device_put refuses).
    assert helper.create_partition_spec((6, 4096), [("fsdp", "sp"), ("tp",)]) == P(None, "tp")
    assert helper.create_partition_spec((3, 5), helper._suggest_methods((3, 5))) == P(None, None)
    # eformer: IndexError for the second pass's pair on a vector.
    assert helper.create_partition_spec((4096,), [("fsdp", "sp")]) == P(("fsdp", "sp"))
    # eformer: P('fsdp', 'fsdp'); a mesh axis is used once.
    assert helper.create_partition_spec((1024, 1024), [("fsdp",), ("fsdp",)]) == P("fsdp", None)
    sharded = helper.shard_array(np.zeros((6, 4096), np.float32), P(None, "tp"))
    assert sharded.addressable_shards[0].data.shape == (6, 2048)


def test_helper_method_errors():
    helper = escale.MeshPartitionHelper(escale.create_mesh((2, 2, 1, 2, 1)))
    with pytest.raises(ValueError, match=r"methods\[1\] \('model',\): 'model' is not an axis"):
        helper.create_partition_spec((64, 64), [("fsdp",), ("model",)], 1)
    with pytest.raises(ValueError, match=r"methods\[0\] \('tp', 'tp'\) names a mesh axis twice"):
        helper.create_partition_spec((64, 64), [("tp", "tp")], 1)
    with pytest.raises(TypeError, match=r"methods must be a list of sharding methods .*str"):
        helper.create_partition_spec((64, 64), "fsdp", 1)
    with pytest.raises(TypeError, match=r"methods\[0\] must be None, a mesh axis name"):
        helper.create_partition_spec((64, 64), [3], 1)
    with pytest.raises(
        TypeError, match=r"got the spec (P|PartitionSpec)\('fsdp', None\), which is a placement"
    ):
        helper.create_partition_spec((64, 64), P("fsdp", None), 1)
    with pytest.raises(
        TypeError, match=r"shape must be a shape \(a tuple of ints\), got the int 1024"
    ):
        helper._suggest_methods(1024)
    with pytest.raises(ValueError, match=r"mesh is an empty mesh .*get_incontext_mesh"):
        escale.MeshPartitionHelper(escale.get_incontext_mesh(raise_error=False))


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
