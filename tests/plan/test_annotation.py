"""Every annotation style Flax documents gets the spec Flax's own tools give it (issue 15).

Each case builds a small model annotated in one of Flax's styles, plans and initializes it
with the library, and compares every array's spec with what Flax itself answers for the same
variables under the same rules:

- Linen boxes (``nn.with_logical_partitioning``, ``nn.with_partitioning``): the specs of
  ``nn.get_partition_spec`` made mesh shardings by ``nn.logical_to_mesh_sharding`` (logical
  names, with the box's own rules when it carries some) or taken as they are (mesh axes).
- t5x's ``flax.linen.partitioning.param_with_axes``: ``partitioning.get_axis_names`` of the
  ``params_axes`` collection, through ``nn.logical_to_mesh_sharding``.
- NNX metadata (``nnx.with_partitioning``, ``out_sharding``, the deprecated ``sharding_names``,
  ``nnx.with_metadata`` with the variable's own ``sharding_rules``): ``nnx.get_partition_spec``
  and ``nnx.get_named_sharding`` of the abstract state, under ``nn.logical_axis_rules``.

Flax accepts fewer names than dimensions where its layers call the initializer on a flattened
shape (``DenseGeneral`` / ``LinearGeneral`` kernels, attention's projections): its spec then
names the leading dimensions and leaves the rest unsharded. Specs are compared padded to the
array's rank (entry by entry, and as ``NamedSharding`` equivalence on the array's rank); the
arrays ``init_sharded`` creates must carry that sharding and, for both front ends, hold the
values ``jax.jit`` of the plain initializer gives, bit for bit.

Shapes are chosen so that every mesh axis the rules name divides its dimension: the library's
shape awareness then changes nothing and its answer is Flax's. Where Flax's answer differs by
design (NNX's ``dict(rules)`` lookup, DESIGN decision 1), the case says so and checks the
library's documented answer, written out literally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import partitioning
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import plan as fep

# Flax-example mesh axis names; every axis has two devices, so every rule shards something.
FLAX_AXES = ("data", "fsdp", "tensor")
RULES = (
    ("batch", "data"),
    ("embed", ("fsdp", "data")),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("vocab", "tensor"),
)
ZEROS = nn.initializers.zeros_init()
# Flax's default kernel initializer, for the attention cases: random values drawn on the
# flattened shape, then reshaped, as Flax's layers do.
RANDOM_INIT = nn.initializers.lecun_normal()


def ramp(key, shape, dtype=jnp.float32):
    """An initializer giving each element its own value, with no random bits to compile.

    Generating random bits is most of what compiling a small model's initializer costs on CPU;
    distinct values still show any misplaced element of a sharded array.
    """
    del key
    return jnp.arange(math.prod(shape), dtype=dtype).reshape(shape)


INIT = EMBED_INIT = ramp
X = jnp.ones((2, 8, 64))
TOKENS = jnp.zeros((2, 8), jnp.int32)


def flax_mesh():
    return fe.create_mesh((2, 2, 2), FLAX_AXES)


def escale_mesh():
    return fe.create_mesh((1, 4, 1, 2, 1))  # dp, fsdp=4, ep, tp=2, sp


@dataclasses.dataclass(frozen=True)
class Case:
    """One annotation style: the model, its rules and mesh, and the specs written out by hand.

    ``expected`` holds the spec of some arrays, literally: the rules' answer worked out by hand
    (for the short annotations, Flax's short spec itself), so that the library and Flax cannot
    drift away together.
    """

    id: str
    build: Callable[[], Any]  # Linen: (module, inputs); NNX: the constructor taking rngs=
    rules: Any = RULES
    mesh: Callable[[], Any] = flax_mesh
    expected: dict[str, P] = dataclasses.field(default_factory=dict)
    # The specs Flax's NNX lookup gives instead of the library's (DESIGN decision 1).
    nnx_lookup_differs: dict[str, P] | None = None
    # Whether NamedSharding refuses the specs NNX's lookup gives (a mesh axis used twice).
    nnx_lookup_refused: bool = False
    warns: tuple[type[Warning], str] | None = None


def logical(names, init=INIT, rules=None):
    return nn.with_logical_partitioning(init, names, rules=rules)


# Linen models -------------------------------------------------------------------------------


def linen_with_logical_partitioning():
    # The box's own rules (``rules=``) replace the rules in context for that box, as in Flax
    # (its unbox constrains with them); the other boxes use the rules in context.
    own = (("rows", "tensor"), ("cols", ("fsdp", "data")))

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(
                128,
                kernel_init=logical(("embed", "mlp")),
                bias_init=logical(("mlp",), ZEROS),
                name="wi",
            )(x)
            h = nn.Dense(64, kernel_init=logical(("mlp", "embed")), name="wo")(nn.relu(h))
            kernel = logical(("rows", "cols"), rules=own)
            return nn.Dense(64, kernel_init=kernel, use_bias=False, name="own")(h)

    return Mlp(), (X,)


def linen_with_partitioning():
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel = nn.with_partitioning(INIT, (("fsdp", "data"), "tensor"))
            h = nn.Dense(128, kernel_init=kernel, name="wi")(x)
            kernel = nn.with_partitioning(INIT, ("tensor", None))
            return nn.Dense(64, kernel_init=kernel, use_bias=False, name="wo")(h)

    return Mlp(), (X,)


def linen_param_with_axes():
    class T5Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            wi = partitioning.param_with_axes(
                "wi", INIT, (64, 128), jnp.float32, axes=("embed", "mlp")
            )
            scale = partitioning.param_with_axes("scale", ZEROS, (128,), axes=("mlp",))
            wo = partitioning.param_with_axes(
                "wo", INIT, (128, 64), jnp.float32, axes=("mlp", "embed")
            )
            return (nn.relu(x @ wi) + scale) @ wo

    return T5Mlp(), (X,)


def linen_dense_general_short():
    # Two names on each three-dimensional kernel: Flax calls the initializer on the flattened
    # two-dimensional shape and reshapes the boxed value, keeping the two names.
    class Heads(nn.Module):
        @nn.compact
        def __call__(self, x):
            q = nn.DenseGeneral((4, 16), kernel_init=logical(("embed", "kv")), name="q")(x)
            k = nn.DenseGeneral(
                (4, 16),
                kernel_init=nn.with_partitioning(INIT, (("fsdp", "data"), "tensor")),
                name="k",
            )(x)
            return nn.DenseGeneral(
                64, axis=(-2, -1), kernel_init=logical(("kv", "embed")), name="out"
            )(q + k)

    return Heads(), (X,)


def linen_attention_short():
    attention = nn.MultiHeadDotProductAttention(
        num_heads=4,
        qkv_features=64,
        kernel_init=logical(("embed", "kv"), RANDOM_INIT),
        out_kernel_init=logical(("heads", "embed"), RANDOM_INIT),
    )
    return attention, (X,)


def linen_embed():
    class Lm(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            table = nn.Embed(128, 64, embedding_init=logical(("vocab", "embed"), EMBED_INIT))
            h = table(tokens)
            return nn.Dense(64, kernel_init=logical(("embed", "mlp")), use_bias=False)(h)

    return Lm(), (TOKENS,)


def linen_partition_axis():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Embed(128, 64, embedding_init=logical(("vocab", "hidden_state"), EMBED_INIT))(
                tokens
            )
            q = nn.DenseGeneral(
                (4, 16), kernel_init=logical(("hidden_state", "head")), use_bias=False, name="q"
            )(h)
            h = h + q.reshape(h.shape)
            h = nn.Dense(256, kernel_init=logical(("hidden_state", "mlp_intermediate")), name="wi")(
                h
            )
            return nn.Dense(
                64, kernel_init=logical(("mlp_intermediate", "hidden_state")), name="wo"
            )(h)

    return Block(), (TOKENS,)


LINEN = [
    Case(
        "linen-with_logical_partitioning",
        linen_with_logical_partitioning,
        expected={
            "params/wi/kernel": P(("fsdp", "data"), "tensor"),
            "params/wi/bias": P("tensor"),
            "params/wo/kernel": P("tensor", ("fsdp", "data")),
            "params/own/kernel": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "linen-with_partitioning",
        linen_with_partitioning,
        expected={
            "params/wi/kernel": P(("fsdp", "data"), "tensor"),
            "params/wo/kernel": P("tensor", None),
        },
    ),
    Case(
        "linen-param_with_axes",
        linen_param_with_axes,
        expected={
            "params/wi": P(("fsdp", "data"), "tensor"),
            "params/scale": P("tensor"),
            "params/wo": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "linen-DenseGeneral-short",
        linen_dense_general_short,
        expected={
            "params/q/kernel": P(("fsdp", "data"), "tensor"),  # (64, 4, 16)
            "params/k/kernel": P(("fsdp", "data"), "tensor"),
            "params/out/kernel": P("tensor", ("fsdp", "data")),  # (4, 16, 64)
        },
    ),
    Case(
        "linen-MultiHeadDotProductAttention-short",
        linen_attention_short,
        expected={
            # (embed, heads, head_dim): embed, then heads, split; head_dim whole.
            **{
                f"params/{n}/kernel": P(("fsdp", "data"), "tensor")
                for n in ("query", "key", "value")
            },
            # (heads, head_dim, embed) named ("heads", "embed"): in Flax's meaning the second
            # name falls on head_dim and embed stays whole.
            "params/out/kernel": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "linen-Embed",
        linen_embed,
        expected={"params/Embed_0/embedding": P("tensor", ("fsdp", "data"))},
    ),
    Case(
        "linen-PartitionAxis",
        linen_partition_axis,
        rules=fe.PartitionAxis(),
        mesh=escale_mesh,
        expected={
            "params/Embed_0/embedding": P("tp", ("fsdp", "sp")),
            "params/q/kernel": P(("fsdp", "sp"), "tp"),
            "params/wi/kernel": P(("fsdp", "sp"), "tp"),
            "params/wo/kernel": P("tp", ("fsdp", "sp")),
        },
    ),
]


# NNX models ---------------------------------------------------------------------------------


class NnxMlp(nnx.Module):
    def __init__(self, wi_init, wo_init, *, rngs, bias_init=ZEROS):
        self.wi = nnx.Linear(64, 128, kernel_init=wi_init, bias_init=bias_init, rngs=rngs)
        self.wo = nnx.Linear(128, 64, kernel_init=wo_init, use_bias=False, rngs=rngs)


def nnx_with_partitioning(rngs):
    return NnxMlp(
        nnx.with_partitioning(INIT, ("embed", "mlp")),
        nnx.with_partitioning(INIT, ("mlp", "embed")),
        bias_init=nnx.with_partitioning(ZEROS, ("mlp",)),
        rngs=rngs,
    )


def nnx_with_partitioning_mesh_axes(rngs):
    # Names no rule mentions but that are mesh axes stand for themselves, in Flax and here.
    return NnxMlp(
        nnx.with_partitioning(INIT, (("fsdp", "data"), "tensor")),
        nnx.with_partitioning(INIT, ("tensor", None)),
        rngs=rngs,
    )


class OutSharding(nnx.Module):
    def __init__(self, *, rngs, key="out_sharding"):
        self.wi = nnx.Linear(
            64,
            128,
            kernel_init=INIT,
            kernel_metadata={key: ("embed", "mlp")},
            use_bias=False,
            rngs=rngs,
        )
        self.w = nnx.Param(INIT(rngs.params(), (128, 64)), **{key: ("mlp", "embed")})


def nnx_out_sharding(rngs):
    return OutSharding(rngs=rngs)


def nnx_sharding_names(rngs):
    return OutSharding(rngs=rngs, key="sharding_names")


def nnx_with_metadata(rngs):
    # The variable's own sharding_rules join the rules in context (no conflict between them).
    own = (("rows", ("fsdp", "data")), ("cols", "tensor"))
    return NnxMlp(
        nnx.with_metadata(INIT, out_sharding=("rows", "cols"), sharding_rules=own),
        nnx.with_metadata(INIT, out_sharding=("mlp", "embed")),
        rngs=rngs,
    )


def nnx_linear_general_short(rngs):
    class Heads(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.LinearGeneral(
                64, (4, 16), kernel_init=nnx.with_partitioning(INIT, ("embed", "kv")), rngs=rngs
            )
            self.out = nnx.LinearGeneral(
                (4, 16),
                64,
                axis=(-2, -1),
                kernel_init=nnx.with_partitioning(INIT, ("kv", "embed")),
                rngs=rngs,
            )

    return Heads(rngs)


def nnx_attention_short(rngs):
    return nnx.MultiHeadAttention(
        num_heads=4,
        in_features=64,
        qkv_features=64,
        kernel_init=nnx.with_partitioning(RANDOM_INIT, ("embed", "kv")),
        out_kernel_init=nnx.with_partitioning(RANDOM_INIT, ("heads", "embed")),
        decode=False,
        rngs=rngs,
    )


def nnx_embed(rngs):
    class Lm(nnx.Module):
        def __init__(self, rngs):
            self.table = nnx.Embed(
                128,
                64,
                embedding_init=nnx.with_partitioning(EMBED_INIT, ("vocab", "embed")),
                rngs=rngs,
            )

    return Lm(rngs)


def nnx_partition_axis(rngs):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.table = nnx.Embed(
                128,
                64,
                embedding_init=nnx.with_partitioning(EMBED_INIT, ("vocab", "hidden_state")),
                rngs=rngs,
            )
            self.q = nnx.LinearGeneral(
                64,
                (4, 16),
                kernel_init=nnx.with_partitioning(INIT, ("hidden_state", "head")),
                use_bias=False,
                rngs=rngs,
            )
            self.mlp = NnxMlp(
                nnx.with_partitioning(INIT, ("hidden_state", "mlp_intermediate")),
                nnx.with_partitioning(INIT, ("mlp_intermediate", "hidden_state")),
                rngs=rngs,
            )

    return Block(rngs)


# embed has two rules. Linen's priority semantics (and the library, in both front ends) take
# the first that applies: embed -> fsdp. NNX's own lookup is dict(rules): the last rule wins,
# embed -> data. The library's answer is Linen's, as nn.logical_to_mesh_sharding gives it.
TWO_RULES_FOR_EMBED = (("embed", "fsdp"), ("mlp", "tensor"), ("embed", "data"))


def nnx_two_rules_for_a_name(rngs):
    return NnxMlp(
        nnx.with_partitioning(INIT, ("embed", "mlp")),
        nnx.with_partitioning(INIT, ("mlp", "embed")),
        rngs=rngs,
    )


NNX = [
    Case(
        "nnx-with_partitioning",
        nnx_with_partitioning,
        expected={
            "wi/kernel": P(("fsdp", "data"), "tensor"),
            "wi/bias": P("tensor"),
            "wo/kernel": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "nnx-with_partitioning-mesh_axes",
        nnx_with_partitioning_mesh_axes,
        expected={"wi/kernel": P(("fsdp", "data"), "tensor"), "wo/kernel": P("tensor", None)},
    ),
    Case(
        "nnx-out_sharding",
        nnx_out_sharding,
        expected={"wi/kernel": P(("fsdp", "data"), "tensor"), "w": P("tensor", ("fsdp", "data"))},
    ),
    Case(
        "nnx-sharding_names",
        nnx_sharding_names,
        expected={"wi/kernel": P(("fsdp", "data"), "tensor"), "w": P("tensor", ("fsdp", "data"))},
        warns=(DeprecationWarning, "'sharding_names' is deprecated"),
    ),
    Case(
        "nnx-with_metadata",
        nnx_with_metadata,
        expected={
            "wi/kernel": P(("fsdp", "data"), "tensor"),
            "wo/kernel": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "nnx-LinearGeneral-short",
        nnx_linear_general_short,
        expected={
            "q/kernel": P(("fsdp", "data"), "tensor"),  # (64, 4, 16)
            "out/kernel": P("tensor", ("fsdp", "data")),  # (4, 16, 64)
        },
    ),
    Case(
        "nnx-MultiHeadAttention-short",
        nnx_attention_short,
        expected={
            **{f"{n}/kernel": P(("fsdp", "data"), "tensor") for n in ("query", "key", "value")},
            "out/kernel": P("tensor", ("fsdp", "data")),
        },
    ),
    Case(
        "nnx-Embed",
        nnx_embed,
        expected={"table/embedding": P("tensor", ("fsdp", "data"))},
    ),
    Case(
        "nnx-PartitionAxis",
        nnx_partition_axis,
        rules=fe.PartitionAxis(),
        mesh=escale_mesh,
        expected={
            "table/embedding": P("tp", ("fsdp", "sp")),
            "q/kernel": P(("fsdp", "sp"), "tp"),
            "mlp/wi/kernel": P(("fsdp", "sp"), "tp"),
            "mlp/wo/kernel": P("tp", ("fsdp", "sp")),
        },
        # The PartitionAxis rules end with fallbacks ((name, (fsdp, sp)) after (name, tp)).
        # Under dict(rules) each fallback wins, so Flax's NNX lookup puts (fsdp, sp) on both
        # dimensions of every kernel: a spec NamedSharding refuses (DESIGN decision 1).
        nnx_lookup_differs={
            path: P(("fsdp", "sp"), ("fsdp", "sp"))
            for path in ("table/embedding", "q/kernel", "mlp/wi/kernel", "mlp/wo/kernel")
        },
        nnx_lookup_refused=True,
    ),
    Case(
        "nnx-two_rules_for_a_name",
        nnx_two_rules_for_a_name,
        rules=TWO_RULES_FOR_EMBED,
        expected={"wi/kernel": P("fsdp", "tensor"), "wo/kernel": P("tensor", "fsdp")},
        nnx_lookup_differs={"wi/kernel": P("data", "tensor"), "wo/kernel": P("tensor", "data")},
    ),
]


# Comparing ----------------------------------------------------------------------------------


def flax_rules(rules):
    """The rules as Flax takes them: pairs (a ``PartitionAxis`` gives its ordered rules)."""
    if isinstance(rules, fe.PartitionAxis):
        return rules.logical_axis_rules()
    return rules


def padded(spec, rank):
    entries = tuple(spec)
    assert len(entries) <= rank, (spec, rank)
    return entries + (None,) * (rank - len(entries))


def flat(tree):
    """``{path: leaf}`` of a nested dict, ``/``-separated."""
    return flatten_dict(dict(tree), sep="/")


def arrays(tree):
    return {path: leaf for path, leaf in flat(tree).items() if hasattr(leaf, "shape")}


def compare(case, plan, created, flax_shardings, mesh):
    """Every array's spec: the library's plan and arrays against Flax's and the literal ones."""
    entries = {entry.path: entry for entry in plan}
    assert set(entries) == set(flax_shardings) == set(created)
    assert set(case.expected) <= set(entries), sorted(entries)
    for path, theirs in flax_shardings.items():
        entry = entries[path]
        rank = len(entry.shape)
        assert isinstance(theirs, NamedSharding), (path, theirs)
        assert theirs.mesh == mesh, (path, theirs)
        # Entry by entry, padded to the rank (Flax's spec is short for the short annotations).
        assert padded(entry.spec, rank) == padded(theirs.spec, rank), (path, entry.spec, theirs)
        ours = NamedSharding(mesh, entry.spec)
        assert ours.is_equivalent_to(theirs, rank), (path, entry.spec, theirs.spec)
        assert created[path].sharding.is_equivalent_to(theirs, rank), (path, theirs.spec)
        assert created[path].shape == entry.shape
        if path in case.expected:
            assert padded(entry.spec, rank) == padded(case.expected[path], rank), (path, entry)
    assert not plan.corrections


def assert_bit_equal(ours, reference):
    assert set(ours) == set(reference)
    for path, value in reference.items():
        assert ours[path].dtype == value.dtype, path
        np.testing.assert_array_equal(np.asarray(ours[path]), np.asarray(value), err_msg=path)


def expecting(case):
    # Flax's own deprecation notice for a style (newer Flax gives it, older Flax does not): not
    # the library's to assert, only to let through.
    stack = contextlib.ExitStack()
    if case.warns is not None:
        category, match = case.warns
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", f".*{match}", category)
    return stack


def linen_flax_shardings(abstract, mesh, rules):
    """Flax's sharding of each array of ``jax.eval_shape(model.init, ...)``, by its own tools."""
    specs = flat(nn.get_partition_spec(abstract))  # logical names, or mesh axes, per box
    boxes = flat(abstract)  # boxes are leaves: flatten_dict goes into dicts only
    # t5x's param_with_axes keeps the logical names in the params_axes collection.
    if "params_axes" in abstract:
        names = partitioning.get_axis_names(abstract["params_axes"])
        axes = flat({"params": nn.logical_to_mesh_sharding(names, mesh, rules)})
    else:
        axes = {}
    shardings = {}
    for path, box in boxes.items():
        if path.startswith("params_axes/"):
            continue
        if path in axes:
            shardings[path] = axes[path]
        elif isinstance(box, nn.LogicallyPartitioned):
            own = rules if box.rules is None else box.rules
            shardings[path] = nn.logical_to_mesh_sharding(specs[path], mesh, own)
        elif isinstance(box, nn.Partitioned):
            shardings[path] = box.get_sharding(mesh)
        else:  # unannotated: replicated
            shardings[path] = nn.logical_to_mesh_sharding(specs[path], mesh, rules)
    return shardings


@pytest.mark.parametrize("case", LINEN, ids=lambda case: case.id)
def test_linen_style_matches_flax(devices, case):
    model, inputs = case.build()
    mesh = case.mesh()
    rng = jax.random.key(0)
    with expecting(case):
        plan = fe.plan_sharding(model, mesh, rng, *inputs, rules=case.rules)
        created = fe.init_sharded(model, mesh, rng, *inputs, rules=case.rules)
        abstract = jax.eval_shape(model.init, rng, *inputs)
        reference = nn.unbox(jax.jit(model.init)(rng, *inputs))

    theirs = linen_flax_shardings(abstract, mesh, flax_rules(case.rules))
    compare(case, plan, arrays(created), theirs, mesh)
    assert_bit_equal(arrays(created), arrays(reference))


def nnx_abstract_state(build):
    with nnx.use_eager_sharding(False):
        return nnx.state(nnx.eval_shape(lambda: build(nnx.Rngs(0))))


def nnx_flat(state):
    return flat(nnx.to_pure_dict(state))


@pytest.mark.parametrize("case", NNX, ids=lambda case: case.id)
def test_nnx_style_matches_flax(devices, case):
    mesh = case.mesh()
    rng = jax.random.key(0)
    with expecting(case):
        plan = fe.plan_sharding(case.build, mesh, rng, rules=case.rules)
        model = fe.init_sharded(case.build, mesh, rng, rules=case.rules)
        abstract = nnx_abstract_state(case.build)
        with nnx.use_eager_sharding(False):
            reference = jax.jit(lambda key: nnx.state(case.build(nnx.Rngs(key))))(rng)
    created = nnx_flat(nnx.state(model))
    rules = flax_rules(case.rules)

    # Flax's answer: the variables' own metadata, read by Flax under the same rules.
    with nn.logical_axis_rules(rules):
        specs = nnx_flat(nnx.get_partition_spec(abstract))
    if case.nnx_lookup_differs is None:
        with nn.logical_axis_rules(rules):
            shardings = nnx_flat(nnx.get_named_sharding(abstract, mesh))
        for path, sharding in shardings.items():
            assert sharding.spec == specs[path], path
        compare(case, plan, created, shardings, mesh)
    else:
        # Flax's NNX lookup answers otherwise here (dict(rules), DESIGN decision 1). The
        # library gives what Linen's nn.logical_to_mesh_sharding gives for the same names and
        # rules, and the literal specs of the case.
        for path, spec in case.nnx_lookup_differs.items():
            assert specs[path] == spec, (path, specs[path])
            assert plan[path].spec != spec
        if case.nnx_lookup_refused:
            with nn.logical_axis_rules(rules), pytest.raises(Exception, match="duplicate entries"):
                nnx.get_named_sharding(abstract, mesh)
        names = abstract_names(abstract)
        linen_answer = {
            path: nn.logical_to_mesh_sharding(P(*names[path]), mesh, rules) for path in specs
        }
        compare(case, plan, created, linen_answer, mesh)
    assert_bit_equal(created, nnx_flat(reference))

    # After init_sharded, NNX's own tools read the resolved sharding from the metadata.
    after = nnx_flat(nnx.get_partition_spec(nnx.state(model)))
    for entry in plan:
        rank = len(entry.shape)
        assert padded(after[entry.path], rank) == padded(entry.spec, rank), entry.path


def abstract_names(state):
    """Each variable's ``out_sharding`` names (``()`` when it has none)."""
    return {
        "/".join(str(k) for k in path): tuple(variable.get_metadata().get("out_sharding") or ())
        for path, variable in nnx.to_flat_state(state)
    }


def test_flax_gives_a_short_spec_for_a_short_annotation(devices):
    # The case the padding is about, as the issue states it: DenseGeneral's (64, 4, 16) kernel
    # with two names is P('fsdp', 'tp') in Flax, its last dimension unsharded; the plan says so.
    rules = [("embed", "fsdp"), ("kv", "tp")]
    model = nn.DenseGeneral(features=(4, 16), kernel_init=logical(("embed", "kv")))
    x = jnp.ones((2, 64))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    assert abstract["params"]["kernel"].value.shape == (64, 4, 16)
    theirs = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), escale_mesh(), rules)
    assert theirs["params"]["kernel"].spec == P("fsdp", "tp")
    plan = fe.plan_sharding(model, escale_mesh(), jax.random.key(0), x, rules=rules)
    assert padded(plan["params/kernel"].spec, 3) == ("fsdp", "tp", None)
    assert NamedSharding(escale_mesh(), plan["params/kernel"].spec).is_equivalent_to(
        theirs["params"]["kernel"], 3
    )
    assert plan["params/kernel"].nbytes_per_device(escale_mesh()) == 16 * 2 * 16 * 4


# Mistakes with Annotation and read_annotation, one case each (support/mistakes.py says
# what a case asserts).
MISTAKES = [
    case(
        lambda: fep.Annotation(logical_axes="batch"),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="Annotation-logical_axes-string",
    ),
    case(
        lambda: fep.read_annotation(np.ones((8, 4), np.float32), source=3),
        T,
        "source",
        "int 3",
        "'sharded_module'",
        id="read_annotation-source-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, MISTAKES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
