"""Tiny Kimi-K2-Thinking-like int4 checkpoints made with compressed-tensors' own compressor, and the
reference ("served") checkpoints a --quantize conversion must equal (docs/test-fixtures.md §4).

- `build_int4(out, hidden)`: a bf16 tiny-kimi-k2 (transformers, atom_convert.synth.build_tiny: fresh
  random data) whose routed experts are then int4-compressed one linear at a time by compressed-tensors:
  scales by its `calculate_qparams` (minmax, symmetric: amax / 7.5 per group of 32, codes in [-8, 7]),
  `PackedQuantizationCompressor.compress` for weight_packed / weight_scale / weight_shape, and the
  quantization_config of Kimi-K2-Thinking (atom-layout-next.md §4.1) dumped from its QuantizationConfig.
  The bf16 source is kept beside it (`<out>-bf16`).
- `ct_decompress(packed, scale, shape)`: compressed-tensors' own decompression (the source oracle).
- `served_mxfp4(src, out)` / `served_fp8(src, out)`: the same model as an ordinary Quark-MXFP4 / DeepSeek
  fp8 checkpoint, quantised by amd-quark's own MXFP4 quantiser / by `fp8_block_reference` (written here
  from DeepSeek's rule, block by block), from the exact source values, with the served
  quantization_config. ATOM's oracle loads these (it cannot load int4), and a --quantize conversion of
  the int4 / bf16 source must be byte-identical to the plain conversion of these.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# What DeepSeek's fp8 release keeps bf16 (the same list as atom_convert.synth._NOT_QUANTIZED).
NOT_FP8 = re.compile(r".*(mlp\.gate\.weight|embed_tokens\.weight|lm_head\.weight|shared_head\.head\.weight|norm\.weight|"
                     r"layernorm\.weight|enorm\.weight|hnorm\.weight|eh_proj\.weight)$")


def _scheme() -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False, observer="minmax"))


def kimi_quantization_config() -> dict[str, Any]:
    """Kimi-K2-Thinking's quantization_config as compressed-tensors 0.20 dumps it."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    q = QuantizationConfig(config_groups={"group_0": _scheme()}, ignore=list(KIMI_IGNORE), format="pack-quantized",
                           quantization_status=QuantizationStatus.COMPRESSED)
    d = json.loads(q.model_dump_json())
    d["quant_method"] = "compressed-tensors"
    d["kv_cache_scheme"] = None
    return d


def ct_compress(w: torch.Tensor, shape_dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    """One linear's weight -> weight_packed / weight_scale / weight_shape by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme()
    g = w.float().reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
    out["weight_shape"] = out["weight_shape"].to(shape_dtype)
    return {k: v.contiguous() for k, v in out.items()}


def ct_decompress(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own decompression (in the scale's dtype, as it runs at load)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    sd = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    return PackedQuantizationCompressor.decompress(sd, _scheme())["weight"]


def build_int4(out: str | Path, hidden: int = 256, seed: int = 0, shape_dtype: torch.dtype = torch.int64,
               preset: str = "tiny-kimi-k2") -> Path:
    """The int4 checkpoint in `out`, its bf16 original in `<out>-bf16` (see the module docstring)."""
    from atom_convert.synth import build_tiny, load_preset

    out = Path(out)
    bf16 = out.parent / f"{out.name}-bf16"
    for d in (out, bf16):
        if d.exists():
            shutil.rmtree(d)
    cfg = load_preset(preset)
    cfg["hidden_size"] = hidden
    build_tiny(cfg, bf16, seed=seed)
    tensors = load_file(str(bf16 / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if EXPERT.match(name):
            for k, v in ct_compress(t, shape_dtype).items():
                packed[name.removesuffix(".weight") + "." + k] = v
        else:
            packed[name] = t
    out.mkdir(parents=True)
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((bf16 / "config.json").read_text())
    c["quantization_config"] = kimi_quantization_config()
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for f in bf16.iterdir():
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def exact_values(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `src` with int4 linears as `X.weight` = exact fp32 q * fp32(scale) (by the
    nibble rule of §4.1, checked against compressed-tensors in the tests)."""
    t = load_file(str(Path(src) / "model.safetensors"))
    out = {}
    for name, v in t.items():
        if name.endswith(".weight_packed"):
            base = name.removesuffix(".weight_packed")
            b = v.contiguous().view(torch.uint8)
            q = torch.stack([b & 0xF, b >> 4], -1).flatten(-2).to(torch.int16) - 8
            out[base + ".weight"] = q.float() * t[base + ".weight_scale"].float().repeat_interleave(32, -1)
        elif name.endswith((".weight_scale", ".weight_shape")) and name.removesuffix("_scale").removesuffix("_shape") \
                + "_packed" in t:
            continue
        else:
            out[name] = v
    return out


def fp8_block_reference(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's fp8 weight rule, block by block: S = amax(block) / 448 in fp32, q = e4m3fn(w / S);
    the last row/column blocks are partial (their own amax)."""
    n, k = w.shape
    w = w.float()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-n // block), -(-k // block), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            sc = blk.abs().max() / 448.0
            s[i, j] = sc
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / sc).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((Path(src) / "config.json").read_text())
    c["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for f in Path(src).iterdir():
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def served_mxfp4(src: str | Path, out: str | Path, qcfg: dict[str, Any]) -> Path:
    """`src` (int4 or bf16) with its routed experts quantised by amd-quark's own MXFP4 quantiser from
    the exact values (`X.weight` uint8 packed + `X.weight_scale` e8m0 uint8), everything else as is."""
    from quark_fixtures import quark_mxfp4_quantize

    vals = exact_values(Path(src))
    out_t: dict[str, torch.Tensor] = {}
    for name, v in vals.items():
        if EXPERT.match(name):
            packed, scale, _ = quark_mxfp4_quantize(v.float())
            out_t[name] = packed
            out_t[name.removesuffix(".weight") + ".weight_scale"] = scale
        else:
            out_t[name] = v
    return _write(Path(src), Path(out), out_t, qcfg)


def served_fp8(src: str | Path, out: str | Path, qcfg: dict[str, Any], experts_only: bool) -> Path:
    """`src` with its routed experts (experts_only) or every linear DeepSeek's fp8 release quantises
    in fp8 block-128 by `fp8_block_reference` (`X.weight` e4m3fn + `X.weight_scale_inv` fp32)."""
    vals = exact_values(Path(src))
    out_t: dict[str, torch.Tensor] = {}
    for name, v in vals.items():
        quant = EXPERT.match(name) if experts_only else (v.dim() == 2 and name.endswith(".weight")
                                                          and not NOT_FP8.match(name))
        if quant:
            q, s = fp8_block_reference(v)
            out_t[name], out_t[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
        else:
            out_t[name] = v
    return _write(Path(src), Path(out), out_t, qcfg)


def header_only_int4(out: str | Path, layers: int | None = None, config: str = "kimi-k2") -> Path:
    """A Kimi-K2-Thinking-shaped int4 checkpoint at full width that declares every tensor in one
    safetensors header and holds no data (a sparse hole: --dry-run reads headers only), with
    Kimi-K2-Thinking's quantization_config. `layers`: fewer decoder layers (None: all 61)."""
    import struct

    from atom_convert.synth import load_preset, source_inventory

    cfg = load_preset(config)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    st = {torch.int32: ("I32", 4), torch.bfloat16: ("BF16", 2), torch.float32: ("F32", 4)}
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, shape, kind in source_inventory(cfg):
        if kind == "linear" and EXPERT.match(name):
            base = name.removesuffix(".weight")
            entries += [(base + ".weight_packed", torch.int32, (shape[0], shape[1] // 8)),
                        (base + ".weight_scale", torch.bfloat16, (shape[0], shape[1] // 32)),
                        (base + ".weight_shape", torch.int32, (2,))]
        else:
            entries.append((name, torch.float32 if kind in ("router", "bias") else torch.bfloat16, shape))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, shape in entries:
        n = st[dt][1]
        for d in shape:
            n *= d
        header[name] = {"dtype": st[dt][0], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out = Path(out)
    out.mkdir(parents=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=kimi_quantization_config())))
    return out


def build_random_int4(out: str | Path, layers: int = 2, config: str = "kimi-k2", shard_bytes: float = 4e9) -> Path:
    """A Kimi-K2-Thinking-width int4 checkpoint with random data (benches: random int4 words, bf16
    scales in [1e-4, 2.1e-3], everything else N(0, 0.02) bf16, the router fp32), written shard by
    shard; `layers` decoder layers (the first dense). No compressed-tensors needed."""
    from atom_convert.synth import load_preset, source_inventory

    out = Path(out)
    out.mkdir(parents=True)
    cfg = load_preset(config)
    cfg["num_hidden_layers"] = layers
    g = torch.Generator().manual_seed(0)
    buf: dict[str, torch.Tensor] = {}
    wm: dict[str, str] = {}
    size = 0
    k = 0

    def flush() -> None:
        nonlocal buf, size, k
        if buf:
            k += 1
            f = f"model-{k:05d}.safetensors"
            save_file(buf, str(out / f), metadata={"format": "pt"})
            wm.update({n: f for n in buf})
            buf, size = {}, 0

    for name, shape, kind in source_inventory(cfg):
        if kind == "linear" and EXPERT.match(name):
            b = name.removesuffix(".weight")
            t = {b + ".weight_packed": torch.randint(-2**31, 2**31 - 1, (shape[0], shape[1] // 8), generator=g,
                                                     dtype=torch.int32),
                 b + ".weight_scale": (torch.rand(shape[0], shape[1] // 32, generator=g) * 2e-3 + 1e-4).to(torch.bfloat16),
                 b + ".weight_shape": torch.tensor(list(shape), dtype=torch.int32)}
        elif kind in ("router", "bias"):
            t = {name: torch.randn(shape, generator=g) * 0.02}
        else:
            t = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)}
        for n, v in t.items():
            buf[n] = v
            size += v.numel() * v.element_size()
        if size > shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=kimi_quantization_config_plain())))
    return out


def kimi_quantization_config_plain() -> dict[str, Any]:
    """Kimi-K2-Thinking's quantization_config written by hand (as `kimi_quantization_config`, without
    importing compressed-tensors: for machines that lack it)."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None,
                "observer_kwargs": {}}, "input_activations": None, "output_activations": None}},
            "ignore": list(KIMI_IGNORE), "kv_cache_scheme": None}
