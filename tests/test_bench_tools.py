"""The diagnostic bench tools run on a tiny checkpoint and report what the conversion did (they are
not timed here: speed lives in bench/ and BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

from atom_convert.engine import workers
from atom_convert.engine.planning import make_plan
from atom_convert.files.source import SourceCheckpoint

REPO = Path(__file__).resolve().parents[1]
PRESET = "tiny-deepseek-v3"


def _run(*args: str) -> str:
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_moe_scaling_threads_and_processes_produce_the_same_bytes(tiny_checkpoint: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    plan = make_plan(SourceCheckpoint(src), target="gfx942", tp=2)
    moe = max(([o for o in g.outputs if o.units] for g in plan.main.groups), key=lambda outs: sum(o.nbytes for o in outs))
    want = 2 * sum(o.nbytes for o in moe)  # every rank's w13 and w2
    out = tmp_path / "rows.json"
    _run("bench/moe_scaling.py", str(src), "--tp", "2", "--target", "gfx942", "--workers", "1,3",
         "--mode", "thread,process", "--scratch", str(tmp_path / "scratch"), "--json", str(out))
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["workers"]) for r in rows] == [("thread", 1), ("process", 1), ("thread", 3), ("process", 3)]
    assert all(r["bytes"] == want for r in rows), (want, rows)
    assert not (tmp_path / "scratch").exists()  # its scratch files are removed


def test_trace_convert_records_every_item_and_shard(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    out = tmp_path / "trace.json"
    text = _run("bench/trace_convert.py", str(src), "--tp", "2", "--workers", "3", "--dst", str(tmp_path / "dst"),
                "--json", str(out))
    rec = json.loads(out.read_text())
    plan = make_plan(SourceCheckpoint(src), tp=2)
    expected = workers.items(plan.main.groups, 2, 3)
    if plan.mtp is not None:
        expected += workers.items(plan.mtp.groups, 2, 3)
    assert sorted((i["group"], i["rank"], i["part"] and tuple(i["part"])) for i in rec["items"]) == \
        sorted((i.group.key, i.rank, i.part) for i in expected)
    assert not (tmp_path / "dst").exists()  # the output is removed
    assert len(rec["hashes"]) >= 2 and all(h["end"] >= h["start"] for h in rec["hashes"])  # a shard per rank at least
    assert "last item ends at" in text and "cores busy" in text and math.isfinite(rec["end"] - rec["start"])
