"""Every test sees 8 simulated CPU devices.

The device count can only be set before JAX starts a backend, which is why it happens at import
time here, before any test module imports code that touches devices.
"""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, f"expected 8 simulated CPU devices, got {found}"
    return found
