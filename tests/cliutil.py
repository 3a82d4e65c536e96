"""The in-process CLI runner and the leftovers check that the CLI, crash, error, MXFP4 and workers
tests share (hostile_util.run_cli is the variant without pytest's capture, for the hostile corpus)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atom_convert.cli import main


def run_cli(args: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`atom-convert ARGS` through the real entry point (exceptions mapped to exit codes as the
    installed script maps them); (exit code, stdout, stderr) of this call alone."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        main([str(a) for a in args])
    cap = capsys.readouterr()
    code = ei.value.code
    return (0 if code is None else code), cap.out, cap.err


def leftovers(dst: Path) -> list[str]:
    """The tool's own names beside DST (staging directory, lock file, replaced DST) left in its
    parent: none may outlive a run that ended, unless it says it kept them for a resume."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


class Shared:
    """An integer that a conversion's forked worker processes share with the test (shared memory):
    a test patches the writer in this process, the worker processes inherit the patch through the
    fork, and every count lands here, whichever process made it."""

    def __init__(self, value: int = 0):
        import multiprocessing

        self._v = multiprocessing.Value("q", value)

    def add(self, n: int = 1) -> int:
        """Add `n`; the new value (atomic across processes)."""
        with self._v.get_lock():
            self._v.value += n
            return int(self._v.value)

    def set(self, value: int) -> None:
        self._v.value = value

    @property
    def value(self) -> int:
        return int(self._v.value)
