"""B9b: which layout of the activations between blocks moves the fewest bytes under ``tp``.

Run: ``python bench/b09b_activation_conventions.py`` (``--models``, ``--layouts``, ``--target`` as
``bench/b09_step_bounds.py`` takes them; GPT-2's vocabulary padded to 50,304). The examples
constrain the activations between blocks to ``("batch", "sequence", "hidden_state")``: the
hidden dimension over ``tp``, eformer's convention and the library's default. Each step of
B9 is compiled again with that one constraint replaced by Megatron's two conventions, and the
bytes one device sends per step are printed side by side, raw and in textbook forms:

- ``hidden``: the default;
- ``sequence``: the sequence over ``sp`` and ``tp`` between blocks, the hidden dimension
  whole (Megatron's sequence parallelism);
- ``whole``: the sequence over ``sp`` only, the hidden dimension whole (Megatron without it).

Every other constraint of the examples (attention's heads, the MLP's width) stays as written.
"""

from __future__ import annotations

import argparse
import contextlib
import types
from collections.abc import Iterator

from _support import format_bytes
from b06_plan_64 import linen_gpt, nnx_llama
from b09_step_bounds import LAYOUTS, measure

import flax_escale as fe
from flax_escale.mesh import Target

BETWEEN_BLOCKS = ("batch", "sequence", "hidden_state")
CONVENTIONS = {
    "hidden": None,
    "sequence": (("batch", "sequence", None), fe.PartitionAxis(sequence_axis=("sp", "tp"))),
    "whole": (("batch", "sequence", None), None),
}


@contextlib.contextmanager
def between_blocks(convention: str) -> Iterator[None]:
    """The examples' constraint between blocks replaced by ``convention``'s, while open."""
    replacement = CONVENTIONS[convention]
    if replacement is None:
        yield
        return
    names, rules = replacement

    def constrain(x, logical_axes, **options):
        if tuple(logical_axes) == BETWEEN_BLOCKS:
            return fe.constrain(x, names, rules=rules, **options)
        return fe.constrain(x, logical_axes, **options)

    # The examples reach the library as ``fe``: a namespace like it, with constrain replaced.
    shim = types.SimpleNamespace(**{n: getattr(fe, n) for n in dir(fe) if not n.startswith("_")})
    shim.constrain = constrain
    modules = (linen_gpt, nnx_llama)
    try:
        for module in modules:
            module.fe = shim
        yield
    finally:
        for module in modules:
            module.fe = fe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama7b"])
    parser.add_argument("--target", default="v5p-16")
    parser.add_argument("--layouts", nargs="+", default=["tp=8", "fsdp=4 tp=2"], choices=LAYOUTS)
    args = parser.parse_args()
    target = Target.named(args.target, devices=8)
    print(f"{target.label}; 16 sequences of 1,024 tokens; raw / in textbook forms", flush=True)
    for model in args.models:
        for layout in args.layouts:
            cells = []
            for convention in CONVENTIONS:
                with between_blocks(convention):
                    (row,) = measure(model, target, 16, 1024, [layout], 50_304)
                cells.append(
                    f"{convention} {format_bytes(int(row['sent']))} / "
                    f"{format_bytes(int(row['textbook']))}"
                )
            print(f"{model:8} {layout:12} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
