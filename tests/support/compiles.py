"""What JAX traces and compiles while a block runs, for tests that something compiles once.

Counted from ``jax.monitoring`` events: a trace of a Python function to a jaxpr, and an XLA
compilation, each with the name of the function (``"step"``, ``"jit(step)"``).
"""

import contextlib
from collections.abc import Iterator

import jax

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/backend_compile_duration": "compile",
}


@contextlib.contextmanager
def counting() -> Iterator[list[tuple[str, str]]]:
    """Yields a list that gets ``(kind, function name)`` for each trace and compile inside."""
    seen: list[tuple[str, str]] = []

    def listener(event: str, duration: float, **kwargs: str) -> None:
        if event in _EVENTS:
            seen.append((_EVENTS[event], kwargs.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def compiles_of(seen: list[tuple[str, str]], name: str) -> int:
    """How many times ``jit(name)`` was compiled."""
    return seen.count(("compile", f"jit({name})"))
