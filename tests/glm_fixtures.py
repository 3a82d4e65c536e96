"""Tiny GLM-5 family checkpoints (`GlmMoeDsaForCausalLM`, model_type glm_moe_dsa) for the tests, built
with transformers' own GlmMoeDsaForCausalLM.

Variants:
- "glm5": GLM-5 / GLM-5.1 shape: an indexer on every layer; config.json states `indexer_types` all
  "full" (tf materialises the key itself, atom-layout-next.md §5.3) and no IndexShare keys.
- "glm52": GLM-5.2 IndexShare: `index_topk_freq`, `index_skip_topk_offset`,
  `index_share_for_mtp_iteration` and an explicit `indexer_types` with "shared" layers, which tf
  builds (and saves) without any indexer tensor (§2.1, §5.3); the MTP layer has its own indexer.

transformers saves the real checkpoint's names for GLM (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`,
per-expert routed experts, `mlp.gate.e_score_correction_bias`): nothing is renamed. Its
`_keys_to_ignore_on_load_unexpected` covers layer 78 only, so the MTP layer (a fresh copy of the
last decoder layer's tensors, an indexer always included, plus embed_tokens, enorm, hnorm, eh_proj
and shared_head) is written by hand. tie_word_embeddings is False (ATOM's replicated embedding needs
it untied, §5.3).

The fp8 variant applies DeepSeek's block rule (GLM-5-FP8 is a DeepSeek-style fp8 export, §2.1) with a
quantiser written here (not the project's): every 2-D linear weight except the router, embeddings,
heads, norms, the MTP eh_proj and the indexer's weights_proj becomes e4m3fn with an fp32
`weight_scale_inv` per 128x128 block (amax / 448). Its quantization_config lists, as GLM-5-FP8's does,
`lm_head`, `model.embed_tokens` and `model.layers.{i}.self_attn.indexers_proj` for every layer in
modules_to_not_convert (a quant-config name only: no such tensor exists).

Dimensions (GLM's own ratios where it matters): qk_nope_head_dim 192 != qk_rope_head_dim 64, v_head_dim
256; index_head_dim 128 and qk_rope_head_dim 64 (ATOM's default, fused indexer); every tp=2 cut on a 128
boundary (kv_a_proj_with_mqa's L + R = 192 rows end in a partial block, as GLM's 576 do); kv_lora_rank 128
(the oracle shim's per_1x128 takes whole groups).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from v32_fixtures import _rand, _save, fp8_block_quant

IDX = "self_attn.indexer."

TINY_GLM: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "first_k_dense_replace": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 8,
    "indexer_rope_interleave": True,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 128,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 128,
    "qk_head_dim": 256,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 256,
    "vocab_size": 512,
}
# GLM-5.2's IndexShare keys (§2.1): freq 2 over 4 layers here; indexer_types is what ATOM obeys.
INDEXSHARE: dict[str, Any] = {
    "num_hidden_layers": 4,
    "index_topk_freq": 2,
    "index_skip_topk_offset": 1,
    "index_share_for_mtp_iteration": True,
    "indexer_types": ["full", "shared", "full", "shared"],
}
VARIANTS: dict[str, dict[str, Any]] = {"glm5": {}, "glm52": INDEXSHARE}
FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}
_TF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "index_topk", "index_head_dim",
            "index_n_heads", "first_k_dense_replace", "indexer_types", "pad_token_id", "rope_parameters")
_NOT_QUANTIZED = ("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "norm.weight",
                  "eh_proj.weight", "indexer.weights_proj.weight")


def glm_config(variant: str = "glm5", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = dict(TINY_GLM, **VARIANTS[variant], **(overrides or {}))
    if "indexer_types" not in cfg:
        cfg["indexer_types"] = ["full"] * cfg["num_hidden_layers"]
    return cfg


def build_glm(out: Path, *, variant: str = "glm5", fmt: str = "fp8", seed: int = 0, shards: int = 1,
              overrides: dict[str, Any] | None = None, mtp: bool = True) -> Path:
    """A tiny GLM checkpoint in `out` (variant "glm5" or "glm52"; fmt "bf16" or "fp8")."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cfg = glm_config(variant, overrides)
    if not mtp:
        cfg["num_nextn_predict_layers"] = 0
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tf_cfg = transformers.GlmMoeDsaConfig(**{k: cfg[k] for k in _TF_KEYS if k in cfg})
    assert list(tf_cfg.indexer_types) == list(cfg["indexer_types"])
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM._from_config(tf_cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers leaves norms at 1 and biases at 0: random values instead
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights, the indexer's LayerNorm weight and bias
                p.copy_(_rand(tuple(p.shape), gen, 0.1, 1.0 if name.endswith("weight") else 0.0))
            elif p.dim() >= 2:
                p.copy_(_rand(tuple(p.shape), gen, p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(_rand(tuple(b.shape), gen, 0.05))
    tmp = out / ".hf"
    model.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    shutil.rmtree(tmp)
    n = cfg["num_hidden_layers"]
    for i, kind in enumerate(cfg["indexer_types"]):  # tf builds no indexer on a "shared" layer (§5.3)
        has = any(k.startswith(f"model.layers.{i}.{IDX}") for k in tensors)
        assert has == (kind == "full"), (i, kind)
    if cfg["num_nextn_predict_layers"]:
        tensors.update(_mtp_layer(cfg, tensors, torch.Generator().manual_seed(seed + 2)))
    # a few exact -0.0 in the indexer's wq_b and wk: e4m3fn byte 0x80 after quantisation (gfx942's fnuz fix
    # applies to wq_b; wk is dequantised from e4m3fn and keeps its bf16 -0)
    for name, t in tensors.items():
        if f".{IDX}wq_b.weight" in name or f".{IDX}wk.weight" in name:
            t.view(-1)[3::97] = -0.0
    if fmt == "fp8":
        q: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith(".weight") and not name.endswith(_NOT_QUANTIZED):
                q[name], q[name.removesuffix(".weight") + ".weight_scale_inv"] = fp8_block_quant(t)
            else:
                q[name] = t
        tensors = q
        excluded = ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.self_attn.indexers_proj"
                                                        for i in range(n + cfg["num_nextn_predict_layers"])]
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG, modules_to_not_convert=excluded)
    elif fmt != "bf16":
        raise ValueError(fmt)
    _save(tensors, out, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _mtp_layer(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer n = num_hidden_layers: fresh values shaped as the last decoder layer's tensors, plus an
    indexer shaped as layer 0's (the last layer may be a "shared" one without it; ATOM builds an
    indexer in the MTP block whatever indexer_types says, §1.6, §2.2), plus the MTP extras."""
    n, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    last, first, j = f"model.layers.{n - 1}.", f"model.layers.0.{IDX}", f"model.layers.{n}."
    like = {j + k[len(last):]: t for k, t in tensors.items() if k.startswith(last) and f".{IDX}" not in k}
    like.update({j + IDX + k[len(first):]: t for k, t in tensors.items() if k.startswith(first)})
    out = {}
    for name, t in like.items():
        sd = float(t.float().std()) if t.numel() > 1 else 1.0
        out[name] = (torch.randn(t.shape, generator=gen) * (sd or 0.02) + float(t.float().mean())).to(t.dtype)
    out[j + "embed_tokens.weight"] = _rand((V, H), gen).to(torch.bfloat16)
    out[j + "enorm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "hnorm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "eh_proj.weight"] = _rand((H, 2 * H), gen, 0.02).to(torch.bfloat16)  # bf16 in the fp8 release
    out[j + "shared_head.norm.weight"] = _rand((H,), gen, 0.1, 1.0).to(torch.bfloat16)
    out[j + "shared_head.head.weight"] = _rand((V, H), gen, 0.02).to(torch.bfloat16)
    return out


if __name__ == "__main__":  # python tests/glm_fixtures.py OUT [glm5|glm52] [bf16|fp8]
    import sys

    print(build_glm(Path(sys.argv[1]), variant=sys.argv[2] if len(sys.argv) > 2 else "glm5",
                    fmt=sys.argv[3] if len(sys.argv) > 3 else "fp8"))


# ------------------------------------------------------------------------------------------------
# AMD Quark MXFP4 (GLM-5.2-MXFP4 style): the MoE only, shared experts included
# ------------------------------------------------------------------------------------------------

# amd/GLM-5.2-MXFP4's exclude list as its card states it (atom-layout-next.md §2.3): attention (the
# indexer with it), routers, lm_head, the dense layers' MLP and the MTP layer stay bf16. `*.mlp.gate_proj`
# names the dense MLP only (a shared expert's is `mlp.shared_experts.gate_proj`).
def quark_glm_exclude(n_layers: int) -> list[str]:
    return ["*self_attn*", "*mlp.gate", "*lm_head", "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj",
            f"*layers.{n_layers}.*"]


def build_glm_quark(out: Path, *, variant: str = "glm52", seed: int = 0) -> Path:
    """A tiny GLM checkpoint quantized by AMD Quark 0.13 (global OCP MXFP4, weights static, inputs dynamic,
    `quark_glm_exclude`) and exported with `export_safetensors(custom_mode="quark",
    weight_format="real_quantized", pack_method="reorder")`. transformers does not load the MTP layer
    (it is not part of its model), so its bf16 tensors are copied into the export by hand, as the release
    carries them (excluded, bf16)."""
    import transformers
    from quark_fixtures import _quark

    q = _quark()
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    bf16 = out.parent / f".{out.name}-bf16"
    build_glm(bf16, variant=variant, fmt="bf16", seed=seed)
    cfg = json.loads((bf16 / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16).eval()
        q["preprocess_for_quantization"](model)  # fused v5 experts -> per-expert nn.Linear
        spec = q["OCP_MXFP4Spec"]
        qcfg = q["QConfig"](global_quant_config=q["QLayerConfig"](
            weight=spec(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
            input_tensors=spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()), exclude=quark_glm_exclude(n))
        quantizer = q["ModelQuantizer"](qcfg)
        model = quantizer.quantize_model(model, None)
        model = quantizer.freeze(model)
        q["export_safetensors"](model, str(out), custom_mode="quark", weight_format="real_quantized",
                                pack_method="reorder")
        src = load_file(str(bf16 / "model.safetensors"))
        mtp = {k: v for k, v in src.items() if k.startswith(f"model.layers.{n}.")}
        if mtp:
            save_file(mtp, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
            idx = out / "model.safetensors.index.json"
            if idx.exists():
                m = json.loads(idx.read_text())
            else:
                with safe_open(str(out / "model.safetensors"), framework="pt") as h:
                    m = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in h.keys()}}
            m["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
            idx.write_text(json.dumps(m, indent=1))
        # The release's config.json: the source's keys (transformers' save adds derived ones such as
        # layer_types ["indexed_attention", ...] that ATOM's pinned transformers refuses) with Quark's
        # quantization_config. Quark writes the exclude list as the names of the modules it saw; the MTP
        # layer is not one of them, so its pattern is added as the release's list has it.
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        qc["exclude"].append(f"*layers.{n}.*")
        (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc), indent=2) + "\n")
    finally:
        shutil.rmtree(bf16, ignore_errors=True)
    return out

