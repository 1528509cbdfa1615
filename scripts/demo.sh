#!/usr/bin/env bash
# Quick start, command one: set up .venv if needed, then run the main job (extra args go to it).
source "$(dirname "$0")/_env.sh" ""
exec python examples/train_lm.py "$@"
