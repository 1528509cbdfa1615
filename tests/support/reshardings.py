"""Compiles a workload's training step in a fresh process and returns XLA's reshardings.

A fresh process because JAX compiles a program once per process: a program a test compiled
before would come from JAX's cache, with nothing logged. The child lowers the step on each
mesh given, for the target given (``"cpu"``: simulated devices; a TPU name such as
``"v5e-8"``: the TPU compiler, nothing run), and collects the "involuntary full
rematerialization" reports with ``flax_escale.tools._reshardings.compile_collecting``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import ROOT

_CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys, warnings
    import jax
    jax.config.update("jax_num_cpu_devices", {devices})
    from flax_escale.mesh import Target
    from flax_escale.planning._evaluate import _prune
    from flax_escale.planning._workload import lower_programs
    from flax_escale.tools._reshardings import compile_collecting

    sys.path[:0] = [{tests!r}, {folder!r}]
    spec = importlib.util.spec_from_file_location("workload_module", {path!r})
    module = sys.modules["workload_module"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = getattr(module, {factory!r})()
    target = Target.named({target!r}, devices={devices})
    found = []
    for shape in {shapes!r}:
        mesh = target.mesh(shape, axis_types={axis_types!r})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a correction is not what is measured here
                if {candidates} and _prune(workload, mesh)[0]:
                    continue  # the planner would not compile it either
                step = lower_programs(workload, mesh, workload.plan(mesh)).step
        except ValueError:  # the model cannot run there, as the planner finds it
            found.append([shape, None])
            continue
        try:
            reports = compile_collecting(step, target.compiler_options)[1]
        except jax.errors.JaxRuntimeError as error:  # the compiler gave up: the planner's "failed"
            found.append([shape, str(error).splitlines()[0]])
            continue
        found.append([shape, [str(r) for r in reports]])
    print("@@" + json.dumps(found))
    """
)


def step_reshardings(
    path: str,
    factory: str,
    shapes: list[tuple[int, ...]],
    devices: int = 8,
    target: str = "cpu",
    axis_types: str | None = None,
    candidates: bool = False,
) -> dict[tuple[int, ...], list[str] | str | None]:
    """``{mesh shape: [resharding, ...]}`` for ``factory()``'s step, the workload in ``path``.

    A mesh the step cannot be lowered on (a ``ValueError``: the model's own shardings do not
    divide its shapes there) maps to ``None``; one the compiler fails on, to its error's first
    line.

    ``shapes`` are sizes of the default axes (dp, fsdp, ep, tp, sp); ``target`` is a
    ``Target.named`` name of ``devices`` devices; ``axis_types`` as ``create_mesh`` takes it
    (``"explicit"`` for a model that names mesh axes in its own ``out_sharding``). With
    ``candidates``, the meshes the planner prunes (its batch does not split there, an axis
    would be idle) are left out of the result, as the planner leaves them uncompiled.
    """
    script = _CHILD.format(
        devices=devices,
        tests=str(ROOT / "tests"),
        folder=os.path.dirname(os.path.abspath(path)),
        path=os.path.abspath(path),
        factory=factory,
        target=target,
        axis_types=axis_types,
        candidates=candidates,
        shapes=[tuple(s) for s in shapes],
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@"))
    return {tuple(shape): reports for shape, reports in json.loads(line[2:])}
