"""Per-format codecs and the post-load primitives (fnuz, shuffles, MLA quantisation).

Importing this package registers every source format.
"""

from __future__ import annotations

from . import bf16
from . import fp8_block
from . import int4_pack
from . import quark  # noqa: F401  (registration
from .base import LinearCodec, LinearData, SourceFormat, available_formats, detect_format

__all__ = ["LinearCodec", "LinearData", "SourceFormat", "available_formats", "detect_format"]
