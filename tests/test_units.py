"""Byte counts as people read and write them: ``parse_bytes`` (public in ``flax_escale.sizing``)."""

import pytest

import flax_escale as fe
from flax_escale.sizing import parse_bytes

MiB = 2**20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 17179869184),
        ("80GB", 80 * 10**9),
        ("1.5T", 1_500_000_000_000),
        ("512 MiB", 512 * MiB),
        ("4k", 4000),
        ("100", 100),
        (1024, 1024),
    ],
)
def test_parse_bytes_reads_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("abc", fe.EscaleError, "memory: 'abc' is not a size"),
        ("-1GB", fe.EscaleError, "is not a size"),
        ("0GB", fe.EscaleError, "the size must be positive"),
        (0, fe.EscaleError, "must be a positive int, got 0"),
        (True, fe.EscaleTypeError, "must be a positive int"),
        (1.5, fe.EscaleTypeError, "must be a positive int"),
    ],
)
def test_parse_bytes_refuses_what_is_not_a_size(value, error, match):
    with pytest.raises(error, match=match):
        parse_bytes(value)
