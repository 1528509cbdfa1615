"""``LocalChunker`` (``flax_escale/t5x/_chunks.py``): the chunk of each array a process holds, its
shard and replica ids, and its mistakes."""

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.fake_devices import FakeDevice
from support.mistakes import (
    MISTAKE,
    T,
    case,
    mesh_dp_tp,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import create_mesh, t5x
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.t5x import get_gpu_mesh
from flax_escale.t5x._chunks import LocalChunker, LocalChunkInfo, process_blocks


def fake_mesh(owners, names) -> Mesh:
    """A mesh whose device at each position belongs to the process given by `owners`."""
    owners = np.asarray(owners)
    grid = np.empty(owners.shape, dtype=object)
    for i, position in enumerate(np.ndindex(owners.shape)):
        grid[position] = FakeDevice(id=i, process_index=int(owners[position]))
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def blocked_owners(hosts: tuple[int, ...], per_host: tuple[int, ...]) -> np.ndarray:
    """Process of each mesh position when every process owns a `per_host` block."""
    shape = tuple(h * n for h, n in zip(hosts, per_host, strict=True))
    owners = np.empty(shape, dtype=int)
    for position in np.ndindex(shape):
        host = tuple(p // n for p, n in zip(position, per_host, strict=True))
        owners[position] = np.ravel_multi_index(host, hosts)
    return owners


def chunker(mesh: Mesh, process: int) -> LocalChunker:
    return LocalChunker(mesh, process_index=process)


# replica x data x model with 4 processes of 2 devices along model (t5x's example).
T5X_EXAMPLE = fake_mesh(blocked_owners((2, 2, 1), (1, 1, 2)), ("replica", "data", "model"))


# --- where a process sits --------------------------------------------------------------------


def test_num_chunks_and_chunk_ids_follow_the_mesh_order():
    for process in range(4):
        found = chunker(T5X_EXAMPLE, process)
        assert found.num_chunks == {"replica": 2, "data": 2, "model": 1}
        assert list(found.chunk_ids) == ["replica", "data", "model"]
        assert found.chunk_ids == {"replica": process // 2, "data": process % 2, "model": 0}


def test_a_single_process_is_one_chunk_of_everything(devices):
    found = LocalChunker(create_mesh((2, 4), ("data", "model")))
    assert found.process_index == 0
    assert found.num_chunks == {"data": 1, "model": 1}
    assert found.get_local_chunk_info((8, 4), P("data", "model")) == LocalChunkInfo(
        (slice(0, 8), slice(0, 4)), 0
    )


# --- shard and replica ids -------------------------------------------------------------------


def test_shard_id_is_row_major_in_the_order_given():
    for process in range(4):
        replica, data = divmod(process, 2)
        found = chunker(T5X_EXAMPLE, process)
        assert found.get_shard_id(("replica", "data")) == 2 * replica + data
        assert found.get_shard_id(["data", "replica"]) == 2 * data + replica
        assert found.get_shard_id(P(("replica", "data"))) == 2 * replica + data
        assert found.get_shard_id("data") == data
        assert found.get_shard_id(()) == 0


def test_replica_id_counts_along_the_other_axes_in_mesh_order():
    for process in range(4):
        replica, data = divmod(process, 2)
        found = chunker(T5X_EXAMPLE, process)
        assert found.get_replica_id("data") == replica
        assert found.get_replica_id(("model", "replica")) == data
        assert found.get_replica_id(("replica", "data")) == 0
        assert found.get_replica_id(None) == 2 * replica + data


# --- local chunks ----------------------------------------------------------------------------


def test_local_chunk_of_a_dimension_sharded_over_one_axis():
    info = chunker(T5X_EXAMPLE, 3).get_local_chunk_info((8, 6), P("data", "model"))
    # data: chunk 1 of 2; model: one chunk (each process holds all of it); replica: chunk 1.
    assert info == LocalChunkInfo((slice(4, 8), slice(0, 6)), replica_id=1)


def test_local_chunk_of_a_dimension_sharded_over_several_axes():
    mesh = fake_mesh(blocked_owners((2, 2), (1, 2)), ("data", "model"))  # 4 processes x 2
    for process in range(4):
        data, model = divmod(process, 2)
        start = 2 * (2 * data + model)
        info = chunker(mesh, process).get_local_chunk_info([8, 3], [("data", "model")])
        assert info.slice == (slice(start, start + 2), slice(None))


def test_a_short_partition_spec_leaves_the_other_dimensions_whole():
    info = chunker(T5X_EXAMPLE, 2).get_local_chunk_info((4, 6, 2), P("replica"))
    assert info == LocalChunkInfo((slice(2, 4), slice(None), slice(None)), replica_id=0)
    assert chunker(T5X_EXAMPLE, 2).get_local_chunk_info((4, 6), ()) == LocalChunkInfo(
        (slice(None), slice(None)), replica_id=2
    )


def test_chunks_of_a_gpu_mesh_spanning_processes():
    devices = [FakeDevice(id=4 * p + i, process_index=p) for p in range(4) for i in range(4)]
    mesh = get_gpu_mesh(8, devices)  # data 2 (across process pairs), model 8 (2 processes)
    found = chunker(mesh, 3)
    assert found.num_chunks == {"data": 2, "model": 2}
    assert found.chunk_ids == {"data": 1, "model": 1}
    assert found.get_local_chunk_info((4, 16), P("data", "model")).slice == (
        slice(2, 4),
        slice(8, 16),
    )


# --- the property: chunks are what jax puts on the process's devices -------------------------


@st.composite
def layouts(draw):
    rank = draw(st.integers(1, 3))
    hosts = tuple(draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    per_host = tuple(draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank)))
    names = ("replica", "data", "model")[:rank]
    owners = blocked_owners(hosts, per_host)
    grid = np.empty(owners.shape, dtype=object)
    ids = draw(st.permutations(range(owners.size)))  # ids play no part in chunking
    for i, position in enumerate(np.ndindex(owners.shape)):
        grid[position] = FakeDevice(id=ids[i], process_index=int(owners[position]))
    mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * rank)

    array_rank = draw(st.integers(1, 3))
    unused = list(draw(st.permutations(names)))
    entries = []
    for _ in range(array_rank):
        take = draw(st.integers(0, len(unused)))
        axes, unused = tuple(unused[:take]), unused[take:]
        if len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(axes or None)
    shape = tuple(
        math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
        * draw(st.integers(1, 3))
        for e in entries
    )
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()  # a spec shorter than the rank
    return mesh, P(*entries), shape


def _flat(spec: P) -> list[str]:
    return [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]


def _is_one_box(held: np.ndarray) -> bool:
    nonzero = np.nonzero(held)
    box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in nonzero)
    return bool(held[box].all())


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_local_chunk_is_exactly_the_process_device_shards(layout):
    mesh, spec, shape = layout
    indices = NamedSharding(mesh, spec).devices_indices_map(shape)
    replicas_by_slice = defaultdict(list)
    for process in process_blocks(mesh.devices):
        expected = np.zeros(shape, dtype=bool)
        for device, index in indices.items():
            if device.process_index == process:
                expected[index] = True
        if not _is_one_box(expected):
            with pytest.raises(MeshError, match="not one slice"):
                chunker(mesh, process).get_local_chunk_info(shape, spec)
            continue
        info = chunker(mesh, process).get_local_chunk_info(shape, spec)
        held = np.zeros(shape, dtype=bool)
        held[info.slice] = True
        np.testing.assert_array_equal(held, expected)
        key = tuple(s.indices(n) for s, n in zip(info.slice, shape, strict=True))
        replicas_by_slice[key].append(info.replica_id)
    for replicas in replicas_by_slice.values():
        assert sorted(replicas) == list(range(len(replicas)))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_shard_ids_cover_every_shard_once_per_replica(layout):
    mesh, spec, _ = layout
    sharded = _flat(spec)
    shards_of_replica = defaultdict(list)
    for process in process_blocks(mesh.devices):
        found = chunker(mesh, process)
        shards_of_replica[found.get_replica_id(sharded)].append(found.get_shard_id(sharded))
    num_shards = math.prod(chunker(mesh, 0).num_chunks[a] for a in sharded)
    num_replicas = len(process_blocks(mesh.devices)) // num_shards
    assert sorted(shards_of_replica) == list(range(num_replicas))
    for shard_ids in shards_of_replica.values():
        assert sorted(shard_ids) == list(range(num_shards))


# --- errors ----------------------------------------------------------------------------------


def test_rejects_a_process_whose_devices_are_not_one_block():
    mesh = fake_mesh([[0, 1, 0, 1]], ("data", "model"))
    with pytest.raises(
        MeshError,
        match=r"the devices of process\(es\) \[0, 1\] do not form one contiguous block of the "
        r"mesh \{'data': 1, 'model': 4\}",
    ):
        chunker(mesh, 0)


def test_rejects_processes_with_blocks_of_different_shapes():
    mesh = fake_mesh([[0, 1, 1], [0, 2, 2]], ("data", "model"))
    with pytest.raises(
        MeshError,
        match=r"blocks of different shapes .*: \{0: \(2, 1\), 1: \(1, 2\), 2: \(1, 2\)\}",
    ):
        chunker(mesh, 1)


def test_rejects_a_process_without_devices_in_the_mesh():
    with pytest.raises(
        MeshError,
        match=r"process 5 has no device in the mesh \{'replica': 2, 'data': 2, 'model': 2\}, "
        r"whose devices belong to processes \[0, 1, 2, 3\]",
    ):
        chunker(T5X_EXAMPLE, 5)


def test_rejects_what_is_not_a_mesh():
    abstract = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(EscaleTypeError, match=r"LocalChunker needs a jax\.sharding\.Mesh"):
        LocalChunker(abstract)


def test_rejects_several_axes_whose_process_part_is_not_one_slice():
    mesh = fake_mesh(blocked_owners((2, 1), (2, 2)), ("replica", "data"))  # 2 processes
    with pytest.raises(
        MeshError,
        match=r"sharded over \('data', 'replica'\), of which a process's devices hold "
        r"\{'data': 2, 'replica': 2\} positions: 'replica' is split across processes but comes "
        r"after 'data'.*Order the axes as \('replica', 'data'\)",
    ):
        chunker(mesh, 1).get_local_chunk_info((8,), P(("data", "replica")))
    assert chunker(mesh, 1).get_local_chunk_info((8,), P(("replica", "data"))).slice == (
        slice(4, 8),
    )
    mesh = fake_mesh(blocked_owners((2, 2), (2, 2)), ("a", "b"))
    with pytest.raises(MeshError, match=r"Shard the dimension over fewer of them: \['a', 'b'\]"):
        chunker(mesh, 0).get_local_chunk_info((16,), P(("a", "b")))


def test_rejects_more_mesh_axes_than_dimensions():
    with pytest.raises(
        MeshError,
        match=r"has 3 entries, but the array of shape \(4, 4\) has 2 dimensions",
    ):
        chunker(T5X_EXAMPLE, 0).get_local_chunk_info((4, 4), P("data", None, "model"))


def test_rejects_an_axis_that_is_not_in_the_mesh():
    found = chunker(T5X_EXAMPLE, 0)
    message = r"mesh axis 'tp' is not in the mesh .*; use one of \('replica', 'data', 'model'\)"
    with pytest.raises(MeshError, match="mesh_axes: " + message):
        found.get_local_chunk_info((4,), P(("data", "tp")))
    with pytest.raises(MeshError, match="sharded_mesh_axes: " + message):
        found.get_shard_id("tp")
    with pytest.raises(MeshError, match="sharded_mesh_axes: " + message):
        found.get_replica_id(("data", "tp"))


def test_rejects_an_axis_used_twice():
    found = chunker(T5X_EXAMPLE, 0)
    with pytest.raises(MeshError, match="mesh axis 'data' appears more than once"):
        found.get_local_chunk_info((4, 4), P("data", "data"))
    with pytest.raises(MeshError, match="mesh axis 'data' appears more than once"):
        found.get_shard_id(("data", "data"))


def test_rejects_a_dimension_not_divisible_by_its_chunks():
    with pytest.raises(
        MeshError,
        match=r"dimension 1 of the array of shape \(4, 6\) has size 6 and is sharded over "
        r"\('replica', 'data'\), which the processes cut into 4 chunks .*Pad the dimension",
    ):
        chunker(T5X_EXAMPLE, 0).get_local_chunk_info((4, 6), P(None, ("replica", "data")))


@pytest.mark.parametrize(
    ("mesh_axes", "message"),
    [
        ("data", "got the string 'data'"),
        (
            P(3),
            r"mesh_axes\[0\] must be None, a mesh axis name, or a tuple or list of mesh axis "
            r"names; got int 3",
        ),
        (P(None, ("data", 3)), r"mesh_axes\[1\] must be None, .*got tuple \('data', 3\)"),
        (P(P.UNCONSTRAINED), r"mesh_axes\[0\] is PartitionSpec.UNCONSTRAINED, which fixes no"),
        (3, "mesh_axes must be a PartitionSpec or a tuple or list of entries, .*got int 3"),
    ],
)
def test_rejects_mesh_axes_of_the_wrong_type(mesh_axes, message):
    with pytest.raises(EscaleTypeError, match=message):
        chunker(T5X_EXAMPLE, 0).get_local_chunk_info((4,), mesh_axes)


def test_rejects_sharded_mesh_axes_of_the_wrong_type():
    found = chunker(T5X_EXAMPLE, 0)
    with pytest.raises(EscaleTypeError, match=r"sharded_mesh_axes must be None, .*got int 3"):
        found.get_shard_id(3)
    with pytest.raises(EscaleTypeError, match=r"sharded_mesh_axes\[1\] must be None, .*got int"):
        found.get_replica_id(("data", 3))
    with pytest.raises(EscaleTypeError, match=r"sharded_mesh_axes\[0\] is .*UNCONSTRAINED"):
        found.get_shard_id(P(P.UNCONSTRAINED))


def test_trailing_entries_past_the_rank_that_name_no_axis_are_cut():
    found = chunker(T5X_EXAMPLE, 0)
    short = found.get_local_chunk_info((4, 4), P("data"))
    assert found.get_local_chunk_info((4, 4), P("data", None, None)) == short
    assert found.get_local_chunk_info((4, 4), ["data", None, ()]) == short


CASES = [
    # --- the chunker and t5x's mesh builders and data layout ------------------------------
    case(
        lambda: t5x.LocalChunker("dp:8"),
        T,
        "global_mesh",
        "'dp:8'",
        r"create_mesh\(",
        id="LocalChunker-mesh-string",
    ),
    case(
        lambda: t5x.LocalChunker(mesh_dp_tp(), process_index="0"),
        T,
        "process_index",
        "'0'",
        "pass the int 0",
        id="LocalChunker-process-string",
    ),
    case(
        lambda: t5x.LocalChunker(mesh_dp_tp()).get_local_chunk_info(8, ("dp",)),
        T,
        "global_shape",
        "int 8",
        r"pass \(8,\)",
        id="get_local_chunk_info-shape-int",
    ),
    case(
        lambda: t5x.LocalChunker(mesh_dp_tp()).get_local_chunk_info((8, 4), "dp"),
        T,
        "mesh_axes",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="get_local_chunk_info-axes-string",
    ),
    case(
        lambda: t5x.LocalChunker(mesh_dp_tp()).get_local_chunk_info((8, 4), ("model",)),
        fe.MeshError,
        "mesh_axes",
        "'model'",
        r"use one of \('dp', 'tp'\)",
        id="get_local_chunk_info-unknown-axis",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
