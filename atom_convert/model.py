"""The model dimensions a conversion needs, read once from config.json.

A frozen dataclass: the config is parsed and checked here, never mutated later.
Symbols follow spec §0 (H, Nh, Q, L, P, R, V, Id, I, E, S).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadInputError, UnsupportedError

SUPPORTED_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


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

    @property
    def has_correction_bias(self) -> bool:
        # transformers' DeepseekV3 always has it; ATOM creates it for noaux_tc (spec §2.4).
        return self.architecture == "DeepseekV3ForCausalLM" or self.topk_method == "noaux_tc"

    def is_moe_layer(self, i: int) -> bool:
        """spec §2.3: MoE when experts exist, i >= first_k_dense_replace and i % moe_layer_freq == 0."""
        return self.E > 0 and i >= self.first_k_dense and i % self.moe_layer_freq == 0

    @property
    def fuse_shared_expert(self) -> bool:
        """ATOM fuses one shared expert as routed slot E; S > 1 (V2) stays a separate MLP (spec §2.4)."""
        return self.S == 1

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = "config.json") -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedError(
                f"{where}: architecture {arch!r} is not supported; atom-convert converts "
                f"{', '.join(SUPPORTED_ARCHS)} (DeepSeek V2/V2-Lite/V3/R1, Kimi-K2)"
            )
        model_type = cfg.get("model_type", "")
        ok_types = {"DeepseekV2ForCausalLM": ("deepseek_v2",), "DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2")}
        if model_type not in ok_types[arch]:
            raise UnsupportedError(
                f"{where}: model_type {model_type!r} with architecture {arch} is not supported; "
                f"expected one of {ok_types[arch]}"
            )

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise BadInputError(f"{where}: missing required key {key!r} for {arch}")
            return cfg[key]

        def num(key: str, default: Any) -> Any:
            v = cfg.get(key)
            return default if v is None else v

        spec = cls(
            architecture=arch,
            model_type=model_type,
            H=int(need("hidden_size")),
            Nh=int(need("num_attention_heads")),
            Q=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
            L=int(need("kv_lora_rank")),
            P=int(need("qk_nope_head_dim")),
            R=int(need("qk_rope_head_dim")),
            V=int(need("v_head_dim")),
            Id=int(need("intermediate_size")),
            I=int(num("moe_intermediate_size", 0)),
            E=int(num("n_routed_experts", 0)),
            S=int(num("n_shared_experts", 0)),
            vocab=int(need("vocab_size")),
            n_layers=int(need("num_hidden_layers")),
            first_k_dense=int(num("first_k_dense_replace", 0)),
            moe_layer_freq=int(num("moe_layer_freq", 1)),
            n_mtp=int(num("num_nextn_predict_layers", 0)),
            topk_method=str(num("topk_method", "noaux_tc" if arch == "DeepseekV3ForCausalLM" else "greedy")),
            scoring_func=str(num("scoring_func", "sigmoid" if arch == "DeepseekV3ForCausalLM" else "softmax")),
            n_group=int(num("n_group", 1)),
            topk_group=int(num("topk_group", 1)),
            top_k=int(num("num_experts_per_tok", 1)),
            routed_scaling_factor=float(num("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(num("norm_topk_prob", arch == "DeepseekV3ForCausalLM")),
            rms_norm_eps=float(num("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(num("tie_word_embeddings", False)),
        )
        if spec.E and not spec.I:
            raise BadInputError(f"{where}: n_routed_experts={spec.E} but moe_intermediate_size is missing")
        if spec.tie_word_embeddings:
            raise UnsupportedError(f"{where}: tie_word_embeddings=true; DeepSeek/Kimi (and ATOM) never tie them")
        return spec
