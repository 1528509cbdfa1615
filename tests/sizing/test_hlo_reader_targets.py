"""The HLO reader on the compilers of the targets, against the textbook's counts.

One training step of a stack of transformer blocks (``lax.scan`` over the layers; fused QKV,
causal attention, a two-matrix MLP; no biases or norms, so every parameter is a matrix) is
compiled for 8 devices by XLA:CPU (simulated devices) and by the TPU compiler (a v5e 2x4 slice
described by ``jax.experimental.topologies``; ``libtpu`` compiles, nothing runs). Analytic
counts are the oracle, with ``P`` the parameters' bytes and ``N = 8``:

- data parallelism all-reduces exactly the gradients, ``P``;
- FSDP all-gathers the parameters forward and again backward and reduce-scatters the
  gradients, ``(N - 1) / N`` of each on the wire (the scaling book's 3x);
- tensor parallelism (Megatron) all-reduces one activation ``B x T x D`` after the attention
  and one after the MLP forward, and the same two gradients backward: ``4 B T D`` values per
  layer;
- matrix multiplications: ``6 x (matrix parameters) x tokens`` plus attention's
  ``12 x B x T^2 x D`` per layer.

Where a compiler's program differs from the textbook, the difference is asserted exactly, as
the reader reports it: XLA:CPU reduces FSDP gradients with an all-reduce + dynamic-slice; the
TPU compiler gathers the weights in bfloat16 (the matrix unit's input at default precision),
reduces some gradients with all-reduce + slice and the rest with its reduce-scatter fusion,
and for large matmuls writes the collectives as collective-permute rings in windowed matmul
loops that send ``N + 1`` shards where the textbook's ring sends ``N - 1``.
"""

import importlib.util
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.example_modules import load

import flax_escale as fe
from flax_escale.sizing._hlo import SLICED, WINDOWED, Rewrite, program_costs
from flax_escale.sizing._programs import lower_programs

N = 8
MESHES = {"dp": (8, 1, 1, 1, 1), "fsdp": (1, 8, 1, 1, 1), "tp": (1, 1, 1, 8, 1)}


@pytest.fixture(scope="module")
def tpu_devices() -> list[jax.Device]:
    """The chips of a TPU v5e 2x4 slice, described for the TPU compiler (libtpu)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip('the TPU compiler is not installed: pip install "flax-escale[tpu]"')
    from jax.experimental import topologies

    return list(topologies.get_topology_desc("v5e:2x4", "tpu").devices)


@pytest.fixture(params=["cpu", "tpu"])
def compiler(request) -> tuple[str, list[jax.Device]]:
    """Each compiler with its 8 devices: XLA:CPU's simulated ones, the TPU slice's chips."""
    if request.param == "cpu":
        return "cpu", jax.devices("cpu")[:N]
    return "tpu", request.getfixturevalue("tpu_devices")


# --- the program -------------------------------------------------------------------------------


class Stack:
    """``layers`` transformer blocks over activations ``(batch, tokens, width)``."""

    def __init__(self, layers=2, batch=16, tokens=32, width=128, heads=8, mlp=256):
        self.layers, self.batch, self.tokens, self.width = layers, batch, tokens, width
        self.heads, self.mlp = heads, mlp
        head = width // heads
        self.shapes = [
            (layers, width, 3, heads, head),  # query, key, value
            (layers, heads, head, width),  # attention output
            (layers, width, mlp),
            (layers, mlp, width),
        ]

    @property
    def parameter_bytes(self) -> int:
        return sum(4 * math.prod(shape) for shape in self.shapes)

    @property
    def activation_bytes(self) -> int:
        return 4 * self.batch * self.tokens * self.width

    @property
    def flops(self) -> int:
        """Matrix-multiplication FLOPs of one step on all devices together."""
        tokens = self.batch * self.tokens
        matrices = self.parameter_bytes // 4
        attention = 12 * self.batch * self.tokens**2 * self.width * self.layers
        return 6 * matrices * tokens + attention

    def step(self, params, x):
        head = self.width // self.heads
        causal = jnp.tril(jnp.ones((self.tokens, self.tokens), bool))

        def block(x, w):
            qkv, out, up, down = w
            q, k, v = jnp.unstack(jnp.einsum("btd,dchk->cbthk", x, qkv))
            scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / head**0.5
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            x = x + jnp.einsum("bhqt,bthk,hkd->bqd", weights, v, out)
            return x + jnp.tanh(x @ up) @ down, None

        def loss(params):
            return jnp.mean(jax.lax.scan(block, x, params)[0] ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    def compile(self, devices, layout, **options):
        mesh = fe.create_mesh(MESHES[layout], devices=devices)
        params, batch = {
            "dp": ([P()] * 4, P("dp")),
            "fsdp": (
                [
                    P(None, "fsdp"),
                    P(None, None, None, "fsdp"),
                    P(None, "fsdp"),
                    P(None, None, "fsdp"),
                ],
                P("fsdp"),
            ),
            # Megatron: heads and the MLP's hidden units split, activations whole.
            "tp": (
                [P(None, None, None, "tp"), P(None, "tp"), P(None, None, "tp"), P(None, "tp")],
                P(),
            ),
        }[layout]
        params = tuple(NamedSharding(mesh, spec) for spec in params)
        abstract = (
            tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in self.shapes),
            jax.ShapeDtypeStruct((self.batch, self.tokens, self.width), jnp.float32),
        )
        step = jax.jit(
            self.step, in_shardings=(params, NamedSharding(mesh, batch)), out_shardings=params
        )
        return step.lower(*abstract).compile(**options)


STACK = Stack()
_COMPILED: dict = {}


def costs_of(compiler, layout):
    """The reader's figures for STACK's step, compiled once per compiler and mesh."""
    name, devices = compiler
    if (name, layout) not in _COMPILED:
        _COMPILED[name, layout] = program_costs(STACK.compile(devices, layout))
    return _COMPILED[name, layout]


# --- collectives against the textbook ---------------------------------------------------------


def test_data_parallelism_all_reduces_exactly_the_gradients(compiler):
    costs = costs_of(compiler, "dp")
    p = STACK.parameter_bytes
    assert set(costs.collectives) == {"all-reduce"}
    reduce = costs.collectives["all-reduce"]
    assert reduce.bytes == p
    assert reduce.wire_bytes == pytest.approx(2 * p * (N - 1) / N)
    assert costs.collective_dtypes == {"all-reduce": {"f32": p}}
    assert costs.rewrites == ()
    assert costs.unknown_trip_loops == 0


def test_fsdp_gathers_twice_and_reduce_scatters_once_on_xla_cpu(devices):
    costs = costs_of(("cpu", devices), "fsdp")
    p, arrays = STACK.parameter_bytes, len(STACK.shapes) * STACK.layers
    assert set(costs.collectives) == {"all-gather", "all-reduce"}
    gather = costs.collectives["all-gather"]
    # Each layer's weights gathered whole forward, and again backward: the textbook's 2 x P.
    assert (gather.count, gather.bytes) == (2 * arrays, 2 * p)
    assert gather.wire_bytes == pytest.approx(2 * p * (N - 1) / N)
    # The gradients: written as all-reduce + dynamic-slice, 2 (N - 1) / N of P on the wire
    # where the textbook's reduce-scatter sends (N - 1) / N.
    reduce = costs.collectives["all-reduce"]
    assert reduce.bytes == p
    assert reduce.wire_bytes == pytest.approx(2 * p * (N - 1) / N)
    textbook = p // N * (N - 1)
    assert costs.rewrites == (
        Rewrite("reduce-scatter", SLICED, arrays, p // N, reduce.wire_bytes, textbook),
    )
    # Counted in their textbook forms, the step moves FSDP's 3 (N - 1) / N of P.
    assert costs.textbook_wire_bytes == pytest.approx(3 * p * (N - 1) / N)


def test_fsdp_on_the_tpu_compiler_gathers_bfloat16_and_reduce_scatters(tpu_devices):
    costs = costs_of(("tpu", tpu_devices), "fsdp")
    p = STACK.parameter_bytes
    assert set(costs.collectives) == {"all-gather", "all-reduce", "reduce-scatter"}
    # The weights gathered forward and backward, in bfloat16: half of the textbook's 2 x P.
    gather = costs.collectives["all-gather"]
    assert gather.bytes == 2 * p // 2
    assert costs.collective_dtypes["all-gather"] == {"bf16": p}
    assert gather.wire_bytes == pytest.approx(p * (N - 1) / N)
    # Every gradient reduce-scattered in float32: some by the reduce-scatter fusion, the rest
    # by all-reduce + dynamic-slice; together they keep P / N, the textbook's.
    scatter, reduce = costs.collectives["reduce-scatter"], costs.collectives["all-reduce"]
    (sliced,) = costs.rewrites
    assert (sliced.textbook, sliced.written_as) == ("reduce-scatter", SLICED)
    assert scatter.bytes + sliced.bytes == p // N
    assert scatter.wire_bytes == pytest.approx(scatter.bytes * (N - 1))
    assert reduce.bytes == sliced.bytes * N  # nothing else is all-reduced
    assert sliced.wire_bytes == pytest.approx(reduce.wire_bytes)
    assert sliced.textbook_wire_bytes == pytest.approx(sliced.bytes * (N - 1))
    assert costs.collective_dtypes["reduce-scatter"] == {"f32": scatter.bytes}


def test_tensor_parallelism_moves_megatrons_activations(compiler):
    costs = costs_of(compiler, "tp")
    # Per layer: after attention and after the MLP forward, and their inputs' gradients
    # backward; each one activation, batch x tokens x width, in float32.
    expected = 4 * STACK.layers * STACK.activation_bytes
    assert set(costs.collectives) == {"all-reduce"}
    reduce = costs.collectives["all-reduce"]
    assert (reduce.count, reduce.bytes) == (4 * STACK.layers, expected)
    assert reduce.wire_bytes == pytest.approx(2 * expected * (N - 1) / N)
    assert costs.rewrites == ()


@pytest.mark.parametrize("layout", list(MESHES))
def test_matmul_flops_are_six_n_d_plus_attention_on_every_mesh(compiler, layout):
    costs = costs_of(compiler, layout)
    assert costs.dot_flops == STACK.flops / N
    # XLA's own count sees the scanned layer's body once.
    assert costs.dot_flops_once == STACK.flops / N / STACK.layers


@pytest.mark.slow
def test_windowed_matmul_rings_stand_for_the_fsdp_collectives_on_the_tpu(tpu_devices):
    # Large enough (2,048 tokens per chip, GPT-2 small's width) for the TPU compiler to write
    # every FSDP collective as a collective-permute ring inside the matmul.
    stack = Stack(layers=2, batch=64, tokens=256, width=768, heads=8, mlp=1536)
    costs = program_costs(stack.compile(tpu_devices, "fsdp"))
    p, arrays = stack.parameter_bytes, len(stack.shapes) * stack.layers
    assert set(costs.collectives) == {"collective-permute"}
    gather, scatter = costs.rewrites
    assert (gather.textbook, gather.written_as) == ("all-gather", WINDOWED)
    assert (scatter.textbook, scatter.written_as) == ("reduce-scatter", WINDOWED)
    # The textbook's collectives: the bfloat16 weights gathered twice, the gradients' shards.
    assert (gather.count, gather.bytes) == (2 * arrays, p)
    assert (scatter.count, scatter.bytes) == (arrays, p // N)
    # The rings send N + 1 shards each, both ways round, where the textbook's sends N - 1.
    assert gather.wire_bytes == gather.bytes * (N + 1) / N
    assert scatter.wire_bytes == scatter.bytes * (N + 1)
    assert costs.wire_bytes == gather.wire_bytes + scatter.wire_bytes
    assert gather.textbook_wire_bytes == gather.bytes * (N - 1) / N
    assert scatter.textbook_wire_bytes == scatter.bytes * (N - 1)
    assert costs.textbook_wire_bytes == pytest.approx(p * (N - 1) / N + p // N * (N - 1))
    assert costs.dot_flops == stack.flops / N


# --- a GPT-like training step -------------------------------------------------------------------


@pytest.mark.slow
def test_gpt_step_matmul_flops_within_5_percent_of_6nd_plus_attention(compiler):
    gpt = load("linen_gpt")
    config = gpt.Config(vocab=512, hidden=128, heads=4, head_dim=32, mlp=512, layers=2, max_len=64)
    batch = 16
    mesh = fe.create_mesh(MESHES["fsdp"], devices=compiler[1])
    step = lower_programs(gpt.workload(config, batch=batch), mesh).step.compile()
    tokens = batch * config.max_len
    inner = config.heads * config.head_dim
    matrices = config.layers * (4 * config.hidden * inner + 2 * config.hidden * config.mlp)
    matrices += config.hidden * config.vocab  # the output head; the embedding is a lookup
    attention = 12 * batch * config.max_len**2 * inner * config.layers
    expected = (6 * matrices * tokens + attention) / N
    assert program_costs(step).dot_flops == pytest.approx(expected, rel=0.05)


# --- forms of other backends, as XLA writes them -------------------------------------------------

ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""
COUNTED = """
%cond (s: (s32[], f32[64])) -> pred[] {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %limit = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}
ENTRY %main (a: f32[64]) -> (s32[], f32[64]) {
  %a = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(%zero, %a)
  ROOT %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body
}
"""
GPU = (
    "HloModule gpu, num_partitions=8\n"
    + ADD
    + """
%wrapped (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}
%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%y), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %ars = f32[64]{0} all-reduce-start(%x), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  %rss = ((f32[64]{0}), f32[8]{0}) async-start(%x), calls=%wrapped
  %rsu = ((f32[64]{0}), f32[8]{0}) async-update(%rss), calls=%wrapped
  %rsd = f32[8]{0} async-done(%rsu), calls=%wrapped
  %cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%z), channel_id=4, source_target_pairs={{0,1},{1,2}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %gemm = (f32[32,16]{1,0}, s8[1024]{0}) custom-call(%l, %r), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %l = f32[32,64]{1,0} constant({...})
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %ard)
}
"""  # noqa: E501
    + COUNTED
)


def test_gpu_async_pairs_and_wrapped_collectives_count_once_per_trip():
    costs = program_costs(GPU)
    assert costs.unknown_trip_loops == 0  # 6 trips, from the loop's counter
    got = {k: (c.count, c.bytes, c.wire_bytes) for k, c in costs.collectives.items()}
    assert got == {
        "all-gather": (6, 6 * 256, 6 * 256 * 7 / 8),
        "all-reduce": (6, 6 * 256, 6 * 256 * 2 * 1 / 2),  # groups of 2
        "reduce-scatter": (6, 6 * 32, 6 * 32 * 7),  # inside async-start's computation
        "collective-permute": (6, 6 * 64, 6 * 64),
    }
    assert costs.dot_flops == 6 * 2 * 32 * 16 * 64  # the cuBLAS call, as its dot


TPU = (
    "HloModule tpu, num_partitions=8\n"
    + ADD
    + """
%start (p: bf16[1,1024,32]) -> (bf16[1,1024,32], bf16[1,1024,256], u32[]) {
  %p = bf16[1,1024,32]{1,2,0:T(8,128)(2,1)} parameter(0)
  %ag = bf16[1,1024,256]{1,2,0:T(8,128)(2,1)} all-gather(%p), channel_id=14, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={2}, frontend_attributes={chain_id="0"}, backend_config={"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  ROOT %go = (bf16[1,1024,32]{1,2,0}, bf16[1,1024,256]{1,2,0}, u32[]{:S(2)}) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}
%continued (p: bf16[1,1024,32], q: f32[8,256], r: f32[256,16]) -> (f32[8,16], bf16[1,1024,256]) {
  %p = bf16[1,1024,32]{1,2,0} parameter(0)
  %q = f32[8,256]{1,0} parameter(1)
  %r = f32[256,16]{1,0} parameter(2)
  %conv = f32[8,16]{1,0:T(8,128)} convolution(%q, %r), dim_labels=bf_io->bf
  %ag = bf16[1,1024,256]{1,2,0} all-gather(%p), channel_id=14, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={2}, frontend_attributes={chain_id="0"}, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  ROOT %both = (f32[8,16]{1,0}, bf16[1,1024,256]{1,2,0}) tuple(%conv, %ag)
}
%done (p: bf16[1,1024,32], q: bf16[1,1024,256]) -> bf16[1,1024,256] {
  %p = bf16[1,1024,32]{1,2,0} parameter(0)
  %q = bf16[1,1024,256]{1,2,0} parameter(1)
  %ag = bf16[1,1024,256]{1,2,0} all-gather(%p), channel_id=14, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={2}, frontend_attributes={chain_id="0"}
  ROOT %end = bf16[1,1024,256]{1,2,0} custom-call(%p, %q, %ag), custom_call_target="AsyncCollectiveDone"
}
%all-reduce-scatter.2.clone (a: f32[256,64]) -> f32[32,64] {
  %a = f32[256,64]{1,0} parameter(0)
  %ar = f32[256,64]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %id = u32[] partition-id()
  %width = u32[] constant(32)
  %offset = u32[] multiply(%id, %width)
  %zero = u32[] constant(0)
  ROOT %mine = f32[32,64]{1,0} dynamic-slice(%ar, %offset, %zero), dynamic_slice_sizes={32,64}
}
%body (s: (u32[], f32[64])) -> (u32[], f32[64]) {
  %s = (u32[]{:T(128)}, f32[64]{0}) parameter(0)
  %step = u32[]{:T(128)} constant(2)
  %i = u32[]{:T(128)} get-tuple-element(%s), index=0
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %copied = u32[]{:T(128)S(6)} copy(%i)
  %go = (bf16[1,1024,32]{1,2,0}, bf16[1,1024,256]{1,2,0}, u32[]{:S(2)}) fusion(%w), kind=kCustom, calls=%start
  %on = (f32[8,16]{1,0}, bf16[1,1024,256]{1,2,0}) fusion(%w, %q, %r), kind=kOutput, calls=%continued, backend_config={"continuation_config":{"output_tuple_original_start":"0"}}
  %end = bf16[1,1024,256]{1,2,0} fusion(%w, %g), kind=kCustom, calls=%done
  %kept = f32[32,64]{1,0:T(8,128)} fusion(%grad), kind=kCustom, calls=%all-reduce-scatter.2.clone, backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion","strategy":"StrategyRing"}}
  %next = u32[]{:T(128)} add(%copied, %step)
  ROOT %t = (u32[]{:T(128)}, f32[64]{0}) tuple(%next, %x)
}
%cond (s: (u32[], f32[64])) -> pred[] {
  %limit = u32[]{:T(128)} constant(8)
  %s = (u32[]{:T(128)}, f32[64]{0}) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%s), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}
ENTRY %main (a: f32[64]) -> (u32[], f32[64]) {
  %a = f32[64]{0} parameter(0)
  %zero = u32[]{:T(128)} constant(0)
  %first = u32[]{:T(128)} copy(%zero)
  %init = (u32[]{:T(128)}, f32[64]{0}) tuple(%first, %a)
  ROOT %loop = (u32[]{:T(128)}, f32[64]{0}) while(%init), condition=%cond, body=%body
}
"""  # noqa: E501
)


def test_tpu_async_collective_fusions_and_reduce_scatter_fusions_count_once():
    costs = program_costs(TPU)
    trips = 4  # the counter runs 0, 2, 4, 6 below 8; the compiler records no trip count
    got = {k: (c.count, c.bytes, c.wire_bytes) for k, c in costs.collectives.items()}
    gathered, kept = 1024 * 256 * 2, 32 * 64 * 4
    assert got == {
        # Start, continuation and done hold the same all-gather: counted at the start.
        "all-gather": (trips, trips * gathered, trips * gathered * 7 / 8),
        # The all-reduce-scatter fusion is one reduce-scatter, not an all-reduce.
        "reduce-scatter": (trips, trips * kept, trips * kept * 7),
    }
    assert costs.rewrites == ()
    # The matmul fused into the continuation counts.
    assert costs.dot_flops == trips * 2 * 8 * 16 * 256


LOOP = (
    ADD
    + """
%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %r = f32[64]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  %by = s32[] constant(STEP)
  %next = s32[] UPDATE(%i, %by)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %r)
}
%cond (s: (s32[], f32[64])) -> pred[] {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %limit = s32[] constant(LIMIT)
  ROOT %test = pred[] compare(COMPARED), direction=DIRECTION
}
ENTRY %main (a: f32[64]) -> (s32[], f32[64]) {
  %a = f32[64]{0} parameter(0)
  %start = s32[] constant(START)
  %init = (s32[], f32[64]{0}) tuple(%start, %a)
  ROOT %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body
}
"""
)


@pytest.mark.parametrize(
    ("start", "update", "step", "compared", "direction", "limit", "trips"),
    [
        (0, "add", 1, "%i, %limit", "LT", 12, 12),
        (0, "add", 5, "%i, %limit", "LT", 12, 3),  # 0, 5, 10
        (1, "add", 1, "%i, %limit", "LE", 12, 12),
        (0, "add", 1, "%limit, %i", "GT", 12, 12),  # limit > i
        (11, "add", -1, "%i, %limit", "GE", 0, 12),  # a reversed scan
        (11, "subtract", 1, "%i, %limit", "GT", -1, 12),
        (0, "add", 3, "%i, %limit", "NE", 12, 4),
        (5, "add", 1, "%i, %limit", "LT", 5, 0),  # never runs
    ],
)
def test_trip_counts_from_the_loop_counter(start, update, step, compared, direction, limit, trips):
    text = (
        LOOP.replace("START", str(start))
        .replace("UPDATE", update)
        .replace("STEP", str(step))
        .replace("COMPARED", compared)
        .replace("DIRECTION", direction)
        .replace("LIMIT", str(limit))
    )
    costs = program_costs(text)
    assert costs.unknown_trip_loops == 0
    assert costs.collective_count == trips


def test_a_loop_whose_count_cannot_be_read_counts_once_and_says_so():
    # The counter starts from the program's argument, unknown when compiling.
    text = LOOP.replace("%start = s32[] constant(START)", "%start = s32[] parameter(1)")
    text = text.replace("STEP", "1").replace("UPDATE", "add").replace("COMPARED", "%i, %limit")
    costs = program_costs(text.replace("DIRECTION", "LT").replace("LIMIT", "12"))
    assert costs.unknown_trip_loops == 1
    assert costs.collective_count == 1


# --- convolutions as XLA counts them ------------------------------------------------------------


@pytest.mark.parametrize(
    ("lhs", "rhs", "dimensions", "options"),
    [
        ((1, 8, 8, 4), (3, 3, 4, 16), ("NHWC", "HWIO", "NHWC"), {"padding": "SAME"}),
        ((2, 9, 9, 3), (3, 3, 3, 8), ("NHWC", "HWIO", "NHWC"), {"window_strides": (2, 2)}),
        (
            (1, 6, 6, 4),
            (2, 2, 4, 4),
            ("NHWC", "HWIO", "NHWC"),
            {"lhs_dilation": (2, 2), "padding": ((1, 1), (1, 1))},
        ),
        ((1, 8, 8, 4), (3, 3, 4, 8), ("NHWC", "HWIO", "NHWC"), {"rhs_dilation": (2, 2)}),
        ((1, 8, 8, 8), (3, 3, 2, 8), ("NHWC", "HWIO", "NHWC"), {"feature_group_count": 4}),
        ((1, 16, 4), (5, 4, 6), ("NWC", "WIO", "NWC"), {"padding": ((4, 4),)}),
    ],
)
def test_convolution_flops_equal_xlas_own_count(lhs, rhs, dimensions, options):
    def conv(x, k):
        padding = options.get("padding", "VALID")
        rest = {key: value for key, value in options.items() if key != "padding"}
        strides = rest.pop("window_strides", (1,) * (len(lhs) - 2))
        return jax.lax.conv_general_dilated(
            x, k, strides, padding, dimension_numbers=dimensions, **rest
        )

    compiled = jax.jit(conv).lower(jnp.ones(lhs), jnp.ones(rhs)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    assert "convolution(" in compiled.as_text()
    assert program_costs(compiled).dot_flops == analysis["flops"]
