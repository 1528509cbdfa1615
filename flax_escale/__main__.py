"""``python -m flax_escale``: the library's command line.

Subcommands:

- ``launch``: run a script as several processes of one job on this machine
  (:mod:`flax_escale.tools._launch`).
- ``plan``: rank the meshes of N devices for a workload by memory and estimated step time
  (:func:`flax_escale.planning.plan_mesh`).
- ``report``: the sharding report of a workload's parameters and optimizer state on one mesh,
  printed and written as a web page (:func:`flax_escale.sharding_report`).

Each subcommand is a function that adds its arguments to a subparser and sets ``run``, the
function that carries it out and returns the exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Sequence

import jax
from jax.sharding import Mesh
from rich.console import Console

from flax_escale import _checks as check
from flax_escale import planning
from flax_escale.errors import EscaleError
from flax_escale.mesh import DEFAULT_AXIS_NAMES, create_mesh, parse_mesh_shape
from flax_escale.planning import PROFILES
from flax_escale.planning._plan import _build
from flax_escale.planning._state_plan import train_state_plan
from flax_escale.tools import _launch, sharding_report


def _add_launch(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a script as several processes of one job on this machine",
        description=(
            "Start PROCESSES copies of a Python script (or module) on this machine, on "
            "loopback, with what initialize_distributed() needs in their environment "
            "(FLAX_ESCALE_COORDINATOR_ADDRESS, FLAX_ESCALE_NUM_PROCESSES, "
            "FLAX_ESCALE_PROCESS_ID) and DEVICES_PER_PROCESS simulated CPU devices each "
            "(JAX_PLATFORMS=cpu). Output lines are prefixed with the rank; SIGINT and SIGTERM "
            "are passed on; the first failure stops the others and gives the exit code."
        ),
    )
    parser.add_argument("--processes", type=int, default=2, help="how many (default 2)")
    parser.add_argument(
        "--devices-per-process", type=int, default=4, help="simulated CPU devices (default 4)"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds a process gets to exit after SIGTERM before it is killed (default 5)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)"
    )
    parser.add_argument("script", help="the Python script (or, with -m, module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    program = ["-m", args.script] if args.module else [args.script]
    return _launch.launch(
        [sys.executable, *program, *args.args],
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace=args.grace,
    )


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank the meshes of N devices for a workload by memory and step time",
        description=(
            "Compile the workload that FACTORY returns (a flax_escale.planning.Workload) on "
            "every candidate mesh of DEVICES simulated CPU devices (or of a TPU slice, with "
            "the TPU compiler: --target v5p-128), ahead of time, and print "
            "the meshes ranked: per-device peak memory against the budget, collective bytes "
            "per step, estimated step time on the hardware profile, and the create_mesh call "
            "of the best one."
        ),
    )
    parser.add_argument("workload", metavar="MODULE:FACTORY", help="e.g. my_models:workload")
    parser.add_argument(
        "--devices", type=int, default=None, help="devices to plan for (a TPU slice: its chips)"
    )
    parser.add_argument(
        "--target",
        default="cpu",
        help="whose compiler: cpu (simulated devices, the default), a TPU slice such as "
        "v5e-256 or v5p-128, or a topology such as v5e:2x4 (needs libtpu, no TPU)",
    )
    parser.add_argument(
        "--slices", type=int, default=1, help="TPU slices over DCN, dp spanning them"
    )
    parser.add_argument(
        "--memory", default=None, help="per-device budget, like 16GiB (default: the profile's)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help=f"hardware profile: {', '.join(PROFILES)} (default: the TPU's, else h100)",
    )
    parser.add_argument("--flops", type=float, help="custom profile: peak FLOP/s per device")
    parser.add_argument(
        "--bandwidth", type=float, help="custom profile: interconnect bytes/s per device"
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="custom profile: seconds per collective"
    )
    parser.add_argument(
        "--memory-bandwidth", type=float, help="custom profile: memory bytes/s per device"
    )
    parser.add_argument("--axes", default=None, help="mesh axes to plan over, like dp,fsdp,tp")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds to compile for")
    parser.add_argument("--top", type=int, default=None, help="rows to show (default all)")
    parser.add_argument("--no-cache", action="store_true", help="compile every candidate again")
    parser.add_argument(
        "--exhaustive",
        action="store_true",
        help="compile every mesh, even those their textbook communication rules out",
    )
    parser.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    profile: str | planning.HardwareProfile | None = args.profile
    if args.flops is not None or args.bandwidth is not None:
        if args.flops is None or args.bandwidth is None:
            raise EscaleError("plan: a custom profile needs both --flops and --bandwidth.")
        profile = planning.HardwareProfile(
            "custom",
            args.flops,
            args.bandwidth,
            args.latency,
            memory_bytes_per_second=args.memory_bandwidth,
        )
    if args.top is not None:
        check.positive_int(args.top, "--top")
    # Wide enough for the table when the output is a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 160)
    plan = planning.plan_mesh(
        args.workload,
        devices=args.devices,
        target=args.target,
        slices=args.slices,
        memory=args.memory,
        profile=profile,
        axes=args.axes.split(",") if args.axes else None,
        time_budget=args.time_budget,
        exhaustive=args.exhaustive,
        cache=not args.no_cache,
        progress=Console(stderr=True),
    )
    console.print(plan.table(args.top))
    console.print(plan.recommendation(), markup=False, highlight=False)
    console.print(planning.ESTIMATE_TERMS, style="dim", highlight=False)
    return 0 if plan.best is not None else 1


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="the sharding report of a workload's parameters and optimizer state on one mesh",
        description=(
            "Plan the train state of the workload that FACTORY returns (a "
            "flax_escale.planning.Workload) on MESH, without allocating or compiling anything: "
            "print the table of every array (parameters, optimizer state as the training step "
            "holds it), and with --html write the report as a self-contained web page. With "
            "--baseline-mesh, also list the arrays whose layout differs on that mesh."
        ),
    )
    parser.add_argument("workload", metavar="MODULE:FACTORY", help="e.g. my_models:workload")
    mesh_help = (
        f"axis sizes, named (dp:1,fsdp:4,tp:2; an axis of {','.join(DEFAULT_AXIS_NAMES)} left "
        "out has size 1) or in that order (1,4,1,2,1); one size may be -1"
    )
    parser.add_argument("--mesh", required=True, help=mesh_help)
    parser.add_argument("--html", default=None, help="also write the report to this web page")
    parser.add_argument(
        "--baseline-mesh", default=None, help="compare with the plan on this mesh (same form)"
    )
    parser.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    mesh = _mesh_of(args.mesh)
    baseline_mesh = None if args.baseline_mesh is None else _mesh_of(args.baseline_mesh)
    workload = _build(args.workload)
    plan = train_state_plan(workload, mesh)
    baseline = None if baseline_mesh is None else train_state_plan(workload, baseline_mesh)
    console = Console(width=None if sys.stdout.isatty() else 160)
    sharding_report(plan, console=console, html=args.html, baseline=baseline)
    if args.html is not None:
        console.print(f"wrote {args.html}", markup=False, highlight=False)
    return 0


def _mesh_of(text: str) -> Mesh:
    """The mesh a ``--mesh`` string describes, over the library's axes."""
    sizes, names = parse_mesh_shape(text, DEFAULT_AXIS_NAMES, partial=True)
    if all(size > 0 for size in sizes) and "JAX_NUM_CPU_DEVICES" not in os.environ:
        # Nothing is compiled: without accelerators, the mesh is as many simulated CPU
        # devices as it needs. Once JAX's backend has started its devices stand as they are.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", math.prod(sizes))
    return create_mesh(sizes, names)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m flax_escale``, with one subparser per subcommand.

    Returns:
        The parser; ``parse_args(...).run(args)`` carries out the chosen subcommand.
    """
    parser = argparse.ArgumentParser(
        prog="python -m flax_escale", description=__doc__.split("\n")[0].replace("``", "")
    )
    subparsers = parser.add_subparsers(title="subcommands", dest="command", required=True)
    _add_launch(subparsers)
    _add_plan(subparsers)
    _add_report(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: The arguments after ``python -m flax_escale`` (``sys.argv[1:]`` when ``None``).

    Returns:
        The exit code.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:  # the library's errors, or a program not found
        print(f"python -m flax_escale {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
