"""A plain-torch forward of DeepSeek V2/V3 and Kimi-K2 decoder layers that reads
only a converted directory (its tensors and manifest) and its config.json.

It is a checker, not a serving engine: everything runs in fp32 for clarity,
and tensor parallelism is emulated by running every rank's slice and summing
the partial outputs, as the runtime's all-reduce does. Every parallel mode of
the manifest's `parallel` block is served (spec atom-parallel.md): attention,
dense MLPs and the vocabulary run over the attention TP group (once under
DP-attention, where every rank holds the same tensors), routed experts over
every rank by their slot maps (summed across ranks under EP, the shared slot
of each token taken from one rank as ATOM's dispatch does, §1.2). Each converted weight
is decoded exactly as the runtime reads it: shuffle undone, fp8 decoded by its
own dtype (e4m3fnuz on gfx942 holds half the e4m3fn value, with doubled
scales), block scales applied. MLA runs the absorbed way with W_K/W_V and their
scalar scales (spec §4.1), and the prefill way through kv_b_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..files.reading import loads, read_regular
from ..layout.model import ModelSpec, text_config
from ..layout.profile import get_profile
from .decode import decode_mla, decode_weight
from ..store.reader import ConvertedCheckpoint

F32 = torch.float32


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(F32)
    return w.to(F32) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Rope:
    """Rotary embedding as transformers' DeepSeek classes compute it (default or yarn),
    applied to the rope part of q and the shared k_pe."""

    def __init__(self, config: dict[str, Any], spec: ModelSpec):
        import transformers

        cfg = {k: v for k, v in text_config(config).items()
               if k not in ("quantization_config", "auto_map", "architectures")}
        v2 = spec.architecture == "DeepseekV2ForCausalLM"
        cfg["model_type"] = "deepseek_v2" if v2 else "deepseek_v3"
        hf_cfg = (transformers.DeepseekV2Config if v2 else transformers.DeepseekV3Config)(**cfg)
        if v2:
            from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

            self._emb = m.DeepseekV2RotaryEmbedding(hf_cfg)
            self._apply = lambda q, k, pe: m.apply_rotary_emb(q, k, pe)
            self.scaling = m.yarn_apply_mscale(hf_cfg.rope_parameters, spec_qk(spec) ** -0.5)
        else:
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

            self._emb = m.DeepseekV3RotaryEmbedding(hf_cfg)
            fn = m.apply_rotary_pos_emb_interleave if hf_cfg.rope_interleave else m.apply_rotary_pos_emb
            self._apply = lambda q, k, pe: fn(q, k, *pe)
            self.scaling = m.yarn_apply_mscale(hf_cfg.rope_parameters, spec_qk(spec) ** -0.5)

    def __call__(self, q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, N, R], k_pe [T, R] -> rotated, same shapes."""
        t = q_pe.shape[0]
        self._emb.to(q_pe.device)
        pos = torch.arange(t, device=q_pe.device)[None]
        pe = self._emb(q_pe[None].transpose(1, 2), pos)
        q, k = self._apply(q_pe[None].transpose(1, 2), k_pe[None, None], pe)  # [1, N, T, R], [1, 1, T, R]
        return q[0].transpose(0, 1), k[0, 0]


def spec_qk(spec: ModelSpec) -> int:
    return spec.P + spec.R


@dataclass
class LayerOut:
    attn: torch.Tensor  # absorbed MLA (W_K/W_V), summed over ranks, [T, H]
    attn_prefill: torch.Tensor  # MLA through kv_b_proj, [T, H]
    out: torch.Tensor  # layer output, [T, H]


class ConvertedModel:
    """Forward over a converted directory, every rank summed."""

    def __init__(self, path: str | Path, device: str = "cpu", ranks: "list[Any] | None" = None):
        """`ranks`: one reader per rank with ConvertedCheckpoint's interface (manifest, entry, get, `in`),
        e.g. `load.LoadedRank` over a module tree filled by `load_into`; default: the files themselves."""
        self.path = Path(path)
        if ranks is None:
            ranks = [ConvertedCheckpoint(self.path, 0)]
            ranks += [ConvertedCheckpoint(self.path, r) for r in range(1, ranks[0].typed.parallel.world)]
        self.ranks = ranks
        self.par = self.ranks[0].typed.parallel
        self.attn_ranks = range(self.par.attn_tp)  # rank r < attn_tp holds attention piece r
        # The forward names tensors natively; the profile maps them to the stored names.
        self.config = loads(read_regular(self.path / "config.json"))
        self.spec = ModelSpec.from_config(self.config)
        # Kimi-K2.5: ATOM's text-model names carry `language_model.` (atom-layout-next.md §3.2)
        to_profile, root = get_profile(self.ranks[0].typed.profile).tensor, self.spec.text_prefix
        self.name = lambda native: to_profile(root + native)
        self.device = device
        self.rope = Rope(self.config, self.spec)

    def w(self, name: str, rank: int = 0) -> torch.Tensor:
        return decode_weight(self.ranks[rank], self.name(name), self.device)

    def _vocab(self, name: str) -> torch.Tensor:
        return torch.cat([self.w(name, r) for r in self.attn_ranks])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._vocab("model.embed_tokens.weight")[ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        return rms_norm(h, self.w("model.norm.weight"), s.rms_norm_eps) @ self._vocab("lm_head.weight").T

    # -- attention (spec §2.2, §4.1) --------------------------------------------------------
    def _attn_rank(self, p: str, x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        nr = s.Nh // self.par.attn_tp
        a = f"{p}self_attn."
        if s.Q is not None:
            qkv = x @ self.w(f"{a}fused_qkv_a_proj.weight", r).T
            q_a, kv_a = qkv[:, : s.Q], qkv[:, s.Q:]
            q = rms_norm(q_a, self.w(f"{a}q_a_layernorm.weight", r), s.rms_norm_eps) @ self.w(f"{a}q_b_proj.weight", r).T
        else:
            q = x @ self.w(f"{a}q_proj.weight", r).T
            kv_a = x @ self.w(f"{a}kv_a_proj_with_mqa.weight", r).T
        t = x.shape[0]
        q = q.view(t, nr, s.P + s.R)
        q_nope, q_pe = q[..., : s.P], q[..., s.P:]
        kv_c = rms_norm(kv_a[:, : s.L], self.w(f"{a}kv_a_layernorm.weight", r), s.rms_norm_eps)
        q_pe, k_pe = self.rope(q_pe, kv_a[:, s.L:])
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        o_proj = self.w(f"{a}o_proj.weight", r)

        # Absorbed (decode) path: q_nope through W_K into the latent space, attention over the latent
        # cache, back out through W_V. W[b] is [N, K], the bmm computes X[b] @ W[b]^T (spec §4.1).
        own = self.ranks[r].manifest["tensors"]
        mla = next(n for n in own if n.startswith(self.name(a)) and n.endswith(".W_K")).removesuffix(".W_K")
        wk, wv = decode_mla(self.ranks[r], mla, self.device)
        q_lat = torch.einsum("tnp,nlp->tnl", q_nope, wk)
        scores = (torch.einsum("tnl,sl->nts", q_lat, kv_c) + torch.einsum("tnr,sr->nts", q_pe, k_pe)) * self.rope.scaling
        probs = torch.softmax(scores + mask, dim=-1)
        o_lat = torch.einsum("nts,sl->tnl", probs, kv_c)
        absorbed = torch.einsum("tnl,nvl->tnv", o_lat, wv).reshape(t, nr * s.V) @ o_proj.T

        # Prefill path: K-nope and V materialised through kv_b_proj (spec §4.3).
        kv = (kv_c @ self.w(f"{a}kv_b_proj.weight", r).T).view(t, nr, s.P + s.V)
        k_nope, v = kv[..., : s.P], kv[..., s.P:]
        scores = (torch.einsum("tnp,snp->nts", q_nope, k_nope) + torch.einsum("tnr,sr->nts", q_pe, k_pe)) * self.rope.scaling
        probs = torch.softmax(scores + mask, dim=-1)
        prefill = torch.einsum("nts,snv->tnv", probs, v).reshape(t, nr * s.V) @ o_proj.T
        return absorbed, prefill

    def attention(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outs = [self._attn_rank(p, x, r) for r in self.attn_ranks]
        return sum(o[0] for o in outs), sum(o[1] for o in outs)  # type: ignore[return-value]

    # -- MLP / MoE (spec §2.3, §2.4) ---------------------------------------------------------------
    def _mlp(self, name: str, x: torch.Tensor) -> torch.Tensor:
        out = 0
        for r in self.attn_ranks:
            gu = self.w(f"{name}.gate_up_proj.weight", r)
            g, u = gu.chunk(2, 0)  # gate first, then up
            out = out + (F.silu(x @ g.T) * (x @ u.T)) @ self.w(f"{name}.down_proj.weight", r).T
        return out  # type: ignore[return-value]

    def route(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k]) as the config's router computes them."""
        s = self.spec
        logits = x @ self.w(f"{p}mlp.gate.weight").T
        if s.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        choice = scores
        bias_name = f"{p}mlp.gate.e_score_correction_bias"
        if self.name(bias_name) in self.ranks[0]:
            choice = scores + self.w(bias_name)
        if s.topk_method in ("noaux_tc", "group_limited_greedy") and s.n_group > 1:
            grouped = choice.view(-1, s.n_group, s.E // s.n_group)
            gscore = grouped.topk(2, -1)[0].sum(-1) if s.topk_method == "noaux_tc" else grouped.max(-1).values
            keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(s.topk_group, -1)[1], 1).bool()
            choice = choice.masked_fill(~keep.repeat_interleave(s.E // s.n_group, 1), float("-inf"))
        ids = choice.topk(s.top_k, -1)[1]
        wts = scores.gather(1, ids)
        if s.norm_topk_prob and s.top_k > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return ids, wts * s.routed_scaling_factor

    def moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        ids, wts = self.route(p, x)
        layout = self.ranks[0].manifest["model"]["moe_layers"][self.name(p.rstrip("."))]
        out = torch.zeros_like(x)
        base = f"{p}mlp.experts."
        ep = self.par.ep
        for r in range(len(self.ranks)):
            w13 = self.w(base + "w13_weight", r)
            w2 = self.w(base + "w2_weight", r)
            slot_ids = self.par.ranks[r].slots[: w13.shape[0]]  # slot -> expert id; id E is the shared expert
            for slot, e in enumerate(slot_ids):
                g, u = w13[slot].chunk(2, 0)
                if e == s.E:  # the fused shared expert, weight 1 for every token
                    # Under EP each token's shared column runs on one rank, token mod ep (spec §1.2).
                    tok = torch.arange(x.shape[0], device=x.device)
                    tok = tok[tok % ep == r % ep] if ep > 1 else tok
                    out.index_add_(0, tok, (F.silu(x[tok] @ g.T) * (x[tok] @ u.T)) @ w2[slot].T)
                    continue
                tok, k = (ids == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                h = F.silu(x[tok] @ g.T) * (x[tok] @ u.T)
                out.index_add_(0, tok, (h @ w2[slot].T) * wts[tok, k, None])
        if layout == "separate_shared_experts":
            out += self._mlp(f"{p}mlp.shared_experts", x)
        return out

    def layer(self, i: int, x: torch.Tensor, prefix: str | None = None, absorbed: bool = False) -> LayerOut:
        """One decoder layer. The output continues from the kv_b (prefill) attention, which
        is exact, unless `absorbed`: then from W_K/W_V, whose fp8 re-quantisation adds noise
        that can flip MoE routing downstream."""
        s = self.spec
        p = prefix or f"model.layers.{i}."
        h = rms_norm(x, self.w(f"{p}input_layernorm.weight"), s.rms_norm_eps)
        attn, prefill = self.attention(p, h)
        x = x.to(F32) + (attn if absorbed else prefill)
        h = rms_norm(x, self.w(f"{p}post_attention_layernorm.weight"), s.rms_norm_eps)
        mlp = self.moe(p, h) if s.is_moe_layer(i) else self._mlp(f"{p}mlp", h)
        return LayerOut(attn=attn, attn_prefill=prefill, out=x + mlp)

    def forward(self, ids: torch.Tensor, absorbed: bool = False) -> torch.Tensor:
        x = self.embed(ids)
        for i in range(self.spec.n_layers):
            x = self.layer(i, x, absorbed=absorbed).out
        return self.logits(x)


def compare(got: torch.Tensor, ref: torch.Tensor, logits: bool = False) -> dict[str, float]:
    """Relative L2, cosine, max abs error (and, for logits [T, vocab], top-1 agreement)."""
    g, r = got.double().flatten(), ref.double().flatten()
    out = {
        "rel_l2": float((g - r).norm() / max(float(r.norm()), 1e-30)),
        "cosine": float(F.cosine_similarity(g, r, dim=0)),
        "max_abs": float((g - r).abs().max()),
    }
    if logits:
        out["top1"] = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    return out
