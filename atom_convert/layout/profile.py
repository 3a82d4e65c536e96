"""Runtime naming profiles: where each converted tensor lives in the runtime's module tree.

The loaders name every output by ATOM's native module path (spec §2); a profile
maps those names to the names the runtime looks up, in ONE renaming step at the
end of planning (`plan.apply_profile`): tensor names, aliases (both sides) and
the per-layer shared-expert records of the main and MTP sets. A new profile is a
table row here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInputError

NATIVE_MLA_OWNER = "mla_attn.impl"  # native: the W_K/W_V owner under self_attn (spec §2.7)


@dataclass(frozen=True)
class NamingProfile:
    name: str
    description: str
    prefix: str  # prepended to every name
    mla_owner: str  # module under `self_attn` that owns W_K/W_V (spec §2.7)
    dp_attention: bool = True  # whether the runtime can run DP-attention in this mode

    def tensor(self, native: str) -> str:
        """The runtime name of a native name (a tensor, or a module/layer path)."""
        if self.mla_owner != NATIVE_MLA_OWNER:
            native = native.replace(f".{NATIVE_MLA_OWNER}.", f".{self.mla_owner}.")
        return self.prefix + native


PROFILES: dict[str, NamingProfile] = {
    "atom": NamingProfile(
        name="atom",
        description="ATOM native server (spec §2, §2.7)",
        prefix="",
        mla_owner=NATIVE_MLA_OWNER,
    ),
    # atom-layout-plugin.md §0-§1.2 (HEAD): ATOM's model is the wrapper's `model` attribute, so every
    # name gains one `model.`; W_K/W_V sit directly on `mla_attn` (its `impl` is itself). The plugin
    # forces DP-attention off (§4). The same holds for DeepSeek-V3.2 and GLM-5, whose sparse-MLA layer
    # (AttentionForVllmSparseMLA) is this MLA layer with another backend (arch/deepseek_v32.py `_PROFILES`).
    "vllm-plugin": NamingProfile(
        name="vllm-plugin",
        description="ATOM inside vLLM as its out-of-tree plugin, ATOM HEAD (atom-layout-plugin.md §1)",
        prefix="model.",
        mla_owner="mla_attn",
        dp_attention=False,
    ),
}


def get_profile(name: str) -> NamingProfile:
    try:
        return PROFILES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value, e.g. a list
        raise BadInputError(f"unknown runtime profile {name!r}; available: {', '.join(PROFILES)}") from None
