"""Check atom_convert's MXFP4 quantiser against aiter's own triton kernel, on a GPU.

The MLA operands under --mla-bmm mxfp4 must round exactly as aiter's triton
`dynamic_mxfp4_quant` does at the aiter revision the ATOM layout pairs with
(e4048607a, spec §10.1). That kernel cannot be run faithfully on a CPU (Triton's
interpreter), so this script runs it on the H200 device machine. The kernel
file is not part of this repository: pass its path (aiter's
aiter/ops/triton/_triton_kernels/quant/quant.py at e4048607a). The launch
parameters restate aiter's wrapper for 2-D inputs.

    PYTHONPATH=. python3 bench/mxfp4_kernel_check.py --kernel .aiter_head/quant_kernels.py --out $OUT

Note (spec §10.1): on NVIDIA the kernel casts a negative float exponent to
uint8 before adding 127, which saturates, so scale bytes are compared only where
the exponent is >= 0; the e2m1 codes come from the float scale and are compared
everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
import triton

from atom_convert.layout.codecs.mxfp4 import dynamic_mxfp4_quant, mxfp4_dequant


def load_kernel(path: Path):
    spec = importlib.util.spec_from_file_location("aiter_quant_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._dynamic_mxfp4_quant_kernel


def aiter_quant(kernel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    x_fp4 = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device)
    bs = torch.empty(((n + 31) // 32, m), dtype=torch.uint8, device=x.device).T
    if m <= 32:
        num_iter, bm, bn, warps, stages = 1, triton.next_power_of_2(m), 32, 1, 1
    else:
        num_iter, bm, bn, warps, stages = 4, 64, 64, 4, 2
        if n <= 16384:
            bm, bn = 32, 128
    if n <= 1024:
        num_iter, stages, warps = 1, 1, 4
        bn = max(32, min(256, triton.next_power_of_2(n)))
        bm = min(8, triton.next_power_of_2(m))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn * num_iter))
    kernel[grid](x, x_fp4, bs, *x.stride(), *x_fp4.stride(), *bs.stride(), M=m, N=n, MXFP4_QUANT_BLOCK_SIZE=32,
                 SCALING_MODE=0, NUM_ITER=num_iter, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, NUM_STAGES=stages,
                 num_warps=warps, num_stages=1)
    return x_fp4, bs


def ties(m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks whose amax is 6 * 2^k (so q = x / 2^k exactly) holding every e2m1 midpoint and
    tiny negatives that round to -0, in random order and sign."""
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 0.0, 6.0])
    idx = torch.randint(0, len(vals), (m, n), generator=gen)
    sign = torch.where(torch.rand(m, n, generator=gen) < 0.5, -1.0, 1.0)
    x = vals[idx] * sign
    x[:, ::32] = 6.0  # every block's amax is exactly 6
    k = torch.randint(-3, 4, (m, n // 32), generator=gen).float().repeat_interleave(32, 1)
    return (x * torch.exp2(k)).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    kernel = load_kernel(a.kernel)
    gen = torch.Generator().manual_seed(0)
    cases = {
        "randn x1e-3 [64, 512]": (torch.randn(64, 512, generator=gen) * 1e-3).to(torch.bfloat16),
        "randn x1 [128, 2048]": torch.randn(128, 2048, generator=gen).to(torch.bfloat16),
        "randn x100 [16, 4096]": (torch.randn(16, 4096, generator=gen) * 100).to(torch.bfloat16),
        "W_K-shaped [16*512, 128]": (torch.randn(16 * 512, 128, generator=gen) * 0.05).to(torch.bfloat16),
        "W_V-shaped [16*128, 512]": (torch.randn(16 * 128, 512, generator=gen) * 0.05).to(torch.bfloat16),
        "exact ties [64, 1024]": ties(64, 1024, gen),
        "exact ties [8, 64]": ties(8, 64, gen),
    }
    results = []
    for name, x in cases.items():
        xa = x.cuda()
        fa, sa = aiter_quant(kernel, xa)
        torch.cuda.synchronize()
        fa, sa = fa.cpu(), sa.contiguous().cpu()
        fm, sm = dynamic_mxfp4_quant(x)
        nonneg = sm >= 127
        row = {
            "case": name,
            "packed_bytes": fa.numel(),
            "packed_bytes_differing": int((fa != fm).sum()),
            "scale_bytes_compared (exponent >= 0)": int(nonneg.sum()),
            "scale_bytes_differing": int(((sa != sm) & nonneg).sum()),
            "negative_zero_codes": int((((fm & 0xF) == 8) | ((fm >> 4) == 8)).sum()),
            "decoded_equal": bool(torch.equal(mxfp4_dequant(fa, sm), mxfp4_dequant(fm, sm))),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["packed_bytes_differing"] == 0 and r["scale_bytes_differing"] == 0 for r in results)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "aiter_kernel": "aiter e4048607a aiter/ops/triton/_triton_kernels/quant/quant.py", "all_equal": ok,
           "cases": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mxfp4_kernel_check.json").write_text(json.dumps(out, indent=1))
    print("ALL EQUAL" if ok else "DIFFERENCES FOUND")


if __name__ == "__main__":
    main()
