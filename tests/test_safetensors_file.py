"""safetensors_file.py, the one reader of a checkpoint's files (issue 27): the header rules every
reader shares (source.read_safetensors_header, the source mapping, transfer.read_header, the
source fingerprint), the files a checkpoint consists of, and its side files under one symlink policy.

Files are crafted byte by byte (a header length, a JSON document, a few data bytes); only one test
writes a file as large as safetensors' limit (100,000,000 header bytes, to show it is accepted).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import pytest

from atom_convert.serve import transfer
from atom_convert.errors import BadInputError, CheckpointError
from atom_convert.store.fingerprint import source_fingerprint
from atom_convert.hub.repo import allow_patterns, auto_map_files
from atom_convert.files.sidefiles import remote_code_files
from atom_convert.files.source import SourceCheckpoint, read_safetensors_header
from hostile_util import assert_refused, run_cli

LIMIT = 100_000_000  # safetensors' MAX_HEADER_SIZE, in bytes (not 100 MiB = 104,857,600)


def _module():
    from atom_convert.files import safetensors as safetensors_file

    return safetensors_file


def _source_mapping(path: Path) -> int:
    from atom_convert.files.source import _MappedFile

    return _MappedFile(path).data_start


# Every reader of a safetensors header; each must refuse what the others refuse.
READERS: dict[str, Callable[[Path], Any]] = {
    "source": lambda p: read_safetensors_header(p),
    "transfer": lambda p: transfer.read_header(p),
    "module": lambda p: _module().read_header(p),
}
LENGTH_READERS = {**READERS, "source-mapping": _source_mapping}


def st_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A file: the 8-byte length (`length`, default the JSON's), the JSON (or raw bytes), the data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def u8(begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def refusal(reader: str, path: Path) -> str:
    with pytest.raises(BadInputError) as e:
        LENGTH_READERS[reader](path)
    return str(e.value)


# ------------------------------------------------------------------------------------------------
# header length: safetensors' own limit, checked before the header is read
# ------------------------------------------------------------------------------------------------


def test_limit_is_safetensors_own() -> None:
    sf = _module()
    assert sf.MAX_HEADER == LIMIT
    assert sf.check_length(struct.pack("<Q", LIMIT), 8 + LIMIT, "x.safetensors") == LIMIT
    with pytest.raises(CheckpointError, match=f"header length {LIMIT + 1} bytes exceeds safetensors' limit of {LIMIT}"):
        sf.check_length(struct.pack("<Q", LIMIT + 1), 8 + LIMIT + 1, "x.safetensors")


@pytest.mark.parametrize("reader", sorted(LENGTH_READERS))
@pytest.mark.parametrize("size", ["length-only", "sparse-full-size"])
def test_header_one_byte_over_the_limit_is_refused_before_it_is_read(tmp_path: Path, reader: str, size: str) -> None:
    """A length of 100,000,001 is refused for the limit: with a file of only the 8 length bytes (so
    nothing past them was read), and with a (sparse) file large enough to hold that header."""
    f = st_file(tmp_path / "over.safetensors", b"", length=LIMIT + 1)
    if size == "sparse-full-size":
        os.truncate(f, 8 + LIMIT + 1)
    msg = refusal(reader, f)
    assert "over.safetensors" in msg and f"header length {LIMIT + 1}" in msg and f"limit of {LIMIT} bytes" in msg, msg


@pytest.fixture(scope="module")
def at_the_limit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid file of no tensors whose header is exactly 100,000,000 bytes (written once)."""
    return st_file(tmp_path_factory.mktemp("limit") / "at.safetensors", b"{}" + b" " * (LIMIT - 2))


@pytest.mark.parametrize("reader", sorted(LENGTH_READERS))
def test_header_of_exactly_the_limit_is_accepted(at_the_limit: Path, reader: str) -> None:
    start = LENGTH_READERS[reader](at_the_limit)
    if reader == "source":
        assert start == ({}, 8 + LIMIT)
    elif reader == "transfer":
        assert (start.data_start, start.entries) == (8 + LIMIT, {})
    elif reader == "module":
        assert (start.data_start, start.tensors, start.size) == (8 + LIMIT, {}, 8 + LIMIT)
    else:
        assert start == 8 + LIMIT


@pytest.mark.parametrize("reader", sorted(LENGTH_READERS))
def test_file_shorter_than_its_length_or_than_8_bytes(tmp_path: Path, reader: str) -> None:
    msg = refusal(reader, st_file(tmp_path / "short.safetensors", b"{}", length=50))
    assert "short.safetensors" in msg and "header length 50 bytes" in msg and "file size 10 bytes" in msg, msg
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    msg = refusal(reader, tmp_path / "tiny.safetensors")
    assert "tiny.safetensors" in msg and "3 bytes" in msg and "not a safetensors file" in msg, msg


# ------------------------------------------------------------------------------------------------
# the header's JSON and its entries
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("doc,kind", [(b"[1]", "a list"), (b'"tensors"', "a string"), (b"null", "null"),
                                      (b"3", "an integer")])
def test_non_object_json_is_refused(tmp_path: Path, reader: str, doc: bytes, kind: str) -> None:
    msg = refusal(reader, st_file(tmp_path / "doc.safetensors", doc))
    assert "doc.safetensors" in msg and kind in msg and "expected a JSON object" in msg, msg


@pytest.mark.parametrize("reader", sorted(READERS))
def test_overlapping_entries_are_refused(tmp_path: Path, reader: str) -> None:
    f = st_file(tmp_path / "ovl.safetensors", {"a": u8(0, 8), "b": u8(4, 12)}, bytes(12))
    msg = refusal(reader, f)
    assert "ovl.safetensors" in msg and "'b' (bytes 4..12) overlaps tensor 'a' (which ends at 8)" in msg, msg


@pytest.mark.parametrize("reader", sorted(READERS))
def test_offsets_past_the_end_are_refused(tmp_path: Path, reader: str) -> None:
    header = {"a": u8(0, 8), "b": u8(8, 16)}
    f = st_file(tmp_path / "cut.safetensors", header, bytes(12))
    start = 8 + len(json.dumps(header))
    msg = refusal(reader, f)
    assert "cut.safetensors" in msg and f"data ends at byte {start + 16}" in msg and f"file has {start + 12}" in msg, msg


@pytest.mark.parametrize("entry,expect", [
    ({"dtype": 7, "shape": [2], "data_offsets": [0, 2]}, ["dtype is an integer 7", "string"]),
    ({"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}, ["shape [-2]", "integers >= 0"]),
    ({"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}, ["shape [True]", "integers >= 0"]),
    ({"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}, ["data_offsets [2, 0]", "begin <= end"]),
    ({"dtype": "U8", "shape": [2], "data_offsets": [0]}, ["data_offsets [0]", "[begin, end]"]),
    ({"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}, ["span 2 bytes", "BF16 x shape [2] is 4 bytes"]),
    ({"dtype": "U8", "shape": [2]}, ["entry has no data_offsets"]),
    ([0, 2], ["entry is a list", "dtype, shape, data_offsets"]),
], ids=["dtype-number", "shape-negative", "shape-bool", "begin-after-end", "offsets-one", "size-mismatch",
        "no-offsets", "entry-list"])
def test_each_entry_is_checked(tmp_path: Path, entry: Any, expect: list[str]) -> None:
    """Every reader says the same (they share one validation): the tensor named, expected vs actual."""
    for reader in sorted(READERS):
        msg = refusal(reader, st_file(tmp_path / "e.safetensors", {"w": entry}, bytes(2)))
        assert "e.safetensors" in msg and "'w'" in msg and all(e in msg for e in expect), (reader, msg)


@pytest.mark.parametrize("header,data,expect", [
    ({"a": u8(0, 4), "b": u8(6, 8)}, 8, ["bytes 4..6", "belong to no tensor", "gap before 'b'"]),
    ({"a": u8(0, 4)}, 6, ["2 bytes after the last tensor"]),
    ({"__metadata__": {"format": 1}, "a": u8(0, 4)}, 4, ["__metadata__['format'] is an integer", "expected a string"]),
    (b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "a": {}}', 4, ["'a' appears twice"]),
    (b'{"a": ', 4, ["not valid JSON"]),
    (b"[" * 100_000, 4, ["not valid JSON"]),
], ids=["gap", "trailing-bytes", "metadata-not-strings", "duplicate-key", "not-json", "nested-too-deeply"])
def test_layout_and_json_problems(tmp_path: Path, header: Any, data: int, expect: list[str]) -> None:
    sf = _module()
    with pytest.raises(CheckpointError) as e:
        sf.read_header(st_file(tmp_path / "l.safetensors", header, bytes(data)))
    assert "l.safetensors" in str(e.value) and all(x in str(e.value) for x in expect), str(e.value)


def test_a_converted_file_refusal_says_convert_again(tmp_path: Path) -> None:
    """transfer.read_header reads converted shards: the same checks, the advice for a DST."""
    from atom_convert.errors import ConvertedCheckError

    with pytest.raises(ConvertedCheckError, match="convert again") as e:
        transfer.read_header(st_file(tmp_path / "r.safetensors", {"a": u8(0, 8), "b": u8(4, 12)}, bytes(12)))
    assert str(tmp_path / "r.safetensors") in str(e.value)
    with pytest.raises(ConvertedCheckError, match="does not exist.*\n.*convert again"):
        transfer.read_header(tmp_path / "absent.safetensors")


def test_every_reader_agrees_on_a_real_shard(tiny_checkpoint: Callable[..., Path]) -> None:
    """One valid file: the same header, data start and bytes hashed, whichever reader reads it."""
    sf = _module()
    src = tiny_checkpoint("tiny-deepseek-v3", "fp8")
    name = sorted(p.name for p in src.glob("*.safetensors"))[-1]
    h = sf.read_header(src / name)
    raw = (src / name).read_bytes()[:h.data_start]
    assert h.raw == raw and h.size == (src / name).stat().st_size
    assert read_safetensors_header(src / name) == (h.header, h.data_start)
    t = transfer.read_header(src / name)
    assert (t.data_start, t.file_size) == (h.data_start, h.size)
    assert t.entries == {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in h.tensors.items()}
    assert _source_mapping(src / name) == h.data_start
    assert source_fingerprint(src).parts[name] == f"{h.size}:{hashlib.sha256(raw).hexdigest()}"
    assert sf.header_bytes(src / name) == (h.size, raw)


# ------------------------------------------------------------------------------------------------
# the files of a checkpoint: weights, side files, one symlink policy
# ------------------------------------------------------------------------------------------------


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def test_weight_files(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    sf = _module()
    fp8, bf16 = tiny_checkpoint("tiny-deepseek-v3", "fp8"), tiny_checkpoint("tiny-deepseek-v3", "bf16")
    index, files, wm = sf.weight_files(fp8)
    assert index == sf.INDEX_NAME and files == sorted(set(wm.values())) and len(files) == 2
    assert sf.weight_files(bf16) == (None, [sf.SINGLE_NAME], None)
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json") as e:
        sf.weight_files(tmp_path)
    assert "Point SRC at the folder" in str(e.value)
    # shards without their index: named, with what to do
    shutil.copy(fp8 / files[0], tmp_path / files[0])
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no model.safetensors and no model.safetensors.index.json, but 2 other "
                                              r"\.safetensors file\(s\): consolidated.safetensors, model-00001") as e:
        sf.weight_files(tmp_path)
    assert "needs its model.safetensors.index.json" in str(e.value) and "must be named model.safetensors" in str(e.value)
    for f in (files[0], "consolidated.safetensors"):
        (tmp_path / f).unlink()
    (tmp_path / sf.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="'../x.safetensors' leaves the checkpoint folder"):
        sf.weight_files(tmp_path)


def _folder(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"auto_map": {
        "AutoConfig": "modeling_x.XConfig", "AutoModel": "modeling_x.XModel",
        "AutoModelForCausalLM": "org/other--remote_y.YModel", "AutoProcessor": "absent_z.Z"}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["modeling_x.Tok", None]}}))
    for n in ("modeling_x.py", "helper.py", "tokenizer.json", "x.tiktoken", "README.md", "notes.txt"):
        (d / n).write_text(f"# {n}\n")
    (d / "sub").mkdir()
    (d / "sub" / "deep.py").write_text("# not at the top: not carried\n")
    (d / "dir.py").mkdir()  # a directory is no side file
    return d


def test_auto_map_module_is_selected_once(tmp_path: Path) -> None:
    """modeling_x.py is named by three auto_map entries of two configs and is a top-level *.py: one
    side file, one download pattern, one part of the fingerprint."""
    sf = _module()
    d = _folder(tmp_path)
    side = sf.select_side_files(d)
    assert side.names == ["config.json", "helper.py", "modeling_x.py", "tokenizer.json", "tokenizer_config.json",
                          "x.tiktoken"]
    assert side.refused == {}
    assert side.auto_map == {"modeling_x.py": "config.json auto_map.AutoConfig",
                             "absent_z.py": "config.json auto_map.AutoProcessor"}
    assert side.code_missing == {"absent_z.py": "config.json auto_map.AutoProcessor"}
    cfg, tok = (json.loads((d / n).read_text()) for n in ("config.json", "tokenizer_config.json"))
    assert auto_map_files(cfg, tok) == ["absent_z.py", "modeling_x.py"]
    assert allow_patterns(cfg, tok).count("modeling_x.py") == 1
    assert remote_code_files(d) == (["helper.py", "modeling_x.py"], {"absent_z.py": "config.json auto_map.AutoProcessor"})
    parts = list(source_fingerprint(d).parts)
    assert parts == side.names  # no weights here: the side files, each once, in order


def test_a_side_file_symlinked_outside_src_is_refused(tmp_path: Path) -> None:
    sf = _module()
    d = _folder(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.json").write_text('{"secret": 1}')
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    (d / "inside.py").symlink_to(d / "helper.py")  # a link that stays inside SRC is followed
    (d / "gone.py").symlink_to(d / "nowhere.py")  # a dangling one inside is no file
    side = sf.select_side_files(d)
    assert "inside.py" in side.names and "tokenizer.json" not in side.names and "gone.py" not in side.names
    assert list(side.refused) == ["tokenizer.json"]
    with pytest.raises(CheckpointError) as e:
        sf.side_files(d)
    assert all(s in str(e.value) for s in ("tokenizer.json", str(outside / "tokenizer.json"), "outside")), str(e.value)
    assert source_fingerprint(d).parts["tokenizer.json"] == "refused"  # never opened, so never hashed


def test_hugging_face_cache_blobs_are_inside(tmp_path: Path) -> None:
    """A cache snapshot links its files into ../../blobs: the one place outside SRC that is read."""
    sf = _module()
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs" / "h1").write_text("{}")
    (snap / "tokenizer.json").symlink_to("../../blobs/h1")
    (tmp_path / "other").write_text("{}")
    (snap / "vocab.json").symlink_to(tmp_path / "other")
    assert sf.member_problem(snap, "tokenizer.json", "side file") is None
    assert sf.member_problem(snap, "vocab.json", "side file")[0] == "outside"
    side = sf.select_side_files(snap)
    assert side.names == ["tokenizer.json"] and list(side.refused) == ["vocab.json"]


def test_convert_refuses_a_side_file_symlinked_outside_src(tiny_checkpoint: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """Through the CLI: exit 2 naming the file and its target, before any work (nothing beside DST),
    SRC as it was; the same source with the file copied in converts."""
    src = clone(tiny_checkpoint("tiny-deepseek-v3", "bf16"), tmp_path / "src")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.json").write_text("{}")
    (src / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    assert_refused(["convert", src, dst], src=src, dst=dst,
                   expect=["tokenizer.json", str(outside / "tokenizer.json"), "outside the checkpoint folder"])
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        SourceCheckpoint(src)
    (src / "tokenizer.json").unlink()
    shutil.copy(outside / "tokenizer.json", src / "tokenizer.json")
    r = run_cli(["convert", src, dst])
    assert r.code == 0, r.text
    copied = json.loads((dst / "atom_manifest.json").read_text())["copied_files"]
    assert "tokenizer.json" in copied and (dst / "tokenizer.json").read_text() == "{}"
