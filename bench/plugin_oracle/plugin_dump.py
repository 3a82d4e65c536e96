"""ATOM's vLLM-plugin model built the way vLLM 0.27.1 builds it, on a CPU, and loaded either by ATOM's own wrapper
(load_format "auto" -> ATOMModelBase.load_weights -> load_model_in_plugin_mode, i.e. ATOM's loader + PWAL on SRC) or
by the project's loader (load_format "atom_converted" on DST, through vLLM's get_model_loader registry). Dumps what
the ATOM model holds in oracle_dump.py's format (tensors.safetensors, meta.json, state.json) so that
the oracle's compare_runtime.py (../shared/atom-oracle) can compare the two.

usage: plugin_dump.py --mode atom|project --model DIR --gfx gfx950 --out DIR [--tp N --rank R] [--ep] [--mtp]
       (tp > 1: run with --tp N --rank R in N processes at once: vLLM's gloo world of N CPU processes)
"""
import argparse
import json
import logging
import os
import sys
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE = os.environ.get("ORACLE", os.path.join(os.path.dirname(_REPO), "shared", "atom-oracle"))
_WORK = os.environ.get("ORACLE_WORK", "/tmp/atom-oracle")  # the oracle's ATOM/aiter export (its README)
ATOM_SRC = os.path.join(_WORK, "atom-src")
AITER_SRC = os.path.join(_WORK, "aiter-src")
PATCHES = []  # every patch this harness applies, with its reason (written to meta.json)


def note(p):
    PATCHES.append(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["atom", "project"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gfx", default="gfx950", choices=["gfx942", "gfx950"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--dp", type=int, default=1, help="vLLM data_parallel_size (with --ep: ATOM's DP+EP path)")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--env", action="append", default=[], help="K=V set before ATOM is imported")
    ap.add_argument("--load-device", default="cpu", help="LoadConfig.device ('none': vLLM's default None)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    meta = {"args": vars(a), "stage": "start", "checks": {}}
    for kv in a.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, ORACLE)
    sys.path.insert(0, ATOM_SRC)
    import aiter_shim
    aiter_shim.install(AITER_SRC, a.gfx, tp=a.tp, rank=a.rank, dp=a.dp, dp_rank=a.dp_rank)
    import cpu_patches
    meta["torch_patches"] = cpu_patches.apply()
    try:
        with cpu_patches.CudaToCpu():
            tensors, info, st = run(a, meta)
    except Exception as e:  # noqa: BLE001
        meta["error"] = f"{type(e).__name__}: {e}"
        meta["traceback"] = traceback.format_exc()
        meta["shim"] = aiter_shim.report()
        meta["patches"] = PATCHES
        json.dump(meta, open(os.path.join(a.out, "meta.json"), "w"), indent=1, default=str)
        print(meta["traceback"], file=sys.stderr)
        print(f"plugin-dump[{a.mode}]: FAILED at stage {meta['stage']}: {meta['error']}")
        return 2
    from safetensors.torch import save_file
    json.dump(st, open(os.path.join(a.out, "state.json"), "w"), indent=0, default=str)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(a.out, "tensors.safetensors"))
    meta["tensors"] = info
    meta["shim"] = aiter_shim.report()
    meta["patches"] = PATCHES
    meta["stage"] = "done"
    json.dump(meta, open(os.path.join(a.out, "meta.json"), "w"), indent=1, default=str)
    print(f"plugin-dump[{a.mode}]: {len(tensors)} tensors -> {a.out}")
    return 0


def run(a, meta):
    import torch

    import vllm_cpu_patches
    vllm_cpu_patches.apply(note)

    meta["stage"] = "ATOM register_model (the vllm.general_plugins hook)"
    from atom.plugin.vllm.register import register_model
    register_model()
    pwal_calls = vllm_cpu_patches.count_pwal_calls()
    if a.mode == "project":
        meta["stage"] = "atom_convert register()"
        from atom_convert.runtime.vllm_plugin import register
        register()

    meta["stage"] = "VllmConfig"
    from vllm.config import (CompilationConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    fmt = "atom_converted" if a.mode == "project" else "auto"
    mc = ModelConfig(model=a.model, tokenizer=a.model, skip_tokenizer_init=True, enforce_eager=True,
                     max_model_len=256, trust_remote_code=False)
    dpkw = {} if a.dp == 1 else dict(data_parallel_size=a.dp, data_parallel_rank=a.dp_rank,
                                     data_parallel_master_ip="127.0.0.1", data_parallel_master_port=a.port + 50)
    pc = ParallelConfig(tensor_parallel_size=a.tp, enable_expert_parallel=a.ep, rank=a.rank, **dpkw,
                        distributed_executor_backend="mp" if a.tp > 1 else None)
    lc = LoadConfig(load_format=fmt, device=None if a.load_device == "none" else a.load_device)
    spec = None
    if a.mtp:
        from vllm.config import SpeculativeConfig
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=mc,
                                 target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=lc, parallel_config=pc,
                    compilation_config=CompilationConfig(), speculative_config=spec)
    if a.dp > 1:  # what vLLM's engine does for its DP workers: one agreed port list (here: fixed ports)
        vc.parallel_config._data_parallel_master_port_list = [a.port + 60 + i for i in range(5)]
        vc.parallel_config.data_parallel_master_port = a.port + 50
        note("DP>1: ParallelConfig's DP master ports fixed (vLLM's engine picks them once and hands them to every DP "
             "worker; each of these standalone processes would otherwise pick its own)")
    meta["vllm_dtype"] = str(mc.dtype)
    meta["vllm_quantization"] = mc.quantization

    meta["stage"] = "vLLM distributed (gloo)"
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=a.tp, rank=a.rank, local_rank=a.rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{a.port}", backend="gloo")
        initialize_model_parallel(a.tp, 1)

    meta["stage"] = "get_model_loader + load_model (target)"
    from vllm.model_executor.model_loader import get_model_loader
    loader = get_model_loader(vc.load_config)
    meta["loader"] = type(loader).__module__ + "." + type(loader).__qualname__
    t0 = time.time()
    with set_current_vllm_config(vc):
        model = loader.load_model(vllm_config=vc, model_config=mc)
    meta["seconds_main"] = round(time.time() - t0, 2)
    meta["pwal_calls_main"] = dict(pwal_calls)
    meta["wrapper"] = type(model).__module__ + "." + type(model).__qualname__
    inner = model.model
    meta["atom_model"] = type(inner).__module__ + "." + type(inner).__qualname__

    import inventory
    import oracle_dump
    tensors, info = oracle_dump.collect(inner)
    st = {"main": inventory.state(inner)}
    meta["checks"]["direct"] = {"ok": True}
    meta["checks"]["main"] = model_checks(inner)
    if a.mtp:
        meta["stage"] = "draft: vLLM's draft construction + load (same load format)"
        draft = load_draft(a, vc, meta)
        meta["pwal_calls_with_draft"] = dict(pwal_calls)
        # the draft as its loader left it, before vLLM's proposer shares the target's embedding / lm_head into it
        t0_, i0_ = oracle_dump.collect(draft.model, prefix_kind="predraft-")
        tensors.update(t0_)
        info.update({k: v for k, v in i0_.items() if not k.startswith("predraft-buffer:")})  # buffers: 'mtp-' rows
        vllm_cpu_patches.share_like_vllm(draft, model, vc)
        dinner = draft.model
        meta["mtp_shares"] = meta["checks"]["mtp_shares"] = oracle_dump.shares_with_target(dinner, inner)
        meta["checks"]["drafter_load_model"] = {"ok": True}
        meta["draft_wrapper"] = type(draft).__qualname__
        meta["draft_atom_model"] = type(dinner).__qualname__
        t2, i2 = oracle_dump.collect(dinner, prefix_kind="mtp-")
        tensors.update(t2)
        info.update(i2)
        st["mtp"] = inventory.state(dinner)
        meta["checks"]["mtp"] = model_checks(dinner)
    return tensors, info, st


def load_draft(a, vc, meta):
    """vLLM's drafter load (v1/spec_decode/llm_base_proposer.py load_model): a VllmConfig copy whose model_config is
    the draft's, built with get_model(vllm_config=..., model_config=draft_model_config, load_config=draft_load_config
    or the target's), under compilation model_tag 'draft_model' style naming."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    import vllm_cpu_patches
    return vllm_cpu_patches.load_draft_like_vllm(vc, meta, get_model, set_current_vllm_config)


def model_checks(model):
    import runtime_dump
    return runtime_dump.model_checks(model, "")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
