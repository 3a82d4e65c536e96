"""The model dimensions a conversion needs, read once from config.json.

A frozen dataclass: the config is parsed and checked here, never mutated later.
Symbols follow spec §0 (H, Nh, Q, L, P, R, V, Id, I, E, S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnsupportedError, json_kind

SUPPORTED_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                   "KimiK25ForConditionalGeneration", "GlmMoeDsaForCausalLM")
# The sparse-MLA (DSA) families: an Indexer in the attention (atom-layout-next.md §1, §2).
DSA_ARCHS = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
# The families whose router is DeepSeek-V3's (sigmoid scores with e_score_correction_bias, noaux_tc) and
# whose config reads V3's defaults (ATOM: atom/config.py 603-611 for glm_moe_dsa too).
V3_ROUTER_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                   "KimiK25ForConditionalGeneration")
# Multimodal configs whose text model sits in `text_config` and whose text tensors (checkpoint and ATOM
# parameter names alike) carry a prefix (atom-layout-next.md §3.1-§3.2: ATOM reads the text config).
TEXT_PREFIX = {"KimiK25ForConditionalGeneration": "language_model."}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    H: int  # hidden_size
    Nh: int  # num_attention_heads
    Q: int | None  # q_lora_rank (None: V2-Lite, q_proj instead of q_a/q_b)
    L: int  # kv_lora_rank
    P: int  # qk_nope_head_dim
    R: int  # qk_rope_head_dim
    V: int  # v_head_dim
    Id: int  # dense intermediate_size
    I: int  # moe_intermediate_size  # noqa: E741
    E: int  # n_routed_experts (0: no MoE)
    S: int  # n_shared_experts
    vocab: int
    n_layers: int
    first_k_dense: int
    moe_layer_freq: int
    n_mtp: int  # num_nextn_predict_layers
    topk_method: str
    scoring_func: str
    n_group: int
    topk_group: int
    top_k: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    # DeepSeek-V3.2's lightning indexer (atom-layout-next.md §1.1; 0 when the model has none)
    Ih: int = 0  # index_n_heads
    Dh: int = 0  # index_head_dim
    Kt: int = 0  # index_topk
    # GLM-5.2 IndexShare (atom-layout-next.md §2.1-§2.2): the per-layer schedule ATOM obeys ("full" layers
    # carry an indexer, "shared" ones none; None: every layer has one).
    indexer_types: tuple[str, ...] | None = None
    # The text model's name prefix, the same in the checkpoint and in ATOM's parameter names
    # ("language_model." for Kimi-K2.5, atom-layout-next.md §3.2); "" for a plain causal LM.
    text_prefix: str = ""

    @property
    def has_indexer(self) -> bool:
        """Sparse (DSA) attention: ATOM keys it on `hasattr(config, "index_topk")` (atom-layout-next.md §0)."""
        return self.Kt > 0

    def has_indexer_at(self, i: int) -> bool:
        """Whether ATOM builds an Indexer for decoder layer (or MTP layer) i: every layer of a DSA model
        but a "shared" one of `indexer_types` (`_indexer_weights_shared`, deepseek_v2.py 402-409); an MTP
        layer (i >= num_hidden_layers) always has its own (atom-layout-next.md §1.6, §2.2)."""
        if not self.has_indexer:
            return False
        if i >= self.n_layers or self.indexer_types is None:
            return True
        return self.indexer_types[i] != "shared"

    @property
    def has_correction_bias(self) -> bool:
        # transformers' DeepseekV3 always has it; ATOM creates it for noaux_tc (spec §2.4).
        return self.architecture in V3_ROUTER_ARCHS or self.topk_method == "noaux_tc"

    def is_moe_layer(self, i: int) -> bool:
        """spec §2.3: MoE when experts exist, i >= first_k_dense_replace and i % moe_layer_freq == 0."""
        return self.E > 0 and i >= self.first_k_dense and i % self.moe_layer_freq == 0

    @classmethod
    def from_config(cls, cfg: Any, where: str = "config.json") -> "ModelSpec":
        """Read and check config.json. Every value is checked for its type and range before
        use; every bad key is reported at once, each with the expected type or range and the
        value found. Accepted as real configs write them: null for an optional key (its
        default applies), integers written as floats (7168.0), any extra keys."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: is {json_kind(cfg)}, expected a JSON object of model settings")
        archs = cfg.get("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ConfigError(f"{where}: architectures is {json_kind(archs)} {archs!r}, expected a list of strings "
                              f"such as [\"DeepseekV3ForCausalLM\"]")
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedError(
                f"{where}: architecture {arch!r} is not supported; atom-convert converts "
                f"{', '.join(SUPPORTED_ARCHS)} (DeepSeek V2/V2-Lite/V3/R1/V3.2, Kimi-K2, Kimi-K2.5, GLM-5)"
            )
        model_type = cfg.get("model_type", "")
        ok_types = {"DeepseekV2ForCausalLM": ("deepseek_v2",), "DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2"),
                    "DeepseekV32ForCausalLM": ("deepseek_v32",), "KimiK25ForConditionalGeneration": ("kimi_k25",),
                    "GlmMoeDsaForCausalLM": ("glm_moe_dsa",)}
        if model_type not in ok_types[arch]:
            raise UnsupportedError(
                f"{where}: model_type {model_type!r} with architecture {arch} is not supported; "
                f"expected one of {ok_types[arch]}"
            )
        _refuse_model_dtype(cfg, where)
        text_prefix = TEXT_PREFIX.get(arch, "")
        if text_prefix:
            cfg = _text_config(cfg, where, arch)
            where = f"{where} text_config"
            _refuse_model_dtype(cfg, where)
        r = _Reader(cfg, where, arch)
        # ATOM reads deepseek_v32 through transformers' DeepseekV3Config (atom-layout-next.md §0): V3's defaults.
        # glm_moe_dsa too (atom/config.py 603-611).
        v3 = arch in V3_ROUTER_ARCHS
        v32 = arch in DSA_ARCHS  # an indexer (DeepSeek-V3.2, GLM-5)
        spec = cls(
            architecture=arch,
            model_type=model_type,
            H=r.int("hidden_size"),
            Nh=r.int("num_attention_heads"),
            Q=r.int("q_lora_rank", default=None),
            L=r.int("kv_lora_rank"),
            P=r.int("qk_nope_head_dim"),
            R=r.int("qk_rope_head_dim"),
            V=r.int("v_head_dim"),
            Id=r.int("intermediate_size"),
            I=r.int("moe_intermediate_size", default=0, minimum=0),
            E=r.int("n_routed_experts", default=0, minimum=0),
            S=r.int("n_shared_experts", default=0, minimum=0),
            vocab=r.int("vocab_size"),
            n_layers=r.int("num_hidden_layers"),
            first_k_dense=r.int("first_k_dense_replace", default=0, minimum=0),
            moe_layer_freq=r.int("moe_layer_freq", default=1),
            n_mtp=r.int("num_nextn_predict_layers", default=0, minimum=0),
            topk_method=r.str("topk_method", "noaux_tc" if v3 else "greedy"),
            scoring_func=r.str("scoring_func", "sigmoid" if v3 else "softmax"),
            n_group=r.int("n_group", default=1),
            topk_group=r.int("topk_group", default=1),
            top_k=r.int("num_experts_per_tok", default=1),
            routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
            norm_topk_prob=r.bool("norm_topk_prob", v3),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6),
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            Ih=r.int("index_n_heads") if v32 else 0,
            Dh=r.int("index_head_dim") if v32 else 0,
            Kt=r.int("index_topk") if v32 else 0,
            text_prefix=text_prefix,
            indexer_types=_indexer_types(cfg, where, r) if v32 else None,
        )
        if r.problems:
            raise ConfigError(r.problems)
        if not v32 and cfg.get("index_topk") is not None:
            # ATOM builds the sparse indexer whenever the config has index_topk (atom-layout-next.md §0).
            raise UnsupportedError(f"{where}: index_topk is set but the architecture is {arch}; ATOM would build "
                                   f"DeepSeek-V3.2's indexer on every layer. A DeepSeek-V3.2 checkpoint says "
                                   f"architectures [\"DeepseekV32ForCausalLM\"] and model_type \"deepseek_v32\"")
        if spec.E and not spec.I:
            raise ConfigError(f"{where}: n_routed_experts={spec.E} but moe_intermediate_size is missing or 0 "
                              f"(expected an integer >= 1)")
        if spec.E:
            _check_router(spec, where)
        if spec.tie_word_embeddings:
            raise UnsupportedError(f"{where}: tie_word_embeddings=true; DeepSeek/Kimi (and ATOM) never tie them")
        return spec


def _check_router(spec: ModelSpec, where: str) -> None:
    """The routing settings a MoE model can be built with. They change no weight, but ATOM builds every
    MoE layer with grouped top-k (atom/models/deepseek_v2.py, FusedMoE(use_grouped_topk=True, num_expert_group=
    n_group, topk_group=...)), which splits the experts into n_group equal groups, keeps topk_group of them and
    picks num_experts_per_tok experts: a config that breaks this would convert and then fail in the server."""
    problems = []
    if spec.top_k > spec.E:
        problems.append(f"num_experts_per_tok={spec.top_k} is more than n_routed_experts={spec.E} "
                        f"(expected 1..{spec.E})")
    if spec.E % spec.n_group:
        problems.append(f"n_routed_experts={spec.E} does not split into n_group={spec.n_group} equal groups "
                        f"(expected n_group to divide n_routed_experts)")
    if spec.topk_group > spec.n_group:
        problems.append(f"topk_group={spec.topk_group} is more than n_group={spec.n_group} "
                        f"(expected 1..{spec.n_group})")
    if problems:
        raise ConfigError([f"{where}: {p}" for p in problems])


def _refuse_model_dtype(cfg: dict[str, Any], where: str) -> None:
    """ATOM builds the model in the config's dtype (`dtype`, or `torch_dtype` as older transformers write it;
    bf16 when neither is set): every unquantized parameter (norms, embedding, lm_head, router, unquantized
    linears) then has that dtype (spec atom-layout.md §1.1). atom-convert writes them in bf16, so any other
    model dtype is refused here rather than converted into a layout ATOM would not hold."""
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if v is not None and v != "bfloat16":
            raise UnsupportedError(
                f"{where}: {key} is {v!r}; ATOM builds the model in the config's dtype, and atom-convert converts for "
                f"a bfloat16 model only (the dtype of every DeepSeek, Kimi and GLM release). To serve this checkpoint "
                f"in bf16, set {key} to \"bfloat16\" in config.json: ATOM then rounds the weights to bf16 as it "
                f"loads them, and atom-convert does the same")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json settings: `text_config` (with the top-level quantization_config) for a
    multimodal checkpoint (Kimi-K2.5), else `cfg` itself. For transformers' DeepSeek classes (check/)."""
    archs = cfg.get("architectures") or [None]
    return _text_config(cfg, "config.json", archs[0]) if archs[0] in TEXT_PREFIX else cfg


def _text_config(cfg: dict[str, Any], where: str, arch: str) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint, as ATOM reads it (atom/config.py 645-669 at
    ffdf3bb5d, atom-layout-next.md §3.1): `text_config` through DeepseekV3Config, the top-level
    quantization_config copied in when the text config has none."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config is {json_kind(text)}, expected the text model's settings (an object "
                          f"with model_type \"kimi_k2\", hidden_size, ...): {arch} keeps its language model there")
    ttype = text.get("model_type", "deepseek_v3")
    if ttype not in ("kimi_k2", "deepseek_v3"):
        raise UnsupportedError(f"{where}: text_config.model_type {ttype!r}; {arch} is converted with a Kimi-K2 "
                               f"(DeepSeek-V3) text model, model_type \"kimi_k2\" or \"deepseek_v3\"")
    if "quantization_config" in cfg and "quantization_config" not in text:
        text = dict(text, quantization_config=cfg["quantization_config"])
    return text


def _indexer_types(cfg: dict[str, Any], where: str, r: "_Reader") -> tuple[str, ...] | None:
    """GLM-5.2 IndexShare's per-layer indexer schedule (atom-layout-next.md §2.1-§2.2, §6). ATOM builds an
    Indexer on a layer unless `indexer_types` says "shared" there, and reads only what config.json says:
    with `index_topk_freq > 1` (or an `index_topk_pattern`) but no `indexer_types` it builds one on every
    layer while transformers' schedule (one layer off ATOM's own offset formula) saves none on the
    skipped layers, so such a config is refused rather than guessed."""
    types = cfg.get("indexer_types")
    n = cfg.get("num_hidden_layers")
    if types is None:
        freq, pattern = cfg.get("index_topk_freq"), cfg.get("index_topk_pattern")
        shares = (isinstance(freq, (int, float)) and not isinstance(freq, bool) and freq > 1) or pattern is not None
        if shares:
            raise UnsupportedError(
                f"{where}: IndexShare ({'index_topk_freq ' + repr(freq) if pattern is None else 'index_topk_pattern'}) "
                f"without indexer_types: ATOM would build an indexer on every layer (deepseek_v2.py 357-409) while "
                f"transformers' schedule leaves some layers without one, one layer off ATOM's own skip formula "
                f"(atom-layout-next.md §2.2). Add the explicit per-layer \"indexer_types\" list (\"full\"/\"shared\", "
                f"one per decoder layer) that the checkpoint was saved with")
        return None
    if not (isinstance(types, list) and all(t in ("full", "shared") for t in types)):
        r.problems.append(f"{where}: indexer_types must be a list of \"full\" or \"shared\" (one per decoder "
                          f"layer), got {json_kind(types)} {str(types)[:120]}")
        return None
    if isinstance(n, int) and len(types) != n:
        r.problems.append(f"{where}: indexer_types has {len(types)} entries but num_hidden_layers is {n}; "
                          f"it needs one \"full\"/\"shared\" entry per decoder layer")
        return None
    if types and types[0] == "shared":
        r.problems.append(f"{where}: indexer_types[0] is \"shared\", but a shared layer reuses the top-k of "
                          f"an earlier \"full\" one (atom-layout-next.md §2.2): layer 0 must be \"full\"")
    return tuple(types)


_REQUIRED = object()


class _Reader:
    """Typed access to config.json keys, collecting one problem per bad key."""

    def __init__(self, cfg: dict[str, Any], where: str, arch: str):
        self.cfg, self.where, self.arch = cfg, where, arch
        self.problems: list[str] = []

    def _get(self, key: str, default: Any) -> Any:
        v = self.cfg.get(key)
        if v is None and default is _REQUIRED:
            self.problems.append(f"{self.where}: missing required key {key!r} for {self.arch}")
        return v

    def int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        v = self._get(key, default)
        if v is None:
            return 0 if default is _REQUIRED else default
        # JSON has one number type: 7168.0 is the integer 7168 (some exporters write it so).
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            self.problems.append(f"{self.where}: {key} must be an integer >= {minimum}, got {json_kind(v)} {v!r}")
            return 0
        if v < minimum:
            self.problems.append(f"{self.where}: {key} must be an integer >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self.problems.append(f"{self.where}: {key} must be a finite number > 0, got {json_kind(v)} {v!r}")
            return default
        return float(v)

    def str(self, key: str, default: str) -> str:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            self.problems.append(f"{self.where}: {key} must be a string, got {json_kind(v)} {v!r}")
            return default
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(f"{self.where}: {key} must be true or false, got {json_kind(v)} {v!r}")
            return default
        return v
