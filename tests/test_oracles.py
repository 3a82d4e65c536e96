"""tests/oracles.py never touches the network: the aiter wheel comes from the cache folder that
`bash scripts/setup.sh --test` fills, and without it the tests that need it fail (never skip) saying so."""

from __future__ import annotations

import socket
import subprocess
import zipfile
from pathlib import Path

import pytest

import oracles


CALLS: list[tuple] = []


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder in place of the tests' one; every subprocess or socket connection is
    recorded in CALLS and refused."""
    CALLS.clear()

    def forbidden(*a, **k):
        CALLS.append(a)
        raise AssertionError(f"oracles started a process or opened a connection: {a!r}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)
    monkeypatch.delenv("ATOM_CONVERT_AITER_WHEEL", raising=False)
    monkeypatch.setattr(oracles, "CACHE", tmp_path / "cache")
    return tmp_path / "cache"


def test_a_missing_wheel_fails_and_says_to_run_setup(offline: Path) -> None:
    with pytest.raises(Exception) as e:
        oracles.aiter_wheel()
    assert CALLS == [], "aiter_wheel() tried to download the wheel (pip) instead of reading the cache"
    assert isinstance(e.value, oracles.OracleMissing)
    assert "bash scripts/setup.sh --test" in str(e.value) and str(offline / "wheels") in str(e.value)
    assert not isinstance(e.value, pytest.skip.Exception)
    assert not (offline / "wheels").exists()  # nothing was created, let alone downloaded
    with pytest.raises(oracles.OracleMissing, match="setup.sh --test"):  # what the `aiter` fixture calls
        oracles.load_aiter("_aiter_oracle_missing")


def test_the_cached_wheel_is_used_as_is(offline: Path) -> None:
    d = offline / "wheels"
    d.mkdir(parents=True)
    (d / "amd_aiter-0.1.6-py3-none-any.whl").write_bytes(b"")  # another version is not the one pinned
    with pytest.raises(oracles.OracleMissing):
        oracles.aiter_wheel()
    want = d / f"amd_aiter-{oracles.AITER_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(want, "w"):
        pass
    assert oracles.aiter_wheel() == want


def test_the_environment_variable_names_the_wheel(offline: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    w = tmp_path / "elsewhere.whl"
    monkeypatch.setenv("ATOM_CONVERT_AITER_WHEEL", str(w))
    with pytest.raises(oracles.OracleMissing, match="not a file"):
        oracles.aiter_wheel()
    w.write_bytes(b"")
    assert oracles.aiter_wheel() == w


def test_setup_downloads_the_wheel_into_the_cache_the_tests_read() -> None:
    sh = (Path(__file__).resolve().parent.parent / "scripts" / "setup.sh").read_text()
    assert "pip download" in sh and "oracles.wheel_dir()" in sh and "oracles.AITER_SPEC" in sh
