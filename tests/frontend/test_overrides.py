"""Correcting a model one did not write: ``overrides=``, the subclass form of ``sharded_module``,
and patterns that hit parameters the model annotates itself."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support.values import assert_same_value

import flax_escale as fe
from flax_escale import linen as fel

KEY = jax.random.key(0)
X = jnp.ones((2, 16))
INIT = nn.initializers.lecun_normal()


class ThirdParty(nn.Module):
    """Stands for a model from another project: annotated in its own file, in its own names."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")))(x)
        return nn.Dense(16, name="out")(x)


def _mesh():
    return fe.create_mesh((1, 4, 1, 2, 1))


def test_overrides_replace_the_models_own_annotation_and_fill_unannotated_ones():
    overrides = {
        "Dense_0/kernel": ("mlp_intermediate", "hidden_state"),
        "out/kernel": ("mlp_intermediate", "hidden_state"),
    }
    plan = fe.plan_sharding(ThirdParty(), _mesh(), KEY, X, overrides=overrides, strict=True)
    assert plan["params/Dense_0/kernel"].spec == P("tp", ("fsdp", "sp"))
    assert plan["params/Dense_0/kernel"].annotation.source == (
        "overrides['Dense_0/kernel'] (replacing ('embed', 'mlp') from nn.with_logical_partitioning)"
    )
    assert plan["params/out/kernel"].spec == P("tp", ("fsdp", "sp"))
    assert plan["params/out/bias"].annotation is None
    variables = fe.init_sharded(ThirdParty(), _mesh(), KEY, X, overrides=overrides, strict=True)
    expected = nn.unbox(jax.jit(ThirdParty().init)(KEY, X))
    for path in (("Dense_0", "kernel"), ("out", "kernel")):
        got = variables["params"][path[0]][path[1]]
        assert got.sharding.spec == P("tp", ("fsdp", "sp"))
        assert_same_value(got, expected["params"][path[0]][path[1]], "/".join(path))


def test_overridden_parameters_carry_their_optimizer_state_with_them():
    overrides = {"Dense_0/kernel": ("mlp_intermediate", "hidden_state")}
    rules = fe.PartitionAxis().with_aliases("t5x")
    state = fel.init_train_state(
        ThirdParty(), _mesh(), KEY, X, tx=optax.adam(1e-3), rules=rules, overrides=overrides
    )
    assert state.params["Dense_0"]["kernel"].sharding.spec == P("tp", ("fsdp", "sp"))
    assert state.opt_state[0].mu["Dense_0"]["kernel"].sharding.spec == P("tp", ("fsdp", "sp"))


def test_an_override_that_matches_nothing_is_reported_with_the_real_paths():
    with pytest.warns(fe.ShardingCorrectionWarning) as caught:
        fe.plan_sharding(
            ThirdParty(),
            _mesh(),
            KEY,
            X,
            rules=fe.PartitionAxis().with_aliases("t5x"),
            overrides={"Dense_9/kernel": ("hidden_state", None)},
        )
    message = str(caught[0].message)
    assert "overrides: pattern 'Dense_9/kernel' matched no variable" in message
    assert "params/Dense_0/bias, params/Dense_0/kernel" in message
    with pytest.raises(fe.EscaleError, match=r"overrides: pattern 'Dense_9/kernel' matched no"):
        fe.plan_sharding(
            ThirdParty(),
            _mesh(),
            KEY,
            X,
            rules=fe.PartitionAxis().with_aliases("t5x"),
            overrides={"Dense_9/kernel": (None, None)},
            strict=True,
        )


def test_an_override_of_another_rank_names_the_path_and_shape():
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "overrides: parameter 'params/out/kernel' of shape (32, 16) matches pattern "
            "'out/kernel', whose logical axes ('hidden_state',) name 1 dimensions instead of 2"
        ),
    ):
        fe.plan_sharding(ThirdParty(), _mesh(), KEY, X, overrides={"out/kernel": ("hidden_state",)})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ("kernel", r"overrides: logical_axes must map parameter-path patterns"),
        ({"kernel": "hidden_state"}, r"the logical axes of pattern 'kernel' must be a tuple"),
        ({"kernel[": ("hidden_state", None)}, r"pattern 'kernel\[' is not a valid regular"),
    ],
)
def test_malformed_overrides_are_refused(overrides, match):
    with pytest.raises(fe.EscaleError, match=match):
        fe.plan_sharding(ThirdParty(), _mesh(), KEY, X, overrides=overrides)


def test_a_pattern_on_a_parameter_the_model_annotates_says_so_and_names_the_way_out():
    @fe.sharded_module({"Dense_0/kernel": ("hidden_state", "mlp_intermediate")})
    class Decorated(ThirdParty):
        pass

    with pytest.warns(fe.ShardingCorrectionWarning) as caught:
        fe.plan_sharding(Decorated(), _mesh(), KEY, X, rules=fe.PartitionAxis().with_aliases("t5x"))
    message = str(caught[0].message)
    assert "pattern 'Dense_0/kernel' matched params/Dense_0/kernel, which keep" in message
    assert "overrides={'Dense_0/kernel': logical_axes}" in message
    assert "matched no parameter" not in message


def test_the_subclass_form_leaves_the_third_party_class_untouched():
    @fe.sharded_module({"out/kernel": ("mlp_intermediate", "hidden_state")})
    class Sharded(ThirdParty):
        pass

    rules = fe.PartitionAxis().with_aliases("t5x")
    plan = fe.plan_sharding(Sharded(), _mesh(), KEY, X, rules=rules, strict=True)
    assert plan["params/out/kernel"].spec == P("tp", ("fsdp", "sp"))
    assert plan["params/out/kernel"].annotation.source.endswith("Sharded['out/kernel']")
    untouched = fe.plan_sharding(ThirdParty(), _mesh(), KEY, X, rules=rules, strict=True)
    assert untouched["params/out/kernel"].annotation is None
    params = ThirdParty().init(KEY, X)["params"]
    assert not isinstance(params["out"]["kernel"], nn.LogicallyPartitioned)


class NnxThirdParty(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(
            16, 32, kernel_init=nnx.with_partitioning(INIT, ("fsdp", None)), rngs=rngs
        )
        self.down = nnx.Linear(32, 16, rngs=rngs)


def test_nnx_overrides_replace_out_sharding_and_reach_the_variables_metadata():
    overrides = {"up/kernel": ("hidden_state", "mlp_intermediate")}
    model = fe.init_sharded(NnxThirdParty, _mesh(), 0, overrides=overrides, strict=True)
    kernel = model.up.kernel
    assert kernel.get_value().sharding.spec == P(("fsdp", "sp"), "tp")
    assert kernel.get_metadata("out_sharding") == (("fsdp", "sp"), "tp")
    assert nnx.get_partition_spec(nnx.state(model))["up"]["kernel"].get_value() == P(
        ("fsdp", "sp"), "tp"
    )
    with nnx.use_eager_sharding(False):
        reference = NnxThirdParty(nnx.Rngs(0))
    np.testing.assert_array_equal(kernel.get_value(), reference.up.kernel.get_value())


def test_nnx_pattern_on_a_variable_with_its_own_out_sharding_says_so():
    @fe.sharded_module({"up/kernel": ("hidden_state", "mlp_intermediate")})
    class Decorated(NnxThirdParty):
        pass

    with pytest.warns(
        fe.ShardingCorrectionWarning,
        match=re.escape(
            "pattern 'up/kernel' matched up/kernel, which keep the annotations the model gives them"
        ),
    ):
        plan = fe.plan_sharding(Decorated, _mesh(), 0)
    assert plan["up/kernel"].spec == P("fsdp", None)
