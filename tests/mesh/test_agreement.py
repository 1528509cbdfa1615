"""assert_same_mesh: processes that built different meshes get a clear error, never a hang."""

import jax
import pytest
from support.distributed import run_processes
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import mesh as fem
from flax_escale.mesh._agreement import assert_same_mesh

# Each call reports its MeshError text instead of raising, so that every process still reaches
# jax.distributed.shutdown and the test sees what all of them said. The seconds are a hang bound.
CHECK = """
import time
import numpy as np
from jax._src import distributed
from jax.sharding import Mesh
from flax_escale import MeshError, create_mesh
from flax_escale.mesh._agreement import assert_same_mesh


def check(mesh, timeout=30):
    start = time.monotonic()
    try:
        assert_same_mesh(mesh, timeout=timeout)
        error = None
    except MeshError as e:
        error = str(e)
    return {"error": error, "seconds": time.monotonic() - start}


me = jax.process_index()
client = distributed.global_state.client
# Imports can take seconds longer on one process of a loaded machine: line up before the calls
# so that their timeouts only measure assert_same_mesh.
client.wait_at_barrier("imported", 120_000)
"""

# A generous bound on each call: far above its timeout, far below "hung".
HANG_BOUND = 120


def test_one_process_has_nothing_to_compare(devices):
    assert assert_same_mesh(fe.create_mesh((1, 8, 1, 1, 1)), timeout=0.001) is None


def test_arguments_are_checked(devices):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(
        fe.EscaleTypeError, match=r"mesh must be a concrete jax\.sharding\.Mesh, got AbstractMesh"
    ):
        assert_same_mesh(mesh.abstract_mesh)
    with pytest.raises(fe.MeshError, match="timeout must be positive seconds, got 0"):
        assert_same_mesh(mesh, timeout=0)


def test_several_processes_without_jax_distributed_is_a_clear_error(devices, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        fe.MeshError, match=r"jax\.process_count\(\) is 2 but jax\.distributed is not"
    ):
        assert_same_mesh(fe.create_mesh((1, 8, 1, 1, 1)))


@pytest.mark.multiprocess
def test_processes_that_agree_pass_call_after_call():
    first, second = run_processes(
        CHECK
        + """
result = [
    check(create_mesh((1, 8, 1, 1, 1))),
    check(create_mesh((2, 2, 1, 2, 1), axis_types="explicit")),
    check(create_mesh((1, 8, 1, 1, 1))),
]
client.wait_at_barrier("all_checked", 60_000)
result.append(sorted(key for key, _ in client.key_value_dir_get("flax_escale/assert_same_mesh")))
"""
    )
    for *calls, keys in (first, second):
        assert [call["error"] for call in calls] == [None, None, None]
        assert all(call["seconds"] < HANG_BOUND for call in calls)
        # Each call drops the keys of the one before, so the store does not grow.
        assert keys == ["flax_escale/assert_same_mesh/2/0", "flax_escale/assert_same_mesh/2/1"]


@pytest.mark.multiprocess
def test_processes_that_disagree_all_get_the_same_clear_error():
    results = run_processes(
        CHECK
        + """
devices = np.array(jax.devices())
swapped = devices[[1, 0, *range(2, 8)]]
result = [
    check(create_mesh((1, 8, 1, 1, 1) if me == 0 else (2, 4, 1, 1, 1))),
    check(create_mesh((2, 4), ("dp", "tp"), axis_types="auto" if me == 0 else "explicit")),
    check(Mesh((devices if me == 0 else swapped).reshape(2, 4), ("dp", "tp"))),
    check(create_mesh((2, 4), ("dp", "tp"))),
]
"""
    )
    shape, types, order, agreed = zip(*results, strict=True)
    for call in (*shape, *types, *order, *agreed):
        assert call["seconds"] < HANG_BOUND
    for calls in (shape, types, order):
        assert calls[0]["error"] == calls[1]["error"], "every process must say the same"
    auto5 = "(Auto, Auto, Auto, Auto, Auto)"
    assert shape[0]["error"].startswith(
        "assert_same_mesh: the processes built different meshes: process 0 built "
        f"{{'dp': 1, 'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1}} {auto5}; process 1 built "
        f"{{'dp': 2, 'fsdp': 4, 'ep': 1, 'tp': 1, 'sp': 1}} {auto5}. They differ in shape. "
        "Build the mesh from the same arguments on every process"
    )
    assert (
        "process 0 built {'dp': 2, 'tp': 4} (Auto, Auto); process 1 built {'dp': 2, 'tp': 4} "
        "(Explicit, Explicit). They differ in axis types." in types[0]["error"]
    )
    assert (
        "They differ in the order of their devices: at mesh position (0, 0), process 0 placed "
        "device 0 and process 1 placed device 1." in order[0]["error"]
    )
    assert [call["error"] for call in agreed] == [None, None], "later calls still pair up"


@pytest.mark.multiprocess
def test_a_process_that_never_calls_is_named_after_the_timeout():
    first, second = run_processes(
        CHECK
        + """
mesh = create_mesh((1, 8, 1, 1, 1))
result = check(mesh, timeout=5) if me == 0 else None
"""
    )
    assert second is None
    assert first["error"] == (
        "assert_same_mesh: no mesh from process 1 within 5 s (only from process 0); process 1 "
        "may have crashed or not reached the same assert_same_mesh call. Every process must "
        "call assert_same_mesh at the same points of the program; look for an earlier error on "
        "the missing ones."
    )
    assert first["seconds"] < HANG_BOUND


@pytest.mark.multiprocess
def test_init_sharded_on_disagreeing_meshes_fails_on_every_process():
    results = run_processes(
        CHECK
        + """
import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
import flax_escale as fe

dims = (1, 8, 1, 1, 1) if me == 0 else (2, 4, 1, 1, 1)
mesh = create_mesh(dims)
result = {}
try:
    fe.init_sharded(nn.Dense(8), mesh, jax.random.key(0), jnp.ones((2, 4)))
except MeshError as e:
    result["linen"] = str(e)
try:
    fe.init_sharded(lambda rngs: nnx.Linear(4, 8, rngs=rngs), mesh, 0)
except MeshError as e:
    result["nnx"] = str(e)
"""
    )
    for result in results:
        for api in ("linen", "nnx"):
            assert "process 0 built {'dp': 1, 'fsdp': 8" in result[api]
            assert "process 1 built {'dp': 2, 'fsdp': 4" in result[api]


CASES = [
    case(
        lambda: fem.assert_same_mesh("dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "create_mesh",
        id="assert_same_mesh-string",
    ),
    case(
        lambda: fem.assert_same_mesh(mesh_dp_tp(), timeout="1"),
        T,
        "timeout",
        "'1'",
        "pass e.g. 60",
        id="assert_same_mesh-timeout-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
