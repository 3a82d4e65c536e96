"""bench/bench_convert.py --variant: the benchmark switches are keyword options of the objects
that use them (issue 27); a variant names them, or the module constants they were before, and
the conversion's objects are made with them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "bench"))
import bench_convert as b
import atom_convert
b.apply_variant({"atom_convert.engine.prefetch.GATE": False,                           # the old constant's name
                 "atom_convert.engine.prefetch.Prefetcher.step": 8192,                 # the option itself
                 "atom_convert.engine.writer.HASH_FROM_MAP": False,
                 "atom_convert.engine.writer.ShardSetWriter.hash_read": 4096})
conv = importlib.import_module("atom_convert.engine.convert")
p = conv.Prefetcher(None, 0, lambda i: [])
p.close()
assert (p._gate, p._step) == (False, 8192), vars(p)
p = conv.Prefetcher(None, 0, lambda i: [], gate=True)  # the caller's own keyword wins
p.close()
assert p._gate is True
w = conv.ShardSetWriter(Path(tempfile.mkdtemp()), "", [], [], None)
assert (w.hash_from_map, w.hash_read) == (False, 4096)
assert isinstance(w, importlib.import_module("atom_convert.engine.writer").ProcessShardWriter.__mro__[1])
try:
    b.apply_variant({"atom_convert.engine.prefetch.Prefetcher.no_such_option": 1})
except SystemExit as e:
    assert "no_such_option" in str(e)
else:
    raise AssertionError("an unknown option was accepted")
print("ok")
"""


def test_variant_options_reach_the_conversions_objects() -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
