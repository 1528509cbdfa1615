"""The one init pipeline: an argument is checked where it enters, and travels checked.

A spy on every argument checker (and on the rules' freezing) counts each (checker, argument)
pair once per public call, whichever front end, whichever entry point. That every entry point
also gives the same specs is ``tests/integration/real_models/test_entry_points_agree.py``.
"""

import collections
import functools
import inspect
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support import MESHES

import flax_escale as fe
from flax_escale import _checks
from flax_escale.linen import init_train_state
from flax_escale.resolve import _rules
from flax_escale.sizing import Workload


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
class Up(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(8, 16, use_bias=False, rngs=rngs)


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
class LinenUp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, use_bias=False)(x)


@pytest.fixture
def meshes():
    return [fe.create_mesh(dims) for dims in MESHES.values()]


@pytest.fixture
def checks(monkeypatch, mesh, meshes):
    """Counts every call of an argument checker and of the rules' freezing, by argument."""
    counts = collections.Counter()

    def spy(name, function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            counts[name, bound.arguments.get("argument", "")] += 1
            return function(*args, **kwargs)

        return counted

    for name in ("mesh", "rng", "flag", "names", "transformation"):
        monkeypatch.setattr(_checks, name, spy(name, getattr(_checks, name)))
    original = _rules.as_logical_rules
    frozen = spy("as_logical_rules", original)
    for module in [m for n, m in sys.modules.items() if n.startswith("flax_escale")]:
        if getattr(module, "as_logical_rules", None) is original:
            monkeypatch.setattr(module, "as_logical_rules", frozen)
    fe.linen.clear_init_cache()
    return counts


def _twice(counts):
    return {key: n for key, n in counts.items() if n > 1}


@pytest.mark.parametrize("entry", [fe.plan_sharding, fe.init_sharded, fe.lower_init])
def test_an_nnx_entry_point_checks_each_argument_once(checks, mesh, entry):
    entry(Up, mesh, 0)
    assert checks["mesh", "mesh"] == 1
    assert checks["rng", "rng"] == 1
    assert checks["as_logical_rules", ""] == 1
    assert _twice(checks) == {}


@pytest.mark.parametrize("entry", [fe.plan_sharding, fe.init_sharded, fe.lower_init])
def test_a_linen_entry_point_checks_each_argument_once(checks, mesh, entry):
    entry(LinenUp(), mesh, jax.random.key(0), jnp.ones((2, 8)))
    assert checks["mesh", "mesh"] == 1
    assert checks["rng", "rng"] == 1
    assert checks["flag", "strict"] == 1
    assert checks["flag", "use_idle_axes"] == 1
    assert _twice(checks) == {}


def test_init_train_state_checks_each_argument_once(checks, mesh):
    init_train_state(LinenUp(), mesh, jax.random.key(0), jnp.ones((2, 8)), tx=optax.adam(1e-3))
    assert checks["mesh", "mesh"] == 1
    assert checks["transformation", "tx"] == 1
    assert _twice(checks) == {}


def test_a_workload_checks_its_arguments_once_for_every_mesh(checks, meshes):
    workload = Workload(Up, 0, tx=optax.sgd(0.1), batch=(jnp.ones((8, 8)),))
    for mesh in meshes:
        workload.plan(mesh)
    assert checks["rng", "rng"] == 1
    assert checks["as_logical_rules", ""] == 1
    assert _twice({k: n for k, n in checks.items() if k[0] != "mesh"}) == {}
