"""The child process's side of a plan: what an aborted child's compiler said last."""

import pytest

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
