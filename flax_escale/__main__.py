"""``python -m flax_escale``: the library's command line.

Subcommands:

- ``launch``: run a script as several processes of one job on this machine
  (:mod:`flax_escale.tools._launch`).
- ``plan``: rank the meshes of N devices for a workload by memory and estimated step time
  (:func:`flax_escale.sizing.plan_mesh`).
- ``report``: the sharding report of a workload's parameters and optimizer state on one mesh,
  printed and written as a web page (:func:`flax_escale.sharding_report`).

Each subcommand is a row of ``_SUBCOMMANDS``: a function that adds its arguments to its
subparser, ``run``, the function that carries it out and returns the exit code (the body of
its docstring is the subcommand's description), and the one-line help. Every error names the
option (or argument) it concerns, in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh
from rich.console import Console

from flax_escale import _checks as check
from flax_escale import sizing
from flax_escale._specs import mesh_text
from flax_escale.errors import EscaleError, MeshError
from flax_escale.mesh import DEFAULT_AXIS_NAMES, Target, create_mesh, parse_mesh_shape
from flax_escale.mesh._target import MAX_SIMULATED_DEVICES
from flax_escale.sizing import PROFILES
from flax_escale.sizing._candidates import checked_axes
from flax_escale.sizing._factory import build_workload
from flax_escale.sizing._state_plan import train_state_plan
from flax_escale.tools import _launch, sharding_report
from flax_escale.tools._caught import catching_corrections, corrections_table


def _add_launch(parser: argparse.ArgumentParser) -> None:
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


@contextlib.contextmanager
def _options(names: dict[str, str], flag: str | None = None) -> Iterator[None]:
    """Library errors raised inside name the command-line options they concern.

    A message begins with the Python argument it concerns (``"profile: ..."``, ``"mesh string
    'x': ..."``); where ``names`` maps that argument to an option, the option takes its place.
    Any other message is prefixed with ``flag``, when given.
    """
    try:
        yield
    except EscaleError as error:
        message = str(error)
        for argument, option in names.items():
            rest = message[len(argument) :]
            if message.startswith(argument) and rest[:1] in (" ", ":", "="):
                message = option + rest
                break
        else:
            if flag is None:
                raise
            message = f"{flag}: {message}"
        raise type(error)(message) from error


def _run_launch(args: argparse.Namespace) -> int:
    """Runs a script as several processes of one job on this machine.

    Start PROCESSES copies of a Python script (or module) on this machine, on loopback, with
    what initialize_distributed() needs in their environment (FLAX_ESCALE_COORDINATOR_ADDRESS,
    FLAX_ESCALE_NUM_PROCESSES, FLAX_ESCALE_PROCESS_ID) and DEVICES_PER_PROCESS simulated CPU
    devices each (JAX_PLATFORMS=cpu). Output lines are prefixed with the rank; SIGINT and
    SIGTERM are passed on; the first failure stops the others and gives the exit code.
    """
    program = ["-m", args.script] if args.module else [args.script]
    arguments = ("processes", "devices_per_process", "port", "grace")
    with _options({name: "--" + name.replace("_", "-") for name in arguments}):
        return _launch.launch(
            [sys.executable, *program, *args.args],
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            grace=args.grace,
        )


def _add_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", metavar="MODULE:FACTORY", help="e.g. my_models:workload")
    parser.add_argument(
        "--devices", type=int, default=None, help="devices to plan for (a TPU/GPU target: its own)"
    )
    parser.add_argument(
        "--target",
        default="cpu",
        help="whose compiler: cpu (simulated devices, the default), a TPU slice such as "
        "v5e-256 or v5p-128, or a topology such as v5e:2x4 (needs libtpu, no TPU), or GPUs "
        "such as h100-8 (simulated devices with the GPU's memory and profile)",
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
        help=f"hardware profile: {', '.join(PROFILES)} (default: the target's, else h100)",
    )
    parser.add_argument("--flops", type=float, help="custom profile: peak FLOP/s per device")
    parser.add_argument(
        "--bandwidth", type=float, help="custom profile: interconnect bytes/s per device"
    )
    parser.add_argument(
        "--latency", type=float, default=None, help="custom profile: seconds per collective (0)"
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


def _run_plan(args: argparse.Namespace) -> int:
    """Ranks the meshes of N devices for a workload by memory and step time.

    Compile the workload that FACTORY returns (a flax_escale.sizing.Workload) on every
    candidate mesh of DEVICES simulated CPU devices (or of a TPU slice, with the TPU compiler:
    --target v5p-128; GPUs are simulated CPU devices with the GPU's memory and profile:
    --target h100-8), ahead of time, and print the meshes ranked: per-device peak memory
    against the budget, collective bytes per step, estimated step time on the hardware
    profile, and the create_mesh call of the best one.
    """
    # Every option is checked here, under its own name, before the workload is built.
    if args.devices is not None:
        check.positive_int(args.devices, "--devices")
    check.positive_int(args.slices, "--slices")
    if args.target == "cpu" and args.devices is None:
        raise EscaleError(
            "--target cpu (the default) simulates devices: pass --devices N, such as --devices 8."
        )
    names = {"target": "--target", "devices": "--devices", "slices": "--slices"}
    with _options(names, "--target"):
        target = Target.named(args.target, devices=args.devices, slices=args.slices)
    profile = _profile(args)
    memory = None if args.memory is None else sizing.parse_bytes(args.memory, "--memory")
    axes = None
    if args.axes is not None:
        axes = checked_axes([a.strip() for a in args.axes.split(",")], "--axes")
    if args.time_budget is not None:
        check.non_negative_number(args.time_budget, "--time-budget")
    if args.top is not None:
        check.positive_int(args.top, "--top")
    # Wide enough for the table when the output is a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 160)
    plan = sizing.plan_mesh(
        args.workload,
        target=target,
        memory=memory,
        profile=profile,
        axes=axes,
        time_budget=args.time_budget,
        exhaustive=args.exhaustive,
        cache=not args.no_cache,
        progress=Console(stderr=True),
    )
    console.print(plan.table(args.top))
    console.print(plan.recommendation(), markup=False, highlight=False)
    console.print(sizing.ESTIMATE_TERMS, style="dim", highlight=False)
    return 0 if plan.best is not None else 1


def _profile(args: argparse.Namespace) -> sizing.HardwareProfile | None:
    """The hardware profile the options describe: named, custom, or ``None`` (the default)."""
    custom = {
        "--flops": args.flops,
        "--bandwidth": args.bandwidth,
        "--latency": args.latency,
        "--memory-bandwidth": args.memory_bandwidth,
    }
    given = [flag for flag, value in custom.items() if value is not None]
    if not given:
        if args.profile is None:
            return None
        with _options({"profile": "--profile"}, "--profile"):
            return sizing.hardware_profile(args.profile)
    if args.profile is not None:
        raise EscaleError(
            f"--profile {args.profile} and {', '.join(given)} both describe the hardware, and "
            "one would be ignored: give --profile alone, or a custom profile with --flops and "
            "--bandwidth (and --latency, --memory-bandwidth)."
        )
    if args.flops is None or args.bandwidth is None:
        raise EscaleError(
            f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for a custom profile, "
            "which needs both --flops and --bandwidth; give them, or name a built-in profile "
            f"with --profile ({', '.join(PROFILES)})."
        )
    for flag in ("--flops", "--bandwidth", "--memory-bandwidth"):
        if custom[flag] is not None:
            check.positive_number(custom[flag], flag)
    latency = 0.0 if args.latency is None else check.non_negative_number(args.latency, "--latency")
    return sizing.HardwareProfile(
        "custom",
        args.flops,
        args.bandwidth,
        latency,
        memory_bytes_per_second=args.memory_bandwidth,
    )


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", metavar="MODULE:FACTORY", help="e.g. my_models:workload")
    mesh_help = (
        f"axis sizes, named (dp:1,fsdp:4,tp:2; an axis of {','.join(DEFAULT_AXIS_NAMES)} left "
        "out has size 1) or in that order (1,4,1,2,1); one size may be -1; at most "
        f"{MAX_SIMULATED_DEVICES} devices"
    )
    parser.add_argument("--mesh", required=True, help=mesh_help)
    parser.add_argument("--html", default=None, help="also write the report to this web page")
    parser.add_argument(
        "--baseline-mesh", default=None, help="compare with the plan on this mesh (same form)"
    )


def _run_report(args: argparse.Namespace) -> int:
    """Prints the sharding report of a workload's train state on one mesh.

    Plan the train state of the workload that FACTORY returns (a flax_escale.sizing.Workload)
    on MESH, without allocating or compiling anything: print the table of every array
    (parameters, optimizer state as the training step holds it), and with --html write the
    report as a self-contained web page. With --baseline-mesh, also list the arrays whose
    layout differs on that mesh. What planning corrects is shown, not warned: an array's
    correction in the table's notes, an activation constraint's in a table below it (its file
    relative to the working folder). The table fits the terminal, or COLUMNS (160 in a log).
    """
    # Both strings are checked before either mesh starts JAX's devices.
    shapes = [(flag, _shape_of(text, flag)) for flag, text in _meshes(args)]
    meshes = [_mesh_of(shape, flag) for flag, shape in shapes]
    # What tracing corrects is said in the table's notes and below it, not as warnings.
    with catching_corrections() as found:
        workload = build_workload(args.workload)
        plan = train_state_plan(workload, meshes[0])
    baseline = None
    if len(meshes) > 1:
        with catching_corrections():  # the baseline's own corrections show in the diff
            baseline = train_state_plan(workload, meshes[1])
    # A terminal's width, or the COLUMNS a log asks for; 160 for a log that says nothing.
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(width=None if wide else 160)
    with _options({"html": "--html"}):
        report = sharding_report(plan, show=False, html=args.html, baseline=baseline)
    console.print(report.table())
    paths = {e.path for e in plan}
    constraints = [c for c in found if c.path not in paths]
    if constraints:
        title = (
            f"{len(constraints)} activation constraint(s) corrected while tracing the step on "
            f"mesh ({mesh_text(plan.mesh.shape)}); the arrays' own corrections are in the "
            "notes above"
        )
        console.print(corrections_table(constraints, title))
    if baseline is not None:
        console.print(baseline.diff(plan).table())
    if args.html is not None:
        console.print(f"wrote {args.html}", markup=False, highlight=False)
    return 0


def _meshes(args: argparse.Namespace) -> list[tuple[str, str]]:
    given = [("--mesh", args.mesh), ("--baseline-mesh", args.baseline_mesh)]
    return [(flag, text) for flag, text in given if text is not None]


def _shape_of(text: str, flag: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The sizes and names a ``--mesh`` string gives, over the library's axes, checked."""
    with _options({"mesh string": flag}, flag):
        sizes, names = parse_mesh_shape(text, DEFAULT_AXIS_NAMES, partial=True)
    # Said before JAX is asked for that many simulated devices (a process of 100,000 of them
    # runs out of memory before anything is planned); the planner has the same limit.
    count = math.prod(size for size in sizes if size > 0)
    if count > MAX_SIMULATED_DEVICES:
        raise MeshError(
            f"{flag} {text!r} asks for {count} devices, more than the {MAX_SIMULATED_DEVICES} "
            "one host simulates for a report; give a mesh of at most "
            f"{MAX_SIMULATED_DEVICES} devices."
        )
    return sizes, names


def _mesh_of(shape: tuple[tuple[int, ...], tuple[str, ...]], flag: str) -> Mesh:
    """The mesh of checked sizes and names, of simulated CPU devices where JAX has not started."""
    sizes, names = shape
    if all(size > 0 for size in sizes) and "JAX_NUM_CPU_DEVICES" not in os.environ:
        # Nothing is compiled: without accelerators, the mesh is as many simulated CPU
        # devices as it needs. Once JAX's backend has started its devices stand as they are.
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", math.prod(sizes))
    with _options({}, flag):
        return create_mesh(sizes, names)


_Run = Callable[[argparse.Namespace], int]

_SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], _Run, str]] = {
    "launch": (
        _add_launch,
        _run_launch,
        "run a script as several processes of one job on this machine",
    ),
    "plan": (
        _add_plan,
        _run_plan,
        "rank the meshes of N devices for a workload by memory and step time",
    ),
    "report": (
        _add_report,
        _run_report,
        "the sharding report of a workload's parameters and optimizer state on one mesh",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m flax_escale``, with one subparser per subcommand.

    Returns:
        The parser; ``parse_args(...).run(args)`` carries out the chosen subcommand.
    """
    parser = argparse.ArgumentParser(
        prog="python -m flax_escale", description=__doc__.split("\n")[0].replace("``", "")
    )
    subparsers = parser.add_subparsers(title="subcommands", dest="command", required=True)
    for name, (add_arguments, run, help_line) in _SUBCOMMANDS.items():
        description = inspect.cleandoc(run.__doc__).partition("\n\n")[2]
        subparser = subparsers.add_parser(name, help=help_line, description=description)
        add_arguments(subparser)
        subparser.set_defaults(run=run)
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
