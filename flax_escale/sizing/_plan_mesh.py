"""``plan_mesh``: which mesh of N devices fits a workload, and which is fastest, on one machine."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import flax.linen as nn
import jax
from flax import nnx
from rich.console import Console

from flax_escale import _checks as check
from flax_escale._units import parse_bytes
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import Target
from flax_escale.sizing._candidates import checked_axes
from flax_escale.sizing._child import Events, Request, evaluate_request, run_child
from flax_escale.sizing._evaluate import TRACE_FAILURE, Figures
from flax_escale.sizing._factory import Factory, build_workload, reference_of
from flax_escale.sizing._profiles import HardwareProfile, hardware_profile
from flax_escale.sizing._result import MeshPlan
from flax_escale.sizing._workload import Workload

__all__ = ["DEFAULT_CACHE", "plan_mesh"]

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flax_escale"
"""Where compiled candidates' figures are kept by default (``plan`` under it)."""


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
        axes: The mesh axes to spread the devices over, distinct axes of the library's mesh
            or ``pp``; defaults to ``dp, fsdp, tp, sp``, ``ep`` when a variable has a logical
            axis the rules map to ``ep``, and ``pp`` (outermost) when the workload can run its
            stack as a pipeline (``Workload(layers=..., pipelined=...)``). A mesh with ``pp`` is
            compiled with the workload's pipelined form, its schedules (microbatches, repeats,
            rematerialization) fastest by the formulas first, until one fits. For a workload
            with ``context_parallel``, a mesh without ``pp`` whose sequence axes (those the
            rules give ``query_sequence``, ``sp`` by default) split the sequence is also
            compiled with its context-parallel forms: the strategies that can run there
            (``ulysses`` only where the heads split), fastest by
            :func:`~flax_escale.context.choose_strategy`'s formulas on ``profile`` first,
            until one fits (each labelled like ``fsdp=2 sp=4 ring``; its notes and
            :meth:`~flax_escale.sizing.Candidate.explain_context` put the formulas' figures
            beside the compiled collectives).
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
            whose module raises as it is imported, ``pp`` in ``axes`` for a workload without
            ``pipelined``, a ``context_parallel`` form whose step calls no
            ``context_attention``, or if the child process fails (its last output lines are in
            the message).
        EscaleTypeError: For arguments of the wrong type, a workload the child process
            could not import, or a ``pipelined`` or ``context_parallel`` that returns anything
            but a Workload.
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
    request = Request(chosen, memory_bytes, profile, axes, time_budget, exhaustive, cache_dir)
    start = time.perf_counter()
    with Events(console, shown, devices, time_budget) as events:
        if _in_this_process(chosen, workload):
            figures = evaluate_request(build_workload(workload), request, events)
        else:
            run_child(reference_of(workload), request, events, console)
            figures = events.figures
    _raise_a_shared_failure(figures)
    return MeshPlan.rank(
        figures,
        profile,
        devices=devices,
        memory_bytes=memory_bytes,
        rules=events.rules,
        front_end=events.front_end,
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
        reference_of(workload)
    except EscaleTypeError:
        return True
    return False


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
