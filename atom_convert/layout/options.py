"""One value for what a conversion is: `ConversionOptions`.

Everything that decides the converted bytes (target, parallel layout, shared-expert mode, MTP, MLA
format, naming profile) plus the shard size (which only splits files), validated once at construction.
The CLI, `convert`, `ensure_converted` and the Hub flows build one and pass it on; the three ways of
saying "the same conversion" all derive from it:
- the options fingerprint (`store.fingerprint.options_fingerprint(options)`: resume and cache records),
  from `fingerprint_parts()`;
- the content key (`hub.pull.content_key`: a converted repo on the Hub), from `layout()`;
- the cache entry (`engine.cache`), from the fingerprint's digest.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInputError, UnsupportedError
from ..files.targets import TARGETS
from .parallel import Parallel
from .profile import get_profile

DEFAULT_SHARD_SIZE = 5 * 1000**3
# The options that decide the bytes, in the order the manifest's `conversion.options` lists them.
LAYOUT_FIELDS = ("target", "tp", "ep", "dp_attention", "shared_experts", "mori", "mtp", "mla_bmm", "profile")


def parse_size(text: str | int) -> int:
    """Bytes from an int or a text like 5GB, 500MB, 2GiB."""
    if isinstance(text, bool):
        raise BadInputError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
             "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "K": 1000, "M": 1000**2, "G": 1000**3, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * m)
            except (ValueError, OverflowError):  # "infGB", "1e400GB"
                break
    try:
        return int(t)
    except ValueError:
        raise BadInputError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB") from None


# The options, and the Python API's other arguments, are checked before anything is created or read:
# a wrong type is bad input named by its argument, not a TypeError from deep inside.


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise BadInputError(f"{name} must be True or False, got {value!r}")


def check_path(name: str, value: Any) -> Path:
    """A str or os.PathLike of str as a Path."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise BadInputError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")
    return Path(value)


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """A whole number >= `minimum` as an int: any integral type (a numpy integer a runtime hands over
    too), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise BadInputError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ConversionOptions:
    """What a conversion produces (see the module docstring); frozen and validated."""

    target: str = "gfx950"
    tp: int = 1
    ep: bool = False
    dp_attention: bool = False
    shared_experts: str = "fused"
    mori: bool = False
    mtp: bool = True
    mla_bmm: str = "fp8"
    profile: str = "atom"
    shard_size: int = DEFAULT_SHARD_SIZE
    # Re-encode while converting (atom-layout-next.md §4.4-4.5): None (as stored), "mxfp4" (gfx950) or "fp8".
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise BadInputError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int):
            raise BadInputError(f"tp must be an integer, got {self.tp!r}")
        for name in ("ep", "dp_attention", "mori", "mtp"):
            check_flag(name, getattr(self, name))
        get_profile(self.profile)  # unknown profiles refused, naming the known ones
        object.__setattr__(self, "shard_size", parse_size(self.shard_size))
        if self.shard_size < 1:
            raise BadInputError(f"shard_size must be positive, got {self.shard_size}")
        if self.dp_attention and not get_profile(self.profile).dp_attention:
            raise UnsupportedError(
                f"--profile {self.profile} with --dp-attention: ATOM inside vLLM forces enable_dp_attention off "
                f"(atom-layout-plugin.md §4); convert with --profile atom, or without --dp-attention")
        self.parallel().validate()  # tp >= 1, shared_experts and its conditions (spec atom-parallel.md §3.2)
        if self.mla_bmm not in ("fp8", "mxfp4"):
            raise BadInputError(f"--mla-bmm must be fp8 or mxfp4, got {self.mla_bmm!r}")
        if self.quantize is not None:
            from .codecs.requant import QUANTIZE_CHOICES, QUANTIZE_TARGETS

            if self.quantize not in QUANTIZE_CHOICES:
                raise BadInputError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
            if self.target not in QUANTIZE_TARGETS[self.quantize]:
                raise UnsupportedError(
                    f"--quantize {self.quantize} --target {self.target}: ATOM serves MXFP4 MoE on gfx950 only (on "
                    f"gfx942 it forces its triton path, atom-layout-next.md §4.3); use --quantize fp8 for {self.target}")

    @classmethod
    def build(cls, options: "ConversionOptions | None" = None, **given: Any) -> "ConversionOptions":
        """`options` as given, or one made from keyword values (those left None take the defaults).
        Both at once is refused unless the keywords equal the value's fields."""
        if options is not None and not isinstance(options, cls):
            raise BadInputError(f"options must be a ConversionOptions (atom_convert.layout.options), got "
                                f"{type(options).__name__} {options!r}; or give its fields as keywords")
        given = {k: v for k, v in given.items() if v is not None}
        if options is None:
            return cls(**given)
        clash = [k for k, v in given.items() if getattr(options, k) != (parse_size(v) if k == "shard_size" else v)
                 and v != getattr(cls(), k)]
        if clash:
            raise BadInputError(f"options= and the keyword(s) {', '.join(clash)} disagree; give one of them")
        return options

    def replace(self, **changes: Any) -> "ConversionOptions":
        return dataclasses.replace(self, **changes)

    def layout(self) -> dict[str, Any]:
        """The options that decide the converted bytes (the shard size only splits files); `quantize`
        only when set, so that the content keys of conversions without it stay as they were."""
        out = {k: getattr(self, k) for k in LAYOUT_FIELDS}
        if self.quantize is not None:
            out["quantize"] = self.quantize
        return out

    def fingerprint_parts(self) -> dict[str, str]:
        """The options' part of the options fingerprint (everything that changes the written files)."""
        return {"target": self.target, "tp": str(self.tp), "shard_size": str(self.shard_size), "mtp": str(self.mtp),
                "mla_bmm": self.mla_bmm, "profile": self.profile, "ep": str(self.ep),
                "dp_attention": str(self.dp_attention), "shared_experts": self.shared_experts, "mori": str(self.mori),
                **({"quantize": self.quantize} if self.quantize is not None else {})}

    def parallel(self) -> Parallel:
        return Parallel(tp=self.tp, ep=self.ep, dp_attention=self.dp_attention, shared_experts=self.shared_experts,
                        mori=self.mori)

    def command(self, source: str) -> str:
        """The `atom-convert convert` command line that makes this conversion of `source`."""
        cmd = [f"atom-convert convert {source} DST --target {self.target} --tp {self.tp}"]
        for flag in ("ep", "dp_attention", "mori"):
            if getattr(self, flag):
                cmd.append("--" + flag.replace("_", "-"))
        if self.shared_experts != "fused":
            cmd.append(f"--shared-experts {self.shared_experts}")
        if self.profile != "atom":
            cmd.append(f"--profile {self.profile}")
        if not self.mtp:
            cmd.append("--no-mtp")
        if self.mla_bmm != "fp8":
            cmd.append(f"--mla-bmm {self.mla_bmm}")
        if self.quantize is not None:
            cmd.append(f"--quantize {self.quantize}")
        return " ".join(cmd)
