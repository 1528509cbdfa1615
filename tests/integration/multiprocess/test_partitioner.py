"""The Partitioner's data layout across 2 real processes x 4 devices."""

import numpy as np
import pytest
from support.distributed import run_processes

pytestmark = pytest.mark.multiprocess

CODE = """
import numpy as np
import jax
from jax.sharding import NamedSharding
import flax_escale as fe
from flax_escale.t5x import Partitioner

BATCH = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)


def case(dims, batch_axis, dcn=None):
    mesh = fe.create_mesh(dims, dcn_mesh_dims=dcn)
    rules = fe.PartitionAxis(batch_axis=batch_axis)
    partitioner = Partitioner(mesh=mesh, logical_axis_rules=rules)
    try:
        layout = partitioner.get_data_layout(16)
    except fe.EscaleError as error:
        return {"error": str(error)}
    other = partitioner.get_data_layout(16, host_index=1 - jax.process_index())
    # Load only this process's part, as a data pipeline would, and run a partitioned step.
    rows = 16 // layout.num_shards
    local = BATCH[layout.shard_id * rows : (layout.shard_id + 1) * rows]
    sharding = NamedSharding(mesh, partitioner.data_partition_spec)
    batch = fe.host_local_to_global(local, sharding, BATCH.shape)
    spec = partitioner.data_partition_spec
    step = partitioner.partition(lambda x: (2 * x).sum(axis=0), spec, None)
    chunk = partitioner.get_local_chunk_info(BATCH.shape, (spec[0], None))
    return {
        "layout": [layout.shard_id, layout.num_shards, layout.is_first_host_in_replica_set],
        "other": [other.shard_id, other.num_shards, other.is_first_host_in_replica_set],
        "shards": [partitioner.data_shards, partitioner.data_shard_id],
        "chunk_rows": [chunk.slice[0].start, chunk.slice[0].stop, chunk.replica_id],
        "sum": np.asarray(step(batch).addressable_data(0)).tolist(),
    }


result = {
    # dp spans the processes and comes first in the batch axes: each process loads one half.
    "dp_first": case((2, 4, 1, 1, 1), ("dp", "fsdp")),
    # The default batch axes put fsdp (inside a process) first: rows interleave across processes.
    "fsdp_first": case((2, 4, 1, 1, 1), ("fsdp", "dp")),
    # Only tp spans the processes: both load the whole batch, process 0 first of the two.
    "tp_across": case((1, 4, 1, 2, 1), ("fsdp", "dp"), dcn=(1, 1, 1, 2, 1)),
}
"""

EXPECTED_SUM = (2 * np.arange(16 * 4, dtype=np.float32).reshape(16, 4)).sum(axis=0).tolist()


@pytest.fixture(scope="module")
def results():
    return run_processes(CODE)


def test_process_spanning_axis_first_gives_one_half_each(results):
    for rank, result in enumerate(results):
        case = result["dp_first"]
        assert case["layout"] == [rank, 2, True]
        assert case["other"] == [1 - rank, 2, True]
        assert case["shards"] == [2, rank]
        assert case["chunk_rows"] == [8 * rank, 8 * rank + 8, 0]
        assert case["sum"] == EXPECTED_SUM


def test_interleaved_rows_are_refused_with_the_fix(results):
    for rank, result in enumerate(results):
        error = result["fsdp_first"]["error"]
        assert f"process {rank} holds rows" in error
        assert "not one contiguous range" in error
        assert "Put the process-spanning mesh axes first" in error


def test_replicas_across_processes_load_the_same_part(results):
    for rank, result in enumerate(results):
        case = result["tp_across"]
        assert case["layout"] == [0, 1, rank == 0]
        assert case["other"] == [0, 1, rank == 1]
        assert case["shards"] == [1, 0]
        assert case["chunk_rows"] == [0, 16, rank]
        assert case["sum"] == EXPECTED_SUM
