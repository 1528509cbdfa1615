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
"""The environment variable that, set to ``1``, makes :func:`assert_plan_matches` write.

``true``, ``yes`` and ``on`` (in any case) mean the same; ``0``, ``false``, ``no``, ``off`` or
the variable unset or empty mean compare; any other value is an error.
"""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


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
            reads the :data:`UPDATE_SNAPSHOTS` environment variable (``1``, ``true``, ``yes``
            or ``on``: write). Only a missing file or a plan snapshot is written over.

    Raises:
        PlanMismatchError: If the snapshot is missing or differs, listing each array that
            changed and saying how to update the snapshot.
        EscaleError: If ``snapshot`` exists but is not a plan snapshot (it is never
            overwritten then), cannot be read or written (a folder without permission), or
            :data:`UPDATE_SNAPSHOTS` holds a value that is neither true nor false.
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
        update = _update_from_environment()
    update = check.flag(update, "update")
    text = _read_snapshot(path)
    if update:
        _write_snapshot(path, plan.to_json())
        return
    if text is None:
        raise PlanMismatchError(
            f"the snapshot {str(path)!r} does not exist. Write it once with "
            f"{UPDATE_SNAPSHOTS}=1 in the environment (or update=True), check it in, and "
            "review it like code."
        )
    changes = ShardingPlan.from_json(text, source=path).diff(plan)
    if changes:
        raise PlanMismatchError(
            f"the plan differs from the snapshot {str(path)!r} (before: the snapshot, after: "
            f"this plan):\n{changes.describe()}\nIf the change is meant, write the snapshot "
            f"again with {UPDATE_SNAPSHOTS}=1 in the environment and review its diff."
        )


def _update_from_environment() -> bool:
    value = os.environ.get(UPDATE_SNAPSHOTS, "")
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise EscaleError(
        f"assert_plan_matches: the environment variable {UPDATE_SNAPSHOTS}={value!r} is neither "
        f"true nor false; set it to one of {', '.join(_TRUE)} (any case) to write the "
        f"snapshots, or to one of {', '.join(repr(v) for v in _FALSE)} or unset it to compare "
        "them."
    )


def _unusable(path: Path, doing: str, error: OSError) -> EscaleError:
    return EscaleError(
        f"assert_plan_matches: cannot {doing} snapshot={str(path)!r}: "
        f"{error.strerror or error} ({error.filename or str(path)!r}); give a path in a "
        "folder you can read and write."
    )


def _write_snapshot(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        raise _unusable(path, "write", error) from None


def _read_snapshot(path: Path) -> str | None:
    # The text of a plan snapshot at `path`, None if there is no file; anything else there is
    # not ours, to read or to write over.
    try:
        if not path.exists():
            return None
        if path.is_dir():
            raise EscaleError(
                f"assert_plan_matches: snapshot={str(path)!r} is a folder; name a file in it, "
                f"such as {str(path / 'plan.json')!r}."
            )
        raw = path.read_bytes()
    except OSError as error:
        raise _unusable(path, "read", error) from None
    try:
        text = raw.decode("utf-8")
        found = json.loads(text).get("format")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        found = error
    if found != FORMAT:
        raise EscaleError(
            f"assert_plan_matches: {str(path)!r} exists but is not a sharding plan snapshot "
            f"({found!r} where the format {FORMAT!r} was expected); it is left as it is. Give "
            "the snapshot a path of its own."
        )
    return text
