import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.distributed import run_processes
from support.mistakes import MISTAKE, T, X, case, dp_batch, mesh5, raises_a_library_error

import flax_escale as fe


def test_batch_sharding_resolves_batch_and_sequence():
    mesh = fe.create_mesh((2, 2, 1, 1, 2))
    assert fe.batch_sharding(mesh, (8, 16)).spec == P(("fsdp", "dp"), "sp")
    assert fe.batch_sharding(mesh, (8, 16, 4)).spec == P(("fsdp", "dp"), "sp", None)
    custom = fe.batch_sharding(mesh, (8, 4), ("batch", None), rules=[("batch", "dp")])
    assert custom.spec == P("dp", None)
    assert fe.batch_sharding(mesh, (8, 4), ["batch"]).spec == P(("fsdp", "dp"), None)


def test_a_batch_the_data_axes_do_not_divide_warns_or_raises():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    message = (
        r"(?s)logical axes \('batch', 'sequence'\) with shape \(12, 4\) on mesh \{'dp': 1, "
        r"'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1\} resolve to P\(None, 'sp'\).*dimension 0 "
        r"\(batch\): size 12 is not divisible"
    )
    with pytest.warns(fe.ShardingCorrectionWarning, match=message):
        sharding = fe.batch_sharding(mesh, (12, 4))
    assert sharding.spec == P(None, "sp")  # the whole batch on every device, said out loud
    with pytest.raises(fe.ShardingResolutionError, match=message):
        fe.batch_sharding(mesh, (12, 4), strict=True)


def test_a_sequence_the_sequence_axis_does_not_divide_warns():
    mesh = fe.create_mesh((2, 2, 1, 1, 2))
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"(?s)dimension 1 \(sequence\): size 3"):
        assert fe.batch_sharding(mesh, (8, 3)).spec == P(("fsdp", "dp"), None)
    with pytest.raises(fe.ShardingResolutionError, match=r"shape \(8, 3\)"):
        fe.batch_sharding(mesh, (8, 3), strict=True)


def test_batch_sharding_argument_errors():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(fe.EscaleTypeError, match=r"logical_axes must be a sequence .*'batch'"):
        fe.batch_sharding(mesh, (8, 4), "batch")
    with pytest.raises(fe.ShardingResolutionError, match="name 3 dimensions"):
        fe.batch_sharding(mesh, (8, 4), ("batch", None, None))
    with pytest.warns(fe.ShardingCorrectionWarning, match="'frames' has no rule"):
        fe.batch_sharding(mesh, (8, 4), ("batch", "frames"))


def test_single_process_round_trip_is_exact():
    mesh = fe.create_mesh((2, 4, 1, 1, 1))
    sharding = fe.batch_sharding(mesh, (16, 4))
    assert fe.process_batch_slice(sharding, (16, 4)) == slice(0, 16)
    data = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    batch = fe.host_local_to_global(data, sharding, (16, 4))
    assert batch.sharding == sharding
    assert batch.addressable_shards[0].data.shape == (2, 4)
    np.testing.assert_array_equal(fe.global_to_host_local(batch), data)
    tree = fe.host_local_to_global({"x": data, "y": data * 2}, sharding, (16, 4))
    np.testing.assert_array_equal(fe.global_to_host_local(tree["y"]), data * 2)


def test_global_to_host_local_needs_a_named_sharding():
    with pytest.raises(fe.EscaleError, match="NamedSharding"):
        fe.global_to_host_local(jax.device_put(np.zeros(4), jax.devices()[0]))
    assert isinstance(fe.batch_sharding(fe.create_mesh((1, 8, 1, 1, 1)), (8,)), NamedSharding)


SNIPPET = """
import numpy as np
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import flax_escale as fe

mesh = fe.create_mesh({dims})
shape = (16, 4)
full = np.arange(64, dtype=np.float32).reshape(shape)
sharding = fe.batch_sharding(mesh, shape, rules={rules})
rows = fe.process_batch_slice(sharding, shape)
batch = fe.host_local_to_global(full[rows], sharding, shape)
total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(batch))
back = fe.global_to_host_local(batch)
result = {{
    "rows": [rows.start, rows.stop],
    "total": total,
    "back_equal": bool(np.array_equal(back, full[rows])),
    "spec": str(batch.sharding.spec),
}}
"""


@pytest.mark.multiprocess
def test_each_process_loads_its_rows_and_the_global_batch_is_whole():
    first, second = run_processes(SNIPPET.format(dims=(1, 8, 1, 1, 1), rules=None))
    assert first["rows"] == [0, 8]
    assert second["rows"] == [8, 16]
    for result in (first, second):
        assert result["total"] == float(sum(range(64)))
        assert result["back_equal"]


@pytest.mark.multiprocess
def test_data_parallel_across_hosts_needs_dp_first_in_the_batch_axes():
    # dp spans the two processes: with dp first in the batch axes, each process's rows are
    # one contiguous range of the global batch.
    rules = [("batch", ("dp", "fsdp")), ("sequence", "sp")]
    first, second = run_processes(SNIPPET.format(dims=(2, 2, 1, 2, 1), rules=rules))
    assert {tuple(first["rows"]), tuple(second["rows"])} == {(0, 8), (8, 16)}
    assert first["total"] == second["total"] == float(sum(range(64)))
    assert first["back_equal"]
    assert second["back_equal"]


@pytest.mark.multiprocess
def test_interleaved_rows_are_refused_with_a_clear_message():
    with pytest.raises(AssertionError, match="not one contiguous range"):
        run_processes(SNIPPET.format(dims=(2, 2, 1, 2, 1), rules=None))


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.batch_sharding(None, (8, 4)),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="batch_sharding-mesh-none",
    ),
    case(
        lambda: fe.batch_sharding(mesh5(), 16),
        T,
        "shape",
        "int 16",
        r"pass \(16,\)",
        id="batch_sharding-shape-int",
    ),
    case(
        lambda: fe.batch_sharding(mesh5(), X),
        T,
        "shape",
        "shape (8, 4)",
        r"pass its \.shape",
        id="batch_sharding-shape-array",
    ),
    case(
        lambda: fe.batch_sharding(mesh5(), (-8, 4)),
        fe.EscaleError,
        "shape",
        "-8",
        "at least 0",
        id="batch_sharding-shape-negative",
    ),
    case(
        lambda: fe.process_batch_slice(P("dp"), (8, 4)),
        T,
        "sharding",
        "P('dp',)",
        r"NamedSharding\(mesh, P\('dp',\)\)",
        id="process_batch_slice-partition-spec",
    ),
    case(
        lambda: fe.process_batch_slice(dp_batch(), "16"),
        T,
        "global_shape",
        "'16'",
        r"\(16, 128\)",
        id="process_batch_slice-shape-string",
    ),
    case(
        lambda: fe.process_batch_slice(dp_batch(), ()),
        fe.EscaleError,
        "global_shape",
        "()",
        "batch dimension",
        id="process_batch_slice-shape-empty",
    ),
    case(
        lambda: fe.process_batch_slice(dp_batch(), (8, 4), process_index="0"),
        T,
        "process_index",
        "'0'",
        "pass the int 0",
        id="process_batch_slice-process-string",
    ),
    case(
        lambda: fe.host_local_to_global(X, None, (8, 4)),
        T,
        "sharding",
        "None",
        r"NamedSharding\(mesh, spec\)",
        id="host_local_to_global-sharding-none",
    ),
    case(
        lambda: fe.host_local_to_global(None, dp_batch(), (8, 4)),
        T,
        "local",
        "None",
        "pytree of arrays",
        id="host_local_to_global-local-none",
    ),
    case(
        lambda: fe.host_local_to_global(X, dp_batch(), (8, 5)),
        fe.EscaleError,
        "global_shape",
        "(8, 5)",
        "process_batch_slice",
        id="host_local_to_global-shape-mismatch",
    ),
    case(
        lambda: fe.host_local_to_global(X, dp_batch(), (8,)),
        fe.EscaleError,
        "global_shape",
        "(8,)",
        "full shape",
        id="host_local_to_global-rank-mismatch",
    ),
    case(
        lambda: fe.global_to_host_local(X),
        T,
        "array",
        "numpy array of shape (8, 4)",
        "host_local_to_global",
        id="global_to_host_local-numpy",
    ),
    case(
        lambda: fe.global_to_host_local(None),
        T,
        "array",
        "None",
        r"jax\.Array",
        id="global_to_host_local-none",
    ),
    case(
        lambda: fe.process_batch_slice(NamedSharding(mesh5(), P("fsdp", None, None)), (16,)),
        fe.EscaleError,
        "sharding",
        "has 3 entries for the 1 dimensions of shape (16,)",
        "at most one entry per dimension",
        id="process_batch_slice-spec-longer-than-shape",
    ),
    case(
        lambda: fe.process_batch_slice(NamedSharding(mesh5(), P("fsdp")), (10,)),
        fe.EscaleError,
        "sharding",
        "splits dimension 0 of shape (10,) into 4 parts",
        "mesh axes divide each dimension",
        id="process_batch_slice-indivisible",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
