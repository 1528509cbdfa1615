import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, X, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe
from flax_escale import eformer as escale


def test_extract_shardings_reads_arrays_boxes_and_specs(mesh):
    w = jax.device_put(np.zeros((8, 4)), NamedSharding(mesh, P("fsdp", "tp")))
    abstract = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("tp")))
    boxed = nn.LogicallyPartitioned(w, ("embed", "mlp"))
    tree = {"w": w, "abstract": abstract, "boxed": boxed, "n": 3, "np": np.zeros(3)}
    out = fe.eformer.extract_shardings(tree, mesh)
    assert out["w"] == w.sharding
    assert out["abstract"] == NamedSharding(mesh, P("tp"))
    assert out["boxed"] == w.sharding
    assert out["n"] is None
    assert out["np"] is None


def test_get_partition_spec(mesh):
    w = jax.device_put(np.zeros((8, 4)), NamedSharding(mesh, P("fsdp", "tp")))
    assert fe.eformer.get_partition_spec({"w": w, "lr": 0.1, "step": 3}) == {
        "w": P("fsdp", "tp"),
        "lr": P(),
        "step": P(),
    }
    with pytest.raises(fe.EscaleError, match="unsupported leaf str"):
        fe.eformer.get_partition_spec({"name": "x"})


def test_get_names_from_partition_spec():
    specs = {"a": P(("fsdp", "sp"), "tp"), "b": [P("dp"), None], "c": P()}
    assert fe.eformer.get_names_from_partition_spec(specs) == ["dp", "fsdp", "sp", "tp"]
    assert fe.eformer.get_names_from_partition_spec(P("tp", None)) == ["tp"]
    assert fe.eformer.get_names_from_partition_spec({}) == []


def test_analysis_counts_exact_bytes_per_device(mesh):
    params = {
        "w": jax.ShapeDtypeStruct((16, 8), np.float32),  # 512 B, split 8 ways -> 64 B each
        "e": jax.ShapeDtypeStruct((8, 6), np.float32),  # 192 B, fsdp only -> 48 B each
        "b": jax.ShapeDtypeStruct((8,), np.float32),  # 32 B, replicated
    }
    specs = {"w": P("fsdp", "tp"), "e": P("fsdp"), "b": None}
    a = fe.eformer.analyze_sharding_strategy(params, specs, mesh)
    assert a.total_parameters == 128 + 48 + 8
    assert a.sharded_parameters == 128 + 48
    assert a.total_bytes == 512 + 192 + 32
    assert set(a.bytes_per_device.values()) == {64 + 48 + 32}
    assert a.max_device_bytes == a.min_device_bytes == 144
    assert a.balance_score == 1.0
    assert a.ideal_device_bytes == pytest.approx(736 / 8)
    assert a.partition_stats[str(P("fsdp", "tp"))] == {"arrays": 1, "parameters": 128, "bytes": 512}
    assert a.partition_stats[str(P())]["arrays"] == 1


def test_analysis_reads_as_eformers_dict(mesh):
    params = {"w": jax.ShapeDtypeStruct((16, 8), np.float32), "b": jax.ShapeDtypeStruct((8,), "f4")}
    a = fe.eformer.analyze_sharding_strategy(params, {"w": P("fsdp", "tp"), "b": None}, mesh)
    keys = ["total_parameters", "sharded_parameters", "memory_per_device", "balance_score"]
    assert list(a) == [*keys, "partition_stats"]
    assert a["total_parameters"] == 136
    assert a["sharded_parameters"] == 128
    assert a["memory_per_device"] is a.bytes_per_device
    assert dict(a.items())["balance_score"] == 1.0
    assert "memory_per_device" in a
    assert a.get("total_bytes") is None  # an attribute, not one of eformer's keys
    with pytest.raises(KeyError, match=r"no key 'max_device_bytes'; the keys are"):
        a["max_device_bytes"]
    # Still a value type: equal by content, frozen.
    assert a == fe.eformer.analyze_sharding_strategy(
        params, {"w": P("fsdp", "tp"), "b": None}, mesh
    )
    with pytest.raises(AttributeError):
        a.total_parameters = 0


def test_analysis_sees_imbalance_and_uses_the_context_mesh():
    mesh = fe.create_mesh((2, 4), ("dp", "tp"), devices=jax.devices())
    sub = fe.create_mesh((1, 2), ("dp", "tp"), devices=jax.devices()[:2])
    params = {"w": jnp.zeros((4, 4))}
    with jax.set_mesh(mesh):
        even = fe.eformer.analyze_sharding_strategy(params, P("dp", "tp"))
    assert even.balance_score == 1.0
    assert set(even.bytes_per_device.values()) == {8}
    uneven = {"w": jax.ShapeDtypeStruct((5, 4), np.float32)}  # 5 rows over tp=2: 3 and 2
    lopsided = fe.eformer.analyze_sharding_strategy(uneven, {"w": P("tp")}, sub)
    assert lopsided.bytes_per_device == {0: 48, 1: 32}
    assert lopsided.balance_score == pytest.approx(2 / 3)
    with pytest.raises(fe.NoMeshError, match="analyze_sharding_strategy"):
        fe.eformer.analyze_sharding_strategy(params, P())


def test_analysis_errors_name_the_path(mesh):
    params = {"w": jax.ShapeDtypeStruct((8, 8), np.float32)}
    with pytest.raises(
        fe.EscaleError,
        match=r"'w': spec P\('nope',\) cannot apply to shape \(8, 8\) on mesh \{'dp': 1, "
        r".*in dimension 0, mesh axis 'nope' is not in the mesh",
    ):
        fe.eformer.analyze_sharding_strategy(params, {"w": P("nope")}, mesh)
    with pytest.raises(fe.EscaleError, match=r"dimension 2, the spec has 3 entries .*rank 2"):
        fe.eformer.analyze_sharding_strategy(params, {"w": P("fsdp", None, "tp")}, mesh)
    with pytest.raises(fe.EscaleError, match=r"dimension 1, mesh axis 'tp' already shards"):
        fe.eformer.analyze_sharding_strategy(params, {"w": P("tp", "tp")}, mesh)
    with pytest.raises(fe.EscaleTypeError, match=r"entry 0 of spec P\(3,?\) must be None"):
        fe.eformer.analyze_sharding_strategy(params, {"w": P(3)}, mesh)


def test_analysis_cuts_none_entries_past_the_rank(mesh):
    params = {"w": jax.ShapeDtypeStruct((8, 8), np.float32)}  # 256 B over fsdp x tp = 8
    a = fe.eformer.analyze_sharding_strategy(params, {"w": P("fsdp", "tp", None)}, mesh)
    assert set(a.bytes_per_device.values()) == {32}
    assert a.sharded_parameters == 64


def test_analysis_counts_unconstrained_and_empty_entries_as_replicated(mesh):
    params = {"w": jax.ShapeDtypeStruct((8, 8), np.float32)}
    a = fe.eformer.analyze_sharding_strategy(params, {"w": P(P.UNCONSTRAINED, ())}, mesh)
    assert a.sharded_parameters == 0
    assert set(a.bytes_per_device.values()) == {256}


def test_get_names_reads_spec_entries_whole_and_refuses_bad_ones():
    assert fe.eformer.get_names_from_partition_spec(P("fsdp", ("tp", "sp"))) == [
        "fsdp",
        "sp",
        "tp",
    ]
    assert fe.eformer.get_names_from_partition_spec([P(P.UNCONSTRAINED, "dp")]) == ["dp"]
    with pytest.raises(fe.EscaleTypeError, match=r"entry 1 of P\('dp', 3\) must be None"):
        fe.eformer.get_names_from_partition_spec({"a": P("dp", 3)})


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


CASES = [
    case(
        lambda: fe.eformer.get_names_from_partition_spec(3),
        T,
        "partition_specs",
        "int 3",
        r"PartitionSpec\('fsdp', 'tp'\)",
        id="eformer-get_names-int",
    ),
    case(
        lambda: fe.eformer.analyze_sharding_strategy(params(), "tp", mesh_dp_tp()),
        T,
        "partition_specs",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="analyze-specs-string",
    ),
    case(
        lambda: fe.eformer.analyze_sharding_strategy(params(), {"v": P()}, mesh_dp_tp()),
        fe.EscaleError,
        "partition_specs",
        "{'v': P()}",
        "same keys",
        id="analyze-specs-other-keys",
    ),
    case(
        lambda: fe.eformer.analyze_sharding_strategy(params(), {"w": "tp"}, mesh_dp_tp()),
        T,
        "partition_specs",
        "str 'tp'",
        r"PartitionSpec\('fsdp', 'tp'\)",
        id="analyze-spec-leaf-string",
    ),
    case(
        lambda: fe.eformer.analyze_sharding_strategy("params", P(), mesh_dp_tp()),
        T,
        "pytree",
        "'params'",
        "not its name",
        id="analyze-pytree-string",
    ),
    case(
        lambda: fe.eformer.analyze_sharding_strategy(params(), P(), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="analyze-mesh-string",
    ),
    case(
        lambda: fe.eformer.get_partition_spec({"w": X}),
        fe.EscaleError,
        "tree",
        "ndarray",
        r"jax\.device_put",
        id="eformer-get_partition_spec-numpy",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fe.eformer.extract_shardings("params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="extract_shardings-string",
    ),
    case(
        lambda: fe.eformer.extract_shardings(params(), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="extract_shardings-mesh-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
