"""A corpus of hostile inputs: every one is refused through the CLI with exit code 2 and a
message naming the file and tensor (or the config key), the expected and the actual value;
nothing is left beside DST and SRC is byte-identical afterwards (tests/hostile_util.py).

Each case mutates a private copy of a small valid checkpoint built once per session
(`tiny-deepseek-v3` fp8 with 2 shards and an index, its bf16 single-file twin, and a tiny
random Quark MXFP4 export); the copy hard-links the files a case leaves alone, and a case
always replaces a file it changes (never edits it in place), so the session fixtures stay intact.
`test_fixtures_convert` holds the unmutated fixtures to converting cleanly, so each refusal
below is caused by its mutation.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import atom_convert
from atom_convert import BadInputError
from atom_convert.check.tensors import check_files
from atom_convert.layout.model import ModelSpec
from atom_convert.layout.codecs.base import detect_format
from atom_convert.files.values import ValueGuard
from atom_convert.files.source import INDEX_NAME
from atom_convert.synth import CONFIG_DIR, build_random, load_preset
from hostile_util import assert_refused, mkfifo_fed_later, run_cli, tree_digest

PRESET = "tiny-deepseek-v3"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
SINGLE = "model.safetensors"
KV_B = "model.layers.1.self_attn.kv_b_proj"
O_PROJ = "model.layers.2.self_attn.o_proj"  # in SHARD2


# ------------------------------------------------------------------------------------------------
# fixtures and mutation helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mxfp4_source(session_dir: Path) -> Path:
    """A tiny random Quark-style MXFP4 export (routed experts MXFP4, the rest bf16), H = 256."""
    cfg = load_preset(PRESET)
    cfg.update(hidden_size=256, num_nextn_predict_layers=0)
    return build_random(cfg, session_dir / "hostile-mxfp4", fmt="mxfp4", seed=11, shard_bytes=2_000_000)


def clone(src: Path, dst: Path) -> Path:
    """A copy of `src` whose files are hard links (cheap); mutate only by replacing files."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def replace_bytes(path: Path, data: bytes) -> None:
    """Give `path` new content through a new inode (the hard-linked original stays as it was)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def split_shard(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_shard(header: Any, data: bytes) -> bytes:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h)) + h + data


@dataclass
class New:
    """Returned by an edit: the document is replaced by `value` (else the edited one is kept)."""

    value: Any


def edit_header(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite a shard's JSON header in place of the old one (the data bytes are kept)."""
    header, data = split_shard(path)
    new = edit(header)
    replace_bytes(path, join_shard(new.value if isinstance(new, New) else header, data))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}
    edit(tensors)
    tmp = path.with_name(path.name + ".new")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    new = edit(data)
    replace_bytes(path, json.dumps(new.value if isinstance(new, New) else data, indent=1).encode())


def shard_of(src: Path, name: str) -> str:
    return json.loads((src / INDEX_NAME).read_text())["weight_map"][name]


def first_tensor(path: Path) -> str:
    header, _ = split_shard(path)
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def second_tensor(path: Path) -> str:
    header, _ = split_shard(path)
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[1]


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    src: Path
    expect: list[str]  # every string must appear in the output: file, tensor or key, expected, actual
    args: list[str] = field(default_factory=list)
    max_lines: int | None = None  # for "one clear line, not one per tensor"


@dataclass
class Sources:
    fp8: Path
    bf16: Path
    mxfp4: Path
    tmp: Path


CASES: dict[str, Callable[[Sources], Case]] = {}


def case(name: str) -> Callable[[Callable[[Sources], Case]], Callable[[Sources], Case]]:
    def reg(fn: Callable[[Sources], Case]) -> Callable[[Sources], Case]:
        assert name not in CASES, name
        CASES[name] = fn
        return fn
    return reg


def _fp8(s: Sources) -> Path:
    return clone(s.fp8, s.tmp / "src")


def _bf16(s: Sources) -> Path:
    return clone(s.bf16, s.tmp / "src")


# --- safetensors container ------------------------------------------------------------------------

def _header_case(name: str, edit: Callable[[dict[str, Any], str], Any], expect: Callable[[str], list[str]]) -> None:
    @case(name)
    def make(s: Sources) -> Case:
        src = _fp8(s)
        victim = first_tensor(src / SHARD2)
        edit_header(src / SHARD2, lambda h: edit(h, victim))
        return Case(src, [SHARD2, *expect(victim)])


def _entry(key: str, value: Any) -> Callable[[dict[str, Any], str], None]:
    def edit(h: dict[str, Any], victim: str) -> None:
        h[victim][key] = value
    return edit


def _drop(key: str) -> Callable[[dict[str, Any], str], None]:
    def edit(h: dict[str, Any], victim: str) -> None:
        del h[victim][key]
    return edit


_header_case("header-is-a-list", lambda h, v: New([h]), lambda v: ["a list", "expected a JSON object"])
_header_case("header-is-a-string", lambda h, v: New("tensors"), lambda v: ["a string", "expected a JSON object"])
_header_case("header-is-null", lambda h, v: New(b"null"), lambda v: ["null", "expected a JSON object"])
_header_case("entry-is-a-list", lambda h, v: h.__setitem__(v, [1, 2]), lambda v: [v, "a list", "dtype, shape, data_offsets"])
_header_case("entry-without-data-offsets", _drop("data_offsets"), lambda v: [v, "data_offsets"])
_header_case("entry-without-dtype", _drop("dtype"), lambda v: [v, "no dtype"])
_header_case("entry-without-shape", _drop("shape"), lambda v: [v, "no shape"])
_header_case("dtype-is-a-number", _entry("dtype", 7), lambda v: [v, "dtype is an integer 7", "string"])
_header_case("dtype-unknown", _entry("dtype", "F8_E4M3X"), lambda v: [v, "'F8_E4M3X'", "does not read"])
_header_case("dtype-lowercase", _entry("dtype", "bf16"), lambda v: [v, "'bf16'", "does not read"])
_header_case("shape-negative-dim", lambda h, v: h[v].__setitem__("shape", [-h[v]["shape"][0]] + h[v]["shape"][1:]),
             lambda v: [v, "shape [-", "integers >= 0"])
_header_case("shape-float-dim", lambda h, v: h[v].__setitem__("shape", [float(d) for d in h[v]["shape"]]),
             lambda v: [v, ".0", "integers >= 0"])
_header_case("shape-is-a-string", _entry("shape", "320x128"), lambda v: [v, "'320x128'", "not a list"])
_header_case("shape-huge", _entry("shape", [2**40, 2**40]), lambda v: [v, str([2**40, 2**40]), "bytes"])
_header_case("shape-bool-dim", _entry("shape", [True, 128]), lambda v: [v, "[True, 128]", "integers"])
_header_case("offsets-is-a-string", _entry("data_offsets", "0-100"), lambda v: [v, "'0-100'", "[begin, end]"])
_header_case("offsets-three-numbers", lambda h, v: h[v]["data_offsets"].append(9), lambda v: [v, "data_offsets", "[begin, end]"])
_header_case("offsets-reversed", lambda h, v: h[v].__setitem__("data_offsets", h[v]["data_offsets"][::-1]),
             lambda v: [v, "begin <= end"])
_header_case("offsets-negative", lambda h, v: h[v].__setitem__("data_offsets", [-8, h[v]["data_offsets"][1]]),
             lambda v: [v, "[-8,", "0 <= begin"])
_header_case("offsets-beyond-file", lambda h, v: h[v].__setitem__("data_offsets", [0, 10**12]),
             lambda v: ["truncated", "data ends at byte 10000000", "but the file has"])
_header_case("span-disagrees-with-dtype", lambda h, v: h[v].__setitem__("dtype", "F32" if h[v]["dtype"] != "F32" else "BF16"),
             lambda v: [v, "dtype", "bytes"])
_header_case("span-disagrees-with-shape", lambda h, v: h[v].__setitem__("shape", [h[v]["shape"][0] + 1] + h[v]["shape"][1:]),
             lambda v: [v, "shape", "bytes"])
_header_case("metadata-is-a-string", lambda h, v: h.__setitem__("__metadata__", "pt"), lambda v: ["__metadata__", "a string"])
_header_case("metadata-value-not-a-string", lambda h, v: h.__setitem__("__metadata__", {"format": 1}),
             lambda v: ["__metadata__['format'] is an integer", "expected a string"])


@case("offsets-overlap")
def _overlap(s: Sources) -> Case:
    src = _fp8(s)
    a, b = first_tensor(src / SHARD2), second_tensor(src / SHARD2)

    def edit(h: dict[str, Any]) -> None:  # b starts inside a, same length, so the spans overlap
        n = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][1] - 2, h[a]["data_offsets"][1] - 2 + n]
    edit_header(src / SHARD2, edit)
    return Case(src, [SHARD2, b, "overlaps", a])


@case("offsets-gap")
def _gap(s: Sources) -> Case:
    src = _fp8(s)
    header, data = split_shard(src / SHARD2)
    a = first_tensor(src / SHARD2)
    for k, e in header.items():  # every tensor moves 8 bytes on: 8 bytes after a belong to nobody
        if k != "__metadata__" and k != a:
            e["data_offsets"] = [e["data_offsets"][0] + 8, e["data_offsets"][1] + 8]
    end = header[a]["data_offsets"][1]
    replace_bytes(src / SHARD2, join_shard(header, data[:end] + b"\x00" * 8 + data[end:]))
    return Case(src, [SHARD2, "belong to no tensor", "gap"])


@case("trailing-bytes")
def _trailing(s: Sources) -> Case:
    src = _fp8(s)
    replace_bytes(src / SHARD1, (src / SHARD1).read_bytes() + b"\x00" * 24)
    return Case(src, [SHARD1, "24 bytes after the last tensor"])


@case("duplicate-key-in-header")
def _dup_key(s: Sources) -> Case:
    src = _fp8(s)
    header, data = split_shard(src / SHARD2)
    v = first_tensor(src / SHARD2)
    text = json.dumps(header)
    entry = json.dumps({v: header[v]})[1:-1]
    raw = ("{" + entry + ", " + text[1:]).encode()  # the same tensor name twice in one object
    replace_bytes(src / SHARD2, join_shard(raw, data))
    return Case(src, [SHARD2, v, "appears twice"])


@case("header-not-json")
def _not_json(s: Sources) -> Case:
    src = _fp8(s)
    _, data = split_shard(src / SHARD2)
    replace_bytes(src / SHARD2, join_shard(b'{"a": {"dtype": "F32",', data))
    return Case(src, [SHARD2, "not valid JSON"])


@case("header-not-utf8")
def _not_utf8(s: Sources) -> Case:
    src = _fp8(s)
    _, data = split_shard(src / SHARD2)
    replace_bytes(src / SHARD2, join_shard(b"\xff\xfe{}", data))
    return Case(src, [SHARD2, "not valid JSON"])


@case("header-length-beyond-file")
def _hlen_beyond(s: Sources) -> Case:
    src = _fp8(s)
    raw = (src / SHARD2).read_bytes()
    replace_bytes(src / SHARD2, struct.pack("<Q", len(raw) + 1000) + raw[8:])
    return Case(src, [SHARD2, f"header length {len(raw) + 1000}", f"file size {len(raw)}"])


@case("header-length-insane")
def _hlen_insane(s: Sources) -> Case:
    src = _fp8(s)
    raw = (src / SHARD2).read_bytes()
    replace_bytes(src / SHARD2, struct.pack("<Q", 2**63) + raw[8:])
    return Case(src, [SHARD2, str(2**63), "limit"])


@case("file-of-three-bytes")
def _three_bytes(s: Sources) -> Case:
    src = _fp8(s)
    replace_bytes(src / SHARD1, b"abc")
    return Case(src, [SHARD1, "3 bytes", "not a safetensors file"])


@case("empty-file")
def _empty(s: Sources) -> Case:
    src = _bf16(s)
    replace_bytes(src / SINGLE, b"")
    return Case(src, [SINGLE, "0 bytes", "not a safetensors file"])


@case("tensor-stored-twice")
def _twice(s: Sources) -> Case:
    src = _fp8(s)
    name = "model.norm.weight"
    other = SHARD1 if shard_of(src, name) == SHARD2 else SHARD2
    edit_tensors(src / other, lambda t: t.__setitem__(name, torch.randn(320).to(torch.bfloat16)))
    return Case(src, [name, "stored twice", SHARD1, SHARD2])


def _odd_name_case(case_name: str, name: str, shown: str, max_lines: int | None = None) -> None:
    """An extra tensor `name` in SHARD1 (and the index): refused as unmapped, the name shown as `shown`."""
    @case(case_name)
    def make(s: Sources) -> Case:
        src = _fp8(s)
        edit_tensors(src / SHARD1, lambda t: t.__setitem__(name, torch.randn(4, 4).to(torch.bfloat16)))
        edit_json(src / INDEX_NAME, lambda d: d["weight_map"].__setitem__(name, SHARD1))
        return Case(src, [SHARD1, f"unmapped tensor {shown} (torch.bfloat16, [4, 4])"], max_lines=max_lines)


_odd_name_case("tensor-name-with-path-characters", "../../etc/passwd", "../../etc/passwd")
# a control character is shown escaped, on the problem's one line
_odd_name_case("tensor-name-with-a-newline", "model.layers.0.extra\nweight", "model.layers.0.extra\\nweight",
               max_lines=3)


# --- index ------------------------------------------------------------------------------------------

def _index_case(name: str, edit: Callable[[Any], Any], expect: list[str], max_lines: int | None = None) -> None:
    @case(name)
    def make(s: Sources) -> Case:
        src = _fp8(s)
        edit_json(src / INDEX_NAME, edit)
        return Case(src, [INDEX_NAME, *expect], max_lines=max_lines)


_index_case("index-is-a-list", lambda d: New([d]), ["a list", "weight_map"])
_index_case("index-weight-map-is-a-list", lambda d: d.__setitem__("weight_map", list(d["weight_map"])),
            ["weight_map is a list", "expected an object"])
_index_case("index-without-weight-map", lambda d: d.pop("weight_map"), ["weight_map is missing"])
_index_case("index-weight-map-null-value", lambda d: d["weight_map"].__setitem__("model.norm.weight", None),
            ["'model.norm.weight'", "null", "shard file name"])
_index_case("index-weight-map-number-value", lambda d: d["weight_map"].__setitem__("lm_head.weight", 2),
            ["'lm_head.weight'", "an integer 2", "shard file name"])
_index_case("index-weight-map-empty", lambda d: d.__setitem__("weight_map", {}), ["weight_map is empty"], max_lines=4)
_index_case("index-path-dotdot", lambda d: d["weight_map"].__setitem__("model.norm.weight", "../" + SHARD1),
            [f"'../{SHARD1}'", "leaves the checkpoint folder"])
_index_case("index-path-absolute", lambda d: d["weight_map"].__setitem__("model.norm.weight", "/etc/hostname"),
            ["'/etc/hostname'", "leaves the checkpoint folder"])
_index_case("index-path-nul", lambda d: d["weight_map"].__setitem__("model.norm.weight", "model\u0000.safetensors"),
            ["NUL"])
_index_case("index-maps-tensor-to-the-wrong-shard",
            lambda d: d["weight_map"].__setitem__(f"{O_PROJ}.weight", SHARD1),
            [f"{O_PROJ}.weight", SHARD1, f"stored in {SHARD2}"])
_index_case("index-lists-absent-tensor", lambda d: d["weight_map"].__setitem__("model.layers.0.mlp.ghost.weight", SHARD2),
            ["model.layers.0.mlp.ghost.weight", SHARD2, "does not contain it"])
_index_case("index-omits-a-tensor", lambda d: d["weight_map"].pop("model.norm.weight"),
            ["model.norm.weight", "does not list"])


@case("index-not-json")
def _index_not_json(s: Sources) -> Case:
    src = _fp8(s)
    replace_bytes(src / INDEX_NAME, b'{"weight_map": {')
    return Case(src, [INDEX_NAME, "not valid JSON"])


DEEP = 100_000  # list brackets nested deeper than Python's JSON parser recurses


def nested_deep(path: Path) -> None:
    """`path`, a JSON object, with one more key whose value nests `DEEP` lists."""
    text = path.read_text().rstrip()
    assert text.endswith("}")
    replace_bytes(path, (text[:-1] + ', "notes": ' + "[" * DEEP + "]" * DEEP + "}").encode())


@case("index-nested-too-deeply")
def _index_deep(s: Sources) -> Case:
    src = _fp8(s)
    nested_deep(src / INDEX_NAME)
    return Case(src, [INDEX_NAME, "not valid JSON", "nested too deeply"])


@case("index-duplicate-key")
def _index_dup(s: Sources) -> Case:
    src = _fp8(s)
    text = (src / INDEX_NAME).read_text()
    text = text.replace('"weight_map": {', f'"weight_map": {{"lm_head.weight": "{SHARD2}", ', 1)
    replace_bytes(src / INDEX_NAME, text.encode())
    return Case(src, [INDEX_NAME, "'lm_head.weight'", "appears twice"])


@case("index-shard-symlink-out-of-src")
def _symlink_out(s: Sources) -> Case:
    src = _fp8(s)
    outside = s.tmp / "elsewhere"
    outside.mkdir()
    os.link(src / SHARD2, outside / SHARD2)
    (src / SHARD2).unlink()
    (src / SHARD2).symlink_to(outside / SHARD2)
    return Case(src, [SHARD2, "symlink", str(outside / SHARD2), "outside"])


@case("index-path-into-sibling-folder")
def _sibling(s: Sources) -> Case:
    src = _fp8(s)
    outside = s.tmp / "elsewhere"
    outside.mkdir()
    shutil.copy(src / SHARD2, outside / SHARD2)
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update(
        {k: f"../elsewhere/{SHARD2}" for k, v in d["weight_map"].items() if v == SHARD2}))
    return Case(src, [f"'../elsewhere/{SHARD2}'", "leaves the checkpoint folder"])


@case("index-shard-is-a-directory")
def _shard_dir(s: Sources) -> Case:
    src = _fp8(s)
    (src / SHARD2).unlink()
    (src / SHARD2).mkdir()
    return Case(src, [SHARD2, "is a directory"])


@case("index-shard-dangling-symlink")
def _dangling(s: Sources) -> Case:
    src = _fp8(s)
    (src / SHARD2).unlink()
    (src / SHARD2).symlink_to(src / "gone.safetensors")
    return Case(src, [SHARD2, "dangling symlink"])


@case("index-shard-symlink-loop")
def _loop(s: Sources) -> Case:
    src = _fp8(s)
    (src / SHARD2).unlink()
    (src / SHARD2).symlink_to(src / SHARD2)
    return Case(src, [SHARD2])


@case("index-shard-is-a-fifo")
def _fifo(s: Sources) -> Case:
    src = _fp8(s)
    (src / SHARD2).unlink()
    os.mkfifo(src / SHARD2)
    return Case(src, [SHARD2, "not a regular file"])


@case("single-file-is-a-directory")
def _single_dir(s: Sources) -> Case:
    src = _bf16(s)
    (src / SINGLE).unlink()
    (src / SINGLE).mkdir()
    return Case(src, [SINGLE, "is a directory"])


@case("index-is-a-directory")
def _index_dir(s: Sources) -> Case:
    src = _fp8(s)
    (src / INDEX_NAME).unlink()
    (src / INDEX_NAME).mkdir()
    return Case(src, [INDEX_NAME, "is a directory"])


# --- config.json ------------------------------------------------------------------------------------

def _config_case(name: str, edit: Callable[[Any], Any], expect: list[str], base: str = "fp8",
                 max_lines: int | None = 6) -> None:
    @case(name)
    def make(s: Sources) -> Case:
        src = _fp8(s) if base == "fp8" else _bf16(s)
        edit_json(src / "config.json", edit)
        return Case(src, ["config.json", *expect], max_lines=max_lines)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.__setitem__(key, value)


def _set_q(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["quantization_config"].__setitem__(key, value)


_config_case("config-is-a-list", lambda c: New([c]), ["a list", "expected a JSON object"])
_config_case("config-hidden-size-string", _set("hidden_size", "320"), ["hidden_size", "integer", "'320'"])
_config_case("config-hidden-size-list", _set("hidden_size", [320]), ["hidden_size", "integer", "[320]"])
_config_case("config-hidden-size-zero", _set("hidden_size", 0), ["hidden_size", ">= 1", "got 0"])
_config_case("config-hidden-size-negative", _set("hidden_size", -320), ["hidden_size", ">= 1", "-320"])
_config_case("config-hidden-size-fraction", _set("hidden_size", 320.5), ["hidden_size", "integer", "320.5"])
_config_case("config-hidden-size-true", _set("hidden_size", True), ["hidden_size", "integer", "True"])
_config_case("config-heads-null", _set("num_attention_heads", None), ["num_attention_heads", "missing"])
_config_case("config-kv-lora-rank-absent", lambda c: c.pop("kv_lora_rank"), ["kv_lora_rank", "missing"])
_config_case("config-moe-layer-freq-zero", _set("moe_layer_freq", 0), ["moe_layer_freq", ">= 1", "got 0"])
_config_case("config-experts-negative", _set("n_routed_experts", -8), ["n_routed_experts", ">= 0", "-8"])
_config_case("config-top-k-above-experts", _set("num_experts_per_tok", 9),
             ["num_experts_per_tok=9", "n_routed_experts=8", "1..8"])
_config_case("config-groups-do-not-divide-experts", _set("n_group", 3), ["n_routed_experts=8", "n_group=3", "divide"])
_config_case("config-topk-group-above-groups", _set("topk_group", 5), ["topk_group=5", "n_group=4", "1..4"])
_config_case("config-vocab-zero", _set("vocab_size", 0), ["vocab_size", ">= 1", "got 0"])
_config_case("config-layers-huge", _set("num_hidden_layers", 10**9), ["num_hidden_layers", "1000000000", "layer 4"])
_config_case("config-experts-huge", _set("n_routed_experts", 10**9), ["n_routed_experts", "1000000000", "0..7"])
# the MoE layers the config makes against the layers that hold routed experts: one line each
_config_case("config-experts-absent", lambda c: c.pop("n_routed_experts"),
             ["n_routed_experts is 0", "layer(s) 1, 2, 3", "model.layers.1.mlp.experts.*"])
_config_case("config-first-dense-layers-too-many", _set("first_k_dense_replace", 10),
             ["first_k_dense_replace 10", "layer 1 dense", "layer(s) 1, 2, 3"])
_config_case("config-first-dense-layers-too-few", _set("first_k_dense_replace", 0),
             ["first_k_dense_replace 0", "layer 0 a MoE layer", "model.layers.0.mlp.experts.* is absent"])
_config_case("config-eps-string", _set("rms_norm_eps", "1e-6"), ["rms_norm_eps", "number", "'1e-6'"])
_config_case("config-scaling-factor-nan", _set("routed_scaling_factor", float("nan")),
             ["routed_scaling_factor", "finite", "nan"])
_config_case("config-norm-topk-prob-string", _set("norm_topk_prob", "yes"), ["norm_topk_prob", "true or false", "'yes'"])
_config_case("config-topk-method-number", _set("topk_method", 3), ["topk_method", "string", "3"])
_config_case("config-architectures-string", _set("architectures", "DeepseekV3ForCausalLM"),
             ["architectures", "a string", "list of strings"])
_config_case("config-quantization-config-string", _set("quantization_config", "fp8"),
             ["quantization_config", "a string", "'fp8'", "expected an object"])
_config_case("config-quantization-config-list", _set("quantization_config", [{"quant_method": "fp8"}]),
             ["quantization_config", "a list", "expected an object"])
_config_case("config-quant-method-absent", lambda c: c["quantization_config"].pop("quant_method"),
             ["quantization_config.quant_method is missing", "expected a string"])
_config_case("config-quant-method-null", _set_q("quant_method", None),
             ["quantization_config.quant_method is null,", "expected a string"])
_config_case("config-activation-scheme-static", _set_q("activation_scheme", "static"),
             ["activation_scheme='static'", "input_scale", "'dynamic'"])
_config_case("config-quant-method-number", _set_q("quant_method", 8), ["quant_method", "an integer 8", "string"])
_config_case("config-block-size-number", _set_q("weight_block_size", 128), ["weight_block_size=128", "[128, 128]"])
_config_case("config-ignore-is-a-string", _set_q("ignore", "lm_head"), ["quantization_config.ignore", "'lm_head'",
                                                                          "list of module names"])
_config_case("config-vocab-disagrees-with-tensors", _set("vocab_size", 640),
             ["model.embed_tokens.weight", "[512, 320]", "expected [640, 320]"], max_lines=None)
_config_case("config-several-bad-keys", lambda c: c.update(hidden_size="x", num_attention_heads=-1, rms_norm_eps=[1]),
             ["hidden_size", "'x'", "num_attention_heads", "-1", "rms_norm_eps", "[1]", "3 problem(s)"])


@case("config-not-json")
def _config_not_json(s: Sources) -> Case:
    src = _fp8(s)
    replace_bytes(src / "config.json", b'{"hidden_size": 320,')
    return Case(src, ["config.json", "not valid JSON"])


@case("config-nested-too-deeply")
def _config_deep(s: Sources) -> Case:
    src = _fp8(s)
    nested_deep(src / "config.json")
    return Case(src, ["config.json", "not valid JSON", "nested too deeply"])


@case("config-is-a-fifo")
def _config_fifo(s: Sources) -> Case:
    src = _fp8(s)
    (src / "config.json").unlink()
    mkfifo_fed_later(src / "config.json")
    return Case(src, ["config.json", "not a regular file"])


@case("config-duplicate-key")
def _config_dup(s: Sources) -> Case:
    src = _fp8(s)
    text = (src / "config.json").read_text().replace("{", '{"hidden_size": 7168, ', 1)
    replace_bytes(src / "config.json", text.encode())
    return Case(src, ["config.json", "'hidden_size'", "appears twice"])


@case("config-is-a-directory")
def _config_dir(s: Sources) -> Case:
    src = _fp8(s)
    (src / "config.json").unlink()
    (src / "config.json").mkdir()
    return Case(src, ["config.json", "is a directory"])


# --- tensors against the config ---------------------------------------------------------------------

@case("fp8-weight-without-its-scale")
def _no_scale(s: Sources) -> Case:
    src = _fp8(s)
    name = f"{O_PROJ}.weight_scale_inv"
    edit_tensors(src / SHARD2, lambda t: t.pop(name))
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].pop(name))
    return Case(src, [f"missing tensor {name}", "[3, 2]"])


@case("fp8-scale-of-the-wrong-shape")
def _scale_shape(s: Sources) -> Case:
    src = _fp8(s)
    name = f"{O_PROJ}.weight_scale_inv"
    edit_tensors(src / SHARD2, lambda t: t.__setitem__(name, torch.rand(2, 3) + 0.1))
    return Case(src, [SHARD2, name, "[2, 3]", "expected [3, 2]"])


@case("fp8-scale-of-the-wrong-dtype")
def _scale_dtype(s: Sources) -> Case:
    src = _fp8(s)
    name = f"{O_PROJ}.weight_scale_inv"
    # the scale's bytes labelled int32: ATOM would re-view them into its fp32 parameter (same width), so it is
    # refused (bf16 and fp16 scales are read: they convert to fp32 exactly, tests/test_layout.py)
    edit_tensors(src / SHARD2, lambda t: t.__setitem__(name, t[name].view(torch.int32)))
    return Case(src, [SHARD2, name, "int32", "expected float32"])


@case("tensor-shape-disagrees-with-config")
def _tensor_shape(s: Sources) -> Case:
    src = _fp8(s)
    name = "model.layers.2.post_attention_layernorm.weight"
    f = shard_of(src, name)
    edit_tensors(src / f, lambda t: t.__setitem__(name, torch.randn(321).to(torch.bfloat16)))
    return Case(src, [f, name, "[321]", "expected [320]"])


@case("mxfp4-scale-of-the-wrong-dtype")
def _mx_scale_dtype(s: Sources) -> Case:
    src = clone(s.mxfp4, s.tmp / "src")
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    f = shard_of(src, name)
    edit_tensors(src / f, lambda t: t.__setitem__(name, t[name].float()))
    return Case(src, [f, name, "torch.float32", "expected uint8"])


@case("mxfp4-weight-of-the-wrong-shape")
def _mx_weight_shape(s: Sources) -> Case:
    src = clone(s.mxfp4, s.tmp / "src")
    name = "model.layers.2.mlp.experts.0.down_proj.weight"
    f = shard_of(src, name)
    edit_tensors(src / f, lambda t: t.__setitem__(name, torch.randint(0, 256, (256, 256), dtype=torch.uint8)))
    return Case(src, [f, name, "[256, 256]", "expected [256, 128]"])


@case("quark-exclude-is-a-string")
def _quark_exclude(s: Sources) -> Case:
    src = clone(s.mxfp4, s.tmp / "src")
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("exclude", "lm_head"))
    return Case(src, ["config.json", "quantization_config.exclude", "'lm_head'"])


@case("quark-global-config-is-a-string")
def _quark_global(s: Sources) -> Case:
    src = clone(s.mxfp4, s.tmp / "src")
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("global_quant_config", "mxfp4"))
    return Case(src, ["config.json", "quantization_config.global_quant_config", "'mxfp4'"])


@case("quark-weight-spec-is-a-list")
def _quark_weight(s: Sources) -> Case:
    src = clone(s.mxfp4, s.tmp / "src")
    edit_json(src / "config.json", lambda c: c["quantization_config"]["global_quant_config"].__setitem__("weight", [1]))
    return Case(src, ["config.json", "weight is a list", "global_quant_config"])


# --- values, checked as they stream (mid-conversion: the partial output must be removed) --------------

def poke(src: Path, name: str, index: tuple[int, ...], value: float | int) -> str:
    """Set one element of a stored tensor: a float value, or the raw byte of an fp8/uint8 tensor.
    Returns the file holding it."""
    f = shard_of(src, name) if (src / INDEX_NAME).exists() else SINGLE

    def edit(t: dict[str, torch.Tensor]) -> None:
        x = t[name]
        (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x)[index] = value
    edit_tensors(src / f, edit)
    return f


def _value_case(name: str, base: str, tensor: str, index: tuple[int, ...], value: float | int, expect: list[str],
                args: tuple[str, ...] = ()) -> None:
    @case(name)
    def make(s: Sources) -> Case:
        src = {"fp8": _fp8, "bf16": _bf16, "mxfp4": lambda s: clone(s.mxfp4, s.tmp / "src")}[base](s)
        f = poke(src, tensor, index, value)
        return Case(src, [f, f"tensor {tensor}", f"first at index {list(index)}", *expect, "--allow-nonfinite"],
                    list(args))


_value_case("value-fp8-block-scale-nan", "fp8", f"{KV_B}.weight_scale_inv", (1, 0), float("nan"), ["NaN", "value nan"])
_value_case("value-fp8-block-scale-inf", "fp8", f"{KV_B}.weight_scale_inv", (0, 0), float("inf"), ["NaN or Inf", "value inf"])
_value_case("value-fp8-block-scale-zero", "fp8", f"{O_PROJ}.weight_scale_inv", (2, 1), 0.0, ["zero or negative", "value 0.0"])
_value_case("value-fp8-block-scale-negative", "fp8", f"{O_PROJ}.weight_scale_inv", (1, 1), -1e-3,
            ["zero or negative", "value -0.001"])
_value_case("value-fp8-nan-code-0x7f", "fp8", f"{O_PROJ}.weight", (5, 7), 0x7F, ["fp8 NaN code", "byte 0x7F"])
_value_case("value-fp8-nan-code-0xff-gfx942", "fp8", "model.layers.0.self_attn.q_b_proj.weight", (100, 3), 0xFF,
            ["fp8 NaN code", "byte 0xFF", "e4m3fnuz"], ("--target", "gfx942"))
# tp=2: rank 1 reads down_proj's columns 128..255 and gate/up's rows 128..255; the index is the stored one
_value_case("value-fp8-expert-nan-code-tp2", "fp8", "model.layers.2.mlp.experts.5.down_proj.weight", (300, 200), 0xFF,
            ["byte 0xFF"], ("--tp", "2"))
# gfx942 leaves an fp8 expert weight's check to its fnuz pass (postload.py): the same report, for
# w2 (down, columns), the second half of w13 (up, rows) and a whole expert at tp=1
_value_case("value-fp8-expert-nan-code-gfx942-down-tp2", "fp8", "model.layers.2.mlp.experts.5.down_proj.weight",
            (300, 200), 0xFF, ["byte 0xFF", "e4m3fnuz", "(1 such element(s)"], ("--tp", "2", "--target", "gfx942"))
_value_case("value-fp8-expert-nan-code-gfx942-up-tp2", "fp8", "model.layers.1.mlp.experts.3.up_proj.weight",
            (200, 37), 0x7F, ["byte 0x7F", "shape [128, 320] from index [128])"], ("--tp", "2", "--target", "gfx942", "--workers", "2"))
_value_case("value-fp8-expert-nan-code-gfx942-gate-tp1", "fp8", "model.layers.2.mlp.experts.0.gate_proj.weight",
            (3, 5), 0xFF, ["byte 0xFF"], ("--target", "gfx942"))
# gfx950 scans the shuffled expert weight for NaN codes and then runs the deferred check (postload.py
# _to_target_scanned): the same reports as the read's own check
_value_case("value-fp8-expert-nan-code-gfx950-down-tp2", "fp8", "model.layers.2.mlp.experts.5.down_proj.weight",
            (300, 200), 0x7F, ["byte 0x7F", "(1 such element(s)", "shape [320, 128] from index [0, 128])"],
            ("--tp", "2", "--target", "gfx950"))
_value_case("value-fp8-expert-nan-code-gfx950-up-tp2", "fp8", "model.layers.1.mlp.experts.3.up_proj.weight",
            (200, 37), 0xFF, ["byte 0xFF", "shape [128, 320] from index [128])"], ("--tp", "2", "--target", "gfx950", "--workers", "2"))
_value_case("value-fp8-expert-nan-code-gfx950-gate-tp1", "fp8", "model.layers.2.mlp.experts.0.gate_proj.weight",
            (3, 5), 0x7F, ["byte 0x7F"], ("--target", "gfx950"))
_value_case("value-fp8-expert-scale-nan-tp2", "fp8", "model.layers.1.mlp.experts.6.up_proj.weight_scale_inv", (1, 2),
            float("nan"), ["NaN"], ("--tp", "2"))
_value_case("value-bf16-weight-nan", "bf16", "model.layers.0.self_attn.q_b_proj.weight", (3, 4), float("nan"), ["NaN"])
_value_case("value-bf16-expert-minus-inf", "bf16", "model.layers.2.mlp.experts.1.down_proj.weight", (17, 33),
            float("-inf"), ["value -inf"])
_value_case("value-bf16-norm-nan", "bf16", "model.norm.weight", (7,), float("nan"), ["NaN"])
_value_case("value-router-fp32-inf", "bf16", "model.layers.1.mlp.gate.weight", (2, 9), float("inf"), ["value inf"])
_value_case("value-correction-bias-nan", "fp8", "model.layers.2.mlp.gate.e_score_correction_bias", (3,), float("nan"),
            ["NaN"])
_value_case("value-embedding-nan", "fp8", "model.embed_tokens.weight", (500, 1), float("nan"), ["NaN"])
_value_case("value-lm-head-inf-tp2", "bf16", "lm_head.weight", (400, 2), float("inf"), ["value inf"], ("--tp", "2"))
_value_case("value-mxfp4-e8m0-nan", "mxfp4", "model.layers.1.mlp.experts.3.gate_proj.weight_scale", (3, 1), 0xFF,
            ["e8m0 NaN", "byte 0xFF"])


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def base_digests(tiny_checkpoint: Callable[..., Path], mxfp4_source: Path) -> dict[Path, dict[str, str]]:
    """The session fixtures' digests, taken before any case clones them."""
    return {p: tree_digest(p) for p in (tiny_checkpoint(PRESET, "fp8"), tiny_checkpoint(PRESET, "bf16"), mxfp4_source)}


@pytest.fixture
def sources(tiny_checkpoint: Callable[..., Path], mxfp4_source: Path, tmp_path: Path,
            base_digests: dict[Path, dict[str, str]]) -> Sources:
    return Sources(tiny_checkpoint(PRESET, "fp8"), tiny_checkpoint(PRESET, "bf16"), mxfp4_source, tmp_path)


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60, len(CASES)


def test_fixtures_convert(sources: Sources, tmp_path: Path) -> None:
    """The unmutated fixtures convert (through the same clone), so every refusal is the mutation's."""
    for i, base in enumerate((sources.fp8, sources.bf16, sources.mxfp4)):
        src = clone(base, tmp_path / f"ok{i}")
        r = run_cli(["convert", src, tmp_path / f"out{i}"])
        assert r.code == 0, r.text


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input(name: str, sources: Sources, tmp_path: Path, base_digests: dict[Path, dict[str, str]]) -> None:
    c = CASES[name](sources)
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    r = assert_refused(["convert", c.src, dst, *c.args], src=c.src, dst=dst, expect=c.expect)
    if c.max_lines is not None:
        lines = [line for line in r.err.splitlines() if line.strip()]
        assert len(lines) <= c.max_lines, r.err
    for base, digest in base_digests.items():  # hard links share their bytes with the session fixtures
        assert tree_digest(base) == digest, f"{name} changed the session fixture {base}"


def test_unreadable_shard(sources: Sources, tmp_path: Path) -> None:
    """Permission denied on a shard: exit 2 naming the path. As root every file is readable,
    so there the conversion runs as `nobody` (setpriv) in a subprocess, in a tree under /tmp
    that `nobody` may enter."""
    root = tmp_path
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot make a file unreadable")
        root = Path(tempfile.mkdtemp(prefix="atom-convert-hostile-", dir="/tmp"))
        os.chmod(root, 0o755)
    try:
        src = Path(shutil.copytree(sources.fp8, root / "src"))  # a real copy: modes change below
        for f in src.iterdir():
            os.chmod(f, 0 if f.name == SHARD2 else 0o644)
        dst = root / "out" / "dst"
        dst.parent.mkdir()
        expect = [str(src / SHARD2), "permission denied"]
        if os.geteuid() != 0:
            assert_refused(["convert", src, dst], src=src, dst=dst, expect=expect)
            return
        os.chmod(src, 0o755)
        os.chmod(dst.parent, 0o777)
        before = tree_digest(src)
        code = "import sys; from atom_convert.cli import main; main(sys.argv[1:])"
        env = dict(os.environ, HOME="/tmp",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
        probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                                "import atom_convert.cli"], capture_output=True, text=True, env=env, timeout=300)
        if probe.returncode != 0:  # e.g. a checkout under a 0700 folder (mktemp -d): nobody cannot import it
            pytest.skip(f"the unprivileged user cannot import atom_convert here: {probe.stderr.strip()[-200:]}")
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code,
                            "convert", str(src), str(dst)], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 2, p.stdout + p.stderr
        for e in expect:
            assert e in p.stderr, p.stderr
        assert os.listdir(dst.parent) == [], os.listdir(dst.parent)
        assert tree_digest(src) == before
    finally:
        if root != tmp_path:
            shutil.rmtree(root)


def test_allow_nonfinite_converts_and_records_each_tensor(sources: Sources, tmp_path: Path) -> None:
    """The override: the same bad values convert, each tensor is recorded once (not per rank) in
    the manifest with its first bad index, the CLI says so, and the output passes verify's checks."""
    src = _fp8(sources)
    f1 = poke(src, f"{KV_B}.weight_scale_inv", (1, 0), float("nan"))
    f2 = poke(src, f"{O_PROJ}.weight", (5, 7), 0x7F)
    dst = tmp_path / "dst"
    r = run_cli(["convert", src, dst, "--tp", "2", "--allow-nonfinite", "--workers", "3"])  # records from processes
    assert r.code == 0, r.text
    assert "2 tensor(s)" in r.text and "atom_manifest.json" in r.text, r.text
    checks = json.loads((dst / "atom_manifest.json").read_text())["value_checks"]
    assert checks["allow_nonfinite"] is True
    got = sorted((w["file"], w["tensor"], w["first_index"]) for w in checks["warnings"])
    assert got == sorted([(f1, f"{KV_B}.weight_scale_inv", [1, 0]), (f2, f"{O_PROJ}.weight", [5, 7])])
    assert check_files(dst).ok


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_allow_nonfinite_records_expert_nan_codes_alike_on_both_targets(sources: Sources, tmp_path: Path,
                                                                        target: str) -> None:
    """An fp8 expert's NaN codes, found in the shuffled weight on gfx950 and in the fnuz pass on gfx942
    (postload.py), then reported by the source's check: the same records (file, tensor, stored index,
    value), one per tensor though both ranks' slices of up_proj hold one (the smallest index kept), and
    the output passes verify's checks."""
    src = _fp8(sources)
    pokes = [("model.layers.1.mlp.experts.2.up_proj.weight", (5, 9), 0x7F),
             ("model.layers.1.mlp.experts.2.up_proj.weight", (250, 1), 0xFF),  # the same tensor, rank 1's rows
             ("model.layers.2.mlp.experts.6.down_proj.weight", (17, 130), 0xFF)]
    files = {name: poke(src, name, index, byte) for name, index, byte in pokes}
    dst = tmp_path / "dst"
    r = run_cli(["convert", src, dst, "--tp", "2", "--target", target, "--allow-nonfinite", "--workers", "2"])
    assert r.code == 0, r.text
    checks = json.loads((dst / "atom_manifest.json").read_text())["value_checks"]
    got = sorted((w["file"], w["tensor"], w["first_index"], w["value"]) for w in checks["warnings"])
    up, down = (p[0] for p in pokes[::2])
    assert got == sorted([(files[up], up, [5, 9], "byte 0x7F"), (files[down], down, [17, 130], "byte 0xFF")]), got
    assert check_files(dst).ok


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_verify_source_of_an_allow_nonfinite_conversion(sources: Sources, tmp_path: Path, target: str) -> None:
    """verify --source on such a conversion: the elements whose source value is non-finite are left
    out (on gfx942 an e4m3fn NaN byte reads as a finite fnuz value), each tensor named in a note; the
    rest is still compared exactly, and a non-finite value the manifest does not record is a problem."""
    src = _fp8(sources)
    poke(src, f"{KV_B}.weight_scale_inv", (1, 0), float("nan"))
    poke(src, f"{O_PROJ}.weight", (5, 7), 0x7F)
    dst = tmp_path / "dst"
    r = run_cli(["convert", src, dst, "--tp", "2", "--target", target, "--allow-nonfinite"])
    assert r.code == 0, r.text
    r = run_cli(["verify", dst, "--source", src])
    assert r.code == 0, r.text
    assert "o_proj.weight: 1 element(s) not compared on rank" in r.text, r.text
    assert "W_K/W_V not compared" in r.text and "forward comparison skipped: 2 source tensor(s)" in r.text, r.text
    # A changed finite element of the same tensor is still found.
    f = shard_of(src, f"{O_PROJ}.weight")
    byte = int(load_file(str(src / f))[f"{O_PROJ}.weight"].view(torch.uint8)[6, 7])
    poke(src, f"{O_PROJ}.weight", (6, 7), byte ^ 0x01)
    r = run_cli(["verify", dst, "--source", src])
    assert r.code == 3 and "o_proj.weight differs from its sources in 1 element(s)" in r.text, r.text  # 3: failed
    poke(src, f"{O_PROJ}.weight", (6, 7), byte)
    # A non-finite value the conversion did not meet: the source changed.
    poke(src, f"{O_PROJ}.weight_scale_inv", (0, 0), float("inf"))
    r = run_cli(["verify", dst, "--source", src])
    assert r.code == 3 and f"{O_PROJ}.weight_scale_inv hold non-finite values that the conversion's manifest does " \
        "not record" in r.text, r.text


def test_clean_conversion_records_no_warning(converted: Callable[..., Path]) -> None:
    m = json.loads((converted(PRESET, "fp8", "gfx950") / "atom_manifest.json").read_text())
    assert m["value_checks"] == {"allow_nonfinite": False, "warnings": []}


def test_api_raises_bad_input_for_a_nan_scale(sources: Sources, tmp_path: Path) -> None:
    src = _fp8(sources)
    poke(src, f"{KV_B}.weight_scale_inv", (3, 0), float("nan"))  # kv_b [512, 128]: a [4, 1] grid
    with pytest.raises(BadInputError, match=r"kv_b_proj\.weight_scale_inv.*first at index \[3, 0\]"):
        atom_convert.convert(src, tmp_path / "dst")
    assert os.listdir(tmp_path) == ["src"]  # the partial output of a mid-stream failure is gone
    m = atom_convert.convert(src, tmp_path / "dst2", allow_nonfinite=True)
    assert [w["first_index"] for w in m["value_checks"]["warnings"]] == [[3, 0]]


def test_fp8_check_against_every_code() -> None:
    """All 256 e4m3fn codes, one at a time, against torch's own decoding (isnan)."""
    for code in range(256):
        t = torch.full((3, 5), 0x38, dtype=torch.uint8)
        t[2, 4] = code
        w = t.view(torch.float8_e4m3fn)
        nan = bool(torch.isnan(w.float()).any())
        guard = ValueGuard(allow_nonfinite=True)
        guard.check("w", "f", w)
        assert bool(guard.warnings) == nan, hex(code)
        if nan:
            assert guard.warnings[0]["first_index"] == [2, 4]


def test_records_do_not_depend_on_the_order_slices_are_checked() -> None:
    """Ranks and workers check a tensor's slices in any order: the record kept per tensor and
    problem is the one with the smallest stored index, whether the slices reach one guard or come
    from worker processes' guards merged in either order."""
    gen = torch.Generator().manual_seed(9)
    t = torch.randn(8, 6, generator=gen)
    t[1, 4] = float("nan")
    t[6, 0] = float("inf")
    slices = [(t[4:], (4,)), (t[:4], (0,))]
    want = ValueGuard(allow_nonfinite=True)
    for part, origin in slices[::-1]:  # in stored order
        want.check("w", "f", part, origin)
    for order in (slices, slices[::-1]):
        one = ValueGuard(allow_nonfinite=True)
        for part, origin in order:
            one.check("w", "f", part, origin)
        assert one.summary() == want.summary()
        assert [w["first_index"] for w in one.summary()["warnings"]] == [[1, 4]]
        parent = ValueGuard(allow_nonfinite=True)
        for part, origin in order:
            worker = ValueGuard(allow_nonfinite=True)
            worker.after_fork()
            worker.check("w", "f", part, origin)
            parent.merge(worker.take())
        assert parent.summary() == want.summary()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_check_against_every_bit_pattern(dtype: torch.dtype) -> None:
    """bf16 and fp16 exhaustively (fp32: a random sample plus the special patterns), against
    torch.isfinite: all finite patterns together pass, each non-finite one is caught alone."""
    gen = torch.Generator().manual_seed(5)
    if dtype == torch.float32:
        bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int64),
                          torch.tensor([0x7F800000, -0x00800000, 0x7FC00000, 0x7F800001, -1])]).to(torch.int32)
    else:
        bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    finite = torch.isfinite(values)
    guard = ValueGuard()
    guard.check("t", "f", values[finite])  # raises on any false alarm
    bad = values[~finite]
    assert bad.numel() >= 5
    base = torch.randn(64, generator=gen).to(dtype)
    for v in bad:
        t = base.clone()
        t[37] = v
        guard = ValueGuard(allow_nonfinite=True)
        guard.check("t", "f", t)
        assert [w["first_index"] for w in guard.warnings] == [[37]], (dtype, v)


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
def test_real_configs_and_their_spellings_are_accepted(preset: str) -> None:
    """No check refuses a real config: every preset (full-size ones are the released config.json
    files), with every integer written as a float (7168.0) and every optional key as null."""
    cfg = load_preset(preset)
    spec = ModelSpec.from_config(cfg)
    detect_format(cfg)
    as_floats = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in cfg.items()}
    assert ModelSpec.from_config(as_floats) == spec
    optional = ("first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "topk_method", "scoring_func",
                "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps",
                "tie_word_embeddings", "rope_scaling", "quantization_config")
    ModelSpec.from_config(dict(cfg, **{k: None for k in optional}))
    detect_format(dict(cfg, quantization_config=None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "columns", "1-d"])
def test_float_check_of_a_large_tensor_piece_by_piece(dtype: torch.dtype, layout: str) -> None:
    """A tensor larger than two check pieces (values.CHECK_PIECE_BYTES) is checked piece by piece: a NaN or
    an infinity in any piece, the last one's last element included, is found and reported at its index
    (contiguous, a column slice of a wider matrix, 1-D), and a finite tensor passes."""
    from atom_convert.files import values

    gen = torch.Generator().manual_seed(11)
    rows = 3 * values.CHECK_PIECE_BYTES // (96 * dtype.itemsize) + 7  # a little over three pieces
    whole = torch.randn(rows, 128, generator=gen).to(dtype)
    t = {"contiguous": whole[:, :96].contiguous(), "columns": whole[:, 16:112], "1-d": whole[:, :96].reshape(-1)}[layout]
    assert t.numel() * t.element_size() > 2 * values.CHECK_PIECE_BYTES
    ValueGuard().check("t", "f", t)
    flat = t.reshape(-1).numel()
    for at, bad in ((flat - 1, float("nan")), (flat // 2 + 3, float("-inf")), (5, float("inf"))):
        u = t.clone() if layout != "columns" else whole.clone()[:, 16:112]
        idx = list(torch.unravel_index(torch.tensor(at), u.shape))
        u[tuple(idx)] = bad
        with pytest.raises(BadInputError, match=rf"first at index \[{', '.join(str(int(i)) for i in idx)}\]"):
            ValueGuard().check("t", "f", u)
