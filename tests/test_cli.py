"""The command line (through the real entry point, `atom_convert.cli.main`, and
click's CliRunner for --help) and the Python API: convert's returned manifest,
open_converted, the copied side files."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import atom_convert
from atom_convert.cli import cli
from atom_convert.files.dtypes import dtype_from_name
from atom_convert.files.source import INDEX_NAME, SourceCheckpoint, read_safetensors_header

from cliutil import leftovers, run_cli
from oracles import xx_blocks

PRESET = "tiny-deepseek-v3"
MANIFEST = "atom_manifest.json"


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def xx(p: Path) -> str:
    """The xxh3_blocks digest of a file, by its definition (tests/oracles.py; a converted set's files carry it)."""
    return xx_blocks(p.read_bytes())


def nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def shard_tensors(path: Path) -> list[str]:
    header, _ = read_safetensors_header(path)
    return [k for k in header if k != "__metadata__"]


@pytest.fixture(scope="module")
def src(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "fp8")


@pytest.fixture(scope="module")
def conv(converted: Callable[..., Path]) -> Path:
    return converted(PRESET, "fp8", "gfx950")


@pytest.fixture(scope="module")
def api_run(src: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One conversion through the Python API (gfx942), its directory and the returned manifest."""
    dst = tmp_path_factory.mktemp("api") / "out"
    return dst, atom_convert.convert(src, dst, target="gfx942")


# ------------------------------------------------------------------------------------------------
# help
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_shows_an_example(command: str) -> None:
    for flag in ("--help", "-h"):
        r = CliRunner().invoke(cli, [command, flag])
        assert r.exit_code == 0, r.output
        assert "Examples:" in r.output
        assert f"atom-convert {command} " in r.output.split("Examples:", 1)[1]


def test_group_help_lists_every_command() -> None:
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0
    for command in cli.commands:
        assert command in r.output
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and atom_convert.__version__ in r.output


# ------------------------------------------------------------------------------------------------
# convert --dry-run
# ------------------------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_writes_nothing(src: Path, conv: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--dry-run"], capsys)
    assert code == 0, err
    assert not dst.exists() and leftovers(dst) == []
    assert list(tmp_path.iterdir()) == []
    assert "[main]" in out and "[mtp]" in out and "nothing is written" in out
    sections = {"main": out.split("[main]", 1)[1].split("[mtp]", 1)[0], "mtp": out.split("[mtp]", 1)[1]}
    for role, root, prefix in (("main", conv, ""), ("mtp", conv / "mtp", "mtp/")):
        lines = sections[role].splitlines()
        m = json.loads((root / MANIFEST).read_text())
        for name, e in m["tensors"].items():
            row = [ln for ln in lines if f" {name} " in ln]
            assert len(row) == 1, f"{name}: {row}"
            fields = row[0].split()
            assert fields[1] == name and fields[2] == e["dtype"], row[0]
            assert str(e["shape"]) in row[0]
            assert int(fields[-2]) == nbytes(e["dtype"], e["shape"]), row[0]
            assert fields[-1] == prefix + e["file"], row[0]
        for f in m["files"]:
            if f.endswith(".safetensors") and "/" not in f:
                assert f"shard {f}:" in sections[role]


def test_dry_run_json_matches_the_conversion(src: Path, conv: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--dry-run", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert not dst.exists()
    assert plan["architecture"] == "DeepseekV3ForCausalLM" and plan["source_format"] == "fp8-block"
    assert plan["target"] == "gfx950" and plan["tp"] == 1
    sets = {s["role"]: s for s in plan["sets"]}
    assert set(sets) == {"main", "mtp"}
    total = 0
    for role, root, prefix in (("main", conv, ""), ("mtp", conv / "mtp", "mtp/")):
        m = json.loads((root / MANIFEST).read_text())
        rows = sets[role]["tensors"]
        assert [r["name"] for r in rows] == list(m["tensors"]), "plan order differs from the written order"
        for r in rows:
            e = m["tensors"][r["name"]]
            assert (r["dtype"], r["shape"], r["file"]) == (e["dtype"], e["shape"], prefix + e["file"])
            assert r["bytes"] == nbytes(e["dtype"], e["shape"])
        for s in sets[role]["shards"]:
            size = (root / s["file"]).stat().st_size
            header, start = read_safetensors_header(root / s["file"])
            assert size == start + s["bytes"], s  # the plan's bytes are the shard's data bytes
            assert len(header) - 1 == s["tensors"]
            total += s["bytes"]
    assert plan["total_bytes"] == total
    assert plan["dropped"] == {}


# ------------------------------------------------------------------------------------------------
# convert, inspect, verify
# ------------------------------------------------------------------------------------------------


def test_convert_then_inspect(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst], capsys)
    assert code == 0, err
    assert "converted DeepseekV3ForCausalLM" in out and str(dst) in out and "MTP layer" in out
    assert (dst / MANIFEST).is_file() and leftovers(dst) == []
    m = json.loads((dst / MANIFEST).read_text())

    code, out, err = run_cli(["inspect", src], capsys)
    assert code == 0, err
    assert "source checkpoint" in out and "DeepseekV3ForCausalLM" in out and "fp8-block" in out
    code, out, err = run_cli(["inspect", src, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    s = SourceCheckpoint(src)
    assert info["kind"] == "source checkpoint" and info["model_type"] == "deepseek_v3"
    assert info["tensors"] == len(s.tensors) and info["files"] == len(s.files)
    assert info["bytes"] == sum(t.nbytes for t in s.tensors.values())
    assert info["layers"]["decoder"] == 3 and info["layers"]["mtp"] == 1

    code, out, err = run_cli(["inspect", dst], capsys)
    assert code == 0, err
    assert "atom-convert output" in out and "gfx950" in out and m["layout"]["atom_revision"] in out
    code, out, err = run_cli(["inspect", dst, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["kind"] == "atom-convert output" and info["tp_size"] == 1
    assert info["tensors per rank"] == len(m["tensors"])
    assert info["shuffled tensors"] == sum(e["is_shuffled"] for e in m["tensors"].values())
    assert info["mtp"] == "converted"
    assert info["files"] == len(m["files"])


def test_convert_json_output(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--json", "--target", "gfx942"], capsys)
    assert code == 0, err
    info = json.loads(out)
    m = json.loads((dst / MANIFEST).read_text())
    assert info["target"] == "gfx942" and info["tp_size"] == 1
    assert info["files"] == m["files"] and info["mtp"]["status"] == "converted"


def _flip_byte(path: Path) -> None:
    _, start = read_safetensors_header(path)
    pos = start + (path.stat().st_size - start) // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("which", ["model-00001-of-00001.safetensors", "mtp/model-00001-of-00001.safetensors"])
def test_verify_passes_then_fails_after_one_flipped_byte(conv: Path, tmp_path: Path, which: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    shutil.copytree(conv, dst)
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 0, out + err
    assert out.strip().endswith("OK")
    _flip_byte(dst / which)
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 3, out + err  # a verification that ran and failed: 3, not 1 (an internal error)
    assert "internal error" not in err and "verification of" in err, err
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and which in fails[0] and "xxh3_blocks" in fails[0], out
    code, out, err = run_cli(["verify", dst, "--json"], capsys)
    assert code == 3
    report = json.loads(out)
    assert report["ok"] is False and which in out


def test_verify_names_a_truncated_or_missing_file(conv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    shutil.copytree(conv, dst)
    shard = dst / "model-00001-of-00001.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    (dst / "mtp" / "config.json").unlink()
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 3
    assert f"model-00001-of-00001.safetensors: {size - 10} bytes" in out and str(size) in out
    assert "mtp/config.json: missing" in out


def test_verify_a_folder_that_is_not_converted(src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["verify", src], capsys)
    assert code == 2 and MANIFEST in err


# ------------------------------------------------------------------------------------------------
# options: --no-mtp, --shard-size, --tp
# ------------------------------------------------------------------------------------------------


def test_no_mtp(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--no-mtp"], capsys)
    assert code == 0, err
    m = json.loads((dst / MANIFEST).read_text())
    assert m["mtp"]["status"] == "dropped"
    assert not (dst / "mtp").exists()
    layer3 = sorted(n for n in SourceCheckpoint(src).names() if n.startswith("model.layers.3."))
    assert len(layer3) > 30
    assert sorted(m["dropped"]) == layer3
    for n in layer3:
        assert isinstance(m["dropped"][n], str) and "MTP" in m["dropped"][n], (n, m["dropped"][n])
    assert not [n for n in m["tensors"] if n.startswith("model.layers.3.")]
    assert not [f for f in m["files"] if f.startswith("mtp/")]
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 0, out
    # the dry run says the same
    code, out, err = run_cli(["convert", src, tmp_path / "dry", "--no-mtp", "--dry-run", "--json"], capsys)
    plan = json.loads(out)
    assert [s["role"] for s in plan["sets"]] == ["main"] and sorted(plan["dropped"]) == layer3


def test_shard_size_1mb(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--shard-size", "1MB"], capsys)
    assert code == 0, err
    m = json.loads((dst / MANIFEST).read_text())
    for root in (dst, dst / "mtp"):
        shards = sorted(root.glob("*.safetensors"))
        assert len(shards) >= 3, shards
        n = len(shards)
        assert [p.name for p in shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        for p in shards:
            names = shard_tensors(p)
            if p.stat().st_size > 1_000_000:
                assert len(names) == 1, f"{p.name}: {p.stat().st_size} bytes with {len(names)} tensors"
                e = (m if root == dst else json.loads((root / MANIFEST).read_text()))["tensors"][names[0]]
                assert nbytes(e["dtype"], e["shape"]) > 1_000_000, (p.name, names[0])
    # every tensor in the file its manifest entry names
    for name, e in m["tensors"].items():
        assert name in shard_tensors(dst / e["file"])
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 0, out


def test_shard_size_is_a_bound_on_the_file(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--shard-size` is documented as the "upper bound per shard file". Choose it equal to
    the tensor bytes of a multi-tensor shard of the 1MB plan: the shard's file (header
    included) must still fit."""
    code, out, err = run_cli(["convert", src, tmp_path / "dry", "--dry-run", "--json", "--shard-size", "1MB"], capsys)
    shards = json.loads(out)["sets"][0]["shards"]
    budget = max(s["bytes"] for s in shards if s["tensors"] > 1 and s["bytes"] <= 1_000_000)
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--shard-size", str(budget), "--no-mtp"], capsys)
    assert code == 0, err
    too_big = {p.name: p.stat().st_size for p in dst.glob("*.safetensors")
               if p.stat().st_size > budget and len(shard_tensors(p)) > 1}
    assert not too_big, f"--shard-size {budget}: files over the bound: {too_big}"


def test_tp2_writes_rank_files(src: Path, conv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "dst"
    code, out, err = run_cli(["convert", src, dst, "--tp", "2"], capsys)
    assert code == 0, err
    m = json.loads((dst / MANIFEST).read_text())
    m1 = json.loads((conv / MANIFEST).read_text())
    # the parallel layout is stated once, in `parallel` (the flags hold only ATOM_* and moe_backend)
    assert m["tp_size"] == 2 and m["parallel"]["tp"] == 2 and "tp_size" not in m["layout"]["flags"]
    for root in (dst, dst / "mtp"):
        names = sorted(p.name for p in root.glob("*.safetensors"))
        assert names == ["model-rank0-00001-of-00001.safetensors", "model-rank1-00001-of-00001.safetensors"]
    assert list(m["tensors"]) == list(m1["tensors"])
    for name, e in m["tensors"].items():
        assert e["rank_files"] == [f"model-rank{r}-00001-of-00001.safetensors" for r in range(2)]
        assert e["file"] == e["rank_files"][0]
        for r in range(2):
            with safe_open(str(dst / e["rank_files"][r]), "pt") as f:
                assert list(f.get_slice(name).get_shape()) == e["shape"]
    q = "model.layers.1.self_attn.q_b_proj.weight"
    assert m["tensors"][q]["shape"] == [m1["tensors"][q]["shape"][0] // 2, m1["tensors"][q]["shape"][1]]
    o = "model.layers.1.self_attn.o_proj.weight"
    assert m["tensors"][o]["shape"] == [m1["tensors"][o]["shape"][0], m1["tensors"][o]["shape"][1] // 2]
    with atom_convert.open_converted(dst, rank=1) as ck:
        assert list(ck.get(q).shape) == m["tensors"][q]["shape"]
    with pytest.raises(atom_convert.AtomConvertError, match="rank 2"):
        atom_convert.open_converted(dst, rank=2)
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 0, out


# ------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------


def test_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              tiny_checkpoint: Callable[..., Path]) -> None:
    tiny_checkpoint(PRESET, "fp8")  # transformers warmed up by the session fixture
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["demo"], capsys)
    assert code == 0, out + err
    assert out.strip().splitlines()[-1] == "OK", out
    demo = tmp_path / "atom-convert-demo"
    assert (demo / "converted" / MANIFEST).is_file() and (demo / "source" / "config.json").is_file()


# ------------------------------------------------------------------------------------------------
# Python API
# ------------------------------------------------------------------------------------------------


def test_api_returns_the_manifest(api_run: tuple[Path, dict[str, Any]], src: Path) -> None:
    dst, m = api_run
    assert m == json.loads((dst / MANIFEST).read_text())
    assert m["format_version"] == 5
    assert m["tool_version"] == atom_convert.__version__
    assert m["target"] == "gfx942" and m["fp8_dtype"] == "float8_e4m3fnuz" and m["tp_size"] == 1
    lay = m["layout"]
    assert isinstance(lay["atom_revision"], str) and len(lay["atom_revision"]) >= 7
    assert isinstance(lay["flags"], dict) and "tp_size" not in lay["flags"] and m["parallel"]["tp"] == 1
    assert "ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE" in lay["flags"]

    s = m["source"]
    assert s["architecture"] == "DeepseekV3ForCausalLM" and s["model_type"] == "deepseek_v3"
    assert s["quant_format"] == "fp8-block"
    assert s["config_sha256"] == sha256(src / "config.json")
    assert s["index_files"][INDEX_NAME] == {"bytes": (src / INDEX_NAME).stat().st_size,
                                           "sha256": sha256(src / INDEX_NAME)}
    assert s["index_files"]["config.json"]["sha256"] == s["config_sha256"]
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert s["files"] == {f: (src / f).stat().st_size for f in shards}

    source_names = set(SourceCheckpoint(src).names())
    assert len(m["tensors"]) > 40
    for name, e in m["tensors"].items():
        assert {"file", "dtype", "shape", "is_shuffled", "sources"} <= set(e), name
        assert (dst / e["file"]).is_file()
        assert isinstance(e["is_shuffled"], bool) and isinstance(e["shape"], list)
        dtype_from_name(e["dtype"])
        assert e["sources"] and set(e["sources"]) <= source_names, name
    assert m["tensors"]["model.layers.1.mlp.experts.w13_weight"]["is_shuffled"] is True
    assert m["tensors"]["model.layers.1.mlp.experts.w13_weight"]["dtype"] == "float8_e4m3fnuz"

    files = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(m["files"]) == files
    for rel, meta in m["files"].items():
        assert meta == {"bytes": (dst / rel).stat().st_size, "xxh3_blocks": xx(dst / rel)}, rel
    assert m["mtp"]["status"] == "converted"
    assert m["mtp"]["tensors"] == len(json.loads((dst / "mtp" / MANIFEST).read_text())["tensors"])


def _mapped_files(ptr: int) -> list[str]:
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi and len(parts) > 5:
            out.append(parts[5])
    return out


def test_open_converted_matches_safetensors(api_run: tuple[Path, dict[str, Any]]) -> None:
    dst, m = api_run
    for root in (dst, dst / "mtp"):
        with atom_convert.open_converted(root) as ck:
            assert ck.keys() == list(json.loads((root / MANIFEST).read_text())["tensors"])
            loaded: dict[str, dict[str, torch.Tensor]] = {}
            for name in ck:
                e = ck.entry(name)
                t = ck.get(name)
                ref = loaded.setdefault(e["file"], load_file(str(root / e["file"])))[name]
                assert t.dtype == ref.dtype == dtype_from_name(e["dtype"]), name
                assert list(t.shape) == list(ref.shape) == e["shape"], name
                assert torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
                if t.numel():
                    assert str((root / e["file"]).resolve()) in _mapped_files(t.data_ptr()), \
                        f"{name} is not memory-mapped from {e['file']}"
            for alias, target in ck.aliases.items():
                assert alias in ck
                assert torch.equal(ck.get(alias), ck.get(target))
    with atom_convert.open_converted(dst) as ck:
        mtp = ck.mtp()
        assert mtp is not None and mtp.keys()
        with pytest.raises(KeyError, match="not in"):
            ck.entry("model.layers.9.nope.weight")


def test_side_files_are_copied(api_run: tuple[Path, dict[str, Any]], src: Path) -> None:
    dst, m = api_run
    for name in ("config.json", "generation_config.json"):
        assert (src / name).is_file()
        for root in (dst, dst / "mtp"):
            assert (root / name).read_bytes() == (src / name).read_bytes()
        assert name in m["copied_files"]
        assert m["files"][name]["xxh3_blocks"] == xx(src / name)
        assert m["files"][f"mtp/{name}"]["xxh3_blocks"] == xx(src / name)
    assert not (dst / INDEX_NAME).exists(), "the source index must not be copied beside converted shards"


def test_mtp_layer_missing_from_the_checkpoint(tiny_checkpoint, tmp_path):
    """A V3 checkpoint whose config announces an MTP layer that the files do not hold (some
    redistributions strip it) converts, and the manifest says why there is no mtp/ set."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("tiny-deepseek-v3", "bf16"), src)
    t = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("model.layers.3.")}
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    m = atom_convert.convert(src, tmp_path / "dst")
    assert m["mtp"]["status"] == "absent" and "num_nextn_predict_layers=1" in m["mtp"]["reason"]
    assert not (tmp_path / "dst" / "mtp").exists()


_ENTRY = """
import atexit, sys, threading, time
from pathlib import Path
marks = Path(sys.argv[1])
def late():
    time.sleep(0.3)
    (marks / "thread").write_text("done")
threading.Thread(target=late).start()  # not a daemon: Python's exit waits for it
import concurrent.futures
pool = concurrent.futures.ThreadPoolExecutor(2)  # left without shutdown: its idle workers are woken at exit
pool.submit(lambda: None).result()
atexit.register(lambda: (marks / "atexit").write_text("ran"))
sys.stdout.write("buffered before the command|")
sys.argv = ["atom-convert", *sys.argv[2:]]
from atom_convert.cli import entry
entry()
raise SystemExit("unreachable: entry() returned")
"""


@pytest.mark.parametrize("args,code,out,err", [
    (["--version"], 0, "version", ""),
    (["convert", "{missing}", "{tmp}/out"], 2, "", "is not a directory"),
    (["no-such-command"], 2, "", "No such command"),
])
def test_the_installed_command_ends_as_python_would(tmp_path: Path, args: list[str], code: int, out: str,
                                                   err: str) -> None:
    """`entry` (the console script) skips only the interpreter's teardown: the exit code is main()'s,
    buffered output is flushed, atexit handlers run, a non-daemon thread is waited for and an
    executor left open does not hang the exit."""
    import subprocess
    import sys

    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, "-c", _ENTRY, str(tmp_path), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == code, r.stderr
    assert r.stdout.startswith("buffered before the command|") and out in r.stdout, r.stdout
    assert err in r.stderr, r.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("code,status,err", [(0, 0, ""), (None, 0, ""), (3, 3, ""), (-1, 255, ""),
                                             ("stopped: reason", 1, "stopped: reason")])
def test_quick_exit_maps_codes_as_sys_exit_does(code: Any, status: int, err: str) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", f"from atom_convert.cli import quick_exit; quick_exit({code!r})"],
                       capture_output=True, text=True, timeout=120)
    plain = subprocess.run([sys.executable, "-c", f"import sys; sys.exit({code!r})"], capture_output=True, text=True)
    assert (r.returncode, r.stderr.strip()) == (status, err) == (plain.returncode, plain.stderr.strip())


_THP_PROBE = """
import os, sys
import atom_convert
light = "torch" not in sys.modules
import atom_convert.cli
import torch
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)
huge = 0
if os.path.exists("/proc/self/smaps_rollup"):
    huge = int([ln for ln in open("/proc/self/smaps_rollup") if ln.startswith("AnonHugePages")][0].split()[1])
print(light, os.environ.get("THP_MEM_ALLOC_ENABLE"), huge)
"""


@pytest.mark.parametrize("given", [None, "0"])
def test_the_command_puts_torchs_large_tensors_on_huge_pages(given: str | None) -> None:
    """`import atom_convert` does not import torch, so the command line can set THP_MEM_ALLOC_ENABLE=1 before
    it does (unless the environment says otherwise): torch's 64 MB tensor then lies on huge pages where the
    kernel gives them on request (THP `madvise`), and on none with THP_MEM_ALLOC_ENABLE=0."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    out = subprocess.run([sys.executable, "-c", _THP_PROBE], env=env, capture_output=True, text=True, check=True)
    light, value, huge = out.stdout.split()
    assert light == "True" and value == (given or "1"), out.stdout
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[madvise]" in thp.read_text():
        assert (int(huge) > 0) == (given is None), out.stdout


def test_the_command_line_imports_no_torch_until_a_command_needs_it() -> None:
    """`atom-convert --help` and `--version` answer without importing torch (0.1 s instead of 1.5 s on the
    2-core box)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom atom_convert.cli import main\nlight = 'torch' not in sys.modules\n"
             "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print(light, 'torch' not in sys.modules, e.code)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "True True 0", r.stdout + r.stderr
    assert "convert" in r.stdout


def test_the_target_names_are_the_fp8_tables_keys() -> None:
    """files/targets.py (names, no torch) and files/dtypes.py (the fp8 dtype of each) list the same targets."""
    from atom_convert.files.dtypes import FP8_DTYPE_BY_TARGET
    from atom_convert.files.targets import TARGETS

    assert tuple(FP8_DTYPE_BY_TARGET) == TARGETS
