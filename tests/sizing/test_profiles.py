"""Hardware profiles: the built-in ones, custom ones checked, and one measured on this machine."""

import jax
import numpy as np
import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import sizing
from flax_escale.sizing import PROFILES, HardwareProfile, hardware_profile, measure_cpu_profile


def test_hardware_profiles_check_their_numbers():
    assert hardware_profile("h100") is PROFILES["h100"]
    custom = HardwareProfile("mine", 1e12, 1e9, 1e-6, 2**30)
    assert hardware_profile(custom) is custom
    with pytest.raises(fe.EscaleError, match="flops_per_second must be a finite number above 0"):
        HardwareProfile("zero", 0, 1e9)
    with pytest.raises(fe.EscaleTypeError, match="interconnect_bytes_per_second must be a number"):
        HardwareProfile("bool", 1e12, True)
    with pytest.raises(
        fe.EscaleError, match="collective_latency_seconds must be a finite number of at least 0"
    ):
        HardwareProfile("negative", 1e12, 1e9, -1.0)
    # A NaN or an infinity would rank every mesh by NaN, and recommend one.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(fe.EscaleError, match=r"'nan-or-inf': flops_per_second must be a fin"):
            HardwareProfile("nan-or-inf", bad, 1e9)
        with pytest.raises(fe.EscaleError, match="memory_bytes_per_second must be a finite"):
            HardwareProfile("nan-or-inf", 1e12, 1e9, memory_bytes_per_second=bad)
        with pytest.raises(fe.EscaleError, match="collective_latency_seconds must be a finite"):
            HardwareProfile("nan-or-inf", 1e12, 1e9, bad)
    with pytest.raises(fe.EscaleError, match="memory_bytes must be a positive int"):
        HardwareProfile("memoryless", 1e12, 1e9, 0.0, 0)


def test_a_measured_cpu_profile_has_positive_finite_numbers():
    mesh = fe.create_mesh((1, 2, 1, 1, 1), devices=jax.devices()[:2])
    profile = measure_cpu_profile(mesh, rounds=2)
    assert profile.name == "measured: cpu x 2"
    for value in (
        profile.flops_per_second,
        profile.interconnect_bytes_per_second,
        profile.collective_latency_seconds,
    ):
        assert np.isfinite(value)
        assert value > 0
    with pytest.raises(fe.EscaleError, match="rounds must be a positive int"):
        measure_cpu_profile(mesh, rounds=0)


CASES = [
    case(
        lambda: sizing.HardwareProfile(3, 1e12, 1e9),
        T,
        "HardwareProfile name",
        "int 3",
        r"must be a string such as 'my accelerator'",
        id="HardwareProfile-name-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
