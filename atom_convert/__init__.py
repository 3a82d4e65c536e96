"""atom-convert: DeepSeek V2/V3/R1 and Kimi-K2 checkpoints into the ROCm ATOM
runtime's post-load weight layout, once, offline.

Public API: `convert`, `open_converted`, `load_into`, `ensure_converted`, `upload`, `AtomConvertError`.

The names are imported on first use (PEP 562), so that `import atom_convert.cli` can set up the
process (torch's allocator settings) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__  # noqa: F401

_WHERE = {
    "convert": ".engine.convert",
    "AtomConvertError": ".errors",
    "BadInputError": ".errors",
    "LoadStats": ".serve.load",
    "load_into": ".serve.load",
    "ensure_converted": ".engine.cache",
    "upload": ".hub.publish",
    "ConvertedCheckpoint": ".store.reader",
    "open_converted": ".store.reader",
}

__all__ = [*_WHERE, "__version__"]

if TYPE_CHECKING:
    from .engine.cache import ensure_converted
    from .engine.convert import convert
    from .errors import AtomConvertError, BadInputError
    from .hub.publish import upload
    from .serve.load import LoadStats, load_into
    from .store.reader import ConvertedCheckpoint, open_converted


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'atom_convert' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
