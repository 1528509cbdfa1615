"""``MeshPartitionHelper`` (``flax_escale/eformer/_helper.py``): methods, specs, placement.

Expected values are what eformer 0.0.101 returns for the same call.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh5, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import eformer as escale


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


def test_helper_analyzes_creates_and_shards():
    mesh = fe.create_mesh((2, 4, 1, 1, 1))
    helper = fe.eformer.MeshPartitionHelper(mesh)
    assert helper.axis_sizes == {"dp": 2, "fsdp": 4, "ep": 1, "tp": 1, "sp": 1}
    params = {"w": np.arange(512 * 8, dtype=np.float32).reshape(512, 8), "b": np.ones(8)}
    analysis = helper.analyze_pytree(params)
    # eformer's suggestions and its placement of them (the tests above have the details).
    assert analysis == {
        (8,): [("dp",), ("tp",), ("fsdp",)],
        (512, 8): [("fsdp", "sp"), ("dp",), ("tp",)],
    }
    assert helper.create_partition_spec((512, 8), analysis[(512, 8)]) == P("fsdp", "sp")
    assert helper.create_partition_spec((8,), [("fsdp",)]) == P(None)  # under min_shard_size
    sharded = helper.auto_shard_pytree(params)
    assert sharded["w"].sharding.spec == P(("fsdp", "dp"), None)
    assert sharded["w"].addressable_shards[0].data.shape == (64, 8)
    np.testing.assert_array_equal(sharded["w"], params["w"])
    assert helper.partition_specs(params) == {"w": P(("fsdp", "dp")), "b": P()}


def test_create_partition_spec_places_or_skips_methods_and_refuses_unknown_axes():
    # eformer's helper reads methods as candidates: what does not fit is placed elsewhere or
    # skipped (test_helper_places_methods_as_eformer_does has eformer's two passes); unknown axes
    # raise.
    helper = fe.eformer.MeshPartitionHelper(fe.create_mesh((1, 4, 1, 2, 1)))
    assert helper.create_partition_spec((6, 1024), [("fsdp",), ()]) == P(None, "fsdp")
    assert helper.create_partition_spec((1024, 1024), [("fsdp",), ("fsdp",)]) == P("fsdp", None)
    assert helper.create_partition_spec((1024, 1024), [(), (), ("tp",)]) == P("tp", None)
    with pytest.raises(fe.EscaleError, match=r"methods\[0\] \('nope',\): 'nope' is not an axis"):
        helper.create_partition_spec((1024, 1024), [("nope",), ()])
    with pytest.raises(fe.EscaleTypeError, match=r"methods\[1\] must be None, .*got int 3"):
        helper.create_partition_spec((1024, 1024), [("fsdp",), 3])
    with pytest.raises(fe.EscaleTypeError, match=r"methods must be a list .*got str 'fsdp'"):
        helper.create_partition_spec((1024, 1024), "fsdp")
    with pytest.raises(fe.ShardingResolutionError):
        helper.shard_array(np.zeros((6, 1024)), P("fsdp"))


def test_create_partition_spec_gives_one_entry_per_dimension():
    helper = fe.eformer.MeshPartitionHelper(fe.create_mesh((1, 4, 1, 2, 1)))
    assert helper.create_partition_spec((1024, 1024), [(), (), ()]) == P(None, None)
    assert helper.create_partition_spec((1024, 1024), [("fsdp",), ("tp",), ()]) == P("fsdp", "tp")
    assert helper.create_partition_spec((1024, 1024), ["tp", None]) == P("tp", None)


def test_every_helper_path_honours_the_partition_axis():
    # On a ('data', 'model') mesh, 'model' is the tensor axis only if paxis says so.
    mesh = fe.create_mesh((2, 4), ("data", "model"))
    paxis = fe.PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    helper = fe.eformer.MeshPartitionHelper(mesh, paxis)
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    assert helper.suggest_methods((64, 64)) == [("data",), ("model",)]
    assert helper.analyze_pytree({"w": w}) == {(64, 64): [("data",), ("model",)]}
    assert helper.partition_specs({"w": w}) == {"w": P("data", "model")}
    assert fe.sharding.spec_from_shape((64, 64), mesh, paxis=paxis) == P("data", "model")
    sharded = helper.auto_shard_pytree({"w": w})["w"]
    assert sharded.sharding.spec == P("data", "model")
    assert sharded.addressable_shards[0].data.shape == (32, 16)
    np.testing.assert_array_equal(sharded, w)
    # Without paxis both axes are data axes and share the first dimension.
    assert fe.eformer.MeshPartitionHelper(mesh).partition_specs({"w": w}) == {
        "w": P(("data", "model"))
    }
    assert fe.sharding.spec_from_shape((64, 64), mesh) == P(("data", "model"))


def test_shape_structs_give_specs_for_a_sharded_init():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    tree = {"k": jax.ShapeDtypeStruct((256, 64), np.float32)}
    assert fe.eformer.MeshPartitionHelper(mesh).partition_specs(tree) == {"k": P("fsdp", "tp")}


CASES = [
    case(
        lambda: fe.eformer.MeshPartitionHelper("dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="eformer-MeshPartitionHelper-mesh-string",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh5(), "tp"),
        T,
        "paxis",
        "'tp'",
        r"PartitionAxis\(tensor_parallel_axis='model'\)",
        id="eformer-MeshPartitionHelper-paxis-string",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh5(), fe.PartitionAxis),
        T,
        "paxis",
        "class PartitionAxis",
        r"pass PartitionAxis\(\.\.\.\)",
        id="MeshPartitionHelper-paxis-class",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh_dp_tp()).create_partition_spec(
            (64, 64), [("tp",)], min_shard_size=float("nan")
        ),
        T,
        "min_shard_size",
        "float nan",
        "an int of at least 0",
        id="eformer-MeshPartitionHelper-create_partition_spec-min-nan",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh_dp_tp()).create_partition_spec(
            (64, 64), [("tp",)], min_shard_size=-1
        ),
        fe.EscaleError,
        "min_shard_size",
        "-1",
        "an int of at least 0",
        id="eformer-MeshPartitionHelper-create_partition_spec-min-negative",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh_dp_tp()).create_partition_spec(
            (64, 64), [("tp",)], min_shard_size=True
        ),
        T,
        "min_shard_size",
        "bool True",
        "an int of at least 0",
        id="eformer-MeshPartitionHelper-create_partition_spec-min-bool",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh_dp_tp()).partition_specs({}, min_shard_size=-1),
        fe.EscaleError,
        "min_shard_size",
        "-1",
        "an int of at least 0",
        id="eformer-MeshPartitionHelper-partition_specs-min-negative-empty-tree",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh5()).suggest_methods(1024),
        T,
        "array_shape",
        "int 1024",
        r"pass \(1024,\)",
        id="MeshPartitionHelper-suggest-int",
    ),
    case(
        lambda: fe.eformer.MeshPartitionHelper(mesh5()).auto_shard_pytree("params"),
        T,
        "pytree",
        "'params'",
        "not its name",
        id="eformer-MeshPartitionHelper-auto_shard-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
