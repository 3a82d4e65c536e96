#!/usr/bin/env bash
# Set up atom-convert in ./.venv (sees the system's packages, so a ROCm torch
# already installed is used as is). Installs torch 2.13.0 only when no torch
# imports. `--test` also installs the test tools and downloads the amd-aiter
# wheel whose pure-torch helpers the tests use as oracles (into
# ~/.cache/atom-convert-tests/wheels/, or $ATOM_CONVERT_TEST_CACHE/wheels/).
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
  # The aiter oracle wheel, downloaded here once into the cache tests/oracles.py reads (the tests never
  # touch the network; without it they fail saying to run this). $ATOM_CONVERT_AITER_WHEEL overrides it.
  ORACLES="import sys; sys.path.insert(0, 'tests'); import oracles"
  if [ -z "${ATOM_CONVERT_AITER_WHEEL:-}" ] && ! python -c "$ORACLES; sys.exit(oracles.cached_aiter_wheel() is None)"; then
    python -m pip download --no-deps -q -d "$(python -c "$ORACLES; print(oracles.wheel_dir())")" \
      "$(python -c "$ORACLES; print(oracles.AITER_SPEC)")"
  fi
  python -c "$ORACLES; print('aiter oracle wheel:', oracles.aiter_wheel())"
  # Real vLLM for the vLLM loader's tests, in a venv of its own (it pins its own torch and packages):
  # the version ATOM pins. Its CUDA-only torchvision/torchaudio/torchcodec are removed (they break imports
  # on a CPU machine); vLLM's loader, configs and distributed groups need none of them.
  if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q "vllm==0.27.1"
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  .venv-vllm/bin/python -m pip install -q --no-deps -e .
  .venv-vllm/bin/python -m pip install -q "xxhash>=3.0"  # ours that vLLM does not bring (pyproject.toml)
  .venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in .venv-vllm')"
else
  python -m pip install -q -e .
fi
python -c "import atom_convert, torch; print('atom-convert', atom_convert.__version__, 'with torch', torch.__version__)"
