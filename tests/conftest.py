"""Every test sees 8 simulated CPU devices, on any host.

The platform and the device count can only be set before JAX starts a backend, which is why it
happens at import time here, before any test module imports code that touches devices. The CPU
platform is chosen explicitly: on a host with a GPU or TPU, JAX would otherwise make the
accelerator the default backend (and start it). The environment variable carries the choice to
the processes that tests start (multi-process tests, examples, the launcher).
"""

import os
import shutil
import tempfile

import jax
import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# Tests that compile for a TPU slice load libtpu, which takes a lock file unless told that
# several processes may load it (only its compiler is used): the workers of a run load it side
# by side, whichever test loads it first.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

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


# One persistent compilation cache for the whole run: the test processes (the xdist workers) and
# every process they start (the planner's children, page programs, multi-process jobs) inherit
# the folder's variable and these minimums of 0 (every program is kept, however quick or small
# its compile), so a program compiled by any of them is compiled once. XLA:CPU's compiles are
# what the suite spends most of its time on.
_EVERY_PROGRAM = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def pytest_configure(config: pytest.Config) -> None:
    # The first process of a run (xdist's controller, or the only one) makes the folder; the
    # workers it starts find it in their environment. A folder the user named is kept as is.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="flax-escale-test-compiles-")
        config.stash[_MADE_CACHE] = folder
        os.environ.update({**_EVERY_PROGRAM, "JAX_COMPILATION_CACHE_DIR": folder})
    # This process imported JAX before this hook: it is told directly.
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    for name, kind in (("COMPILE_TIME_SECS", float), ("ENTRY_SIZE_BYTES", int)):
        value = os.environ.get(f"JAX_PERSISTENT_CACHE_MIN_{name}", "0")
        jax.config.update(f"jax_persistent_cache_min_{name.lower()}", kind(value))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_MADE_CACHE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


_MADE_CACHE = pytest.StashKey[str]()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    # -n auto: a worker per core this process may use, but no more than one per 3 GiB of memory
    # (a worker compiling a 64-chip program holds about 2 GiB).
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(len(os.sched_getaffinity(0)), memory // (3 * 2**30)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest first, so that the workers finish together rather than one of them ending the
    # run alone with a 64-chip compile: files holding pod, slow or multiprocess tests go ahead
    # of the others, each file's tests kept together and in order (module fixtures are made
    # once). Stable, so the order within each class is the collection order. xdist hands out
    # the xdist_group units first, the largest first, then the single tests in this order.
    weight = {}
    for item in items:
        # Tests that share a module-scoped fixture (a plan, a compiled model) run on one worker,
        # which makes it once.
        definitions = item._fixtureinfo.name2fixturedefs.values()
        if any(d.scope == "module" for defs in definitions for d in defs):
            item.add_marker(
                pytest.mark.xdist_group(item.path.relative_to(config.rootpath).as_posix())
            )
        markers = {m.name for m in item.iter_markers()}
        rank = 0 if "pod" in markers else 1 if markers & {"slow", "multiprocess"} else 2
        weight[item.path] = min(weight.get(item.path, 2), rank)
    items.sort(key=lambda item: weight[item.path])


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
