"""Architecture loaders. Importing this package registers every family module."""

from __future__ import annotations

from . import deepseek, deepseek_v32  # noqa: F401  (registration)
from . import glm_moe_dsa  # noqa: F401  (registration)
from . import kimi_k25  # noqa: F401  (registration)
from .base import ArchLoader, get_loader, registered

__all__ = ["ArchLoader", "get_loader", "registered"]
