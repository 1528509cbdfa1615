"""Checkpoints across 2 real processes x 4 devices, restored onto another mesh bit for bit."""

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.distributed import run_processes

import flax_escale as fe

pytestmark = pytest.mark.multiprocess

# The values every process (and the single-process save) starts from, as plain numpy, so that
# each process can tell which bytes its shards must hold. Ranks 0 to 3, float32, bfloat16, int32.
VALUES = """
import ml_dtypes
import numpy as np

_rng = np.random.default_rng(0)
VALUES = {
    "kernel": _rng.standard_normal((16, 8)).astype(np.float32),
    "embedding": _rng.standard_normal((8, 4, 6)).astype(ml_dtypes.bfloat16),
    "ids": (np.arange(8 * 3 * 2 * 4, dtype=np.int32).reshape(8, 3, 2, 4) * 7919 - 100_000),
    "bias": _rng.standard_normal(8).astype(np.float32),
    "step": np.asarray(12345, dtype=np.int32),
}
SAVE_SPECS = {  # on create_mesh((1, 8, 1, 1, 1))
    "kernel": P("fsdp"),
    "embedding": P(None, None, None),
    "ids": P("fsdp", None, None, None),
    "bias": P("fsdp"),
    "step": P(),
}
RESTORE_SPECS = {  # on create_mesh((2, 2, 1, 2, 1)): dp spans the processes
    "kernel": P("tp", ("dp", "fsdp")),
    "embedding": P("dp", "tp", None),
    "ids": P(None, None, "fsdp", ("dp", "tp")),
    "bias": P(("fsdp", "tp")),
    "step": P(),
}
"""

SNIPPET = (
    """
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import flax_escale as fe
"""
    + VALUES
    + """

def sharded(mesh, specs):
    return {
        name: jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, specs[name]), lambda index, v=value: v[index]
        )
        for name, value in VALUES.items()
    }


def same_bits(got, want):
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def check_restored(path):
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    target = {
        name: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                   sharding=NamedSharding(mesh, RESTORE_SPECS[name]))
        for name, value in VALUES.items()
    }
    restored = fe.restore_checkpoint(path, target)
    report = {}
    for name, array in restored.items():
        want = VALUES[name]
        report[name] = {
            "sharding": array.sharding.is_equivalent_to(target[name].sharding, want.ndim),
            "fully_addressable": array.is_fully_addressable,
            "shards": [same_bits(s.data, want[s.index]) for s in array.addressable_shards],
            "gathered": same_bits(multihost_utils.process_allgather(array, tiled=True), want),
        }
    return report
"""
)


def _values() -> dict:
    namespace: dict = {"P": P}
    exec(VALUES, namespace)
    return namespace


def _assert_restored_exactly(report: dict) -> None:
    assert set(report) == {"kernel", "embedding", "ids", "bias", "step"}
    for name, checks in report.items():
        assert checks["sharding"], f"{name} is not in its target sharding"
        assert not checks["fully_addressable"], f"{name} should span both processes"
        assert checks["shards"] == [True] * 4, f"{name}: wrong bytes in a local shard"
        assert checks["gathered"], f"{name}: gathered value differs from the original"


def test_two_processes_save_and_restore_onto_another_mesh(tmp_path):
    results = run_processes(
        f"path = {str(tmp_path / 'ckpt')!r}\n"
        + SNIPPET
        + """
fe.save_checkpoint(path, sharded(fe.create_mesh((1, 8, 1, 1, 1)), SAVE_SPECS))
# Replaced: the save's record lists the files of both processes, or force=True would refuse.
fe.save_checkpoint(path, sharded(fe.create_mesh((1, 8, 1, 1, 1)), SAVE_SPECS), force=True)
result = check_restored(path)
"""
    )
    for report in results:
        _assert_restored_exactly(report)


def test_a_single_process_checkpoint_restores_onto_two_processes(tmp_path, devices):
    values = _values()
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    tree = {
        name: jax.device_put(value, NamedSharding(mesh, values["SAVE_SPECS"][name]))
        for name, value in values["VALUES"].items()
    }
    fe.save_checkpoint(tmp_path / "ckpt", tree)
    results = run_processes(SNIPPET + f"\nresult = check_restored({str(tmp_path / 'ckpt')!r})\n")
    for report in results:
        _assert_restored_exactly(report)


# TensorStore counts the bytes it reads from files: per process, that shows which of the stored
# chunks (the shards as saved, 128-row blocks here) a restore touched.
READS = """
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P
import flax_escale as fe


def bytes_read():
    return sum(
        value["value"]
        for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/")
        if metric["name"].endswith("/bytes_read")
        for value in metric["values"]
    )


value = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
saved = NamedSharding(fe.create_mesh((1, 8, 1, 1, 1)), P("fsdp"))
fe.save_checkpoint(path, {"w": jax.make_array_from_callback(value.shape, saved, value.__getitem__)})
mesh = fe.create_mesh((2, 2, 1, 2, 1))
result = {}
for name, spec in [("all rows", P()), ("half the rows", P("dp"))]:
    target = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    before = bytes_read()
    fe.restore_checkpoint(path, {"w": target})
    result[name] = bytes_read() - before
"""


def test_each_process_reads_only_the_stored_chunks_its_shards_overlap(tmp_path):
    for read in run_processes(f"path = {str(tmp_path / 'ckpt')!r}\n" + READS):
        # Half the chunks plus a little metadata, not the whole array.
        assert 0 < read["half the rows"] < 0.6 * read["all rows"], read
