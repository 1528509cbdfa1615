"""The entry points of flax_escale/_api.py: the mistakes users make with them, one case each.

Cases for ``init_sharded``, ``lower_init``, ``plan_sharding`` and ``sharded_module``, for Linen
and NNX models: the mesh, the model's kind and the rng, checked before a front end has the
model. What a case asserts, and the rest of the table: ``support/mistakes.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.mistakes import (
    MISTAKE,
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

CASES = [
    # --- a wrong type where a mesh is expected ---------------------------------------------
    case(
        lambda: fe.init_sharded(_Up, "dp:8", 0),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="init_sharded-nnx-mesh-string",
    ),
    case(
        lambda: fe.init_sharded(dense(), None, jax.random.key(0), X),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="init_sharded-linen-mesh-none",
    ),
    case(
        lambda: fe.plan_sharding(_Up, (2, 4), 0),
        T,
        "mesh",
        "(2, 4)",
        r"create_mesh\(",
        id="plan_sharding-nnx-mesh-tuple",
    ),
    # --- the wrong kind of model, an rng that is neither a key nor a seed ------------------
    case(
        lambda: fe.init_sharded(nn.Dense, mesh_dp_tp(), jax.random.key(0), X),
        T,
        "model",
        "Dense",
        r"pass Dense\(\.\.\.\)",
        id="init_sharded-linen-class",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), 0.5),
        T,
        "rng",
        "float 0.5",
        r"jax\.random\.key\(0\)",
        id="init_sharded-nnx-rng-float",
    ),
    case(
        lambda: fe.init_sharded(dense(), mesh_dp_tp(), 0.5, X),
        T,
        "rng",
        "float 0.5",
        r"jax\.random\.key\(0\)",
        id="init_sharded-linen-rng-float",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), "0"),
        T,
        "rng",
        "'0'",
        r"jax\.random\.key",
        id="nnx-init_sharded-rng-string",
    ),
    case(
        lambda: fe.init_sharded(dense(), mesh_dp_tp(), None, X),
        T,
        "rng",
        "None",
        r"jax\.random\.key",
        id="linen-init_sharded-rng-none",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), True),
        T,
        "rng",
        "bool True",
        r"jax\.random\.key",
        id="init_sharded-rng-bool",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), {"params": 0.5}),
        T,
        "rng['params']",
        "float 0.5",
        r"jax\.random\.key",
        id="init_sharded-rng-dict-float",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), np.float32(0.5)),
        T,
        "rng",
        "0.5",
        r"jax\.random\.key",
        id="init_sharded-rng-numpy-float",
    ),
    case(
        lambda: fe.plan_sharding(dense(), mesh_dp_tp(), 0.5, X),
        T,
        "rng",
        "float 0.5",
        r"jax\.random\.key",
        id="plan_sharding-linen-rng-float",
    ),
    case(
        lambda: fe.lower_init(_Up, mesh_dp_tp(), 0.5),
        T,
        "rng",
        "float 0.5",
        r"jax\.random\.key",
        id="lower_init-nnx-rng-float",
    ),
    case(
        lambda: fe.lower_init(dense(), mesh_dp_tp(), 0.5, X),
        T,
        "rng",
        "float 0.5",
        r"jax\.random\.key",
        id="lower_init-linen-rng-float",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fe.init_sharded("MLP", mesh5(), 0),
        T,
        "model",
        "'MLP'",
        "NNX module class",
        id="init_sharded-model-name",
    ),
    case(
        lambda: fe.lower_init(dense(), "dp:8", jax.random.key(0), X),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="linen-lower_init-mesh-string",
    ),
    case(
        lambda: fe.plan_sharding(_Up, None, 0),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="nnx-plan_sharding-mesh-none",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh_dp_tp(), np.array([0.5])),
        T,
        "rng",
        "ndarray of shape (1,) and dtype float64",
        r"jax\.random\.key",
        id="init_sharded-rng-float-array",
    ),
    case(
        lambda: fe.plan_sharding(dense(), mesh5(), jax.random.key(0), X, method=3),
        T,
        "method",
        "int 3",
        r"pass one of its methods \('__call__'\)",
        id="linen-plan_sharding-method-int",
    ),
    case(
        lambda: fe.init_sharded(dense(), mesh5(), jax.random.key(0), X, method="encode"),
        fe.EscaleError,
        "method",
        "'encode'",
        r"pass one of its methods \('__call__'\)",
        id="linen-init_sharded-method-missing",
    ),
    case(
        lambda: fe.init_sharded(
            nn.Dense(
                8,
                kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "fsdp")),
            ),
            mesh5(),
            jax.random.key(0),
            X,
        ),
        fe.EscaleError,
        "params/kernel",
        "('fsdp', 'fsdp')",
        "each mesh axis may appear once",
        id="linen-with_partitioning-axis-twice",
    ),
    case(
        lambda: fe.sharded_module(patterns={"kernel": "embed"}),
        T,
        "patterns",
        "'embed'",
        r"such as \('hidden_state', None\)",
        id="linen-sharded_module-axes-string",
    ),
    # --- an rng that is not a key or seed ------------------------------------------------
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
    # --- an nnx.Rngs, or an array that is not one key, where a seed or key is expected -----
    case(
        lambda: fe.init_sharded(_Up, mesh5(), nnx.Rngs(0)),
        T,
        "rng",
        "an nnx.Rngs",
        r"build the module's nnx\.Rngs from a seed or key themselves.*0 or "
        r"jax\.random\.key\(0\)",
        id="nnx-init_sharded-rng-rngs",
    ),
    case(
        lambda: fe.lower_init(_Up, mesh5(), {"params": nnx.Rngs(0)}),
        T,
        "rng['params']",
        "an nnx.Rngs",
        r"a dict of them by stream name such as \{'params': 0, 'dropout': 1\}",
        id="nnx-lower_init-rng-dict-of-rngs",
    ),
    case(
        lambda: fe.plan_sharding(_Up, mesh5(), nnx.Rngs(0).params),
        T,
        "rng",
        "an nnx.RngStream",
        r"pass the seed or key you would give nnx\.Rngs",
        id="nnx-plan_sharding-rng-stream",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh5(), jax.random.split(jax.random.key(0), 2)),
        T,
        "rng",
        "of shape (2,) and dtype key<fry>",
        r"pass one key, e\.g\. keys\[0\]",
        id="nnx-init_sharded-rng-key-array",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh5(), jnp.array(0)),
        T,
        "rng",
        "Array(0, dtype=int32",
        r"pass the seed as a Python int, int\(seed\)",
        id="nnx-init_sharded-rng-int-array",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh5(), [0, 1]),
        T,
        "rng",
        "list [0, 1]",
        r"pass jax\.random\.key\(0\) or 0",
        id="nnx-init_sharded-rng-list",
    ),
    # --- a module already built where its class is expected ---------------------------------
    case(
        lambda: fe.init_sharded(_Up(nnx.Rngs(0)), mesh5(), 0),
        T,
        "model",
        "_Up",
        r"pass its class, or a function that builds it from its rngs, such as lambda rngs: "
        r"_Up\(\.\.\., rngs=rngs\)",
        id="nnx-init_sharded-module-instance",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
