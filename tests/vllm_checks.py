"""The vLLM loader against real vLLM (run by tests/test_vllm.py in the vLLM venv that `scripts/setup.sh --test`
makes: vLLM pins its own torch and packages, so it lives beside the suite's venv, not in it).

usage: python tests/vllm_checks.py CONVERTED_WITH_MTP CONVERTED_WITHOUT_MTP [SPARSE_CONVERTED ...]

SPARSE_CONVERTED: DeepSeek-V3.2 / GLM-5 conversions (--profile vllm-plugin, fp8, tp 1, gfx950, with MTP). For
each, vLLM's own config of the directory is checked for what ATOM's plugin model reads from it, and the
target and the MTP draft are loaded into the plugin trees with the sparse-attention indexer added as ATOM's
plugin builds it (`add_indexers`, written from ATOM's code, not from a manifest).

Each check prints `PASS name` or `FAIL name: why`; the last line is `N passed, M failed`. What runs is vLLM's
own: the `vllm.general_plugins` registration through `register_model_loader`, `get_model_loader(LoadConfig)`,
`ModelConfig`/`VllmConfig`/`DeviceConfig`, the tensor-parallel groups (gloo, one process), and the draft's
config as `SpeculativeConfig` derives it for method "mtp" (the target's directory and load config:
speculative.py `draft_load_config` None -> the target's). The model trees are the suite's ATOM-shaped trees
(tests/atom_trees.py) wrapped as ATOM's plugin wrapper holds them (`model.model`), built without allocation.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS: list[tuple[str, str | None]] = []


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS.append((name, None))
        except Exception as e:  # noqa: BLE001 - the report is the product
            RESULTS.append((name, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        return fn
    return deco


def add_indexers(T, inner: nn.Module, cfg: dict, *, mtp: bool, fp8: torch.dtype) -> int:
    """ATOM's Indexer on every layer that builds one (atom/models/deepseek_v2.py 2149-2222 and 2603-2629 at
    ffdf3bb5d; the same classes in vLLM plugin mode, atom/plugin/vllm/model_wrapper.py 146-150): `wq_b` with
    the attention's fp8 per_1x128 spec, the fused bf16 `wk_weights_proj` [Dh + Ih, H] with its fp32
    `weight_scale` [ceil(Dh/128), ceil(H/128)], `k_norm` fp32 weight and bias, `k_cache` without
    parameters; none on an IndexShare "shared" layer (`_indexer_weights_shared`, 402-409), always on the MTP
    block. The plugin's MLA layer keeps no `indexer` alias (layer_mla.py 165-320). Returns how many."""
    t = T.Tree(meta=False)
    H, Q, Ih, Dh = cfg["hidden_size"], cfg["q_lora_rank"], cfg["index_n_heads"], cfg["index_head_dim"]
    n, types = cfg["num_hidden_layers"], cfg.get("indexer_types")
    if mtp:
        layers = [(n, inner.model.layers.get_submodule(str(n)).mtp_block)]
    else:
        layers = [(i, inner.model.layers[i]) for i in range(n) if types is None or types[i] != "shared"]
    for _, layer in layers:
        idx = T.Node()
        idx.wq_b = t.linear(Ih * Dh, Q, "fp8", fp8)
        idx.wk_weights_proj = T.Node()
        t.param(idx.wk_weights_proj, "weight", (Dh + Ih, H), T.BF16)
        t.param(idx.wk_weights_proj, "weight_scale", (T.cdiv(Dh, 128), T.cdiv(H, 128)), T.F32)
        idx.k_norm = T.Node()
        t.param(idx.k_norm, "weight", (Dh,), T.F32)
        t.param(idx.k_norm, "bias", (Dh,), T.F32)
        idx.k_cache = T.Node()
        layer.self_attn.indexer = idx
    return len(layers)


def main(with_mtp: Path, without_mtp: Path, sparse: list[Path]) -> int:
    import vllm
    from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import atom_trees as T
    from atom_convert.errors import BadInputError
    from atom_convert.store.reader import ConvertedCheckpoint
    from atom_convert.runtime import vllm_plugin
    from atom_convert.runtime.common import meta_parameters

    print(f"vllm {vllm.__version__}, torch {torch.__version__}")
    vllm_plugin.register()

    def model_config(d: Path) -> ModelConfig:
        return ModelConfig(model=str(d), tokenizer=str(d), skip_tokenizer_init=True, dtype="bfloat16",
                           enforce_eager=True)

    class Wrapper(nn.Module):  # ATOM's plugin wrapper: the ATOM model as `model` (plugin spec §1.1)
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.model = inner

    def plugin_tree(cfg: dict, mtp: bool) -> Wrapper:
        with meta_parameters():
            inner = (T.build_mtp if mtp else T.build)(cfg, tp=1, fmt="fp8", target="gfx950", meta=False)
            if "index_topk" in cfg:
                assert add_indexers(T, inner, cfg, mtp=mtp, fp8=T.FP8["gfx950"])
        for _, m in list(inner.named_modules()):
            attn = getattr(m, "mla_attn", None)
            if attn is not None and hasattr(attn, "impl"):
                del attn.impl  # HEAD plugin: W_* on mla_attn itself (plugin spec §1.2)
        return Wrapper(inner)

    cfg = json.loads((with_mtp / "config.json").read_text())
    mc = model_config(with_mtp)
    lc = LoadConfig(load_format=vllm_plugin.LOAD_FORMAT)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=mc,
                             target_parallel_config=ParallelConfig())
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=lc, speculative_config=spec)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:29517", backend="gloo")
        initialize_model_parallel(1, 1)

    @check("registered through vLLM's registry")
    def _():
        loader = get_model_loader(lc)
        assert isinstance(loader, BaseModelLoader) and type(loader).__name__ == "AtomConvertedLoader", type(loader)

    @check("target loads, device from vLLM's device config")
    def _():
        loader = get_model_loader(lc)
        model = plugin_tree(cfg, mtp=False)
        with set_current_vllm_config(vc):
            assert vllm_plugin.target_device(loader.load_config, model) == torch.device("cpu")
            names = loader.load_weights(model, mc)
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert names == {"model." + n for n, _ in model.model.named_parameters(remove_duplicate=False)}
        with ConvertedCheckpoint(with_mtp, 0) as ck:
            n = "model.model.layers.1.mlp.experts.w13_weight"
            assert torch.equal(model.get_parameter(n).view(torch.uint8), ck.get(n).view(torch.uint8))

    @check("device from LoadConfig.device when set")
    def _():
        loader = get_model_loader(LoadConfig(load_format=vllm_plugin.LOAD_FORMAT, device="cpu"))
        assert vllm_plugin.target_device(loader.load_config, nn.Linear(1, 1, device="meta")) == torch.device("cpu")

    @check("the MTP draft gets the target's load format and directory, and loads DST/mtp")
    def _():
        draft_lc = spec.draft_load_config or vc.load_config  # vLLM's fallback (model_loader/__init__.py)
        assert draft_lc.load_format == vllm_plugin.LOAD_FORMAT, draft_lc.load_format
        dmc = spec.draft_model_config
        assert Path(dmc.model) == with_mtp, dmc.model
        assert "DeepSeekMTPModel" in dmc.hf_config.architectures, dmc.hf_config.architectures
        loader = get_model_loader(draft_lc)
        draft = plugin_tree(cfg, mtp=True)
        with set_current_vllm_config(vc):
            names = loader.load_weights(draft, dmc)
        assert all(p.device.type == "cpu" for p in draft.parameters())
        with ConvertedCheckpoint(with_mtp / "mtp", 0) as ck:
            for n in ck.manifest["tensors"]:
                t = draft.get_parameter(n) if not n.rsplit(".", 1)[1].startswith("W_") else getattr(
                    draft.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1])
                assert torch.equal(t.reshape(-1).view(torch.uint8), ck.get(n).reshape(-1).view(torch.uint8)), n
        assert names and all(n.startswith("model.") for n in names)

    @check("a draft over files without an MTP set is refused, saying what to do")
    def _():
        nmc = model_config(without_mtp)
        nspec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=nmc,
                                  target_parallel_config=ParallelConfig())
        loader = get_model_loader(lc)
        ncfg = json.loads((without_mtp / "config.json").read_text())
        draft = plugin_tree(dict(ncfg, num_hidden_layers=ncfg["num_hidden_layers"]), mtp=True)
        try:
            with set_current_vllm_config(vc):
                loader.load_weights(draft, nspec.draft_model_config)
        except BadInputError as e:
            assert "no converted MTP drafter" in str(e) and "speculative" in str(e), e
        else:
            raise AssertionError("not refused")

    def same_bytes(model: nn.Module, d: Path) -> int:
        with ConvertedCheckpoint(d, 0) as ck:
            for n in ck.manifest["tensors"]:
                mod, _, attr = n.rpartition(".")
                t = getattr(model.get_submodule(mod), attr) if attr.startswith("W_") else model.get_parameter(n)
                assert torch.equal(t.reshape(-1).view(torch.uint8), ck.get(n).reshape(-1).view(torch.uint8)), n
            return len(ck.manifest["tensors"])

    for d in sparse:
        scfg = json.loads((d / "config.json").read_text())
        arch = scfg["architectures"][0]
        smc = model_config(d)
        with ConvertedCheckpoint(d, 0) as ck:
            indexer_layers = ck.manifest["model"]["indexer_layers"]
            assert ck.manifest["layout"]["profile"] == "vllm-plugin", d

        @check(f"{arch}: vLLM's config holds what ATOM's plugin model reads")
        def _():
            # the plugin builds ATOM's model from vLLM's hf_config (model_wrapper.py 404-442), not ATOM's own
            hf = smc.hf_config
            assert hf.model_type == scfg["model_type"] and hf.architectures == [arch], (hf.model_type, hf.architectures)
            for k in ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank", "qk_rope_head_dim",
                      "num_nextn_predict_layers"):
                assert getattr(hf, k) == scfg[k], k
            assert not getattr(hf, "tie_word_embeddings", False)
            types = getattr(hf, "indexer_types", None)  # transformers' GlmMoeDsaConfig fills it when absent
            n = scfg["num_hidden_layers"]
            main_layers = list(range(n)) if types is None else [i for i in range(n) if types[i] != "shared"]
            assert main_layers + [n] == indexer_layers, (types, indexer_layers)

        @check(f"{arch}: target loads into the plugin tree, every tensor the converted bytes")
        def _():
            loader = get_model_loader(lc)
            model = plugin_tree(scfg, mtp=False)
            with set_current_vllm_config(vc):
                names = loader.load_weights(model, smc)
            assert names == {"model." + n for n, _ in model.model.named_parameters(remove_duplicate=False)}
            assert any(".self_attn.indexer.wk_weights_proj.weight" in n for n in names)
            assert same_bytes(model, d)

        @check(f"{arch}: the MTP draft (vLLM's DeepSeekMTPModel) loads DST/mtp, indexer included")
        def _():
            sspec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=smc,
                                      target_parallel_config=ParallelConfig())
            dmc = sspec.draft_model_config
            assert dmc.hf_config.architectures == ["DeepSeekMTPModel"], dmc.hf_config.architectures
            assert dmc.hf_config.model_type == "deepseek_mtp" and Path(dmc.model) == d
            loader = get_model_loader(sspec.draft_load_config or vc.load_config)
            draft = plugin_tree(scfg, mtp=True)
            with set_current_vllm_config(vc):
                names = loader.load_weights(draft, dmc)
            assert any(".mtp_block.self_attn.indexer.wq_b.weight" in n for n in names)
            assert same_bytes(draft, d / "mtp")

    failed = [(n, why) for n, why in RESULTS if why]
    for n, why in RESULTS:
        print(f"PASS {n}" if not why else f"FAIL {n}: {why}")
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]]))
