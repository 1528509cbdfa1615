"""``pipeline()`` (``flax_escale/pipeline/_run.py``): the same values and gradients as a scan of
the same layer, for GPipe and the circular schedule on Auto and Explicit meshes, whatever is
rematerialized; the layers' own constraints inside the stages; the mistakes it refuses."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.pipelines import QUICK_COMPILE, RULES, assert_close

import flax_escale as fe
from flax_escale.errors import EscaleTypeError
from flax_escale.pipeline import PipelineError, pipeline, stage_rules

HIDDEN = 16
BATCH = 16


def layer(w, x):
    return jnp.tanh(x @ w["kernel"] + w["bias"])


def scanned(stack, x):
    return jax.lax.scan(lambda h, w: (layer(w, h), None), x, stack)[0]


def constrained_layer(w, x):
    # A layer that says how its activations are split, in the model's own logical names: in a
    # stage, batch is what the rules less pp give it (fsdp), not pp.
    h = fe.constrain(x @ w["kernel"] + w["bias"], ("batch", "hidden_state"))
    return jnp.tanh(h)


def stack_of(layers, key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "kernel": jax.random.normal(k1, (layers, HIDDEN, HIDDEN)) / 4,
        "bias": jax.random.normal(k2, (layers, HIDDEN)) / 4,
    }


def shapes(layers):
    """A stack's shapes: the mistakes are refused before any value is read."""
    return jax.eval_shape(lambda: stack_of(layers))


def placed(mesh, layers, whole=False):
    """The stack with its layers on pp (or whole), the batch on every axis: pp acts as data
    parallelism outside the pipeline."""
    stack = jax.device_put(stack_of(layers), NamedSharding(mesh, P() if whole else P("pp")))
    x = jax.random.normal(jax.random.key(1), (BATCH, HIDDEN))
    batch_axes = (*(a for a in mesh.axis_names if a != "pp"), "pp")
    return stack, jax.device_put(x, NamedSharding(mesh, P(batch_axes)))


def loss_and_grads(run, stack, x):
    def loss(stack, x):
        return jnp.sum(run(stack, x) ** 2)

    return run(stack, x), jax.grad(loss, argnums=(0, 1))(stack, x)


@pytest.mark.parametrize(
    ("shape", "names", "axis_types", "microbatches", "repeats", "layers"),
    [
        ((2, 4), ("pp", "fsdp"), None, 4, 1, 4),
        ((2, 4), ("pp", "fsdp"), "explicit", 4, 2, 8),
        ((4, 2), ("pp", "tp"), "explicit", 4, 1, 8),
        ((4, 2), ("pp", "fsdp"), None, 8, 2, 8),
    ],
    ids=["gpipe-auto", "circular-explicit", "gpipe-pp4-explicit", "circular-pp4-auto"],
)
def test_equals_scan(shape, names, axis_types, microbatches, repeats, layers):
    mesh = fe.create_mesh(shape, names, axis_types=axis_types)
    stack, x = placed(mesh, layers)
    # The scan's stack is whole on every device (a scan over a pp-split stack is refused on an
    # Explicit mesh).
    whole, _ = placed(mesh, layers, whole=True)
    run = functools.partial(pipeline, layer, microbatches=microbatches, repeats=repeats)

    @functools.partial(jax.jit, compiler_options=QUICK_COMPILE)
    def both(stack, whole, x):
        return loss_and_grads(run, stack, x), loss_and_grads(scanned, whole, x)

    with jax.set_mesh(mesh):
        got, want = both(stack, whole, x)
    assert_close(got, want)
    # The stack's gradients keep its layout: each stage's on its stage.
    y, (grads, _) = got
    assert y.shape == x.shape
    for name in ("kernel", "bias"):
        assert grads[name].sharding.is_equivalent_to(stack[name].sharding, grads[name].ndim)


def test_remat_policies_give_the_same_values():
    mesh = fe.create_mesh((2, 4), ("pp", "fsdp"))
    stack, x = placed(mesh, 8)

    @functools.partial(jax.jit, compiler_options=QUICK_COMPILE)
    def every_policy(stack, x):
        return {
            remat: loss_and_grads(
                functools.partial(pipeline, layer, microbatches=4, repeats=2, remat=remat),
                stack,
                x,
            )
            for remat in ("none", "layer", "iteration", "save_dots")
        }

    with jax.set_mesh(mesh):
        got = every_policy(stack, x)
    want = loss_and_grads(scanned, stack_of(8), x)
    for remat, values in got.items():
        assert_close(values, want), remat


def test_stage_rules():
    assert stage_rules(RULES.logical_axis_rules()) == tuple(
        (name, {("fsdp", "dp", "pp"): ("fsdp", "dp"), "pp": None}.get(target, target))
        for name, target in RULES.logical_axis_rules()
    )
    assert stage_rules((("batch", ("pp", "dp")), ("layers", "stage")), axis="stage") == (
        ("batch", ("pp", "dp")),
        ("layers", None),
    )


def test_layers_constraints_apply_inside_the_stages():
    # Outside a pipeline these rules put the batch on (fsdp, dp, pp); inside the stages pp and
    # fsdp are manual (each device runs its 2 rows of each 8-row microbatch), and the layers'
    # constraints there name neither.
    mesh = fe.create_mesh((2, 1, 4, 1, 1, 1), RULES.mesh_axis_names)
    stack, x = placed(mesh, 4)
    run = jax.jit(
        lambda stack, x: pipeline(constrained_layer, stack, x, microbatches=2, rules=RULES)
    )
    with jax.set_mesh(mesh):
        y = run(stack, x)
        with nn.logical_axis_rules(RULES.logical_axis_rules()):
            want = jax.jit(
                lambda s, x: jax.lax.scan(lambda h, w: (constrained_layer(w, h), None), x, s)[0]
            )(stack, x)
        text = run.lower(stack, x).as_text()
    assert_close(y, want)
    assert ("[{?}, {?}]", "2x16xf32") in sharding_constraints(text)
    assert not [c for c in sharding_constraints(text) if '"pp"' in c[0] or '"fsdp"' in c[0]]


def test_mesh_without_the_stage_axis():
    mesh = fe.create_mesh((2, 4), ("dp", "fsdp"))
    stack, x = shapes(4), jnp.ones((BATCH, HIDDEN))
    with pytest.raises(
        PipelineError,
        match=r"the mesh \{'dp': 2, 'fsdp': 4\} has no pipeline axis 'pp': build the mesh with "
        r"a stage axis, e\.g\. create_mesh\(\(2, -1\), \('pp', 'fsdp'\)\) or --mesh pp:2",
    ):
        pipeline(layer, stack, x, microbatches=2, mesh=mesh)
    with pytest.raises(PipelineError, match=r"no pipeline axis 'stage'.*pass axis="):
        pipeline(layer, stack, x, microbatches=2, mesh=mesh, axis="stage")


PP2 = fe.create_mesh((2, 4), ("pp", "fsdp"))
X = jnp.ones((BATCH, HIDDEN))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: pipeline(
                layer,
                {"kernel": jnp.ones((4, 2, 2)), "bias": jnp.ones((3, 2))},
                X,
                microbatches=2,
                mesh=PP2,
            ),
            PipelineError,
            r"the leaves of the stack disagree on the layer count \(leading dimension\): "
            r"params\['bias'\]: 3, params\['kernel'\]: 4; stack every parameter",
        ),
        (
            lambda: pipeline(
                layer,
                {"kernel": jnp.ones((4, 2, 2)), "step": jnp.ones(())},
                X,
                microbatches=2,
                mesh=PP2,
            ),
            PipelineError,
            r"params\['step'\] is a scalar: every leaf of the stack needs the layer count as its "
            r"leading dimension",
        ),
        (
            lambda: pipeline(layer, {}, X, microbatches=2, mesh=PP2),
            PipelineError,
            r"params has no arrays: pass the stacked parameters",
        ),
        (
            lambda: pipeline(layer, shapes(4), X, microbatches=2, remat="all", mesh=PP2),
            EscaleTypeError,
            r"remat must be one of \('none', 'layer', 'iteration', 'save_dots'\) or None, got "
            r"'all'",
        ),
        (
            lambda: pipeline("layer", shapes(4), X, microbatches=2, mesh=PP2),
            EscaleTypeError,
            r"layer.*pass a function \(params, x\) -> x of one layer",
        ),
        (
            lambda: pipeline(layer, shapes(4), jnp.ones(()), microbatches=2, mesh=PP2),
            EscaleTypeError,
            r"x must have a batch dimension to cut into microbatches, got a scalar",
        ),
        (
            lambda: pipeline(layer, shapes(4), [1.0, 2.0], microbatches=2, mesh=PP2),
            EscaleTypeError,
            r"x must be an array, got",
        ),
        # The uneven cases, as pipeline() meets them: the numbers and the fix.
        (
            lambda: pipeline(layer, shapes(6), X, microbatches=2, repeats=2, mesh=PP2),
            PipelineError,
            r"6 layers, which 2 stages x 2 repeats \(4 chunks of equal size\) cannot split "
            r"evenly: use stages dividing 6 / 2 = 3 \(1, 3\)",
        ),
        (
            lambda: pipeline(layer, shapes(4), X, microbatches=3, mesh=PP2),
            PipelineError,
            r"microbatches=3 is not a multiple of the 2 stages.*use microbatches=2",
        ),
        (
            lambda: pipeline(layer, shapes(4), jnp.ones((12, HIDDEN)), microbatches=8, mesh=PP2),
            PipelineError,
            r"a batch of 12 rows cannot be cut into 8 equal microbatches",
        ),
    ],
    ids=[
        "layer-counts",
        "scalar-leaf",
        "no-leaves",
        "remat",
        "layer",
        "scalar-x",
        "list-x",
        "layers-uneven",
        "microbatches-uneven",
        "batch-uneven",
    ],
)
def test_mistakes(call, error, message):
    with pytest.raises(error, match=message):
        call()
