"""The child side of tests/test_crash.py: runs the real CLI entry point in a process forked
from a forkserver that imported atom_convert (and torch) once, so that each of the many
killed conversions does not pay torch's import again. Kept in its own module because
multiprocessing imports the target function by name in the child."""

from __future__ import annotations

import os


def run_cli(argv: list[str], stderr_path: str, fault: str | None = None) -> None:
    """`atom-convert ARGV` with stderr into a file; exits with the CLI's code. `fault`: 'N:SIGNAME',
    the conversion sends itself SIGNAME once N shard bytes are written (tests/fault_launcher.py)."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    import fault_launcher

    fault_launcher.run_cli(argv, fault)
