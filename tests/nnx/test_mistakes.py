"""Mistakes users make with ``flax_escale.nnx``, one case each.

Cases for ``init_optimizer`` and ``stacked``. What a case asserts, and the rest of the table:
``support/mistakes.py``.
"""

import pytest
from flax import nnx
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    _Up,
    case,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import nnx as fen

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fen.init_optimizer(
            fe.init_sharded(_Up, fe.create_mesh((1, 4, 1, 2, 1)), 0), TX, shard_over="dp"
        ),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="nnx-init_optimizer-shard_over",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fen.init_optimizer("model", TX),
        T,
        "model",
        "'model'",
        r"flax\.nnx\.Module",
        id="nnx-init_optimizer-model-string",
    ),
    case(
        lambda: fen.init_optimizer(_Up(nnx.Rngs(0)), None),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="nnx-init_optimizer-tx-none",
    ),
    case(
        lambda: fen.stacked(3),
        T,
        "name",
        "int 3",
        "'layers'",
        id="nnx-stacked-int",
    ),
    case(
        lambda: fen.stacked(""),
        fe.EscaleError,
        "name",
        "''",
        "pass e.g. 'layers'",
        id="nnx-stacked-empty",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
