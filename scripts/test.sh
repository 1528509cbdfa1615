#!/usr/bin/env bash
# Quick start, command two: set up .venv with the test extras if needed, then run the whole
# test suite (extra args go to pytest). pytest exits non-zero when no test ran.
source "$(dirname "$0")/_env.sh" test
exec python -m pytest "$@"
