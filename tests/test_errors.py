"""Bad input: every user-fixable problem exits with code 2 through the real entry
point (`atom_convert.cli.main`, which maps exceptions to exit codes), names the
file and tensor with the expected and the actual value, and leaves neither DST
nor a temporary directory behind. The same problems raise `BadInputError`
subclasses through the Python API. A failure while writing (not bad input)
also leaves nothing behind, and never destroys an existing DST.

The session fixtures are never mutated: every corruption works on a copy.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import atom_convert
import atom_convert.layout.postload as postload_mod
from atom_convert import BadInputError
from atom_convert.errors import CheckpointError, DestinationExistsError, Interrupted, UnsupportedError
from atom_convert.files.source import INDEX_NAME
from atom_convert.synth import build_tiny, load_preset
from atom_convert.engine.writer import ShardFile, ShardSetWriter

from cliutil import leftovers, run_cli
from oracles import b3_blocks, xx_blocks

PRESET = "tiny-deepseek-v3"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
# `atom_convert.convert` is the function (the package re-exports it); this is the module
convert_mod = importlib.import_module("atom_convert.engine.convert")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def copy_source(tiny_checkpoint: Callable[..., Path], tmp_path: Path, preset: str = PRESET, fmt: str = "fp8") -> Path:
    """A private, writable copy of a session source checkpoint."""
    dst = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(preset, fmt), dst)
    return dst


def read_index(src: Path) -> dict[str, Any]:
    return json.loads((src / INDEX_NAME).read_text())


def write_index(src: Path, index: dict[str, Any]) -> None:
    (src / INDEX_NAME).write_text(json.dumps(index, indent=2))


def file_of(src: Path, name: str) -> str:
    return read_index(src)["weight_map"][name]


def edit_shard(src: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None], *, update_index: bool = True) -> None:
    """Rewrite one shard after `edit` changed its tensor dict; optionally bring the index in line."""
    path = src / shard
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}
    before = set(tensors)
    edit(tensors)
    tmp = path.with_name(path.name + ".new")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    if update_index:
        index = read_index(src)
        wm = index["weight_map"]
        for gone in before - set(tensors):
            del wm[gone]
        for new in set(tensors) - before:
            wm[new] = shard
        write_index(src, index)


def edit_config(src: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


def assert_nothing_written(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was created by a failed conversion"
    assert leftovers(dst) == [], f"temporary directories left beside {dst}: {leftovers(dst)}"


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# The bad-input cases: each prepares a source and says what the error must contain.
# ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    src: Path
    error: type[BadInputError]
    expect: list[str]  # substrings of the message: file, tensor, expected value, actual value
    options: dict[str, Any] = field(default_factory=dict)  # API keywords (tp=...)

    def cli_args(self) -> list[str]:
        return [f"--tp={self.options['tp']}"] if "tp" in self.options else []


@pytest.fixture(scope="module")
def qlora192_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real fp8 DeepSeek-V3-shaped checkpoint whose q_lora_rank (192) is not a multiple of 128."""
    cfg = load_preset(PRESET)
    cfg["q_lora_rank"] = 192
    return build_tiny(cfg, tmp_path_factory.mktemp("qlora192") / "src", fmt="fp8", seed=3, shards=2)


def _missing_scale(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    edit_shard(src, file_of(src, name), lambda t: t.pop(name))
    # o_proj is [H, Nh*V] = [320, 256]: a [3, 2] grid of 128x128 blocks
    return Case(src, CheckpointError, [f"missing tensor {name}", "[3, 2]", "model.layers.1.self_attn.o_proj.weight"])


def _missing_weight(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    edit_shard(src, file_of(src, name), lambda t: t.pop(name))
    return Case(src, CheckpointError, [f"missing tensor {name}", "float8_e4m3fn", "[320, 256]"])


def _index_lists_absent_tensor(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.1.self_attn.kv_a_layernorm.weight"
    shard = file_of(src, name)
    edit_shard(src, shard, lambda t: t.pop(name), update_index=False)
    return Case(src, CheckpointError, [INDEX_NAME, name, shard, "does not contain it"])


def _unmapped_extra(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.1.mlp.foo.weight"

    def add(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.ones(4, 6, dtype=torch.bfloat16)

    edit_shard(src, SHARD1, add)
    return Case(src, CheckpointError, [SHARD1, f"unmapped tensor {name}", "bfloat16", "[4, 6]"])


def _wrong_shape(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = file_of(src, name)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(320, 384).to(torch.float8_e4m3fn)

    edit_shard(src, shard, reshape)
    return Case(src, CheckpointError, [shard, name, "[320, 384]", "expected [320, 256]"])


def _wrong_shape_norm(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.norm.weight"
    shard = file_of(src, name)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.ones(321, dtype=torch.bfloat16)

    edit_shard(src, shard, reshape)
    return Case(src, CheckpointError, [shard, name, "[321]", "expected [320]"])


def _scale_grid(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    shard = file_of(src, name)

    def regrid(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.ones(3, 3)

    edit_shard(src, shard, regrid)
    return Case(src, CheckpointError, [shard, name, "scale grid", "[3, 3]", "expected [3, 2]"])


def _wrong_dtype(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.2.self_attn.q_b_proj.weight"
    shard = file_of(src, name)

    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(torch.bfloat16)

    edit_shard(src, shard, to_bf16)
    return Case(src, CheckpointError, [shard, name, "bfloat16", "expected float8_e4m3fn"])


def _truncated(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    path = src / SHARD2
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    # safetensors data runs to the end of the file: the header promises `size` bytes
    return Case(src, CheckpointError, [SHARD2, "truncated", str(size), str(size - 100)])


def _missing_file(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    n = sum(1 for f in read_index(src)["weight_map"].values() if f == SHARD2)
    (src / SHARD2).unlink()
    return Case(src, CheckpointError, [INDEX_NAME, SHARD2, f"({n} tensors)", "does not exist"])


def _not_in_index(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    index = read_index(src)
    shard = index["weight_map"].pop(name)
    write_index(src, index)
    return Case(src, CheckpointError, [shard, name, INDEX_NAME, "does not list"])


def _quark(tc: Callable[..., Path], tmp: Path) -> Case:
    """A Quark export whose scheme ATOM's MXFP4 path cannot take (fp8 per-channel weights)."""
    src = copy_source(tc, tmp)

    def quark(cfg: dict[str, Any]) -> None:
        cfg["quantization_config"] = {
            "quant_method": "quark",
            "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"},
            "global_quant_config": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "group_size": None}},
            "exclude": ["lm_head"],
        }

    edit_config(src, quark)
    return Case(src, UnsupportedError, ["config.json", "global_quant_config", "model.layers.0.self_attn.q_a_proj",
                                        "'fp8_e4m3'", "'per_channel'", "MXFP4"])


def _compressed_tensors(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)

    def ct(cfg: dict[str, Any]) -> None:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                              "strategy": "block",
                                                                              "block_structure": [128, 128]}}},
            "ignore": ["lm_head"],
        }

    edit_config(src, ct)
    return Case(src, UnsupportedError, ["config.json", "'compressed-tensors'", "not supported", "fp8-block"])


def _architecture(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    edit_config(src, lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    return Case(src, UnsupportedError, ["config.json", "'LlamaForCausalLM'", "not supported",
                                        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])


def _model_type(tc: Callable[..., Path], tmp: Path) -> Case:
    src = copy_source(tc, tmp)
    edit_config(src, lambda c: c.update(model_type="qwen3_moe"))
    return Case(src, UnsupportedError, ["config.json", "'qwen3_moe'", "DeepseekV3ForCausalLM", "deepseek_v3", "kimi_k2"])


def _model_dtype(tc: Callable[..., Path], tmp: Path) -> Case:
    # ATOM would build this model in fp16 (its ModelRunner's default dtype is the config's): not converted to bf16
    src = copy_source(tc, tmp)
    edit_config(src, lambda c: c.update(torch_dtype="float16"))
    return Case(src, UnsupportedError, ["config.json", "torch_dtype is 'float16'", "bfloat16 model only",
                                        "set torch_dtype to \"bfloat16\""])


def _model_dtype_new_key(tc: Callable[..., Path], tmp: Path) -> Case:
    # transformers 5 writes `dtype`
    src = copy_source(tc, tmp)
    edit_config(src, lambda c: c.update(dtype="float32"))
    return Case(src, UnsupportedError, ["config.json", "dtype is 'float32'", "bfloat16 model only"])


def _qlora_not_multiple_of_128(tc: Callable[..., Path], tmp: Path, q192: Path) -> Case:
    # read-only use of a module fixture: nothing to copy
    return Case(q192, UnsupportedError, ["model.layers.0.self_attn.q_a_proj", "q_lora_rank 192", "multiple of 128",
                                         "fused_qkv_a_proj"])


def _tp_heads(tc: Callable[..., Path], tmp: Path) -> Case:
    # 4 heads, vocab 512: tp=8 divides the vocabulary but not the heads
    return Case(tc(PRESET, "fp8"), UnsupportedError, ["num_attention_heads 4", "tp=8"], {"tp": 8})


def _tp_vocab(tc: Callable[..., Path], tmp: Path) -> Case:
    return Case(tc(PRESET, "bf16"), UnsupportedError, ["model.embed_tokens.weight", "vocab size 512", "tp=3"], {"tp": 3})


CASES: dict[str, Callable[..., Case]] = {
    "missing-scale": _missing_scale,
    "missing-weight": _missing_weight,
    "index-lists-absent-tensor": _index_lists_absent_tensor,
    "unmapped-extra-tensor": _unmapped_extra,
    "wrong-shape": _wrong_shape,
    "wrong-shape-norm": _wrong_shape_norm,
    "scale-grid-mismatch": _scale_grid,
    "wrong-dtype": _wrong_dtype,
    "truncated-shard": _truncated,
    "index-names-missing-file": _missing_file,
    "shard-tensor-not-in-index": _not_in_index,
    "quant-quark": _quark,
    "quant-compressed-tensors": _compressed_tensors,
    "unsupported-architecture": _architecture,
    "unsupported-model-type": _model_type,
    "model-dtype-float16": _model_dtype,
    "model-dtype-float32-dtype-key": _model_dtype_new_key,
    "fp8-q-lora-rank-192": _qlora_not_multiple_of_128,
    "tp-does-not-divide-heads": _tp_heads,
    "tp-does-not-divide-vocab": _tp_vocab,
}


@pytest.fixture
def case(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Case:
    make = CASES[request.param]
    if make is _qlora_not_multiple_of_128:
        return make(tiny_checkpoint, tmp_path, request.getfixturevalue("qlora192_source"))
    return make(tiny_checkpoint, tmp_path)


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_cli_bad_input(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    code, out, err = run_cli(["convert", case.src, dst, *case.cli_args()], capsys)
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    assert err.startswith("error: "), err
    assert "internal error" not in err and "Traceback" not in err
    for s in case.expect:
        assert s in err, f"{s!r} not in the message:\n{err}"
    assert_nothing_written(dst)


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_api_bad_input(case: Case, tmp_path: Path) -> None:
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    with pytest.raises(BadInputError) as ei:
        atom_convert.convert(case.src, dst, **case.options)
    assert isinstance(ei.value, case.error), f"{type(ei.value).__name__}: {ei.value}"
    assert isinstance(ei.value, atom_convert.AtomConvertError) and ei.value.exit_code == 2
    msg = str(ei.value)
    for s in case.expect:
        assert s in msg, f"{s!r} not in the message:\n{msg}"
    assert_nothing_written(dst)


@pytest.mark.parametrize("case", ["missing-scale", "unsupported-architecture"], indirect=True)
def test_dry_run_reports_the_same_errors(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", case.src, dst, "--dry-run", *case.cli_args()], capsys)
    assert code == 2
    for s in case.expect:
        assert s in err
    assert_nothing_written(dst)


def test_every_problem_is_reported_at_once(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Several problems in one checkpoint: all of them in one message (one pass to fix)."""
    src = copy_source(tiny_checkpoint, tmp_path)
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    weight = "model.layers.2.mlp.experts.5.down_proj.weight"
    edit_shard(src, file_of(src, scale), lambda t: t.pop(scale))
    edit_shard(src, file_of(src, weight), lambda t: t.update({weight: t[weight].to(torch.bfloat16)}))
    dst = tmp_path / "dst"
    code, _, err = run_cli(["convert", src, dst], capsys)
    assert code == 2
    assert "2 problem(s)" in err
    assert f"missing tensor {scale}" in err and f"tensor {weight} has dtype torch.bfloat16" in err
    assert_nothing_written(dst)


def test_real_entry_point_subprocess(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The console script's own process: exit status 2 and the message on stderr, nothing on stdout."""
    case = _truncated(tiny_checkpoint, tmp_path)
    dst = tmp_path / "dst"
    r = subprocess.run([sys.executable, "-c", "from atom_convert.cli import main; main()", "convert",
                        str(case.src), str(dst)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    for s in case.expect:
        assert s in r.stderr
    assert_nothing_written(dst)


def test_two_shared_experts_where_atom_fuses_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A V3-architecture checkpoint with n_shared_experts 2 (a real one, built by transformers): ATOM
    fuses same-format shared experts into the routed kernel and its loader cannot place a 2I-wide
    shared MLP in one I-wide slot (found by running ATOM's own load on such a checkpoint), so it is
    refused naming the key and the way ATOM keeps them separate; V2's architecture, which ATOM does not
    serve, keeps converting them as a separate MLP."""
    cfg = {**load_preset(PRESET), "n_shared_experts": 2}
    src = build_tiny(cfg, tmp_path / "src", seed=5)
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--target", "gfx950"], capsys)
    assert code == 2, err
    for s in ("model.layers.1.mlp.shared_experts", "n_shared_experts is 2", "expected at most 1",
              "512 wide", "256 wide", "--shared-experts separate"):
        assert s in err, (s, err)
    assert_nothing_written(dst)
    v2 = build_tiny("tiny-deepseek-v2", tmp_path / "v2", seed=5)
    assert json.loads((v2 / "config.json").read_text())["n_shared_experts"] == 2
    code, _, err = run_cli(["convert", v2, tmp_path / "v2-out", "--target", "gfx950"], capsys)
    assert code == 0, err


def test_source_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    dst = tmp_path / "dst"
    code, _, err = run_cli(["convert", empty, dst], capsys)
    assert code == 2 and "config.json" in err and str(empty) in err
    (empty / "config.json").write_text(json.dumps(load_preset(PRESET)))
    code, _, err = run_cli(["convert", empty, dst], capsys)
    assert code == 2 and "model.safetensors" in err and INDEX_NAME in err
    code, _, err = run_cli(["convert", tmp_path / "nope", dst], capsys)
    assert code == 2 and "not a directory" in err
    assert_nothing_written(dst)


def test_usage_errors_exit_2(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    dst = tmp_path / "dst"
    for extra in (["--tp", "0"], ["--target", "gfx90a"], ["--shard-size", "lots"]):
        code, _, err = run_cli(["convert", src, dst, *extra], capsys)
        assert code == 2, (extra, err)
        assert err.strip(), extra
    assert_nothing_written(dst)


# ------------------------------------------------------------------------------------------------
# Existing destination
# ------------------------------------------------------------------------------------------------


def test_existing_dst_without_force_is_untouched(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, out, err = run_cli(["convert", tiny_checkpoint(PRESET, "fp8"), dst], capsys)
    assert code == 2
    assert str(dst) in err and "already exists" in err and "--force" in err
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
    assert (dst / "keep.txt").read_text() == "mine"
    assert leftovers(dst) == []
    with pytest.raises(DestinationExistsError):
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst)
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]


def test_force_refuses_a_directory_that_is_not_a_conversion(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--force replaces only an earlier conversion or an empty directory: anything else is refused."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, out, err = run_cli(["convert", tiny_checkpoint(PRESET, "fp8"), dst, "--force"], capsys)
    assert code == 2
    assert str(dst) in err and "not an atom-convert output" in err and "atom_manifest.json" in err
    assert "keep.txt" in err and "Choose another DST" in err
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert leftovers(dst) == []
    with pytest.raises(BadInputError, match="not an atom-convert output"):
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, force=True)
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("kind", ["earlier-conversion", "empty"])
def test_existing_dst_with_force_is_replaced(kind: str, converted: Callable[..., Path], tiny_checkpoint: Callable[..., Path],
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    if kind == "empty":
        dst.mkdir()
    else:  # a gfx942 conversion, replaced by a gfx950 one
        shutil.copytree(converted(PRESET, "fp8", "gfx942"), dst)
    code, out, err = run_cli(["convert", tiny_checkpoint(PRESET, "fp8"), dst, "--force"], capsys)
    assert code == 0, err
    assert json.loads((dst / "atom_manifest.json").read_text())["target"] == "gfx950"
    assert (dst / "mtp" / "atom_manifest.json").is_file()
    assert leftovers(dst) == []
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 0, out


def test_existing_dst_with_force_survives_bad_input(tiny_checkpoint: Callable[..., Path],
                                                    existing_dst: tuple[Path, dict[str, str]], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dst, digest = existing_dst
    case = _scale_grid(tiny_checkpoint, tmp_path)
    code, _, err = run_cli(["convert", case.src, dst, "--force"], capsys)
    assert code == 2 and "scale grid" in err
    assert tree_digest(dst) == digest
    assert leftovers(dst) == []


# ------------------------------------------------------------------------------------------------
# Failures in the middle of writing
# ------------------------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _fail_writer_after(monkeypatch: pytest.MonkeyPatch, n: int, exc: BaseException) -> dict[str, int]:
    calls = {"n": 0, "raised": 0}
    real = ShardSetWriter.write

    def write(self: ShardSetWriter, rank: int, out: Any, chunks: Any, part: Any = None) -> None:
        calls["n"] += 1
        if calls["n"] > n:
            calls["raised"] += 1
            raise exc
        real(self, rank, out, chunks, part)

    monkeypatch.setattr(ShardSetWriter, "write", write)
    return calls


@pytest.mark.parametrize("after", [3, 60], ids=["in-mtp-set", "in-main-set"])
def test_writer_failure_leaves_nothing(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    calls = _fail_writer_after(monkeypatch, after, Boom("disk on fire"))
    dst = tmp_path / "dst"
    with pytest.raises(Boom):
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst)
    assert calls["raised"] == 1 and calls["n"] == after + 1
    assert_nothing_written(dst)


def test_producer_failure_leaves_nothing(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer raising half-way through a stacked expert tensor (after some experts were written)."""
    real = postload_mod.shuffle16
    calls = {"n": 0}

    def shuffle16(w: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 25:
            raise Boom("shuffle failed")
        return real(w)

    monkeypatch.setattr(postload_mod, "shuffle16", shuffle16)
    dst = tmp_path / "dst"
    with pytest.raises(Boom):
        atom_convert.convert(tiny_checkpoint(PRESET, "bf16"), dst)
    assert calls["n"] == 25
    assert_nothing_written(dst)


def test_io_thread_failure_keeps_only_sealed_shards(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full on the background IO thread reaches the caller as bad input naming the shard; the
    shards sealed before it stay for a resume, nothing else does, and the resume completes."""
    real = ShardFile.pwrite
    calls = {"n": 0}

    def pwrite(sh: ShardFile, data: Any, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 40:  # what os.pwrite raises on a full disk: no file name
            sh._io(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        real(sh, data, offset)

    monkeypatch.setattr(ShardFile, "pwrite", pwrite)
    dst = tmp_path / "dst"
    with pytest.raises(BadInputError, match="no space left") as ei:
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB")
    staging = tmp_path / ".dst.atom-partial"
    assert ".safetensors.partial" in str(ei.value) and str(staging) in str(ei.value) and "--restart" in str(ei.value)
    assert not dst.exists() and leftovers(dst) == [staging.name]
    files = [p for p in staging.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith(".partial")]
    journal = [json.loads(x) for x in (staging / ".atom-journal.jsonl").read_text().splitlines()[1:]]
    assert len(journal) >= 1 and {staging / e["sealed"] for e in journal} == {p for p in files if p.suffix == ".safetensors"}
    for e in journal:
        assert xx_blocks((staging / e["sealed"]).read_bytes()) == e["xxh3_blocks"]
    monkeypatch.undo()
    atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB")
    assert leftovers(dst) == []
    ref = tmp_path / "ref"
    atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), ref, shard_size="100KB")
    a, b = tree_digest(dst), tree_digest(ref)
    assert {k: v for k, v in a.items() if not k.endswith("atom_manifest.json")} == \
        {k: v for k, v in b.items() if not k.endswith("atom_manifest.json")}


@pytest.mark.parametrize("key", ["blake3_blocks", "blake3", "sha256"])
def test_resume_keeps_shards_sealed_by_an_earlier_version(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """A staging journal written by an earlier version records its digests (BLAKE3 over blocks,
    whole-file BLAKE3, sha256): a resume checks each kept shard against the digest its journal gives, keeps it, and the finished
    manifest records every file under this version's key with this version's digest (verify passes)."""
    import hashlib

    import blake3

    from atom_convert.check.verify import verify

    real = ShardFile.pwrite
    calls = {"n": 0}

    def pwrite(sh: ShardFile, data: Any, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 40:
            sh._io(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        real(sh, data, offset)

    monkeypatch.setattr(ShardFile, "pwrite", pwrite)
    dst, staging = tmp_path / "dst", tmp_path / ".dst.atom-partial"
    with pytest.raises(BadInputError, match="no space left"):
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB")
    monkeypatch.undo()
    whole = {"blake3_blocks": b3_blocks, "blake3": lambda b: blake3.blake3(b).hexdigest(),
             "sha256": lambda b: hashlib.sha256(b).hexdigest()}[key]
    jp = staging / ".atom-journal.jsonl"
    lines = jp.read_text().splitlines()
    entries = [json.loads(x) for x in lines[1:]]
    assert entries
    for e in entries:  # as the earlier version wrote them
        del e["xxh3_blocks"]
        e[key] = whole((staging / e["sealed"]).read_bytes())
    jp.write_text("\n".join([lines[0]] + [json.dumps(e) for e in entries]) + "\n")
    sealed = {e["sealed"]: (staging / e["sealed"]).stat().st_mtime_ns for e in entries}
    notes: list[str] = []
    m = atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB", notify=notes.append)
    assert any(f"keeping {len(entries)} of" in n for n in notes), notes
    for rel, mtime in sealed.items():  # kept, not rewritten
        assert (dst / rel).stat().st_mtime_ns == mtime, rel
    for rel, meta in m["files"].items():
        assert set(meta) == {"bytes", "xxh3_blocks"} and meta["xxh3_blocks"] == xx_blocks((dst / rel).read_bytes())
    assert verify(dst, None).ok


@pytest.mark.parametrize("after", [0, 30], ids=["before-any-seal", "after-some-seals"])
def test_interrupt_keeps_only_sealed_shards(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    _fail_writer_after(monkeypatch, after, KeyboardInterrupt())
    dst = tmp_path / "dst"
    # Small shards: some are sealed within the first 30 tensors (the main set is written first,
    # so with the default size its one shard per rank would still be open).
    with pytest.raises(KeyboardInterrupt) as ei:
        atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB")
    assert isinstance(ei.value, Interrupted) and ei.value.exit_code == 130
    assert not dst.exists()
    staging = tmp_path / ".dst.atom-partial"
    if after == 0:
        assert "nothing was kept" in str(ei.value)
        assert_nothing_written(dst)
        return
    assert str(staging) in str(ei.value) and "again" in str(ei.value)
    assert leftovers(dst) == [staging.name]
    assert not [p for p in staging.rglob("*.partial")]
    monkeypatch.undo()
    atom_convert.convert(tiny_checkpoint(PRESET, "fp8"), dst, shard_size="100KB")
    assert leftovers(dst) == []


def test_cli_write_failure_is_internal_error(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _fail_writer_after(monkeypatch, 10, Boom("disk on fire"))
    dst = tmp_path / "dst"
    code, _, err = run_cli(["convert", tiny_checkpoint(PRESET, "fp8"), dst], capsys)
    assert code == 1
    assert "internal error" in err and "disk on fire" in err
    assert_nothing_written(dst)


@pytest.fixture
def existing_dst(converted: Callable[..., Path], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    dst = tmp_path / "dst"
    shutil.copytree(converted(PRESET, "fp8", "gfx950"), dst)
    return dst, tree_digest(dst)


@pytest.mark.parametrize("after", [3, 60], ids=["in-mtp-set", "in-main-set"])
def test_force_replacement_failure_keeps_old_dst(tiny_checkpoint: Callable[..., Path], existing_dst: tuple[Path, dict[str, str]],
                                                 monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    dst, digest = existing_dst
    _fail_writer_after(monkeypatch, after, Boom("disk on fire"))
    with pytest.raises(Boom):
        atom_convert.convert(tiny_checkpoint(PRESET, "bf16"), dst, force=True)
    assert tree_digest(dst) == digest
    assert leftovers(dst) == []


def test_force_replacement_failing_at_the_final_rename_keeps_old_dst(
        tiny_checkpoint: Callable[..., Path], existing_dst: tuple[Path, dict[str, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last step swaps DST for the finished temporary directory with two renames
    (DST aside, then tmp -> DST). If the second fails, the old DST must come back."""
    dst, digest = existing_dst
    real = os.rename
    calls = {"n": 0}

    def rename(a: Any, b: Any) -> None:
        calls["n"] += 1
        if Path(a).name == f".{dst.name}.atom-partial" and Path(b) == dst:
            raise OSError(16, "Device or resource busy")
        real(a, b)

    monkeypatch.setattr(convert_mod.os, "rename", rename)
    with pytest.raises(OSError):
        atom_convert.convert(tiny_checkpoint(PRESET, "bf16"), dst, force=True)
    monkeypatch.undo()
    assert dst.is_dir(), f"the old {dst.name} is gone; left beside it: {leftovers(dst)}"
    assert tree_digest(dst) == digest
    assert leftovers(dst) == []


def test_failed_conversion_closes_source_files(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failure the source can be deleted/replaced: no file handle stays open on it."""
    src = copy_source(tiny_checkpoint, tmp_path)
    _fail_writer_after(monkeypatch, 20, Boom("x"))
    with pytest.raises(Boom):
        atom_convert.convert(src, tmp_path / "dst")
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [f for f in fds if f.startswith(str(src.resolve()))]
    out = tmp_path / "dst"
    assert_nothing_written(out)
    # the source is intact: converting it again works
    monkeypatch.undo()
    atom_convert.convert(src, out)
    assert (out / "atom_manifest.json").is_file() and leftovers(out) == []
