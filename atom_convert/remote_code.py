"""The Python files a checkpoint's configs load with `trust_remote_code`, so that a converted
directory is a complete model path for a server (AutoConfig, AutoTokenizer, AutoModel from DST).

`auto_map` in config.json and tokenizer_config.json names classes as `module.Class`, a list of such
names (AutoTokenizer: [slow, fast], either may be null), or `repo_id--module.Class` for code kept in
another repository (not carried: transformers fetches it from there). A module may import sibling
modules of the folder (`from .configuration_deepseek import ...`), so every top-level `*.py` file of
the source is carried too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

CONFIG_FILES = ("config.json", "tokenizer_config.json")


def _class_refs(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _class_refs(v)


def referenced_modules(src: Path) -> dict[str, str]:
    """{file name: where it is referenced} for every local module an `auto_map` names."""
    out: dict[str, str] = {}
    for cfg_name in CONFIG_FILES:
        p = src / cfg_name
        if not p.is_file():
            continue
        try:
            amap = json.loads(p.read_text()).get("auto_map") or {}
        except (ValueError, AttributeError):
            continue
        if not isinstance(amap, dict):
            continue
        for key, value in amap.items():
            for ref in _class_refs(value):
                if "--" in ref or "." not in ref:  # code in another repository
                    continue
                out.setdefault(ref.rsplit(".", 1)[0].replace(".", "/") + ".py", f"{cfg_name} auto_map.{key}")
    return out


def remote_code_files(src: Path) -> tuple[list[str], dict[str, str]]:
    """(files to carry, {referenced file that is absent: where it is referenced})."""
    refs = referenced_modules(src)
    carry = {p.name for p in src.glob("*.py") if p.is_file()}
    carry |= {f for f in refs if (src / f).is_file()}
    missing = {f: where for f, where in refs.items() if not (src / f).is_file()}
    return sorted(carry), missing
