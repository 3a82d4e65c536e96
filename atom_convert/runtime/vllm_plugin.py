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
vLLM quant method and loop 2 finds the neutralised hook. The MTP draft: vLLM loads it with the
target's load format and directory, so the loader fills it from `mtp/` (`is_mtp_draft`). Tested with
real vLLM 0.27.1's config, loader registry and draft-config path on a CPU (tests/test_vllm.py); not
run inside a serving vLLM on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BadInputError, UnsupportedError
from ..serve.transfer import prepare_pool
from .common import live_parallel, mtp_path, restore

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


def is_mtp_draft(model: nn.Module, model_config: Any = None) -> bool:
    """Whether vLLM hands this loader the MTP draft rather than the target. vLLM loads the draft with
    the target's load config and model path (speculative.py: `draft_load_config` None -> the
    target's; the draft's model is the target's directory), so the same `--load-format` reaches
    it; ATOM's wrapper marks the draft (`is_mtp_draft_model`, atom/plugin/vllm/model_wrapper.py
    384), and its config names an MTP architecture (vLLM's `hf_config_override`: DeepSeekMTPModel)."""
    if getattr(model, "is_mtp_draft_model", False):
        return True
    hf = getattr(model_config, "hf_config", None)
    archs = getattr(hf, "architectures", None) or []
    return any("MTP" in a for a in archs)


def target_device(load_config: Any, model: nn.Module) -> torch.device:
    """The device vLLM loads onto, as `BaseModelLoader.load_model` chooses it (base_loader.py 47-52):
    `load_config.device`, else the current config's `device_config.device` (set around the whole
    load in a worker: gpu_worker.py 435-442); else where the model's own tensors live."""
    dev = getattr(load_config, "device", None)
    if dev is None:
        try:
            from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found]

            cur = get_current_vllm_config_or_none()
        except ImportError:
            cur = None
        dev = getattr(getattr(cur, "device_config", None), "device", None)
    if dev is None or str(dev) in ("", "auto"):
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type != "meta":
                dev = t.device
                break
    if dev is None:
        raise BadInputError("atom_converted loader: no device in vLLM's load or device config and none on the "
                            "model; start vLLM with --device (or LoadConfig(device=...))")
    return torch.device(dev)


def load_weights(model: nn.Module, path: str, *, rank: int, tp_size: int, device: torch.device,
                 dp: int = 1, draft: bool = False) -> set[str]:
    """Steps 1-4 of the module docstring for the wrapper `model`; returns the loaded-name set. `draft`:
    the MTP drafter, filled from the converted `mtp/` set (or refused, naming what to do)."""
    inner = model.model if hasattr(model, "model") else model
    if dp > 1:
        # vLLM DP x EP flattens EP over dp*tp ranks and unfuses the shared expert (plugin/config.py
        # 354-356; atom-parallel.md §3.2): no conversion writes that layout, and the files a rank needs
        # are its EP rank's, not its TP rank's.
        raise UnsupportedError(
            f"{path}: vLLM data parallel (data_parallel_size {dp}) with the atom_converted load format is not a "
            "layout atom-convert writes; serve with tensor parallel only (--tensor-parallel-size N, optionally "
            "--enable-expert-parallel), or load the original checkpoint")
    src = mtp_path(path) if draft else Path(path)
    par = live_parallel(inner, world=tp_size, dp=dp, dp_attention=False)  # DP-attention is off in the plugin (§4)
    restore(model, src, rank=rank, device=device, parallel=par, profile=PROFILE)
    neutralise_mla_hooks(model)
    return {"model." + n for n, _ in inner.named_parameters(remove_duplicate=False)}


def register() -> None:
    """The `vllm.general_plugins` entry point: register the loader class in this (worker) process."""
    from vllm.model_executor.model_loader import register_model_loader  # type: ignore[import-not-found]
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # type: ignore[import-not-found]

    @register_model_loader(LOAD_FORMAT)
    class AtomConvertedLoader(BaseModelLoader):  # type: ignore[misc, valid-type]
        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            prepare_pool()  # pinned while vLLM builds the model (transfer.prepare_pool)

        def download_model(self, model_config: Any) -> None:
            return None  # the converted directory is the model path

        def load_weights(self, model: nn.Module, model_config: Any) -> set[str]:
            from vllm.distributed import (  # type: ignore[import-not-found]
                get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)

            dp = 1
            try:
                from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found]

                cur = get_current_vllm_config_or_none()
                dp = int(getattr(getattr(cur, "parallel_config", None), "data_parallel_size", 1) or 1)
            except ImportError:
                pass
            return load_weights(model, str(model_config.model), rank=get_tensor_model_parallel_rank(),
                                tp_size=get_tensor_model_parallel_world_size(),
                                device=target_device(self.load_config, model), dp=dp,
                                draft=is_mtp_draft(model, model_config))
