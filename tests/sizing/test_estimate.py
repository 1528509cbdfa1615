"""The step-time estimate's words: tokens per device and why a mesh is bound as it is."""

import jax
import pytest
from support.tiny_workloads import Tiny, X

import flax_escale as fe
from flax_escale import sizing
from flax_escale.sizing._estimate import explain, textbook_communication, token_count

H100 = sizing.PROFILES["h100"]


@pytest.mark.parametrize(
    ("dims", "per_device"),
    [((0, 1), 64 * 1024 // 8), ((0,), 64 // 8)],
    ids=["token ids: batch x sequence", "rows of features: batch"],
)
def test_tokens_are_counted_along_the_token_dimensions_over_their_mesh_axes(dims, per_device):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    spec = fe.batch_sharding(mesh, (64, 1024)).spec
    assert token_count((64, 1024), dims, spec, mesh) == per_device


def test_a_dimension_split_over_sp_divides_the_tokens_only_when_it_counts_them():
    mesh = fe.create_mesh((1, 4, 1, 1, 2))
    spec = fe.batch_sharding(mesh, (64, 1024)).spec  # P(("fsdp", "dp"), "sp")
    assert token_count((64, 1024), (0, 1), spec, mesh) == 16 * 512
    assert token_count((64, 1024), (0,), spec, mesh) == 16  # features split over sp: not tokens


def test_the_tokens_note_says_which_side_of_the_threshold_and_what_the_threshold_is():
    below = explain(1e-3, 2e-3, {"all-gather": (4, 0, 3e6)}, 132, H100)
    assert below == (
        "communication-bound (67% of the estimate); all-gather sends 100% of the bytes; "
        "132 tokens/device, under the 2,198 from which data/FSDP parallelism is compute-bound on "
        "NVIDIA H100 SXM: 989 TFLOP/s / 450 GB/s"
    )
    above = explain(2e-3, 1e-3, {}, 8192, H100)
    assert above == (
        "compute-bound (67% of the estimate); 8,192 tokens/device, over the 2,198 from which "
        "data/FSDP parallelism is compute-bound on NVIDIA H100 SXM: 989 TFLOP/s / 450 GB/s"
    )


def test_the_textbook_communication_is_said_in_the_librarys_byte_units():
    # The tiny model's kernel (16 x 32 float32, 2 KiB) is split over fsdp=2: each device
    # gathers the other's 1 KiB, and nothing repeated over the batch's axes is reduced.
    mesh = fe.create_mesh((1, 2, 1, 1, 1), devices=jax.devices("cpu")[:2])
    plan = fe.plan_sharding(Tiny(), mesh, jax.random.key(0), X)
    assert [e.nbytes_per_device(mesh) for e in plan] == [1024]
    _, detail = textbook_communication(plan, mesh, ("fsdp",), H100)
    assert detail == "parameters gathered once 1.00 KiB + gradients reduce-scattered 0 B per device"
