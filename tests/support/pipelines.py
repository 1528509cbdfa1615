"""What the pipeline tests share: the rules, their meshes, weights gathered at use, and the
comparison of a pipelined result with a scanned one."""

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flax_escale as fe

RULES = fe.PartitionAxis(pipeline_parallel_axis="pp")
"""Layers on pp, and pp in the batch outside the pipeline."""


def mesh_of(text: str, axis_types: str | None = None) -> jax.sharding.Mesh:
    """The mesh ``text`` names (``"pp:2,fsdp:4"``), with the rules' six axes."""
    return fe.parse_mesh_from_string(
        text, RULES.mesh_axis_names, partial=True, axis_types=axis_types
    )


def at_use(weight: jax.Array) -> jax.Array:
    """``weight`` whole where it is used, on an Explicit mesh (whose matmuls refuse an fsdp
    kernel against an fsdp batch); on an Auto mesh, as XLA places it."""
    if AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types:
        return jax.sharding.reshard(weight, P())
    return weight


def assert_close(got, want):
    """Equal trees at rtol 1e-5, entries near zero compared at 1e-5 of their array's largest."""

    def close(g, w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))

    jax.tree.map(close, got, want)


def assert_born_on_stages(stack: list[jax.Array], mesh: jax.sharding.Mesh, layers: int):
    """Each device holds layers / p of every stacked array, and its bytes are the stack's over
    p times the other axes' share."""
    p = mesh.shape["pp"]
    held = total = 0
    for leaf in stack:
        assert leaf.sharding.spec[0] == "pp", leaf.sharding
        assert leaf.addressable_shards[0].data.shape[0] == layers // p
        others = [a for entry in leaf.sharding.spec[1:] for a in _axes(entry)]
        held += leaf.addressable_shards[0].data.nbytes
        total += leaf.nbytes / (p * np.prod([mesh.shape[a] for a in others]))
    assert held == total


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


QUICK_COMPILE = {"xla_backend_optimization_level": 0}
"""``jax.jit``'s compiler options for the equality tests: XLA:CPU compiles in about half the
time, and both sides of each comparison are compiled alike."""


def layers_whole(stack, mesh: jax.sharding.Mesh):
    """``stack`` with its layers dimension unsharded (on an Explicit mesh JAX scans only over an
    unsharded dimension): the scanned reference's copy of a pipeline's stack."""

    def whole(leaf):
        spec = leaf.sharding.spec
        return jax.device_put(leaf, jax.sharding.NamedSharding(mesh, P(None, *spec[1:])))

    return jax.tree.map(whole, stack)
