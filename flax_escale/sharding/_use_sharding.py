"""One context for running a model sharded: the mesh and the logical-axis rules together."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, ShardingCorrectionWarning, ShardingResolutionError
from flax_escale.resolve import RulesLike, as_logical_rules

__all__ = ["no_mesh_in_this_thread", "sharding_context", "use_sharding"]


def use_sharding(
    mesh: Mesh, rules: RulesLike = None, *, strict: bool = False
) -> contextlib.AbstractContextManager[LogicalRules]:
    """Sets ``mesh`` as the current mesh and ``rules`` as Flax's logical-axis rules.

    Inside, activation constraints (:func:`~flax_escale.constrain`, Flax's own
    ``nn.with_logical_constraint``) resolve on ``mesh`` with ``rules``, in and out of
    ``jax.jit``: a function traced inside keeps its constraints in the compiled program. It is
    ``jax.set_mesh(mesh)`` and ``flax.linen.logical_axis_rules(rules)`` in one, never the legacy
    ``with mesh:`` (under which Flax drops logical constraints).

    Flax's own logical constraints (``nn.with_logical_constraint``, and the one Flax adds when a
    ``nn.LogicallyPartitioned`` parameter is unboxed) look the rules up themselves and fail on a
    mesh axis the mesh lacks; so the rules set for Flax send such targets to ``None``, which is
    what the library's resolver makes of them too (that dimension is left unsharded). That is
    said once, on entering, with a :class:`~flax_escale.ShardingCorrectionWarning` naming the
    rules (with ``strict``, a :class:`~flax_escale.ShardingResolutionError`).

    The rules are part of what ``jax.jit`` caches a trace under, as the mesh is: a function
    jitted once and called under two rule sets (training, then decoding) is traced once for
    each, so its constraints follow the rules in force. (Rules set with Flax's own
    ``nn.logical_axis_rules`` alone are not: JAX reuses the first trace.)

    The context is per thread, as JAX's mesh context and Flax's rules are: entering sets the
    mesh and rules of the entering thread only. A thread started inside does not inherit them,
    so a step run there has no mesh: :func:`~flax_escale.constrain` and
    :func:`~flax_escale.with_sharding_constraint` there say that they do nothing (a
    :class:`~flax_escale.ShardingCorrectionWarning`; with ``strict``, a
    :class:`~flax_escale.ShardingResolutionError`). Enter ``use_sharding`` in that thread
    too (the same object will do), or pass ``mesh=`` and ``rules=``. One object may be entered
    again, nested or later, and by several threads at once: each thread keeps its own entries,
    and each exit closes the latest entry of the thread that exits.

    Args:
        mesh: The mesh.
        rules: The rules (see :func:`~flax_escale.resolve.as_logical_rules`); a ``PartitionAxis`` is
            translated. Defaults to the rules already set, then to ``PartitionAxis()``'s.
        strict: Raise instead of warning when rules name mesh axes the mesh lacks.

    Returns:
        The context; entering it gives the rules, as ``(name, mesh axes)`` pairs (before sending
        absent axes to ``None``).

    Raises:
        ShardingResolutionError: With ``strict``, if rules name mesh axes the mesh lacks.
        EscaleTypeError: If ``mesh`` is not a mesh, ``rules`` are malformed or ``strict`` is
            not a bool.
        EscaleError: On exit in a thread that has not entered the context (only possible by
            calling ``__exit__`` directly).

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import constrain, create_mesh, use_sharding
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> with use_sharding(mesh):
        ...     y = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))(jnp.ones((8, 4)))
        >>> y.sharding.spec
        P('fsdp', 'tp')
    """
    mesh, frozen, strict = check.mesh(mesh), as_logical_rules(rules), check.flag(strict, "strict")
    return _Reentrant(mesh, lambda: sharding_context(mesh, frozen, strict=strict))


class _Reentrant(contextlib.AbstractContextManager):
    """A context made afresh each time it is entered, so that one object can be entered again.

    Each thread has its own stack of entries: the mesh and rules contexts it sets are the
    thread's (as JAX's and Flax's are), and an exit closes that thread's latest entry.
    """

    def __init__(self, mesh: Mesh, make: Any) -> None:
        self._mesh, self._make = mesh, make
        self._local = threading.local()

    def __enter__(self) -> Any:
        context = self._make()
        found = context.__enter__()
        entered = self._local.__dict__.setdefault("entered", [])
        entered.append(context)
        _OPEN.opened(self._mesh)
        return found

    def __exit__(self, *exc: Any) -> bool | None:
        entered = self._local.__dict__.get("entered")
        if not entered:
            raise EscaleError(
                "use_sharding: this context is not entered in this thread "
                f"({threading.current_thread().name!r}), so it cannot be exited here; each "
                "thread exits the entries it made (a with statement does)."
            )
        _OPEN.closed()
        return entered.pop().__exit__(*exc)


class _OpenContexts:
    """The meshes of the use_sharding contexts open in each thread, for messages only.

    JAX's mesh context and Flax's rules are per thread: a thread started inside use_sharding
    runs without them. Constraints that find no mesh ask here whether another thread has one,
    to say so instead of doing nothing in silence. Nothing reads a mesh from here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, list[tuple[str, Mesh]]] = {}

    def opened(self, mesh: Mesh) -> None:
        thread = threading.current_thread()
        with self._lock:
            self._open.setdefault(thread.ident, []).append((thread.name, mesh))

    def closed(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            stack = self._open.get(ident, [])
            if stack:
                stack.pop()
            if not stack:
                self._open.pop(ident, None)

    def elsewhere(self) -> tuple[str, Mesh] | None:
        """A use_sharding context open in another thread: its thread's name and mesh."""
        ident = threading.get_ident()
        with self._lock:
            for other, stack in self._open.items():
                if other != ident and stack:
                    return stack[-1]
        return None


_OPEN = _OpenContexts()


def no_mesh_in_this_thread(function: str, *, strict: bool, stacklevel: int) -> None:
    """Says that ``function`` does nothing for want of a mesh, if another thread has one.

    With no mesh anywhere, a constraint doing nothing is the meaning Flax gives it (a model
    runs on one device); with ``use_sharding`` open in another thread, it is a thread started
    inside it, and the constraint silently not applying would be a mistake.

    Raises:
        ShardingResolutionError: With ``strict``, if ``use_sharding`` is open in another thread.
    """
    found = _OPEN.elsewhere()
    if found is None:
        return
    name, mesh = found
    message = (
        f"{function}: no mesh is set in this thread ({threading.current_thread().name!r}), so "
        f"the constraint does nothing, while use_sharding is open in thread {name!r} on the "
        f"mesh {dict(mesh.shape)}. The mesh and the rules are set per thread (JAX's mesh "
        "context and Flax's rules are): a thread started inside use_sharding does not inherit "
        "them. Enter use_sharding(mesh, rules) in this thread too, or pass mesh= (and rules=)."
    )
    if strict:
        raise ShardingResolutionError(message + " (strict=True)")
    warnings.warn(message, ShardingCorrectionWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def sharding_context(
    mesh: Mesh, frozen: LogicalRules, *, strict: bool = False
) -> Iterator[LogicalRules]:
    """:func:`use_sharding` for values already checked: a mesh, frozen rules and a bool."""
    present = set(mesh.axis_names)
    absent = [(n, t) for n, t in frozen if not set(mesh_axes_of(t)) <= present]
    if absent:
        missing = sorted({a for _, t in absent for a in mesh_axes_of(t)} - present)
        message = (
            f"use_sharding: the rules {absent} name mesh axes {missing} that the mesh "
            f"{dict(mesh.shape)} lacks; inside, those names are left unsharded. Pass rules "
            "written for this mesh (a PartitionAxis whose fields name its axes, say), or add "
            "the axes to the mesh (of size 1 where unused)."
        )
        if strict:
            raise ShardingResolutionError(message + " (strict=True)")
        warnings.warn(message, ShardingCorrectionWarning, stacklevel=5)
    available = [(name, None if (name, target) in absent else target) for name, target in frozen]
    with jax.set_mesh(mesh), nn.logical_axis_rules(available), _RULES_IN_FORCE(tuple(available)):
        yield frozen


# What jax.jit keys its caches on besides its arguments: the rules in force, so that a trace
# made under one rule set is not reused under another (JAX keys on the mesh, not on Flax's rules).
_RULES_IN_FORCE = jax.make_user_context(None)
