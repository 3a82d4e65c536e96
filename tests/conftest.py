"""Session-cached fixtures: tiny real checkpoints (built with transformers from
atom_convert/configs/ presets) and their conversions, shared by every test module."""

from __future__ import annotations

import shutil
import signal
import zlib
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import atom_convert
from atom_convert.synth import build_tiny

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored,
# and Python then installs no KeyboardInterrupt handler: the Ctrl-C tests would see nothing (a
# fresh-clone run started so failed them, and hung in the stuck-write one). Python's default here.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

PRESETS = ("tiny-deepseek-v2-lite", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-kimi-k2")
FORMATS = ("bf16", "fp8")
TARGETS = ("gfx950", "gfx942")


SESSION_DIR = "atom-convert"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module (its conversions run their own workers; tiny
    tensors are slower split across threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(SESSION_DIR)


@pytest.fixture(scope="module", autouse=True)
def _module_dirs_removed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What a test module's own fixtures made under the session's temporary root (tmp_path_factory
    dirs of module scope: its converted checkpoints) is removed when the module ends, unless one of
    its tests failed (kept for reading). CI's disk is small; the session's shared fixtures stay."""
    root = tmp_path_factory.getbasetemp()
    before = set(root.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for p in set(root.iterdir()) - before:
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(SESSION_DIR):
            shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(session_dir: Path) -> Callable[..., Path]:
    """tiny_checkpoint(preset, fmt) -> source folder, built once per session.
    fp8 sources are written as 2 shards with an index; bf16 as one file."""
    cache: dict[tuple[str, str], Path] = {}

    def get(preset: str, fmt: str) -> Path:
        key = (preset, fmt)
        if key not in cache:
            cache[key] = build_tiny(preset, session_dir / "src" / f"{preset}-{fmt}", fmt=fmt, seed=zlib.crc32(repr(key).encode()) % 1000,
                                    shards=2 if fmt == "fp8" else 1)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted(session_dir: Path, tiny_checkpoint: Callable[..., Path]) -> Callable[..., Path]:
    """converted(preset, fmt, target, tp=1) -> converted folder, built once per session."""
    cache: dict[tuple[str, str, str, int], Path] = {}

    def get(preset: str, fmt: str, target: str, tp: int = 1) -> Path:
        key = (preset, fmt, target, tp)
        if key not in cache:
            dst = session_dir / "out" / f"{preset}-{fmt}-{target}-tp{tp}"
            atom_convert.convert(tiny_checkpoint(preset, fmt), dst, target=target, tp=tp)
            cache[key] = dst
        return cache[key]

    return get


@pytest.fixture(scope="session")
def aiter():
    """(fp4_utils, shuffle) from the amd-aiter wheel: the runtime's own pure-torch helpers."""
    from oracles import load_aiter

    return load_aiter()


@pytest.fixture(scope="session")
def quark_checkpoint(session_dir: Path) -> Callable[..., Path]:
    """quark_checkpoint(preset, style) -> an AMD Quark MXFP4 export of `preset` (hidden_size 256,
    no MTP layer), style "template" (Quark's LLMTemplate) or "all" (every linear incl. attention),
    built once per session (tests/quark_fixtures.py; Quark is imported on the first call only)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(preset: str, style: str) -> Path:
        key = (preset, style)
        if key not in cache:
            from quark_fixtures import build_quark_export

            cache[key] = build_quark_export(session_dir / "quark" / f"{preset}-{style}", preset, style,
                                            seed=zlib.crc32(repr(key).encode()) % 1000)
        return cache[key]

    return get
