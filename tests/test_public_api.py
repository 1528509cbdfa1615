import importlib
import types

import flax_escale

EXPECTED = {
    "flax_escale": [
        "EscaleError",
        "EscaleTypeError",
        "MemoryEstimate",
        "MeshError",
        "NoMeshError",
        "PartitionAxis",
        "ShardingCorrectionWarning",
        "ShardingPlan",
        "ShardingReport",
        "ShardingResolutionError",
        "UnshardedParameterError",
        "batch_sharding",
        "calculate_host_mesh_shape",
        "check_sharded",
        "constrain",
        "cpu_context",
        "create_cpu_mesh",
        "create_mesh",
        "force_cpu",
        "global_to_host_local",
        "host_local_to_global",
        "init_opt_state",
        "init_sharded",
        "initialize_distributed",
        "logical_to_mesh_axes",
        "logical_to_mesh_sharding",
        "lower_init",
        "opt_state_shardings",
        "parse_mesh_from_string",
        "plan_sharding",
        "process_batch_slice",
        "reshard_tree",
        "resolve_logical_axes",
        "restore_checkpoint",
        "save_checkpoint",
        "sharded_module",
        "sharding_report",
        "use_sharding",
        "will_it_fit",
        "with_sharding_constraint",
    ],
    "flax_escale.linen": [
        "ShardedMixin",
        "clear_init_cache",
        "init_cache_info",
        "init_train_state",
        "jit_train_step",
        "pipelined",
    ],
    "flax_escale.nnx": [
        "LOGICAL_AXES",
        "ShardedMixin",
        "clear_init_cache",
        "init_cache_info",
        "init_optimizer",
        "pipeline_stack",
        "stack_layers",
        "stacked",
    ],
    "flax_escale.sizing": [
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
    ],
    "flax_escale.mesh": [
        "DEFAULT_AXIS_DIMS",
        "DEFAULT_AXIS_NAMES",
        "PIPELINE_AXIS",
        "TPU_GENERATIONS",
        "AxisTypeLike",
        "ClusterInfo",
        "Target",
        "assert_same_mesh",
        "calculate_host_mesh_shape",
        "cpu_context",
        "create_cpu_mesh",
        "create_mesh",
        "current_mesh",
        "detect_cluster",
        "force_cpu",
        "initialize_distributed",
        "parse_mesh_from_string",
        "parse_mesh_shape",
        "peer_loss_as_mesh_error",
        "resolve_axis_dims",
        "with_auto_axes",
    ],
    "flax_escale.axes": ["VOCABULARIES", "LogicalRules", "MeshAxes", "PartitionAxis"],
    "flax_escale.resolve": [
        "Completion",
        "Correction",
        "LogicalAxes",
        "PassedOver",
        "Resolution",
        "RulesLike",
        "as_logical_rules",
        "complete_spec",
        "enforce",
        "fit_mesh_axes",
        "fit_spec",
        "logical_to_mesh_axes",
        "resolve_logical_axes",
    ],
    "flax_escale.plan": [
        "IDLE_AXES_MIN_BYTES",
        "USE_IDLE_AXES",
        "AnnotatedLeaf",
        "Annotation",
        "ArrayChange",
        "PlanDiff",
        "PlanEntry",
        "ShardingPlan",
        "UnknownPathError",
        "annotated_leaves",
        "arrays_only",
        "build_plan",
        "init_opt_state",
        "logical_to_mesh_sharding",
        "opt_state_shardings",
        "read_annotation",
    ],
    "flax_escale.sharding": [
        "PartitionRuleError",
        "apply_spec",
        "constrain",
        "logical_shard_map",
        "make_shard_and_gather_fns",
        "reshard_tree",
        "spec_from_shape",
        "specs_from_regex",
        "use_sharding",
        "with_sharding_constraint",
    ],
    "flax_escale.context": [
        "BALANCES",
        "QUERY_AXES",
        "CONTEXT_STRATEGIES",
        "AttentionShape",
        "AttentionWork",
        "Choice",
        "ContextError",
        "ContextPlan",
        "Cost",
        "Link",
        "SequenceLayout",
        "attention_work",
        "choose_strategy",
        "context_attention",
        "plan_attention",
    ],
    "flax_escale.pipeline": [
        "REMAT_POLICIES",
        "PipelineError",
        "Remat",
        "Schedule",
        "pipeline",
        "stage_rules",
    ],
    "flax_escale.moe": [
        "EXPERT_AXES",
        "STRATEGIES",
        "Exchange",
        "GatedExperts",
        "MoeOutput",
        "Routing",
        "Strategy",
        "expert_capacity",
        "moe_mlp",
        "route_top_k",
    ],
    "flax_escale.testing": ["UPDATE_SNAPSHOTS", "PlanMismatchError", "assert_plan_matches"],
    "flax_escale.tools": [
        "DeviceBlock",
        "LayoutPicture",
        "MemoryBars",
        "MemoryEstimate",
        "Resharding",
        "ShardingReport",
        "UnshardedParameterError",
        "batch_sharding",
        "check_sharded",
        "free_port",
        "global_to_host_local",
        "host_local_to_global",
        "launch",
        "layout_picture",
        "memory_bars",
        "memory_by_device",
        "process_batch_slice",
        "process_environment",
        "register_treescope",
        "restore_checkpoint",
        "save_checkpoint",
        "sharding_report",
        "will_it_fit",
    ],
    "flax_escale.t5x": [
        "AxisNames",
        "DataLayout",
        "HardwareMesh",
        "LocalChunkInfo",
        "LocalChunker",
        "PartitionedFunction",
        "Partitioner",
        "bounds_from_last_device",
        "default_mesh",
        "get_coords",
        "get_cpu_mesh",
        "get_gpu_mesh",
        "get_mesh",
        "global_mesh_defined",
        "standard_logical_axis_rules",
    ],
    "flax_escale.eformer": [
        "MeshPartitionHelper",
        "NamedSharding",
        "PartitionAxis",
        "PartitionManager",
        "PartitionSpec",
        "ShardingAnalysis",
        "analyze_sharding_strategy",
        "auto_partition_spec",
        "calculate_host_mesh_shape",
        "cpu_context",
        "create_cpu_mesh",
        "create_mesh",
        "create_pattern_based_partition_spec",
        "extract_sharding_structure",
        "extract_shardings",
        "force_cpu",
        "get_axes_size_in_mesh",
        "get_incontext_mesh",
        "get_mesh_axis_names",
        "get_mesh_axis_size",
        "get_names_from_partition_spec",
        "get_partition_spec",
        "get_shardings_with_structure",
        "get_submesh_device_index",
        "make_shard_and_gather_fns",
        "match_partition_rules",
        "names_in_current_mesh",
        "parse_mesh_from_string",
        "with_sharding_constraint",
    ],
}


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_exported_names_are_pinned():
    for module_name, names in EXPECTED.items():
        module = importlib.import_module(module_name)
        assert sorted(module.__all__) == sorted(names), module_name


def test_every_exported_name_exists_and_nothing_public_is_unexported():
    for module_name in EXPECTED:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.{name}"
        assert _public_names(module) == set(module.__all__), module_name


def test_the_top_level_is_a_small_core():
    assert len(flax_escale.__all__) <= 40


# Top-level names that JAX or Flax also has, each meaning what theirs means (taking the same
# arguments and giving the same answer where theirs gives one; the library's also fits shapes).
SAME_MEANING = {"with_sharding_constraint", "logical_to_mesh_axes", "logical_to_mesh_sharding"}


def test_no_top_level_name_shadows_jax_or_flax_with_another_meaning():
    import flax.linen
    import jax
    import jax.sharding
    from flax import nnx

    theirs = set()
    for module in (jax, jax.sharding, jax.lax, jax.experimental, flax.linen, nnx):
        theirs |= {name for name in dir(module) if not name.startswith("_")}
    assert theirs & set(flax_escale.__all__) == SAME_MEANING


def test_errors_are_value_errors():
    for error in (
        flax_escale.EscaleError,
        flax_escale.MeshError,
        flax_escale.NoMeshError,
        flax_escale.EscaleTypeError,
    ):
        assert issubclass(error, ValueError)
    assert issubclass(flax_escale.EscaleTypeError, TypeError)


def test_package_is_typed():
    from importlib.resources import files

    assert files("flax_escale").joinpath("py.typed").is_file()


def test_version_is_the_installed_distributions_and_pyprojects():
    import tomllib
    from importlib import metadata

    from support import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert flax_escale.__version__ == metadata.version(project["name"]) == project["version"]


def test_version_of_a_source_tree_that_is_not_installed(monkeypatch):
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert flax_escale._installed_version() == "0+unknown"


# --- one object per name, and the compatibility vocabularies only in their namespaces ---------

# One entry point serves both Flax APIs (plan_sharding, init_sharded, lower_init,
# sharded_module are the top level's, once). Each API's mixin is its own class, as
# flax.linen.Module and flax.nnx.Module are two classes; every other name is one object.
FRONT_END_SPECIFIC = {"ShardedMixin"}
# Names whose eformer call means something else than the core's: flax_escale.eformer's own.
EFORMER_SPECIFIC = {"PartitionAxis"}


def test_a_name_is_the_same_object_in_every_namespace():
    objects: dict[str, dict[str, object]] = {}
    for module_name in EXPECTED:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            objects.setdefault(name, {})[module_name] = getattr(module, name)
    front_ends = {"flax_escale.linen", "flax_escale.nnx"}
    differing = {}
    for name, by_module in objects.items():
        compared = by_module
        if name in FRONT_END_SPECIFIC:
            compared = {m: o for m, o in by_module.items() if m not in front_ends}
        if name in EFORMER_SPECIFIC:
            compared = {m: o for m, o in by_module.items() if m != "flax_escale.eformer"}
        if len({id(o) for o in compared.values()}) > 1:
            differing[name] = sorted(compared)
    assert differing == {}
    # The exception covers exactly the names the front ends specialize.
    specialized = {
        name for name, by_module in objects.items() if len({id(o) for o in by_module.values()}) > 1
    }
    assert specialized == FRONT_END_SPECIFIC | EFORMER_SPECIFIC


def test_eformer_reuses_the_core_object_wherever_its_call_means_the_same():
    from flax_escale import eformer, sharding

    assert eformer.create_mesh is flax_escale.create_mesh
    # eformer's decode_* fields follow the training ones; the core keeps its seed's defaults.
    assert issubclass(eformer.PartitionAxis, flax_escale.PartitionAxis)
    # eformer calls it with_sharding_constraint(arr=..., sharding=...): the core's takes that.
    assert eformer.with_sharding_constraint is flax_escale.with_sharding_constraint
    assert eformer.make_shard_and_gather_fns is sharding.make_shard_and_gather_fns


COMPAT_PACKAGES = ("flax_escale.t5x", "flax_escale.eformer")

# t5x's and eformer's vocabularies: the names those projects give their functions and types,
# which only flax_escale.t5x and flax_escale.eformer may define.
COMPAT_VOCABULARY = {
    "AxisNames",
    "LocalChunkInfo",
    "LocalChunker",
    "MeshPartitionHelper",
    "ShardingAnalysis",
    "analyze_sharding_strategy",
    "auto_partition_spec",
    "create_pattern_based_partition_spec",
    "extract_shardings",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_names_from_partition_spec",
    "get_partition_spec",
    "get_submesh_device_index",
    "match_partition_rules",
    "names_in_current_mesh",
    "standard_logical_axis_rules",
    "PartitionManager",
    "extract_sharding_structure",
    "get_shardings_with_structure",
    "process_blocks",
}


def _core_modules() -> list[types.ModuleType]:
    import pkgutil

    names = ["flax_escale"] + [
        info.name
        for info in pkgutil.walk_packages(flax_escale.__path__, prefix="flax_escale.")
        if not info.name.endswith("__main__")
    ]
    core = [n for n in names if not any(n == p or n.startswith(p + ".") for p in COMPAT_PACKAGES)]
    return [importlib.import_module(name) for name in core]


def test_no_core_module_defines_or_exports_the_compatibility_vocabularies():
    modules = _core_modules()
    assert {m.__name__ for m in modules} >= {
        "flax_escale.mesh._context",
        "flax_escale.tools._report",
    }
    for module in modules:
        exported = set(getattr(module, "__all__", ())) & COMPAT_VOCABULARY
        assert not exported, f"{module.__name__} exports {sorted(exported)}"
        for name, value in vars(module).items():
            defined_here = getattr(value, "__module__", None) == module.__name__
            assert not (defined_here and getattr(value, "__name__", name) in COMPAT_VOCABULARY), (
                f"{module.__name__} defines {name}"
            )
            # No object of a compatibility namespace is held by a core module.
            origin = getattr(value, "__module__", None) or ""
            if not isinstance(value, types.ModuleType):
                assert not origin.startswith(COMPAT_PACKAGES), f"{module.__name__}.{name}"


def test_core_modules_do_not_import_the_compatibility_namespaces():
    import ast
    import pathlib

    root = pathlib.Path(flax_escale.__file__).parent
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if relative[0] in ("t5x", "eformer"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if relative == ("__init__.py",):
                # The top level binds the namespaces as attributes (fe.t5x, fe.eformer).
                targets = [t for t in targets if t not in COMPAT_PACKAGES]
            offending = [t for t in targets if t.startswith(COMPAT_PACKAGES)]
            assert not offending, f"{path.relative_to(root)} imports {offending}"


def test_importing_the_library_leaves_orbax_unimported():
    import subprocess
    import sys

    # A fresh interpreter: this one has imported orbax through other tests.
    code = "import sys, flax_escale; print(sorted(m for m in sys.modules if 'orbax' in m))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
