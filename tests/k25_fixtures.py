"""Tiny Kimi-K2.5 checkpoints for the tests, built with transformers' own Kimi_K25ForConditionalGeneration.

transformers (5.13 and later) saves a Kimi-K2.5 with names that are not the real checkpoint's
(atom-layout-next.md §5.4): the decoder layers as `language_model.model.blocks.{i}`, the patch convolution
as `vision_tower.encoder.patch_embed.proj`, the projector norm as `model.mm_projector.pre_norm`. Those three
prefixes are renamed here to the real names (`language_model.model.layers.{i}`, `vision_tower.patch_embed.`,
`mm_projector.pre_norm`); everything else (per-expert routed experts, vision blocks, `mm_projector.proj.{0,2}`)
comes out of the save as in the original format. `tie_word_embeddings` is False at the top level (it
defaults True there and the save would lack `language_model.lm_head.weight`). The config.json is written by
hand in the release's schema: top-level architectures/model_type kimi_k25, a `text_config` with model_type
kimi_k2, a `vision_config` with Moonshot's `vt_*` names, and the quantization_config at the top level.

Formats:
- "bf16": the save as it is (e_score_correction_bias is BF16 there, §5.4).
- "fp8": DeepSeek's release rule with a quantiser written here: every 2-D linear weight of the text model
  except the router, embeddings and lm_head becomes e4m3fn + fp32 `weight_scale_inv` per 128x128 block.
- "mxfp4": AMD Quark 0.13 on the text model (a Kimi-K2 DeepseekV3ForCausalLM holding the same tensors),
  with amd/Kimi-K2.5-MXFP4's recipe (atom-layout-next.md §3.5): MXFP4 weights (static) everywhere but
  `*self_attn* *mlp.gate *lm_head` (so layer 0's dense MLP, routed and shared experts MXFP4); the export's
  tensors then get the `language_model.` prefix back, the vision tensors are added unchanged (bf16), and
  the exclude list is written as AMD's exports write it: full `language_model.model.…` module names.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from v32_fixtures import _save, fp8_block_quant

PREFIX = "language_model."
BF16 = torch.bfloat16

TEXT: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
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
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 64,
    "vocab_size": 512,
}
# transformers' vision config (its own names) and the same in Moonshot's schema for config.json.
TF_VISION = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128,
             "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2, "merge_kernel_size": [2, 2]}
VISION_CONFIG = {"model_type": "", "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
                 "init_pos_emb_time": 2, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2,
                 "vt_num_hidden_layers": 1, "vt_hidden_size": 64, "vt_intermediate_size": 128,
                 "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
                 "_attn_implementation": "flash_attention_2", "mm_projector_type": "patchmerger",
                 "mm_hidden_size": 64, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "text_hidden_size": 256}
TF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
           "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
           "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
           "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "first_k_dense_replace",
           "rope_theta", "model_type")
# transformers' save -> the real checkpoint's names (atom-layout-next.md §5.4)
RENAMES = (("language_model.model.blocks.", "language_model.model.layers."),
           ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
           ("model.mm_projector.", "mm_projector."))
NOT_QUANTIZED = ("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight", "norm.weight")
QUARK_EXCLUDE = ["*self_attn*", "*mlp.gate", "*lm_head"]  # amd/Kimi-K2.5-MXFP4's text-model excludes


def top_config(text: dict[str, Any], quant: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "ignore_index": -100, "media_placeholder_token_id": 500,
        "tie_word_embeddings": False,
        "text_config": dict(text),
        "vision_config": dict(VISION_CONFIG),
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
    }
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def _rand(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale + shift


def tf_tensors(seed: int, text: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' Kimi_K25ForConditionalGeneration, random weights, saved and renamed to the real names."""
    import tempfile

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    tf_text = {k: text[k] for k in TF_KEYS}
    cfg = transformers.Kimi_K25Config(text_config=tf_text, vision_config=dict(TF_VISION), projection_hidden_size=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Kimi_K25ForConditionalGeneration._from_config(cfg, dtype=BF16)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers leaves norms at 1 and biases at 0: random values instead
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(_rand(tuple(p.shape), gen, 0.1, 1.0 if name.endswith("weight") else 0.0))
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                p.copy_(_rand(tuple(p.shape), gen, 0.05))
            elif p.dim() >= 2:
                p.copy_(_rand(tuple(p.shape), gen, p.shape[-1] ** -0.5))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    out = {}
    for name, t in tensors.items():
        for a, b in RENAMES:
            if name.startswith(a):
                name = b + name[len(a):]
                break
        out[name] = t
    return out


def build_k25(out: Path, *, fmt: str = "bf16", seed: int = 0, shards: int = 1,
              text_overrides: dict[str, Any] | None = None, keep_tf_names: bool = False) -> Path:
    """A tiny Kimi-K2.5 checkpoint in `out` (fmt "bf16", "fp8", "mxfp4" or "int4")."""
    text = dict(TEXT, **(text_overrides or {}))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = tf_tensors(seed, text)
    if keep_tf_names:  # transformers' own save names, for the refusal test
        inv = {b: a for a, b in RENAMES}
        tensors = {next((inv[b] + k[len(b):] for b in inv if k.startswith(b)), k): v for k, v in tensors.items()}
    # a few exact -0.0 in the text linears: e4m3fn byte 0x80 after quantisation (gfx942's fnuz fix)
    for name, t in tensors.items():
        if name.startswith(PREFIX) and t.dim() == 2 and "proj" in name:
            t.view(-1)[5::211] = -0.0
    quant = None
    if fmt == "fp8":
        q: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(PREFIX) and t.dim() == 2 and name.endswith(".weight") and not name.endswith(NOT_QUANTIZED):
                q[name], q[name.removesuffix(".weight") + ".weight_scale_inv"] = fp8_block_quant(t)
            else:
                q[name] = t
        tensors = q
        quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    elif fmt == "mxfp4":
        tensors, quant = _quark_export(out, tensors, text)
    elif fmt == "int4":  # the official release's form: compressed-tensors pack-quantized routed experts (§3.1, §4.1)
        from int4_fixtures import EXPERT, ct_compress, kimi_quantization_config

        packed: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(PREFIX) and EXPERT.match(name):
                for k, v in ct_compress(t).items():
                    packed[name.removesuffix(".weight") + "." + k] = v
            else:
                packed[name] = t
        tensors = packed
        quant = kimi_quantization_config()
        quant["ignore"] = list(quant["ignore"]) + ["re:.*vision_tower.*", "re:.*mm_projector.*"]
    elif fmt != "bf16":
        raise ValueError(fmt)
    _save(tensors, out, shards)
    (out / "config.json").write_text(json.dumps(top_config(text, quant), indent=2) + "\n")
    return out


def _quark_export(out: Path, tensors: dict[str, torch.Tensor], text: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Quark MXFP4 of the text model (a DeepseekV3ForCausalLM over the same tensors), prefix restored."""
    import transformers

    import quark_fixtures as qf

    q = qf._quark()
    work = out.parent / f".{out.name}-quark"
    if work.exists():
        shutil.rmtree(work)
    bf16, exported = work / "bf16", work / "export"
    bf16.mkdir(parents=True)
    lm = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
    save_file({k: v.contiguous() for k, v in lm.items()}, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    (bf16 / "config.json").write_text(json.dumps(dict(text, model_type="deepseek_v3"), indent=2))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(bf16), dtype=BF16).eval()
        q["preprocess_for_quantization"](model)
        spec = q["OCP_MXFP4Spec"]
        qcfg = q["QConfig"](global_quant_config=q["QLayerConfig"](
            weight=spec(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
            input_tensors=spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()), exclude=list(QUARK_EXCLUDE))
        quantizer = q["ModelQuantizer"](qcfg)
        model = quantizer.quantize_model(model, None)
        model = quantizer.freeze(model)
        q["export_safetensors"](model, str(exported), custom_mode="quark", weight_format="real_quantized",
                                pack_method="reorder")
        quant = json.loads((exported / "config.json").read_text())["quantization_config"]
        got: dict[str, torch.Tensor] = {}
        for f in sorted(exported.glob("*.safetensors")):
            got.update(load_file(str(f)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {PREFIX + k: v for k, v in got.items()}
    vision = {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}
    res.update(vision)
    # AMD's exports list excluded modules by full name (atom-layout-next.md §3.5)
    excluded = sorted({k.removesuffix(".weight") for k, v in res.items() if k.startswith(PREFIX + "model.layers.")
                       and k.endswith(".weight") and v.dim() == 2 and v.dtype != torch.uint8
                       and (".self_attn." in k or k.endswith(".mlp.gate.weight"))})
    excluded.append(PREFIX + "lm_head")
    excluded += sorted({k.rsplit(".", 1)[0] for k, v in vision.items() if v.dim() >= 2})
    quant["exclude"] = excluded
    return res, quant


if __name__ == "__main__":  # python tests/k25_fixtures.py OUT [bf16|fp8|mxfp4]
    import sys

    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    print(build_k25(Path(sys.argv[1]), fmt=sys.argv[2] if len(sys.argv) > 2 else "bf16"))
