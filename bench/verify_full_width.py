"""Full-width `atom-convert verify` run (issue: verify at DeepSeek-V3 and Kimi-K2 dimensions).

Builds random fp8 checkpoints with the real attention and expert dimensions
(hidden 7168, 128 or 64 heads, q_lora 1536, kv_lora 512, moe_intermediate 2048)
but few layers and experts, converts each for gfx950 and gfx942 at tp=8 and
tp=1, and runs the full verify (files, per-tensor decode, layer-by-layer
forward against transformers) on the GPU. Meant for the H200 device machine:

    PYTHONPATH=. python3 bench/verify_full_width.py --out $OUT --device cuda

Results: a JSON file and a text table per (model, target, tp) under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from atom_convert import convert
from atom_convert.synth import build_random, load_preset
from atom_convert.check.verify import format_table, verify

MODELS = {
    "deepseek-v3": dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_group=8, topk_group=4,
                        num_experts_per_tok=8, num_nextn_predict_layers=0),
    "kimi-k2": dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=8,
                    num_nextn_predict_layers=0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--models", default="deepseek-v3,kimi-k2")
    ap.add_argument("--targets", default="gfx950,gfx942")
    ap.add_argument("--tps", default="8,1")
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="atom-verify-"))
    summary = []
    for model in a.models.split(","):
        cfg = dict(load_preset(model), **MODELS[model])
        src = work / f"{model}-src"
        if src.exists():
            shutil.rmtree(src)
        t0 = time.perf_counter()
        build_random(cfg, src, fmt="fp8", weights="gaussian", seed=1)
        print(f"{model}: built fp8 source in {time.perf_counter() - t0:.1f} s", flush=True)
        for target in a.targets.split(","):
            for tp in (int(x) for x in a.tps.split(",")):
                dst = work / f"{model}-{target}-tp{tp}"
                t0 = time.perf_counter()
                convert(src, dst, target, tp=tp, force=True)
                tc = time.perf_counter() - t0
                t0 = time.perf_counter()
                r = verify(dst, src, tokens=a.tokens, device=a.device)
                tv = time.perf_counter() - t0
                table = format_table(r)
                head = (f"== {model} fp8 -> {target} tp={tp}: convert {tc:.1f} s, verify {tv:.1f} s, "
                        f"{r.check.files_checked} files, {r.check.values_checked} tensors decoded, "
                        f"W_K/W_V max err {r.check.max_mla_rel_err:.4f} of amax: {'OK' if r.ok else 'FAIL'}")
                print(head + "\n" + table + "\n" + "\n".join(r.failures), flush=True)
                summary.append({"model": model, "target": target, "tp": tp, "convert_s": tc, "verify_s": tv,
                                **r.as_dict()})
                shutil.rmtree(dst)
        shutil.rmtree(src)
    info = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "runs": summary}
    (a.out / "verify_full_width.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
