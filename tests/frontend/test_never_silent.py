"""Never silent: every path that cannot apply a sharding warns, and raises when strict.

Each case is one that used to drop a sharding without a word.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.t5x import Partitioner

KEY = jax.random.key(0)
ODD = ("hidden_state", "mlp_intermediate")


@pytest.fixture
def fsdp8(devices):
    return fe.create_mesh((1, 8, 1, 1, 1))


def test_linen_init_of_a_kernel_no_rule_divides(fsdp8):
    # (6, 12) on fsdp=8: hidden_state's fallback (fsdp, sp) divides neither 6 nor 12, and tp=1.
    model = nn.Dense(
        12,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ODD),
    )
    x = jnp.ones((2, 6))
    with pytest.raises(
        fe.ShardingResolutionError,
        match=r"parameter 'params/kernel': logical axes \('hidden_state', 'mlp_intermediate'\) "
        r"with shape \(6, 12\) on mesh \{'dp': 1, 'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1\}",
    ):
        fe.init_sharded(model, fsdp8, KEY, x, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"size 6 is not divisible"):
        variables = fe.init_sharded(model, fsdp8, KEY, x)
    assert variables["params"]["kernel"].sharding.spec == P(None, None)


def test_nnx_init_of_a_kernel_no_rule_divides(fsdp8):
    @fe.sharded_module({"kernel": ODD})
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(6, 12, use_bias=False, rngs=rngs)

    with pytest.raises(fe.ShardingResolutionError, match=r"parameter 'w/kernel'.*\(6, 12\)"):
        fe.init_sharded(Odd, fsdp8, 0, strict=True)
    with pytest.warns(
        fe.ShardingCorrectionWarning, match=r"(?s)'w/kernel'.*size 6 is not divisible"
    ):
        module = fe.init_sharded(Odd, fsdp8, 0)
    assert module.w.kernel.get_value().sharding.spec == P(None, None)


def test_partitioner_strict_raises_on_what_does_not_divide(fsdp8):
    state = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 12), jnp.float32), ODD)}
    partitioner = Partitioner(mesh=fsdp8)
    with pytest.raises(fe.ShardingResolutionError, match=r"parameter 'w'.*\(6, 12\)"):
        partitioner.get_mesh_axes(state, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"parameter 'w'"):
        assert partitioner.get_mesh_axes(state) == {"w": P(None, None)}


def test_constraints_inside_use_sharding_are_told_about_absent_axes(devices):
    mesh = fe.create_mesh((2, 4), ("dp", "tp"))
    x = jnp.ones((8, 8))
    # Given explicitly, the rule naming fsdp (absent) is corrected with a warning...
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"mesh axis 'fsdp' is not in the mesh"):
        direct = fe.constrain(x, ("batch", "hidden_state"), mesh=mesh)
    # ...and inside use_sharding the same spec comes with the warning on entering.
    context = fe.use_sharding(mesh)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"name mesh axes \['ep', 'fsdp', 'sp'\]"):
        context.__enter__()
    try:
        inside = fe.constrain(x, ("batch", "hidden_state"))
    finally:
        context.__exit__(None, None, None)
    assert direct.sharding.spec == inside.sharding.spec == P(None, "tp")


def test_nnx_pattern_matching_nothing_names_the_variables_seen(fsdp8):
    @fe.sharded_module({"kernel": ODD, "wq/kernel": ("hidden_state", "head")})
    class Seen(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(8, 16, rngs=rngs)

    expected = (
        r"Seen: pattern 'wq/kernel' matched no variable \(variables seen under it: w/bias, "
        r"w/kernel\)\. Fix the pattern or remove it\."
    )
    with pytest.raises(fe.EscaleError, match=expected):
        fe.init_sharded(Seen, fsdp8, 0, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=expected):
        fe.init_sharded(Seen, fsdp8, 0)


def test_subclasses_of_a_decorated_class_with_its_own_init_subclass_are_declared(fsdp8):
    # A decorated class that defines __init_subclass__ (a registry, say): its subclasses used
    # to be left undeclared, so an NNX subclass with its own __init__ lost every name silently.
    registry = []

    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Registered(nnx.Module):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            registry.append(cls.__name__)

        def __init__(self, rngs):
            self.w = nnx.Linear(8, 16, use_bias=False, rngs=rngs)

    class Wider(Registered):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.v = nnx.Linear(16, 16, use_bias=False, rngs=rngs)

    assert registry == ["Wider"]
    module = fe.init_sharded(Wider, fsdp8, 0, strict=True)
    for layer in (module.w, module.v):
        assert layer.kernel.get_metadata("logical_axes") == ("hidden_state", "mlp_intermediate")
        assert layer.kernel.get_value().sharding.spec == P(("fsdp", "sp"), None)

    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class LinenRegistered(nn.Module):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            registry.append(cls.__name__)

        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, use_bias=False)(x)

    class LinenWider(LinenRegistered):
        pass

    assert registry == ["Wider", "LinenWider"]
    variables = fe.init_sharded(LinenWider(), fsdp8, KEY, jnp.ones((2, 8)), strict=True)
    assert variables["params"]["Dense_0"]["kernel"].sharding.spec == P(("fsdp", "sp"), None)
