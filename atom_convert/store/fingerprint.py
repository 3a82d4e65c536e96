"""Fingerprints of what a conversion's output bytes depend on, cheap enough to take on every run.

Reused by the resume logic (convert.py: is a staged partial conversion still the same
conversion?), by staleness checks of an existing DST, and as a content key for published
conversions. Two fingerprints, kept apart so that a mismatch can say which side changed:

How it works:
1. `source_fingerprint(SRC)`: one part per file that shapes the output: config.json and the
   index (their bytes), every safetensors file the checkpoint uses (its size and its header:
   the 8-byte length plus the JSON, so every tensor's name, dtype, shape and offsets), and
   the side files copied into DST (tokenizer, generation config, the Python files that
   `auto_map` loads with trust_remote_code: their bytes). Tensor data
   is NOT read: hashing a 1 TB checkpoint would take longer than many conversions. So an
   edit that rewrites tensor bytes in place, keeping every header and size, is not seen by
   the fingerprint; re-downloads and re-exports change sizes or headers and are seen. Where a
   stale output would be served or resumed (ensure_converted's cache, a resume), the files'
   sizes and modification times (`source_stamps`) are compared as well.
2. `options_fingerprint(...)`: every option that changes output bytes (target, tp, shard
   size, MTP, the MLA operand format, the naming profile, the parallel mode: ep,
   dp_attention, shared_experts, mori) plus the tool version and the
   layout revision (manifest.LAYOUT_REVISION, bumped whenever a change alters the bytes
   written for the same inputs and options).
Each returns a `Fingerprint`: a sha256 `digest` over its `parts` (name -> value), and
`changed(other)` lists the parts that differ, for messages like "config.json changed".
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BadInputError
from ..files.safetensors import (INDEX_NAME, SIDE_FILES, SIDE_SUFFIXES, SINGLE_NAME, header_bytes, member_problem,
                                 select_side_files, weight_files)


if TYPE_CHECKING:
    from ..layout.options import ConversionOptions

# Re-exported: the files copied from SRC beside the shards are part of DST, so they are part of
# the source fingerprint (safetensors_file.select_side_files names them).
__all__ = ["INDEX_NAME", "SIDE_FILES", "SIDE_SUFFIXES", "SINGLE_NAME", "Fingerprint", "options_fingerprint",
           "source_fingerprint"]


@dataclass(frozen=True)
class Fingerprint:
    """A digest and the named parts it was computed from (all JSON-serialisable strings)."""

    kind: str  # "source" or "options"
    parts: dict[str, str]

    @property
    def digest(self) -> str:
        raw = json.dumps({"kind": self.kind, "parts": self.parts}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(raw.encode()).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "parts": dict(self.parts)}

    @classmethod
    def from_dict(cls, d: Any) -> "Fingerprint":
        """Inverse of `as_dict`; raises ValueError for anything else (a corrupt journal)."""
        if not (isinstance(d, dict) and isinstance(d.get("kind"), str) and isinstance(d.get("parts"), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in d["parts"].items())):
            raise ValueError(f"not a fingerprint: {str(d)[:200]}")
        return cls(d["kind"], dict(d["parts"]))

    def changed(self, other: "Fingerprint") -> list[str]:
        """Names of the parts that differ (present on one side only, or with different values)."""
        keys = sorted(set(self.parts) | set(other.parts))
        return [k for k in keys if self.parts.get(k) != other.parts.get(k)]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _weight_files(src: Path) -> list[str]:
    """The safetensors files the checkpoint uses (safetensors_file.weight_files: the index's, else
    the single file), each checked later on its own (`_part`); [] when the index is unreadable or
    refused (its bytes, or its refusal, are still a part)."""

    def index_only(rel: str, what: str) -> str | None:
        if rel != INDEX_NAME:
            return None
        problem = member_problem(src, rel, what)
        return None if problem is None else problem[1]

    try:
        return weight_files(src, index_only)[1]
    except BadInputError:
        return []


def _header_part(path: Path) -> str:
    """'size:sha256(8-byte length + JSON header)' (safetensors_file.header_bytes: the JSON only when
    its length is within safetensors' limit and the file)."""
    size, head = header_bytes(path)
    return f"{size}:{_sha(head)}"


def _part(root: Path, rel: str, read: Any) -> str:
    """`read(path)` of the file `rel` of SRC, or a marker when it is absent, a directory, or refused
    by the one symlink policy (safetensors_file.member_problem: then it is never opened)."""
    problem = member_problem(root, rel, rel)
    if problem is not None:
        return {"missing": "missing", "dangling": "missing", "directory": "directory"}.get(problem[0],
                                                                                           f"refused:{problem[0]}")
    try:
        return read(root / rel)
    except FileNotFoundError:
        return "missing"
    except IsADirectoryError:
        return "directory"


def source_fingerprint(src: str | os.PathLike[str]) -> Fingerprint:
    """Fingerprint of a Hugging Face checkpoint folder from its metadata (see the module docstring).

    Reads config.json, the index, each safetensors header and the side files; never tensor data,
    nor a file that resolves outside SRC (its part says it was refused). Never raises for a
    malformed checkpoint (absent or malformed files are parts of their own); OSError for an
    unreadable one.

    Example:
        >>> fp = source_fingerprint("DeepSeek-V3")
        >>> fp.digest, fp.changed(source_fingerprint("DeepSeek-V3-redownloaded"))
    """
    root = Path(src)
    parts: dict[str, str] = {}
    if (root / INDEX_NAME).is_file():
        parts[INDEX_NAME] = _part(root, INDEX_NAME, lambda p: _sha(p.read_bytes()))
    for name in _weight_files(root):
        parts[name] = _part(root, name, _header_part)
    if root.is_dir():
        side = select_side_files(root)  # configs, tokenizer, the *.py files a trust_remote_code config loads
        for name in sorted([*side.names, *side.refused]):
            parts[name] = "refused" if name in side.refused else _sha((root / name).read_bytes())
    return Fingerprint("source", parts)


def source_stamps(src: str | os.PathLike[str], fp: Fingerprint) -> dict[str, str]:
    """'size:mtime_ns' of every safetensors file of `fp` (a `source_fingerprint` of `src`; the other
    files are hashed whole there): what a cache and a resume compare to tell a file rewritten in
    place, whose tensor bytes the fingerprint does not cover (a copy that does not keep modification
    times makes them differ too: the cost is a conversion more, never a stale one). Not part of the
    fingerprint, which stays a content key."""
    out = {}
    for name, part in fp.parts.items():
        if not name.endswith(".safetensors") or part in ("missing", "directory") or part.startswith("refused"):
            continue
        try:
            st = (Path(src) / name).stat()
        except OSError:
            continue
        out[name] = f"{st.st_size}:{st.st_mtime_ns}"
    return out


def options_fingerprint(options: "ConversionOptions") -> Fingerprint:
    """Fingerprint of everything besides the source that changes the output bytes: the options
    value's fields (`ConversionOptions.fingerprint_parts`, the shard size in bytes), the tool
    version and the layout revision."""
    from .._version import __version__
    from .manifest import AITER_REVISION, ATOM_REVISION, FORMAT_VERSION, LAYOUT_REVISION

    parts = {**options.fingerprint_parts(), "tool_version": __version__,
             "layout_revision": f"{LAYOUT_REVISION}/atom-{ATOM_REVISION}/aiter-{AITER_REVISION}/manifest-v{FORMAT_VERSION}"}
    return Fingerprint("options", parts)
