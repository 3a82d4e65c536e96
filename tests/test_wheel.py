"""The package as a wheel installs it (`pip install .`, not `-e`): built from a copy of the source, installed
into a fresh venv, run from there.

The venv is plain (no system site packages, no pip); the wheel goes in with this suite's pip
(`pip --python NEW/bin/python install --no-deps --no-index`), and the dependencies come from this suite's
site-packages folders, listed in a .pth file. Listed there, those folders' own .pth files are not run, so
the editable install's finder (`__editable__.atom_convert-*.pth`) never is: `atom_convert` can only come
from the wheel, which the test asserts (`atom_convert.__file__` in the venv, not under the repository),
and it runs with the working directory outside the repository and no PYTHONPATH. No network.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import json, sys
from importlib.metadata import distribution, entry_points
import atom_convert
from atom_convert import synth
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "atom_convert"]
fn = eps[0].load() if len(eps) == 1 else None
print(json.dumps({
    "file": atom_convert.__file__,
    "config_dir": str(synth.CONFIG_DIR),
    "presets": sorted(p.name for p in synth.CONFIG_DIR.glob("*.json")),
    "preset_hidden": synth.load_preset("tiny-deepseek-v3")["hidden_size"],
    "eps": [e.value for e in eps],
    "ep_dist": str(eps[0].dist.locate_file("")) if eps and eps[0].dist is not None else None,
    "dist": str(distribution("atom-convert").locate_file("")),
    "fn": f"{fn.__module__}:{fn.__qualname__}" if fn else None,
}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of the source tree installed; returns the venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: the build writes build/ and *.egg-info, which must not land in the shared tree
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    shutil.copytree(ROOT / "atom_convert", src / "atom_convert", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              "-w", str(wheels), str(src)])
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("atom_convert-*.whl")
    venv = tmp / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert r.returncode == 0, r.stdout + r.stderr
    py = venv / "bin" / "python"
    r = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
              str(wheel)])
    assert r.returncode == 0, r.stdout + r.stderr
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_suite_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    return venv


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.pop("VIRTUAL_ENV", None)
    return env


def test_installed_wheel_is_what_runs(installed: Path, tmp_path: Path) -> None:
    import json

    r = _run([str(installed / "bin" / "python"), "-c", CHECK], cwd=tmp_path, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    venv = installed.resolve()
    for key in ("file", "config_dir", "ep_dist", "dist"):
        p = Path(got[key]).resolve()
        assert p.is_relative_to(venv), f"{key} {p} is not inside the installed venv {venv}"
        assert not p.is_relative_to(ROOT), f"{key} {p} is under the repository: the source tree ran, not the wheel"
    assert got["presets"] == sorted(p.name for p in (ROOT / "atom_convert" / "configs").glob("*.json"))
    assert "tiny-deepseek-v3.json" in got["presets"] and got["preset_hidden"] > 0
    assert got["eps"] == ["atom_convert.runtime.vllm_plugin:register"]
    assert got["fn"] == "atom_convert.runtime.vllm_plugin:register"


def test_installed_wheel_runs_the_demo(installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = _run([str(installed / "bin" / "atom-convert"), "demo", str(out)], cwd=tmp_path, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "OK", r.stdout
    assert any((out / "converted").rglob("*.safetensors"))
