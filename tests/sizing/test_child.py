"""The child process's side of a plan: its reports, and an aborted child's compiler's last words."""

import io

import pytest
from rich.console import Console
from support.tiny_workloads import nnx_workload

from flax_escale.mesh import Target
from flax_escale.sizing import PROFILES
from flax_escale.sizing._child import Request, evaluate_request
from flax_escale.sizing._child import _parent as child_parent


@pytest.mark.parametrize(
    ("stderr", "words"),
    [
        (
            [
                "W1126 warned.cc:1] a warning\n",
                "F1126 ici.cc:42] Check failed: routing\n",
                "*** SIGABRT received by PID 7 ***\n",
                "PC: @ 0x0\n",
            ],
            "F1126 ici.cc:42] Check failed: routing",
        ),
        (
            ["tracing\n", "a line\n", "the last line\n", "*** SIGSEGV received ***\n", "@ 0x1\n"],
            "a line | the last line",
        ),
        ([], ""),
    ],
    ids=["fatal log line", "before the crash report", "silent"],
)
def test_an_aborted_childs_last_words_are_the_compilers_own(stderr, words):
    assert child_parent._last_words(stderr) == words


def test_the_child_reports_the_front_end_that_the_recommendation_is_written_for():
    # Planned in a child, the workload is built there: its Flax API comes back with its rules.
    events = []
    request = Request(
        Target.named("cpu", devices=2), 2**20, PROFILES["h100"], ("fsdp",), 0.0, False, None
    )
    evaluate_request(nnx_workload(), request, events.append)  # no time to compile: none is
    assert events[0] == {"event": "rules", "rules": None, "front_end": "nnx"}
    received = child_parent.Events(Console(file=io.StringIO()), False, 2, None)
    received(events[0])
    assert (received.rules, received.front_end) == (None, "nnx")
