"""The parallel layout a conversion targets, and how every tensor is split across its ranks.

How it works:
1. `Parallel` is the serving mode as ATOM's command line states it (`-tp N`,
   `--enable-expert-parallel`, `--enable-dp-attention`, `ATOM_FUSE_SHARED_EXPERT`,
   whether `mori` is importable on the serving host) and derives what each module sees
   (spec atom-parallel.md §1.1, §2.1): the aiter TP group of attention, dense MLPs,
   embeddings and unfused shared experts (`attn_tp`: 1 under DP-attention), and the MoE's
   `moe_tp`/`ep` (EP turns MoE-TP off; DP-attention flattens the MoE over every GPU).
2. `Split` is the ONE description of how a tensor is cut into ranks, recorded per tensor in
   the plan and the manifest, and read by convert, check, verify, the reference forward and
   inspect: `replicated`, `dim` (source rows or columns in `ways` equal pieces, each part of
   a fused tensor cut on its own), `heads` (W_K/W_V from the rank's kv_b heads), or `experts`
   (the rank's expert slots, each cut on I in `ways` pieces).
3. `RankLayout` is what one rank holds of the MoE: its routed-id range, its slot map (slot ->
   expert id, the shared expert as id E) and, under EP, ATOM's `expert_map` (spec §1.2, §1.4:
   length E+S+1, -1 for experts of other ranks and for the sentinel), for a loader's equality check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import BadInputError, UnsupportedError

SHARED_EXPERT_CHOICES = ("fused", "separate")


@dataclass(frozen=True)
class Split:
    kind: str = "replicated"  # replicated | dim | heads | experts
    ways: int = 1  # distinct pieces; 1: identical on every rank (experts: the cut of I)
    dim: int = 0  # for `dim`: the source dimension cut (0 rows, 1 columns)

    def piece(self, rank: int) -> int:
        """Which piece rank `rank` holds: pieces are numbered like the ranks (spec §1.1: the
        flattened MoE rank and the TP rank are the GPU index) unless there is only one."""
        return rank % self.ways

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "ways": self.ways}
        if self.kind == "dim":
            d["dim"] = self.dim
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Split":
        return cls(kind=d["kind"], ways=int(d.get("ways", 1)), dim=int(d.get("dim", 0)))


REPLICATED = Split()


@dataclass
class RankLayout:
    rank: int
    attn_tp_rank: int
    moe_tp_rank: int
    ep_rank: int
    routed: tuple[int, int]  # global routed ids [lo, hi) held by this rank
    slots: list[int]  # local slot -> expert id (E: the fused shared expert)
    expert_map: list[int] | None = None  # ATOM's map under EP (global id -> local slot, -1 elsewhere)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routed"] = list(self.routed)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankLayout":
        return cls(rank=d["rank"], attn_tp_rank=d["attn_tp_rank"], moe_tp_rank=d["moe_tp_rank"], ep_rank=d["ep_rank"],
                   routed=(d["routed"][0], d["routed"][1]), slots=list(d["slots"]), expert_map=d.get("expert_map"))


@dataclass(frozen=True)
class Parallel:
    """The serving mode. `tp` is ATOM's `-tp` (the number of GPUs; `-dp` stays 1)."""

    tp: int = 1
    ep: bool = False
    dp_attention: bool = False
    shared_experts: str = "fused"  # ATOM_FUSE_SHARED_EXPERT=1 (fused) or 0 (separate)
    mori: bool = False  # whether the serving host can import `mori` (decides all2all, spec §1.1, §3.2)

    @property
    def world(self) -> int:
        return self.tp

    @property
    def attn_tp(self) -> int:
        """The aiter TP group of everything but the routed experts (spec §2.1: 1 under DP-attention)."""
        return 1 if self.dp_attention else self.tp

    @property
    def dp(self) -> int:
        """The engine's data-parallel size (spec §2.1: tp·dp under DP-attention)."""
        return self.tp if self.dp_attention else 1

    @property
    def ep_size(self) -> int:
        return self.tp if self.ep else 1

    @property
    def moe_tp(self) -> int:
        """MoE tensor parallelism: off under EP, flattened over every GPU otherwise (spec §1.1, §2.2)."""
        return 1 if self.ep else self.tp

    @property
    def all2all(self) -> bool:
        """`use_all2all_kernels` (spec §1.1): dp > 1, EP and mori importable."""
        return self.dp > 1 and self.ep and self.mori

    @property
    def fusion_allowed(self) -> bool:
        """ATOM_FUSE_SHARED_EXPERT=0 only acts under DP-attention with mori importable (spec §3.2)."""
        return not (self.shared_experts == "separate" and self.dp_attention and self.mori)

    @property
    def common_files(self) -> bool:
        """Tensors identical on every rank go to common files (spec §3.1). Plain TP keeps its
        per-rank files unchanged (the layout of format_version 1)."""
        return self.world > 1 and (self.ep or self.dp_attention)

    def shared_expert_mode(self, fused: bool) -> str:
        """ATOM's MoEExpertLayout mode for a layer whose shared expert is (or is not) fused (spec §1.2)."""
        if not fused:
            return "NONE"
        return "LOCAL_REPLICA" if self.all2all else "LEGACY_AITER"

    def validate(self) -> None:
        if self.tp < 1:
            raise BadInputError(f"--tp must be >= 1, got {self.tp}")
        if self.shared_experts not in SHARED_EXPERT_CHOICES:
            raise BadInputError(f"--shared-experts must be one of {', '.join(SHARED_EXPERT_CHOICES)}, "
                                f"got {self.shared_experts!r}")
        if self.ep and self.tp < 2:
            raise BadInputError("--ep needs --tp 2 or more: ATOM turns expert parallelism on only when "
                                "tp·dp > 1 (spec atom-parallel.md §1.1); drop --ep or raise --tp")
        if self.dp_attention and self.tp < 2:
            raise BadInputError("--dp-attention needs --tp 2 or more (at tp 1 it is plain tp 1); drop it or raise --tp")
        if self.shared_experts == "separate" and not (self.dp_attention and self.mori):
            raise UnsupportedError(
                "--shared-experts separate (ATOM_FUSE_SHARED_EXPERT=0): ATOM only honours it with "
                "--dp-attention and mori importable on the serving host (spec atom-parallel.md §3.2); in any "
                "other mode it fuses the shared expert anyway. Add --dp-attention --mori, or drop the option"
            )
        if self.mori and not self.dp_attention:
            raise BadInputError("--mori only changes the layout under --dp-attention (spec atom-parallel.md §3.2); "
                                "drop it or add --dp-attention")

    def check_experts(self, E: int, where: str) -> None:
        """E % ep == 0, as FusedMoE asserts (spec §1.4 C)."""
        if self.ep and E % self.ep_size:
            raise UnsupportedError(
                f"{where}: n_routed_experts={E} is not divisible by the expert-parallel size {self.ep_size} "
                f"(--tp {self.tp} --ep); ATOM's FusedMoE asserts E % ep == 0 and refuses to start "
                f"(spec atom-parallel.md §1.4 C). Choose a --tp that divides {E}"
            )

    def rank_layouts(self, E: int, S: int, fused: bool) -> list[RankLayout]:
        """Each rank's routed range and slot map (spec §1.2-§1.4). `fused`: the shared expert
        takes the slot after the routed block on every rank. `S` is recorded by the callers'
        model block; ATOM fuses at most one shared expert."""
        out = []
        per = E // self.ep_size if E else 0
        for r in range(self.world):
            ep_rank = r if self.ep else 0
            lo, hi = (ep_rank * per, (ep_rank + 1) * per) if E else (0, 0)
            slots = list(range(lo, hi)) + ([E] if fused and E else [])
            emap = None
            if self.ep and E:
                emap = [-1] * E
                for k, g in enumerate(range(lo, hi)):
                    emap[g] = k
                if fused:  # the shared slot after the routed block, then a -1 sentinel (moe.py:2778-2793)
                    emap += [hi - lo, -1]
            out.append(RankLayout(rank=r, attn_tp_rank=0 if self.dp_attention else r,
                                  moe_tp_rank=0 if self.ep else r, ep_rank=ep_rank, routed=(lo, hi), slots=slots,
                                  expert_map=emap))
        return out


@dataclass
class ParallelLayout:
    """The manifest's `parallel` block."""

    tp: int
    dp: int
    ep: int
    dp_attention: bool
    attn_tp: int
    moe_tp: int
    world: int
    shared_experts: str  # fused | separate (the ATOM_FUSE_SHARED_EXPERT the files assume)
    shared_expert_mode: str  # LEGACY_AITER | LOCAL_REPLICA | NONE (for fused layers)
    mori_importable: bool
    common_files: bool
    ranks: list[RankLayout] = field(default_factory=list)

    @classmethod
    def of(cls, par: Parallel, E: int, S: int, fused: bool) -> "ParallelLayout":
        return cls(tp=par.tp, dp=par.dp, ep=par.ep_size, dp_attention=par.dp_attention, attn_tp=par.attn_tp,
                   moe_tp=par.moe_tp, world=par.world, shared_experts=par.shared_experts,
                   shared_expert_mode=par.shared_expert_mode(fused), mori_importable=par.mori,
                   common_files=par.common_files, ranks=par.rank_layouts(E, S, fused))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"] = [r.as_dict() for r in self.ranks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ParallelLayout":
        kw = {k: d[k] for k in ("tp", "dp", "ep", "dp_attention", "attn_tp", "moe_tp", "world", "shared_experts",
                                "shared_expert_mode", "mori_importable", "common_files")}
        return cls(**kw, ranks=[RankLayout.from_dict(r) for r in d.get("ranks", [])])
