"""Parameters are born in the layout the training step takes: its first call copies nothing.

A compiled program fixes each input's format (the sharding and the memory layout: the order of
dimensions and the tiling the TPU uses). Were the step's formats for the parameters other
than those ``init_sharded``'s program gives its outputs, the first step would copy every
parameter into them. On the TPU compiler (tiled layouts, nothing run), each example's init and
step are compiled on three meshes and compared parameter by parameter.
"""

import importlib.util
import warnings

import jax
import pytest
from support.example_modules import load

from flax_escale.mesh import Target
from flax_escale.sizing._programs import lower_programs

pytestmark = pytest.mark.slow

SHAPES = [(1, 8, 1, 1, 1), (1, 4, 1, 2, 1), (2, 2, 1, 2, 1)]


@pytest.fixture(scope="module")
def target():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip('the TPU compiler is not installed: pip install "flax-escale[tpu]"')
    return Target.named("v5e-8")


@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_step_takes_each_parameter_in_the_format_init_gives_it(target, example, shape):
    workload = load(example).workload()
    mesh = target.mesh(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        programs = lower_programs(workload, mesh, workload.plan(mesh))
    init, step = programs.init.compile(), programs.step.compile()
    taken = {
        jax.tree_util.keystr(path): f
        for path, f in jax.tree_util.tree_flatten_with_path(step.input_formats)[0]
    }
    compared = 0
    for path, made in jax.tree_util.tree_flatten_with_path(init.output_formats)[0]:
        # Linen's init returns {"params": ...}, which the step's TrainState holds as .params;
        # NNX's returns the model's state, the step's first argument's first part.
        key = jax.tree_util.keystr(path).removeprefix("['params']")
        (format_in_step,) = [
            f for name, f in taken.items() if name.endswith(key) and "opt_state" not in name
        ]
        assert format_in_step.layout == made.layout, key
        assert format_in_step.sharding == made.sharding, key
        assert format_in_step.layout.tiling, key  # a TPU layout: tiled
        compared += 1
    assert compared == {"nnx_llama": 12, "linen_gpt": 17}[example]
