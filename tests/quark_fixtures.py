"""AMD Quark 0.13 MXFP4 exports of the tiny presets, and Quark's own MXFP4 codec as an oracle
(docs/test-fixtures.md §3).

`import quark.torch` takes 16-20 s, so nothing here imports Quark at module level: the first
call of any function below does (once per process), with QUARK_DISABLE_COMPILE=1 set before
(freeze() then skips torch.compile; the exported bytes are identical).

Styles:
- "template": Quark's LLMTemplate for the model, scheme "mxfp4" ("deepseek_v3" for
  tiny-deepseek-v3: attention bf16, dense/shared/routed MLP MXFP4; "kimi_k2" for tiny-kimi-k2:
  only the routed experts MXFP4, shared experts and dense MLP bf16).
- "all": every linear incl. attention MXFP4 (global OCP_MXFP4Spec, weight static, input
  dynamic), exclude ["lm_head"].
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

STYLES = ("template", "all")
TEMPLATE_OF = {"tiny-deepseek-v3": "deepseek_v3", "tiny-kimi-k2": "kimi_k2"}
HIDDEN = 256  # MXFP4 MoE needs hidden_size % 256 == 0 (spec §3.3.2, §10)

# Wall seconds of each export (filled by build_quark_export), and of the first quark import.
TIMINGS: dict[str, float] = {}
_QUARK: dict[str, Any] = {}


def _quark() -> dict[str, Any]:
    """Import Quark once, with torch.compile disabled first."""
    if not _QUARK:
        os.environ["QUARK_DISABLE_COMPILE"] = "1"
        t0 = time.perf_counter()
        import quark.torch.kernel  # noqa: F401  registers torch.ops.quark.*
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
        from quark.torch.quantization.config.config import OCP_MXFP4Spec, QConfig, QLayerConfig
        from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
        from quark.torch.utils.llm.model_preparation import preprocess_for_quantization
        from quark.torch.utils.numerics import to_e8m0_uint8
        from quark.torch.utils.pack import Pack_fp4, create_pack_method

        _QUARK.update(LLMTemplate=LLMTemplate, ModelQuantizer=ModelQuantizer, export_safetensors=export_safetensors,
                      OCP_MXFP4Spec=OCP_MXFP4Spec, QConfig=QConfig, QLayerConfig=QLayerConfig,
                      FakeQuantizeBase=FakeQuantizeBase, preprocess_for_quantization=preprocess_for_quantization,
                      to_e8m0_uint8=to_e8m0_uint8, Pack_fp4=Pack_fp4, create_pack_method=create_pack_method,
                      kernel=quark.torch.kernel)
        TIMINGS["import quark.torch"] = time.perf_counter() - t0
    return _QUARK


def _quant_config(preset: str, style: str) -> Any:
    q = _quark()
    if style == "template":
        return q["LLMTemplate"].get(TEMPLATE_OF[preset]).get_config(scheme="mxfp4")
    if style == "all":
        spec = q["OCP_MXFP4Spec"]
        return q["QConfig"](global_quant_config=q["QLayerConfig"](
            weight=spec(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
            input_tensors=spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()), exclude=["lm_head"])
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def build_quark_export(out: str | Path, preset: str, style: str, seed: int = 0) -> Path:
    """A tiny bf16 checkpoint of `preset` (hidden_size 256, no MTP layer), quantized to MXFP4 by
    Quark in memory and exported with `export_safetensors(..., custom_mode="quark",
    weight_format="real_quantized", pack_method="reorder")` into `out`."""
    import transformers

    from atom_convert.synth import build_tiny, load_preset

    q = _quark()
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    cfg = load_preset(preset)
    cfg["hidden_size"] = HIDDEN
    cfg["num_nextn_predict_layers"] = 0
    kimi = cfg.get("model_type") == "kimi_k2"
    # The bf16 source must exist while exporting (Quark reads it back for weights it did not touch).
    bf16 = out.parent / f".{out.name}-bf16"
    if bf16.exists():
        shutil.rmtree(bf16)
    build_tiny(cfg, bf16, seed=seed)
    if kimi:  # transformers builds Kimi-K2 as deepseek_v3 (docs/test-fixtures.md §1)
        c = json.loads((bf16 / "config.json").read_text())
        c["model_type"] = "deepseek_v3"
        (bf16 / "config.json").write_text(json.dumps(c, indent=2))
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16).eval()
        q["preprocess_for_quantization"](model)  # fused v5 experts -> per-expert nn.Linear (QuarkExperts)
        quantizer = q["ModelQuantizer"](_quant_config(preset, style))
        model = quantizer.quantize_model(model, None)
        model = quantizer.freeze(model)
        q["export_safetensors"](model, str(out), custom_mode="quark", weight_format="real_quantized",
                                pack_method="reorder")
    finally:
        shutil.rmtree(bf16, ignore_errors=True)
    if kimi:  # real Kimi-K2 files say kimi_k2
        c = json.loads((out / "config.json").read_text())
        c["model_type"] = "kimi_k2"
        (out / "config.json").write_text(json.dumps(c, indent=2))
    TIMINGS[f"{preset}-{style}"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------------
# Quark's own MXFP4 codec on plain tensors (docs/test-fixtures.md §3, "Reference MXFP4 ...")
# ------------------------------------------------------------------------------------------------


def quark_unpack(packed: torch.Tensor) -> torch.Tensor:
    """fp32 e2m1 values of packed uint8 [..., K/2] by Quark's unpacker (code 8 -> -0.0)."""
    return _quark()["Pack_fp4"]("per_group", "fp4").unpack(packed, False)


def quark_dequantize(packed: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """fp32 values of a Quark MXFP4 weight: unpacked codes x 2^(scale - 127) per 32 inputs."""
    vals = quark_unpack(packed)
    return vals * torch.exp2(scale_u8.float() - 127).repeat_interleave(32, -1)


def quark_mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quark's OCP MXFP4 quantizer along the last dim: (packed uint8 [..., K/2], e8m0 uint8
    [..., K/32], Quark's QDQ tensor). Mirrors Quark's file2file `_single_stage_quantize_weight`."""
    q = _quark()
    cfg = q["OCP_MXFP4Spec"](ch_axis=-1, is_dynamic=False).to_quantization_spec()
    fq = q["FakeQuantizeBase"].get_fake_quantize(cfg)
    fq.enable_observer()
    fq.disable_fake_quant()
    fq(w)
    codes = q["kernel"].scaled_real_quantize(cfg.dtype.value, w, fq.scale, fq.zero_point, cfg.ch_axis, cfg.group_size,
                                             fq.quant_min, fq.quant_max, cfg.round_method.value, cfg.qscheme.value)
    packed = q["create_pack_method"](qscheme=cfg.qscheme.value, dtype=cfg.dtype.value).pack(codes, False)
    scale_u8 = q["to_e8m0_uint8"](fq.scale)
    fq.disable_observer()
    fq.enable_fake_quant()
    qdq = fq(w)
    return packed, scale_u8, qdq

