"""Tiny DeepSeek-V3.2 checkpoints for the tests, built with transformers' own DeepseekV32ForCausalLM.

transformers (5.17 and later) writes the checkpoint's own names (atom-layout-next.md §5.2:
`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`, per-expert routed experts), so nothing is renamed.
Its `_keys_to_ignore_on_load_unexpected` covers layer 61 only, so the MTP layer (the last decoder
layer's tensors, indexer included, plus embed_tokens, enorm, hnorm, eh_proj and shared_head) is
written by hand, as synth.py does for V3.

The fp8 variant applies DeepSeek's release rule with a quantiser written here (not the project's):
every 2-D linear weight except the router, embeddings, heads, norms, the MTP eh_proj and the
indexer's weights_proj (bf16 in the release, atom-layout-next.md §1.1) becomes e4m3fn with an fp32
`weight_scale_inv` per 128x128 block (amax / 448). The config.json is written by hand in the release's
form (DeepSeek's V3 keys plus index_*; quantization_config with scale_fmt ue8m0).

Dimensions: ATOM's default (fused) indexer needs index_head_dim 128 and qk_rope_head_dim 64; the
indexer's fp8 wk [index_head_dim, hidden] must be whole 128 blocks (ATOM's dequant raises otherwise);
the oracle shim's per_1x128 reference takes whole 128-groups only (kv_lora_rank here); every tp=2 cut
stays on a 128 boundary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FN = torch.float8_e4m3fn

TINY_V32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 8,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 128,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 512,
}
FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                    "weight_block_size": [128, 128]}
_TF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "index_topk", "index_head_dim",
            "index_n_heads", "first_k_dense_replace")
_NOT_QUANTIZED = ("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "norm.weight",
                  "eh_proj.weight", "indexer.weights_proj.weight")


def fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek 128x128 block fp8: scale = block amax / 448 (partial edge blocks their own), e4m3fn codes."""
    n, k = w.shape
    gn, gk = -(-n // 128), -(-k // 128)
    x = torch.zeros(gn * 128, gk * 128)
    x[:n, :k] = w.float()
    amax = x.view(gn, 128, gk, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float()
    i, j = torch.arange(n)[:, None] // 128, torch.arange(k)[None, :] // 128
    q = (w.float() / scale[i, j]).clamp(-448.0, 448.0).to(FN)
    return q.contiguous(), scale.contiguous()


def _rand(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale + shift


def build_v32(out: Path, *, fmt: str = "fp8", seed: int = 0, shards: int = 1, overrides: dict[str, Any] | None = None,
              mtp: bool = True) -> Path:
    """A tiny DeepSeek-V3.2 checkpoint in `out` (fmt "bf16" or "fp8")."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cfg = dict(TINY_V32, **(overrides or {}))
    if not mtp:
        cfg["num_nextn_predict_layers"] = 0
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tf_cfg = transformers.DeepseekV32Config(**{k: cfg[k] for k in _TF_KEYS})
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM._from_config(tf_cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers leaves norms at 1 and biases at 0: random values instead
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights, the indexer's LayerNorm weight and bias
                p.copy_(_rand(tuple(p.shape), gen, 0.1, 1.0 if name.endswith("weight") else 0.0))
            elif "e_score_correction_bias" in name:
                p.copy_(_rand(tuple(p.shape), gen, 0.05))
            elif p.dim() >= 2:
                p.copy_(_rand(tuple(p.shape), gen, p.shape[-1] ** -0.5))
    tmp = out / ".hf"
    model.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    shutil.rmtree(tmp)
    n = cfg["num_hidden_layers"]
    if cfg["num_nextn_predict_layers"]:
        tensors.update(_mtp_layer(cfg, tensors, torch.Generator().manual_seed(seed + 2)))
    # a few exact -0.0 in the indexer's wq_b and wk: e4m3fn byte 0x80 after quantisation (gfx942's fnuz fix
    # applies to wq_b; wk is dequantised from e4m3fn and keeps its bf16 -0)
    for i in range(n + cfg["num_nextn_predict_layers"]):
        for m in ("wq_b", "wk"):
            t = tensors[f"model.layers.{i}.self_attn.indexer.{m}.weight"]
            t.view(-1)[3::97] = -0.0
    if fmt == "fp8":
        q: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith(".weight") and not name.endswith(_NOT_QUANTIZED):
                q[name], q[name.removesuffix(".weight") + ".weight_scale_inv"] = fp8_block_quant(t)
            else:
                q[name] = t
        tensors = q
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
    elif fmt != "bf16":
        raise ValueError(fmt)
    _save(tensors, out, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _mtp_layer(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer n = num_hidden_layers: a copy (fresh values) of the last decoder layer's tensors, its
    indexer included (ATOM builds one in the MTP block, atom-layout-next.md §1.6), plus the MTP extras."""
    n, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    last, j = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = {}
    for name, t in tensors.items():
        if name.startswith(last):
            sd = float(t.float().std()) if t.numel() > 1 else 1.0
            out[j + name[len(last):]] = (torch.randn(t.shape, generator=gen) * (sd or 0.02)
                                         + float(t.float().mean())).to(t.dtype)
    out[j + "embed_tokens.weight"] = _rand((V, H), gen).to(torch.bfloat16)
    out[j + "enorm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "hnorm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "eh_proj.weight"] = _rand((H, 2 * H), gen, 0.02).to(torch.bfloat16)  # bf16 in the fp8 release too
    out[j + "shared_head.norm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "shared_head.head.weight"] = _rand((V, H), gen, 0.02).to(torch.bfloat16)
    return out


def _save(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))


if __name__ == "__main__":  # python tests/v32_fixtures.py OUT [bf16|fp8]
    import sys

    print(build_v32(Path(sys.argv[1]), fmt=sys.argv[2] if len(sys.argv) > 2 else "fp8"))
