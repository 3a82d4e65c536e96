"""The ATOM-native runner and the vLLM-plugin loader, tested up to the boundary of ATOM and vLLM
(neither runs here): the model classes are the spec-derived trees of tests/atom_trees.py, with
stand-in fused-MoE quant methods that count `init_prepare_finalize`, and stand-in `atom`/`vllm`
modules where the integration imports them (atom-loading.md §4, §5, §7, §9.2, §10)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import atom_trees as T
from atom_convert.load import ManifestMismatchError
from atom_convert.runtime import atom_native, vllm_plugin
from atom_convert.runtime.common import meta_parameters


class _MoEMethod:
    """Stand-in FusedMoE quant method: counts init_prepare_finalize and checks it runs after the
    expert scales are final (it captures them, §3)."""

    calls: list[str] = []

    def init_prepare_finalize(self, layer: nn.Module) -> None:
        assert layer.w13_weight.device.type != "meta"
        _MoEMethod.calls.append(id(layer))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        T.PWALCounter.calls += 1


def _with_moe_methods(model: nn.Module) -> nn.Module:
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            m.quant_method = _MoEMethod()
    return model


class _Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(8.0))  # must stay real under the meta patch


def _model_class(cfg: dict, tp: int, fmt: str, target: str, mtp: bool = False):
    def build(config):
        tree = (T.build_mtp if mtp else T.build)(cfg, tp=tp, fmt=fmt, target=target, meta=False)
        tree.rope = _Buffers()
        return _with_moe_methods(tree)

    return build


def test_meta_patch_keeps_buffers_real():
    with meta_parameters():
        m = _Buffers()
        m.lin = nn.Linear(4, 4)
    assert m.lin.weight.device.type == "meta" and m.cos_sin_cache.device.type == "cpu"
    assert nn.Module.register_parameter is not None
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # patch removed


def test_native_build_and_restore(converted):
    d = converted("tiny-deepseek-v3", "fp8", "gfx942", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    _MoEMethod.calls.clear()
    T.PWALCounter.calls = 0
    model = atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx942"), cfg, path=str(d), rank=1, tp_size=2,
                                          device=torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in model.parameters())
    n_moe = sum(1 for n, _ in model.named_modules() if n.endswith("mlp.experts"))
    assert n_moe and sorted(_MoEMethod.calls) == sorted({*_MoEMethod.calls}) and len(_MoEMethod.calls) == n_moe
    assert T.PWALCounter.calls == 0
    assert model.model.layers[0].self_attn.kv_b_proj.weight.is_shuffled
    assert model.model.layers[0].self_attn.mla_attn.impl.W_K.dtype == torch.float8_e4m3fnuz


def test_native_refuses_other_runtime(converted, monkeypatch):
    d = converted("tiny-deepseek-v3", "fp8", "gfx942", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(ManifestMismatchError, match="target: the manifest says 'gfx942', declared 'gfx950'"):
        atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx950"), cfg, path=str(d), rank=0, tp_size=2,
                                      device=torch.device("cpu"))
    monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERT", "0")
    with pytest.raises(ManifestMismatchError, match="flag ATOM_FUSE_SHARED_EXPERT: the manifest says 1, declared 0"):
        atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx942"), cfg, path=str(d), rank=0, tp_size=2,
                                      device=torch.device("cpu"))


def test_native_drafter_loader_replaces_load_model(converted, monkeypatch):
    """§10 item 14: the drafter module's load_model is replaced; the drafter's own sharing code, which
    runs after load_model returns, is untouched."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    drafter_mod = types.ModuleType("atom.spec_decode.drafter")
    drafter_mod.load_model = lambda *a, **k: pytest.fail("ATOM's load_model (with PWAL) was called")
    monkeypatch.setitem(sys.modules, "atom.spec_decode.drafter", drafter_mod)
    assert atom_native.install_drafter_loader(str(d), 0, 2)
    with meta_parameters():
        drafter = _model_class(cfg, 2, "fp8", "gfx950", mtp=True)(None)
    _MoEMethod.calls.clear()
    drafter_mod.load_model(drafter, str(d), cfg)
    n = cfg["num_hidden_layers"]
    blk = drafter.model.layers.get_submodule(str(n)).mtp_block
    assert blk.self_attn.mla_attn.impl.W_V.dtype == torch.float8_e4m3fn and len(_MoEMethod.calls) == 1
    assert all(p.device.type != "meta" for p in drafter.parameters())


def test_native_drafter_refused_without_mtp(converted):
    d = converted("tiny-kimi-k2", "bf16", "gfx950")
    loader = atom_native.converted_drafter_loader(str(d), 0, 1)
    with pytest.raises(Exception, match="no converted MTP drafter"):
        loader(nn.Module())


def test_runner_default_installed_on_config():
    class Config:
        runner_qualname: str = atom_native.ATOM_DEFAULT_RUNNER

        def __post_init__(self):
            self.post_ran = True

    atom_native.make_default(Config)
    c = Config()
    c.__post_init__()
    assert c.runner_qualname == atom_native.RUNNER and c.post_ran
    c2 = Config()
    c2.runner_qualname = "my.Runner"
    c2.__post_init__()
    assert c2.runner_qualname == "my.Runner"


class _Wrapper(nn.Module):
    """ATOM's vLLM wrapper: the ATOM model as `self.model` (plugin spec §1.1); the MLA layer is its own
    impl at HEAD (§1.2), so W_* live on `…self_attn.mla_attn`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner


class _MLA(T.Node):
    pwal_calls = 0

    def process_weights_after_loading(self, *a) -> None:
        _MLA.pwal_calls += 1


def test_vllm_plugin_load_weights(converted):
    d = converted("tiny-deepseek-v3", "bf16", "gfx950", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    with meta_parameters():
        inner = _with_moe_methods(T.build(cfg, tp=2, fmt="bf16", meta=False))
    for layer in inner.model.layers:
        layer.self_attn.mla_attn = _MLA()  # HEAD plugin: no `impl` child
    wrapper = _Wrapper(inner)
    _MoEMethod.calls.clear()
    names = vllm_plugin.load_weights(wrapper, str(d), rank=1, tp_size=2, device=torch.device("cpu"))
    # §10 item 13: every parameter of the ATOM model under "model."
    assert names == {"model." + n for n, _ in inner.named_parameters(remove_duplicate=False)}
    assert all(n.startswith("model.model.") or n.startswith("model.lm_head") for n in names)
    mla = inner.model.layers[0].self_attn.mla_attn
    assert mla.W_K.shape[0] == cfg["num_attention_heads"] // 2
    # §10 item 10 in plugin mode: vLLM's loop 2 calls the hook; the instance attribute swallows it
    mla.process_weights_after_loading(torch.bfloat16)
    assert _MLA.pwal_calls == 0
    assert len(_MoEMethod.calls) == sum(1 for n, _ in inner.named_modules() if n.endswith("mlp.experts"))
    assert inner.model.layers[1].mlp.experts.w13_weight.is_shuffled


def test_vllm_plugin_entry_point_declared():
    import tomllib

    pp = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    eps = pp["project"]["entry-points"]["vllm.general_plugins"]
    assert eps["atom_convert"] == "atom_convert.runtime.vllm_plugin:register"
