"""The sharding report as one web page: mesh, memory per device, every array and its blocks.

The page is self-contained (its style and script inline, nothing fetched), so it opens from a
file, offline, and can be attached to an issue. The plan travels as one JSON document inside
it; the script draws the tables and, for the array one clicks (or names in the address,
``report.html#path=params/wte/embedding``), the grid of which device holds which block. Blocks
come from :func:`~flax_escale.sharding._measure.device_blocks`, once per distinct shape and
spec, so GPT-2-XL with Adam (1,742 arrays) is a page of about 1 MB.
"""

from __future__ import annotations

import html
import importlib.resources
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_text
from flax_escale._units import format_bytes
from flax_escale.errors import EscaleError
from flax_escale.plan import PlanEntry, ShardingPlan
from flax_escale.plan._explain import explain_entry
from flax_escale.plan._leaves import _in_opt_state
from flax_escale.sharding._measure import device_blocks, device_ids
from flax_escale.tools._memory_bars import memory_by_device

__all__ = ["MARKER", "page_data", "render_html", "write_html"]

MARKER = '<meta name="generator" content="flax_escale sharding report">'
"""In the head of every page written: a file without it was not written by the library."""

_PLACEHOLDER = re.compile(r"\{\{(title|data)\}\}")
# The marker sits near the top of a page: this much of an existing file is read to find it.
_HEAD_BYTES = 4096


def render_html(
    plan: ShardingPlan, *, baseline: ShardingPlan | None = None, title: str | None = None
) -> str:
    """The plan as one self-contained HTML page.

    The page shows the mesh (its axes and where each device sits), each device's bytes as a
    bar (parameters, then optimizer state: arrays under an ``opt_state`` path component)
    against the ideal share, and a table of every array (path, shape, dtype, logical axes,
    spec, bytes on the fullest device, where its annotation came from, corrections) with a
    filter box. Clicking an array draws which block each device holds, with the plan's
    explanation of its spec; ``page.html#path=PATH`` opens on that array. With ``baseline``,
    a section lists the arrays whose layout differs from it.

    The page needs no network: its style, script and data are inline.

    Args:
        plan: The plan to show (``plan_sharding``, ``sharding_report(...).plan``).
        baseline: A plan to compare with (the "before"; ``plan`` is the "after").
        title: The page's title; defaults to the mesh and the number of arrays.

    Returns:
        The page, as text.

    Raises:
        EscaleTypeError: If ``plan`` or ``baseline`` is not a ``ShardingPlan`` or ``title``
            not a string.

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> import flax_escale as fe
        >>> from flax_escale.tools._html import render_html
        >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> plan = fe.plan_sharding(model, fe.create_mesh((1, 4, 1, 2, 1)), 0, jnp.ones((2, 8)))
        >>> page = render_html(plan, title="dense </script>")
        >>> page.startswith("<!DOCTYPE html>"), "dense &lt;/script&gt;" in page
        (True, True)
        >>> "http://" in page or "https://" in page
        False
    """
    data = page_data(plan, baseline=baseline, title=title)
    # JSON inside <script> ends at the first "</script": no "<" (nor ">", "&") is left in it.
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    parts = {"title": html.escape(data["title"]), "data": blob}
    return _PLACEHOLDER.sub(lambda match: parts[match.group(1)], _template())


def page_data(
    plan: ShardingPlan, *, baseline: ShardingPlan | None = None, title: str | None = None
) -> dict[str, Any]:
    """What the page embeds, as JSON-ready data (see :func:`render_html` for the arguments).

    ``mesh``: axes, sizes and device ids in mesh order; ``devices``: per device (mesh order)
    its id and bytes of parameters and of optimizer state; ``layouts``: per distinct shape and
    spec, the distinct ``blocks`` and, per device in mesh order, the index of the one it holds
    (``of``); ``arrays``: per array its text fields, ``itemsize``, exact ``bytes`` on the
    fullest device, the index of its ``layout`` and its ``explain`` text; ``diff``: the
    baseline's comparison (``summary`` and ``rows``) or ``None``.

    Raises:
        EscaleTypeError: As :func:`render_html` does.
    """
    plan = check.instance(plan, ShardingPlan, "plan", "fe.plan_sharding(model, mesh, rng, x)")
    if baseline is not None:
        check.instance(baseline, ShardingPlan, "baseline", "the plan on another mesh")
    if title is not None:
        check.string(title, "title", "'GPT-2 on 8 devices'")
    mesh = plan.mesh
    order = [int(device) for device in device_ids(mesh).flat]
    position = {device: i for i, device in enumerate(order)}
    layouts: list[dict[str, Any]] = []
    layout_of: dict[tuple[tuple[int, ...], PartitionSpec], int] = {}
    arrays = []
    for entry in plan:
        key = (entry.shape, entry.spec)
        if key not in layout_of:
            layout_of[key] = len(layouts)
            layouts.append(_layout(entry, mesh, position))
        layout = layouts[layout_of[key]]
        arrays.append(_array(plan, entry, layout_of[key], layout))
    held = memory_by_device(plan)
    devices = [{"id": d, "params": held[d][0], "opt": held[d][1]} for d in order]
    totals = [p + o for p, o in held.values()]
    return {
        "title": title if title is not None else _default_title(plan),
        "summary": _summary(plan, totals),
        "notes": list(plan.notes),
        "mesh": {
            "axes": list(mesh.axis_names),
            "sizes": list(mesh.shape.values()),
            "devices": order,
        },
        "devices": devices,
        "ideal": plan.nbytes / len(order),
        "layouts": layouts,
        "arrays": arrays,
        "diff": None if baseline is None else _diff(baseline, plan),
    }


def write_html(path: str | os.PathLike[str], page: str) -> Path:
    """Writes ``page`` to ``path``, replacing only a page the library wrote itself.

    The page is written beside its destination and moved into place, so a reader never sees
    half of it.

    Args:
        path: Where to write.
        page: The page (:func:`render_html`).

    Returns:
        The path written.

    Raises:
        EscaleTypeError: If ``path`` is not a path.
        EscaleError: If ``path`` is a folder, its folder is missing or cannot be written
            (no permission, a read-only file system), or it is a file the library did not
            write (it is left as it is).
    """
    target = Path(check.path(path, "html"))
    try:
        _write(target, path, page)
    except OSError as error:
        raise EscaleError(
            f"html={os.fspath(path)!r}: cannot write the report: {error.strerror or error} "
            f"({error.filename or os.fspath(path)!r}); write it to a folder you can write to."
        ) from None
    return target


def _write(target: Path, path: str | os.PathLike[str], page: str) -> None:
    if target.is_dir():
        raise EscaleError(
            f"html={os.fspath(path)!r} is a folder; name a file in it, such as "
            f"{str(target / 'sharding_report.html')!r}."
        )
    if not target.parent.is_dir():
        raise EscaleError(
            f"html={os.fspath(path)!r}: the folder {str(target.parent)!r} does not exist; "
            "create it first, or write the report elsewhere."
        )
    if target.exists() and not _ours(target):
        raise EscaleError(
            f"html={os.fspath(path)!r} exists and is not a sharding report written by "
            "flax_escale (it has no generator tag of ours); the library never overwrites a file "
            "it did not create: choose another path, or move that file away yourself."
        )
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        partial.write_text(page, encoding="utf-8")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _ours(path: Path) -> bool:
    # A file that cannot be read is not known to be ours: write_html says why it stops.
    with path.open("rb") as file:
        return MARKER.encode() in file.read(_HEAD_BYTES)


def _template() -> str:
    return importlib.resources.files("flax_escale.tools").joinpath("report.html").read_text("utf-8")


def _layout(entry: PlanEntry, mesh: Mesh, position: dict[int, int]) -> dict[str, Any]:
    held: list[tuple[tuple[int, int], ...]] = [()] * len(position)
    for device, block in device_blocks(entry.shape, entry.spec, mesh):
        held[position[device]] = block
    distinct = list(dict.fromkeys(held))
    index = {block: i for i, block in enumerate(distinct)}
    return {
        "blocks": [[list(dim) for dim in block] for block in distinct],
        "of": [index[block] for block in held],
    }


def _array(
    plan: ShardingPlan, entry: PlanEntry, layout_index: int, layout: dict[str, Any]
) -> dict[str, Any]:
    annotation = entry.annotation
    if annotation is None:
        axes, source = "-", "none (replicated)"
    else:
        given = annotation.logical_axes
        axes = str(given) if given is not None else f"mesh {annotation.mesh_axes}"
        source = annotation.source or "-"
    resolution = entry.resolution
    itemsize = np.dtype(entry.dtype).itemsize
    fullest = max(math.prod(stop - start for start, stop in block) for block in layout["blocks"])
    return {
        "path": entry.path,
        "shape": list(entry.shape),
        "dtype": str(entry.dtype),
        "itemsize": itemsize,
        "axes": axes,
        "spec": str(entry.spec),
        "bytes": fullest * itemsize,
        "source": source,
        "notes": [f"dim {c.dim}: {c.detail}" for c in resolution.corrections]
        + [f"no rule for {name!r}" for name in resolution.unknown_names]
        + [c.detail for c in resolution.completed],
        "opt": _in_opt_state(entry.path),
        "layout": layout_index,
        "explain": explain_entry(entry, plan.mesh, plan.rules),
    }


def _default_title(plan: ShardingPlan) -> str:
    return f"Sharding plan: {len(plan)} arrays on mesh ({mesh_text(plan.mesh.shape)})"


def _summary(plan: ShardingPlan, totals: list[int]) -> str:
    ideal = plan.nbytes / len(totals)
    top = max(totals)
    return (
        f"{len(plan)} arrays, {format_bytes(plan.nbytes)} in all; per device "
        f"{format_bytes(top)} max, {format_bytes(min(totals))} min, ideal "
        f"{format_bytes(ideal)} (balance {top / ideal if ideal else 1.0:.2f}x the ideal share); "
        f"{len(plan.corrections)} corrections, {len(plan.completions)} idle axes put to use, "
        f"{len(plan.unannotated)} unannotated."
    )


def _diff(baseline: ShardingPlan, plan: ShardingPlan) -> dict[str, Any]:
    changes = baseline.diff(plan)
    return {"summary": changes.summary(), "rows": [list(row) for row in changes.rows()]}
