"""Runtime naming profiles: where each converted tensor lives in the runtime's module tree.

The loaders name outputs in ATOM-native module paths; a profile maps them to
the names the runtime looks up. Only ATOM native exists today; the vLLM-plugin
profile (spec/atom-layout-plugin.md: a `model.` prefix, W_* directly under
`mla_attn` at HEAD) will be one more row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadInputError


@dataclass(frozen=True)
class NamingProfile:
    name: str
    description: str
    prefix: str  # prepended to every name
    mla_owner: str  # module under `self_attn` that owns W_K/W_V (spec §2.7)

    def tensor(self, native: str) -> str:
        return self.prefix + native

    def mla(self, attn_prefix: str, attr: str) -> str:
        """`{attn_prefix}.{mla_owner}.{attr}` for W_K, W_K_scale, W_V, W_V_scale."""
        return self.tensor(f"{attn_prefix}.{self.mla_owner}.{attr}")


PROFILES: dict[str, NamingProfile] = {
    "atom": NamingProfile(
        name="atom",
        description="ATOM native server (spec §2, §2.7)",
        prefix="",
        mla_owner="mla_attn.impl",
    ),
}


def get_profile(name: str) -> NamingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise BadInputError(f"unknown runtime profile {name!r}; available: {', '.join(PROFILES)}") from None
