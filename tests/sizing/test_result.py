"""``MeshPlan`` and ``Candidate``: the plan's table, recommendation and explanations.

What a case of the table asserts: ``support/mistakes.py``.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.tiny_workloads import Tiny, plan, planned

import flax_escale as fe
from flax_escale import sizing

CASES = [
    # --- the plan's results --------------------------------------------------------------------
    case(
        lambda: planned().table(top=0),
        fe.EscaleError,
        "top",
        "0",
        "positive int",
        id="MeshPlan.table-top-zero",
    ),
    case(
        lambda: planned().table(top=True),
        T,
        "top",
        "bool True",
        "positive int",
        id="MeshPlan.table-top-bool",
    ),
    case(
        lambda: planned().table(top=1.5),
        T,
        "top",
        "float 1.5",
        "positive int",
        id="MeshPlan.table-top-float",
    ),
    case(
        lambda: planned().best.explain(3),
        T,
        "profile",
        "int 3",
        r"pass one of \[.*'h100'",
        id="Candidate.explain-profile-int",
    ),
    case(
        lambda: planned().best.explain("h900"),
        fe.EscaleError,
        "profile",
        "'h900'",
        r"pass one of \[.*'h100'",
        id="Candidate.explain-profile-unknown",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_explain_takes_a_profile_or_its_name():
    best = planned().best
    assert best.explain("h100") == best.explain(sizing.PROFILES["h100"])


def test_every_mesh_pruned_is_not_said_to_be_out_of_memory():
    # A batch of 3 splits over no mesh of 2 devices: nothing was compiled, so no figure says
    # anything about memory.
    odd = sizing.Workload(
        Tiny(), jax.random.key(0), (jax.ShapeDtypeStruct((3, 16), jnp.float32),), tx=optax.sgd(0.1)
    )
    result = plan(odd)
    assert result.best is None
    assert result.recommendation() == (
        "No mesh was compiled: all 1 meshes of 2 devices were pruned, as none can run the "
        f"workload as asked. The first, fsdp=2: {result.candidates[0].figures.reason}."
    )
    assert "cannot be split on fsdp=2" in result.recommendation()
