"""create_mesh across real processes: 2 processes x 4 CPU devices on loopback."""

import pytest
from support.distributed import run_processes

pytestmark = pytest.mark.multiprocess

SNIPPET = """
import numpy as np
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from flax_escale import create_mesh

mesh = create_mesh({dims})
processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
local = np.arange(4.0) + 4 * jax.process_index()
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(mesh.axis_names)), local)
total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
result = {{
    "shape": dict(mesh.shape),
    "ids": np.asarray(mesh.device_ids).tolist(),
    "processes": processes.tolist(),
    "same_object": create_mesh({dims}) is mesh,
    "total": total,
}}
"""


def test_fsdp_mesh_splits_across_hosts_on_the_outer_part():
    results = run_processes(SNIPPET.format(dims=(1, -1, 1, 1, 1)))
    first, second = results
    assert first["shape"] == {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
    assert first["ids"] == second["ids"], "every process must build the same mesh"
    fsdp_hosts = [row[0][0][0] for row in first["processes"][0]]
    assert fsdp_hosts == [0, 0, 0, 0, 1, 1, 1, 1]
    assert first["same_object"]
    assert first["total"] == second["total"] == float(sum(range(8)))


def test_hybrid_mesh_keeps_tensor_parallel_inside_a_host():
    first, second = run_processes(SNIPPET.format(dims=(2, 2, 1, 2, 1)))
    assert first["ids"] == second["ids"]
    dp_rows = first["processes"]
    assert all(host == 0 for host in _flatten(dp_rows[0]))
    assert all(host == 1 for host in _flatten(dp_rows[1]))


def _flatten(nested):
    if isinstance(nested, list):
        return [item for sub in nested for item in _flatten(sub)]
    return [nested]
