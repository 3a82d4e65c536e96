"""What ATOM's `process_weights_after_loading` does to a linear or a fused-MoE
layer, per quantisation method, at the default flags (spec §3).

The loader decides *which* source bytes form a rank's parameter (names,
fusion, TP slices); this module decides what the runtime then holds: dtype,
shape, padding, fnuz normalisation, shuffles. One entry per codec name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import buffers
from ..errors import UnsupportedError
from .codecs.fnuz import fnuz_normalize_, fnuz_normalize_scan_, target_scale
from ..files.dtypes import FP8_BLOCK, FP8_DTYPE_BY_TARGET
from ..files.values import has_fp8_nan_code
from .codecs.fp8_block import cdiv
from .codecs.mxfp4 import E8M0_SHUFFLE_COLS, E8M0_SHUFFLE_ROWS, MXFP4_BLOCK, e8m0_shuffle
from .codecs.shuffle import shuffle16, shuffle16_into, shuffle_requirements_met

BF16 = torch.bfloat16
FP4X2 = "float4_e2m1fn_x2"  # what the runtime views the uint8 bytes as (spec §10)
E8M0 = "float8_e8m0fnu"
MOE_PAD = 256  # MXFP4 MoE pads I_loc and H to multiples of 256 (spec §3.3.2)


@dataclass(frozen=True)
class TensorSpec:
    """One planned runtime tensor: stored dtype and shape, and how the runtime views it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    shuffled: bool = False
    runtime_dtype: str | None = None  # when the runtime re-views the stored bytes (fp4x2, e8m0)
    meta: dict[str, Any] = field(default_factory=dict)


class LinearPostLoad:
    """Unquantized linear: kept as is, [out, in] bf16, never shuffled (spec §3.1)."""

    quantized = False

    def check(self, module: str, part_rows: list[int], cols: int, row_split: bool, col_split: bool, tp: int,
              parts: list[str]) -> None:
        """Refuse what ATOM cannot load. part_rows/cols are per rank; row_split: column-parallel
        at tp > 1 (output rows sliced), col_split: row-parallel at tp > 1 (input columns sliced)."""

    def plan(self, part_rows: list[int], cols: int, target: str) -> tuple[TensorSpec, TensorSpec | None]:
        return TensorSpec(BF16, (sum(part_rows), cols)), None

    def apply(self, w: torch.Tensor, s: torch.Tensor | None, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return w.to(BF16), None


class Fp8BlockPostLoad(LinearPostLoad):
    """per_1x128 (spec §3.2): fnuz on gfx942, then shuffle16; fp32 [N/128, K/128] scale kept as is."""

    quantized = True

    def check(self, module: str, part_rows: list[int], cols: int, row_split: bool, col_split: bool, tp: int,
              parts: list[str]) -> None:
        if row_split and any(r % FP8_BLOCK for r in part_rows):
            raise UnsupportedError(
                f"{module}: a rank's {part_rows} rows (tp={tp}) do not start on a 128-row fp8 scale block boundary; "
                f"ATOM slices scale rows by rank and would misplace them (spec §3.2). Use a tp that keeps rows per "
                f"rank a multiple of 128."
            )
        if col_split and cols % FP8_BLOCK:
            raise UnsupportedError(
                f"{module}: a rank's {cols} input columns (tp={tp}) are not a multiple of the 128-column fp8 scale "
                f"block (spec §3.2). Use a smaller tp."
            )
        for part, r in zip(parts[:-1], part_rows[:-1]):
            if r % FP8_BLOCK:
                what = "q_lora_rank" if part.endswith("q_a_proj") else "rows per rank"
                raise UnsupportedError(
                    f"{module}: cannot fuse fp8 {part} ({what} {r}) with the next part: {r} is not a multiple of "
                    f"128, so the next part's rows would start inside a 128x128 scale block (spec §2.2). ATOM "
                    f"cannot load this checkpoint fused."
                )
        if not shuffle_requirements_met((sum(part_rows), cols)):
            raise UnsupportedError(
                f"{module}: per-rank fp8 weight [{sum(part_rows)}, {cols}] cannot take ATOM's 16x16 shuffle "
                f"(needs rows % 16 == 0 and columns % 32 == 0, spec §3.0.3)"
            )

    def plan(self, part_rows: list[int], cols: int, target: str) -> tuple[TensorSpec, TensorSpec | None]:
        fp8 = FP8_DTYPE_BY_TARGET[target]
        srows = sum(cdiv(r, FP8_BLOCK) for r in part_rows)
        return (TensorSpec(fp8, (sum(part_rows), cols), shuffled=True),
                TensorSpec(torch.float32, (srows, cdiv(cols, FP8_BLOCK))))

    def apply(self, w: torch.Tensor, s: torch.Tensor | None, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert s is not None
        # Every per_1x128 linear is shuffled: the PRESHUFFLE flag defaults to 1, and
        # fused_qkv_a_proj is shuffled regardless (spec §3.2 step 2). fnuz (per byte) is applied
        # in place on the shuffled copy: the same bytes as fnuz then shuffle, one copy fewer.
        return _fp8_shuffled(w, target), target_scale(s, target)


class Mxfp4PostLoad(LinearPostLoad):
    """per_1x32 MXFP4 linear (spec §3.3.1): shuffle16 on the packed bytes, e8m0shuf on the
    scale (rows padded to 256, columns to 8; the pad is zero here, uninitialised at run time)."""

    quantized = True

    def check(self, module: str, part_rows: list[int], cols: int, row_split: bool, col_split: bool, tp: int,
              parts: list[str]) -> None:
        if cols % MXFP4_BLOCK:
            raise UnsupportedError(
                f"{module}: a rank's {cols} input columns (tp={tp}) are not a multiple of the MXFP4 group of 32 "
                f"(spec §3.3.1). Use a smaller tp."
            )
        if not shuffle_requirements_met((sum(part_rows), cols // 2)):
            raise UnsupportedError(
                f"{module}: per-rank MXFP4 weight [{sum(part_rows)}, {cols // 2}] bytes cannot take ATOM's 16x16 "
                f"shuffle (needs rows % 16 == 0 and bytes % 32 == 0, spec §3.0.3)"
            )

    def plan(self, part_rows: list[int], cols: int, target: str) -> tuple[TensorSpec, TensorSpec | None]:
        rows = sum(part_rows)
        sc = cols // MXFP4_BLOCK
        pad = (cdiv(rows, E8M0_SHUFFLE_ROWS) * E8M0_SHUFFLE_ROWS, cdiv(sc, E8M0_SHUFFLE_COLS) * E8M0_SHUFFLE_COLS)
        return (TensorSpec(torch.uint8, (rows, cols // 2), shuffled=True, runtime_dtype=FP4X2),
                TensorSpec(torch.uint8, pad, runtime_dtype=E8M0, meta={"e8m0_shuffled": True, "unpadded_shape": [rows, sc]}))

    def apply(self, w: torch.Tensor, s: torch.Tensor | None, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert s is not None
        return shuffle16(w), e8m0_shuffle(s)


LINEAR: dict[str, LinearPostLoad] = {
    "bf16": LinearPostLoad(),
    "fp8-block": Fp8BlockPostLoad(),
    "mxfp4": Mxfp4PostLoad(),
}


# ---------------------------------------------------------------------------------------------
# Fused MoE: w13 = [gate; up] per expert, w2 = down (spec §2.4)
# ---------------------------------------------------------------------------------------------


class MoEPostLoad:
    """bf16 experts (spec §3.1): stacked, shuffle16 with Ke = 8, no scales."""

    quantized = False

    def check(self, where: str, il: int, H: int, tp: int) -> None:
        if not (shuffle_requirements_met((2 * il, H)) and shuffle_requirements_met((H, il))):
            raise UnsupportedError(
                f"{where}: per-rank expert weights [{2 * il}, {H}] and [{H}, {il}] cannot take ATOM's 16x16 shuffle "
                f"(rows % 16, columns % 32, spec §3.0.3)"
            )

    def plan(self, n: int, il: int, H: int, target: str) -> dict[str, TensorSpec]:
        return {"w13_weight": TensorSpec(BF16, (n, 2 * il, H), shuffled=True),
                "w2_weight": TensorSpec(BF16, (n, H, il), shuffled=True)}

    def scans_values(self, target: str) -> bool:
        """Whether w13/w2 scan every byte of the expert weights for bad values themselves, so the
        reads may leave the check to them (LinearCodec.read's defer_check)."""
        return False

    def w13(self, gate: Any, up: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _stack_shuffled([gate.weight.to(BF16), up.weight.to(BF16)]), None

    def w2(self, down: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return shuffle16(down.weight.to(BF16)), None


class Fp8MoEPostLoad(MoEPostLoad):
    """per_1x128 experts (spec §3.2): fnuz on gfx942, shuffle16 per expert, fp32 block scales."""

    quantized = True

    def check(self, where: str, il: int, H: int, tp: int) -> None:
        if il % FP8_BLOCK:
            raise UnsupportedError(
                f"{where}: fp8 MoE needs the per-rank intermediate size to be a multiple of 128 (ATOM asserts it, "
                f"spec §3.2); got {il} at tp={tp}"
            )
        super().check(where, il, H, tp)

    def plan(self, n: int, il: int, H: int, target: str) -> dict[str, TensorSpec]:
        fp8 = FP8_DTYPE_BY_TARGET[target]
        return {
            "w13_weight": TensorSpec(fp8, (n, 2 * il, H), shuffled=True),
            "w13_weight_scale": TensorSpec(torch.float32, (n, 2 * cdiv(il, FP8_BLOCK), cdiv(H, FP8_BLOCK))),
            "w2_weight": TensorSpec(fp8, (n, H, il), shuffled=True),
            "w2_weight_scale": TensorSpec(torch.float32, (n, cdiv(H, FP8_BLOCK), cdiv(il, FP8_BLOCK))),
        }

    def scans_values(self, target: str) -> bool:
        # The shuffled weight is scanned for e4m3fn NaN codes while it is in the cache, where the
        # read's check would read the source from memory: on gfx942 in the fnuz pass, in L2-sized
        # steps (fnuz_normalize_scan_; about a tenth of a gfx942 conversion's CPU time on the 2-core
        # box, BENCHMARKS.md, issue 9, seventh round), on gfx950 by the check's own two reductions
        # (_to_target_scanned). The shuffle moves bytes and fnuz clears only 0x80, so a NaN code is in
        # the output exactly when it is in the source.
        return True

    def w13(self, gate: Any, up: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        # [gate; up] shuffled straight into one tensor, then fnuz in place on gfx942: the same bytes
        # as fnuz -> cat -> shuffle16 with one pass and one allocation fewer (each part is a whole
        # number of 16-row bands; fnuz is per byte).
        w = _to_target_scanned(_stack_shuffled([gate.weight, up.weight]), target, [gate, up])
        # cat copies: a view would keep the expert's file pages mapped
        return w, target_scale(torch.cat([gate.scale, up.scale], 0), target)

    def w2(self, down: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _fp8_shuffled(down.weight, target, [down]), target_scale(down.scale, target).clone()


class Mxfp4MoEPostLoad(MoEPostLoad):
    """MXFP4 experts, gfx950 CK path at HEAD defaults (spec §3.3.2): intermediate padded to
    256 per half (gate rows [0, I_loc), up rows [I_pad, I_pad + I_loc)), zero-filled;
    shuffle16 on the bytes per expert; scales e8m0shuf'd as one 2-D [E*N, K/32] tensor
    (uint8, no padding appears since N is a multiple of 256 and K/32 of 8)."""

    quantized = True

    def check(self, where: str, il: int, H: int, tp: int) -> None:
        if H % MOE_PAD:
            raise UnsupportedError(
                f"{where}: MXFP4 MoE needs hidden_size % 256 == 0 (ATOM HEAD pads only the intermediate dimension "
                f"when loading, spec §10); got {H}"
            )
        if il % MXFP4_BLOCK:
            raise UnsupportedError(
                f"{where}: the per-rank intermediate size {il} (tp={tp}) is not a multiple of the MXFP4 group of 32"
            )

    @staticmethod
    def padded(il: int) -> int:
        return cdiv(il, MOE_PAD) * MOE_PAD

    def plan(self, n: int, il: int, H: int, target: str) -> dict[str, TensorSpec]:
        ip = self.padded(il)
        pad = {"intermediate": il, "intermediate_padded": ip}
        return {
            "w13_weight": TensorSpec(torch.uint8, (n, 2 * ip, H // 2), shuffled=True, runtime_dtype=FP4X2, meta=pad),
            "w13_weight_scale": TensorSpec(torch.uint8, (n * 2 * ip, H // MXFP4_BLOCK), runtime_dtype="uint8",
                                           meta={"e8m0_shuffled": True, "experts": n, **pad}),
            "w2_weight": TensorSpec(torch.uint8, (n, H, ip // 2), shuffled=True, runtime_dtype=FP4X2, meta=pad),
            "w2_weight_scale": TensorSpec(torch.uint8, (n * H, ip // MXFP4_BLOCK), runtime_dtype="uint8",
                                          meta={"e8m0_shuffled": True, "experts": n, **pad}),
        }

    def w13(self, gate: Any, up: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        il, kb = gate.weight.shape
        ip = self.padded(il)
        # The zero pad rows [il, ip) of each half are whole 16-row bands (il is a multiple of 32),
        # and a zero band shuffles to zeros: shuffle each half straight into place.
        w = buffers.empty((2 * ip, kb), torch.uint8)
        for part, at in ((gate.weight, 0), (up.weight, ip)):
            shuffle16_into(w[at:at + il], part)
            w[at + il:at + ip].zero_()
        s = torch.zeros(2 * ip, gate.scale.shape[1], dtype=torch.uint8)
        s[:il], s[ip:ip + il] = gate.scale, up.scale
        # e8m0shuf of the flattened [E*N, K/32] scale is, for N a multiple of 32, the
        # concatenation of each expert's own e8m0shuf: rows are permuted within 32-row blocks.
        return w, e8m0_shuffle(s)

    def w2(self, down: Any, target: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        H, ib = down.weight.shape
        ip = self.padded(ib * 2)
        w = buffers.zeros((H, ip // 2), torch.uint8)  # padded, then shuffled into a second buffer
        s = torch.zeros(H, ip // MXFP4_BLOCK, dtype=torch.uint8)
        w[:, :ib], s[:, :down.scale.shape[1]] = down.weight, down.scale
        return shuffle16(w), e8m0_shuffle(s)


def _fp8_shuffled(w: torch.Tensor, target: str, parts: Sequence[Any] = ()) -> torch.Tensor:
    """shuffle16(fnuz(w)) on gfx942, shuffle16(w) on gfx950, as one fresh tensor; `parts`: the
    LinearData w is the weight of, for their deferred value checks (`_to_target_scanned`)."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8 weight expected as float8_e4m3fn, got {w.dtype}")
    return _to_target_scanned(shuffle16(w), target, parts)


def _to_target_scanned(w: torch.Tensor, target: str, parts: Sequence[Any]) -> torch.Tensor:
    """`w` (e4m3fn, shuffled, made from the parts' weights: LinearData) in the target's fp8: fnuz in
    place on gfx942, unchanged on gfx950. Parts read with their value check deferred (`recheck` set)
    are checked here: `w` is scanned for e4m3fn NaN codes while it is hot (in the fnuz pass on gfx942,
    by two reductions on gfx950), and only when it holds one do their checks run, the first bad one
    reporting as the read would have (BadInputError naming file, tensor and stored index; with
    --allow-nonfinite, the manifest's record)."""
    rechecks = [p.recheck for p in parts if p.recheck is not None]
    if FP8_DTYPE_BY_TARGET[target] == torch.float8_e4m3fnuz:
        if not rechecks:
            return fnuz_normalize_(w)
        w, nan = fnuz_normalize_scan_(w)
    else:
        nan = bool(rechecks) and has_fp8_nan_code(w)
    if nan:
        for recheck in rechecks:
            recheck()
    return w


def _stack_shuffled(parts: list[torch.Tensor]) -> torch.Tensor:
    """shuffle16(cat(parts, 0)) without the concatenation: each part shuffled into its rows."""
    rows = sum(p.shape[0] for p in parts)
    out = buffers.empty((rows, *parts[0].shape[1:]), parts[0].dtype)
    at = 0
    for p in parts:
        shuffle16_into(out[at:at + p.shape[0]], p)
        at += p.shape[0]
    return out


MOE: dict[str, MoEPostLoad] = {
    "bf16": MoEPostLoad(),
    "fp8-block": Fp8MoEPostLoad(),
    "mxfp4": Mxfp4MoEPostLoad(),
}


def registered_shapes(shape: Sequence[int], layout: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """The shapes ATOM's model registers, before its post-load step, for a tensor that the files hold
    post-load with `shape` and the manifest's `layout` facts; empty where the two are the same.
    An MXFP4 linear's e8m0 scale is registered [rows, K/32] and padded by aiter's e8m0_shuffle
    (atom/model_ops/linear.py 875-878); a fused MoE's e8m0 scales are registered per expert
    [E, rows, K/32] and flattened to 2-D by the shuffle (atom/model_ops/moe.py 1305-1323)."""
    if not layout.get("e8m0_shuffled"):
        return ()
    if "unpadded_shape" in layout:
        return (tuple(int(x) for x in layout["unpadded_shape"]),)
    n = int(layout.get("experts", 0))
    if n and len(shape) == 2 and shape[0] % n == 0:
        return ((n, shape[0] // n, shape[1]),)
    return ()
