"""The parent's side of planning in a child process: the events shown, the child run to its end.

The child (``python -m flax_escale.sizing._child``) gets the :class:`Request` as JSON on
standard input. Should a compiler abort it while it compiles one mesh, that mesh is recorded as
failed with the compiler's last words and a new child plans the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from flax_escale import errors as error_types
from flax_escale.errors import EscaleError
from flax_escale.sizing._child._protocol import EVENT_PREFIX, Request
from flax_escale.sizing._evaluate import Figures
from flax_escale.tools._reshardings import LOG_VAR

__all__ = ["Events", "run_child"]


class Events:
    """Receives the evaluation's events, in this process or from the child, and shows them."""

    def __init__(self, console: Console, shown: bool, devices: int, budget: float | None):
        self.found: dict[tuple[tuple[str, int], ...], Figures] = {}
        self.compiling: Figures | None = None  # handed to the compiler, not yet reported
        self.error: dict[str, str] | None = None  # the library error that ended a child
        self.rules: Any = None
        self.front_end = "linen"  # the workload's Flax API, for the recommendation's code
        budget_text = f", time budget {budget:g} s" if budget is not None else ""
        self.progress = Progress(
            TextColumn(f"planning {devices} devices{budget_text}: {{task.description}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not shown,
            transient=True,
        )
        self.task = self.progress.add_task("tracing the candidates", total=None)

    def __enter__(self) -> Events:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def __call__(self, event: dict[str, Any]) -> None:
        if event["event"] == "start":
            self.progress.update(
                self.task, total=event["total"], description=f"compiling {event['total']} meshes"
            )
        elif event["event"] == "compiling":
            self.compiling = Figures.from_json(event["figures"])
        elif event["event"] == "figures":
            figures = Figures.from_json(event["figures"])
            self.compiling = None
            self.found[figures.key] = figures
            if figures.status != "pruned":
                self.progress.update(self.task, advance=1, description=f"{figures.label} done")
        elif event["event"] == "rules":
            self.rules = event["rules"]
            self.front_end = event["front_end"]
        elif event["event"] == "error":
            self.error = event

    @property
    def figures(self) -> list[Figures]:
        """Every mesh's figures, in the order they were found."""
        return list(self.found.values())


def run_child(reference: str, request: Request, events: Events, console: Console) -> None:
    """Evaluates the request in a child process, which builds the workload from ``reference``.

    Raises:
        EscaleError: The library error that ended the child (of its own type), or if the
            child failed otherwise (its last output lines are in the message).
    """
    # A compiler that aborts (libtpu does, on some layouts) ends the child with a signal while
    # it compiles one mesh: that mesh is recorded as failed with the compiler's last words, and
    # a new child goes on with the others. Each restart settles one mesh, so this ends.
    while True:
        # The figures earlier children found go with the request: not compiled again.
        asked = dataclasses.replace(request, known=tuple(events.figures))
        code, errors = _child(reference, asked, events, console)
        if code == 0:
            return
        failed, events.compiling = events.compiling, None
        if events.error is not None:  # a library error, in the child as it would be here
            kind = getattr(error_types, events.error["type"], EscaleError)
            raise kind(
                f"planning {request.target.name} for {reference!r} failed in the child "
                f"process: {events.error['message']}"
            )
        tail = "".join(errors[-20:]).strip()
        if code > 0 or failed is None:
            raise EscaleError(
                f"planning {request.target.name} for {reference!r} failed in the child "
                f"process (exit code {code}):\n{tail}"
            )
        words = _last_words(errors)
        reason = f"{failed.reason} ({_signal_name(-code)})" + (f": {words}" if words else "")
        events({"event": "figures", "figures": {**failed.as_json(), "reason": reason}})


def _last_words(errors: list[str]) -> str:
    # What the compiler said as it aborted: its fatal log line (glog's "F1126 file.cc:88] ...")
    # when there is one, else the lines before the crash handler's report.
    lines = [line.strip() for line in errors if line.strip()]
    fatal = [line for line in lines if _FATAL.match(line) or "Check failed" in line]
    if fatal:
        return fatal[-1]
    before = next((i for i, line in enumerate(lines) if line.startswith("*** SIG")), len(lines))
    return " | ".join(lines[:before][-2:])


_FATAL = re.compile(r"F\d{4} ")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child(
    reference: str, request: Request, events: Events, console: Console
) -> tuple[int, list[str]]:
    # Runs one child to its end: its exit code (negative: the signal that ended it) and the
    # lines of its standard error.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    paths = [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="flax-escale-plan-") as folder:
        # The child compiles with its standard error in this file (to collect XLA's reports):
        # what a compiler that aborts the child said last is read from it.
        env[LOG_VAR] = os.path.join(folder, "compiler.log")
        code = _run(env, reference, request, events, console, errors)
        with contextlib.suppress(OSError), open(env[LOG_VAR], errors="replace") as log:
            errors += log.readlines()
    return code, errors


def _run(
    env: dict[str, str],
    reference: str,
    request: Request,
    events: Events,
    console: Console,
    errors: list[str],
) -> int:
    with subprocess.Popen(
        [sys.executable, "-m", "flax_escale.sizing._child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:

        def drain() -> None:
            # Passed on as this process would show them (XLA's own warnings among them), and
            # kept for the error message should the child fail.
            for line in child.stderr:
                errors.append(line)
                console.print(
                    line.rstrip("\n"), markup=False, highlight=False, style="dim", soft_wrap=True
                )

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        child.stdin.write(json.dumps(request.as_json(reference)))
        child.stdin.close()
        for line in child.stdout:
            if line.startswith(EVENT_PREFIX):
                events(json.loads(line[len(EVENT_PREFIX) :]))
            else:
                console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        code = child.wait()
        drainer.join()
    return code
