"""A transformer's train state as a plan, and the checks that a table is readable at a width.

Every table the library prints is rendered by the tests at 80, 100, 120 and 160 columns as a
log writes it (no terminal): :func:`assert_readable` checks that no line is wider than that,
that every path can be read back whole, in order, one row each, and which columns are shown.
"""

import functools
import io
import re

import flax.linen as nn
import jax
import numpy as np

import flax_escale as fe

WIDTHS = (80, 100, 120, 160)
"""The widths every table is printed at: a log, a laptop's terminal, a wide one."""

_LAYERS, _HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _MLP, _VOCAB = 4, 512, 8, 2, 64, 2048, 32000

_KERNELS = {
    "embed/embedding": ((_VOCAB, _HIDDEN), ("vocab", "hidden_state")),
    "blocks/attention/q_proj/kernel": (
        (_LAYERS, _HIDDEN, _HEADS, _HEAD_DIM),
        ("layers", "hidden_state", "head", "attention_dim"),
    ),
    "blocks/attention/k_proj/kernel": (
        (_LAYERS, _HIDDEN, _KV_HEADS, _HEAD_DIM),
        ("layers", "hidden_state", "kv_head", "attention_dim"),
    ),
    "blocks/attention/v_proj/kernel": (
        (_LAYERS, _HIDDEN, _KV_HEADS, _HEAD_DIM),
        ("layers", "hidden_state", "kv_head", "attention_dim"),
    ),
    # 3 key-value heads of bias on tp=2: corrected, so the notes have something to say.
    "blocks/attention/k_proj/bias": ((_LAYERS, 3, _HEAD_DIM), ("layers", "kv_head", None)),
    "blocks/attention/o_proj/kernel": (
        (_LAYERS, _HEADS, _HEAD_DIM, _HIDDEN),
        ("layers", "head", "attention_dim", "hidden_state"),
    ),
    "blocks/attention_norm/scale": ((_LAYERS, _HIDDEN), ("layers", "hidden_state")),
    "blocks/mlp/gate_proj/kernel": (
        (_LAYERS, _HIDDEN, _MLP),
        ("layers", "hidden_state", "mlp_intermediate"),
    ),
    "blocks/mlp/up_proj/kernel": (
        (_LAYERS, _HIDDEN, _MLP),
        ("layers", "hidden_state", "mlp_intermediate"),
    ),
    "blocks/mlp/down_proj/kernel": (
        (_LAYERS, _MLP, _HIDDEN),
        ("layers", "mlp_intermediate", "hidden_state"),
    ),
    "blocks/mlp_norm/scale": ((_LAYERS, _HIDDEN), ("layers", "hidden_state")),
    "final_norm/scale": ((_HIDDEN,), ("hidden_state",)),
    "lm_head/kernel": ((_HIDDEN, _VOCAB), ("hidden_state", "vocab")),
}


def _nest(flat):
    tree = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaf
    return tree


def transformer_state(corrected=True):
    """Parameters, Adam's two moments of each and its count, and the step: Flax boxes."""
    flat = {}
    for path, (shape, names) in _KERNELS.items():
        if not corrected and path.endswith("bias"):
            continue
        box = nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, np.float32), names)
        flat[f"params/{path}"] = box
        flat[f"opt_state/0/mu/{path}"] = box
        flat[f"opt_state/0/nu/{path}"] = box
    flat["opt_state/0/count"] = jax.ShapeDtypeStruct((), np.int32)
    flat["step"] = jax.ShapeDtypeStruct((), np.int32)
    return _nest(flat)


@functools.cache
def transformer_plan(mesh_dims=(1, 4, 1, 2, 1), corrected=True):
    """The train state's plan on a mesh (``create_mesh``'s sizes)."""
    mesh = fe.create_mesh(mesh_dims)
    return fe.sharding_report(transformer_state(corrected), mesh, show=False).plan


def rendered(renderable, width):
    """What a log of ``width`` columns holds once ``renderable`` is printed to it."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def header_cells(text):
    """The header row's cells (joined across the lines a wrapped header takes)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    end = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    rows = [line.strip("┃").split("┃") for line in lines[start + 1 : end]]
    return [" ".join(row[i].strip() for row in rows).strip() for i in range(len(rows[0]))]


def column(text, index=0):
    """The body's cells of one column, line by line (a folded path takes several)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("│"):
            break
        body.append(line.split("│")[index + 1].strip())
    return body


def assert_readable(text, width, keys, index=0):
    """``text`` fits ``width``, cuts nothing, and every key reads back whole, a row each.

    ``keys`` are what tells the rows apart (paths; a mesh's label), one per row, in order. In
    a table, column ``index`` is them, folded: its lines joined give them one after the
    other. In the plain form (a width where the table does not fit), each is there once its
    line breaks are taken out.
    """
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    assert "…" not in text, text
    assert len(set(keys)) == len(keys)

    def squeezed(value):
        return re.sub(r"\s", "", value)

    if any(line.startswith("┡") for line in lines):
        assert squeezed("".join(column(text, index))) == squeezed("".join(keys)), text
    else:
        for key in keys:
            assert squeezed(key) in squeezed(text), (key, text)
