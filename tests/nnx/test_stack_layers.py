"""``flax_escale.nnx.stack_layers``: an nnx.vmap stack's values, one layer at a time.

The stacks are compiled from the Llama example (slow); the mistakes are refused before anything is
built.
"""

import flax.linen as linen
import jax
import numpy as np
import pytest
from flax import nnx
from support.example_modules import load
from support.mistakes import MISTAKE, T, _Up, case, raises_a_library_error

import flax_escale as fe
from flax_escale import nnx as fen


@pytest.fixture(scope="module")
def llama():
    return load("nnx_llama")


def _vmapped(llama):
    """The example's Llama with its stack made the usual way, by nnx.vmap."""

    class Vmapped(llama.Llama):
        def __init__(self, c, *, rngs):
            self.embed = nnx.Embed(c.vocab, c.hidden, rngs=rngs)

            @nnx.split_rngs(splits=c.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=fen.stacked())
            def make(rngs):
                return llama.Block(c, rngs=rngs)

            self.blocks = make(rngs)
            self.final_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
            self.lm_head = nnx.Linear(c.hidden, c.vocab, use_bias=False, rngs=rngs)

    return Vmapped


@pytest.mark.slow
@pytest.mark.xla
def test_values_specs_and_metadata_equal_an_nnx_vmap_stack(llama):
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    config = llama.Config()
    looped = nnx.state(fe.init_sharded(llama.Llama, mesh, 0, config))
    vmapped = nnx.state(fe.init_sharded(_vmapped(llama), mesh, 0, config))
    assert jax.tree.structure(looped) == jax.tree.structure(vmapped)
    for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(vmapped), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kernel = looped["blocks"]["mlp"]["up"]["kernel"]
    assert kernel.shape == (config.layers, config.hidden, config.mlp)
    assert kernel.sharding.spec[0] is None  # the stacked axis stays whole


@pytest.mark.slow
@pytest.mark.xla
def test_the_cpu_init_draws_one_layer_at_a_time(llama):
    # Memory from the compiled program (nothing runs): 16 layers of 512 x 2048 on 8 devices.
    config = llama.Config(
        vocab=256, hidden=512, heads=8, kv_heads=4, head_dim=64, mlp=2048, layers=16
    )
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    looped = fe.lower_init(llama.Llama, mesh, 0, config).compile().memory_analysis()
    vmapped = fe.lower_init(_vmapped(llama), mesh, 0, config).compile().memory_analysis()
    outputs = looped.output_size_in_bytes
    assert vmapped.output_size_in_bytes == outputs
    assert outputs + looped.temp_size_in_bytes <= 1.25 * outputs
    assert vmapped.temp_size_in_bytes > 1.5 * outputs


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            ("block", 4, "rngs"),
            fe.EscaleTypeError,
            r"make must be a function, got the string 'block'",
        ),
        ((lambda r: r, 0, "rngs"), fe.EscaleError, r"count .*0"),
        ((lambda r: r, 4, 0), fe.EscaleTypeError, r"rngs must be an nnx.Rngs, got int 0"),
        (
            (lambda rngs: 3, 4, "rngs"),
            fe.EscaleTypeError,
            r"make must return one layer, an nnx.Module, got int 3; pass e.g. lambda rngs",
        ),
        (
            (lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 4, "rngs"),
            fe.EscaleTypeError,
            r"make must take one argument, the layer's nnx.Rngs, got <lambda>\(\)",
        ),
        (
            # Flax's metaclass shows a layer class as (*args, **kwargs): its __init__ is read.
            (nnx.Linear, 4, "rngs"),
            fe.EscaleTypeError,
            r"make must take one argument, the layer's nnx.Rngs, got Linear\(in_features, "
            r"out_features",
        ),
    ],
    ids=[
        "not callable",
        "count 0",
        "rngs an int",
        "returns an int",
        "takes no rngs",
        "a layer class",
    ],
)
def test_bad_arguments_are_refused(args, error, match):
    make, count, rngs = args
    if rngs == "rngs":
        rngs = nnx.Rngs(0)
    with pytest.raises(error, match=match):
        fen.stack_layers(make, count, rngs)


# Mistakes users make with stack_layers, refused before a layer is built. What a case asserts,
# and the rest of the table: support/mistakes.py.
CASES = [
    case(
        lambda: fen.stack_layers(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), 2, nnx.Rngs(0)),
        T,
        "make",
        "an instance of Linear, a layer already built",
        r"pass its class, Linear, if it takes only rngs, or e\.g\. lambda rngs: "
        r"Linear\(\.\.\., rngs=rngs\)",
        id="nnx-stack_layers-module-instance",
    ),
    case(
        lambda: fen.stack_layers(linen.Dense(4), 2, nnx.Rngs(0)),
        T,
        "make",
        "the flax.linen module Dense",
        r"stack NNX modules .*flax\.nnx\.bridge\.ToNNX",
        id="nnx-stack_layers-linen-module",
    ),
    case(
        lambda: fen.stack_layers(_Up, 2, 0),
        T,
        "rngs",
        "int 0",
        r"pass e\.g\. nnx\.Rngs\(0\)",
        id="nnx-stack_layers-rngs-seed",
    ),
    # --- a layer class given to stack_layers, whose metaclass hides its parameters ---------
    case(
        lambda: fen.stack_layers(nnx.Linear, 2, nnx.Rngs(0)),
        T,
        "make",
        "Linear(in_features, out_features",
        r"lambda rngs: Block\(config, rngs=rngs\)",
        id="nnx-stack_layers-layer-class",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
