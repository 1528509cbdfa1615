"""FLOPs of one matrix multiplication or convolution of a compiled program, as XLA counts them.

XLA:CPU writes a matrix multiplication as ``dot``; the TPU compiler writes every one as a
``convolution`` inside a fusion, a batched one (attention's) with its batch dimensions as
spatial dimensions dilated so that each output position meets a single kernel position; XLA's
GPU backend calls cuBLAS (``__cublas$gemm`` / ``__cublas$lt$matmul`` custom calls, the dot's
dimension numbers in the backend config) or fuses a ``dot`` into a Triton kernel. A
convolution's count is XLA's own (``HloCostAnalysis``): only the (kernel, output) positions
that fall on an input element count, so a dilated or padded window costs what it computes.
"""

from __future__ import annotations

import math
import re

from flax_escale.sizing._hlo._text import Computation, Instruction, Module, elements

__all__ = ["flops"]

_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_WINDOW_FIELD = re.compile(r"(\w+)=([\dx_\-]+)")
_FEATURE_GROUPS = re.compile(r"feature_group_count=(\d+)")
_BATCH_GROUPS = re.compile(r"batch_group_count=(\d+)")


def flops(module: Module, computation: Computation, op: Instruction) -> float | None:
    """The FLOPs of ``op`` (in ``computation``) if it multiplies matrices; None otherwise.

    A ``dot``: ``2 * result size * contracted size``. A ``convolution`` (or a cuDNN one): as
    XLA counts it (see the module's notes). A cuBLAS call: as the ``dot`` it stands for.
    """
    target = op.custom_target or ""
    if op.opcode == "dot" or target.startswith("__cublas"):
        pattern = _CONTRACTING if op.opcode == "dot" else _GEMM_CONTRACTING
        dims = op.attribute(pattern)
        lhs = module.operand_shape(computation, op.operands[0]) if op.operands else None
        if lhs is None or dims is None:
            return 2.0 * elements(op.shape)
        picked = [int(d.strip('" ')) for d in dims.group(1).split(",") if d.strip('" ')]
        return 2.0 * elements(op.shape) * math.prod(lhs[d] for d in picked)
    if op.opcode == "convolution" or target.startswith("__cudnn$conv"):
        lhs, rhs = (module.operand_shape(computation, o) for o in op.operands[:2])
        out = module.operand_shape(computation, op.name)
        labels = op.attribute(_DIM_LABELS)
        if lhs is None or rhs is None or out is None or labels is None:
            return 2.0 * elements(op.shape)
        return _convolution(op, lhs, rhs, out, labels.groups())
    return None


def _convolution(
    op: Instruction, lhs: list[int], rhs: list[int], out: list[int], labels: tuple[str, ...]
) -> float:
    # Input features (per group) x output features x batch (per group) x, along each spatial
    # dimension, the (kernel, output) positions that fall on an input element.
    lhs_labels, rhs_labels, out_labels = labels
    if (len(lhs_labels), len(rhs_labels), len(out_labels)) != (len(lhs), len(rhs), len(out)):
        return 2.0 * math.prod(out)
    features = lhs[lhs_labels.index("f")] // _count(op, _FEATURE_GROUPS)
    batch = lhs[lhs_labels.index("b")] // _count(op, _BATCH_GROUPS)
    fma = features * out[out_labels.index("f")] * batch
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    for axis, window in zip(spatial, _window(op.attributes, len(spatial)), strict=True):
        sizes = (lhs[lhs_labels.index(axis)], rhs[rhs_labels.index(axis)])
        fma *= _valid_positions(*sizes, out[out_labels.index(axis)], *window)
    return 2.0 * fma


def _window(attributes: str, rank: int) -> list[tuple[int, int, int, int]]:
    # (stride, low padding, input dilation, kernel dilation) of each spatial dimension.
    found = _WINDOW.search(attributes)
    fields = dict(_WINDOW_FIELD.findall(found.group(1))) if found else {}

    def each(key: str, default: int) -> list[int]:
        text = fields.get(key)
        if text is None:
            return [default] * rank
        return [int(v.split("_")[0]) for v in text.split("x")]

    return list(
        zip(
            each("stride", 1),
            each("pad", 0),
            each("lhs_dilate", 1),
            each("rhs_dilate", 1),
            strict=True,
        )
    )


def _valid_positions(
    size: int, kernel: int, out: int, stride: int, low: int, base: int, dilation: int
) -> int:
    # Pairs (k, o), 0 <= k < kernel, 0 <= o < out, with o * stride + k * dilation - low equal
    # to base * i for an input position 0 <= i < size.
    limit = (size - 1) * base
    period = base // math.gcd(stride, base)
    count = 0
    for k in range(kernel):
        offset = k * dilation - low
        first = max(0, -(offset // stride))
        last = min(out - 1, (limit - offset) // stride)
        o = next(
            (o for o in range(first, first + period) if (o * stride + offset) % base == 0), None
        )
        if o is not None and o <= last:
            count += (last - o) // period + 1
    return count


def _count(op: Instruction, pattern: re.Pattern[str]) -> int:
    found = op.attribute(pattern)
    return int(found.group(1)) if found else 1
