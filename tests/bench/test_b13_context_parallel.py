"""``bench/b13_context_parallel.py --quick`` runs and prints every figure beside its bound.

The quick run compiles the Llama-7B attention layer's step at 2,048 tokens for ``sp=8`` on 8
simulated CPU devices, each strategy once; the full run (the TPU compiler, 32,768 tokens) is
the benchmarks page's.
"""

import re
import subprocess
import sys

import pytest
from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.xla]

# The collective that exchanges Q, K, V (or the output) under each strategy.
EXCHANGE = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}


@pytest.fixture(scope="module")
def printed() -> str:
    done = subprocess.run(
        [sys.executable, "bench/b13_context_parallel.py", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_strategy_prints_its_peak_memory_beside_the_bound(printed):
    for strategy in EXCHANGE:
        assert re.search(
            rf"^  {strategy} +peak memory +\S+ \S+ +\S+ \S+ +\d+\.\d\d ", printed, re.M
        )
    assert "fsdp=1 x sp=8, batch 1" in printed


def test_each_exchange_is_measured_beside_its_analytic_bytes(printed):
    blocks = re.split(r"^  (?=\w+ +peak memory)", printed, flags=re.M)[1:]
    assert [b.split()[0] for b in blocks] == list(EXCHANGE)
    for block, kind in zip(blocks, EXCHANGE.values(), strict=True):
        row = re.search(rf"^ +{kind} +(\S+ \S+) +(\S+ \S+) +(\d+\.\d\d)$", block, re.M)
        assert row, block
        assert row.group(2) != "0 B"  # the analytic count has the attention's bytes
        assert float(row.group(3)) > 0


def test_auto_names_the_strategy_it_took_and_why(printed):
    auto = re.search(r"^  auto: (\w+) \(its program above\); \1 \((.+?)\);", printed, re.M)
    assert auto
    assert auto.group(1) in EXCHANGE
    assert "S/c = 256 tokens a device" in auto.group(2)
