"""The step-time estimate that ranks meshes, the textbook's count before compiling, and why.

A compiled candidate's estimate adds its compute (FLOPs at the peak rate, plus the optimizer's
pass over the train state at the memory bandwidth) and its communication (the bytes each device
sends in collectives at the interconnect's rate, plus a latency per collective). Before
compiling, the scaling book's per-strategy counts say what a mesh's collectives move when the
weights travel; a mesh whose textbook communication alone exceeds :data:`RULE_OUT_MARGIN`
times the best estimate already compiled is ruled out without compiling it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from flax_escale._specs import mesh_axes_of
from flax_escale._units import format_bytes
from flax_escale.pipeline import Schedule
from flax_escale.plan import ShardingPlan
from flax_escale.sizing._hlo import COLLECTIVE_KINDS
from flax_escale.sizing._profiles import HardwareProfile

__all__ = [
    "ESTIMATE_TERMS",
    "RULE_OUT_MARGIN",
    "estimate_seconds",
    "explain",
    "explain_pipeline",
    "slow_collectives",
    "textbook_communication",
    "token_count",
]

ESTIMATE_TERMS = (
    "estimated step time = FLOPs / peak FLOP/s + 2 x train-state bytes / memory bandwidth "
    "(the optimizer update's pass over the state) + bytes each device sends in collectives / "
    "interconnect bandwidth + collectives run x latency; no overlap of compute and "
    "communication, no activations' memory traffic or kernel-efficiency terms. A pipeline's "
    "bubble is in its compiled FLOPs (every stage computes in each of its m x v + p - 1 "
    "iterations). With a profile's between-host bandwidth, the collectives of axes that span "
    "hosts move at it. An estimate to rank meshes by, not a prediction of seconds."
)
"""What the planner's estimated step time adds up, and what it leaves out (printed with plans)."""


def estimate_seconds(
    flops: float,
    state_bytes: int,
    collectives: Mapping[str, Sequence[float]],
    profile: HardwareProfile,
    slow: Sequence[str] = (),
    pipeline_bytes: float = 0.0,
) -> tuple[float, float]:
    """``(compute, communication)`` seconds of one step by :data:`ESTIMATE_TERMS`.

    Args:
        flops: FLOPs of one step on one device.
        state_bytes: The train state's bytes on the fullest device.
        collectives: ``{kind: (count, bytes, wire bytes)}`` per step on one device.
        profile: The hardware.
        slow: The kinds of collective that cross hosts (:func:`slow_collectives`): they move
            at the profile's between-host bandwidth. ``"pipeline"`` stands for the pipeline's
            own permutes.
        pipeline_bytes: The bytes of the pipeline's own permutes (over ``pp``) among the
            collective-permutes' (the rest are the compiler's, over the other axes).

    Example:
        >>> from flax_escale.sizing import PROFILES
        >>> from flax_escale.sizing._estimate import estimate_seconds
        >>> h100 = PROFILES["h100"]
        >>> compute, talk = estimate_seconds(989e12, 0, {"all-reduce": (1, 0, 450e9)}, h100)
        >>> round(compute, 6), round(talk, 6)
        (1.0, 1.00001)
    """
    bandwidth = profile.memory_bytes_per_second
    update = 2 * state_bytes / bandwidth if bandwidth else 0.0
    count = sum(c[0] for c in collectives.values())
    fast = profile.interconnect_bytes_per_second
    between = profile.host_bytes_per_second or fast
    wire = {kind: c[2] for kind, c in collectives.items()}
    if pipeline_bytes:
        wire["collective-permute"] = max(wire.get("collective-permute", 0.0) - pipeline_bytes, 0)
        wire["pipeline"] = pipeline_bytes
    talk = sum(size / (between if kind in slow else fast) for kind, size in wire.items())
    return (
        flops / profile.flops_per_second + update,
        talk + count * profile.collective_latency_seconds,
    )


def slow_collectives(shape: Mapping[str, int], devices_per_host: int | None) -> tuple[str, ...]:
    """The kinds of collective that cross hosts on a mesh of ``shape`` (outermost axis first).

    Devices are numbered along the mesh's axes, the last fastest, and a host holds
    ``devices_per_host`` consecutive ones: an axis spans hosts when its size times the devices
    of the axes after it exceeds a host. The compiled figures give bytes per kind of collective,
    not per axis, so they are told apart by what runs them: the pipeline's own permutes
    (``"pipeline"``) run over ``pp``; every other collective over the other axes. A kind
    crosses hosts when one of its axes does (a ring moves at its slowest link).

    Example:
        >>> from flax_escale.sizing._estimate import slow_collectives
        >>> slow_collectives({"pp": 2, "dp": 1, "fsdp": 4, "ep": 1, "tp": 1, "sp": 1}, 4)
        ('pipeline',)
        >>> slow_collectives({"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}, 4)[:2]
        ('all-reduce', 'all-gather')
    """
    if devices_per_host is None:
        return ()
    crossing, inner = set(), 1
    for axis, size in reversed(list(shape.items())):
        if size > 1 and size * inner > devices_per_host:
            crossing.add(axis)
        inner *= size
    others = COLLECTIVE_KINDS if crossing - {"pp"} else ()
    return (("pipeline",) if "pp" in crossing else ()) + others


RULE_OUT_MARGIN = 2.0
"""A mesh is ruled out before compiling when its textbook communication alone exceeds this
many times the best estimate compiled so far. Not 1: the textbook moves weights, and a compiler
moves the activations instead where they are smaller (a small batch, or a batch split along a
dimension the weights share), so a mesh can communicate less than its textbook count."""


def textbook_communication(
    plan: ShardingPlan, mesh: Mesh, batch_axes: Sequence[str], profile: HardwareProfile
) -> tuple[float, str]:
    """Seconds a step's collectives take on ``mesh`` when the weights travel, by the textbook.

    Every mesh axis that splits the batch makes each device compute gradients of a part of
    the batch. A parameter split over such axes (FSDP) is gathered for the forward pass:
    ``(m - 1) x shard`` bytes sent per device over the ``m`` devices of those axes. A parameter
    repeated over them (data parallelism) has its gradient reduced, at the least by a
    reduce-scatter: ``(n - 1) / n x shard`` bytes over the ``n`` devices. The scaling book's
    full counts are larger (FSDP gathers again for the backward pass and reduce-scatters the
    gradients, 3x; data parallelism all-reduces, 2x); this keeps only the first pass, and
    leaves out tensor parallelism's activation traffic.

    Args:
        plan: The parameters' sharding plan on ``mesh``.
        mesh: The mesh.
        batch_axes: The mesh axes the batch is split over.
        profile: The hardware.

    Returns:
        ``(seconds, detail)``: the time at the profile's interconnect bandwidth, and the bytes
        of each part in words.
    """
    gathered = reduced = 0.0
    for entry in plan:
        if not entry.path.startswith("params/") and entry.path != "params":
            continue
        shard = entry.nbytes_per_device(mesh)
        split = {a for spec_entry in entry.spec for a in mesh_axes_of(spec_entry)}
        over = math.prod(mesh.shape[a] for a in batch_axes if a in split)
        repeated = math.prod(mesh.shape[a] for a in batch_axes if a not in split)
        gathered += (over - 1) * shard
        reduced += (repeated - 1) / repeated * shard
    seconds = (gathered + reduced) / profile.interconnect_bytes_per_second
    detail = (
        f"parameters gathered once {format_bytes(gathered)} + gradients reduce-scattered "
        f"{format_bytes(reduced)} per device"
    )
    return seconds, detail


def explain(
    compute: float,
    communication: float,
    collectives: Mapping[str, Sequence[float]],
    tokens_per_device: float | None,
    profile: HardwareProfile,
) -> str:
    """Why a mesh's estimate is what it is, in the scaling book's terms.

    Which term dominates the estimate; which collective moves most of the bytes (and the
    all-to-alls' share, where expert parallelism moves tokens with them); and the tokens each
    device computes on per step (the workload's ``tokens`` says which dimensions count)
    against the ratio of the profile's peak FLOP/s to its interconnect bandwidth: data and
    fully sharded parallelism, whose
    weights or gradients cross the interconnect every step, are compute-bound only from that
    many tokens per device.

    Example:
        >>> from flax_escale.sizing import PROFILES
        >>> from flax_escale.sizing._estimate import explain
        >>> explain(2e-3, 1e-3, {"all-gather": (4, 0, 3e6), "all-reduce": (1, 0, 1e6)}, 4096,
        ...         PROFILES["tpu-v5e"])
        'compute-bound (67% of the estimate); all-gather sends 75% of the bytes; 4,096 tokens/device, over the 985 from which data/FSDP parallelism is compute-bound on Google TPU v5e: 197 TFLOP/s / 200 GB/s'
        >>> explain(1e-3, 2e-3, {"all-gather": (4, 0, 3e6), "all-to-all": (8, 0, 1e6)}, 132,
        ...         PROFILES["h100"])
        'communication-bound (67% of the estimate); all-gather sends 75% of the bytes; all-to-all 25%; 132 tokens/device, under the 2,198 from which data/FSDP parallelism is compute-bound on NVIDIA H100 SXM: 989 TFLOP/s / 450 GB/s'
    """  # noqa: E501
    total = compute + communication
    bound = "compute" if compute >= communication else "communication"
    share = max(compute, communication) / total if total else 0.0
    parts = [f"{bound}-bound ({share:.0%} of the estimate)"]
    wire = sum(c[2] for c in collectives.values())
    if wire:
        kind, cost = max(collectives.items(), key=lambda item: item[1][2])
        parts.append(f"{kind} sends {cost[2] / wire:.0%} of the bytes")
        # Expert parallelism's cost is its all-to-alls: named whenever a step has any.
        exchanged = sum(
            c[2] for k, c in collectives.items() if k.endswith("all-to-all") and k != kind
        )
        if exchanged:
            share = exchanged / wire
            parts.append(f"all-to-all {share:.0%}" if share >= 0.005 else "all-to-all <1%")
    if tokens_per_device is not None:
        threshold = profile.flops_per_second / profile.interconnect_bytes_per_second
        ratio = (
            f"{profile.name}: {profile.flops_per_second / 1e12:,.0f} TFLOP/s / "
            f"{profile.interconnect_bytes_per_second / 1e9:,.0f} GB/s"
        )
        side = "over" if tokens_per_device >= threshold else "under"
        parts.append(
            f"{tokens_per_device:,.0f} tokens/device, {side} the {threshold:,.0f} from which "
            f"data/FSDP parallelism is compute-bound on {ratio}"
        )
    return "; ".join(parts)


def explain_pipeline(
    settings: Mapping[str, Any], permuted: float | None, slow: Sequence[str] = ()
) -> str:
    """What a pipeline candidate's schedule costs: its bubble, activations in flight, permutes.

    ``permuted`` is the bytes of the pipeline's own permutes per step, read from the compiled
    step (``None``: not read).

    Example:
        >>> from flax_escale.sizing._estimate import explain_pipeline
        >>> settings = {"stages": 2, "microbatches": 8, "repeats": 1, "remat": "none", "layers": 4}
        >>> explain_pipeline(settings, 9216, ("pipeline",))
        'pipeline of 2 stages, 8 microbatches, GPipe, remat none: bubble 11% (9 iterations, compute x1.12 in the FLOPs); 18 microbatch activations in flight per stage; permutes 9.00 KiB/step, between hosts'
    """  # noqa: E501
    p, m, v = settings["stages"], settings["microbatches"], settings["repeats"]
    schedule = Schedule(p, m, v, settings["layers"])
    kind = "GPipe" if v == 1 else f"circular x{v}"
    where = ", between hosts" if "pipeline" in slow else ""
    moved = "not read" if permuted is None else f"{format_bytes(permuted)}/step{where}"
    in_flight = schedule.activations_in_flight(remat=settings["remat"] == "iteration")
    return (
        f"pipeline of {p} stages, {m} microbatches, {kind}, remat {settings['remat']}: bubble "
        f"{schedule.bubble_fraction:.0%} ({schedule.iterations} iterations, compute "
        f"x{schedule.iterations / (m * v):.3g} in the FLOPs); {in_flight} microbatch activations "
        f"in flight per stage; permutes {moved}"
    )


def token_count(
    shape: Sequence[int], dims: Sequence[int], spec: Sequence[Any], mesh: Mesh
) -> float:
    """The tokens one device holds of an array whose dimensions ``dims`` count tokens.

    Each of ``dims`` is divided by the mesh axes its ``spec`` entry splits it over: a
    ``(64, 1024)`` batch of token ids split ``P(("fsdp", "dp"), "sp")`` on ``fsdp=4 sp=2``
    holds ``16 x 512`` tokens per device.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sizing._estimate import token_count
        >>> mesh = create_mesh((1, 4, 1, 1, 2))
        >>> token_count((64, 1024), (0, 1), (("fsdp", "dp"), "sp"), mesh)
        8192.0
        >>> token_count((64, 1024), (0,), (("fsdp", "dp"), "sp"), mesh)  # rows of features
        16.0
    """
    count = 1.0
    for dim in dims:
        entry = spec[dim] if dim < len(spec) else None
        count *= shape[dim] / math.prod(mesh.shape[a] for a in mesh_axes_of(entry))
    return count
