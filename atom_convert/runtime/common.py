"""What both integrations do around `load_into` (atom-loading.md §4, §5, §10 items 1, 3, 11, 12)."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import BadInputError
from ..load import LoadStats, load_into, rank_view
from ..manifest import MANIFEST_NAME

FP8_TARGET = {torch.float8_e4m3fnuz: "gfx942", torch.float8_e4m3fn: "gfx950"}


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with every Parameter on meta and everything else real (§5): the ATOM
    `_init_weight_params_on_meta` pattern. `register_parameter` is patched so that a Parameter is
    replaced by a meta copy as it is registered; buffers (RoPE caches, expert maps) stay real.
    Never `with torch.device("meta")`, which would put buffers on meta too (§5)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def finalize_moe(model: nn.Module) -> int:
    """`quant_method.init_prepare_finalize(module)` exactly once per fused MoE, in `named_modules()`
    order, after every tensor is in place (§4 step 3, §10 item 11: it captures references to the
    expert scales, and a second call trips an assert under all2all). Returns how many were called."""
    done = 0
    for _, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        fn = getattr(qm, "init_prepare_finalize", None)
        if callable(fn):
            fn(module)
            done += 1
    return done


def live_target(model: nn.Module) -> str | None:
    """The GPU target the live model was built for, from the fp8 dtype its parameters have
    (e4m3fnuz: gfx942, e4m3fn: gfx950; spec §3.0.1); None for a model without fp8 parameters."""
    for p in model.parameters():
        if p.dtype in FP8_TARGET:
            return FP8_TARGET[p.dtype]
    return None


def live_flags(recorded: dict[str, Any]) -> dict[str, Any]:
    """The layout flags as this process has them: an `ATOM_*` flag set in the environment counts
    with its value, an unset one with the value the conversion assumed (ATOM's default, recorded in
    the manifest); config-level values (moe_backend, expert parallel) are compared separately."""
    out = dict(recorded)
    for k in recorded:
        if k.startswith("ATOM_") and k in os.environ:
            v = os.environ[k]
            out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def free_transients(device: torch.device) -> None:
    """§4 step 5: KV-cache sizing measures the free memory after loading."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def restore(model: nn.Module, path: str | os.PathLike[str], *, rank: int, device: torch.device, tp_size: int,
            profile: str = "atom", parallel: dict[str, Any] | None = None) -> tuple[LoadStats, int]:
    """Load one rank's converted tensors into a model built under `meta_parameters`, then finalize
    its fused MoEs; never runs any process_weights_after_loading (§10 item 10). `parallel`: further
    live layout values to compare (ep, dp, dp_attention, expert_map; atom-parallel.md §5)."""
    view = rank_view(path, rank)
    stats = load_into(model, path, rank=rank, device=device, profile=profile, target=live_target(model),
                      flags=live_flags(view.flags), parallel={"tp": tp_size, **(parallel or {})})
    n = finalize_moe(model)
    free_transients(device)
    return stats, n


def mtp_path(path: str | os.PathLike[str]) -> Path:
    """The converted drafter set, or a refusal that says how to get one (§10 item 14)."""
    p = Path(path)
    m = rank_view(p, 0).manifest.get("mtp") or {}
    if m.get("status") != "converted":
        raise BadInputError(f"{p / MANIFEST_NAME}: no converted MTP drafter (mtp status {m.get('status')!r}); "
                            "convert without --no-mtp from a checkpoint with its MTP layer, or serve without "
                            "speculative decoding")
    return p / m["path"]
