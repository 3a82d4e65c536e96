"""Test-side fault injection for the crash tests: a conversion killed or interrupted at an exact
byte of shard data written, through the writer's `fault=` interface (writer.FaultHook).

In this process: `with installed(hook):` makes the conversion driver hand `hook` to its writers
(it replaces the driver's `FaultHook` name, which in production is the writer's, whose
`for_run()` returns None); `run_cli(argv, fault="N:SIGNAME")` runs the CLI with it
(tests/crash_child.py).

As a program, for a fresh interpreter (the installed command's test):

    python tests/fault_launcher.py --fault N:SIGNAME [--script PATH] -- convert SRC DST ...

installs the hook, then runs `atom-convert ARGS` as the installed console script does (`PATH`:
that script file itself, run as __main__; default: atom_convert.cli.entry).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import os
import runpy
import signal
import sys
from typing import Any, Iterator

from atom_convert.engine.writer import FaultHook


class SignalAtByte(FaultHook):
    """Sends the converting process `signum` once `at` shard bytes have been written, counted over
    every shard in the order the writes complete; the buffer crossing byte `at` is written up to it
    first, so a kill leaves a shard cut at exactly that point. Make it in the converting process,
    before the conversion forks its worker processes: the count is in shared memory, so they count
    into the same total, and the signal goes to the converting process whichever process writes."""

    def __init__(self, at: int, signum: int):
        self.at, self.signum = at, signum
        self._done = multiprocessing.Value("q", 0)
        self.pid = os.getpid()

    @classmethod
    def parse(cls, spec: str) -> "SignalAtByte":
        """'N:SIGNAME', e.g. '120000:SIGTERM'."""
        at, name = spec.split(":")
        return cls(int(at), int(getattr(signal, name)))

    @property
    def done(self) -> int:
        return int(self._done.value)

    def cut(self, n: int) -> int | None:
        with self._done.get_lock():
            before = self._done.value
            self._done.value = before + n
        return self.at - before if before < self.at <= before + n else None

    def fire(self) -> None:
        os.kill(self.pid, self.signum)
        if os.getpid() != self.pid and self.signum == signal.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker process dies with the converter, at once


@contextlib.contextmanager
def installed(hook: FaultHook | None) -> Iterator[FaultHook | None]:
    """While inside, every conversion in this process (and its forked workers) writes through
    `hook`: the conversion driver's `FaultHook` name is replaced by one whose `for_run()`
    returns it (production's returns None), and put back on the way out."""
    convert_mod = importlib.import_module("atom_convert.engine.convert")  # the package attribute is the function

    class Installed(FaultHook):
        @staticmethod
        def for_run() -> FaultHook | None:
            return hook

    real = convert_mod.FaultHook
    convert_mod.FaultHook = Installed  # type: ignore[misc]
    try:
        yield hook
    finally:
        convert_mod.FaultHook = real  # type: ignore[misc]


def run_cli(argv: list[str], fault: str | None = None) -> Any:
    """`atom-convert ARGV` through the CLI's `main`, with the fault `fault` ('N:SIGNAME') installed."""
    from atom_convert.cli import main

    with installed(SignalAtByte.parse(fault) if fault else None):
        return main(argv)


def _main() -> None:
    ap = argparse.ArgumentParser(description="atom-convert with a test fault installed")
    ap.add_argument("--fault", default=None, help="N:SIGNAME: send SIGNAME once N shard bytes are written")
    ap.add_argument("--script", default=None, help="run this console-script file as __main__ (the installed command)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    with installed(SignalAtByte.parse(ns.fault) if ns.fault else None):
        if ns.script:
            sys.argv = [ns.script, *args]
            runpy.run_path(ns.script, run_name="__main__")  # the installed command's own code
            return
        from atom_convert.cli import entry

        sys.argv = ["atom-convert", *args]
        entry()


if __name__ == "__main__":
    _main()
