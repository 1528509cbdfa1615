"""Planning a mesh before renting it: which layout of N devices fits a model, and which is fastest.

:func:`plan_mesh` compiles a :class:`Workload` (model, optimizer, batch, training step) on
every candidate mesh of N simulated CPU devices, ahead of time and allocating nothing, and
ranks the meshes that fit a per-device memory budget by a step time estimated on a
:class:`HardwareProfile`. ``python -m flax_escale plan MODULE:FACTORY --devices 64 --memory
16GiB`` prints the same plan as a table.
"""

from flax_escale._units import parse_bytes
from flax_escale.sizing._candidates import PLANNED_AXES, mesh_shapes
from flax_escale.sizing._estimate import ESTIMATE_TERMS
from flax_escale.sizing._evaluate import Figures
from flax_escale.sizing._factory import load_factory
from flax_escale.sizing._plan_mesh import plan_mesh
from flax_escale.sizing._profiles import (
    PROFILES,
    HardwareProfile,
    hardware_profile,
    measure_cpu_profile,
)
from flax_escale.sizing._result import Candidate, MeshPlan
from flax_escale.sizing._workload import Workload, mean_square

__all__ = [
    "ESTIMATE_TERMS",
    "PLANNED_AXES",
    "PROFILES",
    "Candidate",
    "Figures",
    "HardwareProfile",
    "MeshPlan",
    "Workload",
    "hardware_profile",
    "load_factory",
    "mean_square",
    "measure_cpu_profile",
    "mesh_shapes",
    "parse_bytes",
    "plan_mesh",
]
