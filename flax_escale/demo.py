"""The main job: build a device mesh on simulated CPU devices and show it.

Run ``python -m flax_escale.demo --help`` for the options. With none it simulates 8 CPU devices
and builds the default escale mesh (every device on ``fsdp``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from flax_escale.mesh import DEFAULT_AXIS_NAMES, parse_mesh_from_string

__all__ = ["describe_mesh", "main"]


def describe_mesh(mesh: Mesh) -> str:
    """Renders a mesh as text: its axes with sizes and types, then its device ids.

    Example:
        >>> print(describe_mesh(create_mesh((2, 4), ("dp", "tp"))))
        mesh dp=2 (Auto), tp=4 (Auto) on 8 cpu devices
        device ids:
        [[0 1 2 3]
         [4 5 6 7]]
    """
    axes = ", ".join(
        f"{name}={size} ({kind.name})"
        for (name, size), kind in zip(mesh.shape.items(), mesh.axis_types, strict=True)
    )
    platform = mesh.devices.flat[0].platform
    return f"mesh {axes} on {mesh.size} {platform} devices\ndevice ids:\n{mesh.device_ids}"


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the command line, simulates the CPU devices and prints the mesh."""
    parser = argparse.ArgumentParser(prog="python -m flax_escale.demo", description=__doc__)
    parser.add_argument(
        "--devices", type=int, default=8, help="number of simulated CPU devices (default 8)"
    )
    parser.add_argument(
        "--mesh",
        default="1,-1,1,1,1",
        help="mesh sizes of dp,fsdp,ep,tp,sp, positional ('1,-1,1,2,1') or named "
        "('dp:1,fsdp:4,ep:1,tp:2,sp:1'); -1 takes the remaining devices",
    )
    parser.add_argument(
        "--axis-types", default="auto", choices=["auto", "explicit"], help="mesh axis type"
    )
    args = parser.parse_args(argv)
    # The device count can only change before JAX starts its backend (in-process callers such as
    # tests may already have started it with the same count).
    if jax.config.jax_num_cpu_devices != args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = parse_mesh_from_string(
        args.mesh, DEFAULT_AXIS_NAMES, axis_types=args.axis_types, backend="cpu"
    )
    print(describe_mesh(mesh))


if __name__ == "__main__":
    main()
