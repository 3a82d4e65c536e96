"""`--dry-run` at full width reproduces the worked examples of atom-parallel.md §1.4 (A: DeepSeek-V3
tp 8 EP, B: Kimi-K2 tp 4 EP) and §2.3 (DP-attention), shape for shape.

The sources are header-only checkpoints of configs/deepseek-v3.json and configs/kimi-k2.json at full
width (the dense layers and two MoE layers; the MTP layer of V3): every tensor of the real inventory
declared in a safetensors header, the data a sparse hole (a dry run reads headers only), so they cost
no disk and little time. The expected shapes are copied from the spec tables.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from atom_convert.engine.planning import plan_summary
from atom_convert.errors import UnsupportedError
from atom_convert.layout.codecs.fp8_block import scale_grid
from atom_convert.files.source import SourceCheckpoint
from atom_convert.synth import FP8_QUANT_CONFIG, quark_mxfp4_config, source_inventory

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ST = {"fp8": "F8_E4M3", "f32": "F32", "bf16": "BF16", "u8": "U8"}
SIZE = {"fp8": 1, "f32": 4, "bf16": 2, "u8": 1}


def header_only(cfg_name: str, out: Path, fmt: str) -> Path:
    """A checkpoint whose one shard declares every tensor and holds no data (a sparse file)."""
    cfg = json.loads((CONFIGS / cfg_name).read_text())
    # Full width, fewer layers: the worked examples are per-layer shapes, and the dense layers plus two
    # MoE layers (and the MTP layer) show every kind; 61 layers would only cost time.
    cfg["num_hidden_layers"] = cfg["first_k_dense_replace"] + 2
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    excluded = []
    for name, shape, kind in source_inventory(cfg):
        if kind == "linear" and fmt == "fp8":
            entries += [(name, "fp8", shape), (name.removesuffix(".weight") + ".weight_scale_inv", "f32", scale_grid(shape))]
        elif kind == "linear" and fmt == "mxfp4" and (".mlp.experts." in name or ".mlp.shared_experts." in name):
            entries += [(name, "u8", (shape[0], shape[1] // 2)),
                        (name.removesuffix(".weight") + ".weight_scale", "u8", (shape[0], shape[1] // 32))]
        elif kind in ("router", "bias"):
            entries.append((name, "f32", shape))
        else:
            if kind == "linear":
                excluded.append(name.removesuffix(".weight"))
            entries.append((name, "bf16", shape))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, shape in entries:
        n = SIZE[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": ST[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)  # a hole: no data is written or read
    q = dict(FP8_QUANT_CONFIG) if fmt == "fp8" else quark_mxfp4_config(excluded + ["lm_head"])
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=q)))
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("full-width")
    cache: dict[tuple[str, str], SourceCheckpoint] = {}

    def get(cfg: str, fmt: str) -> SourceCheckpoint:
        """The header index, read once (a full-width header is ~10 MB of JSON)."""
        if (cfg, fmt) not in cache:
            cache[(cfg, fmt)] = SourceCheckpoint(header_only(cfg, root / f"{cfg}-{fmt}", fmt))
        return cache[(cfg, fmt)]

    return get


def shapes(plan: dict[str, Any], rank: int = 0) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of what `rank` holds in the main set (its own rows and the common ones)."""
    main = next(s for s in plan["sets"] if s["role"] == "main")
    return {r["name"]: (r["shape"], r["dtype"]) for r in main["tensors"] if r["rank"] in (rank, "common")}


def experts(sh: dict[str, tuple[list[int], str]], layer: int) -> list[list[int]]:
    p = f"model.layers.{layer}.mlp.experts."
    return [sh[p + n][0] for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")]


V3, KIMI = "deepseek-v3.json", "kimi-k2.json"


def test_example_a_deepseek_v3_tp8_ep(full) -> None:
    """§1.4 A: 33 slots, full I; expert_map of length 258; non-expert tensors as plain TP8."""
    fp8 = plan_summary(full(V3, "fp8"), tp=8, ep=True)
    for r in (0, 7):
        sh = shapes(fp8, r)
        assert experts(sh, 3) == [[33, 4096, 7168], [33, 32, 56], [33, 7168, 2048], [33, 56, 16]]
    tp8 = shapes(plan_summary(full(V3, "fp8"), tp=8))
    ep = shapes(fp8)
    assert {n: v for n, v in ep.items() if ".mlp.experts.w" not in n} == \
        {n: v for n, v in tp8.items() if ".mlp.experts.w" not in n}
    for r, lay in enumerate(fp8["parallel"]["ranks"]):
        assert lay["slots"] == list(range(32 * r, 32 * r + 32)) + [256]
        m = lay["expert_map"]
        assert len(m) == 258 and m[256] == 32 and m[257] == -1
        assert [m[32 * r + k] for k in range(32)] == list(range(32))
        assert sum(1 for x in m if x != -1) == 33
    assert fp8["parallel"]["shared_expert_mode"] == "LEGACY_AITER"
    mx = shapes(plan_summary(full(V3, "mxfp4"), tp=8, ep=True))
    assert experts(mx, 3) == [[33, 4096, 3584], [135168, 224], [33, 7168, 1024], [236544, 64]]


def test_example_b_kimi_k2_tp4_ep(full) -> None:
    plan = plan_summary(full(KIMI, "fp8"), tp=4, ep=True)
    sh = shapes(plan, 2)
    assert experts(sh, 1) == [[97, 4096, 7168], [97, 32, 56], [97, 7168, 2048], [97, 56, 16]]
    a, d = "model.layers.1.self_attn.", "model.layers.0.mlp."
    want = {
        "model.embed_tokens.weight": ([40960, 7168], "bfloat16"), "lm_head.weight": ([40960, 7168], "bfloat16"),
        a + "fused_qkv_a_proj.weight": ([2112, 7168], "float8_e4m3fn"), a + "fused_qkv_a_proj.weight_scale": ([17, 56], "float32"),
        a + "q_b_proj.weight": ([3072, 1536], "float8_e4m3fn"), a + "q_b_proj.weight_scale": ([24, 12], "float32"),
        a + "kv_b_proj.weight": ([4096, 512], "float8_e4m3fn"), a + "kv_b_proj.weight_scale": ([32, 4], "float32"),
        a + "o_proj.weight": ([7168, 2048], "float8_e4m3fn"), a + "o_proj.weight_scale": ([56, 16], "float32"),
        a + "mla_attn.impl.W_K": ([16, 512, 128], "float8_e4m3fn"), a + "mla_attn.impl.W_V": ([16, 128, 512], "float8_e4m3fn"),
        a + "mla_attn.impl.W_K_scale": ([], "float32"), a + "mla_attn.impl.W_V_scale": ([], "float32"),
        d + "gate_up_proj.weight": ([9216, 7168], "float8_e4m3fn"), d + "gate_up_proj.weight_scale": ([72, 56], "float32"),
        d + "down_proj.weight": ([7168, 4608], "float8_e4m3fn"), d + "down_proj.weight_scale": ([56, 36], "float32"),
        "model.layers.1.mlp.gate.weight": ([384, 7168], "bfloat16"),
        "model.layers.1.mlp.gate.e_score_correction_bias": ([384], "bfloat16"),
    }
    assert {n: sh[n] for n in want} == want
    m = plan["parallel"]["ranks"][2]["expert_map"]
    assert len(m) == 386 and m[384] == 96 and m[385] == -1 and m[192:288] == list(range(96))
    mx = shapes(plan_summary(full(KIMI, "mxfp4"), tp=4, ep=True))
    assert experts(mx, 1) == [[97, 4096, 3584], [397312, 224], [97, 7168, 1024], [695296, 64]]


def test_dp_attention_deepseek_v3_tp8(full) -> None:
    """§2.3: every row but the experts whole and identical on the 8 ranks (stored once)."""
    src = full(V3, "fp8")
    off = plan_summary(src, tp=8, dp_attention=True)
    a, d = "model.layers.3.self_attn.", "model.layers.0.mlp."
    want = {
        "model.embed_tokens.weight": [129280, 7168], "lm_head.weight": [129280, 7168],
        a + "fused_qkv_a_proj.weight": [2112, 7168], a + "fused_qkv_a_proj.weight_scale": [17, 56],
        a + "q_b_proj.weight": [24576, 1536], a + "q_b_proj.weight_scale": [192, 12],
        a + "kv_b_proj.weight": [32768, 512], a + "kv_b_proj.weight_scale": [256, 4],
        a + "o_proj.weight": [7168, 16384], a + "o_proj.weight_scale": [56, 128],
        a + "mla_attn.impl.W_K": [128, 512, 128], a + "mla_attn.impl.W_V": [128, 128, 512],
        a + "mla_attn.impl.W_K_scale": [], a + "mla_attn.impl.W_V_scale": [],
        d + "gate_up_proj.weight": [36864, 7168], d + "gate_up_proj.weight_scale": [288, 56],
        d + "down_proj.weight": [7168, 18432], d + "down_proj.weight_scale": [56, 144],
    }
    main = next(s for s in off["sets"] if s["role"] == "main")
    common = {r["name"]: r["shape"] for r in main["tensors"] if r["rank"] == "common"}
    assert {n: common[n] for n in want} == want
    own = {r["name"] for r in main["tensors"] if r["rank"] == 5}
    assert own == {n for n in common | {r["name"]: 0 for r in main["tensors"]} if ".mlp.experts.w" in n}
    assert experts(shapes(off, 5), 3) == [[257, 512, 7168], [257, 4, 56], [257, 7168, 256], [257, 56, 2]]
    on = plan_summary(src, tp=8, dp_attention=True, ep=True)
    assert experts(shapes(on, 5), 3) == [[33, 4096, 7168], [33, 32, 56], [33, 7168, 2048], [33, 56, 16]]
    with pytest.raises(UnsupportedError, match="NotImplementedError"):
        plan_summary(src, tp=8, dp_attention=True, ep=True, mori=True)
    sep = plan_summary(src, tp=8, dp_attention=True, ep=True, mori=True, shared_experts="separate")
    sh = shapes(sep, 5)
    assert experts(sh, 3) == [[32, 4096, 7168], [32, 32, 56], [32, 7168, 2048], [32, 56, 16]]
    s = "model.layers.3.mlp.shared_experts."
    assert [sh[s + n][0] for n in ("gate_up_proj.weight", "gate_up_proj.weight_scale", "down_proj.weight",
                                   "down_proj.weight_scale")] == [[4096, 7168], [32, 56], [7168, 2048], [56, 16]]
    assert sep["parallel"]["shared_expert_mode"] == "NONE"


def test_dp_attention_kimi_k2_tp4(full) -> None:
    src = full(KIMI, "fp8")
    sh = shapes(plan_summary(src, tp=4, dp_attention=True), 3)
    a = "model.layers.1.self_attn."
    assert [sh[a + n][0] for n in ("q_b_proj.weight", "q_b_proj.weight_scale", "kv_b_proj.weight",
                                   "kv_b_proj.weight_scale", "o_proj.weight", "o_proj.weight_scale",
                                   "mla_attn.impl.W_K", "mla_attn.impl.W_V")] == \
        [[12288, 1536], [96, 12], [16384, 512], [128, 4], [7168, 8192], [56, 64], [64, 512, 128], [64, 128, 512]]
    assert sh["model.embed_tokens.weight"][0] == sh["lm_head.weight"][0] == [163840, 7168]
    assert sh["model.layers.0.mlp.gate_up_proj.weight"][0] == [36864, 7168]
    assert sh["model.layers.0.mlp.down_proj.weight"][0] == [7168, 18432]
    assert experts(sh, 1) == [[385, 1024, 7168], [385, 8, 56], [385, 7168, 512], [385, 56, 4]]
    on = shapes(plan_summary(src, tp=4, dp_attention=True, ep=True), 3)
    assert experts(on, 1) == [[97, 4096, 7168], [97, 32, 56], [97, 7168, 2048], [97, 56, 16]]


def test_remainder_refused_at_full_width(full) -> None:
    """§1.4 C: DeepSeek-V3 on 6 EP ranks stops at construction in ATOM; Kimi-K2 at ep 6 is fine."""
    with pytest.raises(UnsupportedError, match="n_routed_experts=256 is not divisible by the expert-parallel size 6"):
        plan_summary(full(V3, "fp8"), tp=6, dp_attention=True, ep=True)
    ok = plan_summary(full(KIMI, "fp8"), tp=6, dp_attention=True, ep=True)
    assert experts(shapes(ok, 5), 1)[0] == [65, 4096, 7168]
