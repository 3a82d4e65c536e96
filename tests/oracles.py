"""Independent oracles, loaded from the real packages.

aiter does not import without ROCm, so its pure-torch files (shuffle.py,
fp4_utils.py, dtypes.py) are loaded by path out of the amd-aiter wheel, with
stubs for the few GPU-only imports (docs/test-fixtures.md §5). The wheel is
read from a cache folder (`CACHE`/wheels, or the file $ATOM_CONVERT_AITER_WHEEL names), which
`bash scripts/setup.sh --test` fills once from the package registry. Nothing here touches the
network: without the wheel, the tests that need it fail with `OracleMissing`, saying to run that.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import zipfile
from pathlib import Path

AITER_VERSION = "0.1.7.post2.dev18"
AITER_SPEC = f"amd-aiter=={AITER_VERSION}"  # what scripts/setup.sh --test downloads into wheel_dir()
CACHE = Path(os.environ.get("ATOM_CONVERT_TEST_CACHE", Path.home() / ".cache" / "atom-convert-tests"))
_FILES = ("aiter/ops/shuffle.py", "aiter/utility/fp4_utils.py", "aiter/utility/dtypes.py")
SETUP = "bash scripts/setup.sh --test"


class OracleMissing(RuntimeError):
    """An oracle's package is not on this machine (raised, never skipped: the tests need it)."""


def wheel_dir() -> Path:
    return CACHE / "wheels"


def cached_aiter_wheel() -> Path | None:
    """The cached wheel of AITER_SPEC, or None; only looks at the cache folder."""
    d = wheel_dir()
    found = sorted(d.glob(f"amd_aiter-{AITER_VERSION}-*.whl")) if d.is_dir() else []
    return found[-1] if found else None


def aiter_wheel() -> Path:
    """The amd-aiter wheel: $ATOM_CONVERT_AITER_WHEEL, else the one in wheel_dir(). Never downloads."""
    env = os.environ.get("ATOM_CONVERT_AITER_WHEEL")
    if env:
        if not Path(env).is_file():
            raise OracleMissing(f"ATOM_CONVERT_AITER_WHEEL={env} is not a file; point it at the {AITER_SPEC} "
                                f"wheel, or unset it and run `{SETUP}` (downloads it into {wheel_dir()})")
        return Path(env)
    found = cached_aiter_wheel()
    if found is None:
        raise OracleMissing(f"the {AITER_SPEC} wheel (the tests' aiter oracle) is not in {wheel_dir()}: run "
                            f"`{SETUP}` once (it downloads the wheel there), or set ATOM_CONVERT_AITER_WHEEL "
                            f"to the wheel's path")
    return found


class _Anything(types.ModuleType):
    def __getattr__(self, n: str):
        if n.startswith("__"):
            raise AttributeError(n)
        return _anything


def _anything(*a, **k):
    # decorators (triton.jit, triton.heuristics(...)) return the function unchanged
    return a[0] if len(a) == 1 and callable(a[0]) and not k else _anything


def load_aiter(pkg: str = "_aiter_oracle") -> tuple[types.ModuleType, types.ModuleType]:
    """(fp4_utils, shuffle) modules of the wheel, importable without ROCm."""
    if f"{pkg}.ops.shuffle" in sys.modules:
        return sys.modules[f"{pkg}.utility.fp4_utils"], sys.modules[f"{pkg}.ops.shuffle"]
    src = CACHE / "aiter-src"
    with zipfile.ZipFile(aiter_wheel()) as z:
        for f in _FILES:
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes(z.read(f))
    stubbed = []
    if importlib.util.find_spec("triton") is None:
        tr, tl = _Anything("triton"), _Anything("triton.language")
        tr.language = tl
        tr.cdiv = lambda a, b: (a + b - 1) // b
        for name, mod in (("triton", tr), ("triton.language", tl)):
            sys.modules[name] = mod
            stubbed.append(name)
    for n in (pkg, f"{pkg}.utility", f"{pkg}.ops", f"{pkg}.jit", f"{pkg}.jit.utils"):
        m = types.ModuleType(n)
        m.__path__ = []
        sys.modules[n] = m
    chip = types.ModuleType(f"{pkg}.jit.utils.chip_info")
    chip.get_gfx = lambda: "gfx950"
    sys.modules[chip.__name__] = chip

    def load(name: str, rel: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, src / rel)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    try:
        load(f"{pkg}.utility.dtypes", "aiter/utility/dtypes.py")
        fp4 = load(f"{pkg}.utility.fp4_utils", "aiter/utility/fp4_utils.py")
        shf = load(f"{pkg}.ops.shuffle", "aiter/ops/shuffle.py")
    finally:
        for n in stubbed:  # a stub left behind breaks importlib.util.find_spec("triton") for other packages
            sys.modules.pop(n, None)
    return fp4, shf


def fp8_block_dequantize_dir(src: Path, out: Path) -> Path:
    """compressed-tensors' FP8BlockDequantizer, file to file: bf16 weights, scales dropped.
    Correct for partial blocks, unlike transformers' CPU fallback (docs/test-fixtures.md §2).

    With partial *column* blocks compressed-tensors 0.20.1 returns a non-contiguous crop that
    safetensors refuses to save; the only change here is `.contiguous()` on its result, the
    arithmetic is compressed-tensors' own.
    """
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    class Contiguous(FP8BlockDequantizer):
        def _create_dequantized_weight(self, weight, weight_scale_inv):  # type: ignore[no-untyped-def]
            return super()._create_dequantized_weight(weight, weight_scale_inv).contiguous()

    convert_checkpoint(str(src), str(out), Contiguous.from_pretrained(str(src)), max_workers=1, device="cpu")
    return out


def b3_blocks(data: bytes) -> str:
    """The `blake3_blocks` digest of a file's bytes, from its definition (docs/layout.md) and the
    blake3 package's one-shot calls alone: the BLAKE3 hash of each 64 KiB block (the last one
    shorter, none for no bytes), laid end to end, hashed in key-derivation mode with the context
    string the format names."""
    import blake3

    leaves = b"".join(blake3.blake3(data[i:i + 65536]).digest() for i in range(0, len(data), 65536))
    context = "atom-convert 2026-12-04 file digest: the BLAKE3 of each 64 KiB block, in order"
    return blake3.blake3(leaves, derive_key_context=context).hexdigest()


def xx_blocks(data: bytes) -> str:
    """The `xxh3_blocks` digest of a file's bytes, from its definition (docs/layout.md) and the
    xxhash package's one-shot calls alone: the XXH3-128 of each 64 KiB block (the last one shorter,
    none for no bytes) in its canonical 16 bytes, laid end to end, then the XXH3-128 of those, in hex."""
    import xxhash

    leaves = b"".join(xxhash.xxh3_128(data[i:i + 65536]).digest() for i in range(0, len(data), 65536))
    return xxhash.xxh3_128(leaves).hexdigest()
