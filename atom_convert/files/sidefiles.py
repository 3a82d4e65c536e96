"""The Python files a checkpoint's configs load with `trust_remote_code`, so that a converted
directory is a complete model path for a server (AutoConfig, AutoTokenizer, AutoModel from DST).

The selection lives in safetensors_file.py (`auto_map_modules`, `select_side_files`: how auto_map
names code, and why every top-level `*.py` file is carried); this module keeps its two names.
"""

from __future__ import annotations

from pathlib import Path

from .safetensors import CODE_SUFFIX, CONFIG_FILES, select_side_files

__all__ = ["CONFIG_FILES", "referenced_modules", "remote_code_files"]


def referenced_modules(src: Path) -> dict[str, str]:
    """{file name: where it is referenced} for every local module an `auto_map` names."""
    return select_side_files(src).auto_map


def remote_code_files(src: Path) -> tuple[list[str], dict[str, str]]:
    """(files to carry, {referenced file that is absent: where it is referenced})."""
    side = select_side_files(src)
    carry = {f for f in side.names if f.endswith(CODE_SUFFIX)}
    carry |= {f for f in side.auto_map if f not in side.code_missing}
    return sorted(carry), side.code_missing
