"""Helpers for a user's own tests: pin a model's layout so that CI catches it drifting.

A sharding mistake rarely raises: an array falls back to a replicated layout and costs memory
and bandwidth. :func:`assert_plan_matches` keeps a model's plan as a JSON snapshot beside the
tests and fails, naming each array that changed, when a later plan differs from it.

Updating a snapshot on purpose (a new mesh, new rules, a new layer): run the tests once with
``FLAX_ESCALE_UPDATE_SNAPSHOTS=1`` set (``true``, ``yes`` or ``on`` also do; another value
that is not ``0``, ``false``, ``no`` or ``off`` is an error), and review the snapshot's diff
like code::

    FLAX_ESCALE_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_layout.py
    git diff tests/snapshots/
"""

from flax_escale.testing._snapshot import UPDATE_SNAPSHOTS, PlanMismatchError, assert_plan_matches

__all__ = ["UPDATE_SNAPSHOTS", "PlanMismatchError", "assert_plan_matches"]
