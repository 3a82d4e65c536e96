"""Small real checkpoints from the presets in atom_convert/configs/, for the demo, tests and benches.

`build_tiny` uses transformers' own DeepseekV2/V3 classes, so the tensors
carry the names, shapes and dtypes transformers writes (router in fp32). The
MTP layer (which transformers does not model) is written by hand with the
names DeepSeek-V3 ships. `quantize_fp8` applies DeepSeek's 128x128 block rule
with partial edge blocks (docs/test-fixtures.md §2).

`source_inventory` enumerates a checkpoint's names and shapes from config
alone; `build_random` streams random tensors of any width straight to disk
(a full-width layer does not fit a test machine's memory through transformers).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from .layout.model import ModelSpec
from .layout.codecs.fp8_block import block_quant, scale_grid

# Shipped inside the package (pyproject [tool.setuptools.package-data]) so that an installed wheel
# finds them; the repository root's configs/ is a link to this folder.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# Linear weights that DeepSeek keeps in bf16 in its fp8 release; the MTP eh_proj among them (R1/V3/V3.2
# fp8 store it in bf16 without a scale: ATOM's atom/models/deepseek_mtp.py 288-300 says so and relies on it).
_NOT_QUANTIZED = re.compile(r".*(mlp\.gate\.weight|embed_tokens\.weight|lm_head\.weight|shared_head\.head\.weight|norm\.weight|layernorm\.weight|enorm\.weight|hnorm\.weight|eh_proj\.weight)$")


def quark_mxfp4_config(exclude: list[str]) -> dict[str, Any]:
    """A Quark 0.13 export's quantization_config for OCP MXFP4 weights (as Quark writes it)."""
    spec = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "is_dynamic": False,
            "scale_format": "e8m0", "scale_calculation_mode": "even", "round_method": "half_even",
            "observer_cls": "PerBlockMXObserver", "scale_type": "float", "symmetric": None, "mx_element_dtype": None}
    return {"quant_method": "quark", "version": "0.13", "quant_mode": "eager_mode",
            "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "exclude": exclude,
            "global_quant_config": {"weight": spec, "input_tensors": dict(spec, is_dynamic=True),
                                    "output_tensors": None, "bias": None},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "kv_cache_quant_config": {},
            "algo_config": None, "softmax_quant_spec": None}


def load_preset(name: str) -> dict[str, Any]:
    """A preset from atom_convert/configs/ by name ('tiny-deepseek-v3') or path."""
    p = Path(name)
    if not p.suffix:
        p = CONFIG_DIR / f"{name}.json"
    cfg = json.loads(p.read_text())
    cfg.pop("_comment", None)
    return cfg


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    names = sorted(tensors, key=_natural)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        part = names[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def quantize_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek fp8 release rule: every 2-D linear weight except router, embeddings,
    heads and norms becomes e4m3fn with a `weight_scale_inv` per 128x128 block."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and not _NOT_QUANTIZED.match(name):
            q, s = block_quant(t)
            out[name] = q
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = s
        else:
            out[name] = t
    return out


def _mtp_tensors(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP layer j = num_hidden_layers: a full MoE decoder layer plus
    embed_tokens, enorm, hnorm, eh_proj and shared_head (names as shipped)."""
    n, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    last = f"model.layers.{n - 1}."
    out = {}
    for name, t in tensors.items():
        if name.startswith(last):
            new = f"model.layers.{n}." + name[len(last):]
            out[new] = _like(t, gen)
    j = f"model.layers.{n}."
    out[j + "embed_tokens.weight"] = _rand((V, H), torch.bfloat16, gen)
    out[j + "enorm.weight"] = 1 + 0.1 * _rand((H,), torch.bfloat16, gen)
    out[j + "hnorm.weight"] = 1 + 0.1 * _rand((H,), torch.bfloat16, gen)
    out[j + "eh_proj.weight"] = 0.02 * _rand((H, 2 * H), torch.bfloat16, gen)
    out[j + "shared_head.norm.weight"] = 1 + 0.1 * _rand((H,), torch.bfloat16, gen)
    out[j + "shared_head.head.weight"] = 0.02 * _rand((V, H), torch.bfloat16, gen)
    return out


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    scale = float(t.float().std()) if t.numel() > 1 else 1.0
    return (torch.randn(t.shape, generator=gen, dtype=torch.float32) * (scale or 0.02) + float(t.float().mean())).to(t.dtype)


def build_tiny(preset: str | dict[str, Any], out: str | Path, *, fmt: str = "bf16", seed: int = 0, shards: int = 1,
               overwrite: bool = False) -> Path:
    """A tiny random checkpoint built with transformers from an atom_convert/configs/ preset.

    fmt: "bf16" or "fp8" (DeepSeek block fp8 with partial blocks).
    The config.json written is the preset itself (model_type kimi_k2 kept),
    plus quantization_config for fp8.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cfg = load_preset(preset) if isinstance(preset, str) else dict(preset)
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(out)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    arch = cfg["architectures"][0]
    hf_cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "quantization_config", "architectures")}
    # transformers only knows deepseek_v3 (docs/test-fixtures.md §1, trap 2); the file keeps kimi_k2.
    hf_cfg["model_type"] = "deepseek_v2" if arch == "DeepseekV2ForCausalLM" else "deepseek_v3"
    hf_cfg["num_nextn_predict_layers"] = 0
    cls_cfg = transformers.DeepseekV2Config if arch == "DeepseekV2ForCausalLM" else transformers.DeepseekV3Config
    model_cls = getattr(transformers, arch)
    torch.manual_seed(seed)
    model = model_cls._from_config(cls_cfg(**hf_cfg), dtype=torch.bfloat16)  # keeps the router in fp32
    with torch.no_grad():  # transformers' init leaves some tensors at exactly 0 or 1; use fresh random data
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))
    tmp = out / ".hf"
    model.save_pretrained(tmp)
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if (tmp / "generation_config.json").exists():
        shutil.copy(tmp / "generation_config.json", out / "generation_config.json")
    shutil.rmtree(tmp)
    if cfg.get("num_nextn_predict_layers"):
        tensors.update(_mtp_tensors(cfg, tensors, torch.Generator().manual_seed(seed + 2)))
    if fmt == "fp8":
        tensors = quantize_fp8(tensors)
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
    elif fmt != "bf16":
        raise ValueError(f"fmt must be 'bf16' or 'fp8', got {fmt!r}")
    _save_sharded(tensors, out, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------------------------
# Full-width synthetic checkpoints without transformers
# ------------------------------------------------------------------------------------------------


def source_inventory(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of a DeepSeek/Kimi/GLM HF checkpoint, in file order.
    kind: 'linear' (quantizable weight), 'router', 'bias' (fp32), 'plain' (bf16).

    A Kimi-K2.5 config (text model in `text_config`): the text tensors under the checkpoint's
    `language_model.` prefix, then the vision tower and projector of its `vision_config`, all 'plain'
    (atom-layout-next.md §3.1)."""
    s = ModelSpec.from_config(cfg)
    for name, shape, kind in _text_inventory(s):
        yield s.text_prefix + name, shape, kind
    if s.text_prefix:
        yield from _vision_inventory(cfg)


def _text_inventory(s: ModelSpec) -> Iterator[tuple[str, tuple[int, ...], str]]:
    yield "model.embed_tokens.weight", (s.vocab, s.H), "plain"
    for i in range(s.n_layers + s.n_mtp):
        p = f"model.layers.{i}."
        if i >= s.n_layers:
            yield p + "embed_tokens.weight", (s.vocab, s.H), "plain"
            for n in ("enorm.weight", "hnorm.weight"):
                yield p + n, (s.H,), "plain"
            yield p + "eh_proj.weight", (s.H, 2 * s.H), "linear"
            yield p + "shared_head.norm.weight", (s.H,), "plain"
            yield p + "shared_head.head.weight", (s.vocab, s.H), "plain"
        yield p + "input_layernorm.weight", (s.H,), "plain"
        yield p + "post_attention_layernorm.weight", (s.H,), "plain"
        if s.Q is None:
            yield p + "self_attn.q_proj.weight", (s.Nh * (s.P + s.R), s.H), "linear"
        else:
            yield p + "self_attn.q_a_proj.weight", (s.Q, s.H), "linear"
            yield p + "self_attn.q_a_layernorm.weight", (s.Q,), "plain"
            yield p + "self_attn.q_b_proj.weight", (s.Nh * (s.P + s.R), s.Q), "linear"
        yield p + "self_attn.kv_a_proj_with_mqa.weight", (s.L + s.R, s.H), "linear"
        yield p + "self_attn.kv_a_layernorm.weight", (s.L,), "plain"
        yield p + "self_attn.kv_b_proj.weight", (s.Nh * (s.P + s.V), s.L), "linear"
        yield p + "self_attn.o_proj.weight", (s.H, s.Nh * s.V), "linear"
        if s.has_indexer_at(i):  # DeepSeek-V3.2 / GLM-5's indexer (atom-layout-next.md §1.1): weights_proj bf16
            q = p + "self_attn.indexer."
            yield q + "wq_b.weight", (s.Ih * s.Dh, s.Q), "linear"
            yield q + "wk.weight", (s.Dh, s.H), "linear"
            yield q + "k_norm.weight", (s.Dh,), "plain"
            yield q + "k_norm.bias", (s.Dh,), "plain"
            yield q + "weights_proj.weight", (s.Ih, s.H), "plain"
        if not s.is_moe_layer(i):
            for n in ("gate_proj", "up_proj"):
                yield p + f"mlp.{n}.weight", (s.Id, s.H), "linear"
            yield p + "mlp.down_proj.weight", (s.H, s.Id), "linear"
            continue
        yield p + "mlp.gate.weight", (s.E, s.H), "router"
        if s.has_correction_bias:
            yield p + "mlp.gate.e_score_correction_bias", (s.E,), "bias"
        for e in range(s.E):
            for n in ("gate_proj", "up_proj"):
                yield p + f"mlp.experts.{e}.{n}.weight", (s.I, s.H), "linear"
            yield p + f"mlp.experts.{e}.down_proj.weight", (s.H, s.I), "linear"
        if s.S:
            for n in ("gate_proj", "up_proj"):
                yield p + f"mlp.shared_experts.{n}.weight", (s.I * s.S, s.H), "linear"
            yield p + "mlp.shared_experts.down_proj.weight", (s.H, s.I * s.S), "linear"
    yield "model.norm.weight", (s.H,), "plain"
    yield "lm_head.weight", (s.vocab, s.H), "plain"


# Kimi-K2.5's vision tower (MoonViT) and projector at the release's width: its remote code's
# KimiK25VisionConfig defaults, in the `vt_*` schema of its config.json (atom-layout-next.md §3.1).
# `vt_num_hidden_layers` is 27 there; kimi_k25_config writes fewer blocks by default.
KIMI_K25_VISION = {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
                   "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
                   "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "merge_kernel_size": [2, 2],
                   "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
                   "_attn_implementation": "flash_attention_2", "mm_projector_type": "patchmerger",
                   "mm_hidden_size": 1152, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
                   "text_hidden_size": 7168}


def kimi_k25_config(text: dict[str, Any], *, vision_layers: int = 1) -> dict[str, Any]:
    """A Kimi-K2.5 (KimiK25ForConditionalGeneration) config.json around a Kimi-K2 text config: the text
    model in `text_config` (its own quantization_config and auto_map removed: the checkpoint's sit at the
    top level, atom-layout-next.md §3.1), a real-width `vision_config` with `vision_layers` encoder blocks."""
    text = {k: v for k, v in text.items() if k not in ("quantization_config", "auto_map")}
    text["model_type"] = "kimi_k2"
    vision = dict(KIMI_K25_VISION, vt_num_hidden_layers=vision_layers, text_hidden_size=text["hidden_size"])
    return {"architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                         "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                         "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
            "model_type": "kimi_k25", "bos_token_id": text.get("bos_token_id", 163584),
            "eos_token_id": text.get("eos_token_id", 163585), "ignore_index": -100,
            "media_placeholder_token_id": 163605, "tie_word_embeddings": False, "text_config": text,
            "vision_config": vision, "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>"}


def _vision_inventory(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Kimi-K2.5's vision tower and projector with the release's names (atom-layout-next.md §3.1; the
    shapes of transformers' Kimi_K25 modules): bf16 weights and biases, 'plain'."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError("a Kimi-K2.5 config needs a vision_config object (kimi_k25_config writes one)")
    h, inter, p = v["vt_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    mm = v.get("mm_hidden_size") or h
    merged = mm * math.prod(v["merge_kernel_size"])
    t = "vision_tower."
    yield t + "patch_embed.proj.weight", (h, 3, p, p), "plain"
    yield t + "patch_embed.proj.bias", (h,), "plain"
    yield t + "patch_embed.pos_emb.weight", (v["init_pos_emb_height"], v["init_pos_emb_width"], h), "plain"
    for j in range(v["vt_num_hidden_layers"]):
        b = f"{t}encoder.blocks.{j}."
        for module, out, inp in (("norm0", h, 0), ("norm1", h, 0), ("wqkv", 3 * h, h), ("wo", h, h),
                                 ("mlp.fc0", inter, h), ("mlp.fc1", h, inter)):
            yield b + module + ".weight", ((out, inp) if inp else (out,)), "plain"
            yield b + module + ".bias", (out,), "plain"
    yield t + "encoder.final_layernorm.weight", (h,), "plain"
    yield t + "encoder.final_layernorm.bias", (h,), "plain"
    for module, out, inp in (("pre_norm", mm, 0), ("proj.0", merged, merged),
                             ("proj.2", cfg["text_config"]["hidden_size"], merged)):
        yield f"mm_projector.{module}.weight", ((out, inp) if inp else (out,)), "plain"
        yield f"mm_projector.{module}.bias", (out,), "plain"


def mxfp4_in_export(name: str, text_prefix: str = "") -> bool:
    """Whether build_random's Quark MXFP4 export stores the linear weight `name` in MXFP4: the routed
    experts only (Quark's kimi_k2 template, Kimi-K2-Thinking-MXFP4); for a Kimi-K2.5 (`text_prefix`
    "language_model.") every MLP linear, layer 0's dense MLP and the shared experts too, as
    amd/Kimi-K2.5-MXFP4's recipe excludes only `*self_attn* *mlp.gate *lm_head *mm_projector*
    *vision_tower*` (atom-layout-next.md §3.5). (With full-name excludes and bf16 shared experts, ATOM's
    own loader disagrees with its model construction about the shared-expert fusion, §3.2.)"""
    return ".mlp." in name if text_prefix else ".mlp.experts." in name


def _random_tensors(name: str, shape: tuple[int, ...], kind: str, fmt: str, weights: str,
                    gen: torch.Generator, text_prefix: str = "") -> dict[str, torch.Tensor]:
    """One source tensor of `source_inventory` (and its scale), random, as build_random documents."""
    if fmt == "mxfp4" and kind == "linear":
        if not mxfp4_in_export(name, text_prefix):
            return {name: (torch.randn(shape, generator=gen) * shape[1] ** -0.5).to(torch.bfloat16)}
        return {name: torch.randint(0, 256, (shape[0], shape[1] // 2), generator=gen, dtype=torch.uint8),
                name.removesuffix(".weight") + ".weight_scale":
                    torch.randint(118, 124, (shape[0], shape[1] // 32), generator=gen, dtype=torch.uint8)}
    if kind == "linear" and fmt == "fp8" and name.endswith("eh_proj.weight"):
        return {name: (torch.randn(shape, generator=gen) * shape[1] ** -0.5).to(torch.bfloat16)}  # see _NOT_QUANTIZED
    if kind == "linear" and weights == "gaussian":
        w = (torch.randn(shape, generator=gen) * shape[1] ** -0.5).to(torch.bfloat16)
        if fmt == "fp8":
            q, s = block_quant(w)
            return {name: q, name.removesuffix(".weight") + ".weight_scale_inv": s}
        return {name: w}
    if kind == "linear" and fmt == "fp8":
        # Codes 0..253 with 0x7F moved to 0xFE: every e4m3fn code but the two NaNs (0x7F, 0xFF).
        b = torch.randint(0, 254, shape, generator=gen, dtype=torch.uint8)
        b += (b == 0x7F).to(torch.uint8) * 0x7F
        return {name: b.view(torch.float8_e4m3fn),
                name.removesuffix(".weight") + ".weight_scale_inv":
                    torch.rand(scale_grid(shape), generator=gen) * 1e-3 + 1e-4}
    if kind in ("router", "bias"):
        return {name: torch.randn(shape, generator=gen) * (0.02 if kind == "bias" else shape[1] ** -0.5)}
    if len(shape) == 1:  # norms
        return {name: (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)}
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}


def build_random(cfg: dict[str, Any], out: str | Path, *, fmt: str = "fp8", seed: int = 0,
                 shard_bytes: int = 4 * 1000**3, weights: str = "bytes", threads: int | None = None) -> Path:
    """Random checkpoint of any width, written shard by shard (memory: about two shards).

    weights="bytes": fp8 weights are random e4m3fn bytes (NaN codes excluded)
    with random positive scales, which exercises every byte path at a fraction
    of the cost of quantising random data (benches).
    weights="gaussian": linear weights are N(0, 1/in_features) in bf16, block
    quantised as DeepSeek does for fp8 (numerical checks).
    fmt="mxfp4": a Quark-style export with the routed experts in MXFP4 (random
    codes, e8m0 scales 2^-9..2^-4) and every other linear in bf16, as Quark's
    kimi_k2 template writes it. A Kimi-K2.5 config (kimi_k25_config) gives AMD's
    Kimi-K2.5-MXFP4 export's layout: `language_model.` text names, every MLP linear
    in MXFP4 (mxfp4_in_export), the quantization_config at the top level, attention,
    routers, lm_head, the vision tower and projector bf16 and in its exclude list.

    Tensors are generated on `threads` threads (default: the usable cores; torch's generators
    release the GIL), each from its own generator seeded by (seed, its index in the inventory),
    so the bytes depend on the seed only, not on the number of threads.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .engine.workers import usable_cores

    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    buf: dict[str, torch.Tensor] = {}
    size, k, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal buf, size, k
        if not buf:
            return
        k += 1
        fname = f"model-{k:05d}.safetensors"
        save_file(buf, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in buf})
        buf, size = {}, 0

    def make(i: int, name: str, shape: tuple[int, ...], kind: str) -> dict[str, torch.Tensor]:
        return _random_tensors(name, shape, kind, fmt, weights, torch.Generator().manual_seed((seed << 24) + i),
                               prefix)

    excluded: list[str] = []
    prefix = ModelSpec.from_config(cfg).text_prefix
    pending: list[tuple[Any, int]] = []  # futures in inventory order, with their planned bytes
    ahead = 0  # elements (1-4 bytes each) submitted and not yet taken: about a shard ahead at most
    with ThreadPoolExecutor(max_workers=threads or usable_cores()) as pool:
        inventory = iter(enumerate(source_inventory(cfg)))
        while True:
            while ahead < shard_bytes:
                nxt = next(inventory, None)
                if nxt is None:
                    break
                i, (name, shape, kind) = nxt
                if fmt == "mxfp4" and kind == "linear" and not mxfp4_in_export(name, prefix):
                    excluded.append(name.removesuffix(".weight"))
                elif fmt == "mxfp4" and prefix and (kind == "router" or not name.startswith(prefix)) and len(shape) > 1:
                    excluded.append(name.removesuffix(".weight"))  # K2.5's routers and vision modules: see below
                nbytes = math.prod(shape)  # elements: a size estimate
                pending.append((pool.submit(make, i, name, shape, kind), nbytes))
                ahead += nbytes
            if not pending:
                break
            fut, nbytes = pending.pop(0)
            ahead -= nbytes
            for n, t in fut.result().items():
                buf[n] = t
                size += t.numel() * t.element_size()
            if size >= shard_bytes:
                flush()
    flush()
    n = k
    renamed = {}
    for i in range(1, n + 1):
        src, dst = out / f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{n:05d}.safetensors"
        src.rename(out / dst)
        renamed[f"model-{i:05d}.safetensors"] = dst
    weight_map = {t: renamed[f] for t, f in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    if fmt == "fp8":
        cfg = dict(cfg, quantization_config=dict(FP8_QUANT_CONFIG))
    elif fmt == "mxfp4":
        # Kimi-K2.5: AMD's export names every excluded module in full, the routers, lm_head and the vision
        # modules included (`*self_attn* *mlp.gate *lm_head *mm_projector* *vision_tower*`, atom-layout-next.md §3.5)
        cfg = dict(cfg, quantization_config=quark_mxfp4_config(excluded + [prefix + "lm_head"]))
    else:
        cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
