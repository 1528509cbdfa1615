"""A pipeline's schedule (``flax_escale/pipeline/_schedule.py``): its figures, and the uneven
splits it refuses with the numbers and the fix."""

import pytest

from flax_escale.errors import EscaleError
from flax_escale.pipeline import PipelineError, Schedule


@pytest.mark.parametrize(
    ("p", "m", "v", "layers", "iterations", "per_stage"),
    [(2, 4, 1, 4, 5, 2), (4, 8, 1, 16, 11, 4), (4, 8, 2, 16, 19, 2), (2, 2, 3, 6, 7, 1)],
)
def test_figures(p, m, v, layers, iterations, per_stage):
    schedule = Schedule(stages=p, microbatches=m, repeats=v, layers=layers)
    assert schedule.iterations == m * v + p - 1 == iterations
    assert schedule.layers_per_stage == per_stage
    assert schedule.layers_per_stage * p * v == layers
    # GPipe's bubble (p - 1) / (m + p - 1); the circular one (p - 1) / (v m + p - 1).
    assert schedule.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert schedule.kind == ("gpipe" if v == 1 else "circular")
    assert schedule.permuted_activations() == iterations + 1
    assert schedule.activations_in_flight(remat=True) == iterations
    assert schedule.activations_in_flight(remat=False) == iterations * per_stage


def test_circular_bubble_is_smaller_by_the_repeats():
    gpipe = Schedule(stages=4, microbatches=8, repeats=1, layers=16)
    circular = Schedule(stages=4, microbatches=8, repeats=2, layers=16)
    assert gpipe.bubble_fraction == pytest.approx(3 / 11)
    assert circular.bubble_fraction == pytest.approx(3 / 19)


def test_microbatch_size():
    schedule = Schedule(stages=2, microbatches=4, repeats=1, layers=4)
    assert schedule.microbatch_size(16) == 4
    assert schedule.microbatch_size(4) == 1


def test_describe():
    assert Schedule(stages=2, microbatches=4, repeats=1, layers=4).describe() == (
        "gpipe pipeline: 2 stages x 2 layers, 4 microbatches, 1 repeat: 5 iterations, bubble 20.0%"
    )
    assert Schedule(stages=4, microbatches=8, repeats=2, layers=16).describe() == (
        "circular pipeline: 4 stages x 2 layers, 8 microbatches, 2 repeats: 19 iterations, "
        "bubble 15.8%"
    )


def test_layers_not_divisible_by_stages_and_repeats():
    with pytest.raises(
        PipelineError,
        match=r"the stack has 6 layers, which 4 stages x 1 repeat \(4 chunks of equal size\) "
        r"cannot split evenly: use stages dividing 6 \(1, 2, 3, 6\), or a stack of a "
        r"multiple of 4 layers\.",
    ):
        Schedule(stages=4, microbatches=4, repeats=1, layers=6)
    with pytest.raises(
        PipelineError,
        match=r"12 layers, which 4 stages x 2 repeats \(8 chunks of equal size\).*: use "
        r"stages dividing 12 / 2 = 6 \(1, 2, 3, 6\), or a stack of a multiple of 8 layers",
    ):
        Schedule(stages=4, microbatches=4, repeats=2, layers=12)
    # No number of stages helps when the repeats do not divide the layers.
    with pytest.raises(
        PipelineError,
        match=r"8 layers, which 2 stages x 3 repeats \(6 chunks of equal size\).*: use "
        r"repeats dividing 8 \(1, 2, 4, 8\), or a stack of a multiple of 6 layers",
    ):
        Schedule(stages=2, microbatches=4, repeats=3, layers=8)


def test_microbatches_not_divisible_by_stages():
    with pytest.raises(
        PipelineError,
        match=r"microbatches=6 is not a multiple of the 4 stages.*use microbatches=4 or "
        r"another multiple of 4",
    ):
        Schedule(stages=4, microbatches=6, repeats=1, layers=8)
    with pytest.raises(PipelineError, match=r"microbatches=1 .* use microbatches=2 "):
        Schedule(stages=2, microbatches=1, repeats=1, layers=8)


def test_batch_not_divisible_by_microbatches():
    schedule = Schedule(stages=2, microbatches=4, repeats=1, layers=4)
    with pytest.raises(
        PipelineError,
        match=r"a batch of 10 rows cannot be cut into 4 equal microbatches: use a batch that "
        r"is a multiple of 4, or a number of microbatches dividing 10 \(and a multiple of 2\)",
    ):
        schedule.microbatch_size(10)


def test_pipeline_error_is_an_escale_error():
    assert issubclass(PipelineError, EscaleError)


@pytest.mark.parametrize("field", ["stages", "microbatches", "repeats", "layers"])
def test_counts_must_be_positive(field):
    given = {"stages": 2, "microbatches": 2, "repeats": 1, "layers": 2, field: 0}
    with pytest.raises(EscaleError, match=field):
        Schedule(**given)
