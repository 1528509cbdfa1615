"""``create_pattern_based_partition_spec`` (``flax_escale/eformer/_pattern.py``): its mistakes."""

import pytest
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import sharding as fes

CASES = [
    # --- regex partition rules and pattern strings -----------------------------------------
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec(None),
        T,
        "pattern",
        "None",
        r"'attention\|mlp->fsdp\.tp",
        id="create_pattern-none",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec(["fsdp", "tp"]),
        T,
        "pattern",
        "['fsdp', 'tp']",
        r"'attention\|mlp->fsdp\.tp",
        id="create_pattern-list",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("kernel->fsdp.fsdp"),
        fes.PartitionRuleError,
        "pattern",
        "P('fsdp', 'fsdp')",
        "at most once",
        id="create_pattern-axis-twice",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("kernel", mesh=mesh_dp_tp()),
        fes.PartitionRuleError,
        "pattern",
        "'kernel'",
        r"'regex\|regex->axis\.axis'",
        id="create_pattern-no-arrow",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("kernel->fsdp", mesh=mesh_dp_tp()),
        fes.PartitionRuleError,
        "pattern",
        "'fsdp'",
        "Use the axes of the mesh",
        id="create_pattern-axis-not-in-mesh",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("kernel->tp", mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="create_pattern-mesh-string",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("kernel->tp", default_spec="dp"),
        fes.PartitionRuleError,
        "default_spec",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="create_pattern-default-string",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("mlp->fsdp..tp"),
        fe.EscaleError,
        "'mlp->fsdp..tp'",
        "empty mesh axis name in 'fsdp..tp'",
        "write None for a dimension left unsharded",
        id="eformer-pattern-empty-axis",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec("(attn|mlp)/kernel->tp"),
        fes.PartitionRuleError,
        "pattern '(attn|mlp)/kernel->tp': in the rule '(attn|mlp)/kernel->tp'",
        "'(attn' is not a valid regex",
        r"'\|' separates the regexes of one rule.*write alternatives as separate regexes",
        id="eformer-pattern-alternation-in-a-regex",
    ),
    case(
        lambda: fe.eformer.create_pattern_based_partition_spec(r"layer_\d{1,2}/kernel->tp"),
        fes.PartitionRuleError,
        "pattern 'layer_\\\\d{1,2}/kernel->tp'",
        "'layer_\\\\d{1'",
        r"',' separates rules.*spell out a \{m,n\} repeat",
        id="eformer-pattern-repeat-with-a-comma",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
