"""The few places where the library relies on JAX's or Flax's internals, kept together.

Each entry says why it is needed and which public API would replace it.
"""

from __future__ import annotations

from typing import Any

from flax.core import spmd as _flax_spmd
from jax.sharding import Mesh

__all__ = [
    "compiled_devices",
    "coordination_client",
    "jax_cluster_env",
    "jax_trace_context",
    "legacy_mesh",
    "rules_context_is_set",
]


class _NoRulesSet(tuple):
    """Flax's default (empty) logical-axis rules, told apart from rules set to be empty."""

    __slots__ = ()


_UNSET = _NoRulesSet()


def _mark_flax_default_rules() -> None:
    # Flax keeps its logical-axis rules in a thread-local whose default is the empty tuple, and
    # `with nn.logical_axis_rules(()):` sets the same empty tuple: by value, "no rules set" and
    # "rules set to none" cannot be told apart. Making the default an empty tuple of our own
    # type (Flax reads it as the empty tuple it was) tells them apart. Flax has no public way to
    # ask whether a rules context is active; when it gets one, use it here instead.
    _flax_spmd._AxisRules.rules = _UNSET
    # The class is a dataclass on a threading.local: each new thread runs its __init__, whose
    # default must be the marker too.
    _flax_spmd._AxisRules.__init__.__defaults__ = (_UNSET,)
    current = _flax_spmd._axis_rules.__dict__
    if current.get("rules", _UNSET) == ():
        current["rules"] = _UNSET


def rules_context_is_set() -> bool:
    """Whether Flax's logical-axis rules were set (``nn.logical_axis_rules``), even to ``()``."""
    return not isinstance(_flax_spmd.get_logical_axis_rules(), _NoRulesSet)


_mark_flax_default_rules()


def legacy_mesh() -> Mesh | None:
    """The mesh entered with the deprecated ``with mesh:``, or ``None``."""
    # The context is deprecated and has no public getter any more (the pxla alias warns), but
    # users still enter meshes that way. Its public replacement is `jax.set_mesh`, whose mesh
    # `jax.sharding.get_abstract_mesh()` / `jax.sharding.get_mesh()` return: once jax removes
    # `with mesh:`, this function and its callers' fallback go.
    try:
        from jax._src.mesh import thread_resources
    except ImportError:
        return None
    mesh = thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def coordination_client() -> Any:
    """``jax.distributed``'s coordination-service client (its key-value store), or ``None``."""
    # The coordination service's key-value store is the only cross-process channel that needs
    # no device collective, and jax has no public API for it yet (multihost_utils offers only
    # device collectives); replace this with a public key-value API of jax.distributed once
    # there is one.
    from jax._src import distributed

    return distributed.global_state.client


def jax_cluster_env() -> Any:
    """The base class of JAX's cluster environments, whose subclasses are registered in it.

    ``None`` if JAX moved it: then nothing is detected through JAX.
    """
    # JAX has no public way to ask what `jax.distributed.initialize()` would detect, so this
    # reads its registry (unchanged from jax 0.8.1 to 0.11); tests compare the answers with
    # JAX's. Replace with a public cluster-detection API of jax.distributed once there is one.
    try:
        from jax._src import clusters

        clusters.ClusterEnv._cluster_types  # noqa: B018 (the registry the caller reads)
    except (ImportError, AttributeError):
        return None
    return clusters.ClusterEnv


def jax_trace_context() -> Any:
    """The JAX configuration a traced program depends on, as a hashable value (``None`` if none).

    ``jax.jit`` keys its own caches on it (``jax_enable_x64``, the PRNG implementation, default
    matmul precision and the rest), so a cache of compiled programs must too.
    """
    # JAX has no public way to ask which of its settings a trace depends on; this is the value
    # its jit caches use. Replace it with a public one once JAX has it.
    try:
        from jax._src.config import trace_context
    except ImportError:
        return None
    return trace_context()


def compiled_devices(lowered: Any) -> str:
    """The platform and device kinds a lowered program compiles for (``"tpu: TPU v5 lite"``).

    A program's text names neither, and two targets (XLA:CPU, a TPU slice) can lower the same
    text. ``jax.stages.Lowered`` has no public attribute for them; its compile arguments do.
    A JAX whose ``Lowered`` keeps them elsewhere gives ``"unknown"``: XLA:CPU and TPU
    programs of one text then share a key.
    """
    arguments = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if not isinstance(arguments, dict) or "backend" not in arguments:
        return "unknown"
    kinds = {
        device.device_kind
        for sharding in (*arguments.get("in_shardings", ()), *arguments.get("out_shardings", ()))
        for device in getattr(sharding, "device_set", ())
    }
    return f"{arguments['backend'].platform}: {', '.join(sorted(kinds))}"
