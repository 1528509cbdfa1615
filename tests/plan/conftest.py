import pytest

from flax_escale import create_mesh


@pytest.fixture
def mesh2(devices):
    """A two-axis mesh of the plain names: dp=2, tp=4."""
    return create_mesh((2, 4), ("dp", "tp"))
