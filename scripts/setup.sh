#!/usr/bin/env bash
# Set up atom-convert in ./.venv (sees the system's packages, so a ROCm torch
# already installed is used as is). Installs torch 2.13.0 only when no torch
# imports. `--test` also installs the test tools and fetches the amd-aiter
# wheel whose pure-torch helpers the tests use as oracles.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -e ".[test]"
  python -c "import sys; sys.path.insert(0, 'tests'); import oracles; print('aiter oracle wheel:', oracles.aiter_wheel())"
else
  python -m pip install -q -e .
fi
python -c "import atom_convert, torch; print('atom-convert', atom_convert.__version__, 'with torch', torch.__version__)"
