"""Mistakes users make with ``flax_escale.nnx``, one case each.

Cases for ``init_optimizer`` (its ``wrt`` filter too), ``stacked``, ``stack_layers`` and the NNX
constructors that ``init_sharded`` and ``plan_sharding`` call. What a case asserts, and the rest
of the table: ``support/mistakes.py``.
"""

import functools

import flax.linen as linen
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    _Up,
    case,
    mesh5,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import nnx as fen


# Named with an underscore, as the messages of the cases that pass the classes show them.
class _Sized(nnx.Module):
    def __init__(self, din, rngs):
        self.wi = nnx.Linear(din, 8, use_bias=False, rngs=rngs)


class _NoRngs(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((4, 4)))


def _built():
    """A model whose only variable is a Param, built sharded."""
    return fe.init_sharded(_Up, mesh5(), 0)


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
    # --- a filter of what to optimize that is none, or selects nothing ----------------------
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=3),
        T,
        "wrt",
        "int 3",
        r"pass nnx\.Param \(the default\)",
        id="nnx-init_optimizer-wrt-int",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=[nnx.Param, 3.5]),
        T,
        "wrt",
        "3.5",
        r"pass nnx\.Param \(the default\)",
        id="nnx-init_optimizer-wrt-list-with-float",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=lambda: True),
        T,
        "wrt",
        "<lambda>()",
        r"\(path, value\).*exactly those 2 parameters",
        id="nnx-init_optimizer-wrt-arity",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=lambda path, value: None),
        fe.EscaleError,
        "wrt",
        "function",
        r"selects none of the model's variables \(it holds Param\).*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-selects-nothing",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt="params"),
        fe.EscaleError,
        "wrt",
        "'params'",
        r"selects variables by tag, not by collection name.*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-collection-name",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=nnx.BatchStat),
        fe.EscaleError,
        "wrt",
        "BatchStat",
        r"selects none of the model's variables.*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-absent-type",
    ),
    # --- a constructor that cannot be called as model(*args, rngs=..., **kwargs) ------------
    case(
        lambda: fe.init_sharded(_Sized, mesh5(), 0),
        T,
        "model",
        "_Sized(din, rngs)",
        r"missing a required argument: 'din'.*after rng.*lambda rngs: _Sized\(\.\.\., rngs=rngs\)",
        id="nnx-init_sharded-class-missing-argument",
    ),
    case(
        lambda: fe.plan_sharding(_Sized, mesh5(), 0),
        T,
        "model",
        "_Sized(din, rngs)",
        r"missing a required argument: 'din'.*after rng",
        id="nnx-plan_sharding-class-missing-argument",
    ),
    case(
        lambda: fe.init_sharded(_Sized, mesh5(), 0, 4, 5),
        T,
        "model",
        "_Sized(din, rngs)",
        r"2 positional argument.*after rng",
        id="nnx-init_sharded-class-extra-argument",
    ),
    case(
        lambda: fe.init_sharded(lambda: _Up(nnx.Rngs(0)), mesh5(), 0),
        T,
        "model",
        "<lambda>()",
        r"unexpected keyword argument 'rngs'.*must take the keyword argument rngs",
        id="nnx-init_sharded-factory-without-rngs",
    ),
    case(
        lambda: fe.init_sharded(lambda r: _Up(r), mesh5(), 0),
        T,
        "model",
        "<lambda>(r)",
        r"must take the keyword argument rngs.*lambda rngs: Model\(\.\.\., rngs=rngs\)",
        id="nnx-init_sharded-factory-rngs-misnamed",
    ),
    case(
        lambda: fe.init_sharded(_NoRngs, mesh5(), 0),
        T,
        "model",
        "_NoRngs()",
        r"must take the keyword argument rngs",
        id="nnx-init_sharded-class-without-rngs",
    ),
    case(
        lambda: fe.init_sharded(functools.partial(_Sized), mesh5(), 0),
        T,
        "model",
        "functools.partial(<class",
        r"missing a required argument: 'din'",
        id="nnx-init_sharded-partial-missing-argument",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh5(), 0, rngs=nnx.Rngs(1)),
        T,
        "rngs",
        "Rngs",
        r"pass its seed or key as rng",
        id="nnx-init_sharded-rngs-keyword",
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
    case(
        lambda: fe.init_sharded(lambda rngs: {"up": _Up(rngs)}, mesh5(), 0),
        T,
        "model",
        "returned a dict",
        r"goes inside a module's attribute",
        id="nnx-init_sharded-factory-returns-dict",
    ),
    case(
        lambda: fen.init_optimizer(_Up, TX),
        T,
        "model",
        "_Up",
        r"build it first, e\.g\. init_sharded\(_Up, mesh, 0\)",
        id="nnx-init_optimizer-model-class",
    ),
    case(
        lambda: fen.stack_layers(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), 2, nnx.Rngs(0)),
        T,
        "make",
        "an instance of Linear, a layer already built",
        r"pass its class, Linear, if it takes only rngs, or e\.g\. lambda rngs: "
        r"Linear\(\.\.\., rngs=rngs\)",
        id="nnx-stack_layers-module-instance",
    ),
    case(
        lambda: fen.stack_layers(linen.Dense(4), 2, nnx.Rngs(0)),
        T,
        "make",
        "the flax.linen module Dense",
        r"stack NNX modules .*flax\.nnx\.bridge\.ToNNX",
        id="nnx-stack_layers-linen-module",
    ),
    case(
        lambda: fen.stack_layers(_Up, 2, 0),
        T,
        "rngs",
        "int 0",
        r"pass e\.g\. nnx\.Rngs\(0\)",
        id="nnx-stack_layers-rngs-seed",
    ),
    # --- a layer class given to stack_layers, whose metaclass hides its parameters ---------
    case(
        lambda: fen.stack_layers(nnx.Linear, 2, nnx.Rngs(0)),
        T,
        "make",
        "Linear(in_features, out_features",
        r"lambda rngs: Block\(config, rngs=rngs\)",
        id="nnx-stack_layers-layer-class",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
