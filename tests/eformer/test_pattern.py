"""``create_pattern_based_partition_spec`` (``flax_escale/eformer/_pattern.py``): eformer's
pattern strings compiled into regex rules, the specs they give, and their mistakes.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import sharding as fes


def test_pattern_strings():
    spec_of = fe.eformer.create_pattern_based_partition_spec(
        "attention|mlp->fsdp.tp, embed->tp.None"
    )
    assert spec_of("layers/0/attention/q", np.zeros((4, 4))) == P("fsdp", "tp")
    assert spec_of("layers/0/mlp/wi", np.zeros((4, 4))) == P("fsdp", "tp")
    assert spec_of("embed/table", np.zeros((8, 4))) == P("tp", None)
    assert spec_of("embed/bias", np.zeros(4)) == P("tp")  # the None past the rank is cut
    assert spec_of("mlp/scalar", np.float32(1.0)) == P()
    assert spec_of("mlp/no_shape", 3) == P("fsdp", "tp")
    assert spec_of("norm", np.zeros(4)) == P()
    with_default = fe.eformer.create_pattern_based_partition_spec("x->tp", default_spec=P("fsdp"))
    assert with_default("other", np.zeros(4)) == P("fsdp")


def test_pattern_spec_that_drops_mesh_axes_past_the_rank_warns_or_raises():
    spec_of = fe.eformer.create_pattern_based_partition_spec("mlp->fsdp.tp")
    message = r"(?s)parameter 'mlp/bias': .*dimension 1: the spec has 2 entries .*dropped \('tp',\)"
    with pytest.warns(fe.ShardingCorrectionWarning, match=message):
        assert spec_of("mlp/bias", np.zeros(4)) == P("fsdp")
    strict = fe.eformer.create_pattern_based_partition_spec("mlp->fsdp.tp", strict=True)
    with pytest.raises(fe.ShardingResolutionError, match=message):
        strict("mlp/bias", np.zeros(4))
    assert strict("mlp/kernel", np.zeros((4, 4))) == P("fsdp", "tp")
    default = fe.eformer.create_pattern_based_partition_spec("x->tp", default_spec=P("fsdp", "tp"))
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"(?s)'other'.*dropped \('tp',\)"):
        assert default("other", np.zeros(4)) == P("fsdp")


def test_pattern_string_errors():
    with pytest.raises(
        fe.sharding.PartitionRuleError,
        match=r"the rule 'attention' \(as cut at the ',' separators\) must be",
    ):
        fe.eformer.create_pattern_based_partition_spec("attention")
    with pytest.raises(fe.sharding.PartitionRuleError, match="empty regex"):
        fe.eformer.create_pattern_based_partition_spec("a||b->tp")
    with pytest.raises(
        fe.sharding.PartitionRuleError,
        match=r"rule 'mlp->fsdp\.fsdp' gives P\('fsdp', 'fsdp'\), which cannot apply: in "
        r"dimension 1, mesh axis 'fsdp' already shards another dimension\. Name each mesh axis",
    ):
        fe.eformer.create_pattern_based_partition_spec("attention->tp,mlp->fsdp.fsdp")
    with pytest.raises(fe.sharding.PartitionRuleError, match=r"default_spec gives P\('tp', 'tp'\)"):
        fe.eformer.create_pattern_based_partition_spec("a->tp", default_spec=P("tp", "tp"))
    mesh = fe.create_mesh((2, 4), ("dp", "tp"))
    with pytest.raises(
        fe.sharding.PartitionRuleError,
        match=r"rule 'a->fsdp' .*mesh axis 'fsdp' is not in the mesh\. Use the axes of the mesh "
        r"\{'dp': 2, 'tp': 4\}",
    ):
        fe.eformer.create_pattern_based_partition_spec("a->fsdp", mesh=mesh)
    with (
        jax.set_mesh(mesh),
        pytest.raises(fe.sharding.PartitionRuleError, match="mesh axis 'sp' is not"),
    ):
        fe.eformer.create_pattern_based_partition_spec("a->sp")


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
