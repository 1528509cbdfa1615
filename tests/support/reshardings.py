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
    from flax_escale.sizing._evaluate import _prune
    from flax_escale.sizing._programs import lower_step
    from flax_escale.tools._reshardings import compile_collecting

    sys.path[:0] = [{tests!r}, {folder!r}]
    spec = importlib.util.spec_from_file_location("workload_module", {path!r})
    module = sys.modules["workload_module"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = getattr(module, {factory!r})()
    target = Target.named({target!r}, devices={devices})

    def found(shape, result):
        print("@@" + json.dumps([shape, result]), flush=True)

    for shape in {shapes!r}:
        mesh = target.mesh(shape, axis_types={axis_types!r})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a correction is not what is measured here
                plan = None
                if {candidates}:
                    reason, plan = _prune(workload, mesh)[:2]
                    if reason:
                        found(shape, "pruned")  # the planner would not compile it either
                        continue
                    if not {lower}:
                        found(shape, "candidate")
                        continue
                step = lower_step(workload, mesh, plan)  # the planner's step, on its plan
        except ValueError:  # the model cannot run there, as the planner finds it
            found(shape, None)
            continue
        print("@@compiling", file=sys.stderr, flush=True)
        try:
            reports = compile_collecting(step, target.compiler_options)[1]
        except jax.errors.JaxRuntimeError as error:  # the compiler gave up: the planner's "failed"
            found(shape, str(error).splitlines()[0])
            continue
        found(shape, [str(r) for r in reports])
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
    lower: bool = True,
) -> dict[tuple[int, ...], list[str] | str | None]:
    """``{mesh shape: [resharding, ...]}`` for ``factory()``'s step, the workload in ``path``.

    A mesh the step cannot be lowered on (a ``ValueError``: the model's own shardings do not
    divide its shapes there) maps to ``None``; one the compiler fails on, to its error's first
    line, or to "the compiler aborted" where it ended the process.

    ``shapes`` are sizes of the default axes (dp, fsdp, ep, tp, sp); ``target`` is a
    ``Target.named`` name of ``devices`` devices; ``axis_types`` as ``create_mesh`` takes it
    (``"explicit"`` for a model that names mesh axes in its own ``out_sharding``). With
    ``candidates``, the meshes the planner prunes (its batch does not split there, an axis
    would be idle) are left out of the result, as the planner leaves them uncompiled; without
    ``lower`` as well, a mesh the planner keeps maps to ``"candidate"``: nothing is lowered.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    results: dict[tuple[int, ...], list[str] | str | None] = {}
    left = [tuple(s) for s in shapes]
    while left:
        script = _CHILD.format(
            devices=devices,
            tests=str(ROOT / "tests"),
            folder=os.path.dirname(os.path.abspath(path)),
            path=os.path.abspath(path),
            factory=factory,
            target=target,
            axis_types=axis_types,
            candidates=candidates,
            lower=lower,
            shapes=left,
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1800
        )
        for line in done.stdout.splitlines():
            if line.startswith("@@"):
                shape, result = json.loads(line[2:])
                results[tuple(shape)] = result
        left = [s for s in left if s not in results]
        if done.returncode == 0:
            break
        # The compiler aborted the process (as the planner's child can find it): that mesh
        # failed; the others are compiled in a new process.
        assert "@@compiling" in done.stderr, done.stderr[-4000:]
        results[left.pop(0)] = f"the compiler aborted (exit {done.returncode})"
    return {s: results[s] for s in map(tuple, shapes) if results.get(s) != "pruned"}
