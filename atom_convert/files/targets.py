"""The targets atom-convert writes for, as names only: the command line offers them before torch is
imported (files/dtypes.py maps each to its fp8 dtype)."""

from __future__ import annotations

TARGETS: tuple[str, ...] = ("gfx950", "gfx942")
