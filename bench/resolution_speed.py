"""B3: time to compute a model's shardings from its logical annotations, against Flax's own.

Run: ``python bench/resolution_speed.py [rounds]`` (default 5 rounds per condition).

What is compared, in one process, on the same tree, mesh and rules
(``PartitionAxis().logical_axis_rules()``), on 8 simulated CPU devices (mesh ``dp=1, fsdp=4,
ep=1, tp=2, sp=1``):

- flax_escale, input ``boxes``: ``fe.logical_to_mesh_sharding(tree, mesh, rules)``, the
  library's drop-in given the annotated tree itself. It reads every annotation and resolves it
  *shape-aware*: a rule whose mesh axes do not divide the dimension is passed over, what still
  does not fit is corrected and warned about (``strict`` raises), optimizer state would follow
  its parameter. It returns one ``NamedSharding`` per array.
- flax_escale, input ``specs``: ``fe.logical_to_mesh_sharding(nn.get_partition_spec(tree),
  mesh, rules)``: the same input as Flax's, so not shape-aware (there is no shape to see).
- Flax: ``nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)``. It takes
  specs, not arrays: it never sees a shape, checks nothing, and hands back whatever the rules
  say, divisible or not.

Every call is timed end to end from the same boxed tree (``nn.get_partition_spec`` included
where it is called). The trees are what ``jax.eval_shape`` of a Linen ``init`` gives for a
decoder-only transformer annotated with this library's logical names: ``{"params": ...}`` of
``nn.LogicallyPartitioned`` boxes around ``jax.ShapeDtypeStruct``, an embedding, then per layer
attention kernels (query, grouped key/value, output), a gated MLP (two input kernels, an output
kernel and bias) and two norm scales, then a final norm and an output head: about 1,000, 10,000
and 100,000 leaves. Every layer has its own widths (no two layers share a shape), so about 60%
of the leaves are distinct ``(names, shape)`` pairs and a cache keyed by them has little to
reuse. Every dimension is divisible by the mesh axes its rules name, so all three must agree:
the script checks it for every leaf (``NamedSharding.is_equivalent_to`` on the leaf's rank).

Conditions: the garbage collector stays on (``gc.collect()`` runs, untimed, before each timed
call so that no call pays for garbage another left); the three calls run in interleaved rounds
(boxes, specs, Flax, then Flax, specs, boxes, ...) and each reports the median of its rounds.
*Cold*: every cache of the library (each ``functools`` cache in any loaded ``flax_escale``
module, listed when the script starts; on the resolution path they are ``_rules._translated``,
``_rules._frozen`` and ``_logical.resolver``, which holds each resolver's memos) is cleared,
untimed, before each of its calls. *Warm*: the library's caches hold what the previous
identical call left there. Flax keeps no cache of its own, so its column is the same call in
both conditions, timed again in each; JAX's own caches (interned specs, shardings) are warm for
both sides throughout. Timings on a shared host are noisy; the ratio ``flax / flax_escale``
(above 1: the library is faster) is the number to read.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import backend_choice

# Measured on 8 simulated CPU devices on any host: the CPU platform is chosen before any
# backend starts, so an accelerator plugin is never started.
DEVICES = backend_choice.select_devices("cpu")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flax_escale as fe  # noqa: E402

SIZES = (1_000, 10_000, 100_000)
LEAVES_PER_LAYER = 10
VOCAB = 32_000


def box(shape: tuple[int, ...], names: tuple[str, ...]) -> nn.LogicallyPartitioned:
    return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def layer(i: int) -> dict[str, Any]:
    # Widths grow with the layer index, so no two layers share a shape; every size is a
    # multiple of 8, which the mesh axes any rule names (tp=2, fsdp*sp=4) divide.
    hidden = 512 + 8 * i
    heads, kv_heads, head_dim = 8 + 2 * (i % 5), 2 + 2 * (i % 3), 64 * (1 + i % 2)
    mlp = 4 * hidden + 16 * (i % 7)
    attention = ("hidden_state", "head", "attention_dim")
    kv = ("hidden_state", "kv_head", "attention_dim")
    return {
        "attention": {
            "query": {"kernel": box((hidden, heads, head_dim), attention)},
            "key": {"kernel": box((hidden, kv_heads, head_dim), kv)},
            "value": {"kernel": box((hidden, kv_heads, head_dim), kv)},
            "out": {
                "kernel": box((heads, head_dim, hidden), ("head", "attention_dim", "hidden_state"))
            },
        },
        "mlp": {
            "wi_0": {"kernel": box((hidden, mlp), ("hidden_state", "mlp_intermediate"))},
            "wi_1": {"kernel": box((hidden, mlp), ("hidden_state", "mlp_intermediate"))},
            "wo": {
                "kernel": box((mlp, hidden), ("mlp_intermediate", "hidden_state")),
                "bias": box((hidden,), ("hidden_state",)),
            },
        },
        "pre_attention_norm": {"scale": box((hidden,), ("hidden_state",))},
        "pre_mlp_norm": {"scale": box((hidden,), ("hidden_state",))},
    }


def model_tree(leaves: int) -> dict[str, Any]:
    """The abstract variables of a transformer with about ``leaves`` parameters."""
    layers = max(1, (leaves - 3) // LEAVES_PER_LAYER)
    last = 512 + 8 * (layers - 1)
    params: dict[str, Any] = {"embed": {"embedding": box((VOCAB, 512), ("vocab", "hidden_state"))}}
    params.update({f"layers_{i}": layer(i) for i in range(layers)})
    params["final_norm"] = {"scale": box((last,), ("hidden_state",))}
    params["lm_head"] = {"kernel": box((last, VOCAB), ("hidden_state", "vocab"))}
    return {"params": params}


def library(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return fe.logical_to_mesh_sharding(tree, mesh, rules)


def library_specs(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return fe.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)


def flax_builtin(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> Any:
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)


OURS = {"boxes": library, "specs": library_specs}


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
    result = fn()
    seconds = time.perf_counter() - start
    del result
    return seconds


def measure(
    tree: Any, mesh: jax.sharding.Mesh, rules: tuple, rounds: int, caches: dict, cold: bool
) -> dict[str, float]:
    """Median seconds of each function over interleaved rounds (A S B, B S A, ...)."""

    def ours(fn: Callable) -> Callable[[], float]:
        def run() -> float:
            if cold:
                for clear in caches.values():
                    clear()
            return timed(lambda: fn(tree, mesh, rules))

        return run

    runs = {name: ours(fn) for name, fn in OURS.items()}
    runs["flax"] = lambda: timed(lambda: flax_builtin(tree, mesh, rules))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in (*OURS.values(), flax_builtin):  # warm: the caches hold what this call leaves
        fn(tree, mesh, rules)
    order = ["boxes", "specs", "flax"]
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(runs[name]())
    return {name: statistics.median(found) for name, found in times.items()}


def equivalent(tree: Any, mesh: jax.sharding.Mesh, rules: tuple) -> dict[str, int]:
    """Per input, how many leaves get a sharding equivalent to Flax's."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    ranks = [len(box.value.shape) for box in jax.tree.leaves(tree, is_leaf=is_box)]
    theirs = jax.tree.leaves(flax_builtin(tree, mesh, rules))
    same = {}
    for name, fn in OURS.items():
        ours = jax.tree.leaves(fn(tree, mesh, rules))
        same[name] = sum(
            a.is_equivalent_to(b, rank) for a, b, rank in zip(ours, theirs, ranks, strict=True)
        )
    return same


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(backend_choice.describe(DEVICES))
    mesh = fe.create_mesh((1, 4, 1, 2, 1), devices=DEVICES)
    rules = fe.PartitionAxis().logical_axis_rules()
    library(model_tree(20), mesh, rules)  # import-time and first-call costs out of the way
    caches = library_caches()
    print(f"mesh {dict(mesh.shape)}; gc enabled: {gc.isenabled()}; {rounds} rounds per condition")
    print("caches cleared before each cold call of the library:")
    for name in caches:
        print(f"  {name}")
    print(
        "input boxes: fe.logical_to_mesh_sharding(tree, mesh, rules), shape-aware;\n"
        "input specs: fe.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules);\n"
        "flax:        nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)."
    )
    print(
        f"{'leaves':>7} {'distinct':>8} {'input':>5} {'equivalent':>11} {'cache':>5} "
        f"{'flax_escale s':>13} {'flax s':>8} {'flax / flax_escale':>18}"
    )
    for size in SIZES:
        tree = model_tree(size)
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        distinct = len({(tuple(b.names), b.value.shape) for b in leaves})
        same = equivalent(tree, mesh, rules)
        for cold in (True, False):
            times = measure(tree, mesh, rules, rounds, caches, cold)
            for name in OURS:
                print(
                    f"{len(leaves):>7} {distinct:>8} {name:>5} "
                    f"{f'{same[name]}/{len(leaves)}':>11} {'cold' if cold else 'warm':>5} "
                    f"{times[name]:>13.4f} {times['flax']:>8.4f} "
                    f"{times['flax'] / times[name]:>17.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
