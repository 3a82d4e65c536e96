"""Digests of converted bytes and manifests, to hold a refactoring against the code before it.

`python tests/layout_digests.py record tests/layout_digests.json` converts every case below with the code
checked out and writes, per case, the sha256 of every file the conversion wrote (shards, copied side files,
the MTP set) and of its manifest with what legitimately varies between runs taken out (the conversion's
seconds and the source's absolute path); a case the converter refuses records the refusal's type.
`tests/test_layout_digests.py` converts the same cases with the code as it is and compares.

The fixtures are the suite's own (`atom_convert.synth.build_tiny`, `tests/quark_fixtures.py`) with fixed
seeds; their bytes depend on torch's CPU random generator and on Quark's quantiser, so the digests hold for
the torch, transformers and amd-quark versions recorded in the file (the ones `scripts/setup.sh --test`
installs).

Re-recorded once on purpose: when converted shards became 64-byte aligned (engine/shard_header.py
`data_order`: the header JSON padded with spaces so the data starts at a multiple of 64, tensors whose size
is a multiple of 64 first, the odd-sized ones after), so that a CPU load maps them instead of copying. The
tensor bytes are unchanged, only where they lie: before re-recording, every shard of all 88 cases, re-packed
back to back in its header's order with the old 8-byte header padding (tests/test_alignment.py
`repacked_before`), had the sha256 recorded here before; the same tree with the old shard_header.py
reproduced every recorded digest; the only other files that changed are the manifests (they hold the shards'
sha256 and sizes). tests/test_alignment.py keeps three cases' pre-change shard digests (`BEFORE`).

Re-recorded a second time, manifests only: when a converted set's files became digested with BLAKE3
(format_version 3, atom_convert/store/digest.py). Before re-recording, every one of the 582 other files of
the 88 cases (shards, copied side files) had the digest recorded here; only the 113 manifests differed.

Re-recorded a third time, manifests only: when the files' digest became `blake3_blocks` (format_version 4,
the BLAKE3 of each 64 KiB block, then of those leaves: atom_convert/store/digest.py). Before re-recording,
every shard and copied side file of every case had the digest recorded here; only the manifests differed.

Re-recorded a fourth time, manifests only: when the files' digest became `xxh3_blocks` (format_version 5, the
XXH3-128 of each 64 KiB block, then of those leaves). Before re-recording, all 582 shards and copied side
files of the 88 cases had the digest recorded here; only the 113 manifests differed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

SOURCES: dict[str, tuple[str, str]] = {  # name -> (preset, fmt); quark-* is a Quark MXFP4 export
    "v2-lite-bf16": ("tiny-deepseek-v2-lite", "bf16"),
    "v2-fp8": ("tiny-deepseek-v2", "fp8"),
    "v3-bf16": ("tiny-deepseek-v3", "bf16"),
    "v3-fp8": ("tiny-deepseek-v3", "fp8"),
    "kimi-bf16": ("tiny-kimi-k2", "bf16"),
    "kimi-fp8": ("tiny-kimi-k2", "fp8"),
    "v3-mxfp4": ("tiny-deepseek-v3", "quark-template"),
    "kimi-mxfp4-all": ("tiny-kimi-k2", "quark-all"),
    "v3-fp8-h8": ("tiny-deepseek-v3", "fp8"),  # 8 heads, wide experts: divisible by tp 8 (OVERRIDES)
    "v3-bf16-h8": ("tiny-deepseek-v3", "bf16"),
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "v3-fp8-h8": {"num_attention_heads": 8, "moe_intermediate_size": 1024, "intermediate_size": 1024},
    "v3-bf16-h8": {"num_attention_heads": 8, "moe_intermediate_size": 1024, "intermediate_size": 1024},
}
# mode -> convert() keyword arguments
MODES: dict[str, dict[str, Any]] = {
    "tp1": {"tp": 1},
    "tp2": {"tp": 2},
    "tp8": {"tp": 8},
    "tp8-ep": {"tp": 8, "ep": True},
    "tp8-dpa": {"tp": 8, "dp_attention": True},
    "tp2-ep": {"tp": 2, "ep": True},
    "tp2-dpa": {"tp": 2, "dp_attention": True},
    "tp2-dpa-ep": {"tp": 2, "dp_attention": True, "ep": True},
    "tp2-ep-plugin": {"tp": 2, "ep": True, "profile": "vllm-plugin"},
    "tp1-plugin": {"tp": 1, "profile": "vllm-plugin"},
    "tp1-mla-mxfp4": {"tp": 1, "mla_bmm": "mxfp4"},
}
FULL = ("v3-fp8", "kimi-fp8", "v3-mxfp4", "v3-bf16")


def cases() -> list[tuple[str, str, str]]:
    out = []
    for src in SOURCES:
        for target in ("gfx950", "gfx942"):
            modes = ("tp8", "tp8-ep", "tp8-dpa") if src in OVERRIDES else MODES if src in FULL else ("tp1", "tp2")
            for mode in modes:
                if mode.startswith("tp8") and src not in OVERRIDES:
                    continue
                if mode == "tp1-mla-mxfp4" and target != "gfx950":
                    continue
                out.append((src, target, mode))
    return out


def build_source(name: str, out: Path) -> Path:
    preset, fmt = SOURCES[name]
    seed = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000
    if fmt.startswith("quark-"):
        from quark_fixtures import build_quark_export

        return build_quark_export(out, preset, fmt.removeprefix("quark-"), seed=seed)
    from atom_convert.synth import build_tiny, load_preset

    cfg = dict(load_preset(preset), **OVERRIDES.get(name, {}))
    return build_tiny(cfg, out, fmt=fmt, seed=seed, shards=2 if fmt == "fp8" else 1)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def normalized_manifest(path: Path, src: Path) -> str:
    m = json.loads(path.read_text())
    m.pop("conversion_seconds", None)
    for name, f in (m.get("files") or {}).items():  # a nested manifest (mtp/) is digested on its own, normalized
        if name.endswith("atom_manifest.json"):
            f.pop("sha256", None)
            f.pop("blake3", None)
            f.pop("blake3_blocks", None)
            f.pop("xxh3_blocks", None)
            f.pop("bytes", None)
    text = json.dumps(m, sort_keys=True)
    return text.replace(str(src), "SRC")


def digest(dst: Path, src: Path) -> dict[str, str]:
    out = {}
    for p in sorted(dst.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(dst))
            out[rel] = _sha(normalized_manifest(p, src).encode()) if p.name == "atom_manifest.json" else _sha(p.read_bytes())
    return out


def run_case(src: Path, dst: Path, target: str, mode: str) -> dict[str, str]:
    import atom_convert
    from atom_convert.errors import BadInputError

    try:
        atom_convert.convert(src, dst, target=target, **MODES[mode])
    except BadInputError as e:
        return {"refused": type(e).__name__}
    return digest(dst, src)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {k: version(k) for k in ("torch", "transformers", "amd-quark", "safetensors")}


def compute(work: Path, progress: Callable[[str], None] = lambda s: None) -> dict[str, dict[str, str]]:
    srcs: dict[str, Path] = {}
    res = {}
    for src, target, mode in cases():
        if src not in srcs:
            srcs[src] = build_source(src, work / "src" / src)
        key = f"{src}/{target}/{mode}"
        res[key] = run_case(srcs[src], work / "out" / key.replace("/", "-"), target, mode)
        progress(key)
    return res


def main(argv: list[str]) -> int:
    import tempfile

    if len(argv) != 3 or argv[1] != "record":
        print(__doc__)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with tempfile.TemporaryDirectory() as tmp:
        res = compute(Path(tmp), progress=lambda k: print(k, flush=True))
    Path(argv[2]).write_text(json.dumps({"how": "python tests/layout_digests.py record tests/layout_digests.json",
                                         "versions": versions(), "cases": res}, indent=1, sort_keys=True) + "\n")
    print(f"{len(res)} cases -> {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
