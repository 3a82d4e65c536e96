"""DeepSeek's MLA hook: the batched-GEMM operands W_K/W_V from the processed kv_b_proj
(spec §4.1), in fp8 or, under --mla-bmm mxfp4, MXFP4 (spec §4.2)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from ...errors import UnsupportedError
from ..plan import OutTensor
from ..postload import TensorSpec
from ..profile import NATIVE_MLA_OWNER
from ..codecs.base import LinearCodec, LinearData
from ..codecs.fp8_block import identity_readback
from ..codecs.mxfp4 import MXFP4_BLOCK, dynamic_mxfp4_quant
from ..codecs.per_tensor import per_tensor_quant
from .deepseek_rules import BF16, KV_B, _Ctx, _out, _read_linear

# The rounding of the MXFP4 MLA operands (spec §10.1): pinned per layout revision.
MXFP4_ROUNDING = "aiter e4048607a triton dynamic_mxfp4_quant: e8m0 from amax rounded up, e2m1 half to even, -0 kept"


# --------------------------------------------------------------------------------------------
# Hook 2: MLA batched-GEMM operands from the processed kv_b_proj (spec §4.1)
# --------------------------------------------------------------------------------------------


def kv_b_bf16(codec: LinearCodec, data: LinearData, target_fp8: torch.dtype) -> torch.Tensor:
    """What `get_and_maybe_dequant_weights(kv_b_proj)` returns (spec §4.1 step 1, §6.4): the bf16
    weight itself; for a DeepSeek fp8 one, the processed layer's blockscale GEMM against an
    identity (`identity_readback`: the kernel's epilogue, not a plain bf16(value x scale), which
    differs in rare ulps); an MXFP4 value is exact in bf16."""
    if codec.name == "fp8-block":
        assert data.scale is not None
        return identity_readback(data.weight, data.scale, target_fp8)
    return codec.dequant(data).to(BF16)


def mla_operands(wkvb: torch.Tensor, nr: int, P: int, V: int, L: int, fp8: torch.dtype,
                 bmm: str = "fp8") -> dict[str, torch.Tensor]:
    """W_K and W_V from the rank's kv_b [Nr(P+V), L] in bf16.

    bmm "fp8" (default, spec §4.1): W_K [Nr, L, P], W_V [Nr, V, L] in fp8, one fp32 scalar scale each.
    bmm "mxfp4" (ATOM_USE_TRITON_MXFP4_BMM=1, spec §4.2): W_K [Nr, L, P/2] quantised along P,
    W_V [Nr, V, L/2] along L, uint8 packed e2m1 with plain row-major e8m0 scales (not shuffled).
    """
    x = wkvb.view(nr, P + V, L)
    wk = x[:, :P, :].transpose(1, 2)  # W_K[n, l, p] = Wkvb[n(P+V)+p, l]
    wv = x[:, P:, :]  # W_V[n, v, l] = Wkvb[n(P+V)+P+v, l]
    if bmm == "mxfp4":
        qk, sk = dynamic_mxfp4_quant(wk.contiguous())
        qv, sv = dynamic_mxfp4_quant(wv.contiguous())
        return {"W_K": qk, "W_K_scale": sk, "W_V": qv, "W_V_scale": sv}
    qk, sk = per_tensor_quant(wk, fp8)
    qv, sv = per_tensor_quant(wv, fp8)
    return {"W_K": qk, "W_K_scale": sk, "W_V": qv, "W_V_scale": sv}


def _mla(ctx: _Ctx, src_prefix: str, codecs: list[LinearCodec], attr: str, rank: int,
         cache: dict[str, Any]) -> Iterator[torch.Tensor]:
    key = f"{src_prefix}mla"
    if key not in cache:
        d = _read_linear(ctx, KV_B, src_prefix, codecs, rank)
        s = ctx.spec
        cache[key] = mla_operands(kv_b_bf16(codecs[0], d, ctx.fp8), s.Nh // ctx.tp, s.P, s.V, s.L, ctx.fp8, ctx.mla_bmm)
    yield cache[key].pop(attr)
    if not cache[key]:
        del cache[key]


def _plan_mla(ctx: _Ctx, src_prefix: str, out_prefix: str) -> list[OutTensor]:
    s = ctx.spec
    nr = s.Nh // ctx.tp
    codecs = [ctx.fmt.codec_for(src_prefix + p) for p in KV_B.parts]
    sources = tuple(codecs[0].source_names(src_prefix + KV_B.parts[0]))
    attn = f"{out_prefix}self_attn"
    if ctx.mla_bmm == "mxfp4":
        if s.P % MXFP4_BLOCK or s.L % MXFP4_BLOCK:
            raise UnsupportedError(f"--mla-bmm mxfp4 needs qk_nope_head_dim ({s.P}) and kv_lora_rank ({s.L}) to be "
                                   f"multiples of 32 (spec §4.2)")
        # ATOM holds the packed e2m1 pairs as uint8 here, not as float4_e2m1fn_x2 (b_dynamic_mxfp4_quant,
        # atom/model_ops/utils.py 191-194, over aiter's dynamic_mxfp4_quant)
        specs = {"W_K": TensorSpec(torch.uint8, (nr, s.L, s.P // 2), runtime_dtype="uint8"),
                 "W_K_scale": TensorSpec(torch.uint8, (nr, s.L, s.P // MXFP4_BLOCK), runtime_dtype="uint8"),
                 "W_V": TensorSpec(torch.uint8, (nr, s.V, s.L // 2), runtime_dtype="uint8"),
                 "W_V_scale": TensorSpec(torch.uint8, (nr, s.V, s.L // MXFP4_BLOCK), runtime_dtype="uint8")}
        rounding = {"rounding": MXFP4_ROUNDING}
        specs = {k: TensorSpec(v.dtype, v.shape, runtime_dtype=v.runtime_dtype, meta=rounding) for k, v in specs.items()}
    else:
        specs = {"W_K": TensorSpec(ctx.fp8, (nr, s.L, s.P)), "W_K_scale": TensorSpec(torch.float32, ()),
                 "W_V": TensorSpec(ctx.fp8, (nr, s.V, s.L)), "W_V_scale": TensorSpec(torch.float32, ())}
    # Per rank, from the rank's kv_b heads; one piece (identical on every rank) under DP-attention (spec
    # atom-parallel.md §2.2: the per-tensor scale is then taken over all heads).
    return [_out(f"{attn}.{NATIVE_MLA_OWNER}.{a}", spec, sources, partial(_mla, ctx, src_prefix, codecs, a), ctx.split("heads"))
            for a, spec in specs.items()]

