"""What both integrations do around `load_into` (atom-loading.md §4, §5, §10 items 1, 3, 11, 12)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import BadInputError
from ..serve.load import LoadStats, load_into, rank_view
from ..store.manifest import MANIFEST_NAME
from ..layout.arch.deepseek import ATOM_FLAG_DEFAULTS

FP8_TARGET = {torch.float8_e4m3fnuz: "gfx942", torch.float8_e4m3fn: "gfx950"}

# Plain module state that ATOM's own weight loaders leave on a module once its checkpoint tensors are in,
# and that its process_weights_after_loading or forward reads: a restore bypasses those loaders, so it
# sets the same values itself on every module of the class whose Parameters it filled.
# class name -> {attribute: its value after ATOM's complete load}.
LOADED_STATE: dict[str, dict[str, Any]] = {
    # The fused indexer wk_weights_proj (DeepSeek-V3.2, GLM-5): its weight_loader sets _wk_loaded when wk
    # is in (a bf16 one copied, an fp8 one dequantised with its scale; the pending copies cleared to None,
    # as they are at construction): atom/models/deepseek_v2.py 1993, 2012-2055 at ffdf3bb5d.
    "IndexerWkWeightsProjLinear": {"_wk_loaded": True},
}


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


def mark_loaded(model: nn.Module, filled: frozenset[str] | set[str]) -> int:
    """Set `LOADED_STATE` on every module of those classes with a Parameter among `filled` (live names,
    `LoadStats.names`). Returns how many modules were marked."""
    n = 0
    for name, module in model.named_modules():
        state = LOADED_STATE.get(type(module).__name__)
        if state and any((f"{name}.{p}" if name else p) in filled for p in module._parameters):
            for attr, value in state.items():
                setattr(module, attr, value)
            n += 1
    return n


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


def _runtime_fp8() -> torch.dtype | None:
    """The fp8 dtype of the GPU this process runs on, as ATOM decides it (aiter's `dtypes.fp8`, which
    ATOM gives W_K/W_V: atom/model_ops/attention_mla.py 665-669); None where aiter is not loaded (no
    ATOM in this process)."""
    if "aiter" not in sys.modules:
        return None
    try:
        from aiter.utility import dtypes  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - an aiter without the module: fall back to the parameters
        return None
    dt = getattr(dtypes, "fp8", None)
    return dt if isinstance(dt, torch.dtype) else None


def live_target(model: nn.Module) -> str | None:
    """The GPU target the live runtime is for (spec §3.0.1: e4m3fnuz gfx942, e4m3fn gfx950): from
    aiter's arch fp8 where ATOM runs (a bf16 model has no fp8 Parameter, but its W_K/W_V would be
    the arch's fp8), else from the fp8 dtype of the model's Parameters; None when neither tells.
    A model whose fp8 Parameters disagree with each other or with the arch is refused."""
    seen = {FP8_TARGET[p.dtype] for p in model.parameters() if p.dtype in FP8_TARGET}
    arch = _runtime_fp8()
    if arch is not None and arch in FP8_TARGET:
        seen.add(FP8_TARGET[arch])
    if len(seen) > 1:
        raise BadInputError(f"the live model mixes fp8 formats of {' and '.join(sorted(seen))} "
                            f"(aiter's arch fp8: {arch}); build it on one GPU target")
    return next(iter(seen), None)


def _atom_envs() -> Any:
    """ATOM's own flag reader (`atom.utils.envs`) where ATOM is loaded in this process, else None."""
    if "atom" not in sys.modules:
        return None
    try:
        import atom.utils.envs as envs  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001
        return None
    return envs


def live_flags(names: Any = None) -> dict[str, Any]:
    """The layout flags (`ATOM_*`, spec atom-layout.md §6) as this process has them: read through
    ATOM's own `atom.utils.envs` where ATOM is loaded, else from the environment with ATOM's
    defaults (atom/utils/envs.py at the layout's ATOM revision). An unset flag counts with ATOM's
    default, never with the value a conversion recorded. `names` (a manifest's flags, or their
    names) limits the result to those flags; None: every flag of the layout."""
    wanted = [k for k in (names if names is not None else ATOM_FLAG_DEFAULTS) if k.startswith("ATOM_")]
    envs = _atom_envs()
    out: dict[str, Any] = {}
    for k in wanted:
        if envs is not None:
            try:
                v = getattr(envs, k)
            except AttributeError:
                v = None
            if v is not None:
                out[k] = int(v) if isinstance(v, bool) else v
                continue
        if k in os.environ:
            out[k] = int(os.environ[k].strip().lower() == "1")  # ATOM's boolean flags: "1" is on
        elif k in ATOM_FLAG_DEFAULTS:
            out[k] = ATOM_FLAG_DEFAULTS[k]
    return out


def fused_moes(model: nn.Module) -> list[nn.Module]:
    """ATOM's fused MoE modules: those with a `moe_parallel_config` (atom/model_ops/moe.py)."""
    return [m for _, m in model.named_modules() if getattr(m, "moe_parallel_config", None) is not None]


def live_parallel(model: nn.Module, *, world: int, dp: int = 1, dp_attention: bool = False) -> dict[str, Any]:
    """The parallel layout the live model was built for (spec atom-loading.md §10 item 1,
    atom-parallel.md §5), read from its own objects: the world (GPUs of the deployment), dp and
    dp_attention from the runtime's config, and from its fused MoEs the expert-parallel size
    (`moe_parallel_config.ep_size` when `use_ep`) and the rank's `expert_map` (None without EP)."""
    par: dict[str, Any] = {"tp": int(world), "dp": int(dp), "dp_attention": bool(dp_attention)}
    moes = fused_moes(model)
    if moes:
        layouts = set()
        for m in moes:
            mpc = m.moe_parallel_config
            em = getattr(m, "expert_map", None)
            layouts.add((int(mpc.ep_size) if mpc.use_ep else 1,
                         None if em is None else tuple(int(x) for x in em.tolist())))
        if len(layouts) > 1:
            raise BadInputError(f"the live model's fused MoEs disagree on their expert layout ({len(layouts)} "
                                "different ep/expert_map pairs); build it with one parallel config")
        ep, em = layouts.pop()
        par["ep"] = ep
        par["expert_map"] = None if em is None else list(em)
    return par


def free_transients(device: torch.device) -> None:
    """§4 step 5: KV-cache sizing measures the free memory after loading."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def restore(model: nn.Module, path: str | os.PathLike[str], *, rank: int, device: torch.device,
            parallel: dict[str, Any], profile: str = "atom", moe_backend: str | None = None) -> tuple[LoadStats, int]:
    """Load one rank's converted tensors into a model built under `meta_parameters`, set the module
    state ATOM's own loaders would have left (`LOADED_STATE`), then finalize its fused MoEs; never
    runs any process_weights_after_loading (§10 item 10). `parallel`: the live
    layout (`live_parallel`), compared with the manifest's; the target and the layout flags are read
    from this process (`live_target`, `live_flags`); `moe_backend` from the runtime's config."""
    view = rank_view(path, rank)
    flags = live_flags(view.flags)
    if moe_backend is not None:
        flags["moe_backend"] = moe_backend
    stats = load_into(model, path, rank=rank, device=device, profile=profile, target=live_target(model),
                      flags=flags, parallel=parallel)
    mark_loaded(model, stats.names)
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
