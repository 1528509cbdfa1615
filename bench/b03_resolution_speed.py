"""B3: time to compute a model's shardings from its logical annotations, against Flax's own.

Run: ``python bench/b03_resolution_speed.py [rounds]`` (default 5 rounds per condition).

What is compared, in one process, on the same model, mesh and rules
(``PartitionAxis().logical_axis_rules()``), on 8 simulated CPU devices (mesh ``dp=1, fsdp=4,
ep=1, tp=2, sp=1``). The model is a decoder-only transformer annotated with this library's
logical names: an embedding, then per layer attention kernels (query, grouped key/value,
output), a gated MLP (two input kernels, an output kernel and bias) and two norm scales, then a
final norm and an output head; about 1,000, 10,000 and 100,000 leaves. Every layer has its own
widths (no two layers share a shape), so about 60% of the parameters are distinct ``(names,
shape)`` pairs and a cache keyed by them has little to reuse.

The library's side is always ``fe.logical_to_mesh_sharding(tree, mesh, rules)`` given the tree
as the user has it: one path, the plan ``fe.plan_sharding`` makes (every annotation read the
one way, resolution *shape-aware*: a rule whose mesh axes do not divide the dimension is passed
over, what still does not fit is corrected and warned about, optimizer state follows its
parameter, idle mesh axes are put to use on large arrays), then one ``NamedSharding`` per
array. Flax's side is what Flax offers for the same tree, timed end to end from the same input
(extracting the specs included):

- ``linen``: ``jax.eval_shape`` of a Linen ``init``: ``{"params": ...}`` of
  ``nn.LogicallyPartitioned`` boxes around ``jax.ShapeDtypeStruct``. Flax:
  ``nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)``.
- ``specs``: the library given Flax's own input, ``nn.get_partition_spec(tree)`` of the
  ``linen`` tree (its time includes that call): specs carry no shapes, so they resolve as Flax
  resolves them. Flax: as for ``linen``.
- ``nnx``: ``nnx.state(nnx.eval_shape(...))`` of an NNX model whose ``nnx.Param`` s carry
  Flax's ``out_sharding`` metadata (logical names). Flax, as its guide does:
  ``nn.logical_to_mesh_sharding(nnx.get_partition_spec(state), mesh, rules)``.
- ``train_state``: ``jax.eval_shape`` of ``TrainState.create`` with ``optax.adamw`` on the
  ``linen`` parameters (about a third of the leaves): the Adam moments are boxes optax copied
  from the parameters, which the library makes follow their parameter. Flax:
  ``nn.logical_to_mesh_sharding(nn.get_partition_spec(state), mesh, rules)``.
- ``params_axes``: t5x's ``param_with_axes`` layout, plain arrays under ``params`` and their
  names in ``params_axes`` (``AxisMetadata`` at ``<name>_axes``). Flax:
  ``nn.logical_to_mesh_sharding(partitioning.get_axis_names(tree["params_axes"]), mesh, rules)``.
- ``own_rules``: ``linen`` boxes that carry the rules themselves
  (``nn.with_logical_partitioning(..., rules=rules)``). Flax has no tree function that reads a
  box's own rules (``nn.get_partition_spec`` drops them; the box applies them only as a
  constraint when unboxed), so its side resolves each box with them as the box would:
  ``NamedSharding(mesh, nn.logical_to_mesh_axes(box.names, box.rules))`` over the tree.
- ``corrections``: the ``linen`` tree with an odd number of heads in every layer, which neither
  ``tp=2`` nor the fallback ``fsdp*sp=4`` divides: the library corrects the query and output
  kernels (a fifth of the leaves) and warns, once per call, listing every one (the warning is
  built, then ignored, inside the timed call); Flax hands back specs that do not divide.

Every dimension of the other trees is divisible by the mesh axes its rules name and nothing is
large enough to leave an axis idle, so the library must agree with Flax there: the script
checks every leaf (``NamedSharding.is_equivalent_to`` on the leaf's rank) and prints how many
agree (for ``corrections``, the leaves not corrected).

Conditions: the garbage collector stays on (``gc.collect()`` runs, untimed, before each timed
call so that no call pays for garbage another left); the library pauses it inside its own call
while it reads and resolves the tree (which makes no reference cycles), and that is part of
what is measured; the two calls run in interleaved rounds
(library, Flax, then Flax, library, ...) and each reports the median of its rounds. *Cold*:
every cache of the library (each ``functools`` cache in any loaded ``flax_escale`` module,
listed when the script starts) is cleared, untimed, before each of its calls. *Warm*: the
library's caches hold what the previous identical call left there. Flax keeps no cache of its
own, so its column is the same call in both conditions, timed again in each. JAX's caches are
cleared (untimed) once each tree is built, so that what tracing one tree left there does not
weigh on the next, then warm for both sides throughout the rounds. Timings on a shared host are
noisy; the ratio ``flax / flax_escale`` (above 1: the library is faster) is the number to read.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
from _support import cpu_devices, example

DEVICES = cpu_devices()  # before anything starts a backend

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import partitioning  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import flax_escale as fe  # noqa: E402

SIZES = (1_000, 10_000, 100_000)
LEAVES_PER_LAYER = 10
VOCAB = 32_000

# A model as {name: subtree or (shape, logical names)}, whatever form its leaves take.
Spec = dict[str, Any]


def layer(i: int, odd_heads: bool = False) -> Spec:
    # Widths grow with the layer index, so no two layers share a shape; every size is a
    # multiple of 8, which the mesh axes any rule names (tp=2, fsdp*sp=4) divide, but for
    # odd_heads.
    hidden = 512 + 8 * i
    heads, kv_heads, head_dim = 8 + 2 * (i % 5), 2 + 2 * (i % 3), 64 * (1 + i % 2)
    heads += odd_heads
    mlp = 4 * hidden + 16 * (i % 7)
    attention = ("hidden_state", "head", "attention_dim")
    kv = ("hidden_state", "kv_head", "attention_dim")
    return {
        "attention": {
            "query": {"kernel": ((hidden, heads, head_dim), attention)},
            "key": {"kernel": ((hidden, kv_heads, head_dim), kv)},
            "value": {"kernel": ((hidden, kv_heads, head_dim), kv)},
            "out": {
                "kernel": ((heads, head_dim, hidden), ("head", "attention_dim", "hidden_state"))
            },
        },
        "mlp": {
            "wi_0": {"kernel": ((hidden, mlp), ("hidden_state", "mlp_intermediate"))},
            "wi_1": {"kernel": ((hidden, mlp), ("hidden_state", "mlp_intermediate"))},
            "wo": {
                "kernel": ((mlp, hidden), ("mlp_intermediate", "hidden_state")),
                "bias": ((hidden,), ("hidden_state",)),
            },
        },
        "pre_attention_norm": {"scale": ((hidden,), ("hidden_state",))},
        "pre_mlp_norm": {"scale": ((hidden,), ("hidden_state",))},
    }


def model_spec(leaves: int, odd_heads: bool = False) -> Spec:
    """The parameters of a transformer with about ``leaves`` of them."""
    layers = max(1, (leaves - 3) // LEAVES_PER_LAYER)
    last = 512 + 8 * (layers - 1)
    params: Spec = {"embed": {"embedding": ((VOCAB, 512), ("vocab", "hidden_state"))}}
    params.update({f"layers_{i}": layer(i, odd_heads) for i in range(layers)})
    params["final_norm"] = {"scale": ((last,), ("hidden_state",))}
    params["lm_head"] = {"kernel": ((last, VOCAB), ("hidden_state", "vocab"))}
    return params


def mapped(spec: Spec, leaf: Callable[[tuple[int, ...], tuple[str, ...]], Any]) -> Any:
    return {
        key: mapped(value, leaf) if isinstance(value, dict) else leaf(*value)
        for key, value in spec.items()
    }


def abstract(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def linen_tree(leaves: int, odd_heads: bool = False, **box: Any) -> Any:
    """What ``jax.eval_shape`` of a Linen ``init`` gives: ``{"params": boxes}``."""
    spec = model_spec(leaves, odd_heads)
    return {
        "params": mapped(
            spec, lambda shape, names: nn.LogicallyPartitioned(abstract(shape), names, **box)
        )
    }


class Node(nnx.Module):
    """An NNX module holding a model spec's parameters, with ``out_sharding`` metadata."""

    def __init__(self, spec: Spec) -> None:
        for key, value in spec.items():
            if isinstance(value, dict):
                setattr(self, key, Node(value))
            else:
                shape, names = value
                setattr(self, key, nnx.Param(jnp.zeros(shape), out_sharding=names))


def nnx_state(leaves: int) -> Any:
    spec = model_spec(leaves)
    with nnx.use_eager_sharding(False):  # no mesh: the metadata is read, not applied
        return nnx.state(nnx.eval_shape(lambda: Node(spec)))


def train_state(leaves: int) -> Any:
    # Parameters, Adam's two moments: a third of the leaves each.
    params = linen_tree(leaves // 3)["params"]
    tx = optax.adamw(1e-3)
    return jax.eval_shape(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx), params)


def params_axes_tree(leaves: int) -> Any:
    spec = model_spec(leaves)

    def axes(tree: Spec) -> Any:
        return {
            (key if isinstance(value, dict) else f"{key}_axes"): (
                axes(value) if isinstance(value, dict) else partitioning.AxisMetadata(value[1])
            )
            for key, value in tree.items()
        }

    return {"params": mapped(spec, lambda shape, _: abstract(shape)), "params_axes": axes(spec)}


def library(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return fe.logical_to_mesh_sharding(tree, mesh, rules)


def library_specs(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return fe.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)


def flax_linen(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)


def flax_nnx(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return nn.logical_to_mesh_sharding(nnx.get_partition_spec(tree), mesh, rules)


def flax_params_axes(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    specs = partitioning.get_axis_names(tree["params_axes"])
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def flax_own_rules(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    del rules  # each box carries its own
    return jax.tree.map(
        lambda box: NamedSharding(mesh, nn.logical_to_mesh_axes(box.names, box.rules)),
        tree,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of tree: how to build one of about ``leaves`` leaves, and each side's call."""

    name: str
    build: Callable[[int, tuple], Any]
    ours: Callable[[Any, jax.sharding.Mesh, tuple], Any]
    flax: Callable[[Any, jax.sharding.Mesh, tuple], Any]


KINDS = (
    Kind("linen", lambda n, rules: linen_tree(n), library, flax_linen),
    Kind("specs", lambda n, rules: linen_tree(n), library_specs, flax_linen),
    Kind("nnx", lambda n, rules: nnx_state(n), library, flax_nnx),
    Kind("train_state", lambda n, rules: train_state(n), library, flax_linen),
    Kind("params_axes", lambda n, rules: params_axes_tree(n), library, flax_params_axes),
    Kind("own_rules", lambda n, rules: linen_tree(n, rules=rules), library, flax_own_rules),
    Kind("corrections", lambda n, rules: linen_tree(n, odd_heads=True), library, flax_linen),
)


def is_box(x: Any) -> bool:
    return isinstance(x, (nn.Partitioned, nnx.Variable))


def arrays(tree: Any) -> list[Any]:
    """The tree's arrays, unboxed, in flattening order (``params_axes`` holds none)."""
    return [getattr(x, "value", x) for x in jax.tree.leaves(tree, is_leaf=is_box)]


def quietly(fn: Callable[[], Any]) -> Any:
    # The library's warning for what it corrected is built (and timed), then ignored.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return fn()


def library_caches() -> dict[str, Callable[[], None]]:
    """Every ``functools`` cache in the loaded ``flax_escale`` modules, by qualified name."""
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("flax_escale"):
            continue
        for attr, value in vars(module).items():
            cached = callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info")
            if cached and getattr(value, "__module__", module_name) == module_name:
                found[f"{module_name}.{attr}"] = value.cache_clear
    return found


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()  # untimed: no call pays for garbage another left
    start = time.perf_counter()
    result = quietly(fn)
    seconds = time.perf_counter() - start
    del result
    return seconds


def measure(
    kind: Kind,
    tree: Any,
    mesh: jax.sharding.Mesh,
    rules: tuple,
    rounds: int,
    caches: dict,
    cold: bool,
) -> dict[str, float]:
    """Median seconds of each side over interleaved rounds (A B, B A, ...)."""

    def ours() -> float:
        if cold:
            for clear in caches.values():
                clear()
        return timed(lambda: kind.ours(tree, mesh, rules))

    runs = {"ours": ours, "flax": lambda: timed(lambda: kind.flax(tree, mesh, rules))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in (kind.ours, kind.flax):  # warm: the caches hold what this call leaves
        quietly(lambda fn=fn: fn(tree, mesh, rules))
    order = ["ours", "flax"]
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(runs[name]())
    return {name: statistics.median(found) for name, found in times.items()}


def agreement(kind: Kind, tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> tuple[int, int]:
    """How many of the tree's arrays get a sharding equivalent to Flax's, and of how many."""
    ranks = [len(x.shape) for x in arrays(tree)]
    ours = jax.tree.leaves(quietly(lambda: kind.ours(tree, mesh, rules)))
    theirs = jax.tree.leaves(kind.flax(tree, mesh, rules))
    same = sum(a.is_equivalent_to(b, n) for a, b, n in zip(ours, theirs, ranks, strict=True))
    return same, len(ranks)


def distinct(tree: Any) -> int:
    """Distinct (annotation, shape) pairs among the tree's arrays."""
    _, items = quietly(lambda: fe.plan.annotated_leaves(tree))
    return len({(None if a is None else a.axes, tuple(v.shape)) for _, v, a in items})


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(example("backend_choice").describe(DEVICES))
    mesh = fe.create_mesh((1, 4, 1, 2, 1), devices=DEVICES)
    rules = fe.PartitionAxis().logical_axis_rules()
    for kind in KINDS:  # import-time and first-call costs out of the way
        quietly(lambda kind=kind: kind.ours(kind.build(40, rules), mesh, rules))
    caches = library_caches()
    print(f"mesh {dict(mesh.shape)}; gc enabled: {gc.isenabled()}; {rounds} rounds per condition")
    print("caches cleared before each cold call of the library:")
    for name in caches:
        print(f"  {name}")
    print(
        f"{'kind':>11} {'leaves':>7} {'distinct':>8} {'agree':>13} {'cache':>5} "
        f"{'flax_escale s':>13} {'flax s':>8} {'flax / flax_escale':>18}"
    )
    for kind in KINDS:
        for size in SIZES:
            tree = kind.build(size, rules)
            # What building it left in JAX's caches (tracing an NNX model of 100,000 variables
            # leaves hundreds of thousands of objects) weighs on every call that allocates.
            jax.clear_caches()
            gc.collect()
            same, leaves = agreement(kind, tree, mesh, rules)
            pairs = distinct(tree)
            for cold in (True, False):
                times = measure(kind, tree, mesh, rules, rounds, caches, cold)
                print(
                    f"{kind.name:>11} {leaves:>7} {pairs:>8} "
                    f"{f'{same}/{leaves}':>13} {'cold' if cold else 'warm':>5} "
                    f"{times['ours']:>13.4f} {times['flax']:>8.4f} "
                    f"{times['flax'] / times['ours']:>17.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
