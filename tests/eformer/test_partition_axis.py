"""eformer's ``PartitionAxis`` (``flax_escale/eformer/_partition_axis.py``): its decode fields.

Expected values are what eformer 0.0.101 returns for the same call.
"""

import inspect

import jax
import pytest
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import eformer as escale


def test_partition_axis_takes_eformers_decode_names():
    paxis = escale.PartitionAxis(
        decode_batch_axis="dp",
        decode_query_sequence_axis=None,
        decode_head_axis="tp",
        decode_kv_head_axis="sp",
        decode_key_sequence_axis=None,
        decode_attention_dim_axis=None,
        decode_attention_kv_dim_axis=None,
        attention_kv_dim_axis=None,
    )
    assert paxis.generation_batch_axis == paxis.decode_batch_axis == "dp"
    assert paxis.generation_kv_head_axis == paxis.decode_kv_head_axis == "sp"
    assert paxis.attention_kv_dim_axis is None
    assert paxis == escale.PartitionAxis(
        generation_batch_axis="dp", generation_kv_head_axis="sp", generation_key_sequence_axis=None
    )
    rules = paxis.logical_axis_rules(generation=True)
    assert fe.logical_to_mesh_axes(("batch", "kv_head", "attention_kv_dim"), rules) == P(
        "dp", "sp", None
    )
    # eformer's default: decode follows the kv_head mapping.
    assert escale.PartitionAxis(kv_head_axis="sp").decode_kv_head_axis == "sp"


DECODE_NAMES = [
    "batch",
    "query_sequence",
    "head",
    "kv_head",
    "key_sequence",
    "attention_dim",
    "attention_kv_dim",
]


def decode_fields(paxis):
    return [getattr(paxis, f"decode_{name}_axis") for name in DECODE_NAMES]


EFORMER_NONE_DEFAULTS = ["query_sequence", "attention_dim", "attention_kv_dim"]


@pytest.mark.parametrize(
    ("keywords", "expected"),
    [
        ({}, [("fsdp", "dp"), None, "tp", "tp", "sp", None, None]),
        (
            {
                "head_axis": "sp",
                "key_sequence_axis": None,
                "kv_head_axis": "dp",
                "batch_axis": "dp",
            },
            ["dp", None, "sp", "dp", None, None, None],
        ),
        (
            {"tensor_parallel_axis": "model", "sequence_parallel_axis": "seq"},
            [("fsdp", "dp"), None, "model", "model", "seq", None, None],
        ),
        (
            {"decode_batch_axis": None, "decode_query_sequence_axis": "dp"},
            [None, "dp", "tp", "tp", "sp", None, None],
        ),
        (
            {"batch_axis": ("dp",), "decode_head_axis": ("tp", "sp")},
            [("dp",), None, ("tp", "sp"), "tp", "sp", None, None],
        ),
    ],
)
def test_partition_axis_decode_fields_are_eformers(keywords, expected):
    assert decode_fields(escale.PartitionAxis(**keywords)) == expected


@pytest.mark.parametrize("name", EFORMER_NONE_DEFAULTS)
def test_decode_fields_eformer_defaults_to_none_do_not_follow_their_training_field(name):
    # eformer 0.0.101 declares these three decode fields with the default None (the others
    # default to "derived"); giving the training field does not move them.
    training = {"query_sequence": "tp", "attention_dim": "tp", "attention_kv_dim": "sp"}[name]
    paxis = escale.PartitionAxis(**{f"{name}_axis": training})
    assert getattr(paxis, f"{name}_axis") == training
    assert getattr(paxis, f"decode_{name}_axis") is None
    assert paxis.logical_axes(generation=True)[name] is None
    assert escale.PartitionManager(paxis).resolve([name], mode="decode") == P(None)
    assert escale.PartitionManager(paxis).resolve([name], mode="train") == P(training)
    # The signature says so too, where the derived ones show the placeholder `...`.
    parameters = inspect.signature(escale.PartitionAxis).parameters
    assert parameters[f"decode_{name}_axis"].default is None
    assert parameters["decode_head_axis"].default is ...
    assert inspect.signature(fe.PartitionAxis).parameters[f"decode_{name}_axis"].default is None


def test_partition_axis_takes_every_decode_keyword():
    paxis = escale.PartitionAxis(
        decode_batch_axis="dp",
        decode_query_sequence_axis="sp",
        decode_head_axis=("tp", "sp"),
        decode_kv_head_axis=None,
        decode_key_sequence_axis="fsdp",
        decode_attention_dim_axis="ep",
        decode_attention_kv_dim_axis="ep",
    )
    assert decode_fields(paxis) == ["dp", "sp", ("tp", "sp"), None, "fsdp", "ep", "ep"]
    assert paxis.generation_head_axis == ("tp", "sp")  # the library's name for the same field
    parameters = inspect.signature(escale.PartitionAxis).parameters
    assert all(f"decode_{name}_axis" in parameters for name in DECODE_NAMES)
    assert "decode_batch_axis" in inspect.signature(fe.PartitionAxis).parameters


def test_eformer_partition_axis_is_usable_wherever_the_librarys_is():
    paxis = escale.PartitionAxis()
    assert isinstance(paxis, fe.PartitionAxis)
    # The library's own keeps its seed default: the batch unsharded while decoding.
    assert fe.PartitionAxis().decode_batch_axis is None
    rules = paxis.logical_axis_rules(generation=True)
    assert fe.logical_to_mesh_axes(("batch", "query_sequence", "head"), rules) == P(
        ("fsdp", "dp"), None, "tp"
    )
    assert escale.PartitionManager(paxis).resolve(["batch", "sequence"], mode="decode") == P(
        ("fsdp", "dp"), "sp"
    )
    # Copies stay eformer's; a static argument of jit, as the library's.
    assert type(paxis.replace(tensor_parallel_axis="model")) is escale.PartitionAxis
    assert paxis.replace(tensor_parallel_axis="model").decode_head_axis == "model"
    assert type(paxis.with_aliases("t5x")) is escale.PartitionAxis
    assert jax.jit(lambda x, p: x + len(p.decode_batch_axis), static_argnums=1)(1, paxis) == 3
    assert paxis == escale.PartitionAxis()
    assert hash(paxis) == hash(escale.PartitionAxis())


def test_partition_axis_decode_errors():
    with pytest.raises(ValueError, match=r"decode_batch_axis and generation_batch_axis name the"):
        escale.PartitionAxis(decode_batch_axis="dp", generation_batch_axis="dp")
    with pytest.raises(ValueError, match=r"generation_head_axis must be a mesh axis name"):
        escale.PartitionAxis(decode_head_axis=3)
    with pytest.raises(ValueError, match=r"PartitionAxis has no field 'decode_heads_axis'"):
        escale.PartitionAxis().replace(decode_heads_axis="tp")


def test_suggested_methods_follow_the_mesh_and_the_partition_axis():
    no_sp = escale.MeshPartitionHelper(escale.create_mesh((2, 4), ("dp", "fsdp")))
    assert no_sp._suggest_methods((64, 64)) == [("dp",), ("fsdp",)]
    paxis = fe.PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    renamed = escale.MeshPartitionHelper(escale.create_mesh((2, 4), ("data", "model")), paxis)
    assert renamed._suggest_methods((64, 64)) == [("data",), ("model",)]
    # The library's own placement, one tuple per dimension, stays under its own name.
    assert renamed.suggest_methods((64, 64)) == [("data",), ("model",)]
