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
2. `load_into` the rank's converted tensors (config.model is the converted directory), declaring the
   live fp8 target, the layout flags of this process and the tensor-parallel size (§10 item 1);
3. `init_prepare_finalize` once per fused MoE; transients freed (§4 steps 3 and 5).
The MTP drafter (§4 step 7, §10 item 14): ATOM's `drafter.load_model` calls the module-level
`load_model` it imported from `atom.model_loader.loader`; the runner replaces that name in the
drafter module with a loader of `mtp/`, so the drafter's own embedding/head sharing still runs after it.
Read from ATOM's code (spec), not run against a live ATOM: the attribute names of ATOM's runner and
config used below (`config.model`, `rank`, `config.tensor_parallel_size`) are the spec's.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from .common import meta_parameters, mtp_path, restore

log = logging.getLogger("atom_convert")
RUNNER = "atom_convert.runtime.atom_native.ConvertedModelRunner"
ATOM_DEFAULT_RUNNER = "atom.model_engine.model_runner.ModelRunner"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_and_restore(model_class: Any, config: Any, *, path: str, rank: int, tp_size: int,
                      device: torch.device | None = None) -> nn.Module:
    """Steps 1-3 of the module docstring; returns the model, every tensor final."""
    device = device or _device()
    with meta_parameters():
        model = model_class(config)
    torch.set_default_device(None)
    stats, n_moe = restore(model, path, rank=rank, device=device, tp_size=tp_size)
    log.info("atom-convert: rank %d loaded %.2f GB in %.2f s (%.1f GB/s), %d fused MoE finalized",
             rank, stats.bytes / 1e9, stats.seconds, stats.gb_per_s, n_moe)
    return model


def converted_drafter_loader(path: str, rank: int, tp_size: int) -> Any:
    """A stand-in for `atom.model_loader.loader.load_model` as the drafter calls it: restores the MTP
    set into the drafter model (its first argument) and returns as load_model does."""

    def load_model(model: nn.Module, *args: Any, **kwargs: Any) -> None:
        restore(model, mtp_path(path), rank=rank, device=_device(), tp_size=tp_size)

    return load_model


def install_drafter_loader(path: str, rank: int, tp_size: int) -> bool:
    """Point the drafter module's `load_model` at the converted MTP set (when ATOM has a drafter module)."""
    mod = sys.modules.get("atom.spec_decode.drafter")
    if mod is None:
        try:
            import atom.spec_decode.drafter as mod  # type: ignore[no-redef]
        except ImportError:
            return False
    mod.load_model = converted_drafter_loader(path, rank, tp_size)  # type: ignore[attr-defined]
    return True


def _make_runner() -> type:
    from atom.model_engine.model_runner import ModelRunner  # type: ignore[import-not-found]

    class ConvertedModelRunner(ModelRunner):  # type: ignore[misc, valid-type]
        """ATOM's ModelRunner with `_build_and_load_model` replaced (§7: its documented override point)."""

        def _build_and_load_model(self, model_class: Any) -> None:
            cfg = self.config
            path = str(cfg.model)
            rank = int(getattr(self, "rank", 0))
            tp = int(getattr(cfg, "tensor_parallel_size", 1))
            install_drafter_loader(path, rank, tp)  # the drafter is built and loaded after this (§1 step 4)
            self.model = build_and_restore(model_class, cfg, path=path, rank=rank, tp_size=tp)

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
