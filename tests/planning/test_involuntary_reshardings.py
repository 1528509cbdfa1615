"""No layout of the examples makes XLA replicate an array to split it another way.

Every mesh of 8 devices over ``dp, fsdp, tp, sp`` compiles each example's training step in a
fresh process (``support.reshardings``), and XLA's "involuntary full rematerialization"
reports are collected: there must be none. Before the examples gathered their embedding
tables for the lookup, four layouts had them (``dp`` with ``fsdp``, ``fsdp`` with ``sp``).
"""

import pytest
from support import EXAMPLES
from support.reshardings import step_reshardings

from flax_escale.planning import mesh_shapes

pytestmark = pytest.mark.slow

SHAPES = [tuple(s.values()) for s in mesh_shapes(8, ("dp", "fsdp", "tp", "sp"))]


@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
def test_no_layout_of_the_example_replicates_an_array_to_reshard_it(example):
    found = step_reshardings(str(EXAMPLES / f"{example}.py"), "workload", SHAPES)
    assert set(found) == set(SHAPES)
    assert len(SHAPES) == 20
    assert {shape: reports for shape, reports in found.items() if reports} == {}
