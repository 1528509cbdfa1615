"""What the real-model tests share: synthetic batches, leaf-by-leaf comparisons, bytes.

Every check compares a sharded run with the same computation unsharded (``jax.jit`` on one
device, no mesh), leaf by leaf and by path, so a leaf that is missing, renamed, reordered or
different fails with its path in the message.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training.train_state import TrainState

import flax_escale as fe
from flax_escale import linen as fel

DEVICES = 8
SLACK = 1.1  # largest device within 10% of total / devices
STEPS = 3
KEY = jax.random.key(0)

# Sharded and unsharded training differ only in the order of reductions (float32).
LOSS_TOLERANCE = {"rtol": 5e-6, "atol": 0.0}
PARAM_TOLERANCE = {"rtol": 5e-5, "atol": 1e-6}


def token_batch(batch: int = 8, length: int = 16, vocab: int = 256, seed: int = 0) -> np.ndarray:
    """Tokens in ``[1, vocab)``, with a few padding zeros at the end of half the rows."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(batch, length), dtype=np.int32)
    tokens[::2, -3:] = 0
    return tokens


def path_name(path: Sequence[Any]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def flat(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` for every array leaf of ``tree`` (Flax boxes unboxed)."""
    tree = nn.meta.unbox(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): leaf for path, leaf in leaves if hasattr(leaf, "shape")}


def flat_shardings(tree: Any) -> dict[str, Any]:
    """``{path: NamedSharding}`` for a tree of shardings (as ``nn.logical_to_mesh_sharding``)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )[0]
    return {path_name(path): leaf for path, leaf in leaves if leaf is not None}


def assert_bit_equal(actual: Any, expected: Any) -> int:
    """Same paths, shapes, dtypes and bits, leaf by leaf; returns the number of leaves."""
    got, want = flat(actual), flat(expected)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for path, leaf in want.items():
        value = np.asarray(got[path])
        assert value.dtype == leaf.dtype, (path, value.dtype, leaf.dtype)
        assert value.shape == leaf.shape, (path, value.shape, leaf.shape)
        differ = int(np.sum(value != np.asarray(leaf)))
        assert differ == 0, f"{path}: {differ} of {value.size} values differ from the reference"
    return len(want)


def assert_close(actual: Any, expected: Any, **tolerance: float) -> None:
    got, want = flat(actual), flat(expected)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for path, leaf in want.items():
        np.testing.assert_allclose(
            np.asarray(got[path]), np.asarray(leaf), err_msg=path, **tolerance
        )


def bytes_by_device(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of the arrays in ``tree``, from their addressable shards."""
    held: dict[Any, int] = collections.Counter()
    for leaf in flat(tree).values():
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)


def total_bytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in flat(tree).values())


def assert_ideal_share(tree: Any, devices: int = DEVICES) -> tuple[int, int]:
    """Every device holds at most ``SLACK * total / devices``; returns (largest, total)."""
    held, total = bytes_by_device(tree), total_bytes(tree)
    assert len(held) == devices, held
    largest = max(held.values())
    assert largest <= SLACK * total / devices, (
        f"largest device holds {largest} B of {total} B: {largest * devices / total:.2f}x its "
        f"share over {devices} devices"
    )
    return largest, total


def mesh_shardings(tree: Any) -> Any:
    """Each array's own sharding (``None`` elsewhere), for ``jax.jit``'s ``out_shardings``."""
    return jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, tree)


def place_batch(mesh: Any, tokens: np.ndarray, *, logical_axes=None, rules=None) -> jax.Array:
    """A global batch made the multi-host way: each process passes only the rows it holds."""
    sharding = fe.batch_sharding(mesh, tokens.shape, logical_axes, rules)
    rows = fe.process_batch_slice(sharding, tokens.shape)
    return fe.host_local_to_global(tokens[rows], sharding, tokens.shape)


# -- Linen: init and train, unsharded and sharded ------------------------------------------


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross entropy over the non-padding targets."""
    weights = (targets > 0).astype(jnp.float32)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1])
    per_token = -jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1)
    return jnp.sum(per_token * weights) / jnp.sum(weights)


def linen_train_step(loss: Callable[[Any, Any], jax.Array]):
    """``(state, batch) -> (state, loss)`` for ``loss(params, batch)``."""

    def step(state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        value, grads = jax.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads), value

    return step


# Training steps are compared with each other, never with a stored number, so both sides are
# compiled with the same quick settings (XLA's CPU compiler is most of this directory's time).
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_quick(jitted: Callable, *args: Any) -> Callable:
    """``jitted`` lowered for ``args`` and compiled with ``QUICK_COMPILE``."""
    return jitted.lower(*args).compile(compiler_options=QUICK_COMPILE)


def run_steps(step: Callable, state: Any, batch: Any, steps: int = STEPS) -> tuple[Any, list]:
    losses = []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def linen_reference(model: nn.Module, inputs: tuple, tx: Any, loss: Callable) -> dict[str, Any]:
    """Unsharded: ``jax.jit(model.init)`` on one device, then ``STEPS`` jitted training steps."""
    variables = nn.meta.unbox(jax.jit(model.init)(KEY, *inputs))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
    step = compile_quick(jax.jit(linen_train_step(loss)), state, inputs)
    final, losses = run_steps(step, state, inputs)
    return {"variables": variables, "params": final.params, "losses": losses}


def linen_sharded(
    model: nn.Module,
    mesh: Any,
    inputs: tuple,
    tx: Any,
    loss: Callable,
    rules: Any,
    batch: tuple,
    *,
    lowered: bool = False,
) -> dict[str, Any]:
    """A sharded train state on ``mesh``, then the same steps under ``use_sharding``.

    The state comes from ``fel.init_train_state``, or with ``lowered`` from
    ``fe.lower_init(...).compile()`` (whose ``memory_analysis`` is kept) and
    ``fe.init_opt_state``, the two halves ``init_train_state`` is made of.
    """
    result: dict[str, Any] = {}
    if lowered:
        compiled = fe.lower_init(model, mesh, KEY, *inputs, rules=rules).compile()
        result["memory"] = compiled.memory_analysis()
        result["variables"] = compiled(KEY, *inputs)
        params = result["variables"]["params"]
        opt_state = fe.init_opt_state(tx, params)
        state = TrainState(step=0, apply_fn=model.apply, params=params, tx=tx, opt_state=opt_state)
    else:
        state = fel.init_train_state(model, mesh, KEY, *inputs, tx=tx, rules=rules)
    with fe.use_sharding(mesh, rules):
        jitted = jax.jit(linen_train_step(loss), out_shardings=(mesh_shardings(state), None))
        final, losses = run_steps(compile_quick(jitted, state, batch), state, batch)
    return {
        **result,
        "state": state,
        "initial": state.params,
        "params": final.params,
        "losses": losses,
    }
