"""Mistakes users make with ``flax_escale.linen``, one case each.

Cases for ``init_train_state``. What a case asserts, and the rest of the table:
``support/mistakes.py``.
"""

import jax
import optax
import pytest
from flax import nnx
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    X,
    _Up,
    case,
    dense,
    mesh5,
    mesh_dp_tp,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import linen as fel

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fel.init_train_state(
            dense(), mesh_dp_tp(), jax.random.key(0), X, tx=TX, shard_over="dp"
        ),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="linen-init_train_state-shard_over",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fel.init_train_state(dense(), mesh5(), jax.random.key(0), X, tx=None),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="linen-init_train_state-tx-none",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fel.init_train_state(_Up, mesh5(), jax.random.key(0), X, tx=optax.sgd(0.1)),
        T,
        "model",
        "_Up",
        r"flax_escale\.nnx\.init_optimizer",
        id="linen-init_train_state-nnx-class",
    ),
    # --- an rng that is not a key or seed; inputs the model cannot be initialized with ------
    case(
        lambda: fe.init_sharded(dense(), mesh5(), nnx.Rngs(0), X),
        T,
        "rng",
        "an nnx.Rngs",
        r"pass the seed or key you would give nnx\.Rngs",
        id="linen-init_sharded-rng-rngs",
    ),
    case(
        lambda: fe.init_sharded(dense(), mesh5(), [0], X),
        T,
        "rng",
        "list [0]",
        r"pass jax\.random\.key\(0\) or 0",
        id="linen-init_sharded-rng-list",
    ),
    case(
        lambda: fel.init_train_state(dense(), mesh5(), jax.random.key(0), tx=TX),
        T,
        "model",
        "Dense.__call__(inputs)",
        r"missing a required argument: 'inputs'.*pass the example inputs after rng",
        id="linen-init_train_state-no-inputs",
    ),
    case(
        lambda: fe.lower_init(dense(), mesh5(), jax.random.key(0), "x"),
        T,
        "inputs[0]",
        "str 'x'",
        r"pass arrays \(or jax\.ShapeDtypeStruct\) as inputs",
        id="linen-lower_init-string-input",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
