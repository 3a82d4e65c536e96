"""Oracle tests of the post-load primitives (spec §3.0.2, §3.0.3, §3.2, §4.1 step 5).

Each primitive is checked against something that does not share its code:
- shuffle16 / unshuffle16 against aiter's own `shuffle_weight` (loaded from the wheel) and the
  closed-form index map of spec §3.0.3;
- the fnuz fix against e4m3fn / e4m3fnuz value tables decoded here by bit arithmetic;
- block_dequant against compressed-tensors' FP8BlockDequantizer, file to file;
- per_tensor_quant against a re-statement of ATOM's `dynamic_per_batched_tensor_quant` whose
  final fp8 rounding is done here from the value tables (round to nearest, ties to even).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
from oracles import fp8_block_dequantize_dir
from safetensors import safe_open
from safetensors.torch import save_file

from atom_convert.layout import buffers
from atom_convert.layout.codecs import fnuz as fnuz_mod
from atom_convert.layout.codecs.fnuz import (fnuz_normalize, fnuz_normalize_, fnuz_normalize_scan_, fnuz_scale, target_scale,
                                    to_target_fp8)
from atom_convert.layout.codecs.fp8_block import block_dequant, fp8_float, identity_readback
from atom_convert.layout.codecs.per_tensor import per_tensor_quant
from atom_convert.layout.codecs.shuffle import shuffle16, shuffle_requirements_met, unshuffle16

FN = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
BF16 = torch.bfloat16
FP8_QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _seed(*parts: object) -> int:
    """A stable seed per test case (hash() of strings changes between runs)."""
    return zlib.crc32(repr(parts).encode())


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Fresh random data of any dtype: random bytes for 1-byte types, normal values otherwise."""
    if dtype in (FN, FNUZ, torch.uint8):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small tensors: torch's intra-op threads only add overhead on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# shuffle16 (spec §3.0.3)
# ------------------------------------------------------------------------------------------------

SHUFFLE_CASES = [
    ((16, 32), FN),
    ((64, 96), FN),
    ((48, 320), FN),
    ((256, 128), FN),
    ((32, 64), FNUZ),
    ((16, 32), torch.uint8),
    ((80, 224), torch.uint8),
    ((16, 32), BF16),
    ((48, 96), BF16),
    ((320, 256), BF16),
    ((32, 64), torch.float32),
    ((3, 32, 64), FN),
    ((9, 256, 320), FN),
    ((5, 16, 96), torch.uint8),
    ((4, 48, 128), BF16),
    ((9, 320, 128), BF16),
    ((2, 3, 16, 64), FN),
]


@pytest.mark.parametrize("shape,dtype", SHUFFLE_CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_shuffle16_equals_aiter(aiter, shape, dtype):
    _, shf = aiter
    gen = torch.Generator().manual_seed(_seed(shape, str(dtype)))
    x = _random(shape, dtype, gen)
    before = _bytes(x).clone()
    want = shf.shuffle_weight(x.clone(), layout=(16, 16))
    got = shuffle16(x)
    assert got.dtype == dtype and tuple(got.shape) == shape and got.is_contiguous()
    assert torch.equal(_bytes(got), _bytes(want))
    assert torch.equal(_bytes(x), before), "shuffle16 modified its input"
    assert not torch.equal(_bytes(got), before), "a random tensor must not be left in place"


@pytest.mark.parametrize("shape,dtype", SHUFFLE_CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_unshuffle16_inverts(aiter, shape, dtype):
    _, shf = aiter
    gen = torch.Generator().manual_seed(_seed(1, shape, str(dtype)))
    x = _random(shape, dtype, gen)
    back = unshuffle16(shf.shuffle_weight(x.clone(), layout=(16, 16)))
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(_bytes(back), _bytes(x))
    assert torch.equal(_bytes(unshuffle16(shuffle16(x))), _bytes(x))
    assert torch.equal(_bytes(shuffle16(unshuffle16(x))), _bytes(x))


@pytest.mark.parametrize("dtype", [FN, BF16, torch.float32])
def test_shuffle16_closed_form(dtype):
    """Spec §3.0.3: (n, k) moves to ((n0·(K/32) + k0)·(32/Ke) + k1)·16·Ke + n1·Ke + k2."""
    n_rows, k_cols = 48, 96
    ke = 16 // torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(7)
    x = _random((n_rows, k_cols), dtype, gen)
    flat = shuffle16(x).reshape(-1)
    n = torch.arange(n_rows)[:, None].expand(n_rows, k_cols)
    k = torch.arange(k_cols)[None, :].expand(n_rows, k_cols)
    n0, n1, k0, k1, k2 = n // 16, n % 16, k // 32, (k % 32) // ke, k % ke
    pos = ((n0 * (k_cols // 32) + k0) * (32 // ke) + k1) * 16 * ke + n1 * ke + k2
    assert sorted(pos.reshape(-1).tolist()) == list(range(n_rows * k_cols))
    assert torch.equal(_bytes(flat[pos.reshape(-1)]), _bytes(x.reshape(-1)))


BAD_SHAPES = [
    ((8, 32), FN),  # rows % 16
    ((24, 64), FN),
    ((16, 16), FN),  # cols % 32
    ((16, 48), FN),
    ((16, 16), BF16),  # 32 bytes, but 16 elements: the rule counts elements
    ((32, 40), torch.uint8),
    ((2, 16, 48), FN),
    ((2, 20, 32), BF16),
    ((32,), FN),  # fewer than 2 dims
]


@pytest.mark.parametrize("shape,dtype", BAD_SHAPES, ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_shuffle16_rejects_bad_shapes(aiter, shape, dtype):
    _, shf = aiter
    x = torch.zeros(shape, dtype=torch.uint8).view(dtype) if dtype != BF16 else torch.zeros(shape, dtype=BF16)
    with pytest.raises(ValueError):
        shuffle16(x)
    with pytest.raises(ValueError):
        unshuffle16(x)
    assert not shuffle_requirements_met(shape)
    if len(shape) >= 2:  # aiter refuses the same shapes
        with pytest.raises((AssertionError, RuntimeError)):
            shf.shuffle_weight(x, layout=(16, 16))


def test_shuffle_requirements_met_accepts_good_shapes():
    for shape, _ in SHUFFLE_CASES:
        assert shuffle_requirements_met(shape)


# ------------------------------------------------------------------------------------------------
# e4m3fn -> e4m3fnuz (spec §3.0.2), against tables decoded here by bit arithmetic
# ------------------------------------------------------------------------------------------------


def e4m3fn_value(b: int) -> float | None:
    """OCP e4m3fn: bias 7, no inf, S.1111.111 is NaN, 0x80 is -0."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return None
    if e == 0:
        return sign * m * 2.0**-9  # subnormal: m/8 * 2^(1-7)
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def e4m3fnuz_value(b: int) -> float | None:
    """e4m3fnuz: bias 8, no inf, no -0; 0x80 is the only NaN."""
    if b == 0x80:
        return None
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0:
        return sign * m * 2.0**-10  # m/8 * 2^(1-8)
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 8)


VALUE = {FN: e4m3fn_value, FNUZ: e4m3fnuz_value}


def test_value_tables_sane():
    fn = [e4m3fn_value(b) for b in range(256)]
    fnuz = [e4m3fnuz_value(b) for b in range(256)]
    assert [b for b in range(256) if fn[b] is None] == [0x7F, 0xFF]
    assert [b for b in range(256) if fnuz[b] is None] == [0x80]
    assert max(v for v in fn if v is not None) == 448.0 == torch.finfo(FN).max
    assert max(v for v in fnuz if v is not None) == 240.0 == torch.finfo(FNUZ).max
    # both dtypes decode exactly like the tables (the dtype carries the decoding)
    codes = torch.arange(256, dtype=torch.uint8)
    for dt, table in ((FN, fn), (FNUZ, fnuz)):
        dec = codes.view(dt).double().tolist()
        for b in range(256):
            if table[b] is None:
                assert math.isnan(dec[b])
            else:
                assert dec[b] == table[b] and math.copysign(1, dec[b]) == math.copysign(1, table[b]), (dt, b)


def test_fnuz_normalize_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    x = codes.clone().view(FN)
    y = fnuz_normalize(x)
    assert y.dtype == FNUZ and y.shape == x.shape
    assert torch.equal(x.view(torch.uint8), codes), "fnuz_normalize modified its input"
    out = y.view(torch.uint8).tolist()
    assert out[0x80] == 0x00
    assert all(out[b] == b for b in range(256) if b != 0x80)
    checked = 0
    for b in range(256):
        v_fn = e4m3fn_value(b)
        if v_fn is None:
            continue
        v_fnuz = e4m3fnuz_value(out[b])
        assert v_fnuz is not None, f"byte {b:#04x} became NaN"
        assert v_fnuz * 2 == v_fn, f"byte {b:#04x}: fnuz {v_fnuz} * 2 != fn {v_fn}"
        checked += 1
    assert checked == 254


def test_fnuz_normalize_every_code_in_every_byte_lane():
    """The in-place path works on 8-byte words (quant/fnuz.py): each of the 256 codes at each of
    the 8 byte positions of a word, against the per-byte definition; plus sizes and offsets
    that take the per-byte fallback (not a multiple of 8, not 8-byte aligned)."""
    codes = torch.arange(256, dtype=torch.uint8)
    for shift in range(8):
        b = torch.cat([torch.full((shift,), 0x80, dtype=torch.uint8), codes,
                       torch.full(((-(shift + 256)) % 8,), 0x7F, dtype=torch.uint8)])
        assert b.numel() % 8 == 0
        want = torch.where(b == 0x80, torch.zeros_like(b), b)
        got = fnuz_normalize_(b.clone().view(FN))
        assert torch.equal(got.view(torch.uint8), want), shift
    gen = torch.Generator().manual_seed(5)
    big = torch.randint(0, 256, (3 * fnuz_mod._BLOCK * 8 + 8,), generator=gen, dtype=torch.uint8)  # several blocks
    big[::97] = 0x80
    for piece in (big, big[:-3], big[1:]):  # words; odd size; misaligned start
        want = torch.where(piece == 0x80, torch.zeros_like(piece), piece)
        assert torch.equal(fnuz_normalize(piece.view(FN)).view(torch.uint8), want)
        assert torch.equal(fnuz_normalize_(piece.clone().view(FN)).view(torch.uint8), want)


def test_fnuz_scan_finds_each_nan_code_in_every_lane_and_block():
    """fnuz_normalize_scan_ says whether an e4m3fn NaN code (0x7F, 0xFF) was among the bytes: for
    every code alone at every byte lane of a word, in the last block of several, on the word path
    and on the per-byte fallback (misaligned); and its bytes are fnuz_normalize_'s."""
    gen = torch.Generator().manual_seed(11)
    n = 2 * fnuz_mod._BLOCK * 8 + 64  # words: three blocks, the last a short one
    base = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    base[(base & 0x7F) == 0x7F] = 0x80  # no NaN code, some 0x80
    clean = base[:n]

    def placed(b: torch.Tensor, start: int) -> torch.Tensor:
        """b's bytes in a fresh buffer from byte `start` on: 0, the word path; 1, a start that is
        not 8-byte aligned, the per-byte fallback."""
        buf = torch.empty(start + b.numel(), dtype=torch.uint8)
        buf[start:] = b
        return buf[start:]

    for start in (0, 1):
        assert (placed(clean, start).data_ptr() % 8 == 0) == (start == 0)
        out, nan = fnuz_normalize_scan_(placed(clean, start).view(FN))
        assert not nan
        assert torch.equal(out.view(torch.uint8), fnuz_normalize_(clean.clone().view(FN)).view(torch.uint8))
        for code in range(256):
            for lane in range(8) if start == 0 else (3,):
                b = clean.clone()
                b[n - 64 + lane] = code
                out, nan = fnuz_normalize_scan_(placed(b, start).view(FN))
                assert nan == ((code & 0x7F) == 0x7F), (start, code, lane)
        # the flag does not change the bytes, and a NaN code in the first block is found too
        b = clean.clone()
        b[5] = 0xFF
        want = torch.where(b == 0x80, torch.zeros_like(b), b)
        out, nan = fnuz_normalize_scan_(placed(b, start).view(FN))
        assert nan and torch.equal(out.view(torch.uint8), want)
    assert fnuz_normalize_scan_(torch.empty(0, dtype=torch.uint8).view(FN))[1] is False


def test_fnuz_normalize_2d_random_and_dtype_guard():
    gen = torch.Generator().manual_seed(3)
    b = torch.randint(0, 256, (64, 96), generator=gen, dtype=torch.uint8)
    b[0, :8] = 0x80
    y = fnuz_normalize(b.view(FN))
    want = torch.where(b == 0x80, torch.zeros_like(b), b)
    assert y.dtype == FNUZ and torch.equal(y.view(torch.uint8), want)
    # applied exactly once: a second application (fnuz input) or other dtypes are refused
    for bad in (y, b, b.view(torch.int8), torch.zeros(4, 4, dtype=BF16)):
        with pytest.raises(TypeError):
            fnuz_normalize(bad)


def test_fnuz_scale_keeps_dequantised_value():
    gen = torch.Generator().manual_seed(4)
    s = (torch.rand(37, generator=gen) + 0.5) * torch.exp2(torch.randint(-30, 10, (37,), generator=gen).float())
    s0 = s.clone()
    d = fnuz_scale(s)
    assert d.dtype == torch.float32 and torch.equal(s, s0)
    assert torch.equal(d, s * 2)
    codes = torch.arange(256, dtype=torch.uint8)
    y = fnuz_normalize(codes.view(FN))
    # exact products, table values (python floats are exact for these)
    for b in range(256):
        v_fn = e4m3fn_value(b)
        if v_fn is None:
            continue
        v_fnuz = e4m3fnuz_value(y.view(torch.uint8)[b].item())
        for k in range(s.numel()):
            assert v_fnuz * d[k].item() == v_fn * s[k].item()
    # and in fp32, as the runtime multiplies: bit-identical, except that e4m3fn -0 (0x80)
    # becomes +0 (its only change of sign)
    ok = torch.tensor([e4m3fn_value(b) is not None and b != 0x80 for b in range(256)])
    lhs = y.float()[:, None] * d[None, :]
    rhs = codes.view(FN).float()[:, None] * s[None, :]
    assert torch.equal(lhs[ok].view(torch.int32), rhs[ok].view(torch.int32))
    assert torch.equal(lhs[0x80], rhs[0x80]) and not lhs[0x80].any()


def test_fnuz_block_dequant_unchanged_and_target_helpers():
    gen = torch.Generator().manual_seed(5)
    b = torch.randint(0, 256, (200, 300), generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # no e4m3fn NaN codes
    w = b.view(FN)
    s = torch.rand(2, 3, generator=gen) * 1e-2 + 1e-4
    ref = block_dequant(w, s)
    w942, s942 = to_target_fp8(w, s, "gfx942")
    assert w942.dtype == FNUZ and torch.equal(w942.view(torch.uint8), fnuz_normalize(w).view(torch.uint8))
    assert torch.equal(s942, s * 2) and torch.equal(target_scale(s, "gfx942"), s * 2)
    got = block_dequant(w942, s942)
    assert torch.equal(got, ref)  # equal values; bit-identical except -0 (0x80) -> +0
    keep = b != 0x80
    assert torch.equal(got[keep].view(torch.int32), ref[keep].view(torch.int32))
    w950, s950 = to_target_fp8(w, s, "gfx950")
    assert w950.dtype == FN and torch.equal(w950.view(torch.uint8), b)
    assert torch.equal(s950, s) and torch.equal(target_scale(s, "gfx950"), s)


# ------------------------------------------------------------------------------------------------
# block_dequant (spec §3.2, §8.4) against compressed-tensors' FP8BlockDequantizer
# ------------------------------------------------------------------------------------------------


def ct_dequantize_dir(src: Path, out: Path) -> Path:
    return fp8_block_dequantize_dir(src, out)


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _compare_with_oracle(src: Path, oracle: Path) -> list[tuple[int, int]]:
    s_t, o_t = _read_all(src), _read_all(oracle)
    scales = sorted(n for n in s_t if n.endswith(".weight_scale_inv"))
    assert scales, "no fp8 weights in the source"
    assert not any(n.endswith("weight_scale_inv") for n in o_t)
    shapes = []
    for sn in scales:
        wn = sn.removesuffix("_scale_inv")
        w, s = s_t[wn], s_t[sn]
        assert w.dtype == FN
        got = block_dequant(w, s)
        assert got.dtype == torch.float32 and got.shape == w.shape
        want = o_t[wn]
        assert want.dtype == BF16 and want.shape == w.shape
        assert torch.equal(_bytes(got.to(BF16)), _bytes(want)), wn
        shapes.append(tuple(w.shape))
    return shapes


def test_block_dequant_matches_compressed_tensors_on_fixture(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    shapes = _compare_with_oracle(src, ct_dequantize_dir(src, tmp_path / "oracle"))
    assert len(shapes) > 50
    # partial edge blocks in rows and in columns were exercised
    assert any(r % 128 for r, _ in shapes) and any(c % 128 for _, c in shapes)


def test_block_dequant_matches_compressed_tensors_partial_blocks(tmp_path):
    gen = torch.Generator().manual_seed(11)
    shapes = {"model.layers.0.self_attn.kv_a_proj_with_mqa": (576, 320), "model.layers.0.self_attn.q_a_proj": (160, 256),
              "model.layers.0.mlp.down_proj": (100, 130), "model.layers.0.mlp.up_proj": (128, 128),
              "model.layers.0.mlp.gate_proj": (7, 300), "model.layers.0.self_attn.o_proj": (257, 129)}
    tensors = {}
    for m, (n, k) in shapes.items():
        b = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        b[(b & 0x7F) == 0x7F] = 0x00  # NaN codes are not valid weights
        tensors[f"{m}.weight"] = b.view(FN)
        g = (-(-n // 128), -(-k // 128))
        # wide range of exponents and full mantissas: fp32 products that need real bf16 rounding
        tensors[f"{m}.weight_scale_inv"] = (torch.rand(g, generator=gen) + 0.5) * torch.exp2(
            torch.randint(-24, 4, g, generator=gen).float())
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                                 "hidden_size": 320, "quantization_config": FP8_QCFG}))
    got_shapes = _compare_with_oracle(src, ct_dequantize_dir(src, tmp_path / "oracle"))
    assert sorted(got_shapes) == sorted(shapes.values())


def test_block_dequant_index_map():
    """Element (i, j) uses scale (i // 128, j // 128), partial edge blocks included."""
    gen = torch.Generator().manual_seed(12)
    n, k = 300, 200
    b = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 1
    w = b.view(FN)
    s = torch.rand(3, 2, generator=gen) + 0.25
    got = block_dequant(w, s)
    i = torch.arange(n)[:, None] // 128
    j = torch.arange(k)[None, :] // 128
    want = w.float() * s[i, j]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [FN, FNUZ, torch.float8_e5m2, torch.float8_e5m2fnuz])
def test_fp8_float_every_code_as_torch_converts_it(dtype):
    """The table lookup gives torch's own fp32 bits for each of the 256 codes (NaN codes and -0
    included), contiguous or strided, and a fresh tensor; other dtypes are copied, never aliased."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(16, 16)
    for w in (codes, codes.t(), codes[::3, 1::2]):
        got = fp8_float(w)
        assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == w.shape
        assert torch.equal(got.view(torch.int32), w.float().view(torch.int32))
    f = torch.randn(4, 4)
    got = fp8_float(f)
    assert torch.equal(got, f) and got.data_ptr() != f.data_ptr()
    got = fp8_float(torch.randn(6, 4, dtype=BF16).t())  # strided, another dtype: a contiguous fp32 copy
    assert got.dtype == torch.float32 and got.is_contiguous()


def test_block_dequant_of_a_strided_float_weight():
    """A weight that is not fp8 and not contiguous (a transposed bf16 view) dequantises as the plain formula."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(256, 384, generator=gen).to(BF16).t()  # [384, 256]: whole blocks, strided
    s = torch.rand(3, 2, generator=gen) + 0.5
    c = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(block_dequant(w, s), w.float() * c)


@pytest.mark.parametrize("n,k", [(256, 384), (4096, 512), (300, 200), (576, 320), (128, 130)])
@pytest.mark.parametrize("target", [FN, FNUZ])
def test_identity_readback_and_block_dequant_as_expanded_scales(n, k, target):
    """The blocked in-place arithmetic gives the bits of the plain formula with the scales expanded to
    the weight's shape (each element's product rounded once, -0 read back as +0), whole blocks and
    partial edge blocks alike, every byte value included."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8).view(FN)
    gn, gk = -(-n // 128), -(-k // 128)
    s = (torch.rand(gn, gk, generator=gen) + 0.5) * torch.exp2(torch.randint(-20, 4, (gn, gk), generator=gen).float())
    c = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(block_dequant(w, s).view(torch.int32), (w.float() * c).view(torch.int32))
    fmax = float(torch.finfo(target).max)
    a_scale = torch.tensor(1.0 / fmax, dtype=torch.float32)
    want = ((w.float() * fmax) * (a_scale * c) + 0.0).to(BF16)
    assert torch.equal(identity_readback(w, s, target).view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------------------------
# per_tensor_quant (spec §4.1 step 5, §10): ATOM's dynamic_per_batched_tensor_quant
# ------------------------------------------------------------------------------------------------


def _positive_table(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values in code order (codes 0x00..0x7E for fn, 0x00..0x7F for fnuz)."""
    val = VALUE[dtype]
    codes = [b for b in range(0x80) if val(b) is not None]
    vals = torch.tensor([val(b) for b in codes], dtype=torch.float64)
    assert torch.all(vals[1:] > vals[:-1])
    return torch.tensor(codes, dtype=torch.int64), vals


def encode_rne(y: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """fp8 bytes of in-range values y, round to nearest, ties to the even code (from the tables).
    Negative values keep the sign bit (e4m3fn -0 = 0x80); e4m3fnuz has no -0.
    Returns (uint8 bytes, number of exact ties met)."""
    codes, vals = _positive_table(dtype)
    a = y.double().abs().reshape(-1)
    assert float(a.max()) <= float(vals[-1])
    lo = torch.searchsorted(vals, a, right=True) - 1
    hi = (lo + 1).clamp(max=len(vals) - 1)
    dlo, dhi = a - vals[lo], vals[hi] - a
    tie = (dlo == dhi) & (hi != lo)
    pick_hi = (dhi < dlo) | (tie & (codes[hi] % 2 == 0))
    mag = torch.where(pick_hi, codes[hi], codes[lo])
    neg = torch.signbit(y.double().reshape(-1))
    if dtype == FNUZ:
        out = torch.where(neg & (mag != 0), mag | 0x80, mag)
    else:
        out = torch.where(neg, mag | 0x80, mag)
    return out.to(torch.uint8).reshape(y.shape), int(tie.sum())


def runtime_per_tensor_quant(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Re-statement of ATOM attention_mla.py dynamic_per_batched_tensor_quant:
    amax (bf16) = max|x| clamped to 1e-10;
    s = DTYPE_MAX / amax, a Python float divided by a 0-dim bf16 tensor, which PyTorch evaluates as
      `amax.reciprocal() * DTYPE_MAX` (Tensor.__rtruediv__): two bf16 roundings, r = bf16(1/amax)
      then s = bf16(r * DTYPE_MAX) (each op computed in fp32, as bf16 kernels do);
    y = bf16(x * s) clamped to +-DTYPE_MAX; fp8 = RNE(y) from the value tables; scale = fp32(1 / s).
    Python double arithmetic rounded to fp32 equals correctly rounded fp32 division (53 >= 2*24+2)."""
    fmax = 448.0 if dtype == FN else 240.0
    amax = x.abs().max().float().clamp(min=float(torch.tensor(1e-10, dtype=BF16)))
    r = torch.tensor(1.0 / float(amax), dtype=torch.float32).to(BF16)
    s = torch.tensor(float(r) * fmax, dtype=torch.float32).to(BF16)  # exact product, then bf16
    y = (x.float() * s.float()).to(BF16).float().clamp(-fmax, fmax)
    q, ties = encode_rne(y, dtype)
    scale = torch.tensor(1.0 / float(s), dtype=torch.float32)  # double then fp32: correctly rounded
    return q, scale, ties


PT_CASES = [((2, 128, 64), 0.05), ((4, 64, 128), 1.0), ((3, 5, 7), 300.0), ((8, 128, 64), 1e-3),
            ((1, 512, 128), 0.02), ((40000,), 7.0)]


@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("shape,mag", PT_CASES, ids=[str(c[0]) for c in PT_CASES])
def test_per_tensor_quant_matches_runtime_formula(shape, mag, dtype):
    gen = torch.Generator().manual_seed(_seed(shape, mag, str(dtype)))
    x = (torch.randn(shape, generator=gen) * mag).to(BF16)
    if x.numel() > 100:  # a few tiny values exercise the subnormal codes
        x.view(-1)[:50] = (torch.randn(50, generator=gen) * mag * 1e-3).to(BF16)
    q, sc = per_tensor_quant(x, dtype)
    want_q, want_s, ties = runtime_per_tensor_quant(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape and q.is_contiguous()
    assert sc.dtype == torch.float32 and sc.dim() == 0
    assert torch.equal(q.view(torch.uint8), want_q), f"{int((q.view(torch.uint8) != want_q).sum())} bytes differ"
    assert sc.view(torch.int32).item() == want_s.view(torch.int32).item()
    if x.numel() >= 4096:
        assert ties > 0, "no exact ties met: the rounding rule was not exercised"
    # the largest magnitude lands on (or next to) DTYPE_MAX: the scale is the tensor's own
    assert q.float().abs().max().item() >= torch.finfo(dtype).max * 0.9


@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_per_tensor_quant_needs_bf16_arithmetic(dtype):
    """The bf16 rounding of x*s matters: an fp32 pipeline gives other bytes on large tensors,
    so the bit-exact test above really pins down the runtime's bf16 arithmetic."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(4, 128, 128, generator=gen).to(BF16)
    q, _ = per_tensor_quant(x, dtype)
    fmax = torch.finfo(dtype).max
    amax = x.float().abs().max()
    naive = (x.float() * (fmax / amax)).clamp(-fmax, fmax).to(dtype)
    assert not torch.equal(q.view(torch.uint8), naive.view(torch.uint8))


def test_per_tensor_quant_zero_and_dtype_guard():
    for dtype in (FN, FNUZ):
        q, sc = per_tensor_quant(torch.zeros(2, 16, 8, dtype=BF16), dtype)
        want_q, want_s, _ = runtime_per_tensor_quant(torch.zeros(2, 16, 8, dtype=BF16), dtype)
        assert torch.equal(q.view(torch.uint8), want_q) and not q.view(torch.uint8).any()
        assert math.isfinite(sc.item()) and sc.item() > 0 and sc.item() == want_s.item()
    with pytest.raises(TypeError):
        per_tensor_quant(torch.ones(4, dtype=torch.float32), FN)


def test_shuffle16_stays_on_the_input_device():
    """The reference forward unshuffles on the GPU (verify --device cuda): the result must stay on
    the input's device (checked here with the meta device, which every torch build has)."""
    from atom_convert.layout.codecs.shuffle import shuffle16, unshuffle16

    x = torch.empty(2, 32, 64, dtype=torch.float8_e4m3fn, device="meta")
    assert shuffle16(x).device.type == "meta" and unshuffle16(x).device.type == "meta"
