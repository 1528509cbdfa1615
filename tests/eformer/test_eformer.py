"""flax_escale.eformer: eformer.escale code runs with only its import line changed.

PROGRAM is written the way eformer's documentation uses escale (meshes, regex rules, shard and
gather functions, analysis, constraints, PartitionAxis, PartitionManager, the helper); the
tests run it with ``from eformer import escale`` replaced, then check the differences of what
the namespace takes from the core (shard and gather functions, constraints) and its mistakes.
Each eformer module's own differences are tested beside it (``test_helper.py``,
``test_manager.py``, ...).
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, X, case, mesh_dp_tp, raises_a_library_error

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


CASES = [
    case(
        lambda: fe.eformer.make_shard_and_gather_fns("tp", mesh_dp_tp()),
        T,
        "partition_specs",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="make_shard_and_gather-string",
    ),
    case(
        lambda: fe.eformer.make_shard_and_gather_fns({"w": P("tp")}, "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="make_shard_and_gather-mesh-string",
    ),
    case(
        lambda: fe.eformer.make_shard_and_gather_fns({"w": P("dp", "dp")}, mesh_dp_tp()),
        fe.EscaleError,
        "partition_specs",
        "P('dp', 'dp')",
        "twice",
        id="make_shard_and_gather-axis-twice",
    ),
    case(
        lambda: fe.eformer.make_shard_and_gather_fns({"w": P("fsdp")}, mesh_dp_tp()),
        fe.EscaleError,
        "partition_specs",
        "'fsdp'",
        r"the mesh's axes \('dp', 'tp'\)",
        id="make_shard_and_gather-axis-not-in-mesh",
    ),
    case(
        lambda: fe.eformer.with_sharding_constraint(X, 3, mesh=mesh_dp_tp()),
        T,
        "sharding",
        "int 3",
        r"PartitionSpec\('dp'\)",
        id="eformer-with_sharding_constraint-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
