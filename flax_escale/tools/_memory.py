"""Will it fit: a program's per-device memory, read from the compiler before anything runs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flax_escale import _checks as check
from flax_escale._units import format_bytes
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import Target
from flax_escale.tools._reshardings import Resharding, compile_collecting, summarize

__all__ = ["MemoryEstimate", "will_it_fit"]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a compiled program, from ``compiled.memory_analysis()``.

    Attributes:
        argument_bytes: Inputs.
        output_bytes: Outputs.
        temp_bytes: Temporaries.
        alias_bytes: Outputs that reuse (donated) inputs.
        code_bytes: Generated code.
        device_bytes: The device's memory, if known.
        backend: The platform the program was compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``):
            temporaries depend on it. XLA's CPU backend materializes the random numbers of an
            initializer before transforming them, where an accelerator fuses them, so an init
            compiled for CPU needs temporaries an accelerator does not.
        reshardings: The arrays XLA's partitioner replicates in full to split them another
            way (its "involuntary full rematerialization" reports, collected instead of
            printed), each an all-gather the layout did not ask for; ``None`` when the program
            came already compiled, so that its compile was not seen.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    device_bytes: int | None
    backend: str = "unknown"
    reshardings: tuple[Resharding, ...] | None = None

    @property
    def peak_bytes(self) -> int:
        """Arguments, outputs and temporaries, counting aliased buffers once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the device's memory (``None`` if that is unknown)."""
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    def __str__(self) -> str:
        verdict = {None: "device memory unknown", True: "fits", False: "does NOT fit"}[self.fits]
        return (
            f"per {self.backend} device: arguments {format_bytes(self.argument_bytes)}, outputs "
            f"{format_bytes(self.output_bytes)}, temporaries {format_bytes(self.temp_bytes)}, "
            f"aliased {format_bytes(self.alias_bytes)} -> peak {format_bytes(self.peak_bytes)} "
            f"({verdict})" + (f"; {summarize(self.reshardings)}" if self.reshardings else "")
        )


def _jax_stage(fn: Any) -> Any:
    """JAX's own ``Lowered`` or ``Compiled`` inside a wrapper of one (``nnx.jit``'s), else ``fn``.

    ``nnx.jit(f).lower(...)`` and its ``.compile()`` are Flax's objects around JAX's, which they
    hold as ``.lowered`` and ``.compiled``; a wrapper is callable, so it would otherwise be taken
    for a function to trace.
    """
    for attribute, stage in (("compiled", jax.stages.Compiled), ("lowered", jax.stages.Lowered)):
        inner = getattr(fn, attribute, None)
        if not isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)) and isinstance(
            inner, stage
        ):
            return inner
    return fn


def will_it_fit(
    fn: Callable[..., Any] | jax.stages.Lowered | jax.stages.Compiled,
    *args: Any,
    device_bytes: int | None = None,
    target: str | Target | None = None,
    **kwargs: Any,
) -> MemoryEstimate:
    """Estimates a step's per-device memory before running it, by compiling it.

    Args:
        fn: A ``jax.jit`` function (lowered with ``*args``), a plain function (jitted first),
            or an already lowered or compiled program.
        *args: Example arguments (arrays or ``jax.ShapeDtypeStruct`` with shardings).
        device_bytes: The memory of one device; defaults to the target chip's, then to what
            the device reports, if any.
        target: Compile for other hardware than the arguments live on: a TPU slice such as
            ``"v5e-8"`` or a :class:`~flax_escale.mesh.Target` (``libtpu`` needed, no TPU). The
            arguments' ``NamedSharding`` meshes move onto a mesh of the target's devices with
            the same axes, so a step laid out on simulated CPU devices is measured as the TPU
            compiler builds it; the mesh must have the target's device count. With a program
            already lowered or compiled, only the target's memory is used.
        **kwargs: Keyword arguments for lowering.

    Returns:
        A :class:`MemoryEstimate`.

    Raises:
        EscaleTypeError: If ``fn`` is not a function (a name, say), is a Flax module class or
            a Linen module rather than a step, or cannot take ``*args`` and ``**kwargs``; or if
            ``device_bytes`` is not a positive int (``EscaleError`` for one below 1).
        EscaleError: If an argument's mesh does not have the target's device count, or
            ``libtpu`` is missing for a TPU target.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from flax_escale import batch_sharding, create_mesh, will_it_fit
        >>> rows = batch_sharding(create_mesh((1, 8, 1, 1, 1)), (1024, 256))  # 128 per device
        >>> x = jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=rows)
        >>> estimate = will_it_fit(lambda x: x * 2, x, device_bytes=1 << 20)
        >>> estimate.argument_bytes, estimate.output_bytes, estimate.fits
        (131072, 131072, True)
    """
    fn = _jax_stage(fn)
    if not isinstance(fn, (jax.stages.Compiled, jax.stages.Lowered)):
        check.callable_(fn, "fn", "pass the step function itself (or its jax.jit), not its name.")
        _check_step(fn, args, kwargs)
    if device_bytes is not None:
        device_bytes = check.positive_int(device_bytes, "device_bytes")
    if target is not None:
        target = Target.named(target)
        if device_bytes is None:
            device_bytes = target.memory_bytes
        if target.platform != "cpu":
            args, kwargs = _on_target((args, kwargs), target)
    reshardings = None
    if isinstance(fn, jax.stages.Compiled):
        compiled = fn
    else:
        if not isinstance(fn, jax.stages.Lowered):
            fn = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs)
        compiled, reshardings = compile_collecting(fn)
    analysis = compiled.memory_analysis()
    device = _device_of(compiled)
    if device_bytes is None:
        device_bytes = _bytes_limit(device)
    return MemoryEstimate(
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        temp_bytes=int(analysis.temp_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
        code_bytes=int(analysis.generated_code_size_in_bytes),
        device_bytes=device_bytes,
        backend=device.platform,
        reshardings=reshardings,
    )


def _check_step(fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    # Each would otherwise fail inside jax.jit's tracing, with errors that name no argument: a
    # module class "returns" an instance JAX cannot take, a Linen module is not bound, and a
    # function missing an argument is Python's TypeError.
    linen = isinstance(fn, nn.Module) or (isinstance(fn, type) and issubclass(fn, nn.Module))
    if linen or (isinstance(fn, type) and issubclass(fn, nnx.Module)):
        kind = ("Linen" if linen else "NNX") + (
            " module class" if isinstance(fn, type) else " module"
        )
        name = fn.__name__ if isinstance(fn, type) else type(fn).__name__
        example = (
            "lambda x: model.apply(variables, x)"
            if linen
            else "lambda model, x: model(x), with the built model among the arguments"
        )
        raise EscaleTypeError(
            f"fn must be the step function, got the {kind} {name}; pass a "
            f"function that runs it, e.g. {example}."
        )
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): lowering says what is wrong
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__name__", type(fn).__name__)
        keywords = f" and the keywords {', '.join(kwargs)}" if kwargs else ""
        raise EscaleTypeError(
            f"fn {name}{signature} cannot take the {len(args)} example argument(s){keywords} "
            f"given ({error}); pass the arguments it takes after it, as will_it_fit(fn, *args, "
            "**kwargs)."
        ) from None


def _device_of(compiled: jax.stages.Compiled) -> jax.Device:
    # A device the program runs on, from its shardings (the default device for none).
    for sharding in jax.tree.leaves((compiled.output_shardings, compiled.input_shardings)):
        if isinstance(sharding, jax.sharding.Sharding):
            return next(iter(sharding.device_set))
    return jax.devices()[0]


def _bytes_limit(device: jax.Device) -> int | None:
    # A device of a topology description (a TPU slice compiled for from elsewhere) is not
    # addressable, and JAX refuses to report its memory.
    try:
        stats = device.memory_stats() or {}
    except jax.errors.JaxRuntimeError:
        return None
    return stats.get("bytes_limit")


def _on_target(tree: Any, target: Target) -> Any:
    meshes: dict[Mesh, Mesh] = {}

    def moved(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return leaf
        mesh = sharding.mesh
        if mesh not in meshes:
            if mesh.size != target.device_count:
                raise EscaleError(
                    f"target {target.name!r} has {target.device_count} devices but an argument "
                    f"is laid out on a mesh of {mesh.size} ({dict(mesh.shape)}); lay the "
                    f"arguments out on a mesh of {target.device_count} devices."
                )
            meshes[mesh] = target.mesh(
                tuple(mesh.shape.values()), tuple(mesh.axis_names), axis_types=mesh.axis_types
            )
        return jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=NamedSharding(meshes[mesh], sharding.spec)
        )

    return jax.tree.map(moved, tree)
