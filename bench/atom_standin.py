"""A stand-in for ATOM's own load of an original DeepSeek fp8 checkpoint on one TP rank (the baseline
(c) of bench/bench_load.py), written from atom-loading.md §1 and atom-layout.md §2-§4.

What ATOM does per rank, and what this does the same way:
1. map checkpoint names to module parameters (q_a + kv_a -> fused_qkv_a_proj, gate/up -> gate_up_proj,
   experts -> w13/w2 slots, the shared expert -> slot E);
2. read the rank's slice of every tensor through safetensors' CPU mapping (every rank reads the
   replicated tensors whole) and copy it into the parameter on the GPU, tensor by tensor
   (`param.copy_`, pageable host memory), experts one at a time into their slot;
3. post-load processing on the GPU: gfx942 fnuz (clear 0x80, double the scales), shuffle16 of every fp8
   weight and of the expert stacks, W_K/W_V from the dequantised kv_b_proj (per-tensor fp8).
It is a stand-in for timing: it runs no ATOM code. Its tensors are compared with what load_into
places (bench_load.py reports the count that are byte-equal).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from atom_convert.layout.arch.deepseek import mla_operands
from atom_convert.layout.model import ModelSpec
from atom_convert.layout.codecs.fnuz import fnuz_normalize
from atom_convert.layout.codecs.fp8_block import block_dequant
from atom_convert.files.dtypes import FP8_DTYPE_BY_TARGET
from atom_convert.layout.codecs.shuffle import shuffle16

BF16 = torch.bfloat16
BLOCK = 128


class _Src:
    def __init__(self, path: Path):
        idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        self.file_of = idx
        self.h = {f: safe_open(str(path / f), framework="pt", device="cpu") for f in sorted(set(idx.values()))}
        self.read = 0

    def whole(self, name: str) -> torch.Tensor:
        t = self.h[self.file_of[name]].get_tensor(name)
        self.read += t.numel() * t.element_size()
        return t

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        t = self.h[self.file_of[name]].get_slice(name)[lo:hi]
        self.read += t.numel() * t.element_size()
        return t

    def cols(self, name: str, lo: int, hi: int) -> torch.Tensor:
        t = self.h[self.file_of[name]].get_slice(name)[:, lo:hi]
        self.read += t.numel() * t.element_size()
        return t


def load_rank(src_dir: str | Path, rank: int, tp: int, target: str, device: torch.device) -> tuple[dict[str, Any], int]:
    """Every tensor of the rank in ATOM's post-load form on `device` (names as atom-convert writes them)
    and the source bytes read."""
    src_dir = Path(src_dir)
    cfg = json.loads((src_dir / "config.json").read_text())
    s = ModelSpec.from_config(cfg)
    src = _Src(src_dir)
    fp8 = FP8_DTYPE_BY_TARGET[target]
    out: dict[str, Any] = {}

    def gpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = t.to(device)  # the parameter copy (pageable host memory, as weight_loader's copy_)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def fp8_param(w: torch.Tensor, sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ATOM's per_1x128 post-load: fnuz on gfx942 (x2 scales), then shuffle16 (spec §3.2)."""
        if fp8 == torch.float8_e4m3fnuz:
            w, sc = fnuz_normalize(w), sc * 2.0
        return shuffle16(w), sc

    def linear(name: str, src_prefixes: list[str], split: str | None) -> None:
        ws, ss = [], []
        for sp in src_prefixes:
            wn, sn = f"{sp}.weight", f"{sp}.weight_scale_inv"
            shape = src.h[src.file_of[wn]].get_slice(wn).get_shape()
            if split == "rows":
                n = shape[0] // tp
                ws.append(gpu(src.rows(wn, rank * n, (rank + 1) * n)))
                ss.append(gpu(src.rows(sn, rank * n // BLOCK, (rank + 1) * n // BLOCK)))
            elif split == "cols":
                n = shape[1] // tp
                ws.append(gpu(src.cols(wn, rank * n, (rank + 1) * n)))
                ss.append(gpu(src.cols(sn, rank * n // BLOCK, (rank + 1) * n // BLOCK)))
            else:
                ws.append(gpu(src.whole(wn)))
                ss.append(gpu(src.whole(sn)))
        w, sc = fp8_param(torch.cat(ws), torch.cat(ss).float())
        out[f"{name}.weight"], out[f"{name}.weight_scale"] = w, sc

    vr = s.vocab // tp
    out["model.embed_tokens.weight"] = gpu(src.rows("model.embed_tokens.weight", rank * vr, (rank + 1) * vr))
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"):
            out[f"{p}{n}.weight"] = gpu(src.whole(f"{p}{n}.weight"))
        linear(a + "fused_qkv_a_proj", [a + "q_a_proj", a + "kv_a_proj_with_mqa"], None)
        linear(a + "q_b_proj", [a + "q_b_proj"], "rows")
        # kv_b: the raw rank slice is needed for W_K/W_V before it is processed
        nkv = s.Nh * (s.P + s.V) // tp
        kvw = gpu(src.rows(a + "kv_b_proj.weight", rank * nkv, (rank + 1) * nkv))
        kvs = gpu(src.rows(a + "kv_b_proj.weight_scale_inv", rank * nkv // BLOCK, (rank + 1) * nkv // BLOCK)).float()
        mla = mla_operands(block_dequant(kvw, kvs).to(BF16), s.Nh // tp, s.P, s.V, s.L, fp8)
        for k, v in mla.items():
            out[f"{a}mla_attn.impl.{k}"] = v
        out[a + "kv_b_proj.weight"], out[a + "kv_b_proj.weight_scale"] = fp8_param(kvw, kvs)
        linear(a + "o_proj", [a + "o_proj"], "cols")
        if not s.is_moe_layer(i):
            ir = s.Id // tp
            gw = torch.cat([gpu(src.rows(f"{p}mlp.{n}_proj.weight", rank * ir, (rank + 1) * ir)) for n in ("gate", "up")])
            gs = torch.cat([gpu(src.rows(f"{p}mlp.{n}_proj.weight_scale_inv", rank * ir // BLOCK, (rank + 1) * ir // BLOCK))
                            for n in ("gate", "up")]).float()
            out[p + "mlp.gate_up_proj.weight"], out[p + "mlp.gate_up_proj.weight_scale"] = fp8_param(gw, gs)
            linear(p + "mlp.down_proj", [p + "mlp.down_proj"], "cols")
            continue
        out[p + "mlp.gate.weight"] = gpu(src.whole(p + "mlp.gate.weight"), BF16)
        out[p + "mlp.gate.e_score_correction_bias"] = gpu(src.whole(p + "mlp.gate.e_score_correction_bias"), BF16)
        il = s.I // tp
        E = s.E + 1  # the shared expert fused into slot E (spec §2.4)
        w13 = torch.empty((E, 2 * il, s.H), dtype=torch.float8_e4m3fn, device=device)
        w2 = torch.empty((E, s.H, il), dtype=torch.float8_e4m3fn, device=device)
        s13 = torch.empty((E, 2 * il // BLOCK, -(-s.H // BLOCK)), dtype=torch.float32, device=device)
        s2 = torch.empty((E, -(-s.H // BLOCK), il // BLOCK), dtype=torch.float32, device=device)
        for e in range(E):
            m = f"{p}mlp.experts.{e}" if e < s.E else f"{p}mlp.shared_experts"
            for j, n in enumerate(("gate_proj", "up_proj")):
                w13[e, j * il:(j + 1) * il].copy_(src.rows(f"{m}.{n}.weight", rank * il, (rank + 1) * il))
                s13[e, j * il // BLOCK:(j + 1) * il // BLOCK].copy_(
                    src.rows(f"{m}.{n}.weight_scale_inv", rank * il // BLOCK, (rank + 1) * il // BLOCK))
            w2[e].copy_(src.cols(f"{m}.down_proj.weight", rank * il, (rank + 1) * il))
            s2[e].copy_(src.cols(f"{m}.down_proj.weight_scale_inv", rank * il // BLOCK, (rank + 1) * il // BLOCK))
        x = p + "mlp.experts."
        out[x + "w13_weight"], out[x + "w13_weight_scale"] = fp8_param(w13, s13)
        out[x + "w2_weight"], out[x + "w2_weight_scale"] = fp8_param(w2, s2)
    out["model.norm.weight"] = gpu(src.whole("model.norm.weight"))
    out["lm_head.weight"] = gpu(src.rows("lm_head.weight", rank * vr, (rank + 1) * vr))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, src.read
