"""Usage errors of every command: exit 2 with a message naming the option, file or layer, the
expected and the actual value, and what to do; never an internal error (1) or a traceback. A
verification that ran and failed exits 3. `demo OUT` deletes nothing it did not write."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

from atom_convert.cli import cli

from cliutil import leftovers, run_cli

PRESET = "tiny-deepseek-v3"
MARKER = ".atom-convert-demo"


@pytest.fixture(scope="module")
def src(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "fp8")


@pytest.fixture(scope="module")
def conv(converted: Callable[..., Path]) -> Path:
    return converted(PRESET, "fp8", "gfx950")


def usage_error(args: list[object], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the CLI; assert exit 2, no internal error, and every needle in stderr; return stderr."""
    code, out, err = run_cli(args, capsys)
    assert code == 2, (args, code, out, err)
    assert "internal error" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under root (links as their target text, never followed)."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


# ------------------------------------------------------------------------------------------------
# demo OUT: created, or replaced only when it is the demo's own output; nothing else deleted
# ------------------------------------------------------------------------------------------------


def test_demo_refuses_a_folder_of_someone_elses_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "photos"
    (out / "2024").mkdir(parents=True)
    (out / "2024" / "a.jpg").write_bytes(b"precious")
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    err = usage_error(["demo", out], capsys, str(out), "OUT", "pick another folder", "notes.txt")
    assert "remove it" in err
    assert tree(out) == before


def test_demo_refuses_a_symlink_out_and_does_not_follow_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "real"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    usage_error(["demo", link], capsys, str(link), "symbolic link")
    assert link.is_symlink() and tree(target) == {"keep.txt": b"keep"}
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    usage_error(["demo", dangling], capsys, "symbolic link")
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_demo_refuses_a_file_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "out"
    f.write_text("a file")
    usage_error(["demo", f], capsys, str(f), "not a folder")
    assert f.read_text() == "a file"


def test_demo_replaces_its_own_output_but_not_what_was_added(tmp_path: Path, tiny_checkpoint: Callable[..., Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    tiny_checkpoint(PRESET, "fp8")  # transformers warmed up by the session fixture
    out = tmp_path / "new" / "demo"  # missing, parent too: created
    code, stdout, err = run_cli(["demo", out], capsys)
    assert code == 0, stdout + err
    assert (out / MARKER).is_file() and (out / "converted" / "atom_manifest.json").is_file()
    first = json.loads((out / "converted" / "atom_manifest.json").read_text())["target"]
    # an earlier demo's output: replaced
    code, stdout, err = run_cli(["demo", out, "--target", "gfx942"], capsys)
    assert code == 0, stdout + err
    assert (first, json.loads((out / "converted" / "atom_manifest.json").read_text())["target"]) == ("gfx950", "gfx942")
    # the same output with a file someone put into it: refused, everything kept
    (out / "converted" / "my-notes.md").write_text("mine")
    before = tree(out)
    usage_error(["demo", out], capsys, "converted/my-notes.md", "pick another folder")
    assert tree(out) == before
    # a marker nested too deeply for the parser is not the demo's: refused alike (once an internal error)
    (out / "converted" / "my-notes.md").unlink()
    (out / MARKER).write_text("[" * 100_000 + "]" * 100_000)
    before = tree(out)
    usage_error(["demo", out], capsys, MARKER, "pick another folder")
    assert tree(out) == before
    # an empty folder: used
    empty = tmp_path / "empty"
    empty.mkdir()
    code, stdout, err = run_cli(["demo", empty, "--preset", "tiny-deepseek-v2-lite"], capsys)
    assert code == 0, stdout + err  # (also: a preset without q_lora_rank, once a KeyError)
    assert stdout.strip().splitlines()[-1] == "OK"


def test_demo_replaces_its_own_interrupted_output(tmp_path: Path, tiny_checkpoint: Callable[..., Path],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A demo stopped mid-conversion leaves its source and the conversion's staging folder beside
    OUT/converted: the next demo replaces them (the demo wrote them)."""
    import atom_convert.engine.convert as engine_convert

    tiny_checkpoint(PRESET, "fp8")
    real = engine_convert.convert

    def stopped(src: Path, dst: Path, *a: object, **k: object) -> None:
        staging = dst.parent / f".{dst.name}.atom-partial"
        staging.mkdir()
        (staging / "model-00001-of-00001.safetensors.partial").write_bytes(b"half")
        raise KeyboardInterrupt

    out = tmp_path / "demo"
    monkeypatch.setattr(engine_convert, "convert", stopped)
    code, stdout, err = run_cli(["demo", out], capsys)
    assert code == 130, stdout + err
    assert (out / "source" / "config.json").is_file() and (out / ".converted.atom-partial").is_dir()
    monkeypatch.setattr(engine_convert, "convert", real)
    code, stdout, err = run_cli(["demo", out], capsys)
    assert code == 0, stdout + err
    assert leftovers(out / "converted") == []


def test_demo_preset_must_be_a_tiny_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for preset in ("no-such-preset", "deepseek-v3"):  # unknown (was FileNotFoundError); full size
        usage_error(["demo", tmp_path / "out", "--preset", preset], capsys, "--preset", preset, "tiny-deepseek-v3")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# verify: --layers, --device, options that need --source; a failed verification exits 3
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", ["a", "0,", ",", "-1", "1.5", ""])
def test_verify_layers_not_indices(conv: Path, src: Path, layers: str, capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(["verify", conv, "--source", src, "--layers", layers], capsys, "--layers",
                "comma-separated layer indices like 0,2", repr(layers))


@pytest.mark.parametrize("layers", ["99", "0,3"])
def test_verify_layers_out_of_range(conv: Path, src: Path, layers: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model has 3 decoder layers: 99 and 3 were silently skipped and the run reported OK."""
    bad = layers.split(",")[-1]
    usage_error(["verify", conv, "--source", src, "--layers", layers], capsys, f"--layers {bad}", "3 decoder layer",
                "0-2")


def test_verify_api_refuses_layers_out_of_range(conv: Path, src: Path) -> None:
    from atom_convert.check.verify import verify
    from atom_convert.errors import BadInputError

    with pytest.raises(BadInputError, match=r"--layers 7: .*0-2"):
        verify(conv, src, layers=[0, 7])
    with pytest.raises(BadInputError, match="needs --source"):
        verify(conv, layers=[0])


@pytest.mark.parametrize("extra", [["--layers", "0"], ["--tokens", "4"], ["--through-loader"], ["--device", "cpu"]])
def test_verify_forward_options_need_source(conv: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """They only shape the forward comparison, which runs with --source: once silently ignored."""
    usage_error(["verify", conv, *extra], capsys, extra[0], "--source")


def test_verify_device_cuda_without_cuda(conv: Path, src: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Was an AssertionError (torch: "not compiled with CUDA"), exit 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for extra in ([], ["--through-loader"]):
        usage_error(["verify", conv, "--source", src, "--device", "cuda", *extra], capsys, "--device cuda",
                    "CUDA is not available", "available: cpu", "--device cpu")


def test_failed_verify_exits_3_internal_error_1(conv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    dst = tmp_path / "dst"
    shutil.copytree(conv, dst)
    (dst / "config.json").write_text("{}")  # a copied side file that no longer matches its digest
    code, out, err = run_cli(["verify", dst], capsys)
    assert code == 3, out + err
    assert "FAIL config.json" in out and out.strip().endswith("1 problem(s)"), out
    assert "internal error" not in err


# ------------------------------------------------------------------------------------------------
# convert: --shard-size, --max-memory minimums; exclusive flags
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,actual", [("1", "1 byte"), ("-5", "-5 byte"), ("0", "0 byte"), ("50KB", "50000 byte")])
def test_shard_size_below_the_minimum(src: Path, tmp_path: Path, value: str, actual: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for dry in ([], ["--dry-run"]):
        usage_error(["convert", src, tmp_path / "dst", "--shard-size", value, *dry], capsys, "'--shard-size'",
                    actual, "minimum of 100.0 KB")
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path / "dst") == []


@pytest.mark.parametrize("value,needle", [("1KB", "minimum of 64.0 MB"), ("-1", "minimum of 64.0 MB"),
                                          ("infGB", "cannot read size"), ("lots", "cannot read size")])
def test_max_memory_below_the_minimum(src: Path, tmp_path: Path, value: str, needle: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for dry in ([], ["--dry-run"]):
        usage_error(["convert", src, tmp_path / "dst", "--max-memory", value, *dry], capsys, "'--max-memory'", needle)
    assert not (tmp_path / "dst").exists() and leftovers(tmp_path / "dst") == []


def test_shard_size_at_the_minimum_and_help(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["convert", src, tmp_path / "dst", "--dry-run", "--shard-size", "100KB",
                              "--max-memory", "64MB"], capsys)
    assert code == 0, err
    text = " ".join(CliRunner().invoke(cli, ["convert", "--help"]).output.split())
    assert "at least 100KB" in text and "at least 64MB" in text


def test_resume_and_restart_exclude_each_other_even_in_a_dry_run(src: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    usage_error(["convert", src, tmp_path / "dst", "--resume", "--restart", "--dry-run"], capsys, "--resume",
                "--restart")
