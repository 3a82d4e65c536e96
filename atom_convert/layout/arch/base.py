"""Architecture loaders: a registry keyed by (architecture, model_type).

A loader turns a source checkpoint into a `ConversionPlan`. Registration is a
class keyword, checked when the class is defined, so a loader that forgets
its keys fails at import time with its name in the message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import UnsupportedError

if TYPE_CHECKING:
    from ..model import ModelSpec
    from ..parallel import Parallel
    from ..plan import ConversionPlan
    from ..profile import NamingProfile
    from ..codecs.base import SourceFormat
    from ...files.source import SourceCheckpoint

_LOADERS: dict[tuple[str, str], type["ArchLoader"]] = {}


class ArchLoader(ABC):
    keys: ClassVar[tuple[tuple[str, str], ...]]  # (architecture, model_type) pairs

    def __init_subclass__(cls, register: bool = True, **kw: Any):
        super().__init_subclass__(**kw)
        if not register:
            return
        if "keys" not in cls.__dict__ or not cls.keys:
            raise TypeError(f"loader {cls.__name__!r} must define `keys` ((architecture, model_type) pairs)")
        for k in cls.keys:
            if k in _LOADERS:
                raise TypeError(f"{k} is registered twice ({_LOADERS[k].__name__}, {cls.__name__})")
            _LOADERS[k] = cls

    @abstractmethod
    def plan(
        self,
        src: "SourceCheckpoint",
        spec: "ModelSpec",
        fmt: "SourceFormat",
        *,
        target: str,
        tp: int,
        profile: "NamingProfile",
        mtp: bool,
        mla_bmm: str = "fp8",
        parallel: "Parallel | None" = None,
    ) -> "ConversionPlan":
        """Check the source against the config and plan every output tensor."""


def get_loader(spec: "ModelSpec") -> ArchLoader:
    cls = _LOADERS.get((spec.architecture, spec.model_type))
    if cls is None:
        known = ", ".join(f"{a} ({t})" for a, t in sorted(_LOADERS))
        raise UnsupportedError(f"no loader for {spec.architecture} with model_type {spec.model_type!r}; known: {known}")
    return cls()


def registered() -> list[tuple[str, str]]:
    return sorted(_LOADERS)
