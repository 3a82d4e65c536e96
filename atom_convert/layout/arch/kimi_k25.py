"""Kimi-K2.5 (`KimiK25ForConditionalGeneration`, model_type kimi_k25) -> ATOM's post-load layout.

The language model is Kimi-K2's (a DeepSeek-V3 text config in `text_config`, first_k_dense_replace 1,
no MTP) and is planned by deepseek.py unchanged, under the `language_model.` prefix that the
checkpoint and ATOM's parameter names share (atom/models/kimi_k25.py 25-102 at ffdf3bb5d: the wrapper
holds the DeepseekV2ForCausalLM as `self.language_model`; atom-layout-next.md §3.2, §3.3). The prefix
comes from the config (ModelSpec.text_prefix) and reaches the base loader through `roots`.

The vision tower and the projector (`vision_tower.*`, `mm_projector.*`, atom-layout-next.md §3.4):
- --profile atom: ATOM's native wrapper never builds them (`skip_weight_prefixes`); every such tensor is
  recorded in the manifest's `dropped` with that reason.
- --profile vllm-plugin: the plugin builds vLLM's MoonViT and projector beside ATOM's text model
  (atom/plugin/vllm/models/kimi_k25.py 187-290) and loads them with the mapper
  `mm_projector.proj.0 -> mm_projector.linear_1`, `mm_projector.proj.2 -> mm_projector.linear_2`; no
  post-load step of ATOM's touches them. So they are carried with their checkpoint bytes in bf16, whole
  on every rank (written once, in the common files where the layout has them), under the plugin's
  module paths: the checkpoint name with the mapper applied (`vision_tower.*` is unchanged), then the
  profile's `model.`. The entry's layout note keeps the checkpoint name.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterator

import torch

from ...errors import CheckpointError, UnsupportedError
from ...files.source import SourceCheckpoint
from ..codecs.base import SourceFormat
from ..model import ModelSpec
from ..parallel import Parallel
from ..plan import Group, ModelPlan, OutTensor
from ..profile import NamingProfile
from .deepseek import DeepseekLoader
from .deepseek_rules import BF16, _Ctx

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# MoonViT's block and the tower's other parts (atom-layout-next.md §3.1; the patch embedding under either of the
# two spellings §3.1 and §5.4 name).
BLOCK_PARTS = tuple(f"{m}.{p}" for m in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1") for p in ("weight", "bias"))
TOWER_PARTS = (("vision_tower.encoder.final_layernorm.weight",), ("vision_tower.encoder.final_layernorm.bias",),
               ("vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.patch_embed.pos_emb.weight"),
               ("vision_tower.patch_embed.proj.weight", "vision_tower.encoder.patch_embed.proj.weight"))
_BLOCK = re.compile(r"vision_tower\.encoder\.blocks\.(\d+)\.(.+)$")
# ATOM's plugin WeightsMapper for the projector (atom/plugin/vllm/models/kimi_k25.py 194-203).
PROJECTOR_MAP = (("mm_projector.proj.0.", "mm_projector.linear_1."), ("mm_projector.proj.2.", "mm_projector.linear_2."))
PROJECTOR_NAMES = ("mm_projector.proj.0.", "mm_projector.proj.2.", "mm_projector.pre_norm.")
NATIVE_DROP = ("Kimi-K2.5 vision tower / projector: ATOM's native KimiK25ForCausalLM never builds it "
               "(skip_weight_prefixes, atom/models/kimi_k25.py 39-42; atom-layout-next.md §3.4); convert with "
               "--profile vllm-plugin to carry it for ATOM's vLLM plugin")
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def plugin_name(name: str) -> str:
    """The ATOM-relative module path the vLLM plugin gives a checkpoint vision/projector tensor."""
    for a, b in PROJECTOR_MAP:
        if name.startswith(a):
            return b + name[len(a):]
    return name


def _carried(ctx: _Ctx, name: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    yield ctx.src.get(name).to(BF16, copy=True)


class KimiK25Loader(DeepseekLoader):
    """KimiK25ForConditionalGeneration: ATOM's KimiK25ForCausalLM around its DeepseekV2ForCausalLM
    (atom-layout-next.md §0 routing, §3.2)."""

    keys = (("KimiK25ForConditionalGeneration", "kimi_k25"),)

    def check_source(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, target: str,
                     par: Parallel, profile: NamingProfile) -> None:
        where = src.path / "config.json"
        # the official int4 release (compressed-tensors pack-quantized) arrives here only re-encoded by
        # --quantize (codecs/requant.py refuses it without); its format keeps the source's name
        if fmt.name not in ("bf16", "quark-mxfp4", "fp8-block", "ct-int4-pack"):
            raise UnsupportedError(
                f"{where}: a {fmt.name} Kimi-K2.5 checkpoint: atom-convert converts Kimi-K2.5 from bf16, AMD's Quark "
                f"MXFP4 export (amd/Kimi-K2.5-MXFP4), DeepSeek fp8 block, or the official int4 release with "
                f"--quantize mxfp4 / fp8 (atom-layout-next.md §4)")
        if profile.name == "vllm-plugin":
            self._check_vision(src, spec)

    def check_names(self, src: SourceCheckpoint, spec: ModelSpec) -> None:
        where = src.path / "config.json"
        if spec.n_mtp:
            raise UnsupportedError(f"{where}: text_config.num_nextn_predict_layers is {spec.n_mtp}; Kimi-K2.5 has no "
                                   f"MTP layer and ATOM's Kimi-K2.5 wrapper builds no drafter (atom-layout-next.md §0)")
        blocks = sorted(n for n in src.names() if n.startswith(f"{spec.text_prefix}model.blocks."))
        if blocks:
            info = src.info(blocks[0])
            raise CheckpointError(
                [f"{info.file}: tensor {blocks[0]} (and {len(blocks) - 1} more {spec.text_prefix}model.blocks.* "
                 f"tensors): the decoder layers are named `blocks`, as transformers' Kimi_K25 save writes them "
                 f"(atom-layout-next.md §5.4); Moonshot's checkpoint and ATOM say "
                 f"{spec.text_prefix}model.layers.{{i}}"],
                hint="Rename language_model.model.blocks. to language_model.model.layers. (and "
                     "vision_tower.encoder.patch_embed. to vision_tower.patch_embed., model.mm_projector. to "
                     "mm_projector.) before converting.")

    def _check_vision(self, src: SourceCheckpoint, spec: ModelSpec) -> None:
        where = src.path / "config.json"
        if not isinstance(src.config.get("vision_config"), dict):
            raise UnsupportedError(
                f"{where}: no vision_config; with --profile vllm-plugin ATOM's plugin builds Kimi-K2.5's vision "
                f"tower from it (atom/plugin/vllm/models/kimi_k25.py 160-186, atom-layout-next.md §3.4). Use the "
                f"checkpoint's own config.json, or convert with --profile atom (text only)")
        names = [n for n in src.names() if n.startswith(VISION_PREFIXES)]
        problems = []
        if not any(n.startswith("vision_tower.") for n in names):
            problems.append(f"{src.path}: no vision_tower.* tensor: --profile vllm-plugin carries Kimi-K2.5's vision "
                            f"tower for the plugin, which builds and loads it (atom-layout-next.md §3.4)")
        for need in ("mm_projector.proj.0.weight", "mm_projector.proj.2.weight"):
            if need not in src:
                problems.append(f"{src.path}: missing tensor {need}: the plugin loads the projector's two linears "
                                f"from mm_projector.proj.0 / .proj.2 (its mapper, atom/plugin/vllm/models/"
                                f"kimi_k25.py 194-203)")
        for n in names:
            info = src.info(n)
            if n.startswith("mm_projector.") and not n.startswith(PROJECTOR_NAMES):
                problems.append(f"{info.file}: tensor {n}: the plugin's projector has proj.0 (linear_1), proj.2 "
                                f"(linear_2) and pre_norm only; no module would take it")
            if info.dtype not in FLOATS:
                problems.append(f"{info.file}: tensor {n} has dtype {info.dtype}: the vision tower and projector are "
                                f"carried in bf16 for the plugin (AMD's exports keep them bf16: exclude "
                                f"*vision_tower* *mm_projector*); re-export them unquantized")
        problems += _tower_blocks(src, names) + _projector_shapes(src, spec)
        if problems:
            raise CheckpointError(problems, hint="Download the complete checkpoint (vision_tower.*, mm_projector.*), "
                                                 "or convert with --profile atom, which needs no vision tensor.")

    def plan_extras(self, ctx: _Ctx, main: ModelPlan, dropped: dict[str, str]) -> None:
        names = sorted(n for n in ctx.src.names() if n.startswith(VISION_PREFIXES))
        if ctx.profile.name != "vllm-plugin":
            dropped.update({n: NATIVE_DROP for n in names})
            return
        outs = []
        for n in names:
            info = ctx.src.info(n)
            ctx.consumed.add(n)
            outs.append(OutTensor(plugin_name(n), BF16, tuple(info.shape), (n,), partial(_carried, ctx, n),
                                  meta={"carried": "vision", "checkpoint_name": n}))
        main.groups.append(Group("vision", outs))


def _tower_blocks(src: SourceCheckpoint, names: list[str]) -> list[str]:
    """The vision encoder's blocks must be whole: indices 0..N-1 with N the vision_config's layer count
    (Moonshot's `vt_num_hidden_layers`, or transformers' `num_hidden_layers`), and every block holding the
    same tensors, in the same shapes and dtypes, as block 0. A hole in the carried tower would otherwise be
    found only when the server starts (load_into refuses a module tree with a parameter the manifest lacks),
    after the whole conversion, and its upload, had run."""
    vc = src.config["vision_config"]
    where = src.path / "config.json"
    blocks: dict[int, dict[str, Any]] = {}
    for n in names:
        m = _BLOCK.match(n)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = src.info(n)
    problems = []
    count = vc.get("vt_num_hidden_layers", vc.get("num_hidden_layers"))
    if isinstance(count, int) and not isinstance(count, bool) and sorted(blocks) != list(range(count)):
        have = sorted(blocks)
        missing = sorted(set(range(count)) - set(have))
        extra = [j for j in have if j >= count]
        problems.append(f"{src.path}: the vision tower holds encoder blocks {_ranges(have) or 'none'}, but "
                        f"{where.name} vision_config says {count} layer(s) (expected blocks 0..{count - 1}"
                        + (f"; missing {_ranges(missing)}" if missing else "")
                        + (f"; beyond it {_ranges(extra)}" if extra else "") + ")")
    for j in sorted(blocks):
        lacking = [part for part in BLOCK_PARTS if part not in blocks[j]]
        if lacking:
            problems.append(f"{src.path}: vision_tower.encoder.blocks.{j} lacks {', '.join(lacking)} (each block of "
                            f"the tower has {', '.join(BLOCK_PARTS)})")
    for need in TOWER_PARTS:
        if not any(n in src for n in need):
            problems.append(f"{src.path}: missing tensor {' or '.join(need)}")
    if 0 in blocks:
        ref = blocks[0]
        for j in sorted(blocks)[1:]:
            for part in sorted(set(ref) | set(blocks[j])):
                a, b = ref.get(part), blocks[j].get(part)
                name = f"vision_tower.encoder.blocks.{j}.{part}"
                if b is None:
                    if part not in BLOCK_PARTS:  # those are named above
                        problems.append(f"{src.path}: missing tensor {name} (block 0 has {part})")
                elif a is None:
                    problems.append(f"{b.file}: tensor {name}: block 0 has no {part}; every block of the tower "
                                    f"has the same tensors")
                elif (a.shape, a.dtype) != (b.shape, b.dtype):
                    problems.append(f"{b.file}: tensor {name} has shape {list(b.shape)} {b.dtype}, expected "
                                    f"{list(a.shape)} {a.dtype} as in block 0")
    return problems


def _projector_shapes(src: SourceCheckpoint, spec: ModelSpec) -> list[str]:
    """The projector maps the merged vision features to the text model's hidden size: proj.2's rows are
    text_config.hidden_size, proj.0's rows are proj.2's columns, and each bias has its weight's rows."""
    problems = []
    w0, w2 = "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"
    if w0 not in src or w2 not in src:
        return problems  # named missing above
    i0, i2 = src.info(w0), src.info(w2)
    if len(i2.shape) != 2 or i2.shape[0] != spec.H:
        problems.append(f"{i2.file}: tensor {w2} has shape {list(i2.shape)}, expected [{spec.H}, K]: its output is "
                        f"the text model's hidden_size ({spec.H})")
    if len(i0.shape) != 2:
        problems.append(f"{i0.file}: tensor {w0} has shape {list(i0.shape)}, expected a 2-D weight")
    elif len(i2.shape) == 2 and i0.shape[0] != i2.shape[1]:
        problems.append(f"{i0.file}: tensor {w0} has shape {list(i0.shape)}, expected 2-D with "
                        f"{i2.shape[1]} rows ({w2}'s input width)")
    for w, wi in ((w0, i0), (w2, i2)):
        b = w.removesuffix("weight") + "bias"
        bi = src.info(b) if b in src else None
        if bi is not None and len(wi.shape) == 2 and tuple(bi.shape) != (wi.shape[0],):
            problems.append(f"{bi.file}: tensor {b} has shape {list(bi.shape)}, expected [{wi.shape[0]}] ({w}'s rows)")
    return problems


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ", ".join(out)
