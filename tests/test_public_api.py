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
        "init_sharded",
        "init_train_state",
        "jit_train_step",
        "lower_init",
        "plan_sharding",
        "sharded_module",
    ],
    "flax_escale.nnx": [
        "LOGICAL_AXES",
        "ShardedMixin",
        "clear_init_cache",
        "init_cache_info",
        "init_optimizer",
        "init_sharded",
        "lower_init",
        "plan_sharding",
        "sharded_module",
        "stack_layers",
        "stacked",
    ],
    "flax_escale.planning": [
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
