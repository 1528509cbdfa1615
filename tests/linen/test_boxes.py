"""The boxes of Linen declarations: what ``model.init`` returns, and what a lifted transform stacks.

``model.init`` of a decorated class returns the declared names in Flax's logical boxes, which the
model itself never sees; ``nn.scan`` stacks a declared parameter with the name its
``metadata_params`` gives the stacked axis, and the body and its caller read plain arrays.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.plain_reads import IDS, OurTiedLmHead, TiedLmHead, plain, spec_of
from support.values import assert_same_values

import flax_escale as fe

KEY = jax.random.key(0)
X = jnp.ones((2, 16))
HIDDEN = ("fsdp", "sp")


def test_linen_plain_init_returns_boxes_the_model_never_saw(mesh):
    variables = OurTiedLmHead().init(KEY, IDS)
    params = variables["params"]["transformer"]
    assert params["wte"]["embedding"].names == ("vocab", "hidden_state")
    assert params["h"]["kernel"].names == ("hidden_state", "mlp_intermediate")
    assert not isinstance(params["ln_f"]["scale"], nn.Partitioned)
    assert_same_values(nn.unbox(variables), TiedLmHead().init(KEY, IDS))
    np.testing.assert_array_equal(
        OurTiedLmHead().apply(variables, IDS), TiedLmHead().apply(nn.unbox(variables), IDS)
    )
    bound = OurTiedLmHead().bind(variables)
    np.testing.assert_array_equal(bound(IDS), TiedLmHead().apply(nn.unbox(variables), IDS))
    # Flax's idiom on the boxes gives the plan's specs.
    abstract = jax.eval_shape(OurTiedLmHead().init, KEY, IDS)
    idiom = jax.tree.leaves(fe.logical_to_mesh_sharding(abstract, mesh))
    plan = fe.plan_sharding(OurTiedLmHead(), mesh, KEY, IDS)
    assert [sharding.spec for sharding in idiom] == [entry.spec for entry in plan]


# Linen: lifted transforms. The scan body reads its child's variables; the enclosing module
# reads the stacked kernels right after the scan.


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        wi = nn.Dense(16, name="wi")
        h = wi(x)
        return h + x @ plain(wi.variables["params"]["kernel"]), None


def stack_of(body, **metadata):
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
        **metadata,
    )


LAYERS = {"metadata_params": {nn.PARTITION_NAME: "layers"}}
KERNEL = ("hidden_state", "mlp_intermediate")


class Scanned(nn.Module):
    body: type = ScanBody

    @nn.compact
    def __call__(self, x):
        stack = stack_of(self.body, **LAYERS)(name="stack")
        y = stack(x, None)[0]
        return y @ plain(stack.variables["params"]["wi"]["kernel"])[0]


def declared_outside():
    return fe.sharded_module({"stack/wi/kernel": KERNEL})(type("Outside", (Scanned,), {}))()


def declared_in_the_body():
    # The enclosing module declares nothing, and is decorated so that it never sees a box.
    body = fe.sharded_module({"wi/kernel": KERNEL})(type("Body", (ScanBody,), {}))
    return fe.sharded_module({})(type("Enclosing", (Scanned,), {}))(body)


@pytest.mark.parametrize("make", [declared_outside, declared_in_the_body])
def test_linen_scan_reads_plain_kernels_inside_and_after(mesh, make):
    model = make()
    variables = fe.init_sharded(model, mesh, KEY, X)
    assert_same_values(variables, jax.jit(Scanned().init)(KEY, X))
    assert spec_of(variables, "params/stack/wi/kernel") == P(None, HIDDEN, "tp")
    plan = fe.plan_sharding(model, mesh, KEY, X)
    assert plan["params/stack/wi/kernel"].annotation.logical_axes == ("layers", *KERNEL)
    assert model.init(KEY, X)["params"]["stack"]["wi"]["kernel"].names == ("layers", *KERNEL)
    np.testing.assert_array_equal(model.apply(variables, X), Scanned().apply(variables, X))


def test_linen_scan_without_a_name_for_the_stacked_axis_is_refused(mesh):
    @fe.sharded_module({"kernel": KERNEL})
    class Unnamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stack_of(ScanBody)(name="stack")(x, None)[0]

    message = (
        r"parameter params/stack/wi/kernel: a Flax transform \(nn.scan or nn.vmap\) stacks it "
        r"along axis 0, and its declared logical axes \('hidden_state', 'mlp_intermediate'\) "
        r"have no name for that axis; pass metadata_params=\{nn.PARTITION_NAME: 'layers'\}"
    )
    with pytest.raises(fe.EscaleError, match=message):
        fe.plan_sharding(Unnamed(), mesh, KEY, X)
    with pytest.raises(fe.EscaleError, match=message):
        Unnamed().init(KEY, X)
