"""t5x's data layout (``flax_escale/t5x/_data.py``): ``DataLayout`` and ``get_data_layout``."""

import pytest
from support.mistakes import (
    MISTAKE,
    T,
    case,
    partitioner,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import t5x

CASES = [
    case(
        lambda: t5x.DataLayout(0, 0, 1, True),
        fe.EscaleError,
        "batch_size",
        "0",
        "positive int",
        id="t5x-DataLayout-batch-zero",
    ),
    case(
        lambda: t5x.DataLayout(8, 2, 2, True),
        fe.EscaleError,
        "shard_id",
        "2",
        "from 0 to 1",
        id="t5x-DataLayout-shard-out-of-range",
    ),
    case(
        lambda: t5x.DataLayout(8, 0, 1, "yes"),
        T,
        "is_first_host_in_replica_set",
        "'yes'",
        "True or False",
        id="t5x-DataLayout-flag-string",
    ),
    case(
        lambda: partitioner().get_data_layout(0),
        fe.EscaleError,
        "batch_size",
        "0",
        "positive int",
        id="t5x-get_data_layout-zero",
    ),
    case(
        lambda: partitioner().get_data_layout("32"),
        T,
        "batch_size",
        "'32'",
        "pass the int 32",
        id="t5x-get_data_layout-string",
    ),
    case(
        lambda: partitioner().get_data_layout(32, host_index="0"),
        T,
        "host_index",
        "'0'",
        "pass the int 0",
        id="t5x-get_data_layout-host-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
