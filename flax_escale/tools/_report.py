"""What users look at before training: the sharding report of every array's layout."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from rich.console import Console

from flax_escale import _checks as check
from flax_escale._specs import mesh_text
from flax_escale._tables import FittedTable
from flax_escale._units import format_bytes
from flax_escale.errors import EscaleError, EscaleTypeError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.plan import (
    AnnotatedLeaf,
    ShardingPlan,
    annotated_leaves,
    arrays_only,
    build_plan,
)
from flax_escale.resolve import RulesLike, as_logical_rules
from flax_escale.resolve._fit import Correction
from flax_escale.sharding._measure import LayoutFigures, measure_layout
from flax_escale.tools._html import render_html, write_html

__all__ = ["ShardingReport", "sharding_report"]


@dataclasses.dataclass(frozen=True)
class ShardingReport(LayoutFigures):
    """A layout's figures, with the plan they come from.

    Attributes:
        total_parameters: Elements of all arrays.
        sharded_parameters: Elements of arrays split over at least one mesh axis.
        total_bytes: Bytes of all arrays.
        bytes_per_device: Bytes each device holds, by device id (exact: a dimension its axes
            do not divide counts as the padded blocks XLA gives each device).
        max_device_bytes: The fullest device's bytes.
        min_device_bytes: The emptiest device's bytes.
        balance_score: ``min / max`` device bytes (1.0 when every device holds the same, which
            a fully replicated layout also gives: :attr:`fullest_share` says how far the
            fullest device is from its share).
        ideal_device_bytes: ``total_bytes / devices``.
        partition_stats: For each spec (as text): arrays, elements and bytes using it.
        plan: The plan the report shows (every array, its annotation, spec and corrections).
    """

    plan: ShardingPlan

    @property
    def corrections(self) -> tuple[tuple[str, Correction], ...]:
        """Every ``(path, correction)``."""
        return self.plan.corrections

    def rows(self) -> list[dict[str, Any]]:
        """One dict per array: its layout and, briefly, why.

        Keys: path, shape, dtype, logical axes, who annotated it (``source``), spec, bytes per
        device, and notes (corrections, rules passed over, idle axes put to use);
        ``plan.explain(path)`` tells the whole story of one row.
        """
        mesh = self.plan.mesh
        return [
            {
                "path": e.path,
                "shape": e.shape,
                "dtype": str(e.dtype),
                "logical_axes": None if e.annotation is None else e.annotation.logical_axes,
                "source": None if e.annotation is None else e.annotation.source,
                "spec": e.spec,
                "bytes_per_device": e.nbytes_per_device(mesh),
                "notes": [c.detail for c in e.resolution.corrections]
                + [f"no rule for {n!r}" for n in e.resolution.unknown_names]
                + [
                    f"{p.mesh_axes} passed over on dim {p.dim} (size {p.size})"
                    for p in e.resolution.passed_over
                    if not e.resolution.corrections
                ]
                + [c.detail for c in e.resolution.completed],
            }
            for e in self.plan
        ]

    @property
    def fullest_share(self) -> float:
        """The fullest device's bytes over the ideal share (``total_bytes / devices``).

        1.0 when every device holds its share; 3.0 when one holds three times its share (a
        replicated array on 3 devices, say). ``balance_score`` (``min / max``) reads 1.0 for a
        layout that replicates everything, as every device then holds the same.
        """
        return self.max_device_bytes / self.ideal_device_bytes if self.ideal_device_bytes else 1.0

    def summary(self) -> str:
        """One line: the bytes in all and per device, the balance and the corrections."""
        return (
            f"total {format_bytes(self.total_bytes)}; per device "
            f"{format_bytes(self.max_device_bytes)} max, "
            f"{format_bytes(self.min_device_bytes)} min, "
            f"ideal {format_bytes(self.ideal_device_bytes)}; balance "
            f"{self.fullest_share:.2f}x the ideal share (fullest device); "
            f"{len(self.corrections)} corrections"
        )

    def describe(self) -> str:
        """The report as plain text: every array (``plan.describe()``), then :meth:`summary`."""
        return f"{self.plan.describe()}\n{self.summary()}"

    def table(self) -> FittedTable:
        """The report as a ``rich`` table that fits the width it is printed at.

        Paths are folded, never cut; empty columns are left out, then, as the width shrinks,
        who annotated each array, its dtype, its logical axes, its shape and the notes, in
        that order; where path, spec and bytes per device do not fit, :meth:`describe`.
        """
        mesh = mesh_text(self.plan.mesh.shape)
        table = FittedTable(
            title=f"sharding plan on mesh ({mesh})",
            show_footer=True,
            caption=self.summary(),
            plain=self.describe,
        )
        # (header, gives way, narrowest useful width, wraps); 0 never gives way.
        columns = (
            ("path", 0, 28, True),
            ("shape", 2, 15, False),
            ("dtype", 4, 8, False),
            ("logical axes", 3, 20, True),
            ("annotated by", 5, 12, True),
            ("spec", 0, 20, True),
            ("bytes/device", 0, 12, False),
            ("notes", 1, 24, True),
        )
        for name, give_way, least, wrap in columns:
            table.add_column(
                name,
                give_way=give_way,
                least=least,
                path=name == "path",
                wrap=wrap,
                justify="right" if name == "bytes/device" else "left",
            )
        for row in self.rows():
            logical = "-" if row["logical_axes"] is None else str(row["logical_axes"])
            table.add_row(
                row["path"],
                str(row["shape"]),
                row["dtype"],
                logical,
                row["source"] or "-",
                str(row["spec"]),
                format_bytes(row["bytes_per_device"]),
                "; ".join(row["notes"]),
            )
        table.columns[0].footer = f"{len(self.plan)} arrays"
        table.columns[6].footer = format_bytes(self.max_device_bytes)
        return table

    def __rich__(self) -> FittedTable:
        return self.table()


def sharding_report(
    tree: Any,
    mesh: Mesh | None = None,
    *,
    rules: RulesLike = None,
    console: Console | None = None,
    show: bool = True,
    html: str | os.PathLike[str] | None = None,
    baseline: ShardingPlan | None = None,
) -> ShardingReport:
    """Prints a table of how every array of ``tree`` is laid out, and returns the figures.

    ``tree`` is a :class:`~flax_escale.ShardingPlan` (from ``plan_sharding``: nothing needs to
    exist yet), an NNX module, or any pytree of arrays, ``jax.ShapeDtypeStruct`` or Flax boxes.
    Logical annotations (Linen boxes, NNX ``logical_axes`` metadata) are resolved with
    ``rules``; otherwise an array's own ``NamedSharding`` is shown.

    A report shows one mesh, and arrays where they are. A plan is shown on its own mesh (or
    ``mesh=`` of the same axes and sizes: real devices for a plan loaded from JSON); to see
    a model on another mesh or with other rules, plan it again. Arrays that carry a
    ``NamedSharding`` are shown on their mesh: a tree whose arrays live on two meshes (a
    serving layout with some weights on a sub-mesh), or ``mesh=`` other than theirs, is
    refused, naming each mesh and its arrays; report each mesh's part of the tree apart.

    With ``html``, the report is also written as one self-contained web page (no network
    needed to open it): the mesh, each device's memory (parameters apart from optimizer
    state, against the ideal share), every array in a table with a filter, and for the array
    one clicks, which block each device holds and why its spec came out so
    (``page.html#path=PATH`` opens on one array). The library replaces only a page it wrote
    itself. With ``baseline``, a plan on another mesh or of another version, the arrays whose
    layout differs are listed too (printed, and on the page).

    Args:
        tree: What to report on.
        mesh: The mesh; defaults to the plan's, the arrays', then the current mesh. For a
            plan, a mesh of its axes and sizes; for arrays with a ``NamedSharding``, theirs
            (or an abstract mesh of its shape).
        rules: Logical-axis rules for logical annotations; for a plan, only its own
            (``plan.rules``) or ``None``.
        console: Where to print (a ``rich`` console); defaults to standard output.
        show: Print the table; ``False`` only returns the figures.
        html: Also write the report as a web page to this file (``str`` or ``os.PathLike``).
        baseline: A plan to compare with (the "before"; this report's plan is the "after").

    Returns:
        A :class:`ShardingReport`.

    Raises:
        NoMeshError: If no mesh is given, carried by the arrays, or set.
        EscaleTypeError: If ``tree`` holds no array, ``mesh`` is not a mesh, ``console`` is
            not a console, ``show`` not a bool, ``html`` not a path or ``baseline`` not a
            ``ShardingPlan``.
        EscaleError: If ``html`` names a folder, a file in a missing folder, or an existing
            file the library did not write (it is never overwritten); if ``mesh`` is not the
            plan's axes and sizes, or not where the arrays live; if the arrays live on more
            than one mesh; if ``rules`` are given with a plan made with others; or if
            ``console`` is given with ``show=False``, or ``baseline`` with neither ``show``
            nor ``html`` (nothing would use them).

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh, sharding_report
        >>> blocks = NamedSharding(create_mesh((1, 4, 1, 2, 1)), PartitionSpec("fsdp", "tp"))
        >>> w = jax.device_put(np.zeros((8, 4), np.float32), blocks)  # 2 x 2 on each device
        >>> report = sharding_report({"w": w}, show=False)
        >>> report.total_bytes, report.max_device_bytes, report.balance_score
        (128, 16, 1.0)
        >>> import pathlib, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     page = pathlib.Path(folder, "report.html")
        ...     _ = sharding_report({"w": w}, show=False, html=page)
        ...     'content="flax_escale sharding report"' in page.read_text()
        True
    """
    show = check.flag(show, "show")
    if html is not None:
        check.path(html, "html")
    if baseline is not None:
        check.instance(
            baseline, ShardingPlan, "baseline", "fe.plan_sharding(model, other_mesh, rng, x)"
        )
    if console is not None and not callable(getattr(console, "print", None)):
        raise EscaleTypeError(
            f"console must be a rich.console.Console, got {check.describe(console)}; pass "
            "rich.console.Console() (or Console(file=...) to print elsewhere), or None."
        )
    _check_used(show=show, console=console, html=html, baseline=baseline)
    plan = as_plan(tree, mesh, rules)
    abstract = plan.treedef.unflatten([jax.ShapeDtypeStruct(e.shape, e.dtype) for e in plan])
    report = measure_layout(abstract, plan.specs(), plan.mesh, into=ShardingReport, plan=plan)
    if show:
        out = console or Console()
        out.print(report.table())
        if baseline is not None:
            out.print(baseline.diff(plan).table())
    if html is not None:
        write_html(html, render_html(plan, baseline=baseline))
    return report


def _check_used(*, show: bool, console: Any, html: Any, baseline: Any) -> None:
    # What is only printed or written must not be given where nothing is printed or written.
    if not show and console is not None:
        raise EscaleError(
            "sharding_report: console= is where the table is printed, but show=False prints "
            "nothing; drop console=, or leave show=True."
        )
    if not show and html is None and baseline is not None:
        raise EscaleError(
            "sharding_report: baseline= lists what changed in the printed table and on the "
            "page, but show=False and no html= show neither; pass html=, leave show=True, or "
            "compare the plans yourself: baseline.diff(report.plan)."
        )


def as_plan(tree: Any, mesh: Mesh | AbstractMesh | None, rules: RulesLike) -> ShardingPlan:
    """The plan a report (or ``check_sharded``) shows of ``tree``, on its one mesh."""
    mesh = check.optional_mesh(mesh)
    if isinstance(tree, ShardingPlan):
        return _plan_on(tree, mesh, rules)
    check.tree_of_arrays(tree, "tree")
    treedef, items = annotated_leaves(tree, own_sharding=True)
    mesh = _mesh_of(items, mesh)
    if mesh is None:
        try:
            mesh = current_mesh()
        except NoMeshError:
            raise NoMeshError(
                "sharding_report: no mesh given, none on the arrays and none set; pass mesh=."
            ) from None
    treedef, arrays = arrays_only(treedef, items)
    with warnings.catch_warnings():
        # The report lists every correction itself.
        warnings.simplefilter("ignore")
        return build_plan(treedef, arrays, mesh, rules=rules)


def _plan_on(
    plan: ShardingPlan, mesh: Mesh | AbstractMesh | None, rules: RulesLike
) -> ShardingPlan:
    # A plan's specs are resolved already, for its own mesh and with its own rules: a mesh
    # of the same axes and sizes (real devices for a plan loaded from JSON) can stand for
    # its mesh; other rules or another shape would need a new plan, which only the model
    # can give.
    if rules is not None and as_logical_rules(rules) != plan.rules:
        raise EscaleError(
            "sharding_report: rules= cannot apply to a ShardingPlan, whose specs were resolved "
            "with its own rules (plan.rules); plan the model with these rules "
            "(fe.plan_sharding(model, mesh, rng, *inputs, rules=rules)) and report that plan, "
            "or leave rules=None."
        )
    if mesh is None or mesh is plan.mesh:
        return plan
    if dict(mesh.shape) != dict(plan.mesh.shape):
        raise EscaleError(
            f"sharding_report: mesh=({mesh_text(mesh.shape)}) is not the plan's mesh "
            f"({mesh_text(plan.mesh.shape)}), for which its specs were resolved; plan the "
            "model on this mesh (fe.plan_sharding(model, mesh, rng, *inputs)) and report that "
            "plan (plan.diff(other) lists what changes), or leave mesh=None."
        )
    return dataclasses.replace(plan, mesh=mesh)


def _mesh_of(
    items: list[AnnotatedLeaf], given: Mesh | AbstractMesh | None
) -> Mesh | AbstractMesh | None:
    # The one mesh the arrays that carry a NamedSharding live on (checked against mesh=
    # when it is given): a report shows one mesh, and shows arrays where they are.
    homes: dict[Any, tuple[Mesh | AbstractMesh, list[str]]] = {}
    for path, value, _ in items:
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding):
            homes.setdefault(_where(sharding.mesh), (sharding.mesh, []))[1].append(path)
    if given is not None:
        elsewhere = [home for key, home in homes.items() if not _same_place(_where(given), key)]
        if elsewhere:
            raise EscaleError(
                f"sharding_report: mesh=({_mesh_and_devices(given)}) is not where the arrays "
                f"live: {_homes_text(elsewhere)}; a report shows arrays where they are: leave "
                "mesh=None (their own mesh is used), or place them on this mesh first "
                "(fe.reshard_tree)."
            )
        return given
    if len(homes) > 1:
        raise EscaleError(
            f"sharding_report: the arrays live on {len(homes)} meshes: "
            f"{_homes_text(list(homes.values()))}; a report shows one mesh: report the arrays "
            "of each mesh apart (sharding_report(part) for each part of the tree)."
        )
    return next(iter(homes.values()))[0] if homes else None


def _where(mesh: Mesh | AbstractMesh) -> tuple[Any, ...]:
    # Axes, sizes and devices (None for an abstract mesh): the axis types do not change
    # which device holds which block.
    ids = None if isinstance(mesh, AbstractMesh) else tuple(d.id for d in mesh.devices.flat)
    return tuple(mesh.shape.items()), ids


def _same_place(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    # An abstract mesh stands for any devices in its shape.
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def _mesh_and_devices(mesh: Mesh | AbstractMesh) -> str:
    ids = _where(mesh)[1]
    if ids is None:
        return f"{mesh_text(mesh.shape)}; abstract"
    if list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{mesh_text(mesh.shape)}; devices {ids[0]}-{ids[-1]}"
    return f"{mesh_text(mesh.shape)}; devices {list(ids)}"


def _homes_text(homes: list[tuple[Mesh | AbstractMesh, list[str]]]) -> str:
    parts = []
    for mesh, paths in homes:
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        parts.append(f"{paths[0]!r}{more} on ({_mesh_and_devices(mesh)})")
    return ", ".join(parts)
