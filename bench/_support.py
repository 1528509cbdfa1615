"""What the benchmark scripts share: the examples, the CPU devices, the library's measuring tools.

Each script runs as ``python bench/bNN_<name>.py`` (``NN`` its number on the benchmarks page,
``docs/benchmarks.md``). Python puts ``bench/`` first on ``sys.path`` for it, so a script
imports this module and the other scripts by name; nothing here or in a script edits
``sys.path``. The scripts of ``examples/`` are loaded by their path (:func:`example`), as they
are when they run themselves.

The benchmarks measure with a few of the library's internal helpers. They are gathered here, the
one place ``bench/`` imports a private module from, so that a move inside the library is mended
in one line:

- :func:`program_costs` and :func:`collective_bytes`: the collectives and matmul FLOPs of one run
  of a compiled program, read from its HLO (the reader ``plan_mesh`` estimates with);
- :func:`pipeline_figures`: a compiled pipeline step's loop trips, permutes and gradient
  reductions, read from its HLO;
- :func:`lower_programs`: a :class:`~flax_escale.sizing.Workload`'s init and training step
  lowered on a mesh, allocating nothing (what ``plan_mesh`` compiles);
- :func:`compile_collecting`: a compile, with the involuntary reshardings XLA reported;
- :func:`checksums`: the per-array checksums checkpoints store;
- :func:`format_bytes`: a byte count as the library prints it (``1.50 GiB``).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import jax
from rich.console import Console

from flax_escale._units import format_bytes
from flax_escale.sizing import MeshPlan
from flax_escale.sizing._hlo import collective_bytes, pipeline_figures, program_costs
from flax_escale.sizing._programs import lower_programs
from flax_escale.tools._checksum import checksums
from flax_escale.tools._reshardings import compile_collecting

__all__ = [
    "EXAMPLES",
    "checksums",
    "collective_bytes",
    "compile_collecting",
    "cpu_devices",
    "example",
    "format_bytes",
    "lower_programs",
    "pipeline_figures",
    "print_plan",
    "program_costs",
]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    """The module of ``examples/<name>.py``, loaded once, under its own name.

    An example imports its neighbours by name (``import backend_choice``), which resolves when
    it runs as a script; here each neighbour it names is loaded first, the same way, so those
    imports find it in ``sys.modules``.
    """
    path = EXAMPLES / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "")).resolve() != path:
            raise ImportError(f"{name!r} is already imported from elsewhere: {loaded!r}")
        return loaded
    for neighbour in _neighbours(path):
        example(neighbour)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no example {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as an import does: dataclasses look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _neighbours(path: Path) -> list[str]:
    """The other examples ``path`` imports at its top level, by module name."""
    names = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return [name for name in names if (EXAMPLES / f"{name}.py").is_file()]


def cpu_devices() -> list[jax.Device]:
    """8 simulated CPU devices on any host, the examples' way (``--devices cpu``).

    The CPU platform is chosen before any backend starts, so an accelerator plugin is never
    started: call it before anything touches a device.
    """
    return example("backend_choice").select_devices("cpu")


def print_plan(plan: MeshPlan, wall: float, top: int, width: int = 160) -> None:
    """A mesh plan's table and recommendation, then what became of its candidates and why."""
    Console(width=width).print(plan.table(top=top))
    print(plan.recommendation())
    status: dict[str, int] = {}
    for c in plan.candidates:
        status[c.figures.status] = status.get(c.figures.status, 0) + 1
    compiled = [c for c in plan.candidates if c.figures.status == "compiled"]
    cached = sum(c.figures.cached for c in compiled)
    compile_seconds = sum(c.figures.compile_seconds for c in compiled)
    print(
        f"wall clock {wall:.1f} s; {len(plan.candidates)} meshes: "
        + ", ".join(f"{n} {s}" for s, n in sorted(status.items()))
        + f" ({cached} of the compiled from the cache; {compile_seconds:.0f} s compiling); "
        f"{len(plan.fitting)} fit {format_bytes(plan.memory_bytes)}"
    )
    for c in plan.candidates:
        if c.figures.status == "failed":
            print(f"  FAILED {c.label}: {c.figures.reason[:300]}")
