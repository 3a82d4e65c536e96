"""Values of tensors, source or converted, in fp32: what the checks and the reference
forward compare. One place that knows every stored form."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layout.codecs.fp8_block import block_dequant
from ..layout.codecs.int4_pack import int4_dequant
from ..layout.codecs.mxfp4 import MXFP4_BLOCK, e8m0_unshuffle, mxfp4_dequant
from ..layout.codecs.shuffle import unshuffle16

if TYPE_CHECKING:
    from ..store.reader import ConvertedCheckpoint
    from ..files.source import SourceCheckpoint

F32 = torch.float32
FP4X2 = "float4_e2m1fn_x2"


def source_value(src: "SourceCheckpoint", weight_name: str) -> torch.Tensor:
    """fp32 value of a source weight: fp8 block (`weight_scale_inv`), Quark MXFP4
    (uint8 with `weight_scale`), compressed-tensors int4 (`X.weight_packed`, or `X.weight` of a
    module stored so: the exact q * fp32(scale), atom-layout-next.md §4.1), or plain float."""
    base = weight_name.removesuffix(".weight_packed").removesuffix(".weight")
    if f"{base}.weight_packed" in src and (weight_name.endswith(".weight_packed") or weight_name not in src):
        return int4_dequant(src.get(f"{base}.weight_packed"), src.get(f"{base}.weight_scale"))
    w = src.get(weight_name)
    if w.dtype == torch.float8_e4m3fn and f"{base}.weight_scale_inv" in src:
        return block_dequant(w, src.get(f"{base}.weight_scale_inv"))
    if w.dtype == torch.uint8 and f"{base}.weight_scale" in src:
        return mxfp4_dequant(w, src.get(f"{base}.weight_scale"))
    return w.to(F32)


def scale_name(name: str) -> str:
    """`X.weight` -> `X.weight_scale`; `w13_weight` -> `w13_weight_scale`."""
    return name + "_scale" if name.endswith("_weight") else name.removesuffix(".weight") + ".weight_scale"


def decode_weight(ck: "ConvertedCheckpoint", name: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """fp32 values of a converted weight in plain [.., N, K] order, as the runtime computes with it:
    shuffle undone, fp8 decoded by its own dtype (e4m3fnuz holds half the e4m3fn value, with a
    doubled scale), MXFP4 codes times e8m0 scales (un-shuffled, padding cropped from the scale;
    MXFP4 MoE keeps its zero padding, see `unpad_moe`)."""
    e = ck.entry(name)
    w = ck.get(name).to(device)
    if e["is_shuffled"]:
        w = unshuffle16(w)
    sname = scale_name(name)
    if sname not in ck.manifest["tensors"] or w.is_floating_point() and w.element_size() >= 2:
        # a bf16/fp32 weight is its own value: a scale beside it is vestigial (the DSA indexer's
        # fused wk_weights_proj keeps wk's checkpoint block scale, atom-layout-next.md §1.5)
        return w.to(F32)
    s = ck.get(sname).to(device)
    if e.get("runtime_dtype") == FP4X2:
        k = w.shape[-1] * 2 // MXFP4_BLOCK
        if s.dim() == 2 and w.dim() == 3:  # MoE: one 2-D [E*N, K/32] scale, e8m0-shuffled as a whole
            s = e8m0_unshuffle(s, w.shape[0] * w.shape[1], k).reshape(w.shape[0], w.shape[1], k)
        elif ck.entry(sname).get("layout", {}).get("e8m0_shuffled"):
            s = e8m0_unshuffle(s, w.shape[0], k)
        return mxfp4_dequant(w, s)
    if w.dim() == 3:
        return torch.stack([block_dequant(w[i], s[i]) for i in range(w.shape[0])])
    return block_dequant(w, s)


def unpad_moe(t: torch.Tensor, entry: dict, which: str) -> torch.Tensor:
    """Drop the MXFP4 MoE intermediate padding (spec §3.3.2): w13 keeps rows [0, I) and
    [I_pad, I_pad + I); w2 keeps columns [0, I)."""
    lay = entry.get("layout") or {}
    if "intermediate_padded" not in lay:
        return t
    il, ip = lay["intermediate"], lay["intermediate_padded"]
    if which == "w13":
        return torch.cat([t[:, :il], t[:, ip:ip + il]], 1)
    return t[..., :il]


def decode_mla(ck: "ConvertedCheckpoint", owner: str, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(W_K [Nr, L, P], W_V [Nr, V, L]) in fp32 from either MLA layout (spec §4.1 fp8, §4.2 MXFP4)."""
    out = []
    for attr in ("W_K", "W_V"):
        w = ck.get(f"{owner}.{attr}").to(device)
        s = ck.get(f"{owner}.{attr}_scale").to(device)
        if s.dtype == torch.uint8:  # MXFP4 operands: e8m0 scales per 32 (spec §4.2); fp8: one fp32 scale
            out.append(mxfp4_dequant(w, s))
        else:
            out.append(w.to(F32) * s)
    return out[0], out[1]
