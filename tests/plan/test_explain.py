"""``ShardingPlan.explain``: each kind of step, against literal text."""

import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_escale as fe
from flax_escale.plan import Annotation, annotated_leaves, build_plan

RULES = [
    ("embed", "fsdp"),
    ("mlp", "fsdp"),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv", "sp"),
    ("kv", "tp"),
    ("experts", "expert"),
]
MESH = "mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)"


def _plan(*arrays, rules=RULES):
    items = [(path, jax.ShapeDtypeStruct(shape, np.float32), a) for path, shape, a in arrays]
    treedef = jax.tree.structure({path: 0 for path, _, _ in items})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return build_plan(treedef, items, fe.create_mesh((1, 4, 1, 2, 1)), rules=rules)


def _expect(plan, path, text):
    assert plan.explain(path) == textwrap.dedent(text).strip("\n")


def test_an_applied_rule_and_the_bytes_against_the_ideal_share():
    plan = _plan(("w", (8, 6), Annotation(("embed", "heads"), source="the model's box")))
    _expect(
        plan,
        "w",
        f"""
        w: float32[8, 6] on {MESH}
          annotation: logical axes ('embed', 'heads'), from the model's box
          rules for these names, in order:
            rules[0] ('embed', 'fsdp') on dim 0: applied
            rules[3] ('heads', 'tp') on dim 1: applied
          the rules give P('fsdp', 'tp')
          spec: P('fsdp', 'tp')
          bytes per device: 24 B of 192 B (1.00x the ideal share, 24 B)
        """,
    )


def test_a_rule_passed_over_because_its_axes_do_not_divide_the_size():
    plan = _plan(("w", (6, 8), Annotation(("mlp", None), source="m")))
    _expect(
        plan,
        "w",
        f"""
        w: float32[6, 8] on {MESH}
          annotation: logical axes ('mlp', None), from m
          rules for these names, in order:
            rules[1] ('mlp', 'fsdp') on dim 0: passed over: size 6 is not divisible by 'fsdp' (4)
            rules[2] ('mlp', 'tp') on dim 0: applied
          the rules give P('tp', None)
          spec: P('tp', None)
          bytes per device: 96 B of 192 B (4.00x the ideal share, 24 B)
        """,
    )


def test_a_rule_passed_over_because_another_dimension_already_uses_its_axis():
    plan = _plan(("w", (8, 16), Annotation(("embed", "mlp"), source="m")))
    _expect(
        plan,
        "w",
        f"""
        w: float32[8, 16] on {MESH}
          annotation: logical axes ('embed', 'mlp'), from m
          rules for these names, in order:
            rules[0] ('embed', 'fsdp') on dim 0: applied
            rules[1] ('mlp', 'fsdp') on dim 1: passed over: 'fsdp' already splits dim 0
            rules[2] ('mlp', 'tp') on dim 1: applied
          the rules give P('fsdp', 'tp')
          spec: P('fsdp', 'tp')
          bytes per device: 64 B of 512 B (1.00x the ideal share, 64 B)
        """,
    )


def test_a_rule_of_size_one_leaves_the_dimension_to_a_later_rule():
    plan = _plan(("w", (4, 8), Annotation(("kv", None), source="m")))
    _expect(
        plan,
        "w",
        f"""
        w: float32[4, 8] on {MESH}
          annotation: logical axes ('kv', None), from m
          rules for these names, in order:
            rules[4] ('kv', 'sp') on dim 0: passed over: 'sp' has size 1 (a later rule for the name may split it)
            rules[5] ('kv', 'tp') on dim 0: applied
          the rules give P('tp', None)
          spec: P('tp', None)
          bytes per device: 64 B of 128 B (4.00x the ideal share, 16 B)
        """,  # noqa: E501
    )


def test_a_rule_naming_an_axis_the_mesh_lacks_is_corrected():
    plan = _plan(("w", (4, 8), Annotation(("experts", None), source="m")))
    _expect(
        plan,
        "w",
        f"""
        w: float32[4, 8] on {MESH}
          annotation: logical axes ('experts', None), from m
          rules for these names, in order:
            rules[6] ('experts', 'expert') on dim 0: applied, but the mesh has no axis 'expert' (corrected below)
          the rules give P('expert', None)
          corrected dim 0: mesh axis 'expert' is not in the mesh, dropped ('expert',)
          spec: P(None, None)
          bytes per device: 128 B of 128 B (8.00x the ideal share, 16 B)
        """,  # noqa: E501
    )


def test_a_name_without_a_rule_and_an_unannotated_array():
    plan = _plan(("w", (4, 8), Annotation(("nope", None), source="m")), ("b", (4,), None))
    _expect(
        plan,
        "w",
        f"""
        w: float32[4, 8] on {MESH}
          annotation: logical axes ('nope', None), from m
          rules for these names, in order:
            no rule names 'nope': its dimension stays unsharded
          the rules give P(None, None)
          spec: P(None, None)
          bytes per device: 128 B of 128 B (8.00x the ideal share, 16 B)
        """,
    )
    _expect(
        plan,
        "b",
        f"""
        b: float32[4] on {MESH}
          annotation: none (replicated)
          spec: P(None,)
          bytes per device: 16 B of 16 B (8.00x the ideal share, 2 B)
        """,
    )


def test_an_idle_axis_completes_a_large_parameter():
    # (another array is split over tp, which makes it a parameter axis)
    plan = _plan(
        ("w", (1024, 512), Annotation(("embed", None), source="m")),
        ("v", (8, 8), Annotation((None, "heads"), source="m")),
    )
    _expect(
        plan,
        "w",
        f"""
        w: float32[1024, 512] on {MESH}
          annotation: logical axes ('embed', None), from m
          rules for these names, in order:
            rules[0] ('embed', 'fsdp') on dim 0: applied
          the rules give P('fsdp', None)
          completed: idle mesh axis 'tp' put to use on dim 1 (size 512, now split 2 ways)
          spec: P('fsdp', 'tp')
          bytes per device: 256.00 KiB of 2.00 MiB (1.00x the ideal share, 256.00 KiB)
        """,
    )


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
class _Declared(nn.Dense):
    pass


class _ThirdParty(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(16, kernel_init=init, name="proj")(x)


def test_a_sharded_module_pattern_and_an_override_name_themselves():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    x = jnp.ones((2, 8))
    plan = fe.plan_sharding(_Declared(16), mesh, jax.random.key(0), x)
    _expect(
        plan,
        "params/kernel",
        f"""
        params/kernel: float32[8, 16] on {MESH}
          annotation: logical axes ('hidden_state', 'mlp_intermediate'), from _Declared['kernel']
          rules for these names, in order:
            rules[3] ('mlp_intermediate', 'tp') on dim 1: applied
            rules[9] ('hidden_state', 'tp') on dim 0: passed over: 'tp' already splits dim 1
            rules[17] ('hidden_state', ('fsdp', 'sp')) on dim 0: applied
            rules[21] ('mlp_intermediate', ('fsdp', 'sp')) on dim 1: passed over: an earlier rule already set this dimension
          the rules give P(('fsdp', 'sp'), 'tp')
          spec: P(('fsdp', 'sp'), 'tp')
          bytes per device: 64 B of 512 B (1.00x the ideal share, 64 B)
        """,  # noqa: E501
    )
    overrides = {"proj/kernel": ("mlp_intermediate", "hidden_state")}
    plan = fe.plan_sharding(_ThirdParty(), mesh, jax.random.key(0), x, overrides=overrides)
    first = plan.explain("params/proj/kernel").splitlines()[1]
    assert first == (
        "  annotation: logical axes ('mlp_intermediate', 'hidden_state'), from "
        "overrides['proj/kernel'] (replacing ('embed', 'mlp') from nn.with_logical_partitioning)"
    )


def test_optimizer_state_names_the_parameter_it_follows():
    box = nn.LogicallyPartitioned(jnp.zeros((8, 16)), ("embed", "heads"))
    params = {"w": box}
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    treedef, items = annotated_leaves(state)
    plan = build_plan(treedef, items, fe.create_mesh((1, 4, 1, 2, 1)), rules=RULES)
    mu = next(e.path for e in plan if e.path.endswith("mu/w"))
    lines = plan.explain(mu).splitlines()
    assert lines[2] == (
        "  optimizer state of 'params/w': keeps its dimensions [0, 1] and their mesh axes (the "
        "parameter's explanation says why it has them)"
    )
    assert lines[3] == "  spec: P('fsdp', 'tp')"


def test_a_path_the_plan_lacks_is_refused_with_close_paths():
    plan = _plan(*[(f"layer_{i}/kernel", (8, 8), None) for i in range(12)])
    # A library error (as the errors page promises) that is still the KeyError of a mapping.
    with pytest.raises(
        fe.plan.UnknownPathError,
        match=r"^ShardingPlan\.explain: no array at path 'layer_1/kernal'; the closest: "
        r"\['layer_1/kernel', ",
    ) as caught:
        plan.explain("layer_1/kernal")
    assert isinstance(caught.value, fe.EscaleError)
    assert isinstance(caught.value, KeyError)
    with pytest.raises(KeyError, match=r"no path of the plan is close to it \(the plan has 12"):
        plan.explain("optimizer/mu")


def test_explain_refuses_a_path_that_is_not_a_string():
    plan = _plan(("w", (8, 8), None))
    with pytest.raises(
        fe.EscaleTypeError, match=r"ShardingPlan\.explain: path must be an array's path as a "
    ):
        plan.explain(0)
