"""What the tests share: the mesh table, the repository's paths, and helper modules.

``tests/`` is on ``sys.path`` during a test run (``pythonpath`` in pyproject.toml's pytest
section), so every test module, in any directory, imports these as ``support``:

- ``support.built_plans``: plans of hand-written trees of abstract arrays, through ``build_plan``;
- ``support.checkpoints``: a small checkpointed tree, and restoring it, for the checkpoint tests;
- ``support.compiles``: what JAX traces and compiles while a block runs;
- ``support.distributed``: a snippet of Python run in several real JAX processes on loopback;
- ``support.example_modules``: the scripts of ``examples/`` imported as modules;
- ``support.fake_devices``: stand-ins for devices of other processes, hosts and TPU chips;
- ``support.lowered``: the sharding constraints of a lowered program;
- ``support.mistakes``: the table of mistakes users make, whose ``CASES`` lists sit in the test
  file of the module that raises each mistake's error;
- ``support.mlp_plan``: a small Linen MLP and its plan (plan diffs, JSON, snapshots);
- ``support.pictures``: models, plans and a console for the layout pictures' tests;
- ``support.pipelines``: the rules, meshes and comparisons the pipeline tests share;
- ``support.plain_reads``: the check that a model's code reads plain arrays, and a tied-head model;
- ``support.real_models``: small rewrites of Flax's example models and what their tests share;
- ``support.tiny_workloads``: a tiny Linen workload planned on 2 devices, for the planner's tests.
"""

from pathlib import Path

# The repository's root, and the example scripts.
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# The meshes of 8 devices most tests use, in the default axis order (dp, fsdp, ep, tp, sp).
# The ``mesh`` fixture of tests/conftest.py is MESHES["fsdp4_tp2"].
MESHES = {
    "fsdp8": (1, 8, 1, 1, 1),
    "fsdp4_tp2": (1, 4, 1, 2, 1),
    "dp2_fsdp2_tp2": (2, 2, 1, 2, 1),
}
