"""Pinning a plan as a JSON snapshot, compared on every run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan import ShardingPlan
from flax_escale.plan._serialize import FORMAT

__all__ = ["UPDATE_SNAPSHOTS", "PlanMismatchError", "assert_plan_matches"]

UPDATE_SNAPSHOTS = "FLAX_ESCALE_UPDATE_SNAPSHOTS"
"""The environment variable that, set to ``1``, makes :func:`assert_plan_matches` write."""


class PlanMismatchError(EscaleError, AssertionError):
    """A plan differs from its snapshot (an ``AssertionError``: test runners report a failure)."""


def assert_plan_matches(
    plan: ShardingPlan, snapshot: str | os.PathLike[str], *, update: bool | None = None
) -> None:
    """Fails if ``plan`` differs from the plan kept in ``snapshot`` (a JSON file).

    Arrays are compared as :meth:`~flax_escale.ShardingPlan.diff` compares them (shape, dtype,
    logical axes, spec, bytes per device, corrections, arrays added or removed), and the
    meshes' shapes; where an annotation came from is not compared.

    Args:
        plan: The plan of the model as it is now.
        snapshot: The snapshot file (``ShardingPlan.to_json`` text).
        update: Write ``plan`` to ``snapshot`` instead of comparing; ``None`` (the default)
            reads the :data:`UPDATE_SNAPSHOTS` environment variable (``1``: write). Only a
            missing file or a plan snapshot is written over.

    Raises:
        PlanMismatchError: If the snapshot is missing or differs, listing each array that
            changed and saying how to update the snapshot.
        EscaleError: If ``snapshot`` exists but is not a plan snapshot (it is never
            overwritten then).
        EscaleTypeError: If ``plan`` is not a ``ShardingPlan`` or ``snapshot`` not a path.

    Example:
        >>> import tempfile, pathlib
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> import flax_escale as fe
        >>> from flax_escale.testing import assert_plan_matches
        >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> x = jnp.ones((2, 8))
        >>> snapshot = pathlib.Path(tempfile.mkdtemp()) / "dense.json"
        >>> plan = fe.plan_sharding(model, fe.create_mesh((1, 4, 1, 2, 1)), 0, x)
        >>> assert_plan_matches(plan, snapshot, update=True)  # written once, on purpose
        >>> assert_plan_matches(plan, snapshot)  # the same layout: passes
        >>> other = fe.plan_sharding(model, fe.create_mesh((1, 8, 1, 1, 1)), 0, x)
        >>> assert_plan_matches(other, snapshot)
        Traceback (most recent call last):
        ...
        flax_escale.testing._snapshot.PlanMismatchError: the plan differs from the snapshot ...
    """
    if not isinstance(plan, ShardingPlan):
        raise EscaleTypeError(
            f"assert_plan_matches: plan must be a ShardingPlan, got {check.describe(plan)}; "
            "pass fe.plan_sharding(model, mesh, rng, *args)."
        )
    if not isinstance(snapshot, (str, os.PathLike)):
        raise EscaleTypeError(
            f"assert_plan_matches: snapshot must be a file path, got "
            f"{check.describe(snapshot)}; pass e.g. 'tests/snapshots/model.json'."
        )
    path = Path(snapshot)
    if update is None:
        update = os.environ.get(UPDATE_SNAPSHOTS, "") == "1"
    update = check.flag(update, "update")
    text = _read_snapshot(path)
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan.to_json())
        return
    if text is None:
        raise PlanMismatchError(
            f"the snapshot {str(path)!r} does not exist. Write it once with "
            f"{UPDATE_SNAPSHOTS}=1 in the environment (or update=True), check it in, and "
            "review it like code."
        )
    changes = ShardingPlan.from_json(text).diff(plan)
    if changes:
        raise PlanMismatchError(
            f"the plan differs from the snapshot {str(path)!r} (before: the snapshot, after: "
            f"this plan):\n{changes.describe()}\nIf the change is meant, write the snapshot "
            f"again with {UPDATE_SNAPSHOTS}=1 in the environment and review its diff."
        )


def _read_snapshot(path: Path) -> str | None:
    # The text of a plan snapshot at `path`, None if there is no file; anything else there is
    # not ours, to read or to write over.
    if not path.exists():
        return None
    try:
        text = path.read_text()
        found = json.loads(text).get("format")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        found = error
    if found != FORMAT:
        raise EscaleError(
            f"assert_plan_matches: {str(path)!r} exists but is not a sharding plan snapshot "
            f"({found!r} where the format {FORMAT!r} was expected); it is left as it is. Give "
            "the snapshot a path of its own."
        )
    return text
