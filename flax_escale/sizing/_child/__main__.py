"""The child process in which :func:`~flax_escale.sizing.plan_mesh` has more devices.

Started as ``python -m flax_escale.sizing._child`` with the request as JSON on standard
input; it stays on the CPU platform and, for a CPU target, gives itself the requested number of
simulated CPU devices before JAX starts,
builds the workload from its reference, and writes each event of the evaluation as one line of
standard output (prefixed, so that the workload's own prints pass through). The figures another
child already reported (one a compiler abort ended) come with the request, and are not
compiled again.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax

from flax_escale.errors import EscaleError
from flax_escale.sizing._child import EVENT_PREFIX, Request, evaluate_request
from flax_escale.sizing._factory import build_workload


def main() -> int:
    reference, request = Request.from_json(json.loads(sys.stdin.read()))
    # Before anything starts a backend: no accelerator is started, and a CPU target's devices
    # are what this process exists to have.
    jax.config.update("jax_platforms", "cpu")
    if request.target.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", request.target.device_count)

    def report(event: dict[str, Any]) -> None:
        print(EVENT_PREFIX + json.dumps(event), flush=True)

    try:
        evaluate_request(build_workload(reference), request, report)
    except EscaleError as error:  # one line for the caller to raise, not a traceback
        report({"event": "error", "type": type(error).__name__, "message": str(error)})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
