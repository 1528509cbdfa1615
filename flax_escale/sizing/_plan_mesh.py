"""``plan_mesh``: which mesh of N devices fits a workload, and which is fastest, on one machine."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from flax_escale import _checks as check
from flax_escale import errors as error_types
from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import Target
from flax_escale.resolve import as_logical_rules
from flax_escale.sizing._candidates import checked_axes
from flax_escale.sizing._evaluate import TRACE_FAILURE, Figures, evaluate
from flax_escale.sizing._profiles import HardwareProfile, hardware_profile, parse_bytes
from flax_escale.sizing._result import MeshPlan
from flax_escale.sizing._workload import Workload
from flax_escale.tools._reshardings import LOG_VAR

__all__ = ["DEFAULT_CACHE", "load_factory", "plan_mesh"]

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flax_escale"
"""Where compiled candidates' figures are kept by default (``plan`` under it)."""

# Lines of the child's standard output that carry an event start with this; any other line is
# the workload's own output and is passed on to standard error.
EVENT_PREFIX = "flax_escale.plan "

Factory = Callable[[], Workload]


def plan_mesh(
    workload: Workload | Factory | str,
    *,
    devices: int | None = None,
    target: str | Target = "cpu",
    slices: int | None = None,
    memory: int | str | None = None,
    profile: str | HardwareProfile | None = None,
    axes: Sequence[str] | None = None,
    time_budget: float | None = None,
    exhaustive: bool = False,
    cache: bool | str | os.PathLike[str] = True,
    progress: bool | Console = False,
) -> MeshPlan:
    """Ranks the meshes of ``devices`` devices for a workload by memory and estimated step time.

    Every layout of the devices over ``axes`` is planned (:func:`~flax_escale.plan_sharding`)
    and pruned when it cannot run as asked (the batch does not divide over its data axes) or
    when an axis of it would split nothing (those devices would only repeat the work). Each
    remaining mesh's sharded init and training step are compiled ahead of time, nothing
    allocated, by the target's compiler: XLA's CPU compiler on simulated devices (the
    default), or the TPU compiler for a TPU slice described by JAX (``target="v5p-128"``; no
    TPU is needed, only ``libtpu``: ``pip install "flax-escale[tpu]"``). The figures are read
    from the compiled programs:
    per-device peak memory (``memory_analysis()``, temporaries included), FLOPs and the bytes
    each collective moves per step (loop trips counted). A mesh whose train state alone
    exceeds the budget is not compiled. The meshes that fit are ranked by an estimated step
    time on ``profile`` (:data:`~flax_escale.sizing.ESTIMATE_TERMS` says which terms), each
    with what explains it (compute- or communication-bound, the collective that dominates,
    tokens per device against the compute-bound threshold). Meshes are compiled in the order
    of their communication by the scaling book's counts; one whose textbook communication alone
    exceeds twice the best estimate already compiled is ruled out without compiling (its row
    says by how much), unless ``exhaustive``.

    More simulated devices than this process has, or a TPU target, are planned in a child
    process on the CPU platform (this process's JAX is untouched, and no accelerator is
    started); the workload then has to be importable by the child: pass its factory as
    ``"module:function"`` (or ``"path/to/file.py:function"``) or as a module-level function.
    Should the TPU compiler abort on a mesh (``libtpu`` does on some layouts), that mesh is
    reported as failed with the compiler's last words and a new child plans the rest. A
    :class:`Workload` object for a TPU target is compiled in this process while its JAX runs
    on the CPU, where such an abort would end it.

    Args:
        workload: A :class:`Workload`, or a function without arguments returning one, or its
            ``"module:function"`` reference.
        devices: N, the devices to plan for; for a TPU target, optional (the slice's chips);
            beside a :class:`~flax_escale.mesh.Target`, optional and then equal to its
            ``device_count``.
        target: Whose compiler compiles the candidates: ``"cpu"`` (simulated CPU devices), a
            TPU slice such as ``"v5e-256"`` or ``"v5p-128"``, a topology such as
            ``"v5e:2x4"``, or a :class:`~flax_escale.mesh.Target`.
        slices: TPU slices joined over the data-center network; data parallelism (``dp``)
            spans them, so only meshes whose ``dp`` is a multiple of ``slices`` are planned.
            Defaults to 1 for a target's name; beside a ``Target``, optional and then equal
            to its ``slices``.
        memory: One device's memory budget: bytes, or a size like ``"16GiB"``. Defaults to
            the TPU chip's memory, then to the profile's.
        profile: A hardware profile or the name of a built-in one
            (:data:`~flax_escale.sizing.PROFILES`); defaults to the TPU chip's, and to
            ``"h100"`` for the CPU simulation.
        axes: The mesh axes to spread the devices over, distinct axes of the library's mesh;
            defaults to ``dp, fsdp, tp, sp`` and ``ep`` when a variable has a logical axis the
            rules map to ``ep``.
        time_budget: Seconds; once spent, the meshes not yet compiled are reported as
            skipped rather than compiled.
        exhaustive: Compile every mesh left after pruning, even those the communication
            textbook rules out.
        cache: Keep each compiled candidate's figures on disk, keyed by its lowered programs
            and the JAX version, so a second plan does not compile again: ``True`` (under
            ``$XDG_CACHE_HOME/flax_escale/plan``), a directory, or ``False``.
        progress: Show a progress bar (on standard error, or on the ``rich`` console given).

    Returns:
        The :class:`~flax_escale.sizing.MeshPlan`: ``best``, ``fitting``, ``candidates``,
        ``table()``, ``recommendation()``.

    Raises:
        EscaleError: For a budget or profile that cannot be used (a memory of 0 included),
            ``devices`` or ``slices`` disagreeing with a ``Target``, axes the library's mesh
            lacks, a cache directory that cannot be created or written, a step or loss that
            traces on no mesh (what it returned is in the message), rules or overrides naming
            mesh axes the planned meshes lack when that leaves no mesh to compile, a factory
            whose module raises as it is imported, or if the child process fails (its last
            output lines are in the message).
        EscaleTypeError: For arguments of the wrong type, or a workload the child process
            could not import.
    """
    if isinstance(workload, (nn.Module, nnx.Module)):  # callable, but not a factory
        raise EscaleTypeError(
            f"workload: got the model {type(workload).__name__} itself; pass a "
            "flax_escale.sizing.Workload(model, rng, batch, tx=...), or a function without "
            "arguments that returns one."
        )
    chosen = Target.named(target, devices=devices, slices=slices)
    profile = hardware_profile(profile if profile is not None else chosen.profile or "h100")
    # Only None is not given: a memory of 0 is refused, not taken for the profile's.
    memory = next(
        (m for m in (memory, chosen.memory_bytes, profile.memory_bytes) if m is not None), None
    )
    if memory is None:
        raise EscaleError(
            f"memory: the profile {profile.name!r} has no memory size; pass memory='16GiB'."
        )
    memory_bytes = parse_bytes(memory, "memory")
    if axes is not None:
        axes = checked_axes(axes)
    if time_budget is not None:
        time_budget = check.non_negative_number(time_budget, "time_budget")
    exhaustive = check.flag(exhaustive, "exhaustive")
    cache_dir = _cache_dir(cache)
    if isinstance(progress, Console):
        console, shown = progress, True
    else:
        console, shown = Console(stderr=True), check.flag(progress, "progress")
    devices = chosen.device_count
    request = {
        "target": chosen.as_json(),
        "memory_bytes": memory_bytes,
        "axes": list(axes) if axes is not None else None,
        "time_budget": time_budget,
        "exhaustive": exhaustive,
        "profile": dataclasses.asdict(profile),
        "cache_dir": str(cache_dir) if cache_dir is not None else None,
    }
    start = time.perf_counter()
    with _Events(console, shown, devices, time_budget) as events:
        if _in_this_process(chosen, workload):
            built = _build(workload)
            figures = evaluate(
                built,
                chosen,
                memory_bytes=memory_bytes,
                profile=profile,
                exhaustive=exhaustive,
                axes=axes,
                time_budget=time_budget,
                cache_dir=cache_dir,
                report=events,
            )
        else:
            built = None
            _run_child(_reference(workload), request, events, console)
            figures = events.figures
    _raise_a_shared_failure(figures)
    return MeshPlan.rank(
        figures,
        profile,
        devices=devices,
        memory_bytes=memory_bytes,
        rules=frozen_rules(built.rules) if built is not None else events.rules,
        seconds=time.perf_counter() - start,
        time_budget=time_budget,
        backend=chosen.label,
    )


def _raise_a_shared_failure(figures: Sequence[Figures]) -> None:
    # Every mesh that was tried failing to trace is the workload's mistake (a batch_stats
    # collection, a shard_over axis the mesh lacks), not a verdict on the meshes: it is raised
    # as such rather than reported as "no mesh fits".
    tried = [f for f in figures if f.status not in ("pruned", "skipped", "ruled out")]
    if tried and all(f.status == "failed" and f.reason.startswith(TRACE_FAILURE) for f in tried):
        first = tried[0]
        raise EscaleError(
            f"workload: the step traced on none of the {len(tried)} meshes tried, so the "
            f"workload is at fault, not the meshes; on {first.label}: "
            f"{first.reason[len(TRACE_FAILURE) :]}"
        )


def _in_this_process(target: Target, workload: Workload | Factory | str) -> bool:
    # Simulated devices this process has: here. A TPU target compiles in a child process on
    # the CPU platform whenever one can build the workload, because libtpu's compiler aborts
    # its process on some layouts (the child's end then fails one mesh, not the plan, nor the
    # caller's process); here only for a Workload object, and only while JAX runs on the CPU.
    if target.platform == "cpu":
        return target.device_count <= len(jax.devices("cpu"))
    if jax.default_backend() != "cpu":
        return False
    try:
        _reference(workload)
    except EscaleTypeError:
        return True
    return False


def load_factory(reference: str) -> Factory:
    """The function a ``"module:function"`` or ``"path/to/file.py:function"`` reference names.

    Raises:
        EscaleTypeError: If the reference is not a string or is malformed, or the module or
            function is missing.
        EscaleError: If the module raises as it is imported (the message names the module
            and the exception, which is its cause).
    """
    if not isinstance(reference, str):
        raise EscaleTypeError(
            f"workload: the reference must be a string, got {check.describe(reference)}; write "
            "it MODULE:FUNCTION, such as 'my_models:workload' or 'path/to/train.py:workload'."
        )
    module_name, sep, attribute = reference.rpartition(":")
    if not sep or not module_name or not attribute:
        raise EscaleTypeError(
            f"workload: {reference!r} is not a reference; write it MODULE:FUNCTION, such as "
            "'my_models:workload' or 'path/to/train.py:workload'."
        )
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except SyntaxError as error:
        raise EscaleTypeError(
            f"workload: {module_name!r} of {reference!r} has a syntax error: {error.msg} "
            f"({error.filename}, line {error.lineno}); fix it, then plan again."
        ) from error
    except (ImportError, OSError) as error:
        raise EscaleTypeError(
            f"workload: cannot import {module_name!r} of {reference!r} ({error}); run from the "
            "directory that holds it, or add that directory to PYTHONPATH."
        ) from error
    except Exception as error:  # the user's module: said in one line, with its cause
        raise EscaleError(
            f"workload: importing {module_name!r} of {reference!r} raised "
            f"{type(error).__name__}: {error}; fix the module so that it imports (its traceback "
            "is this error's cause), then plan again."
        ) from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise EscaleTypeError(
            f"workload: {module_name!r} has no function {attribute!r} (of {reference!r}); "
            "name a function without arguments that returns a flax_escale.sizing.Workload."
        )
    return factory


def _module_from_file(path: Path) -> Any:
    loaded = sys.modules.get(path.stem)
    file = getattr(loaded, "__file__", None)
    if file and Path(file).resolve() == path.resolve():
        return loaded
    # Never in place of another module of the same name (an installed package, say).
    name = path.stem if loaded is None else f"flax_escale_plan_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no such file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses look their module up there.
    sys.modules[spec.name] = module
    # Its neighbours importable while it runs, as when it runs as a script.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def _build(workload: Workload | Factory | str) -> Workload:
    given = workload
    if isinstance(workload, str):
        workload = load_factory(workload)
    if callable(workload) and not isinstance(workload, Workload):
        factory = workload
        name = given if isinstance(given, str) else getattr(factory, "__qualname__", factory)
        try:
            workload = factory()
        except Exception as error:  # the user's function: said in one line, with its cause
            raise EscaleError(
                f"workload: the factory {name!r} raised {type(error).__name__}: {error}; it "
                "must build the Workload when called without arguments."
            ) from error
        if not isinstance(workload, Workload):
            raise EscaleTypeError(
                f"workload: the factory {name!r} returned {check.describe(workload)}, not a "
                "flax_escale.sizing.Workload; return Workload(model, rng, batch, tx=...)."
            )
    if not isinstance(workload, Workload):
        raise EscaleTypeError(
            f"workload must be a flax_escale.sizing.Workload (or a function returning one), "
            f"got {check.describe(workload)}."
        )
    return workload


def _reference(workload: Workload | Factory | str) -> str:
    if isinstance(workload, str):
        load_factory(workload)  # a clear error here rather than in the child
        return workload
    module = getattr(workload, "__module__", None)
    name = getattr(workload, "__qualname__", "")
    if callable(workload) and not isinstance(workload, Workload) and module and "<" not in name:
        file = getattr(sys.modules.get(module), "__file__", None)
        if module != "__main__" and (file is None or _importable(module, file)):
            return f"{module}:{name}"
        # A script, or a module loaded from a file under a name that does not import it.
        if file:
            return f"{file}:{name}"
    raise EscaleTypeError(
        f"workload: planning more devices than this process has ({len(jax.devices('cpu'))} "
        "CPU devices), or a TPU target beside an accelerator, compiles in a child process, "
        "which has to build the workload itself; "
        "pass a module-level function returning the Workload, or its 'module:function' "
        f"reference, rather than {check.describe(workload)}."
    )


def _importable(module: str, file: str) -> bool:
    # Whether importing the name afresh gives the module of this file, as in the child (whose
    # path is ours): looked up on the path, not in sys.modules, where a module loaded from a
    # file under any name sits.
    package, _, name = module.rpartition(".")
    try:
        search = importlib.import_module(package).__path__ if package else sys.path
        spec = importlib.machinery.PathFinder.find_spec(name, search)
    except (ImportError, AttributeError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    return origin is not None and Path(origin).resolve() == Path(file).resolve()


def frozen_rules(rules: Any) -> tuple[tuple[str, Any], ...] | None:
    """The workload's rules as pairs, or ``None`` when they are ``PartitionAxis()``'s."""
    frozen = as_logical_rules(rules)
    return None if frozen == as_logical_rules(PartitionAxis()) else frozen


def _cache_dir(cache: bool | str | os.PathLike[str]) -> Path | None:
    if cache is True:
        return DEFAULT_CACHE / "plan"
    if cache is False:
        return None
    if isinstance(cache, (str, os.PathLike)):
        if os.path.exists(cache) and not os.path.isdir(cache):
            raise EscaleError(
                f"cache: {os.fspath(cache)!r} is a file, not a directory; give a directory for "
                "the compiled candidates' figures (it is created if missing), or cache=False."
            )
        _check_creatable(Path(cache))
        return Path(cache)
    raise EscaleTypeError(f"cache must be True, False or a directory, got {check.describe(cache)}.")


def _check_creatable(cache: Path) -> None:
    # Said before anything compiles, rather than when the first figures are written: the
    # directory must exist or be creatable, so its nearest existing ancestor must be a
    # directory this process can write in.
    ancestor = cache.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EscaleError(
            f"cache: {os.fspath(cache)!r} cannot be created, as {str(ancestor)!r} is a file, not "
            "a directory; give a directory for the compiled candidates' figures, or cache=False."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise EscaleError(
            f"cache: {os.fspath(cache)!r} cannot be written, as {str(ancestor)!r} is not a "
            "writable directory; give a directory you can write in, or cache=False."
        )


class _Events:
    """Receives the evaluation's events, in this process or from the child, and shows them."""

    def __init__(self, console: Console, shown: bool, devices: int, budget: float | None):
        self.found: dict[tuple[tuple[str, int], ...], Figures] = {}
        self.compiling: Figures | None = None  # handed to the compiler, not yet reported
        self.error: dict[str, str] | None = None  # the library error that ended a child
        self.rules: Any = None
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

    def __enter__(self) -> _Events:
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
        elif event["event"] == "error":
            self.error = event

    @property
    def figures(self) -> list[Figures]:
        """Every mesh's figures, in the order they were found."""
        return list(self.found.values())


def _run_child(reference: str, request: dict[str, Any], events: _Events, console: Console) -> None:
    # A compiler that aborts (libtpu does, on some layouts) ends the child with a signal while
    # it compiles one mesh: that mesh is recorded as failed with the compiler's last words, and
    # a new child goes on with the others. Each restart settles one mesh, so this ends.
    while True:
        code, errors = _child(reference, {**request, "known": _known(events)}, events, console)
        if code == 0:
            return
        failed, events.compiling = events.compiling, None
        if events.error is not None:  # a library error, in the child as it would be here
            kind = getattr(error_types, events.error["type"], EscaleError)
            raise kind(
                f"planning {request['target']['name']} for {reference!r} failed in the child "
                f"process: {events.error['message']}"
            )
        tail = "".join(errors[-20:]).strip()
        if code > 0 or failed is None:
            raise EscaleError(
                f"planning {request['target']['name']} for {reference!r} failed in the child "
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


def _known(events: _Events) -> list[dict[str, Any]]:
    return [f.as_json() for f in events.figures]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child(
    reference: str, request: dict[str, Any], events: _Events, console: Console
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
    request: dict[str, Any],
    events: _Events,
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
        child.stdin.write(json.dumps({**request, "workload": reference}))
        child.stdin.close()
        for line in child.stdout:
            if line.startswith(EVENT_PREFIX):
                events(json.loads(line[len(EVENT_PREFIX) :]))
            else:
                console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        code = child.wait()
        drainer.join()
    return code
