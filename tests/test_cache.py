"""`ensure_converted`: one conversion for concurrent callers, takeover of a dead converter, rebuild
of a stale cache, no tensor data read for a current one; and remote-code files carried into DST."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import atom_convert
from atom_convert.engine.cache import cache_path, ensure_converted
from atom_convert.check.tensors import check_files

from cliutil import Shared

REPO = Path(__file__).resolve().parent.parent
PRESET = "tiny-deepseek-v2-lite"  # the smallest fixture: conversions here take a fraction of a second

# A child process: waits for GO, then calls ensure_converted with `convert` wrapped to log each
# conversion (pid) and, for the converter to be killed, to stop inside the conversion (the shards
# written, the manifest not yet) until it is killed.
CHILD = textwrap.dedent('''
    import json, logging, os, sys, time
    from pathlib import Path
    import atom_convert.engine.cache as cache
    logging.basicConfig(level=logging.INFO)
    conv = sys.modules["atom_convert.engine.convert"]  # the package attribute of that name is the function
    src, cache_dir, log, go, mode = sys.argv[1:6]
    real = cache.convert
    def logged(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        if mode == "stall":
            real_write = conv.write_manifest
            def stall(path, manifest):
                if path.parent.name != "mtp":
                    Path(log + ".stalled").write_text(str(os.getpid()))
                    time.sleep(600)
                real_write(path, manifest)
            conv.write_manifest = stall
        return real(*a, **k)
    cache.convert = logged
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    dst = cache.ensure_converted(src, cache_dir, target="gfx942", tp=2)
    print(json.dumps({"dst": str(dst), "manifest": (dst / "atom_manifest.json").read_text()}), flush=True)
''')


def _spawn(tmp: Path, src: Path, cache_dir: Path, mode: str = "plain") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(cache_dir), str(tmp / "log"), str(tmp / "go"), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _conversions(tmp: Path) -> list[str]:
    p = tmp / "log"
    return p.read_text().split() if p.exists() else []


@pytest.fixture
def src(tiny_checkpoint, tmp_path: Path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(PRESET, "bf16"), d)
    return d


def test_four_processes_convert_once(src: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    procs = [_spawn(tmp_path, src, cache_dir) for _ in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    (tmp_path / "go").touch()  # all four start together
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len(_conversions(tmp_path)) == 1
    assert len({o["dst"] for o in outs}) == 1 and len({o["manifest"] for o in outs}) == 1
    dst = Path(outs[0]["dst"])
    assert check_files(dst).ok
    # the entry and its record; the lock file goes with its last holder (staging.FileLock)
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([dst.name, dst.name + ".cache.json"])


def test_killed_converter_taken_over(src: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    first = _spawn(tmp_path, src, cache_dir, mode="stall")
    assert first.stdout.readline().strip() == "ready"
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 120
    while not (tmp_path / "log.stalled").exists():  # inside the conversion, holding the lock
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.05)
    second = _spawn(tmp_path, src, cache_dir)
    assert second.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    assert second.poll() is None  # waiting on the lock
    first.send_signal(signal.SIGKILL)
    first.wait()
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err
    assert len(_conversions(tmp_path)) == 2  # the dead one, then the taker-over
    dst = Path(json.loads(out.strip().splitlines()[-1])["dst"])
    assert check_files(dst).ok
    # the dead one had sealed every shard (it stalled before its manifest): the taker keeps them all
    kept = re.search(r"keeping (\d+) of (\d+) shards", err)
    assert kept and kept.group(1) == kept.group(2) != "0", err
    assert not [p for p in cache_dir.iterdir() if p.is_dir() and p != dst]  # the dead one's staging went into DST


def test_current_found_from_headers_only(src: Path, tmp_path: Path, monkeypatch) -> None:
    cache_dir = tmp_path / "cache"
    calls: list[int] = []
    real = atom_convert.engine.cache.convert
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    dst = ensure_converted(src, cache_dir, target="gfx950", tp=1)
    assert calls == [1] and check_files(dst).ok
    # current: found again without converting, also when every tensor byte of the source is gone
    # (the files keep their size, header and modification time): the fingerprint reads headers and
    # the stamps stat the files, never reading tensor data
    for f in src.glob("*.safetensors"):
        raw, st = f.read_bytes(), f.stat()
        n = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[:8 + n])
        os.truncate(f, len(raw))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ensure_converted(src, cache_dir, target="gfx950", tp=1) == dst
    assert calls == [1]
    # other options: another directory, converted
    other = ensure_converted(src, cache_dir, target="gfx950", tp=1, mtp=False, shard_size="1MB")
    assert other != dst and calls == [1, 1]


def test_stale_cache_rebuilt(src: Path, tmp_path: Path, monkeypatch) -> None:
    cache_dir = tmp_path / "cache"
    calls: list[int] = []
    real = atom_convert.engine.cache.convert
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    dst = ensure_converted(src, cache_dir)
    before = json.loads((dst / "atom_manifest.json").read_text())["source"]["config_sha256"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    assert ensure_converted(src, cache_dir) == dst
    assert calls == [1, 1]
    after = json.loads((dst / "atom_manifest.json").read_text())
    assert after["source"]["config_sha256"] != before
    assert json.loads((dst / "config.json").read_text())["rms_norm_eps"] == 1e-5
    # a cache entry with a file gone is not current either
    next(dst.glob("*.safetensors")).unlink()
    ensure_converted(src, cache_dir)
    assert calls == [1, 1, 1] and check_files(dst).ok


def test_source_rewritten_in_place_is_converted_again(src: Path, tmp_path: Path, monkeypatch) -> None:
    """A source file rewritten in place (same size and header, other tensor bytes) is seen by its
    modification time: the entry is converted again, never served stale; so is a partial conversion
    of it, which is started over instead of resumed."""
    cache_dir = tmp_path / "cache"
    calls = _counting(monkeypatch)
    dst = ensure_converted(src, cache_dir)
    f = src / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    a, b = json.loads(raw[8:8 + n])["lm_head.weight"]["data_offsets"]
    raw[8 + n + a:8 + n + b] = b"\x20\x40" * ((b - a) // 2)  # every bf16 value 2.5
    st = f.stat()
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ensure_converted(src, cache_dir) == dst and calls == [1, 1]
    with atom_convert.open_converted(dst) as ck:
        assert set(ck.get("lm_head.weight").float().flatten().tolist()) == {2.5}
    assert ensure_converted(src, cache_dir) == dst and calls == [1, 1]  # current again


def test_a_partial_conversion_of_a_rewritten_source_is_not_resumed(src: Path, tmp_path: Path, monkeypatch) -> None:
    dst = tmp_path / "dst"

    def interrupted(path: Path, manifest: dict) -> None:  # every shard sealed, then Ctrl-C
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(sys.modules["atom_convert.engine.convert"], "write_manifest", interrupted)
        with pytest.raises(KeyboardInterrupt):
            atom_convert.convert(src, dst)
    staging = tmp_path / f".{dst.name}.atom-partial"
    journal_src = json.loads((staging / ".atom-journal.jsonl").read_text().splitlines()[0])["source"]["parts"]
    assert any(k.endswith("(size, modification time)") for k in journal_src)
    f = src / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000_000))
    with pytest.raises(atom_convert.errors.NotResumableError, match=r"model.safetensors \(size, modification time\)"):
        atom_convert.convert(src, dst, resume="resume")


def test_fetch_step_used_before_converting(src: Path, tmp_path: Path, monkeypatch) -> None:
    """The hook the Hub cache plugs into: a fetcher that places a directory means no conversion."""
    ready = tmp_path / "made-elsewhere"
    atom_convert.convert(src, ready, target="gfx950", tp=1)
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda *a, **k: pytest.fail("converted despite fetch"))
    seen = []

    def fetch(dst: Path, record: dict) -> bool:
        seen.append(record["options"]["target"])
        assert record["source_parts"]["config.json"] and record["options_digest"]
        shutil.copytree(ready, dst)
        return True

    dst = ensure_converted(src, tmp_path / "cache", fetch=fetch)
    assert seen == ["gfx950"] and check_files(dst).ok
    assert ensure_converted(src, tmp_path / "cache", fetch=fetch) == dst and seen == ["gfx950"]


def test_parallel_options_are_part_of_the_key(tiny_checkpoint, tmp_path: Path) -> None:
    """A server under expert parallel or DP-attention gets that layout (atom-parallel.md), in an entry
    of its own, and ensure_converted converts on every core by default (the CLI's default)."""
    src = tiny_checkpoint("tiny-deepseek-v3", "bf16")
    cache_dir = tmp_path / "cache"
    plain = ensure_converted(src, cache_dir, tp=2)
    ep = ensure_converted(src, cache_dir, tp=2, ep=True)
    dpa = ensure_converted(src, cache_dir, tp=2, dp_attention=True, ep=True)
    assert len({plain, ep, dpa}) == 3
    for d, want_ep, want_dpa in ((plain, 1, False), (ep, 2, False), (dpa, 2, True)):  # ep: the EP size
        m = json.loads((d / "atom_manifest.json").read_text())
        assert (m["parallel"]["ep"], m["parallel"]["dp_attention"]) == (want_ep, want_dpa), m["parallel"]
        assert check_files(d).ok
    # the same bytes as the CLI's conversion with those options
    direct = tmp_path / "direct-ep"
    atom_convert.convert(src, direct, tp=2, ep=True, workers=1)
    files = json.loads((direct / "atom_manifest.json").read_text())["files"]
    assert [f for f in files if f.endswith(".safetensors")]
    assert {f: (direct / f).read_bytes() for f in files} == {f: (ep / f).read_bytes() for f in files}
    assert ensure_converted(src, cache_dir, tp=2, ep=True) == ep  # current: found again


def test_taker_over_restarts_a_staging_of_another_source(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A dead converter's sealed shards are resumed only when staged from the same source and
    options; staged from a source that changed since, they are discarded and the entry converted anew."""
    from atom_convert.errors import Interrupted
    from atom_convert.engine.writer import ShardSetWriter

    cache_dir = tmp_path / "cache"
    dst, _ = cache_path(src, cache_dir, shard_size="100KB")
    real, calls = ShardSetWriter.write, Shared()  # counted over the worker processes too

    def write(self, *a, **k):  # an interrupt once a few tensors are written: sealed shards stay
        if calls.add() > 40:
            raise KeyboardInterrupt()
        real(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(ShardSetWriter, "write", write)
        with pytest.raises(Interrupted, match="sealed"):
            ensure_converted(src, cache_dir, shard_size="100KB")
    staging = dst.with_name(f".{dst.name}.atom-partial")
    assert staging.is_dir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("INFO", logger="atom_convert"):
        got = ensure_converted(src, cache_dir, shard_size="100KB")
    assert "cannot resume" in caplog.text and "config.json" in caplog.text and "starting over" in caplog.text
    assert "keeping" not in caplog.text  # nothing of the old staging was kept
    assert got == dst and check_files(dst).ok and not staging.exists()
    assert json.loads((dst / "config.json").read_text())["rms_norm_eps"] == 1e-5
    fresh = tmp_path / "fresh"
    atom_convert.convert(src, fresh, shard_size="100KB")
    for f in dst.glob("*.safetensors"):
        assert f.read_bytes() == (fresh / f.name).read_bytes(), f.name


def test_lock_timeout_names_the_holder(src: Path, tmp_path: Path) -> None:
    import fcntl

    dst, _ = cache_path(src, tmp_path / "cache")
    dst.parent.mkdir(parents=True)
    lock = dst.with_name(f".{dst.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, b'{"pid": 4242}')
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        # the lock is per open file: a second open in this process contends like another process
        with pytest.raises(atom_convert.BadInputError, match="4242"):
            ensure_converted(src, tmp_path / "cache", timeout=0.5)
    finally:
        os.close(fd)


def test_remote_code_carried(tiny_checkpoint, tmp_path: Path) -> None:
    """A Kimi-K2-like source whose config and tokenizer need trust_remote_code loads from DST."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "kimi"
    shutil.copytree(tiny_checkpoint("tiny-kimi-k2", "bf16"), src)
    (src / "configuration_kimi.py").write_text(textwrap.dedent('''
        from transformers import PretrainedConfig
        class KimiK2TestConfig(PretrainedConfig):
            model_type = "kimi_k2"
            def __init__(self, hidden_size=1, **kwargs):
                self.hidden_size = hidden_size
                super().__init__(**kwargs)
    '''))
    (src / "tokenization_kimi.py").write_text(textwrap.dedent('''
        from transformers import PreTrainedTokenizer
        from .kimi_vocab import VOCAB
        class KimiTestTokenizer(PreTrainedTokenizer):
            vocab_files_names = {}
            def __init__(self, **kwargs):
                self._v = dict(VOCAB)
                super().__init__(**kwargs)
            @property
            def vocab_size(self):
                return len(self._v)
            def get_vocab(self):
                return dict(self._v)
            def _tokenize(self, text):
                return list(text)
            def _convert_token_to_id(self, t):
                return self._v.get(t, 0)
            def _convert_id_to_token(self, i):
                return {v: k for k, v in self._v.items()}.get(i, "?")
    '''))
    (src / "kimi_vocab.py").write_text("VOCAB = {'?': 0, 'a': 1, 'b': 2, 'c': 3}\n")  # a sibling import
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_kimi.KimiK2TestConfig"}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.KimiTestTokenizer", None]},
         "tokenizer_class": "KimiTestTokenizer"}))
    dst = tmp_path / "dst"
    atom_convert.convert(src, dst, target="gfx950")
    assert {"configuration_kimi.py", "tokenization_kimi.py", "kimi_vocab.py"} <= set(os.listdir(dst))
    assert check_files(dst).ok  # carried files are listed (size, digest) in the manifest
    shutil.rmtree(src)  # DST alone
    c = transformers.AutoConfig.from_pretrained(dst, trust_remote_code=True)
    assert type(c).__name__ == "KimiK2TestConfig" and c.hidden_size == cfg["hidden_size"]
    tok = transformers.AutoTokenizer.from_pretrained(dst, trust_remote_code=True)
    assert type(tok).__name__ == "KimiTestTokenizer"
    assert tok("abc", add_special_tokens=False)["input_ids"] == [1, 2, 3]


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = atom_convert.engine.cache.convert
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _future(m: dict) -> None:
    m["format_version"] += 1


def _dotdot_rank_file(m: dict) -> None:
    e = next(iter(m["tensors"].values()))
    e["file"] = e["rank_files"][0] = "../../outside.safetensors"


def _dotdot_files(m: dict) -> None:
    m["files"]["../../outside.safetensors"] = {"bytes": 4, "xxh3_blocks": "0" * 32}


@pytest.mark.parametrize("edit", [_future, _dotdot_rank_file, _dotdot_files], ids=["future-format", "rank-file-out",
                                                                                     "files-list-out"])
def test_entry_the_manifest_reader_refuses_is_rebuilt(edit, src: Path, tmp_path: Path, monkeypatch) -> None:
    """An entry of this cache whose manifest is from a future format or names a file outside it is
    stale: it is converted again (inside cache_dir), not returned; nothing outside is read."""
    cache_dir = tmp_path / "cache"
    calls = _counting(monkeypatch)
    dst = ensure_converted(src, cache_dir)
    (tmp_path / "outside.safetensors").write_bytes(b"abcd")
    m = json.loads((dst / "atom_manifest.json").read_text())
    edit(m)
    (dst / "atom_manifest.json").write_text(json.dumps(m))
    assert ensure_converted(src, cache_dir) == dst
    assert calls == [1, 1] and check_files(dst).ok
    assert (tmp_path / "outside.safetensors").read_bytes() == b"abcd"


def test_entry_whose_manifest_was_deleted_is_rebuilt(src: Path, tmp_path: Path, monkeypatch) -> None:
    cache_dir = tmp_path / "cache"
    calls = _counting(monkeypatch)
    dst = ensure_converted(src, cache_dir)
    (dst / "atom_manifest.json").unlink()
    assert ensure_converted(src, cache_dir) == dst
    assert calls == [1, 1] and check_files(dst).ok


@pytest.mark.parametrize("manifest", ["deleted", "kept"])
def test_entry_holding_a_file_of_someone_else_is_refused_not_deleted(manifest: str, src: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """A stale entry is replaced only when all it holds is what atom-convert writes: a file put into
    it by hand makes ensure_converted refuse, naming it, and the file stays."""
    cache_dir = tmp_path / "cache"
    dst = ensure_converted(src, cache_dir)
    (dst / "user-notes.txt").write_text("mine")
    if manifest == "deleted":
        (dst / "atom_manifest.json").unlink()
    else:  # the record stale instead: the source changed
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(cfg, rms_norm_eps=1e-5)))
    with pytest.raises(atom_convert.BadInputError, match="user-notes.txt") as ei:
        ensure_converted(src, cache_dir)
    assert "did not write" in str(ei.value)
    assert (dst / "user-notes.txt").read_text() == "mine"


@pytest.mark.parametrize("edit", [lambda r: r.__setitem__("source_parts", "abc"),
                                  lambda r: r.__setitem__("options", [1, 2]),
                                  lambda r: r.__setitem__("source_stamps", 5)], ids=["parts", "options", "stamps"])
def test_record_with_wrong_types_is_stale(edit, src: Path, tmp_path: Path, monkeypatch) -> None:
    cache_dir = tmp_path / "cache"
    calls = _counting(monkeypatch)
    dst = ensure_converted(src, cache_dir)
    record = dst.with_name(dst.name + ".cache.json")
    r = json.loads(record.read_text())
    edit(r)
    record.write_text(json.dumps(r))
    assert ensure_converted(src, cache_dir) == dst and calls == [1, 1]


def test_cache_dir_that_is_a_file_is_refused(src: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.write_text("not a directory")
    with pytest.raises(atom_convert.BadInputError, match=f"cache_dir {re.escape(str(cache_dir))}: exists and is not a "
                                                         "directory"):
        ensure_converted(src, cache_dir)
    assert cache_dir.read_text() == "not a directory"


def test_entry_that_is_a_symlink_out_of_cache_dir_is_refused(src: Path, tmp_path: Path, monkeypatch) -> None:
    """ensure_converted writes only inside cache_dir: a stale entry linked elsewhere is not rebuilt there."""
    cache_dir = tmp_path / "cache"
    dst = ensure_converted(src, cache_dir)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(dst, elsewhere)
    dst.symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.stat().st_mtime_ns for p in elsewhere.iterdir()}
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5  # stale now
    (src / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda *a, **k: pytest.fail("converted through the link"))
    with pytest.raises(atom_convert.BadInputError, match=f"{re.escape(dst.name)} is a symbolic link .*remove the link"):
        ensure_converted(src, cache_dir)
    assert {p.name: p.stat().st_mtime_ns for p in elsewhere.iterdir()} == before
