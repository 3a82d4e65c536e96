"""A hostile corpus for the runtime side: converted directories that were truncated, bit-flipped,
header-edited or manifest-edited, and module trees that lack or add a parameter. Each case is fed to
every reader of a converted directory (verify's integrity check, inspect, `load_into`,
`open_converted`) and must be refused as bad input (a BadInputError, exit code 2) naming the file,
the tensor or entry, and what is wrong, or, where a reader is not the one to catch it, pass
harmlessly (a flipped tensor byte is verify's digest check's to catch, not the loader's).

Nothing outside a converted directory is read: a manifest that names `../x`, an absolute path or a
symlink leading out is refused before anything is opened (store/manifest.check_manifest)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import atom_convert
import atom_trees as T
from hostile_util import mkfifo_fed_later
from atom_convert.check.inspect import describe
from atom_convert.check.tensors import check_files
from atom_convert.errors import BadInputError, ConvertedCheckError
from atom_convert.serve.load import LoadMismatchError
from atom_convert.store.digest import file_digest
from atom_convert.store.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, sha256_file

PRESET, FMT, TARGET = "tiny-deepseek-v3", "bf16", "gfx950"
READERS = ("verify", "inspect", "load_into", "open_converted")


# -- editing a converted directory ---------------------------------------------------------------


def manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / MANIFEST_NAME).read_text())


def write_manifest(d: Path, m: Any) -> None:
    (d / MANIFEST_NAME).write_text(json.dumps(m, indent=1))


def edit_manifest(d: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """edit(m) changes the manifest in place (what it returns is ignored)."""
    m = manifest(d)
    edit(m)
    write_manifest(d, m)


def shard(d: Path) -> str:
    """The main set's (only) shard."""
    return sorted(f for f in manifest(d)["files"] if f.endswith(".safetensors") and "/" not in f)[0]


def split_shard(p: Path) -> tuple[dict[str, Any], bytes]:
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_shard(p: Path, header_text: str, data: bytes) -> None:
    b = header_text.encode()
    p.write_bytes(struct.pack("<Q", len(b)) + b + data)


def reseal(d: Path, rel: str) -> None:
    """Record the file's new size and digest in the manifest: only the header checks can catch it then."""
    edit_manifest(d, lambda m: m["files"].__setitem__(rel, {"bytes": (d / rel).stat().st_size,
                                                           "xxh3_blocks": file_digest(d / rel)}))


def edit_header(d: Path, edit: Callable[[dict[str, Any]], str | None]) -> None:
    rel = shard(d)
    h, data = split_shard(d / rel)
    text = edit(h)
    join_shard(d / rel, text if text is not None else json.dumps(h), data)
    reseal(d, rel)


def tensors_by_offset(h: dict[str, Any]) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def two_dim(h: dict[str, Any]) -> str:
    """A bf16 tensor with two different dimensions (a transposed shape holds as many bytes)."""
    return next(k for k in tensors_by_offset(h) if h[k]["dtype"] == "BF16" and len(h[k]["shape"]) == 2
                and h[k]["shape"][0] != h[k]["shape"][1])


# -- the cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    """expect: substrings every refusal names. outcome per reader: "refused" (a BadInputError naming
    `expect`), "ok" (nothing wrong for that reader), or "problem" (verify: a failure in its report)."""

    expect: list[str]
    outcome: dict[str, str] = field(default_factory=lambda: dict.fromkeys(READERS, "refused"))
    error: type[BaseException] = BadInputError


CASES: dict[str, Callable[[Path, Path], Case]] = {}


def case(name: str) -> Callable[[Callable[[Path, Path], Case]], Callable[[Path, Path], Case]]:
    def reg(fn: Callable[[Path, Path], Case]) -> Callable[[Path, Path], Case]:
        CASES[name] = fn
        return fn

    return reg


# bytes


@case("shard-truncated")
def _truncated(d: Path, outside: Path) -> Case:
    rel = shard(d)
    with open(d / rel, "r+b") as f:
        f.truncate((d / rel).stat().st_size - 100)
    return Case([rel, "truncated"], {"verify": "problem", "inspect": "ok", "load_into": "refused",
                                     "open_converted": "refused"})


@case("shard-is-a-fifo")
def _fifo(d: Path, outside: Path) -> Case:
    rel = shard(d)
    (d / rel).unlink()
    mkfifo_fed_later(d / rel)
    return Case([rel, "not a regular file"], {"verify": "problem", "inspect": "ok", "load_into": "refused",
                                              "open_converted": "refused"})


@case("tensor-bytes-flipped")
def _flipped(d: Path, outside: Path) -> Case:
    rel = shard(d)
    raw = bytearray((d / rel).read_bytes())
    raw[len(raw) - 10] ^= 0x5A
    (d / rel).write_bytes(bytes(raw))
    return Case([rel, "xxh3_blocks"], {"verify": "problem", "inspect": "ok", "load_into": "ok", "open_converted": "ok"})


# shard headers (the manifest's sizes and digests resealed, so that the header checks must catch them)


@case("header-dtype-edited")
def _h_dtype(d: Path, outside: Path) -> Case:
    victim: list[str] = []

    def edit(h: dict[str, Any]) -> None:
        victim.append(two_dim(h))
        h[victim[0]]["dtype"] = "F16"  # as many bytes: only a dtype comparison sees it

    edit_header(d, edit)
    return Case([shard(d), victim[0], "F16", "BF16"], {**dict.fromkeys(READERS, "refused"), "verify": "problem",
                                                       "inspect": "ok"})


@case("header-shape-edited")
def _h_shape(d: Path, outside: Path) -> Case:
    victim: list[str] = []

    def edit(h: dict[str, Any]) -> None:
        victim.append(two_dim(h))
        h[victim[0]]["shape"] = h[victim[0]]["shape"][::-1]

    edit_header(d, edit)
    return Case([shard(d), victim[0]], {**dict.fromkeys(READERS, "refused"), "verify": "problem", "inspect": "ok"})


@case("header-offsets-overlap")
def _h_overlap(d: Path, outside: Path) -> Case:
    names: list[str] = []

    def edit(h: dict[str, Any]) -> None:
        a, b = tensors_by_offset(h)[:2]
        names.extend([a, b])
        n = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        start = h[a]["data_offsets"][0]
        h[b]["data_offsets"] = [start, start + n]  # b now lies over a

    edit_header(d, edit)
    return Case([shard(d), "overlaps"], {**dict.fromkeys(READERS, "refused"), "verify": "problem", "inspect": "ok"})


@case("header-name-twice")
def _h_twice(d: Path, outside: Path) -> Case:
    name: list[str] = []

    def edit(h: dict[str, Any]) -> str:
        name.append(tensors_by_offset(h)[0])
        text = json.dumps(h)
        return text[:-1] + f", {json.dumps(name[0])}: {json.dumps(h[name[0]])}}}"

    edit_header(d, edit)
    return Case([shard(d), name[0], "twice"], {**dict.fromkeys(READERS, "refused"), "verify": "problem",
                                               "inspect": "ok"})


@case("header-tensor-renamed")
def _h_renamed(d: Path, outside: Path) -> Case:
    name: list[str] = []

    def edit(h: dict[str, Any]) -> None:
        name.append(two_dim(h))
        h[name[0] + "_x"] = h.pop(name[0])

    edit_header(d, edit)
    return Case([shard(d), name[0]], {**dict.fromkeys(READERS, "refused"), "verify": "problem", "inspect": "ok"})


# manifests


@case("manifest-a-list")
def _m_list(d: Path, outside: Path) -> Case:
    write_manifest(d, [manifest(d)])
    return Case([MANIFEST_NAME, "a list", "expected a JSON object", "convert"], error=ConvertedCheckError)


@case("manifest-not-json")
def _m_not_json(d: Path, outside: Path) -> Case:
    (d / MANIFEST_NAME).write_text('{"format_version": 2, ')
    return Case([MANIFEST_NAME, "not valid JSON", "convert"], error=ConvertedCheckError)


@case("manifest-missing-key")
def _m_missing(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m.pop("files"))
    return Case([MANIFEST_NAME, "files: missing", "convert"], error=ConvertedCheckError)


@case("manifest-wrong-type")
def _m_type(d: Path, outside: Path) -> Case:
    name = next(iter(manifest(d)["tensors"]))
    edit_manifest(d, lambda m: m["tensors"][name].__setitem__("shape", "256x320"))
    return Case([MANIFEST_NAME, name, "shape is a string", "expected a list of integers"], error=ConvertedCheckError)


@case("manifest-unknown-target")
def _m_target(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m.__setitem__("target", "gfx900"))
    return Case([MANIFEST_NAME, "target is a string 'gfx900'", "expected 'gfx950' or 'gfx942'"], error=ConvertedCheckError)


@case("manifest-fp8-dtype-of-the-other-target")
def _m_fp8(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m.__setitem__("fp8_dtype", "float8_e4m3fnuz"))
    return Case([MANIFEST_NAME, "fp8_dtype is 'float8_e4m3fnuz'", "target 'gfx950' stores 'float8_e4m3fn'"],
                error=ConvertedCheckError)


@case("manifest-wrong-type-parallel")
def _m_type_par(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m["parallel"].__setitem__("ranks", {"0": {}}))
    return Case([MANIFEST_NAME, "parallel.ranks is an object", "expected a list of 1"], error=ConvertedCheckError)


@case("manifest-digest-of-another-length")
def _m_digest_len(d: Path, outside: Path) -> Case:
    """A format_version 5 file entry with a 64-digit digest (BLAKE3's length, not XXH3-128's 32)."""
    rel = shard(d)
    edit_manifest(d, lambda m: m["files"][rel].__setitem__("xxh3_blocks", "ab" * 32))
    return Case([MANIFEST_NAME, f"files[{rel!r}]", "xxh3_blocks", "expected 32 hex digits"], error=ConvertedCheckError)


@case("manifest-future-version")
def _m_future(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m.__setitem__("format_version", FORMAT_VERSION + 1))
    return Case([MANIFEST_NAME, f"format_version {FORMAT_VERSION + 1}", f"writes format_version {FORMAT_VERSION}",
                 "pip install -U atom-convert", "convert the checkpoint again"], error=ConvertedCheckError)


@case("manifest-unknown-version")
def _m_unknown(d: Path, outside: Path) -> Case:
    edit_manifest(d, lambda m: m.__setitem__("format_version", "2"))
    return Case([MANIFEST_NAME, "format_version '2' is unknown", f"writes format_version {FORMAT_VERSION}",
                 "pip install -U atom-convert"], error=ConvertedCheckError)


def _outside_copy(d: Path, outside: Path) -> str:
    """A copy of the shard outside the directory, with the manifest's digest (so only the path is wrong)."""
    rel = shard(d)
    shutil.copy(d / rel, outside / "stolen.safetensors")
    return rel


@case("manifest-dotdot-rank-file")
def _m_dotdot(d: Path, outside: Path) -> Case:
    rel = _outside_copy(d, outside)
    bad = f"../{outside.name}/stolen.safetensors"
    name = next(iter(manifest(d)["tensors"]))

    def edit(m: dict[str, Any]) -> None:
        e = m["tensors"][name]
        e["file"] = e["rank_files"][0] = bad
        m["files"][bad] = m["files"].pop(rel)

    edit_manifest(d, edit)
    return Case([MANIFEST_NAME, name, bad, "'..'"], error=ConvertedCheckError)


@case("manifest-absolute-file")
def _m_absolute(d: Path, outside: Path) -> Case:
    rel = _outside_copy(d, outside)
    bad = str(outside / "stolen.safetensors")

    def edit(m: dict[str, Any]) -> None:
        for e in m["tensors"].values():
            e["file"] = e["rank_files"][0] = bad
        m["files"][bad] = m["files"].pop(rel)

    edit_manifest(d, edit)
    return Case([MANIFEST_NAME, bad, "an absolute path", "more entries"], error=ConvertedCheckError)


@case("manifest-files-list-dotdot")
def _m_files_dotdot(d: Path, outside: Path) -> Case:
    (outside / "secret.txt").write_text("not yours")
    bad = f"../{outside.name}/secret.txt"
    edit_manifest(d, lambda m: m["files"].__setitem__(bad, {"bytes": 9, "xxh3_blocks": file_digest(outside / "secret.txt")}))
    return Case([MANIFEST_NAME, f"files[{bad!r}]", "'..'"], error=ConvertedCheckError)


@case("shard-symlink-out")
def _m_symlink(d: Path, outside: Path) -> Case:
    rel = _outside_copy(d, outside)
    (d / rel).unlink()
    (d / rel).symlink_to(outside / "stolen.safetensors")
    return Case([MANIFEST_NAME, rel, "resolves through a symlink", str(outside.resolve())], error=ConvertedCheckError)


@case("manifest-symlink-out")
def _m_itself_symlink(d: Path, outside: Path) -> Case:
    shutil.move(d / MANIFEST_NAME, outside / MANIFEST_NAME)
    (d / MANIFEST_NAME).symlink_to(outside / MANIFEST_NAME)
    return Case([MANIFEST_NAME, "symbolic link", "outside"], error=ConvertedCheckError)


@case("manifest-mtp-path-out")
def _m_mtp(d: Path, outside: Path) -> Case:
    shutil.copytree(d / "mtp", outside / "mtp")
    bad = f"../{outside.name}/mtp"
    edit_manifest(d, lambda m: m["mtp"].__setitem__("path", bad))
    return Case([MANIFEST_NAME, "mtp.path", bad, "'..'"], error=ConvertedCheckError)


@case("manifest-tensor-twice")
def _m_twice(d: Path, outside: Path) -> Case:
    text = (d / MANIFEST_NAME).read_text()
    m = json.loads(text)
    name = next(iter(m["tensors"]))
    entry = json.dumps(m["tensors"][name])
    text = text.replace('"tensors": {', f'"tensors": {{{json.dumps(name)}: {entry}, ', 1)
    (d / MANIFEST_NAME).write_text(text)
    return Case([MANIFEST_NAME, name, "appears twice"], error=ConvertedCheckError)


@case("manifest-alias-is-a-tensor")
def _m_alias(d: Path, outside: Path) -> Case:
    names = list(manifest(d)["tensors"])
    edit_manifest(d, lambda m: m["aliases"].__setitem__(names[1], names[0]))
    return Case([MANIFEST_NAME, names[1], "named twice"], error=ConvertedCheckError)


@case("manifest-omits-a-tensor")
def _m_omits(d: Path, outside: Path) -> Case:
    m = manifest(d)
    name = next(n for n in m["tensors"] if n.endswith("input_layernorm.weight"))
    edit_manifest(d, lambda m: m["tensors"].pop(name))
    # The file still holds it: verify names it; the loader finds the live Parameter nothing fills.
    return Case([name], {"verify": "problem", "inspect": "ok", "load_into": "refused", "open_converted": "ok"},
                error=LoadMismatchError)


# -- running every reader ------------------------------------------------------------------------


def _load(d: Path, base: Path) -> None:
    model = T.build(json.loads((base / "config.json").read_text()), tp=1, fmt=FMT, meta=True)
    atom_convert.load_into(model, d, rank=0)


def _open(d: Path) -> None:
    with atom_convert.open_converted(d, rank=0) as ck:
        for name in ck.keys():
            ck.get(name)
        mtp = ck.mtp()
        if mtp is not None:
            for name in mtp.keys():
                mtp.get(name)


def _run(reader: str, d: Path, base: Path) -> list[str]:
    """The reader's problems (verify), or [] when it passes; its exception propagates."""
    if reader == "verify":
        from atom_convert.check.verify import verify

        return verify(d).failures
    if reader == "inspect":
        describe(d)
    elif reader == "load_into":
        _load(d, base)
    else:
        _open(d)
    return []


@pytest.fixture(scope="module")
def base(converted) -> Path:
    return converted(PRESET, FMT, TARGET)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", list(CASES))
def test_tampered_directory(name: str, reader: str, base: Path, tmp_path: Path) -> None:
    d, outside = tmp_path / "conv", tmp_path / "elsewhere"
    shutil.copytree(base, d)
    outside.mkdir()
    c = CASES[name](d, outside)
    before = {p.name: p.read_bytes() for p in outside.iterdir() if p.is_file()}
    want = c.outcome[reader]
    if want == "refused":
        with pytest.raises(BadInputError) as ei:
            _run(reader, d, base)
        assert isinstance(ei.value, c.error), (type(ei.value), ei.value)
        assert ei.value.exit_code == 2
        msg = str(ei.value)
        missing = [s for s in c.expect if s not in msg]
        assert not missing, f"{missing} not in:\n{msg}"
    elif want == "problem":
        problems = _run(reader, d, base)
        assert problems, "verify must report it"
        text = "\n".join(problems)
        for s in c.expect:
            assert s in text, f"{s!r} not in:\n{text}"
    else:
        assert _run(reader, d, base) == []
    assert {p.name: p.read_bytes() for p in outside.iterdir() if p.is_file()} == before  # nothing written outside


def test_untouched_directory_passes_every_reader(base: Path) -> None:
    for reader in READERS:
        assert _run(reader, base, base) == [], reader


def test_unlisted_shards_are_a_note_not_a_problem(base: Path, tmp_path: Path) -> None:
    """A .safetensors file the manifest does not list (here beside the shards and inside mtp/) is named in a
    note, since no loader reads it, and the check still passes; a directory reached through a symlink is
    not walked. An untouched directory has no such note."""
    assert not [n for n in check_files(base).notes if "does not list" in n]
    d, outside = tmp_path / "conv", tmp_path / "elsewhere"
    shutil.copytree(base, d)
    outside.mkdir()
    first = sorted(d.glob("*.safetensors"))[0]
    shutil.copy(first, d / "copy-of-rank0.safetensors")
    assert (d / "mtp").is_dir()
    shutil.copy(first, d / "mtp" / "old.safetensors")
    shutil.copy(first, outside / "beyond.safetensors")
    (d / "linked").symlink_to(outside, target_is_directory=True)
    report = check_files(d)
    assert report.ok, report.problems
    notes = [n for n in report.notes if "does not list" in n]
    assert len(notes) == 1 and notes[0].startswith("2 .safetensors file(s)"), report.notes
    assert "copy-of-rank0.safetensors" in notes[0] and "mtp/old.safetensors" in notes[0]
    assert "beyond" not in notes[0]


def test_the_cli_exits_2_naming_the_manifest(base: Path, tmp_path: Path) -> None:
    from hostile_util import run_cli

    d = tmp_path / "conv"
    shutil.copytree(base, d)
    write_manifest(d, [1, 2])
    for cmd in (["verify", d], ["inspect", d]):
        r = run_cli(cmd)
        assert r.code == 2, r.text
        assert MANIFEST_NAME in r.text and "a list" in r.text and "Traceback" not in r.text


# -- module trees lacking or adding a parameter --------------------------------------------------


@pytest.mark.parametrize("change", ["lacks", "adds"])
def test_module_tree_lacking_or_adding_a_parameter(change: str, base: Path) -> None:
    model = T.build(json.loads((base / "config.json").read_text()), tp=1, fmt=FMT, meta=True)
    attn = model.model.layers[0].self_attn
    if change == "lacks":
        del attn.o_proj._parameters["weight"]
        want = "unexpected: model.layers.0.self_attn.o_proj.weight"
    else:
        attn.register_parameter("extra_bias", nn.Parameter(torch.empty(4, device="meta"), requires_grad=False))
        want = "missing: live Parameter model.layers.0.self_attn.extra_bias"
    with pytest.raises(LoadMismatchError) as ei:
        atom_convert.load_into(model, base, rank=0)
    assert want in str(ei.value) and ei.value.exit_code == 2


# -- the typed reader itself ---------------------------------------------------------------------


def test_a_hugging_face_snapshot_may_link_into_its_blobs(base: Path, tmp_path: Path) -> None:
    """The one symlink policy (files/safetensors.py): a Hub cache snapshot links every file to
    ../../blobs/HASH, the documented way to fetch a converted repo (snapshot_download, then
    open_converted); that is inside, anything else out of the directory is not."""
    repo = tmp_path / "hub" / "models--org--conv"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    blobs.mkdir(parents=True)
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base)
        if p.is_dir():
            (snap / rel).mkdir(parents=True, exist_ok=True)
            continue
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        blob = blobs / sha256_file(p)
        shutil.copy(p, blob)
        (snap / rel).symlink_to(os.path.relpath(blob, (snap / rel).parent))
    assert check_files(snap).ok
    _open(snap)
    Manifest.read(snap / "mtp")


# -- upload publishes only regular files inside DST ----------------------------------------------


def _upload(d: Path) -> list[str]:
    return sorted(n for n, _ in atom_convert.upload(d, "my-org/conv", dry_run=True).files)


def test_upload_lists_the_manifest_files_the_manifest_and_the_card(base: Path, tmp_path: Path) -> None:
    d = tmp_path / "conv"
    shutil.copytree(base, d)
    (d / "atom_verify.json").write_text(json.dumps({"ok": True, "rows": []}))
    (d / "unlisted.bin").write_bytes(b"x")  # in DST but not in the manifest: not published
    want = sorted([*manifest(d)["files"], MANIFEST_NAME, "atom_verify.json", "README.md"])
    assert _upload(d) == want


def test_upload_refuses_a_symlinked_verify_result(base: Path, tmp_path: Path) -> None:
    d, outside = tmp_path / "conv", tmp_path / "elsewhere"
    shutil.copytree(base, d)
    outside.mkdir()
    (outside / "secret.json").write_text(json.dumps({"ok": True, "rows": [], "token": "hf_secret"}))
    (d / "atom_verify.json").symlink_to(outside / "secret.json")
    with pytest.raises(ConvertedCheckError, match=r"atom_verify\.json: a symlink \(to .*secret\.json\)"):
        _upload(d)


def test_upload_refuses_files_out_of_dst(base: Path, tmp_path: Path) -> None:
    d, outside = tmp_path / "conv", tmp_path / "elsewhere"
    shutil.copytree(base, d)
    outside.mkdir()
    CASES["manifest-files-list-dotdot"](d, outside)
    with pytest.raises(ConvertedCheckError, match=r"files\['\.\./elsewhere/secret\.txt'\].*'\.\.'"):
        _upload(d)


def test_upload_refuses_a_listed_file_reached_through_a_symlink(base: Path, tmp_path: Path) -> None:
    """Inside DST, but a link: the manifest reader accepts it (it stays inside); upload does not."""
    d = tmp_path / "conv"
    shutil.copytree(base, d)
    rel = shard(d)
    (d / "sub").mkdir()
    shutil.move(d / rel, d / "sub" / rel)
    (d / rel).symlink_to(Path("sub") / rel)
    assert check_files(d).ok
    with pytest.raises(ConvertedCheckError, match=f"{re.escape(rel)}: reached through a symlink"):
        _upload(d)


def test_upload_patterns_match_each_file_alone() -> None:
    """upload_folder's allow_patterns are fnmatch patterns: a listed name with * ? [ is escaped."""
    from huggingface_hub.utils import filter_repo_objects

    from atom_convert.hub.publish import _literal

    names = ["a*b.safetensors", "x[1].json", "q?.txt"]
    others = ["aXb.safetensors", "x1.json", "qq.txt", "secret/a*b.safetensors"]
    assert list(filter_repo_objects(names + others, allow_patterns=[_literal(n) for n in names])) == names


def test_a_typo_in_the_declared_layout_is_named_not_sent_to_convert_again(tmp_path):
    """README's earlier example passed parallel={"tp_size": 8}: refused naming the key and the valid ones,
    without the "convert again" advice of a real mismatch."""
    import atom_convert
    from atom_convert.errors import BadInputError
    from atom_convert.load import ManifestMismatchError, module_tree, rank_view
    from atom_convert.synth import build_tiny

    src = build_tiny("tiny-deepseek-v2-lite", tmp_path / "src", seed=3)
    dst = tmp_path / "dst"
    atom_convert.convert(src, dst)
    model = module_tree(rank_view(dst, 0))
    with pytest.raises(BadInputError) as e:
        atom_convert.load_into(model, dst, rank=0, parallel={"tp_size": 1})
    assert not isinstance(e.value, ManifestMismatchError)
    assert "tp_size: not a layout key" in str(e.value) and "tp" in str(e.value) and "convert again" not in str(e.value).lower()
    m = json.loads((dst / "atom_manifest.json").read_text())
    assert "enable_expert_parallel" not in m["layout"]["flags"] and "tp_size" not in m["layout"]["flags"]
