#!/usr/bin/env bash
# Builds the documentation site into docs/_build/html, warnings as errors as in CI: sets up
# .venv with the docs extra if needed (extra args go to sphinx-build).
source "$(dirname "$0")/_env.sh" docs
python -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
echo "Open file://$PWD/docs/_build/html/index.html"
