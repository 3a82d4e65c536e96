"""The vLLM loader against real vLLM 0.27.1 (the version ATOM pins): tests/vllm_checks.py runs in the vLLM venv
that `scripts/setup.sh --test` makes beside the suite's (.venv-vllm; vLLM pins its own packages). Skipped only
where no vLLM can be imported: neither that venv nor this interpreter has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import atom_convert

ROOT = Path(__file__).resolve().parent.parent


def _vllm_python() -> str | None:
    for py in (ROOT / ".venv-vllm" / "bin" / "python", Path(sys.executable)):
        if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
            return str(py)
    return None


def test_loader_with_real_vllm(tiny_checkpoint, tmp_path):
    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not importable here (scripts/setup.sh --test installs it into .venv-vllm)")
    from glm_fixtures import build_glm
    from v32_fixtures import build_v32

    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    with_mtp, without = tmp_path / "mtp", tmp_path / "nomtp"
    atom_convert.convert(src, with_mtp, target="gfx950", profile="vllm-plugin")
    atom_convert.convert(src, without, target="gfx950", profile="vllm-plugin", mtp=False)
    # the sparse-attention families (DeepSeek-V3.2; GLM-5.2 with IndexShare's indexer-less layers), fp8, with MTP
    sparse = []
    for name, build in (("v32", lambda d: build_v32(d, fmt="fp8", seed=5)),
                        ("glm52", lambda d: build_glm(d, variant="glm52", fmt="fp8", seed=6))):
        sparse.append(tmp_path / f"{name}-plugin")
        atom_convert.convert(build(tmp_path / f"{name}-src"), sparse[-1], target="gfx950", profile="vllm-plugin")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    r = subprocess.run([py, str(ROOT / "tests" / "vllm_checks.py"), str(with_mtp), str(without), *map(str, sparse)],
                       capture_output=True, text=True, env=env, timeout=600)
    report = "\n".join(ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL", "vllm ")) or "passed" in ln)
    assert r.returncode == 0 and "11 passed, 0 failed" in r.stdout, report + "\n" + r.stderr[-3000:]
    assert "vllm 0.27.1" in r.stdout, report
