"""Patches that let vLLM 0.27.1 + ATOM's plugin build on this CPU machine. Each one is reported through `note`.
Nothing of ATOM, vLLM or the project is edited on disk."""
import types


def apply(note):
    import vllm.platforms as P
    from vllm.platforms.cpu import CpuPlatform
    P._current_platform = CpuPlatform()
    note("vllm.platforms._current_platform = CpuPlatform() (ATOM's platform plugin ATOMPlatform subclasses "
         "RocmPlatform; no ROCm here, and the platform plugin entry point is not installed)")
    import vllm.utils.flashinfer as FI
    for fn in ("has_flashinfer", "has_flashinfer_comm", "has_flashinfer_nvlink_two_sided",
               "has_flashinfer_nvlink_one_sided", "has_flashinfer_all2all"):
        if hasattr(FI, fn):
            setattr(FI, fn, lambda *a, **k: False)
    note("vllm.utils.flashinfer.has_flashinfer* -> False (the installed flashinfer is a CUDA build whose import calls "
         "torch.cuda.get_device_properties; vLLM's CPU communicator for an EP group (DP+EP) imports all2all, which "
         "probes it)")
    import vllm.model_executor.models.registry as R
    R._run_in_subprocess = lambda fn: fn()
    note("vllm registry._run_in_subprocess -> in-process (vLLM inspects a model class in a fresh interpreter only to "
         "keep CUDA uninitialised; that interpreter would not have the aiter shim, so ATOM's wrapper cannot import there)")


def load_draft_like_vllm(vc, meta, get_model, set_current_vllm_config):
    """SpecDecodeBaseProposer._get_model (vllm/v1/spec_decode/llm_base_proposer.py:1314-1328), called unbound on a
    stand-in holding what it reads (vllm_config, speculative_config): EagleProposer's own __init__ needs a runner."""
    from vllm.compilation.backends import set_model_tag
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    stand = types.SimpleNamespace(vllm_config=vc, speculative_config=vc.speculative_config)
    draft_vc = SpecDecodeBaseProposer._create_draft_vllm_config(stand)
    meta["draft_load_config"] = repr(vc.speculative_config.draft_load_config)
    meta["draft_model_config_model"] = vc.speculative_config.draft_model_config.model
    meta["draft_arch"] = vc.speculative_config.draft_model_config.architectures
    with set_current_vllm_config(draft_vc):
        with set_model_tag("eagle_head"):
            return get_model(vllm_config=draft_vc, model_config=vc.speculative_config.draft_model_config,
                             load_config=vc.speculative_config.draft_load_config)


def count_pwal_calls():
    """Observation only: wrap every `process_weights_after_loading` that an ATOM class defines (module hooks and ATOM
    quant methods), counting calls per class; behaviour unchanged. Returns the counter dict."""
    import functools
    import importlib
    import inspect
    import sys
    for m in ("atom.models.deepseek_v2", "atom.models.deepseek_mtp", "atom.model_ops.moe", "atom.model_ops.linear",
              "atom.model_ops.attention_mla", "atom.plugin.vllm.attention.layer_mla"):
        importlib.import_module(m)
    calls = {}
    seen = set()
    for name, mod in list(sys.modules.items()):
        if not (name == "atom" or name.startswith("atom.")) or mod is None:
            continue
        for cname, cls in list(vars(mod).items()):
            if not inspect.isclass(cls) or id(cls) in seen or not cls.__module__.startswith("atom"):
                continue
            seen.add(id(cls))
            f = cls.__dict__.get("process_weights_after_loading")
            if f is None or not callable(f) or getattr(f, "_counted", False):
                continue
            key = f"{cls.__module__}.{cls.__qualname__}"

            def make(f=f, key=key):
                @functools.wraps(f)
                def w(*a, **k):
                    calls[key] = calls.get(key, 0) + 1
                    return f(*a, **k)
                w._counted = True
                return w
            setattr(cls, "process_weights_after_loading", make())
    return calls


def share_like_vllm(draft, target, vc):
    """SpecDecodeBaseProposer.load_model's sharing after _get_model (llm_base_proposer.py:1405-1406):
    _maybe_share_embeddings and _maybe_share_lm_head, called unbound on a stand-in whose .model is the draft."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    stand = types.SimpleNamespace(model=draft, vllm_config=vc, speculative_config=vc.speculative_config,
                                  use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(stand, target)
    SpecDecodeBaseProposer._maybe_share_lm_head(stand, target)
