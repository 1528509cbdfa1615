import importlib.util
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

import flax_escale as fe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_linen_gpt_prints_its_plan_and_its_loss_falls(capsys, tie):
    example = load("linen_gpt")
    if tie:
        with pytest.warns(fe.ShardingCorrectionWarning, match="'head/kernel' matched no param"):
            losses = example.main(["--steps", "10", "--tie-embeddings"])
    else:
        losses = example.main(["--steps", "10"])
    out = capsys.readouterr().out
    assert "params/blocks/mlp/wi/kernel" in out
    assert str(P(None, ("fsdp", "sp"), "tp")) in out
    assert ("params/head/kernel" in out) is not tie
    assert "0 corrections, 0 unannotated" in out
    assert len(losses) == 10
    assert losses[-1] < 0.8 * losses[0]


def test_nnx_llama_prints_its_plan_and_its_loss_falls(capsys):
    example = load("nnx_llama")
    losses = example.main(["--steps", "10", "--zero1"])
    out = capsys.readouterr().out
    assert "blocks/attention/k_proj/kernel" in out
    assert "('layers', 'hidden_state', 'kv_head', 'attention_dim')" in out
    assert str(P(None, ("fsdp", "sp"), "tp", None)) in out
    assert "0 corrections, 0 unannotated" in out
    assert len(losses) == 10
    assert losses[-1] < 0.8 * losses[0]
