"""Module trees with ATOM's module paths and registered parameter shapes and dtypes, written from the
layout spec (../shared/spec/atom-layout.md §2, §3.2; atom-loading.md §2.1, §5), not from a manifest.

`build(config, tp=..., fmt=..., target=...)` stands in for ATOM's `DeepseekV2ForCausalLM(config)` on
one rank: the Parameters it registers are the pre-PWAL ones, which for the default fp8 per_1x128 and
bf16 checkpoints have the post-PWAL names, shapes and dtypes (atom-loading.md §2.1). `meta=True`
builds them on the meta device, as ATOM's register_parameter patch does (§5), including the split
bias alias that patch causes. Every module counts calls of `process_weights_after_loading` on
itself and on its quant_method, so a test can assert the loader never ran one (§10 item 10).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BF16 = torch.bfloat16
F32 = torch.float32
FP8 = {"gfx950": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz}  # spec §3.0.1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PWALCounter:
    calls = 0


class _QuantMethod:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        PWALCounter.calls += 1


class Node(nn.Module):
    """A module with a post-load hook that must never be called by a converted-weights loader."""

    def __init__(self, quantized: bool = False):
        super().__init__()
        if quantized:
            self.quant_method = _QuantMethod()

    def process_weights_after_loading(self) -> None:
        PWALCounter.calls += 1


class MoEParallel:
    def __init__(self, ep_size: int, use_ep: bool):
        self.ep_size, self.use_ep = ep_size, use_ep


class Tree:
    def __init__(self, meta: bool):
        self.device = "meta" if meta else "cpu"

    def param(self, m: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        if self.device == "meta":
            t = torch.empty(shape, dtype=dtype, device="meta")
        else:  # random bytes, so that a loader that forgets a tensor leaves a visible difference
            t = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8)
            t = t.view(dtype).view(shape) if shape else t.view(dtype).reshape(())
        p = nn.Parameter(t, requires_grad=False)
        m.register_parameter(name, p)
        return p

    def linear(self, n: int, k: int, fmt: str, fp8: torch.dtype, scale_rows: int | None = None) -> Node:
        """LinearBase: `weight` [N, K]; fp8 per_1x128 adds `weight_scale` [ceil(N/128), ceil(K/128)] fp32
        (spec §3.2)."""
        m = Node(quantized=True)
        if fmt == "fp8":
            self.param(m, "weight", (n, k), fp8)
            self.param(m, "weight_scale", (scale_rows if scale_rows is not None else cdiv(n, 128), cdiv(k, 128)), F32)
        else:
            self.param(m, "weight", (n, k), BF16)
        return m

    def norm(self, h: int) -> Node:
        m = Node()
        self.param(m, "weight", (h,), BF16)
        return m


def _attention(t: Tree, c: dict[str, Any], tp: int, fmt: str, fp8: torch.dtype) -> Node:
    """spec §2.2 (variant A with q_lora_rank, variant B without), §2.7 (impl has no parameters)."""
    H, L, R, P, V, Nh = (c["hidden_size"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"],
                         c["v_head_dim"], c["num_attention_heads"])
    Q, Nr = c.get("q_lora_rank"), c["num_attention_heads"] // tp
    a = Node()
    if Q is not None:
        a.fused_qkv_a_proj = t.linear(Q + L + R, H, fmt, fp8, scale_rows=cdiv(Q, 128) + cdiv(L + R, 128))
        a.q_a_layernorm = t.norm(Q)
        a.q_b_proj = t.linear(Nr * (P + R), Q, fmt, fp8)
    else:
        a.q_proj = t.linear(Nr * (P + R), H, fmt, fp8)
        a.kv_a_proj_with_mqa = t.linear(L + R, H, fmt, fp8)
    a.kv_a_layernorm = t.norm(L)
    a.kv_b_proj = t.linear(Nr * (P + V), L, fmt, fp8)
    a.o_proj = t.linear(H, Nr * V, fmt, fp8)
    a.mla_attn = Node()
    a.mla_attn.impl = Node()
    # ATOM's MLA impl keeps the attention's own q/o/kv_b Linear objects as children too
    # (atom/model_ops/attention_mla.py 427-429: `self.q_proj = mla_modules.q_proj`, ...): the same
    # modules under a second name, so named_parameters(remove_duplicate=False) lists them twice.
    impl = a.mla_attn.impl
    impl.q_proj = a.q_b_proj if Q is not None else a.q_proj
    impl.o_proj = a.o_proj
    impl.kv_b_proj = a.kv_b_proj
    del Nh
    return a


def _moe(t: Tree, c: dict[str, Any], tp: int, fmt: str, fp8: torch.dtype) -> Node:
    """spec §2.4: router, FusedMoE with the shared expert fused in slot E when S == 1, separate
    shared_experts otherwise; the bias registered under both names (moe.py:2844)."""
    H, E, S, I = c["hidden_size"], c["n_routed_experts"], c.get("n_shared_experts") or 0, c["moe_intermediate_size"]
    mlp = Node()
    mlp.gate = Node()
    t.param(mlp.gate, "weight", (E, H), BF16)
    mlp.experts = Node(quantized=True)
    # ATOM's FusedMoE carries its parallel layout as live objects (atom/model_ops/moe.py:
    # `moe_parallel_config` with ep_size/use_ep, `expert_map` None without EP); a loader declares
    # them (atom-loading.md §10 item 1). These trees are tensor-parallel: no EP.
    mlp.experts.moe_parallel_config = MoEParallel(ep_size=1, use_ep=False)
    mlp.experts.expert_map = None
    if c.get("topk_method") == "noaux_tc":
        bias = t.param(mlp.gate, "e_score_correction_bias", (E,), BF16)
        if t.device == "meta":  # the meta patch re-registers a copy: two objects (atom-loading.md §5)
            t.param(mlp.experts, "e_score_correction_bias", (E,), BF16)
        else:
            mlp.experts.register_parameter("e_score_correction_bias", bias)
    fused = S == 1
    el, il = E + (1 if fused else 0), I // tp
    wdt = fp8 if fmt == "fp8" else BF16
    t.param(mlp.experts, "w13_weight", (el, 2 * il, H), wdt)
    t.param(mlp.experts, "w2_weight", (el, H, il), wdt)
    if fmt == "fp8":
        t.param(mlp.experts, "w13_weight_scale", (el, cdiv(2 * il, 128), cdiv(H, 128)), F32)
        t.param(mlp.experts, "w2_weight_scale", (el, cdiv(H, 128), cdiv(il, 128)), F32)
    if S and not fused:
        mlp.shared_experts = Node()
        mlp.shared_experts.gate_up_proj = t.linear(2 * I * S // tp, H, fmt, fp8)
        mlp.shared_experts.down_proj = t.linear(H, I * S // tp, fmt, fp8)
    return mlp


def _decoder_layer(t: Tree, c: dict[str, Any], i: int, tp: int, fmt: str, fp8: torch.dtype) -> Node:
    H = c["hidden_size"]
    layer = Node()
    layer.input_layernorm = t.norm(H)
    layer.post_attention_layernorm = t.norm(H)
    layer.self_attn = _attention(t, c, tp, fmt, fp8)
    moe = c.get("n_routed_experts") and i >= c.get("first_k_dense_replace", 0) and i % c.get("moe_layer_freq", 1) == 0
    if moe:
        layer.mlp = _moe(t, c, tp, fmt, fp8)
    else:  # spec §2.3: gate rows then up rows
        Id = c["intermediate_size"] // tp
        layer.mlp = Node()
        layer.mlp.gate_up_proj = t.linear(2 * Id, H, fmt, fp8)
        layer.mlp.down_proj = t.linear(H, Id, fmt, fp8)
    return layer


def build(c: dict[str, Any], *, tp: int = 1, fmt: str = "fp8", target: str = "gfx950", meta: bool = True) -> nn.Module:
    """The main model of one rank (spec §2.1-§2.5)."""
    t = Tree(meta)
    fp8 = FP8[target]
    H, vocab = c["hidden_size"], c["vocab_size"]
    root = Node()
    root.model = Node()
    root.model.embed_tokens = Node()
    t.param(root.model.embed_tokens, "weight", (vocab // tp, H), BF16)
    root.model.layers = nn.ModuleList([_decoder_layer(t, c, i, tp, fmt, fp8) for i in range(c["num_hidden_layers"])])
    root.model.norm = t.norm(H)
    root.lm_head = Node()
    t.param(root.lm_head, "weight", (vocab // tp, H), BF16)
    return root


def build_mtp(c: dict[str, Any], *, tp: int = 1, fmt: str = "fp8", target: str = "gfx950", meta: bool = True) -> nn.Module:
    """The MTP drafter of one rank (spec §2.6): `model.layers.{n}.{enorm,hnorm,eh_proj,shared_head,mtp_block}`
    and its own `model.embed_tokens`. eh_proj is bf16 for a DeepSeek fp8 checkpoint (§2.6)."""
    t = Tree(meta)
    fp8 = FP8[target]
    H, vocab, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    root = Node()
    root.model = Node()
    root.model.embed_tokens = Node()
    t.param(root.model.embed_tokens, "weight", (vocab // tp, H), BF16)
    root.model.layers = nn.Module()
    mtp = Node()
    root.model.layers.add_module(str(n), mtp)
    mtp.enorm, mtp.hnorm = t.norm(H), t.norm(H)
    mtp.eh_proj = t.linear(H, 2 * H, "bf16", fp8)
    mtp.shared_head = Node()
    mtp.shared_head.norm = t.norm(H)
    mtp.shared_head.head = Node()
    t.param(mtp.shared_head.head, "weight", (vocab // tp, H), BF16)
    mtp.mtp_block = _decoder_layer(t, c, n, tp, fmt, fp8)
    return root


def shuffled_by_spec(name: str, fmt: str) -> bool:
    """Which parameters PWAL shuffles (and marks is_shuffled) per the spec: every fp8 per_1x128 linear
    weight (§3.2, PRESHUFFLE=1 default) and the expert weights in fp8 and in bf16 (§2.2 of
    atom-loading.md); never scales, norms, the router, embeddings or bf16 linears."""
    if name.endswith(("experts.w13_weight", "experts.w2_weight")):
        return True
    return fmt == "fp8" and name.endswith(".weight") and any(
        f".{m}." in name for m in ("fused_qkv_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                   "o_proj", "gate_up_proj", "down_proj"))
