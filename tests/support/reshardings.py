"""Compiles a workload's training step in a fresh process and returns XLA's reshardings.

A fresh process because JAX compiles a program once per process: a program a test compiled
before would come from JAX's cache, with nothing logged. The child lowers the step on each
mesh given and collects the "involuntary full rematerialization" reports with
``flax_escale.tools._reshardings.compile_collecting``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys, warnings
    import jax
    jax.config.update("jax_num_cpu_devices", {devices})
    import flax_escale as fe
    from flax_escale.planning._workload import lower_programs
    from flax_escale.tools._reshardings import compile_collecting

    sys.path.insert(0, {folder!r})
    spec = importlib.util.spec_from_file_location("workload_module", {path!r})
    module = sys.modules["workload_module"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = getattr(module, {factory!r})()
    found = []
    for shape in {shapes!r}:
        mesh = fe.create_mesh(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a correction is not what is measured here
            step = lower_programs(workload, mesh, workload.plan(mesh)).step
        found.append([shape, [str(r) for r in compile_collecting(step)[1]]])
    print("@@" + json.dumps(found))
    """
)


def step_reshardings(
    path: str, factory: str, shapes: list[tuple[int, ...]], devices: int = 8
) -> dict[tuple[int, ...], list[str]]:
    """``{mesh shape: [resharding, ...]}`` for ``factory()``'s step, the workload in ``path``."""
    script = _CHILD.format(
        devices=devices,
        folder=os.path.dirname(os.path.abspath(path)),
        path=os.path.abspath(path),
        factory=factory,
        shapes=[tuple(s) for s in shapes],
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@"))
    return {tuple(shape): reports for shape, reports in json.loads(line[2:])}
