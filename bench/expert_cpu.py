#!/usr/bin/env python3
"""CPU per byte of one rank's fp8 experts, step by step, on a real source's mapping (issue 29).

For `--experts` routed experts of `--layer` (one rank's cut at `--tp`: gate/up rows, down columns),
on one torch thread, in this process: each step alone, then the whole per-expert work as the
converter does it at gfx950 with the NaN-code check on the source (before `3ee0be0`) and on the
shuffled weight (after), alternated `--rounds` times. The output goes by `pwrite` into one file under
--out, rewritten in place after the first pass (a conversion's fresh pages are a different cost: see
BENCHMARKS.md on the first touch of a page). Rates are GB of source per CPU-second
(`time.process_time`), so other processes on the machine do not count.

    python bench/expert_cpu.py SRC [--layer 1] [--experts 16] [--tp 8] [--rounds 6] [--out /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from atom_convert.files.source import SourceCheckpoint  # noqa: E402
from atom_convert.files.values import has_fp8_nan_code  # noqa: E402
from atom_convert.layout.codecs.shuffle import shuffle16, shuffle16_into  # noqa: E402
from atom_convert.store import digest  # noqa: E402


def experts(src: Path, layer: int, count: int, tp: int) -> list[tuple[torch.Tensor, ...]]:
    """Rank 0's cut of the first `count` routed experts: views of the source's mapping, unchecked."""
    ck = SourceCheckpoint(src)
    out = []
    for e in range(count):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        il = ck.info(p + "gate_proj.weight").shape[0] // tp
        out.append((ck.get_rows(p + "gate_proj.weight", 0, il, check=False),
                    ck.get_rows(p + "up_proj.weight", 0, il, check=False),
                    ck.get_cols(p + "down_proj.weight", 0, il, contiguous=False, check=False)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("/dev/shm"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    ws = experts(a.src, a.layer, a.experts, a.tp)
    il, H = ws[0][0].shape
    per = sum(x.numel() for x in ws[0])
    o13 = torch.empty((2 * il, H), dtype=torch.uint8)
    o2 = torch.empty((H, il), dtype=torch.uint8)
    f13, f2 = o13.view(torch.float8_e4m3fn), o2.view(torch.float8_e4m3fn)
    path = a.out / f"expert-cpu-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)

    def shuffle(e: int) -> None:
        g, u, d = ws[e]
        shuffle16_into(f13[:il], g)
        shuffle16_into(f13[il:], u)
        shuffle16_into(f2, d)

    def check_source(e: int) -> None:
        for x in ws[e]:
            has_fp8_nan_code(x)

    def check_shuffled(e: int) -> None:
        has_fp8_nan_code(f13)
        has_fp8_nan_code(f2)

    def leaves(e: int) -> None:
        digest.leaves_within(o13.numpy(), 0)
        digest.leaves_within(o2.numpy(), 0)

    def write(e: int) -> None:
        os.pwrite(fd, o13.numpy(), e * per)
        os.pwrite(fd, o2.numpy(), e * per + o13.numel())

    steps: dict[str, Callable[[int], None]] = {
        "check the source (2 reductions)": check_source, "shuffle16 into a buffer": shuffle,
        "check the shuffled weight": check_shuffled, f"{digest.WRITTEN} leaves of 64 KiB blocks": leaves,
        "pwrite (in place)": write,
        "whole, check on the source (before)": lambda e: (check_source(e), shuffle(e), leaves(e), write(e)),
        "whole, check on the shuffled weight": lambda e: (shuffle(e), check_shuffled(e), leaves(e), write(e)),
    }
    try:
        for e in range(len(ws)):  # map the source pages and make the output file's pages once
            check_source(e), shuffle(e), write(e)
        rates: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(a.rounds):
            for name, fn in steps.items():
                t0 = time.process_time()
                for e in range(len(ws)):
                    fn(e)
                rates[name].append(round(per * len(ws) / (time.process_time() - t0) / 1e9, 2))
        g, u, d = ws[-1]  # the file holds what the converter writes for each expert
        want = torch.cat([shuffle16(torch.cat([g, u])).reshape(-1).view(torch.uint8),
                          shuffle16(d.contiguous()).reshape(-1).view(torch.uint8)])
        got = torch.frombuffer(bytearray(os.pread(fd, per, (len(ws) - 1) * per)), dtype=torch.uint8)
        if not torch.equal(got, want):
            raise SystemExit("expert_cpu: the bytes written differ from shuffle16 of the expert")
    finally:
        os.close(fd)
        path.unlink()
    print(f"{len(ws)} experts of layer {a.layer} at tp {a.tp}: [{2 * il}, {H}] + [{H}, {il}] fp8, "
          f"{per * len(ws) / 1e6:.0f} MB; GB of source per CPU-second, {a.rounds} rounds:")
    print("  the last expert's bytes in the file: equal to shuffle16 of [gate; up] and of down")
    for name, r in rates.items():
        print(f"  {name:40s} {' '.join(f'{x:5.2f}' for x in r)}   median {statistics.median(r):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
