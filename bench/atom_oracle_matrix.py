"""Hold converted fixtures against ATOM's own code on a CPU, case by case: for each fixture, target and
parallel mode, convert with this checkout, then run the oracle tool's `oracle.sh` (the conversion against
ATOM's load + PWAL) and/or `runtime.sh` (ATOM builds its model for the converted directory, this project's
runner loads it, every tensor and piece of state compared with ATOM's own load + PWAL). Prints one line per
case with each tool's closing line, and a JSON summary with --json.

The oracle tool is not part of this project (../shared/atom-oracle/, its README says how to set it up:
ATOM_GIT and AITER_GIT naming git directories of ROCm/ATOM and ROCm/aiter at the commits it pins).

    python bench/atom_oracle_matrix.py --work /tmp/oracle-matrix [--tool runtime|oracle|both] [--only v3-fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT.parent / "shared" / "atom-oracle"

# fixture -> (how to build it, whether it has an MTP layer, targets)
FIXTURES = {
    "v3-fp8": ("tiny-deepseek-v3", "fp8", True, ("gfx950", "gfx942")),
    "kimi-fp8": ("tiny-kimi-k2", "fp8", False, ("gfx950", "gfx942")),
    "v3-bf16": ("tiny-deepseek-v3", "bf16", True, ("gfx950", "gfx942")),
    "v3-mxfp4": ("tiny-deepseek-v3", "quark-template", False, ("gfx950", "gfx942")),
}
# mode -> (convert options, oracle options besides --tp/--rank, tp)
MODES = {
    "tp1": ([], [], 1),
    "tp2": ([], [], 2),
    "tp2-ep": (["--ep"], ["--ep"], 2),
    "tp2-dpa": (["--dp-attention"], ["--dp-attention"], 2),
    "tp2-dpa-ep": (["--dp-attention", "--ep"], ["--dp-attention", "--ep"], 2),
    "tp1-mla-mxfp4": (["--mla-bmm", "mxfp4"], ["--env", "ATOM_USE_TRITON_MXFP4_BMM=1"], 1),
}


def build_fixture(name: str, out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    preset, fmt, _, _ = FIXTURES[name]
    if out.exists():
        return out
    seed = zlib.crc32(name.encode()) % 1000
    if fmt.startswith("quark-"):
        from quark_fixtures import build_quark_export

        return build_quark_export(out, preset, fmt.removeprefix("quark-"), seed=seed)
    from atom_convert.synth import build_tiny

    return build_tiny(preset, out, fmt=fmt, seed=seed, shards=2 if fmt == "fp8" else 1)


def closing(text: str, pattern: str) -> str:
    lines = [ln for ln in text.splitlines() if re.search(pattern, ln)]
    return lines[-1].strip() if lines else "(no closing line)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/atom-oracle-matrix"))
    ap.add_argument("--tool", choices=("runtime", "oracle", "both"), default="runtime")
    ap.add_argument("--only", action="append", default=[], help="fixture names (default: all)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    env = dict(os.environ)
    for k in ("ATOM_GIT", "AITER_GIT"):
        if k not in env:
            print(f"set {k} (see {ORACLE}/README.md)")
            return 2
    rows = []
    for fx in a.only or list(FIXTURES):
        src = build_fixture(fx, a.work / "src" / fx)
        _, fmt, has_mtp, targets = FIXTURES[fx]
        for target in targets:
            for mode in a.modes.split(","):
                conv, opts, tp = MODES[mode]
                if mode == "tp1-mla-mxfp4" and target != "gfx950":
                    continue
                dst = a.work / "out" / f"{fx}-{target}-{mode}"
                if not (dst / "atom_manifest.json").exists():
                    r = subprocess.run([sys.executable, "-c", "from atom_convert.cli import entry; entry()", "convert",
                                        str(src), str(dst),
                                        "--target", target, "--tp", str(tp), "--force", *conv],
                                       capture_output=True, text=True, cwd=ROOT)
                    if r.returncode:
                        rows.append({"fixture": fx, "target": target, "mode": mode, "rank": None,
                                     "convert": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"})
                        print(json.dumps(rows[-1]))
                        continue
                for rank in range(tp):
                    extra = [*opts, "--tp", str(tp), "--rank", str(rank)] + (["--mtp"] if has_mtp else [])
                    row = {"fixture": fx, "target": target, "mode": mode, "rank": rank}
                    t0 = time.time()
                    for tool in (("runtime", "oracle") if a.tool == "both" else (a.tool,)):
                        script = ORACLE / f"{tool}.sh"
                        r = subprocess.run(["bash", str(script), str(src), str(dst), "--target", target, *extra],
                                           capture_output=True, text=True, cwd=ROOT, env=env)
                        pat = r"atom runtime oracle:" if tool == "runtime" else r"atom oracle:"
                        row[tool] = closing(r.stdout + r.stderr, pat)
                        row[tool + "_rc"] = r.returncode
                    row["seconds"] = round(time.time() - t0, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    bad = [r for r in rows if any(r.get(k) for k in ("runtime_rc", "oracle_rc")) or "convert" in r]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases hold")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
