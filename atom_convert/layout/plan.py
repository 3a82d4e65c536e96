"""The conversion plan: every output tensor, its dtype, shape and sources, known
before any tensor data is read. `--dry-run` prints it; the writer sizes shards
and headers from it; the manifest records it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .model import ModelSpec
from .parallel import REPLICATED, Parallel, ParallelLayout, Split
from .profile import NamingProfile

# Produces one rank's tensor as chunks along dim 0 (or the whole tensor); the
# `cache` dict lives for one (group, rank), so outputs of the same group can
# share one read of their sources (a weight and its scale, W_K and W_V).
Producer = Callable[[int, dict[str, Any]], Iterable[torch.Tensor]]


@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per rank
    sources: tuple[str, ...]
    produce: Producer
    is_shuffled: bool = False
    runtime_dtype: str | None = None  # the dtype the runtime views the stored bytes as, if different
    meta: dict[str, Any] = field(default_factory=dict)  # padding and layout notes for loaders and checks
    split: Split = REPLICATED  # how the ranks divide it (parallel.py); `produce` is called per rank
    rank_sources: list[tuple[str, ...]] | None = None  # per rank, when ranks read different sources (EP)
    chunk_bytes: int = 0  # the largest chunk `produce` yields (0: the whole tensor); sizes the memory budget
    # > 0: the tensor is `units` equal slabs along dim 0 (a rank's experts) that `produce` can make
    # a range of: produce(rank, cache, part=(a, b)) yields the bytes of units [a, b) only. Workers
    # then split one layer's experts over several items (workers.py).
    units: int = 0
    # With units: the source tensors of unit u of rank r's copy (unit_sources(r, u)), so that the
    # readahead reads an item's range of experts, not every source of the tensor (prefetch.py).
    unit_sources: Callable[[int, int], tuple[str, ...]] | None = None

    def sources_of(self, rank: int) -> tuple[str, ...]:
        """The source tensors rank `rank`'s copy is made from."""
        return self.rank_sources[rank] if self.rank_sources is not None else self.sources

    def sources_of_units(self, rank: int, part: tuple[int, int] | None) -> tuple[str, ...]:
        """The source tensors units [a, b) of rank `rank`'s copy are made from (all of its
        sources where the tensor has no units or does not say)."""
        if part is None or self.unit_sources is None:
            return self.sources_of(rank)
        return tuple(n for u in range(*part) for n in self.unit_sources(rank, u))

    @property
    def identical_on_every_rank(self) -> bool:
        return self.split.kind != "experts" and self.split.ways == 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def unit_bytes(self) -> int:
        return self.nbytes // self.units if self.units else self.nbytes


@dataclass
class Group:
    """One unit of streaming work (a decoder layer, or the top-level tensors).

    The working set of a conversion is one group's producers at a time.
    """

    key: str
    outputs: list[OutTensor] = field(default_factory=list)


@dataclass
class ModelPlan:
    """One converted set (the main model, or the MTP drafter under mtp/)."""

    groups: list[Group]
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> stored name
    moe_layers: dict[str, str] = field(default_factory=dict)  # layer -> shared-expert layout

    def outputs(self) -> list[OutTensor]:
        return [o for g in self.groups for o in g.outputs]


@dataclass
class ConversionPlan:
    spec: ModelSpec
    source_format: str
    target: str
    tp: int
    profile: NamingProfile
    main: ModelPlan
    mtp: ModelPlan | None
    mtp_status: str  # "converted", "dropped by --no-mtp", "not in the checkpoint", "absent"
    dropped: dict[str, str]  # source name -> reason
    layout_flags: dict[str, Any]
    parallel: Parallel = field(default_factory=Parallel)
    # --quantize: the requantisation the conversion applies (codecs/requant.RequantFormat.record), else None.
    requant: dict[str, Any] | None = None

    def is_common(self, o: OutTensor) -> bool:
        """Written once, in a common file every rank maps (spec atom-parallel.md §3.1)."""
        return self.parallel.common_files and o.identical_on_every_rank

    def parallel_layout(self) -> ParallelLayout:
        fused = "fused_shared_expert" in self.main.moe_layers.values()
        return ParallelLayout.of(self.parallel, self.spec.E, self.spec.S, fused)


@dataclass
class ShardPlan:
    file: str
    rank: int
    names: list[str]
    nbytes: int


COMMON = -1  # the ShardPlan.rank of common files (read by every rank)


def assign_shards(outputs: list[OutTensor], rank: int, tp: int, max_bytes: int, prefix: str = "model") -> list[ShardPlan]:
    """Greedy, in load order: a shard closes when the next tensor would pass `max_bytes`
    (a tensor larger than the budget gets a shard of its own)."""
    # The budget covers the whole file: tensor bytes plus the JSON header (an upper bound of
    # each tensor's entry: name, dtype code, shape and two offsets of up to 20 digits).
    base = 8 + len('{"__metadata__":{"format":"pt"}}') + 8
    groups: list[tuple[list[str], int]] = [([], base)]
    for o in outputs:
        cost = o.nbytes + len(o.name) + len(str(list(o.shape))) + 90
        names, size = groups[-1]
        if names and size + cost > max_bytes:
            groups.append(([], base))
            names, size = groups[-1]
        names.append(o.name)
        groups[-1] = (names, size + cost)
    n = len(groups)
    tag = "-common" if rank == COMMON else f"-rank{rank}" if tp > 1 else ""
    by_name = {o.name: o.nbytes for o in outputs}
    return [
        ShardPlan(f"{prefix}{tag}-{k + 1:05d}-of-{n:05d}.safetensors", rank, names, sum(by_name[x] for x in names))
        for k, (names, _) in enumerate(groups)
    ]


def apply_profile(plan: ConversionPlan, profile: NamingProfile) -> None:
    """Rename a plan planned with ATOM-native names into `profile`'s, in place: the one renaming step
    at the end of planning (tensor names, aliases on both sides, the per-layer MoE records)."""
    if profile.name == "atom":
        return
    for mplan in (plan.main, plan.mtp):
        if mplan is None:
            continue
        for o in mplan.outputs():
            o.name = profile.tensor(o.name)
        mplan.aliases = {profile.tensor(a): profile.tensor(t) for a, t in mplan.aliases.items()}
        mplan.moe_layers = {profile.tensor(k): v for k, v in mplan.moe_layers.items()}
