"""The compiled sharded initializers both front ends' ``init_sharded`` keep, and their timings.

Most of a first ``init_sharded`` is spent before anything runs: tracing the model, planning its
sharding, lowering and compiling the initializer. Initializing the same model again, on the same
mesh, with inputs of the same shapes, dtypes and shardings and the same options, would build the
same program; it is kept here and run again, so only the run is paid. This is a cache and
nothing more: a result is the same with or without it (warnings included, which are issued
again on every call).

The key is what determines the program: the front end's options (mesh, rules in their frozen
form, ``strict``, overrides, method, constructor or ``init`` arguments), the inputs' abstract
values and shardings, and JAX's configuration. A model (a Linen module, an NNX class or
callable) that hashes (Linen modules hash their fields) is compared by ``==``; one that does
not is compared by identity, held weakly. What the model's code reads besides its fields is in
the key too: the class attributes of its classes (those outside Flax and this library) and the
variables its methods, or the callable itself, close over (a model class defined in a function
reads that function's variables), by value. Options compare by ``==`` as well, lists, dicts and
unhashable dataclasses by their contents; a call with an option, a class attribute or a
closed-over value that cannot be compared that way (an array, say) is not cached. Declaring any
class with ``sharded_module`` makes every kept program stale. As with ``jax.jit``, a module's
global variables are not part of the key, and an object that hashes by identity and is changed
between calls is not seen to change: :func:`clear_init_cache` forgets every program.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax

from flax_escale._compat import jax_trace_context
from flax_escale._frontend._declare import declarations_version

__all__ = ["CompiledInit", "InitCacheInfo", "clear_init_cache", "init_cache_info", "run_cached"]

MAXSIZE = 32
"""How many compiled initializers are kept; the least recently used one goes first."""

_P = TypeVar("_P")
_R = TypeVar("_R")

# Stands in front of an id() in a key: no model or option equals it.
_BY_IDENTITY = object()


class CompiledInit(NamedTuple):
    """One kept initializer: what building it cost, and what running it costs."""

    model: str
    """The model's class or callable name."""
    compile_seconds: float
    """Tracing, sharding planning, lowering and compiling, paid once."""
    run_seconds: float
    """The latest run, until every array was ready."""
    runs: int
    """How many times it ran."""


class InitCacheInfo(NamedTuple):
    """The state of the cache, as ``functools.lru_cache``'s ``cache_info()`` gives it."""

    hits: int
    misses: int
    maxsize: int
    currsize: int
    entries: tuple[CompiledInit, ...]
    """The kept initializers, least recently used first."""


@dataclasses.dataclass
class _Entry:
    payload: Any
    owner: weakref.ref[Any] | None
    warned: list[warnings.WarningMessage]
    model: str
    compile_seconds: float
    run_seconds: float = 0.0
    runs: int = 0


_lock = threading.Lock()
_entries: OrderedDict[Hashable, _Entry] = OrderedDict()
_counts = {"hits": 0, "misses": 0}


def run_cached(
    model: Any,
    options: Any,
    inputs: Any,
    build: Callable[[], _P],
    run: Callable[[_P], _R],
) -> _R:
    """``run(build())``, with ``build()``'s result kept for the next call with the same key.

    Args:
        model: The model, the first part of the key.
        options: Everything else the program depends on, except the inputs.
        inputs: The program's arguments, keyed on their abstract values and shardings.
        build: Traces, plans, lowers and compiles; returns what ``run`` needs. Its warnings
            are recorded and issued again on every call that uses its result.
        run: Runs the program for this call's inputs.

    Returns:
        What ``run`` returns, once its arrays are ready.
    """
    key, by_identity = _key(model, options, inputs)
    with _lock:
        entry = _entries.get(key) if key is not None else None
        if entry is not None and (entry.owner is None or entry.owner() is model):
            _entries.move_to_end(key)
            _counts["hits"] += 1
        else:
            entry = None
            _counts["misses"] += 1
    if entry is None:
        entry = _build(model, key, by_identity, build)
    for w in entry.warned:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    start = time.perf_counter()
    result = jax.block_until_ready(run(entry.payload))
    with _lock:
        entry.run_seconds = time.perf_counter() - start
        entry.runs += 1
    return result


def init_cache_info() -> InitCacheInfo:
    """How often ``init_sharded`` found its compiled initializer kept, and what each cost.

    Both front ends' ``init_sharded`` (and ``init_train_state``, through it) keep the
    initializer they compile, up to ``maxsize`` (32), so that the same model initialized again
    on the same mesh, with inputs of the same shapes, dtypes and shardings and the same
    options, runs without tracing or compiling anew. Each kept initializer tells apart the
    one-time cost of building it from the cost of running it.

    Returns:
        Hits, misses, the size limit, the current size and, per kept initializer, its model's
        name, ``compile_seconds`` (tracing, planning, lowering, compiling), ``run_seconds``
        (its latest run) and ``runs``.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale import init_sharded
        >>> from flax_escale.linen import clear_init_cache, init_cache_info
        >>> clear_init_cache()
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> for seed in range(3):
        ...     variables = init_sharded(nn.Dense(4), mesh, jax.random.key(seed), jnp.ones((2, 8)))
        >>> info = init_cache_info()
        >>> info.hits, info.misses, info.currsize
        (2, 1, 1)
        >>> info.entries[0].model, info.entries[0].runs
        ('Dense', 3)
        >>> info.entries[0].compile_seconds > 0 and info.entries[0].run_seconds > 0
        True
    """
    with _lock:
        entries = tuple(
            CompiledInit(e.model, e.compile_seconds, e.run_seconds, e.runs)
            for e in _entries.values()
        )
        return InitCacheInfo(_counts["hits"], _counts["misses"], MAXSIZE, len(entries), entries)


def clear_init_cache() -> None:
    """Forgets every compiled initializer ``init_sharded`` kept, and zeroes the counts.

    To free the programs' memory, or after changing in place a model or option that hashes by
    identity. See :func:`init_cache_info`.
    """
    with _lock:
        _entries.clear()
        _counts.update(hits=0, misses=0)


def _build(model: Any, key: Hashable | None, by_identity: bool, build: Callable[[], Any]) -> _Entry:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        payload = build()
    # A model kept by identity is held weakly: a new object at a dead one's address is no hit.
    owner = weakref.ref(model) if by_identity else None
    name = getattr(model, "__qualname__", None) or type(model).__qualname__
    entry = _Entry(payload, owner, warned, name, time.perf_counter() - start)
    if key is not None:
        with _lock:
            _entries[key] = entry
            while len(_entries) > MAXSIZE:
                _entries.popitem(last=False)
    return entry


def _key(model: Any, options: Any, inputs: Any) -> tuple[Hashable | None, bool]:
    # (None, _) when the call cannot be keyed: it is then built and run, and not kept.
    by_identity = False
    try:
        head = _freeze(model)
    except TypeError:
        try:
            weakref.ref(model)
        except TypeError:
            return None, False
        head, by_identity = (_BY_IDENTITY, id(model)), True
    leaves, treedef = jax.tree.flatten(inputs)
    try:
        avals = tuple(
            (jax.typeof(x), x.sharding if isinstance(x, jax.Array) else None) for x in leaves
        )
        context = (jax_trace_context(), declarations_version())
        key = (head, _definition(model), _freeze(options), treedef, avals, context)
        hash(key)
    except TypeError:
        return None, False
    return key, by_identity


def _freeze(value: Any) -> Hashable:
    # Containers by their contents, with their types, so that 1, 1.0 and True stay apart.
    # Raises TypeError for what cannot be compared by value (arrays).
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v) for v in value))
    if isinstance(value, Mapping):
        return (type(value), tuple((_freeze(k), _freeze(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        # A dataclass that does not hash (a mutable config; a Linen module with a list field)
        # by its fields.
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            raise
        fields = dataclasses.fields(value)
        return (type(value), tuple((f.name, _freeze(getattr(value, f.name))) for f in fields))
    return (type(value), value)


# Classes and functions of these packages are not the model's own code: their attributes and
# closures (Flax's method wrappers, its lifted transforms' kept traces) are left out of the key.
_LIBRARIES = frozenset({"flax", "flax_escale", "jax", "jaxlib", "builtins", "abc", "typing"})


def _definition(model: Any) -> Hashable:
    """What the model's code reads besides its fields: class attributes and closed-over values.

    Raises:
        TypeError: If one of them cannot be compared by value or identity (an array).
    """
    seen: set[int] = set()
    if isinstance(model, (types.FunctionType, functools.partial)):
        return _code(model, seen)
    cls = model if isinstance(model, type) else type(model)
    return tuple(
        (klass, name, _code(value, seen))
        for klass in cls.__mro__
        if not _library(klass)
        for name, value in sorted(vars(klass).items())
        if not (name.startswith("__") and name.endswith("__")) or callable(value)
    )


def _code(value: Any, seen: set[int]) -> Hashable:
    # A function by identity and by what it closes over (through the wrappers that
    # functools.wraps made); anything else by _freeze.
    if isinstance(value, (classmethod, staticmethod)):
        return _code(value.__func__, seen)
    if isinstance(value, property):
        return tuple(_code(f, seen) for f in (value.fget, value.fset, value.fdel))
    if isinstance(value, functools.partial):
        return (_code(value.func, seen), _freeze(value.args), _freeze(value.keywords))
    if not isinstance(value, types.FunctionType):
        return value if isinstance(value, type) else _freeze(value)
    if id(value) in seen:
        return value
    seen.add(id(value))
    inner = getattr(value, "__wrapped__", None)
    closed: tuple[Hashable, ...] = ()
    if not _library(value):
        closed = tuple(_cell(cell, seen) for cell in value.__closure__ or ())
    return (value, closed, None if inner is None else _code(inner, seen))


def _cell(cell: Any, seen: set[int]) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # a variable not yet assigned
        return _BY_IDENTITY
    return _code(contents, seen)


def _library(thing: Any) -> bool:
    module = getattr(thing, "__module__", None) or ""
    return module.partition(".")[0] in _LIBRARIES
