"""DeepSeek V2/V2-Lite/V3/R1 and Kimi-K2 -> ATOM's post-load layout.

How it works:
1. Declarative tables (deepseek_rules.py) say, per decoder layer, which source modules feed
   which runtime module and how tensor parallelism splits them (spec §2, §5).
2. `DeepseekLoader.plan` checks every source tensor against config.json (name,
   dtype, shape, scale grid), then builds one `Group` of `OutTensor`s per layer.
3. Each `OutTensor` carries a producer that reads only its rank's slice of the
   sources when the writer asks for it, applies the post-load steps in ATOM's
   order (fnuz on gfx942, then shuffle16, spec §3.2), and yields the bytes.
4. Two code hooks cover what is not a table row: the expert stack (with the
   shared expert as slot E, deepseek_experts.py) and the MLA operands W_K/W_V
   (spec §4.1, deepseek_mla.py).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterator

import torch

from ...errors import BadInputError, CheckpointError, ConfigError, UnsupportedError
from ..model import ModelSpec
from ..parallel import Parallel
from ..plan import ConversionPlan, Group, ModelPlan, OutTensor
from ..profile import NamingProfile
from ..codecs.base import LinearCodec, SourceFormat
from ..codecs.bf16 import Bf16Linear
from ...files.source import SourceCheckpoint
from .base import ArchLoader
from .deepseek_experts import _plan_experts
from .deepseek_mla import MXFP4_ROUNDING, _plan_mla, kv_b_bf16, mla_operands  # noqa: F401  (re-exported)
from .deepseek_rules import (ATTENTION, BF16, DENSE_MLP, EH_PROJ, KV_B, MTP_VECTORS, NORMS, SHARED_MLP,  # noqa: F401
                             Dims, LinearRule, Par, _Ctx, _plain, _plan_linear)

# §6.2). A conversion records the values it assumed (the defaults, but ATOM_USE_TRITON_MXFP4_BMM
# under --mla-bmm mxfp4) so that a runtime with other flags refuses the files (spec §8.10); a
# runtime's unset flag counts with its default here (runtime/common.live_flags).
_MLA_FLAG_DEFAULTS: dict[str, int] = {
    "ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE": 1,
    "ATOM_FP8_BLOCKSCALE_USE_E8M0_SCALE": 0,
    "ATOM_USE_TRITON_GEMM": 0,
    "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": 0,
    "ATOM_USE_TRITON_MXFP4_BMM": 0,
    "ATOM_MOE_GU_ITLV": 0,
    "ATOM_FUSE_SHARED_EXPERT": 1,
}
# DeepSeek-V3.2's indexer: 1 fuses wk and weights_proj into one bf16 wk_weights_proj, 0 keeps them
# apart (atom-layout-next.md §1.8, §6); recorded by the V3.2 loader only (deepseek_v32.py).
INDEXER_FLAG_DEFAULTS: dict[str, int] = {"ATOM_ENABLE_DS_INDEXER_QK_ROPE_CACHE_FUSION": 1}
# GLM-5 (glm_moe_dsa): 1 lets the GLM indexer take the same fused wk_weights_proj, and 1 holds the whole
# vocabulary embedding on every rank (atom-layout-next.md §2.2, §6); recorded by glm_moe_dsa.py.
GLM_FLAG_DEFAULTS: dict[str, int] = {"ATOM_ENABLE_GLM_FUSED_INDEXER": 1, "ATOM_REPLICATE_VOCAB_EMBED": 1}
# Every layout flag's ATOM default (what a runtime's unset flag counts as, runtime/common.live_flags).
ATOM_FLAG_DEFAULTS: dict[str, int] = {**_MLA_FLAG_DEFAULTS, **INDEXER_FLAG_DEFAULTS, **GLM_FLAG_DEFAULTS}
# The manifest's flags: the ATOM_* values plus the config's MoE backend. Expert parallel and the
# tensor-parallel size are facts of the manifest's `parallel` record, stated once there.
LAYOUT_FLAGS: dict[str, Any] = {**_MLA_FLAG_DEFAULTS, "moe_backend": "standard"}

# Source names dropped by ATOM's name rewriting (spec §1.2 rule 3).
DROP_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*kv_scale$"), "kv-cache scale: ATOM never loads one; MLA uses k-scale 1.0 (spec §1.2 rule 3)"),
    (re.compile(r".*inv_freq.*"), "rotary inv_freq: rebuilt by the runtime (spec §1.2 rule 3)"),
)


# --------------------------------------------------------------------------------------------
# Layers and the whole model
# --------------------------------------------------------------------------------------------


def _plan_layer(ctx: _Ctx, i: int, src_prefix: str, out_prefix: str, plan: ModelPlan) -> list[OutTensor]:
    s = ctx.spec
    if s.Nh % ctx.tp:
        raise UnsupportedError(f"num_attention_heads {s.Nh} is not divisible by tp={ctx.tp} (ATOM asserts it, spec §4.3)")
    outs: list[OutTensor] = []
    for name, n in NORMS:
        length = n(s)
        if length is not None:
            outs += _plain(ctx, src_prefix + name, out_prefix + name, (length,))
    if s.Q is not None and ctx.fmt.codec_for(src_prefix + "self_attn.q_a_proj").name == "mxfp4":
        # HEAD keeps a static-MXFP4 fused_qkv_a_proj's quant config for q_b_proj and kv_b_proj too
        # (spec §2.2); a bf16 one of them would be loaded into an MXFP4 parameter.
        for part in ("self_attn.q_b_proj", "self_attn.kv_b_proj"):
            if ctx.fmt.codec_for(src_prefix + part).name != "mxfp4":
                raise UnsupportedError(
                    f"{src_prefix}self_attn: q_a_proj is MXFP4 but {part.split('.')[-1]} is "
                    f"{ctx.fmt.codec_for(src_prefix + part).name} in the Quark config; ATOM then builds "
                    f"q_b_proj and kv_b_proj as MXFP4 (spec §2.2) and cannot load this layer"
                )
    for rule in ATTENTION:
        if rule.when(s):
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
    outs += _plan_mla(ctx, src_prefix, out_prefix)
    if ctx.attn_extras is not None:
        outs += ctx.attn_extras(ctx, src_prefix, out_prefix)
    if not s.is_moe_layer(i):
        for rule in DENSE_MLP:
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
        return outs
    gate = f"{src_prefix}mlp.gate.weight"
    outs += _plain(ctx, gate, f"{out_prefix}mlp.gate.weight", (s.E, s.H))
    if s.has_correction_bias:
        bias = f"{out_prefix}mlp.gate.e_score_correction_bias"
        outs += _plain(ctx, f"{src_prefix}mlp.gate.e_score_correction_bias", bias, (s.E,))
        # One Parameter under two names at run time (spec §2.4, §10).
        plan.aliases[f"{out_prefix}mlp.experts.e_score_correction_bias"] = bias
    fused = False
    if s.S == 1:
        # HEAD fuses when shared and routed experts resolve to the same quant spec (spec §2.4).
        shared_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.shared_experts.gate_proj")
        routed_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.experts.0.gate_proj")
        # ATOM_FUSE_SHARED_EXPERT=0 turns fusion off under DP-attention with mori (spec atom-parallel.md §3.2).
        fused = shared_codec.name == routed_codec.name and ctx.par.fusion_allowed
        if fused and ctx.par.all2all and routed_codec.name != "mxfp4":
            # LOCAL_REPLICA: wired for the MXFP4 MoE method only (spec atom-parallel.md §1.2, §3.3).
            raise UnsupportedError(
                f"{src_prefix}mlp.experts: --dp-attention --ep with mori importable (--mori) and the shared expert "
                f"fused makes ATOM build its LOCAL_REPLICA layout, which raises NotImplementedError for a "
                f"{routed_codec.name} MoE (moe.py:2908-2914, spec atom-parallel.md §3.3). Add --shared-experts "
                f"separate (serve with ATOM_FUSE_SHARED_EXPERT=0), or drop --mori if mori is not installed there"
            )
    elif s.S > 1 and s.architecture != "DeepseekV2ForCausalLM":
        _refuse_wide_fused_shared(ctx, src_prefix)
    outs += _plan_experts(ctx, src_prefix, out_prefix, fused)
    layer_key = out_prefix.rstrip(".")
    if fused:
        plan.moe_layers[layer_key] = "fused_shared_expert"  # slot E of w13/w2
    elif s.S:
        for rule in SHARED_MLP:
            outs += _plan_linear(ctx, rule, src_prefix, out_prefix)
        plan.moe_layers[layer_key] = "separate_shared_experts"  # mlp.shared_experts.{gate_up,down}_proj
    else:
        plan.moe_layers[layer_key] = "no_shared_experts"
    return outs


def _refuse_wide_fused_shared(ctx: _Ctx, src_prefix: str) -> None:
    """More than one shared expert where ATOM would fuse them (spec §2.4): its model then makes
    n_shared_experts slots of the routed width I, but its loader puts the whole shared MLP, I x S wide,
    into the first (`_load_w13` narrows I/tp rows to I*S/tp and raises), so ATOM cannot load such a
    checkpoint and there is no post-load layout to write. Fusion off (a bf16 shared expert beside
    quantised routed ones, or --shared-experts separate under --dp-attention --mori) builds the
    separate S x I MLP, which converts. DeepseekV2ForCausalLM (S = 2) is not served by ATOM and keeps
    the separate layout."""
    s = ctx.spec
    shared_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.shared_experts.gate_proj")
    routed_codec = ctx.fmt.codec_for(f"{src_prefix}mlp.experts.0.gate_proj")
    if shared_codec.name == routed_codec.name and ctx.par.fusion_allowed:
        raise UnsupportedError(
            f"{src_prefix}mlp.shared_experts: n_shared_experts is {s.S}, expected at most 1 for {s.architecture}. ATOM fuses "
            f"the shared experts into the routed experts' kernel here (both {routed_codec.name}) and loads the whole "
            f"shared MLP ({s.I * s.S} wide) into one expert slot {s.I} wide, which fails (moe.py _load_w13), so ATOM "
            f"cannot load this checkpoint (spec §2.4). Check n_shared_experts in config.json; ATOM keeps a separate "
            f"shared MLP only with --dp-attention --ep --mori --shared-experts separate (ATOM_FUSE_SHARED_EXPERT=0)"
        )


def _plan_mtp(ctx: _Ctx, j: int) -> ModelPlan:
    """The drafter's tensors (spec §2.6): decoder block under `mtp_block`, extras keep layer j's name."""
    s = ctx.spec
    src = f"model.layers.{j}."
    plan = ModelPlan(groups=[])
    outs: list[OutTensor] = []
    outs += _plain(ctx, f"{src}embed_tokens.weight", "model.embed_tokens.weight",
                   (s.vocab, s.H), vocab=not ctx.embed_replicated, optional=True)
    for name in MTP_VECTORS:
        outs += _plain(ctx, src + name, src + name, (s.H,))
    # eh_proj: a replicated linear (HEAD). It is bf16 unless the index has a key ending in
    # `eh_proj.weight_scale` (spec §2.6): a DeepSeek fp8 one (`weight_scale_inv`) never does, so
    # ATOM holds it in bf16 and an fp8 source is dequantised; a Quark MXFP4 one stays MXFP4.
    eh = f"{src}eh_proj"
    codec = ctx.fmt.codec_for(eh)
    if codec.name == "fp8-block" and f"{eh}.weight_scale_inv" in ctx.src:
        ctx.problems.extend(codec.check(ctx.src, eh, s.H, 2 * s.H))
        ctx.consumed.update(codec.source_names(eh))
        outs.append(OutTensor(f"{eh}.weight", BF16, (s.H, 2 * s.H), tuple(codec.source_names(eh)),
                              partial(_dequant_whole, ctx, codec, eh)))
    else:
        if codec.name == "fp8-block":  # stored in bf16 although the config would quantize it
            codec = Bf16Linear()
        outs += _plan_linear(ctx, EH_PROJ, src, src, [codec])
    outs += _plain(ctx, f"{src}shared_head.head.weight", f"{src}shared_head.head.weight",
                   (s.vocab, s.H), vocab=True, optional=True)
    plan.groups.append(Group(f"mtp.{j}.extras", outs))
    plan.groups.append(Group(f"mtp.{j}.block", _plan_layer(ctx, j, src, f"{src}mtp_block.", plan)))
    return plan


def _dequant_whole(ctx: _Ctx, codec: LinearCodec, module: str, rank: int, cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    yield codec.dequant(codec.read(ctx.src, module)).to(BF16)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _few(items: list[int], n: int = 4) -> str:
    """'1, 2, 3' or '1, 2, 3, 4 and 5 more'."""
    shown = ", ".join(map(str, items[:n]))
    return shown if len(items) <= n else f"{shown} and {len(items) - n} more"


def _first_absent(have: set[int]) -> int:
    i = 0
    while i in have:
        i += 1
    return i


def _check_counts(src: SourceCheckpoint, spec: ModelSpec, root: str = "") -> None:
    """num_hidden_layers and n_routed_experts against what the files hold, before any
    per-tensor check: a wrong count is one line naming the key, not one line per missing
    tensor (and a count like 1e9 is refused at once instead of being iterated)."""
    where = src.path / "config.json"
    layers, experts, expert_layers = set(), set(), set()
    for name in src.names():
        if root:  # the text model's tensors only (Kimi-K2.5: language_model.*); others are the loader's extras
            if not name.startswith(root):
                continue
            name = name[len(root):]
        if m := _LAYER_RE.match(name):
            layers.add(int(m.group(1)))
        if m := _EXPERT_RE.match(name):
            expert_layers.add(int(m.group(1)))
            experts.add(int(m.group(2)))
    have = {i for i in layers if i < spec.n_layers}
    if len(have) < spec.n_layers:
        first = _first_absent(have)
        raise ConfigError(f"{where}: num_hidden_layers is {spec.n_layers}, but the checkpoint holds no tensor of "
                          f"layer {first} ({spec.n_layers - len(have)} of the {spec.n_layers} layers have none: "
                          f"{root}model.layers.{first}.* is absent)",
                          hint="Fix num_hidden_layers, or download the shards that hold the missing layers.")
    # Which layers are MoE (spec §2.3), against the layers that hold routed experts: one line for a
    # wrong n_routed_experts / first_k_dense_replace / moe_layer_freq, not one per tensor of each layer.
    span = range(spec.n_layers + spec.n_mtp)
    dense = sorted(i for i in expert_layers if i in span and not spec.is_moe_layer(i))
    if dense:
        why = (f"n_routed_experts is {spec.E} (a missing or null key reads as 0: no MoE layer)" if not spec.E else
               f"first_k_dense_replace {spec.first_k_dense} and moe_layer_freq {spec.moe_layer_freq} make layer "
               f"{dense[0]} dense")
        raise ConfigError(f"{where}: {why}, but the checkpoint holds routed experts in layer(s) {_few(dense)} "
                          f"({root}model.layers.{dense[0]}.mlp.experts.*)",
                          hint="Fix n_routed_experts, first_k_dense_replace or moe_layer_freq in config.json to "
                               "match the checkpoint, or re-download it.")
    bare = sorted(i for i in layers if i in span and spec.is_moe_layer(i) and i not in expert_layers)
    if bare and expert_layers:  # no expert anywhere: the count check below names n_routed_experts
        raise ConfigError(f"{where}: first_k_dense_replace {spec.first_k_dense} and moe_layer_freq "
                          f"{spec.moe_layer_freq} make layer {bare[0]} a MoE layer, but the checkpoint holds no "
                          f"routed expert of layer(s) {_few(bare)} ({root}model.layers.{bare[0]}.mlp.experts.* is "
                          f"absent)",
                          hint="Fix first_k_dense_replace or moe_layer_freq in config.json to match the checkpoint, "
                               "or download the shards that hold those layers' experts.")
    have_e = {e for e in experts if e < spec.E}
    if spec.E and len(have_e) < spec.E and spec.E > max(experts, default=-1) + 1:
        raise ConfigError(f"{where}: n_routed_experts is {spec.E}, but the checkpoint holds experts "
                          f"{'0..' + str(max(experts)) if experts else 'none'} (no mlp.experts.{_first_absent(have_e)}.* "
                          f"tensor in any layer)",
                          hint="Fix n_routed_experts, or download the shards that hold the missing experts.")


class DeepseekLoader(ArchLoader):
    """DeepseekV2ForCausalLM (V2, V2-Lite) and DeepseekV3ForCausalLM (V3, R1, Kimi-K2):
    ATOM builds all of them as its DeepseekV2ForCausalLM (spec §0)."""

    keys = (
        ("DeepseekV2ForCausalLM", "deepseek_v2"),
        ("DeepseekV3ForCausalLM", "deepseek_v3"),
        ("DeepseekV3ForCausalLM", "kimi_k2"),  # Kimi-K2: a DeepSeek-V3 config under its own model_type
    )

    # Family hooks (deepseek_v32.py): extra attention modules per layer, extra layout flags, refusals.
    attn_extras: Any = None
    extra_flags: dict[str, Any] = {}

    def roots(self, spec: ModelSpec) -> tuple[str, str]:
        """(source prefix, output prefix) of the text model's names: "" for a causal LM; Kimi-K2.5 keeps
        `language_model.` on both sides (atom-layout-next.md §3.2)."""
        return spec.text_prefix, spec.text_prefix

    def check_names(self, src: SourceCheckpoint, spec: ModelSpec) -> None:
        """Refuse a checkpoint whose names are another tool's spelling, before layers are counted."""

    def plan_extras(self, ctx: _Ctx, main: ModelPlan, dropped: dict[str, str]) -> None:
        """Tensors outside the text model (Kimi-K2.5's vision tower): add groups to `main`, mark their
        sources consumed, or record them in `dropped` with the reason. Called before unmapped names are
        reported."""

    def check_source(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, target: str,
                     par: Parallel, profile: NamingProfile) -> None:
        """Refuse a source this family cannot convert, before any tensor is planned."""

    def replicated_embedding(self, spec: ModelSpec) -> bool:
        """Whether ATOM holds the whole vocabulary embedding on every rank (main model and MTP drafter)
        instead of a vocab-parallel slice: DeepSeek/Kimi never (spec §2.1), GLM by default
        (glm_moe_dsa.py, atom-layout-next.md §2.2). lm_head stays vocab-parallel either way."""
        return False

    def plan(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, *, target: str, tp: int,
             profile: NamingProfile, mtp: bool, mla_bmm: str = "fp8", parallel: Parallel | None = None) -> ConversionPlan:
        if tp < 1:
            raise BadInputError(f"tp must be >= 1, got {tp}")
        sr, orr = self.roots(spec)
        self.check_names(src, spec)
        _check_counts(src, spec, sr)
        par = parallel or Parallel(tp=tp)
        if par.tp != tp:
            raise BadInputError(f"internal: tp={tp} but the parallel layout says tp={par.tp}")
        par.validate()
        par.check_experts(spec.E, str(src.path / "config.json"))
        if mla_bmm not in ("fp8", "mxfp4"):
            raise BadInputError(f"--mla-bmm must be fp8 or mxfp4, got {mla_bmm!r}")
        if mla_bmm == "mxfp4" and target != "gfx950":
            raise UnsupportedError(
                f"--mla-bmm mxfp4 (ATOM_USE_TRITON_MXFP4_BMM=1) is gfx950-only in ATOM (spec §4.2); target is {target}"
            )
        if fmt.name == "quark-mxfp4" and target != "gfx950":
            raise UnsupportedError(
                f"MXFP4 checkpoints convert for gfx950 only: on {target} ATOM runs MXFP4 MoE through its triton "
                f"path with transposed views and a different scale layout (spec §3.3.2, §6), which atom-convert "
                f"does not produce"
            )
        if spec.n_mtp > 1:
            raise UnsupportedError(f"num_nextn_predict_layers={spec.n_mtp}: only one MTP layer is supported (DeepSeek-V3/R1 have 1)")
        self.check_source(src, spec, fmt, target, par, profile)
        ctx = _Ctx(src, spec, fmt, target, par.attn_tp, profile, problems=[], consumed=set(), mla_bmm=mla_bmm, par=par,
                   attn_extras=self.attn_extras)
        ctx.embed_replicated = embed_replicated = self.replicated_embedding(spec)
        main = ModelPlan(groups=[])
        main.groups.append(Group("embed", _plain(ctx, f"{sr}model.embed_tokens.weight", f"{orr}model.embed_tokens.weight",
                                                 (spec.vocab, spec.H), vocab=not embed_replicated)))
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            main.groups.append(Group(f"layer.{i}", _plan_layer(ctx, i, sr + p, orr + p, main)))
        main.groups.append(Group("final", _plain(ctx, f"{sr}model.norm.weight", f"{orr}model.norm.weight", (spec.H,))
                                 + _plain(ctx, f"{sr}lm_head.weight", f"{orr}lm_head.weight",
                                          (spec.vocab, spec.H), vocab=True)))
        mtp_layers = range(spec.n_layers, spec.n_layers + spec.n_mtp)
        mtp_plan = None
        mtp_status = "absent"
        if spec.n_mtp:
            # Some redistributions of V3/R1 strip the MTP layer but keep num_nextn_predict_layers.
            present = any(n.startswith(f"model.layers.{spec.n_layers}.") for n in src.names())
            mtp_status = "not in the checkpoint" if not present else "converted" if mtp else "dropped by --no-mtp"
            if mtp and present:
                mtp_plan = _plan_mtp(ctx, spec.n_layers)
        dropped: dict[str, str] = {}
        self.plan_extras(ctx, main, dropped)
        for name in src.names():
            if name in ctx.consumed or name in dropped:
                continue
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) in mtp_layers and not mtp:
                dropped[name] = "MTP layer, dropped by --no-mtp (spec §2.6)"
                continue
            for pat, why in DROP_RULES:
                if pat.fullmatch(name):
                    dropped[name] = why
                    break
            else:
                info = src.info(name)
                ctx.problems.append(
                    f"{info.file}: unmapped tensor {name} ({info.dtype}, {list(info.shape)}): no rule for it in a "
                    f"{spec.architecture} ({spec.model_type}) checkpoint with {spec.n_layers} layers and "
                    f"{spec.n_mtp} MTP layer(s); remove it or check config.json"
                )
        if ctx.problems:
            raise CheckpointError(ctx.problems, hint="The source does not match its config.json; fix or re-download it.")
        return ConversionPlan(spec=spec, source_format=fmt.name, target=target, tp=tp, profile=profile, main=main,
                              mtp=mtp_plan, mtp_status=mtp_status, dropped=dropped,
                              layout_flags=dict(LAYOUT_FLAGS, ATOM_USE_TRITON_MXFP4_BMM=int(mla_bmm == "mxfp4"),
                                                ATOM_FUSE_SHARED_EXPERT=int(par.shared_experts == "fused"),
                                                **self.extra_flags),
                              parallel=par)
