"""ATOM native: a model runner that builds the model without allocating its weights, restores the
converted tensors and never runs process_weights_after_loading (atom-loading.md §7, §10).

Select it with ATOM's `Config.runner_qualname` (§7):

    LLMEngine(model="DeepSeek-V3-atom", tensor_parallel_size=8,
              runner_qualname="atom_convert.runtime.atom_native.ConvertedModelRunner")

ATOM's OpenAI server has no command-line flag for it, so `python -m atom_convert.runtime.atom_native
ARGS...` runs `atom.entrypoints.openai_server` with ARGS after making this runner the default.

What `_build_and_load_model` does (§7, §4, §5):
1. `model_class(config)` under the `register_parameter` meta patch (no weight is allocated; buffers
   stay real), then `torch.set_default_device(None)` as ATOM does;
2. `load_into` the rank's converted tensors (config.model is the converted directory), declaring what
   this process runs (§10 item 1): the GPU's fp8 target (aiter's), ATOM's layout flags as ATOM reads
   them, the MoE backend, and the parallel layout from ATOM's live config and fused-MoE objects
   (`Placement`: world, dp, DP-attention; ep and expert_map per rank);
3. `init_prepare_finalize` once per fused MoE; transients freed (§4 steps 3 and 5).
The MTP drafter (§4 step 7, §10 item 14): ATOM's `drafter.load_model` calls the module-level
`load_model` it imported from `atom.model_loader.loader`; the runner replaces that name in the
drafter module with a loader of `mtp/`, so the drafter's own embedding/head sharing still runs after it.
Run against ATOM's own model classes, loader and drafter (ROCm/ATOM ffdf3bb5d) on a CPU through
../shared/atom-oracle/runtime.sh; not against a live ATOM on a ROCm GPU.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..serve.transfer import prepare_pool
from .common import live_parallel, meta_parameters, mtp_path, restore

log = logging.getLogger("atom_convert")
RUNNER = "atom_convert.runtime.atom_native.ConvertedModelRunner"
ATOM_DEFAULT_RUNNER = "atom.model_engine.model_runner.ModelRunner"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Which files this process loads and the parallel layout it runs, from ATOM's live config.

    Under DP-attention each engine is its own process with `tensor_parallel_size` 1 and ModelRunner
    rank 0 (CoreManager's rewrite, atom/model_engine/engine_core_mgr.py 152-162, 196-203): the files
    it needs are its engine index's (`parallel_config.data_parallel_rank`), and the deployment's GPUs
    are `data_parallel_size` x `tensor_parallel_size`."""

    rank: int  # the rank whose files this process loads
    world: int  # GPUs of the deployment (the manifest's tp)
    dp: int
    dp_attention: bool
    moe_backend: str | None = None

    @classmethod
    def of(cls, config: Any, runner_rank: int) -> "Placement":
        tp = int(getattr(config, "tensor_parallel_size", 1))
        pc = getattr(config, "parallel_config", None)
        dp = int(getattr(pc, "data_parallel_size", 1) or 1)
        dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        dpa = bool(getattr(config, "enable_dp_attention", False))
        backend = getattr(config, "moe_backend", None)
        if dpa:
            return cls(rank=dp_rank * tp + int(runner_rank), world=dp * tp, dp=dp, dp_attention=True,
                       moe_backend=backend)
        return cls(rank=int(runner_rank), world=tp, dp=dp, dp_attention=False, moe_backend=backend)

    def parallel(self, model: nn.Module) -> dict[str, Any]:
        return live_parallel(model, world=self.world, dp=self.dp, dp_attention=self.dp_attention)


def build_and_restore(model_class: Any, config: Any, *, path: str, placement: Placement,
                      device: torch.device | None = None) -> nn.Module:
    """Steps 1-3 of the module docstring; returns the model, every tensor final."""
    device = device or _device()
    if device.type == "cuda":
        prepare_pool()  # pinned while ATOM builds the model (transfer.prepare_pool)
    with meta_parameters():
        model = model_class(config)
    torch.set_default_device(None)
    stats, n_moe = restore(model, path, rank=placement.rank, device=device, parallel=placement.parallel(model),
                           moe_backend=placement.moe_backend)
    log.info("atom-convert: rank %d loaded %.2f GB in %.2f s (%.1f GB/s), %d fused MoE finalized",
             placement.rank, stats.bytes / 1e9, stats.seconds, stats.gb_per_s, n_moe)
    return model


def converted_drafter_loader(path: str, placement: Placement) -> Any:
    """A stand-in for `atom.model_loader.loader.load_model` as the drafter calls it: restores the MTP
    set into the drafter model (its first argument) and returns, as load_model does, the set of
    parameter names it loaded (the drafter keeps it and shares the target's head only for a name
    not in it: atom/spec_decode/drafter.py 359, 376)."""

    def load_model(model: nn.Module, *args: Any, **kwargs: Any) -> set[str]:
        stats, _ = restore(model, mtp_path(path), rank=placement.rank, device=_device(),
                           parallel=placement.parallel(model), moe_backend=placement.moe_backend)
        return set(stats.names)

    return load_model


def install_drafter_loader(path: str, placement: Placement) -> bool:
    """Point the drafter module's `load_model` at the converted MTP set (when ATOM has a drafter module)."""
    mod = sys.modules.get("atom.spec_decode.drafter")
    if mod is None:
        try:
            import atom.spec_decode.drafter as mod  # type: ignore[no-redef]
        except ImportError:
            return False
    mod.load_model = converted_drafter_loader(path, placement)  # type: ignore[attr-defined]
    return True


def _make_runner() -> type:
    from atom.model_engine.model_runner import ModelRunner  # type: ignore[import-not-found]

    class ConvertedModelRunner(ModelRunner):  # type: ignore[misc, valid-type]
        """ATOM's ModelRunner with `_build_and_load_model` replaced (§7: its documented override point)."""

        def _build_and_load_model(self, model_class: Any) -> None:
            cfg = self.config
            path = str(cfg.model)
            placement = Placement.of(cfg, int(getattr(self, "rank", 0)))
            install_drafter_loader(path, placement)  # the drafter is built and loaded after this (§1 step 4)
            self.model = build_and_restore(model_class, cfg, path=path, placement=placement)

    return ConvertedModelRunner


def __getattr__(name: str) -> Any:  # ATOM imports this module by qualname; ATOM itself is needed only then
    if name == "ConvertedModelRunner":
        cls = _make_runner()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def make_default(config_cls: Any) -> None:
    """Make the converted runner the default of ATOM's `Config` (for servers without a flag for it)."""
    post = getattr(config_cls, "__post_init__", None)

    def __post_init__(self: Any) -> None:
        if getattr(self, "runner_qualname", ATOM_DEFAULT_RUNNER) == ATOM_DEFAULT_RUNNER:
            self.runner_qualname = RUNNER
        if post is not None:
            post(self)

    config_cls.__post_init__ = __post_init__


def main(argv: list[str] | None = None) -> None:
    """`python -m atom_convert.runtime.atom_native ARGS`: ATOM's OpenAI server with this runner."""
    import runpy

    import atom.config  # type: ignore[import-not-found]

    make_default(atom.config.Config)
    sys.argv = ["atom.entrypoints.openai_server", *(argv if argv is not None else sys.argv[1:])]
    runpy.run_module("atom.entrypoints.openai_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
