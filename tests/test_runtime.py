"""The ATOM-native runner and the vLLM-plugin loader, tested up to the boundary of ATOM and vLLM
(neither runs here): the model classes are the spec-derived trees of tests/atom_trees.py, with
stand-in fused-MoE quant methods that count `init_prepare_finalize`, and stand-in `atom`/`vllm`
modules where the integration imports them (atom-loading.md §4, §5, §7, §9.2, §10)."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import atom_trees as T
from atom_convert.serve.load import LoadMismatchError, ManifestMismatchError
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


def _placement(rank: int, world: int, dp_attention: bool = False) -> atom_native.Placement:
    return atom_native.Placement(rank=rank, world=world, dp=world if dp_attention else 1, dp_attention=dp_attention)


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
    model = atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx942"), cfg, path=str(d),
                                          placement=_placement(rank=1, world=2), device=torch.device("cpu"))
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
        atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx950"), cfg, path=str(d),
                                      placement=_placement(rank=0, world=2), device=torch.device("cpu"))
    monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERT", "0")
    with pytest.raises(ManifestMismatchError, match="flag ATOM_FUSE_SHARED_EXPERT: the manifest says 1, declared 0"):
        atom_native.build_and_restore(_model_class(cfg, 2, "fp8", "gfx942"), cfg, path=str(d),
                                      placement=_placement(rank=0, world=2), device=torch.device("cpu"))


def test_native_drafter_loader_replaces_load_model(converted, monkeypatch):
    """§10 item 14: the drafter module's load_model is replaced; the drafter's own sharing code, which
    runs after load_model returns, is untouched."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    drafter_mod = types.ModuleType("atom.spec_decode.drafter")
    drafter_mod.load_model = lambda *a, **k: pytest.fail("ATOM's load_model (with PWAL) was called")
    monkeypatch.setitem(sys.modules, "atom.spec_decode.drafter", drafter_mod)
    assert atom_native.install_drafter_loader(str(d), _placement(rank=0, world=2))
    with meta_parameters():
        drafter = _model_class(cfg, 2, "fp8", "gfx950", mtp=True)(None)
    _MoEMethod.calls.clear()
    loaded = drafter_mod.load_model(drafter, str(d), cfg)
    # ATOM's drafter keeps load_model's return and tests names in it (atom/spec_decode/drafter.py 359, 376)
    assert isinstance(loaded, set) and f"model.layers.{cfg['num_hidden_layers']}.shared_head.head.weight" in loaded
    every = {n for n, _ in drafter.named_parameters(remove_duplicate=False)}
    assert loaded == {n for n in every if ".mla_attn.impl." not in n}  # the impl's names are the same objects
    n = cfg["num_hidden_layers"]
    blk = drafter.model.layers.get_submodule(str(n)).mtp_block
    assert blk.self_attn.mla_attn.impl.W_V.dtype == torch.float8_e4m3fn and len(_MoEMethod.calls) == 1
    assert all(p.device.type != "meta" for p in drafter.parameters())


def test_native_drafter_refused_without_mtp(converted):
    d = converted("tiny-kimi-k2", "bf16", "gfx950")
    loader = atom_native.converted_drafter_loader(str(d), _placement(rank=0, world=1))
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


# --------------------------------------------------------------------------------------------------
# What ATOM's real module tree has that the spec-derived trees lacked (issue: the runner, load_into and
# the vLLM loader against ATOM's real tree; checked against ATOM's own classes with
# ../shared/atom-oracle/runtime.sh, results in VERIFICATION.md)
# --------------------------------------------------------------------------------------------------


def test_mla_impl_children_are_one_slot_and_an_unfilled_one_is_missing(converted):
    """ATOM's MLA impl re-registers q/o/kv_b_proj (attention_mla.py 427-429): the loader fills them once;
    a Parameter nothing fills is still reported, under the impl's name too."""
    d = converted("tiny-deepseek-v3", "fp8", "gfx950")
    cfg = json.loads((d / "config.json").read_text())
    with meta_parameters():
        model = _with_moe_methods(T.build(cfg, fmt="fp8", target="gfx950", meta=False))
    atom_native.build_and_restore(lambda c: model, cfg, path=str(d), placement=_placement(0, 1), device=torch.device("cpu"))
    a = model.model.layers[0].self_attn
    assert a.mla_attn.impl.kv_b_proj.weight is a.kv_b_proj.weight and a.kv_b_proj.weight.device.type == "cpu"
    with meta_parameters():
        model2 = _with_moe_methods(T.build(cfg, fmt="fp8", target="gfx950", meta=False))
    model2.model.layers[0].self_attn.o_proj.register_parameter("extra", nn.Parameter(torch.zeros(2)))
    with pytest.raises(LoadMismatchError) as e:
        atom_native.build_and_restore(lambda c: model2, cfg, path=str(d), placement=_placement(0, 1),
                                      device=torch.device("cpu"))
    msg = str(e.value)
    assert "missing: live Parameter model.layers.0.self_attn.o_proj.extra" in msg
    assert "missing: live Parameter model.layers.0.self_attn.mla_attn.impl.o_proj.extra" in msg
    assert msg.count("problem") == 1 and "(2 problem(s))" in msg


def _atom_registered_mxfp4(model: nn.Module) -> int:
    """Give every e8m0 scale the shape ATOM registers before its post-load step, from the weights'
    own shapes: a per_1x32 linear [N, K/32] (atom/model_ops/linear.py; the e8m0_shuffle pads it later,
    875-878), a fused MoE [E, rows, K/32] (Mxfp4MoEMethod.create_weights, moe.py 1110-1118, flattened
    by moe_shuffle_scale, 1305-1323)."""
    n = 0
    for _, m in model.named_modules():
        for w, s in (("weight", "weight_scale"), ("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale")):
            wp, sp = m._parameters.get(w), m._parameters.get(s)
            if wp is None or sp is None or sp.dtype != torch.uint8:
                continue
            shape = (*wp.shape[:-1], wp.shape[-1] * 2 // 32)
            m._parameters[s] = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False)
            n += 1
    return n


def test_mxfp4_scales_registered_pre_post_load_take_the_files_shape(quark_checkpoint, tmp_path):
    import atom_convert
    from atom_convert.serve.load import load_into, module_tree, rank_view

    d = tmp_path / "q"
    atom_convert.convert(quark_checkpoint("tiny-deepseek-v3", "template"), d, target="gfx950")
    view = rank_view(d, 0)
    model = module_tree(view)
    assert _atom_registered_mxfp4(model) > 0
    load_into(model, d, rank=0)
    for name, ref in view.tensors.items():
        if ref.layout.get("e8m0_shuffled"):
            mod, _, attr = name.rpartition(".")
            assert tuple(model.get_submodule(mod)._parameters[attr].shape) == ref.shape
    # a scale of any other shape is still refused
    model = module_tree(view)
    _atom_registered_mxfp4(model)
    name = next(n for n, r in view.tensors.items() if r.layout.get("experts"))
    mod, _, attr = name.rpartition(".")
    p = model.get_submodule(mod)._parameters[attr]
    model.get_submodule(mod)._parameters[attr] = nn.Parameter(
        torch.empty((p.shape[0], p.shape[1] + 1, p.shape[2]), dtype=torch.uint8, device="meta"), requires_grad=False)
    with pytest.raises(LoadMismatchError, match=rf"wrong shape or dtype: {re.escape(name)}"):
        load_into(model, d, rank=0)


@pytest.fixture
def fake_aiter(monkeypatch):
    """aiter as ATOM's process has it: `aiter.utility.dtypes.fp8` is the GPU's fp8 (e4m3fn on gfx950)."""
    def install(fp8: torch.dtype) -> None:
        aiter = types.ModuleType("aiter")
        util = types.ModuleType("aiter.utility")
        dt = types.ModuleType("aiter.utility.dtypes")
        dt.fp8 = fp8
        util.dtypes = dt
        aiter.utility = util
        for k, v in (("aiter", aiter), ("aiter.utility", util), ("aiter.utility.dtypes", dt)):
            monkeypatch.setitem(sys.modules, k, v)
    return install


def test_bf16_conversion_for_gfx942_refused_by_a_gfx950_runtime(converted, fake_aiter):
    """A bf16 model has no fp8 Parameter; the GPU's fp8 still decides W_K/W_V (attention_mla.py 665-669)."""
    d = converted("tiny-deepseek-v3", "bf16", "gfx942")
    cfg = json.loads((d / "config.json").read_text())
    fake_aiter(torch.float8_e4m3fn)
    with pytest.raises(ManifestMismatchError, match="target: the manifest says 'gfx942', declared 'gfx950'"):
        atom_native.build_and_restore(_model_class(cfg, 1, "bf16", "gfx950"), cfg, path=str(d),
                                      placement=_placement(0, 1), device=torch.device("cpu"))
    fake_aiter(torch.float8_e4m3fnuz)
    model = atom_native.build_and_restore(_model_class(cfg, 1, "bf16", "gfx942"), cfg, path=str(d),
                                          placement=_placement(0, 1), device=torch.device("cpu"))
    assert model.model.layers[0].self_attn.mla_attn.impl.W_K.dtype == torch.float8_e4m3fnuz


def test_mla_bmm_mxfp4_conversion_refused_by_a_default_atom(tiny_checkpoint, tmp_path, monkeypatch):
    """ATOM_USE_TRITON_MXFP4_BMM unset is ATOM's default 0 (atom/utils/envs.py 53-55), not the value the
    conversion recorded; ATOM holds the operands as uint8 (utils.py 191-194)."""
    import atom_convert

    d = tmp_path / "bmm"
    atom_convert.convert(tiny_checkpoint("tiny-deepseek-v3", "fp8"), d, target="gfx950", mla_bmm="mxfp4")
    cfg = json.loads((d / "config.json").read_text())
    monkeypatch.delenv("ATOM_USE_TRITON_MXFP4_BMM", raising=False)
    with pytest.raises(ManifestMismatchError, match="flag ATOM_USE_TRITON_MXFP4_BMM: the manifest says 1, declared 0"):
        atom_native.build_and_restore(_model_class(cfg, 1, "fp8", "gfx950"), cfg, path=str(d),
                                      placement=_placement(0, 1), device=torch.device("cpu"))
    # ATOM's own reader, where ATOM is loaded, decides (here: the flag on)
    envs = types.ModuleType("atom.utils.envs")
    envs.__getattr__ = lambda name: name == "ATOM_USE_TRITON_MXFP4_BMM" or (
        name in ("ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE", "ATOM_FUSE_SHARED_EXPERT"))
    for k in ("atom", "atom.utils"):
        monkeypatch.setitem(sys.modules, k, sys.modules.get(k) or types.ModuleType(k))
    monkeypatch.setitem(sys.modules, "atom.utils.envs", envs)
    monkeypatch.setattr(sys.modules["atom.utils"], "envs", envs, raising=False)
    model = atom_native.build_and_restore(_model_class(cfg, 1, "fp8", "gfx950"), cfg, path=str(d),
                                          placement=_placement(0, 1), device=torch.device("cpu"))
    wk = model.model.layers[0].self_attn.mla_attn.impl.W_K
    assert wk.dtype == torch.uint8 and model.model.layers[0].self_attn.mla_attn.impl.W_K_scale.dtype == torch.uint8


class _ParallelConfig:
    def __init__(self, dp: int = 1, dp_rank: int = 0):
        self.data_parallel_size, self.data_parallel_rank = dp, dp_rank


class _AtomConfig:
    """The fields of ATOM's Config the runner reads (atom/config.py): model, tensor_parallel_size,
    parallel_config.data_parallel_{size,rank}, enable_dp_attention, moe_backend."""

    def __init__(self, model: Path, tp: int, dp: int = 1, dp_rank: int = 0, dp_attention: bool = False):
        self.model, self.tensor_parallel_size = str(model), tp
        self.parallel_config = _ParallelConfig(dp, dp_rank)
        self.enable_dp_attention, self.moe_backend = dp_attention, "standard"


@pytest.fixture
def runner_cls(monkeypatch):
    """ConvertedModelRunner over a stand-in ATOM ModelRunner (ATOM itself does not import here)."""
    mods = {k: types.ModuleType(k) for k in ("atom", "atom.model_engine", "atom.model_engine.model_runner")}
    mods["atom.model_engine.model_runner"].ModelRunner = type("ModelRunner", (), {})
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    monkeypatch.delitem(atom_native.__dict__, "ConvertedModelRunner", raising=False)
    cls = atom_native.ConvertedModelRunner
    monkeypatch.delitem(atom_native.__dict__, "ConvertedModelRunner", raising=False)
    return cls


def _run(cls, config, rank, model_class):
    r = object.__new__(cls)
    r.config, r.rank = config, rank
    r._build_and_load_model(model_class)
    return r.model


def test_runner_dp_attention_engine_loads_its_engine_index_files(runner_cls, tiny_checkpoint, tmp_path):
    """Under DP-attention each engine has tensor_parallel_size 1 and runner rank 0 (engine_core_mgr.py
    152-162, 196-203); its files are those of parallel_config.data_parallel_rank."""
    import atom_convert
    from atom_convert.store.reader import ConvertedCheckpoint

    d = tmp_path / "dpa"
    atom_convert.convert(tiny_checkpoint("tiny-deepseek-v3", "fp8"), d, target="gfx950", tp=2, dp_attention=True)
    cfg = json.loads((d / "config.json").read_text())
    build = _model_class(cfg, 1, "fp8", "gfx950")
    model = _run(runner_cls, _AtomConfig(d, tp=1, dp=2, dp_rank=1, dp_attention=True), 0, _moe_tp_tree(build, 2))
    name = "model.layers.1.mlp.experts.w13_weight"
    with ConvertedCheckpoint(d, 1) as ck:
        assert torch.equal(model.get_parameter(name).view(torch.uint8), ck.get(name).view(torch.uint8))
    with ConvertedCheckpoint(d, 0) as ck:
        assert not torch.equal(model.get_parameter(name).view(torch.uint8), ck.get(name).view(torch.uint8))
    # the same files for an engine that is not under DP-attention: refused, naming the field
    with pytest.raises(ManifestMismatchError, match="dp_attention: the manifest says True, declared False"):
        _run(runner_cls, _AtomConfig(d, tp=2), 1, _moe_tp_tree(build, 2))


def _moe_tp_tree(build, moe_tp: int):
    """Under DP-attention attention is whole per engine but routed experts are split over every GPU
    (atom-parallel.md §2.1): the tree's expert shapes are those of MoE-TP `moe_tp`."""
    def make(config):
        model = build(config)
        for _, m in model.named_modules():
            for k in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
                p = m._parameters.get(k)
                if p is not None:
                    shape = list(p.shape)
                    ax = 1 if k.startswith("w13") else 2
                    shape[ax] = -(-shape[ax] // moe_tp) if "scale" in k else shape[ax] // moe_tp
                    m._parameters[k] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=False)
        return model
    return make


def test_runner_refuses_another_parallel_layout(runner_cls, converted):
    d = converted("tiny-deepseek-v3", "fp8", "gfx950", tp=2)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(ManifestMismatchError, match="tp: the manifest says 2, declared 4"):
        _run(runner_cls, _AtomConfig(d, tp=4), 0, _model_class(cfg, 2, "fp8", "gfx950"))

    def with_ep(config):
        model = _model_class(cfg, 2, "fp8", "gfx950")(config)
        for _, m in model.named_modules():
            if getattr(m, "moe_parallel_config", None) is not None:
                m.moe_parallel_config = T.MoEParallel(ep_size=2, use_ep=True)
        return model
    with pytest.raises(ManifestMismatchError, match="ep: the manifest says 1, declared 2"):
        _run(runner_cls, _AtomConfig(d, tp=2), 0, with_ep)


def test_vllm_data_parallel_refused_with_what_to_do(converted):
    """vLLM DP x EP unfuses the shared expert and numbers files by EP rank: no conversion writes it."""
    from atom_convert.errors import UnsupportedError

    d = converted("tiny-deepseek-v3", "bf16", "gfx950", tp=2)
    with pytest.raises(UnsupportedError, match="data_parallel_size 2.*tensor parallel only"):
        vllm_plugin.load_weights(_Wrapper(nn.Module()), str(d), rank=0, tp_size=1, device=torch.device("cpu"), dp=2)
