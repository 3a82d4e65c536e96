"""vLLM plugin mode: a model loader registered as `--load-format atom_converted` (atom-loading.md §9.2,
option 2), through vLLM's `vllm.general_plugins` entry point so that every worker registers it.

    vllm serve ./DeepSeek-V3-atom --tensor-parallel-size 8 --load-format atom_converted

What it does in `load_weights(model, model_config)` (`model` is ATOM's wrapper, the ATOM model is
`model.model`; plugin spec §1):
1. `load_into(model, DST, profile="vllm-plugin")`: names are `model.` + native, the MLA operands
   on `…self_attn.mla_attn` (HEAD plugin layout; the bytes are the native ones, plugin spec §0.3);
2. `init_prepare_finalize` once per fused MoE (ATOM's own plugin loader would have called it);
3. neutralises vLLM's second MLA post-load call (§9.1 step 5, loop 2) with an instance attribute on
   every MLA layer, so the restored W_K/W_V stay the converted ones (§10 item 10);
4. returns `{"model." + name}` for every parameter of the ATOM model (§10 item 13: vLLM's strict
   check for bf16 configs).
vLLM still calls its own `process_weights_after_loading` loop after `load_weights`; loop 1 finds no
vLLM quant method and loop 2 finds the neutralised hook. Written from vLLM 0.27.1 / ATOM HEAD code
(spec), not run against a live vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .common import finalize_moe, free_transients, live_flags, live_target
from ..load import load_into, rank_view

LOAD_FORMAT = "atom_converted"
PROFILE = "vllm-plugin"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def neutralise_mla_hooks(model: nn.Module, owner_suffix: str = ".mla_attn") -> int:
    """Shadow `process_weights_after_loading` on every MLA layer by an instance attribute (§9.2)."""
    n = 0
    for name, module in model.named_modules():
        if name.endswith(owner_suffix):
            module.process_weights_after_loading = _noop  # type: ignore[method-assign]
            n += 1
    return n


def load_weights(model: nn.Module, path: str, *, rank: int, tp_size: int, device: torch.device,
                 parallel: dict[str, Any] | None = None) -> set[str]:
    """Steps 1-4 of the module docstring for the wrapper `model`; returns the loaded-name set."""
    view = rank_view(path, rank)
    load_into(model, path, rank=rank, device=device, profile=PROFILE, target=live_target(model),
              flags=live_flags(view.flags), parallel={"tp": tp_size, **(parallel or {})})
    finalize_moe(model)
    neutralise_mla_hooks(model)
    free_transients(device)
    inner = model.model if hasattr(model, "model") else model
    return {"model." + n for n, _ in inner.named_parameters(remove_duplicate=False)}


def register() -> None:
    """The `vllm.general_plugins` entry point: register the loader class in this (worker) process."""
    from vllm.model_executor.model_loader import register_model_loader  # type: ignore[import-not-found]
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # type: ignore[import-not-found]

    @register_model_loader(LOAD_FORMAT)
    class AtomConvertedLoader(BaseModelLoader):  # type: ignore[misc, valid-type]
        def download_model(self, model_config: Any) -> None:
            return None  # the converted directory is the model path

        def load_weights(self, model: nn.Module, model_config: Any) -> set[str]:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size  # type: ignore[import-not-found]

            device = torch.device("cuda", torch.cuda.current_device())
            return load_weights(model, str(model_config.model), rank=get_tensor_model_parallel_rank(),
                                tp_size=get_tensor_model_parallel_world_size(), device=device)
