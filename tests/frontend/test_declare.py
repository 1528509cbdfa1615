"""The declaration mechanics both front ends share (``flax_escale/_frontend/_declare.py``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import MESHES

import flax_escale as fe


def test_subclasses_of_a_decorated_class_with_its_own_init_subclass_are_declared(devices):
    fsdp8 = fe.create_mesh(MESHES["fsdp8"])
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
    variables = fe.init_sharded(
        LinenWider(), fsdp8, jax.random.key(0), jnp.ones((2, 8)), strict=True
    )
    assert variables["params"]["Dense_0"]["kernel"].sharding.spec == P(("fsdp", "sp"), None)
