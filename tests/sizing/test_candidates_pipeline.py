"""The pipeline part of the planner's search space (``flax_escale/sizing/_candidates.py``):
which schedules a mesh of ``pp`` stages gets, in which order, and the meshes with ``pp``; with
the estimate's links between hosts (``_estimate.slow_collectives``)."""

import pytest

import flax_escale as fe
from flax_escale.sizing import mesh_shapes
from flax_escale.sizing._candidates import REMAT_LADDER, checked_axes, pipeline_settings
from flax_escale.sizing._estimate import estimate_seconds, slow_collectives
from flax_escale.sizing._profiles import HardwareProfile


def test_schedules_are_bounded_and_fastest_by_the_formulas_first():
    settings = pipeline_settings(stages=2, layers=8, batch=32, stage_data=1)
    # Microbatches 2, 4 and 8; repeats 1 and 2; every remat policy: 3 x 2 x 4.
    assert len(settings) == 24
    assert {(s.microbatches, s.repeats) for s in settings} == {
        (m, v) for m in (2, 4, 8) for v in (1, 2)
    }
    assert {s.remat for s in settings} == set(REMAT_LADDER)
    factors = [s.factor for s in settings]
    assert factors == sorted(factors)
    first = settings[0]
    # 8 microbatches, 2 repeats: 17 iterations for 16 microbatch passes, no recomputation.
    assert (first.microbatches, first.repeats, first.remat) == (8, 2, "none")
    assert first.iterations == 17
    assert first.bubble == pytest.approx(1 / 17)
    assert first.factor == pytest.approx(17 / 16)
    # On one microbatch setting, remat policies come least recomputation first.
    same = [s.remat for s in settings if (s.microbatches, s.repeats) == (8, 2)]
    assert same == list(REMAT_LADDER)


@pytest.mark.parametrize(
    ("stages", "layers", "batch", "stage_data", "expected"),
    [
        (2, 3, 16, 1, set()),  # 2 stages cannot split 3 layers
        (2, 2, 16, 1, {(2, 1), (4, 1), (8, 1)}),  # 2 repeats would need 4 layers
        (2, 4, 16, 4, {(2, 1), (2, 2), (4, 1), (4, 2)}),  # 8 microbatches of 2 rows: not over 4
        (4, 4, 8, 1, {(4, 1), (8, 1)}),  # 16 microbatches do not divide 8 rows
        (4, 4, 8, 4, set()),  # 4 microbatches of 2 rows: not over 4 devices
    ],
)
def test_schedules_fit_the_layers_batch_and_stage_data(stages, layers, batch, stage_data, expected):
    found = pipeline_settings(stages, layers, batch, stage_data)
    assert {(s.microbatches, s.repeats) for s in found} == expected
    for s in found:
        assert s.microbatches % stages == 0
        assert layers % (stages * s.repeats) == 0


def test_meshes_with_pp_put_it_first_and_those_without_are_unchanged():
    shapes = mesh_shapes(4, ("pp", "fsdp"))
    assert [tuple(s.items()) for s in shapes] == [
        (("pp", 4), ("dp", 1), ("fsdp", 1), ("ep", 1), ("tp", 1), ("sp", 1)),
        (("pp", 2), ("dp", 1), ("fsdp", 2), ("ep", 1), ("tp", 1), ("sp", 1)),
        (("dp", 1), ("fsdp", 4), ("ep", 1), ("tp", 1), ("sp", 1)),
    ]
    assert checked_axes(("pp", "fsdp")) == ("pp", "fsdp")
    with pytest.raises(fe.EscaleError, match=r"distinct axes .* or 'pp'.*\['stage'\] are not"):
        checked_axes(("stage", "fsdp"))


PIPELINE = {"pp": 2, "dp": 1, "fsdp": 4, "ep": 1, "tp": 1, "sp": 1}
FSDP = {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
EVERY = {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
}


@pytest.mark.parametrize(
    ("shape", "per_host", "expected"),
    [
        (PIPELINE, 4, {"pipeline"}),  # pp spans the 2 hosts, fsdp=4 inside each
        (FSDP, 4, EVERY),  # fsdp=8 spans both hosts
        (PIPELINE, 2, EVERY | {"pipeline"}),  # fsdp=4 spans hosts of 2 as well
        (PIPELINE, 8, set()),  # one host holds them all
        (FSDP, None, set()),  # a profile without hosts
    ],
)
def test_slow_collectives_are_those_of_the_axes_spanning_hosts(shape, per_host, expected):
    assert set(slow_collectives(shape, per_host)) == expected


def test_collectives_across_hosts_move_at_the_between_host_bandwidth():
    profile = HardwareProfile(
        "two hosts", 1e12, 100e9, 0.0, devices_per_host=4, host_bytes_per_second=1e9
    )
    # 1 GB of permutes, a quarter of them the pipeline's own (the rest the compiler's rings).
    collectives = {"all-gather": (1, 0, 1e9), "collective-permute": (1, 0, 1e9)}
    _, fast = estimate_seconds(0.0, 0, collectives, profile)
    assert fast == pytest.approx(0.02)
    _, pipeline = estimate_seconds(0.0, 0, collectives, profile, ("pipeline",), 0.25e9)
    assert pipeline == pytest.approx(0.01 + 0.0075 + 0.25)
    _, everything = estimate_seconds(0.0, 0, collectives, profile, ("all-gather",))
    assert everything == pytest.approx(1.0 + 0.01)


def test_a_profile_refuses_a_host_size_or_bandwidth_below_one():
    with pytest.raises(fe.EscaleError, match="devices_per_host"):
        HardwareProfile("x", 1e12, 1e9, devices_per_host=0)
    with pytest.raises(fe.EscaleError, match="host_bytes_per_second"):
        HardwareProfile("x", 1e12, 1e9, host_bytes_per_second=0.0)
