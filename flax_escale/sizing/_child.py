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
from pathlib import Path
from typing import Any


def main() -> int:
    request = json.loads(sys.stdin.read())
    import jax

    from flax_escale.mesh import Target

    target = Target(**request["target"])
    # Before anything starts a backend: no accelerator is started, and a CPU target's devices
    # are what this process exists to have.
    jax.config.update("jax_platforms", "cpu")
    if target.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", target.device_count)

    from flax_escale.errors import EscaleError
    from flax_escale.sizing._evaluate import Figures, evaluate
    from flax_escale.sizing._plan_mesh import EVENT_PREFIX, _build, frozen_rules
    from flax_escale.sizing._profiles import HardwareProfile

    def report(event: dict[str, Any]) -> None:
        print(EVENT_PREFIX + json.dumps(event), flush=True)

    try:
        workload = _build(request["workload"])
        report({"event": "rules", "rules": frozen_rules(workload.rules)})
        evaluate(
            workload,
            target,
            memory_bytes=request["memory_bytes"],
            profile=HardwareProfile(**request["profile"]),
            exhaustive=request["exhaustive"],
            axes=request["axes"],
            time_budget=request["time_budget"],
            cache_dir=Path(request["cache_dir"]) if request["cache_dir"] else None,
            report=report,
            known=[Figures.from_json(f) for f in request.get("known", ())],
        )
    except EscaleError as error:  # one line for the caller to raise, not a traceback
        report({"event": "error", "type": type(error).__name__, "message": str(error)})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
