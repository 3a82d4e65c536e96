"""The model dimensions a conversion needs, read once from config.json.

A frozen dataclass: the config is parsed and checked here, never mutated later.
Symbols follow spec §0 (H, Nh, Q, L, P, R, V, Id, I, E, S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnsupportedError, json_kind

SUPPORTED_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


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

    @property
    def has_indexer(self) -> bool:
        """Sparse (DSA) attention: ATOM keys it on `hasattr(config, "index_topk")` (atom-layout-next.md §0)."""
        return self.Kt > 0

    @property
    def has_correction_bias(self) -> bool:
        # transformers' DeepseekV3 always has it; ATOM creates it for noaux_tc (spec §2.4).
        return self.architecture in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM") or self.topk_method == "noaux_tc"

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
                f"{', '.join(SUPPORTED_ARCHS)} (DeepSeek V2/V2-Lite/V3/R1/V3.2, Kimi-K2)"
            )
        model_type = cfg.get("model_type", "")
        ok_types = {"DeepseekV2ForCausalLM": ("deepseek_v2",), "DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2"),
                    "DeepseekV32ForCausalLM": ("deepseek_v32",)}
        if model_type not in ok_types[arch]:
            raise UnsupportedError(
                f"{where}: model_type {model_type!r} with architecture {arch} is not supported; "
                f"expected one of {ok_types[arch]}"
            )
        r = _Reader(cfg, where, arch)
        # ATOM reads deepseek_v32 through transformers' DeepseekV3Config (atom-layout-next.md §0): V3's defaults.
        v3 = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
        v32 = arch == "DeepseekV32ForCausalLM"
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
        if spec.tie_word_embeddings:
            raise UnsupportedError(f"{where}: tie_word_embeddings=true; DeepSeek/Kimi (and ATOM) never tie them")
        return spec


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
