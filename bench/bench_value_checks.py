"""Cost of the streaming value checks (atom_convert/files/values.py) against the work the
conversion does on the same bytes anyway.

Measures, in this process, on random data at DeepSeek-V3 width:
1. one fp8 weight [7168, 2048] (an expert's down_proj; o_proj-sized): the check, a plain copy of
   its bytes, and its post-load processing (fnuz-free gfx950 path: shuffle16);
2. one V3 MoE layer's experts, 256 routed + 1 shared, one expert at a time as the converter
   streams them: per expert the gate/up/down weights [2048, 7168] x 2 and [7168, 2048] and their
   block scales are checked, then stacked and shuffled (Fp8MoEPostLoad.w13/w2);
3. a 64 MB bf16 chunk (the size the embedding and lm_head are streamed in).
Each number is the median of `--repeat` runs of the process's CPU time (`time.process_time`)
on one torch thread: on a shared machine wall time mostly measures the other processes. The
ratio "checks / processing" is the overhead the checks add to the CPU work of the conversion
(reading the source and writing the output are not counted, so the end-to-end overhead is smaller).

Usage: python bench/bench_value_checks.py [--repeat 5] [--experts 257] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from atom_convert.layout.postload import MOE
from atom_convert.layout.codecs.base import LinearData
from atom_convert.layout.codecs.shuffle import shuffle16
from atom_convert.files.values import ValueGuard


def fp8_weight(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes: the checks take their fast path, as on a sound checkpoint
    return b.view(torch.float8_e4m3fn)


def scales(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    return torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=gen) * 1e-3 + 1e-4


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median CPU milliseconds of `fn` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--experts", type=int, default=257, help="experts per MoE layer (V3: 256 routed + 1 shared)")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    guard = ValueGuard()
    out: dict[str, object] = {"torch_threads": torch.get_num_threads(), "unit": "CPU ms (or s), median"}

    w = fp8_weight((7168, 2048), gen)
    s = scales((7168, 2048), gen)
    out["fp8_7168x2048"] = {
        "check_ms": median_ms(lambda: (guard.check("w", "f", w), guard.check("s", "f", s), guard.scales("s", "f", s)),
                              a.repeat),
        "copy_ms": median_ms(lambda: w.clone(), a.repeat),
        "shuffle16_ms": median_ms(lambda: shuffle16(w), a.repeat),
    }

    H, inter = 7168, 2048
    gate, up, down = (fp8_weight((inter, H), gen), fp8_weight((inter, H), gen), fp8_weight((H, inter), gen))
    sg, su, sd = scales((inter, H), gen), scales((inter, H), gen), scales((H, inter), gen)
    post = MOE["fp8-block"]

    def check_expert() -> None:
        for name, t, sc in (("gate", gate, sg), ("up", up, su), ("down", down, sd)):
            guard.check(name, "f", t)
            guard.check(name + "_scale", "f", sc)
            guard.scales(name + "_scale", "f", sc)

    def process_expert() -> None:
        post.w13(LinearData(gate, sg), LinearData(up, su), "gfx950")
        post.w2(LinearData(down, sd), "gfx950")

    c, p = median_ms(check_expert, a.repeat), median_ms(process_expert, a.repeat)
    out["v3_moe_layer"] = {"experts": a.experts, "bytes": a.experts * 3 * inter * H,
                           "check_s": c * a.experts / 1e3, "postload_s": p * a.experts / 1e3,
                           "check_over_postload": c / p}

    x = (torch.randn(32 << 20, generator=gen) * 0.02).to(torch.bfloat16)  # 64 MB
    out["bf16_64MB_chunk"] = {"check_ms": median_ms(lambda: guard.check("e", "f", x), a.repeat),
                              "copy_ms": median_ms(lambda: x.clone(), a.repeat)}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
