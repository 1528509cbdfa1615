import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, enter, raises_a_library_error

import flax_escale as fe
from flax_escale import cpu_context, force_cpu


def test_force_cpu_sets_and_restores_the_default_device():
    before = jax.config.jax_default_device
    with force_cpu() as cpu:
        assert cpu.platform == "cpu"
        assert jnp.zeros(2).devices() == {cpu}
        assert jax.config.jax_default_device == cpu
    assert jax.config.jax_default_device == before


def test_cpu_context_sets_the_mesh_and_restores_it():
    with cpu_context((2, -1), ("dp", "tp"), axis_types="explicit") as mesh:
        assert {d.platform for d in mesh.devices.flat} == {"cpu"}
        current = jax.sharding.get_abstract_mesh()
        assert current.axis_names == ("dp", "tp")
        assert dict(current.shape) == {"dp": 2, "tp": 4}
        # A bare PartitionSpec resolves against the context mesh.
        x = jax.device_put(jnp.arange(8.0), P("tp"))
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), 1)
    assert jax.sharding.get_abstract_mesh().empty


def test_cpu_context_default_mesh():
    with cpu_context() as mesh:
        assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}


CASES = [
    case(
        lambda: enter(fe.cpu_context((8,), "dp")),
        T,
        "axis_names",
        "'dp'",
        r"pass \('dp',\)",
        id="cpu_context-names-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
