"""atom-convert: DeepSeek V2/V3/R1 and Kimi-K2 checkpoints into the ROCm ATOM
runtime's post-load weight layout, once, offline.

Public API: `convert`, `open_converted`, `load_into`, `ensure_converted`, `upload`, `AtomConvertError`.
"""

from __future__ import annotations

from ._version import __version__  # noqa: F401

from .engine.convert import convert  # noqa: E402
from .errors import AtomConvertError, BadInputError  # noqa: E402
from .serve.load import LoadStats, load_into  # noqa: E402
from .engine.cache import ensure_converted  # noqa: E402
from .hub.publish import upload  # noqa: E402
from .store.reader import ConvertedCheckpoint, open_converted  # noqa: E402

__all__ = ["convert", "open_converted", "load_into", "LoadStats", "ensure_converted", "upload", "ConvertedCheckpoint", "AtomConvertError", "BadInputError", "__version__"]
