"""Tests of ``will_it_fit`` (``flax_escale/tools/_memory.py``): its estimate and its refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, X, case, raises_a_library_error

import flax_escale as fe
from flax_escale._units import format_bytes


def test_will_it_fit_reads_the_compiled_memory():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    x = jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    step = jax.jit(lambda x: jnp.tanh(x) * 2)
    estimate = fe.will_it_fit(step, x, device_bytes=1 << 30)
    assert estimate.argument_bytes == 1024 * 256 * 4 // 8
    assert estimate.output_bytes == 1024 * 256 * 4 // 8
    assert estimate.fits
    assert not fe.will_it_fit(step.lower(x), device_bytes=1000).fits
    compiled = fe.will_it_fit(step.lower(x).compile())
    assert compiled.peak_bytes >= compiled.argument_bytes
    assert "peak" in str(compiled)
    assert compiled.backend == "cpu"
    assert str(compiled).startswith("per cpu device: arguments 128.00 KiB")


def test_will_it_fit_labels_an_init_with_its_temporaries_and_backend():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    model = nn.Dense(
        1024,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )
    lowered = fe.lower_init(model, mesh, jax.random.key(0), jnp.ones((2, 1024)))
    estimate = fe.will_it_fit(lowered)
    assert estimate.output_bytes == 1024 * 1024 * 4 // 8
    # XLA's CPU backend materializes the random bits before transforming them.
    assert estimate.temp_bytes > 0
    assert estimate.peak_bytes == estimate.argument_bytes + estimate.output_bytes + (
        estimate.temp_bytes
    )
    assert f"temporaries {format_bytes(estimate.temp_bytes)}" in str(estimate)


def test_will_it_fit_reads_nnx_jits_stages_as_jaxs_own():
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    x = jnp.ones((8, 64))
    lowered = nnx.jit(lambda m, x: m(x)).lower(model, x)
    compiled = lowered.compile()
    expected = fe.will_it_fit(compiled.compiled)
    assert fe.will_it_fit(compiled) == expected
    assert fe.will_it_fit(lowered).peak_bytes == expected.peak_bytes


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.will_it_fit("step", X),
        T,
        "fn",
        "'step'",
        "not its name",
        id="will_it_fit-string",
    ),
    case(lambda: fe.will_it_fit(None, X), T, "fn", "None", "function", id="will_it_fit-none"),
    case(lambda: fe.will_it_fit(42, X), T, "fn", "int 42", "function", id="will_it_fit-int"),
    case(
        lambda: fe.will_it_fit(jnp.sin, X, device_bytes="16GB"),
        T,
        "device_bytes",
        "'16GB'",
        "positive int",
        id="will_it_fit-device_bytes-string",
    ),
    case(
        lambda: fe.will_it_fit(jnp.sin, X, device_bytes=1.5e9),
        T,
        "device_bytes",
        "float 1500000000.0",
        "pass the int 1500000000",
        id="will_it_fit-device_bytes-float",
    ),
    case(
        lambda: fe.will_it_fit(jnp.sin, X, device_bytes=0),
        fe.EscaleError,
        "device_bytes",
        "0",
        "positive int",
        id="will_it_fit-device_bytes-zero",
    ),
    case(
        lambda: fe.will_it_fit(lambda x, y: x, X),
        T,
        "fn",
        "<lambda>(x, y)",
        r"missing a required argument: 'y'.*will_it_fit\(fn, \*args, \*\*kwargs\)",
        id="will_it_fit-fn-missing-argument",
    ),
    case(
        lambda: fe.will_it_fit(jax.jit(lambda x: x), X, y=X),
        T,
        "fn",
        "<lambda>(x)",
        r"unexpected keyword argument 'y'",
        id="will_it_fit-jit-fn-unexpected-keyword",
    ),
    case(
        lambda: fe.will_it_fit(nn.Dense, X),
        T,
        "fn",
        "Linen module class Dense",
        r"model\.apply\(variables, x\)",
        id="will_it_fit-linen-class",
    ),
    case(
        lambda: fe.will_it_fit(nn.Dense(4), X),
        T,
        "fn",
        "Linen module Dense",
        r"model\.apply\(variables, x\)",
        id="will_it_fit-linen-module",
    ),
    case(
        lambda: fe.will_it_fit(nnx.Linear, X),
        T,
        "fn",
        "NNX module class Linear",
        r"lambda model, x: model\(x\)",
        id="will_it_fit-nnx-class",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
