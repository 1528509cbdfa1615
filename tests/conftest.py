"""Every test sees 8 simulated CPU devices, on any host.

The platform and the device count can only be set before JAX starts a backend, which is why it
happens at import time here, before any test module imports code that touches devices. The CPU
platform is chosen explicitly: on a host with a GPU or TPU, JAX would otherwise make the
accelerator the default backend (and start it). The environment variable carries the choice to
the processes that tests start (multi-process tests, examples, the launcher).
"""

import os
import shutil

import jax
import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# Messages show specs with JAX's repr, which older JAX (the supported lower bound) spells
# PartitionSpec(...) where newer JAX writes P(...); the tests match the newer spelling, so on
# older JAX the repr is given that spelling (as test_doctests' checker does for docstrings).
if repr(jax.sharding.PartitionSpec()).startswith("PartitionSpec("):
    _spec_repr = jax.sharding.PartitionSpec.__repr__
    jax.sharding.PartitionSpec.__repr__ = lambda spec: "P(" + _spec_repr(spec)[14:]


# Imported after the platform choice above (importing them starts no backend).
from support import MESHES  # noqa: E402

import flax_escale as fe  # noqa: E402


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, f"expected 8 simulated CPU devices, got {found}"
    assert {device.platform for device in found} == {"cpu"}, found
    return found


@pytest.fixture(scope="session")
def mesh(devices):
    """The mesh most tests use: fsdp=4, tp=2 (``support.MESHES["fsdp4_tp2"]``).

    Test files whose subject needs another mesh define their own ``mesh`` fixture.
    """
    return fe.create_mesh(MESHES["fsdp4_tp2"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The pod tests together would take half of CI's 90 minutes, so the whole suite skips them
    # (and says so) unless asked for by name, as in -m pod.
    if "pod" in config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="compiles for a 64-chip TPU slice (minutes): -m pod runs it")
    for item in items:
        if item.get_closest_marker("pod") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(
                "Chromium is not installed, and CI is set: the browser tests must run in CI. "
                "Install Debian's chromium (.ci/run does: apt-get install chromium)."
            )
        pytest.skip("Chromium is not installed (apt-get install chromium); CI runs these tests")
    return found
