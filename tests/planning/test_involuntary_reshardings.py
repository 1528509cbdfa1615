"""No layout of the NNX Llama example makes XLA replicate an array to split it another way.

Every mesh of 8 devices over ``dp, fsdp, tp, sp`` compiles the example's training step in a
fresh process (``support.reshardings``), and XLA's "involuntary full rematerialization"
reports are collected. Four layouts still have them (issue "Sharded steps as lean as the
textbook"): they are marked as expected failures, strictly, so that a fix shows as a pass to
be unmarked, and a new one fails.
"""

import pytest
from support import EXAMPLES
from support.reshardings import step_reshardings

from flax_escale.planning import mesh_shapes

pytestmark = pytest.mark.slow

SHAPES = [tuple(s.values()) for s in mesh_shapes(8, ("dp", "fsdp", "tp", "sp"))]
STILL_REPLICATED = {
    (4, 2, 1, 1, 1): "activations split over (fsdp, dp) taken to hidden over fsdp",
    (2, 4, 1, 1, 1): "activations split over (fsdp, dp) taken to hidden over fsdp",
    (1, 4, 1, 1, 2): "the embedding gather's output, and its gradient",
    (1, 2, 1, 1, 4): "the embedding gather's output, and its gradient",
}


@pytest.fixture(scope="module")
def found():
    return step_reshardings(str(EXAMPLES / "nnx_llama.py"), "workload", SHAPES)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(s, marks=pytest.mark.xfail(reason=STILL_REPLICATED[s], strict=True))
        if s in STILL_REPLICATED
        else s
        for s in SHAPES
    ],
    ids=str,
)
def test_the_step_replicates_nothing_to_reshard_it(found, shape):
    assert found[shape] == [], found[shape]


def test_every_layout_was_compiled(found):
    assert set(found) == set(SHAPES)
    assert len(SHAPES) == 20
