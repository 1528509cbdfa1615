"""Mistakes users make with the static plan, one case each.

Cases for the annotation readers (``Annotation``, ``annotated_leaves``, ``read_annotation``),
``build_plan``, ``logical_to_mesh_sharding`` and the optimizer state (``init_opt_state``,
``opt_state_shardings``). What a case asserts, and the rest of the table:
``support/mistakes.py``.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    X,
    case,
    mesh5,
    params,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import plan as fep

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fe.opt_state_shardings(TX, params(), shard_over="dp"),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="opt_state_shardings-shard_over-string",
    ),
    case(
        lambda: fe.init_opt_state(TX, params(), shard_over="dp"),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="init_opt_state-shard_over-string",
    ),
    case(
        lambda: fe.init_opt_state(TX, params(), shard_over=("dp",) * 1000),
        fe.EscaleError,
        "shard_over",
        "'dp' is named 1000 times",
        r"name each axis once",
        id="init_opt_state-shard_over-repeated",
    ),
    # --- wrong entries inside a sequence of names ------------------------------------------
    case(
        lambda: fe.opt_state_shardings(TX, params(), shard_over=("dp", 1)),
        T,
        "shard_over",
        "int 1",
        "not a string",
        id="shard_over-entry-int",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fe.logical_to_mesh_sharding({"w": P("batch")}, None),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="logical_to_mesh_sharding-mesh-none",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding({"w": "batch"}, mesh5()),
        T,
        "tree",
        "'batch'",
        r"PartitionSpec\('batch'\)",
        id="logical_to_mesh_sharding-leaf-string",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding("params", mesh5()),
        T,
        "tree",
        "'params'",
        r"jax\.eval_shape",
        id="logical_to_mesh_sharding-tree-string",
    ),
    case(
        lambda: fe.opt_state_shardings(None, params()),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="opt_state_shardings-tx-none",
    ),
    case(
        lambda: fe.opt_state_shardings("adam", params()),
        T,
        "tx",
        "'adam'",
        r"optax\.adam\(1e-3\), not its name",
        id="opt_state_shardings-tx-name",
    ),
    case(
        lambda: fe.init_opt_state(optax.adam, params()),
        T,
        "tx",
        "function",
        r"call the factory first, e\.g\. optax\.adam\(1e-3\)",
        id="init_opt_state-tx-factory",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fep.build_plan(jax.tree.structure({}), [], "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="build_plan-mesh-string",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), [("w", X, None)], mesh5(), notes="n"),
        T,
        "notes",
        "'n'",
        r"pass \('n',\)",
        id="build_plan-notes-string",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), [("w", "x", None)], mesh5()),
        T,
        "the leaf 'w'",
        "str 'x'",
        r"make it one \(jnp.asarray",
        id="build_plan-item-not-an-array",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding({"w": jnp.zeros((8, 4)), "step": 3}, mesh5()),
        T,
        "the leaf 'step'",
        "int 3",
        r"keep it out of the tree, or make it one",
        id="logical_to_mesh_sharding-python-int-leaf",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), {"w": X}, mesh5()),
        T,
        "items",
        "dict",
        r"annotated_leaves\(tree\)\[1\]",
        id="build_plan-items-dict",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0, "v": 0}), [("w", X, None)], mesh5()),
        T,
        "treedef",
        "PyTreeDef",
        r"the treedef annotated_leaves\(tree\) gives",
        id="build_plan-treedef-of-other-leaves",
    ),
    case(
        lambda: fep.build_plan(
            jax.tree.structure({"w": 0, "v": 0}), [("w", X, None), ("w", X, None)], mesh5()
        ),
        fe.EscaleError,
        "build_plan",
        "'w' 2 times",
        r"give each item its own path",
        id="build_plan-path-twice",
    ),
    case(
        lambda: fep.annotated_leaves("params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="annotated_leaves-string",
    ),
    case(
        lambda: fep.Annotation(logical_axes="batch"),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="Annotation-logical_axes-string",
    ),
    case(
        lambda: fep.read_annotation(X, source=3),
        T,
        "source",
        "int 3",
        "'sharded_module'",
        id="read_annotation-source-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
