"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, model_type deepseek_v32) -> ATOM's post-load layout.

Everything but the sparse-attention "lightning indexer" is DeepSeek-V3's and is planned by
deepseek.py unchanged (atom-layout-next.md §1.5). This module adds, to every decoder layer and to
the MTP block, the indexer's tensors as ATOM holds them after its load and post-load
(atom/models/deepseek_v2.py 1938-2252 at ffdf3bb5d; atom-layout-next.md §1.2-§1.6), all of them
replicated on every rank at any tp, with EP and with DP-attention alike:

- `self_attn.indexer.wq_b`: a ReplicatedLinear with the attention's quant spec: for a DeepSeek fp8
  source exactly `q_b_proj`'s per_1x128 post-load (fnuz + doubled scale on gfx942, shuffle16), never
  TP-sliced; bf16 unshuffled for a bf16 source.
- fused (the default: ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION=1, index_head_dim 128,
  qk_rope_head_dim 64): `self_attn.indexer.wk_weights_proj.weight` bf16 [Dh + Ih, H], rows [0, Dh)
  the checkpoint's wk (an fp8 wk dequantised per 128x128 block as bf16(fp32(w) x fp32(scale)), no
  fnuz), rows [Dh, Dh + Ih) weights_proj cast to bf16; unshuffled. Beside it the vestigial fp32
  `wk_weights_proj.weight_scale` [ceil(Dh/128), ceil(H/128)] forward never reads: the checkpoint's
  raw wk scale (fp8 source); for a bf16 source ATOM leaves it `torch.empty`, written here as zeros.
- unfused (index_head_dim != 128 or qk_rope_head_dim != 64): `wk` like `wq_b`, `weights_proj` bf16.
- `self_attn.indexer.k_norm.{weight,bias}`: a LayerNorm's fp32 parameters.

--profile vllm-plugin: the same tensors and bytes under the plugin profile's names
(`model.model.layers.{i}.self_attn.indexer.*`, the drafter's `model.model.layers.{n}.mtp_block.self_attn.
indexer.*`); see `_PROFILES` for why nothing else changes.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterator

import torch

from ...errors import UnsupportedError
from ...files.source import SourceCheckpoint
from ..codecs.base import LinearCodec, SourceFormat
from ..codecs.bf16 import Bf16Linear
from ..codecs.fp8_block import block_dequant, scale_grid
from ..model import ModelSpec
from ..parallel import Parallel
from ..plan import OutTensor
from ..profile import NamingProfile
from .deepseek import GLM_FLAG_DEFAULTS, INDEXER_FLAG_DEFAULTS, DeepseekLoader
from .deepseek_rules import BF16, LinearRule, Par, _check_float, _Ctx, _plan_linear

F32 = torch.float32
INDEXER = "self_attn.indexer."
# The five tensors of every indexer in the checkpoint (atom-layout-next.md §1.1).
INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
FP8_BLOCK = 128

WQ_B = LinearRule(INDEXER + "wq_b", (INDEXER + "wq_b",), Par.REPLICATED, lambda s: ((s.Ih * s.Dh, s.Q),))
WK = LinearRule(INDEXER + "wk", (INDEXER + "wk",), Par.REPLICATED, lambda s: ((s.Dh, s.H),))
WEIGHTS_PROJ = LinearRule(INDEXER + "weights_proj", (INDEXER + "weights_proj",), Par.REPLICATED,
                          lambda s: ((s.Ih, s.H),))

# The profiles whose V3.2/GLM tree is modelled. Under vLLM (atom/plugin/vllm at ffdf3bb5d) ATOM builds the
# same DeepseekV2ForCausalLM subclasses (model_wrapper.py 147, 149) with the same Indexer (deepseek_v2.py
# 2149-2222: its plugin decorator swaps a forward op only, layer_sparse_mla.py 570-585); the sparse MLA layer
# (attention/layer.py 70-77, layer_mla.py 1439-1440) is the dense one with another backend, so the
# vllm-plugin profile's renaming (`model.` prefix, W_* on mla_attn) is the whole difference. The plugin's
# default excludes for V3.2 (`*.indexer.weights_proj`, `*.indexer.wk_weights_proj`, deepseek_v2.py 3426-3432,
# applied at model_wrapper.py 483-485) match only modules ATOM builds with quant_config=None anyway
# (deepseek_v2.py 1997, 2206-2211) and not `indexer.wk`, whose spec decides the fusion (321-347).
_PROFILES = ("atom", "vllm-plugin")

_INDEXER_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.indexer\.")
_FORMAT_WORDS = {"bf16": "bf16", "fp8-block": "DeepSeek fp8 block", "quark-mxfp4": "Quark MXFP4 (MoE-only)"}
_LAYER_OF = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fuses_wk_weights_proj(spec: ModelSpec) -> bool:
    """ATOM's `_can_fuse_indexer_wk_weights_proj` and the Indexer's own kernel condition at the
    default flags, for the formats converted here (deepseek_v2.py 284-347, 2179-2190): the flag is 1,
    index_head_dim is 128 and qk_rope_head_dim is 64 (= index_head_dim / 2); a bf16 or fp8 wk."""
    glm_ok = spec.model_type != "glm_moe_dsa" or GLM_FLAG_DEFAULTS["ATOM_ENABLE_GLM_FUSED_INDEXER"] == 1
    return (INDEXER_FLAG_DEFAULTS["ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION"] == 1 and glm_ok and spec.Dh == 128
            and spec.R == 64)


def _plain_fp32(ctx: _Ctx, src_name: str, out_name: str, length: int) -> list[OutTensor]:
    """A LayerNorm parameter ATOM builds in fp32 (`LayerNorm(Dh, dtype=float32)`): the checkpoint's
    value cast to fp32 by `default_weight_loader`'s copy_ (atom/model_loader/loader.py 47-49)."""
    if not _check_float(ctx, src_name, (length,)):
        return []

    def produce(rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
        yield ctx.src.get(src_name).to(F32, copy=True)

    return [OutTensor(out_name, F32, (length,), (src_name,), produce)]


def _wk_bf16(ctx: _Ctx, codec: LinearCodec, module: str) -> torch.Tensor:
    """The checkpoint's wk as ATOM writes it into rows [0, Dh) of wk_weights_proj: an fp8 one
    through `_dequant_fp8_block_to_bf16` (deepseek_v2.py 1938-1977: the fp32 product of the e4m3fn
    value and its block's fp32 scale, rounded once to bf16; on gfx942 too, no fnuz), a bf16 one as is."""
    d = codec.read(ctx.src, module)
    if codec.name == "fp8-block":
        return block_dequant(d.weight, d.scale).to(BF16)
    return d.weight.to(BF16)


def _fused_weight(ctx: _Ctx, codec: LinearCodec, sp: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    wk = _wk_bf16(ctx, codec, sp + WK.parts[0])
    # MergedReplicatedLinear's shard 1: `.to(bf16)` of a float source (linear.py 579-591, 2061-2089)
    wp = ctx.src.get(sp + WEIGHTS_PROJ.parts[0] + ".weight").to(BF16)
    yield torch.cat([wk, wp], 0)


def _fused_scale(ctx: _Ctx, codec: LinearCodec, sp: str, shape: tuple[int, int], rank: int,
                 cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    if codec.name == "fp8-block":
        # IndexerWkWeightsProjLinear.weight_loader copies the checkpoint scale when its shape is the
        # parameter's (deepseek_v2.py 2033-2039); no post-load step touches it (quant_type No).
        yield ctx.src.get(sp + WK.parts[0] + ".weight_scale_inv").to(F32, copy=True)
    else:
        yield torch.zeros(shape, dtype=F32)  # never written by ATOM: torch.empty there


def _plan_fused(ctx: _Ctx, sp: str, op: str) -> list[OutTensor]:
    s = ctx.spec
    wk_mod, wp_mod = sp + WK.parts[0], sp + WEIGHTS_PROJ.parts[0]
    codec = ctx.fmt.codec_for(wk_mod)
    ctx.problems.extend(codec.check(ctx.src, wk_mod, s.Dh, s.H))
    ctx.consumed.update(codec.source_names(wk_mod))
    _check_weights_proj(ctx, wp_mod)
    if codec.name == "fp8-block" and (s.Dh % FP8_BLOCK or s.H % FP8_BLOCK):
        raise UnsupportedError(
            f"{wk_mod}: an fp8 indexer wk of [{s.Dh}, {s.H}] (index_head_dim, hidden_size): ATOM dequantises it "
            f"per 128x128 block into the bf16 wk_weights_proj and raises unless both are multiples of 128 "
            f"(deepseek_v2.py 1962-1966, atom-layout-next.md §6). Store wk in bf16 (and list it in the "
            f"quantization_config's modules_to_not_convert), or use dimensions that are multiples of 128")
    sources = tuple(codec.source_names(wk_mod)) + (wp_mod + ".weight",)
    name = f"{op}{INDEXER}wk_weights_proj"
    grid = scale_grid((s.Dh, s.H))
    outs = [OutTensor(f"{name}.weight", BF16, (s.Dh + s.Ih, s.H), sources, partial(_fused_weight, ctx, codec, sp))]
    if codec.name == "fp8-block":
        scale_sources: tuple[str, ...] = (wk_mod + ".weight_scale_inv",)
        meta = {"vestigial": "wk's checkpoint block scale, kept by ATOM's loader; forward never reads it"}
    else:
        scale_sources = ()
        meta = {"vestigial": "never written by ATOM (torch.empty there; zeros here); forward never reads it"}
    outs.append(OutTensor(f"{name}.weight_scale", F32, grid, scale_sources,
                          partial(_fused_scale, ctx, codec, sp, grid), meta=meta))
    return outs


def _check_weights_proj(ctx: _Ctx, module: str) -> None:
    """weights_proj is unquantized in ATOM whatever the quantization_config says (quant_config=None,
    deepseek_v2.py 1997, 2206-2211): a float tensor, no scale."""
    s = ctx.spec
    for suffix in (".weight_scale_inv", ".weight_scale"):
        if module + suffix in ctx.src:
            info = ctx.src.info(module + suffix)
            ctx.problems.append(
                f"{info.file}: tensor {module}{suffix} ({info.dtype}, {list(info.shape)}): ATOM builds the indexer's "
                f"weights_proj unquantized and would drop this scale; DeepSeek-V3.2 stores weights_proj in bf16. "
                f"Re-export it in bf16")
            ctx.consumed.add(module + suffix)
    _check_float(ctx, module + ".weight", (s.Ih, s.H))


def plan_indexer(ctx: _Ctx, sp: str, op: str) -> list[OutTensor]:
    """The indexer of one decoder layer or MTP block (source prefix sp, output prefix op)."""
    s = ctx.spec
    outs = _plan_linear(ctx, WQ_B, sp, op)
    if fuses_wk_weights_proj(s):
        outs += _plan_fused(ctx, sp, op)
    else:
        outs += _plan_linear(ctx, WK, sp, op)
        _check_weights_proj(ctx, sp + WEIGHTS_PROJ.parts[0])
        outs += _plan_linear(ctx, WEIGHTS_PROJ, sp, op, [Bf16Linear()])
    for p in ("k_norm.weight", "k_norm.bias"):
        outs += _plain_fp32(ctx, sp + INDEXER + p, op + INDEXER + p, s.Dh)
    return outs


def _layers_with_indexer_tensors(src: SourceCheckpoint) -> set[int]:
    return {int(m.group(1)) for name in src.names() if (m := _INDEXER_RE.match(name))}


def _missing_indexers(src: SourceCheckpoint, spec: ModelSpec) -> list[int]:
    """Decoder layers ATOM builds an indexer for that hold no indexer tensor at all (a missing MTP one
    is reported per tensor when the MTP layer is converted)."""
    have = _layers_with_indexer_tensors(src)
    return sorted(i for i in range(spec.n_layers) if spec.has_indexer_at(i) and i not in have)


def _stray_indexers(src: SourceCheckpoint, spec: ModelSpec) -> list[int]:
    """Decoder layers that hold indexer tensors although ATOM builds no indexer there (IndexShare)."""
    return sorted(i for i in _layers_with_indexer_tensors(src) if i < spec.n_layers and not spec.has_indexer_at(i))


def _layers(ids: list[int]) -> str:
    return f"{', '.join(map(str, ids[:8]))}{' ...' if len(ids) > 8 else ''}"


class DeepseekV32Loader(DeepseekLoader):
    """DeepseekV32ForCausalLM: ATOM builds it as its DeepseekV2ForCausalLM with an Indexer in every
    layer's attention and in the MTP block (atom-layout-next.md §0, §1.2, §1.6)."""

    keys = (("DeepseekV32ForCausalLM", "deepseek_v32"),)
    extra_flags = dict(INDEXER_FLAG_DEFAULTS)
    family = "DeepSeek-V3.2"  # in messages
    formats: tuple[str, ...] = ("bf16", "fp8-block")

    def attn_extras(self, ctx: _Ctx, src_prefix: str, out_prefix: str) -> list[OutTensor]:
        # the layer index as ATOM reads it off the module prefix (`_extract_layer_index_from_prefix`)
        m = _LAYER_OF.search(src_prefix)
        if m is not None and not ctx.spec.has_indexer_at(int(m.group(1))):
            return []  # an IndexShare "shared" layer: no Indexer, no parameters (atom-layout-next.md §2.2)
        return plan_indexer(ctx, src_prefix, out_prefix)

    def check_source(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, target: str,
                     par: Parallel, profile: NamingProfile) -> None:
        where = src.path / "config.json"
        if profile.name not in _PROFILES:
            raise UnsupportedError(
                f"{where}: {self.family} with --profile {profile.name}: atom-convert models {self.family}'s module "
                f"tree for ATOM's native server and its vLLM plugin only (an SGLang-style plugin replaces the MLA "
                f"post-load step with its own, atom-layout-plugin.md §6). Convert with --profile "
                f"{' or --profile '.join(_PROFILES)}")
        if fmt.name not in self.formats:
            raise UnsupportedError(
                f"{where}: a {fmt.name} {self.family} checkpoint: atom-convert converts {self.family} from its "
                f"{' or '.join(_FORMAT_WORDS[f] for f in self.formats)} release only (the indexer's layout under "
                f"other formats is not modelled, atom-layout-next.md §1.5). Convert the fp8 release, or a bf16 copy")
        if spec.Q is None:
            raise UnsupportedError(f"{where}: q_lora_rank is missing; {self.family}'s indexer projects the q_lora "
                                   f"latent (wq_b [index_n_heads·index_head_dim, q_lora_rank]), so ATOM needs it")
        if spec.Dh <= spec.R:
            raise UnsupportedError(f"{where}: index_head_dim {spec.Dh} must exceed qk_rope_head_dim {spec.R}: the "
                                   f"indexer ropes the first {spec.R} of its head dims")
        missing = _missing_indexers(src, spec)
        if missing:
            which = ("on every layer" if spec.indexer_types is None else
                     "on every layer that config.json's indexer_types marks \"full\"")
            raise UnsupportedError(
                f"{src.path}: layer(s) {_layers(missing)} hold no self_attn.indexer.* tensor; ATOM builds "
                f"{self.family}'s indexer {which} (MTP included) and needs all five ({', '.join(INDEXER_TENSORS)}, "
                f"atom-layout-next.md §1.1, §2.2, §6). Download the complete checkpoint"
                + ("" if spec.indexer_types is None else ", or fix indexer_types"))
        stray = _stray_indexers(src, spec)
        if stray:
            raise UnsupportedError(
                f"{src.path}: layer(s) {_layers(stray)} hold self_attn.indexer.* tensors, but config.json's "
                f"indexer_types marks them \"shared\": ATOM builds no indexer there (IndexShare, "
                f"atom-layout-next.md §2.2) and would not load them. The config does not match the checkpoint: "
                f"fix indexer_types (\"full\" for those layers) or use the config.json the checkpoint came with")
