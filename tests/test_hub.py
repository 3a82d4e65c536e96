"""Hub flows end to end with the real huggingface_hub client against tests/hubserver.py on 127.0.0.1:
convert from a repo id while it downloads, the offline cache, the refusals, upload with a model card,
and pull-instead-of-convert. Nothing leaves the machine."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import atom_convert
from atom_convert.errors import BadInputError, ConvertedCheckError, HubOfflineError
from atom_convert.hub.repo import allow_patterns, auto_map_files, open_source, parse_repo_spec
from atom_convert.synth import build_tiny
from hubserver import FakeHub

SRC_REPO = "deepseek-ai/tiny-v3"
TOKEN = "hf_test_token"
LAST = "model-00003-of-00003.safetensors"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """The server, with huggingface_hub pointed at it (its constants are read at import, so they are
    patched here; the CLI test below sets the real environment variables in a fresh process)."""
    from huggingface_hub import constants

    server = FakeHub().start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "ENDPOINT", server.url)
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        mp.setattr(constants, "HF_HUB_DISABLE_XET", True)
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
        mp.setenv("HF_TOKEN", TOKEN)
        yield server
    server.stop()


@pytest.fixture()
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty Hugging Face cache for one test."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny DeepSeek-V3 (bf16, with an MTP layer) in 3 shards: layers 0.. in the first, norm and MTP in the last."""
    d = build_tiny("tiny-deepseek-v3", tmp_path_factory.mktemp("hubsrc") / "tiny-v3", fmt="bf16", shards=3, seed=7)
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_tiny.Tok", None]}}))
    (d / "tokenization_tiny.py").write_text("# referenced by auto_map\n")
    (d / "unrelated_script.py").write_text("# not referenced: never downloaded\n")
    (d / "original").mkdir()
    (d / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)  # not needed: never downloaded
    return d


@pytest.fixture(scope="module")
def source_repo(hub: FakeHub, source_dir: Path) -> str:
    """The source checkpoint published on the server with the real client (upload_folder)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(SRC_REPO)
    api.upload_folder(folder_path=source_dir, repo_id=SRC_REPO)
    return hub.repos[SRC_REPO].branches["main"]


def downloads(hub: FakeHub, since: int = 0) -> list[str]:
    return [p for _, kind, p in hub.events[since:] if kind == "get-start"]


class Recorder(logging.Handler):
    """Collects atom_convert's log records; sets `gate` when conversion starts on layer 0."""

    def __init__(self, gate: Any = None) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str]] = []
        self.gate = gate

    def emit(self, record: logging.LogRecord) -> None:
        import time

        msg = record.getMessage()
        self.records.append((time.monotonic(), msg))
        # On a worker thread the item logs it starts; worker processes log in their own process,
        # so there the parent's hand-out is the start.
        if self.gate is not None and msg in ("layer.0 (rank 0): converting", "layer.0 (rank 0): to a worker process"):
            self.gate.set()


@pytest.fixture()
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    lg = logging.getLogger("atom_convert")
    old = lg.level
    lg.setLevel(logging.DEBUG)
    lg.addHandler(rec)
    yield rec
    lg.removeHandler(rec)
    lg.setLevel(old)


# ------------------------------------------------------------------------------------------------


def test_repo_spec_and_patterns(tmp_path: Path) -> None:
    assert parse_repo_spec("deepseek-ai/DeepSeek-R1").repo_id == "deepseek-ai/DeepSeek-R1"
    spec = parse_repo_spec("moonshotai/Kimi-K2-Instruct@v1.0")
    assert (spec.repo_id, spec.revision) == ("moonshotai/Kimi-K2-Instruct", "v1.0")
    assert parse_repo_spec("org/name", "abc").revision == "abc"
    local = tmp_path / "org"
    (local / "name").mkdir(parents=True)
    assert parse_repo_spec(str(local / "name")) is None  # an existing path is a path
    assert parse_repo_spec("./DeepSeek-V3") is None
    with pytest.raises(BadInputError, match="'v1' but --revision says 'v2'"):
        parse_repo_spec("org/name@v1", "v2")
    with pytest.raises(BadInputError, match="local path"):
        parse_repo_spec(str(local / "name"), "main")
    kimi_cfg = {"auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                             "AutoModel": "modeling_deepseek.DeepseekV3Model",
                             "AutoModelForCausalLM": "other/repo--modeling_x.M"}}
    kimi_tok = {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    assert auto_map_files(kimi_cfg, kimi_tok) == ["configuration_deepseek.py", "modeling_deepseek.py",
                                                  "tokenization_kimi.py"]
    pats = allow_patterns(kimi_cfg, kimi_tok)
    assert {"config.json", "model.safetensors.index.json", "*.safetensors", "tiktoken.model",
            "tokenization_kimi.py"} <= set(pats)


@pytest.mark.parametrize("workers", [1, 2], ids=["thread", "processes"])
def test_convert_from_repo_id_overlaps_download(hub: FakeHub, source_repo: str, source_dir: Path, hf_cache: Path,
                                                tmp_path: Path, recorder: Recorder, workers: int) -> None:
    """Layer 0 converts while the last shard downloads, on the calling thread and in worker
    processes (forked before the downloads start; the parent waits for an item's files)."""
    release = hub.hold(LAST)  # the last shard is served only once layer 0 is being converted
    recorder.gate = release
    n0 = len(hub.events)
    try:
        m = atom_convert.convert(SRC_REPO, tmp_path / "out", "gfx950", tp=2, workers=workers,
                                 worker_mode="process" if workers > 1 else "auto")
    finally:
        release.set()
        hub.holds.pop(LAST)
    events = hub.events[n0:]
    last_done = next(t for t, kind, p in events if kind == "get-done" and p == LAST)
    # The hold makes a conversion that waits for every shard before it starts hang; a start is the
    # item's own log line on a thread, its hand-out to a worker process otherwise.
    start = "layer.0 (rank 0): converting" if workers == 1 else "layer.0 (rank 0): to a worker process"
    started = next(t for t, msg in recorder.records if msg == start)
    assert started < last_done, "layer 0 was not converted before the last shard had arrived"
    verified = [msg for _, msg in recorder.records if "downloaded and verified" in msg]
    assert len(verified) == 3
    # Only what conversion needs was fetched: configs, index, shards, tokenizer and the auto_map code.
    got = set(downloads(hub, n0))
    assert got == {"config.json", "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json",
                   "tokenization_tiny.py", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                   LAST}
    assert m["source"]["hub"] == {"repo_id": SRC_REPO, "revision": "main", "commit": source_repo}
    assert m["conversion"]["source"] == f"{SRC_REPO}@{source_repo}"
    assert m["conversion"]["content_key"].startswith("sha256:")
    # Byte-identical to converting the same checkpoint from a local folder.
    local = atom_convert.convert(source_dir, tmp_path / "local", "gfx950", tp=2)
    shards = {k: v for k, v in local["files"].items() if k.endswith(".safetensors")}
    assert shards and all(m["files"][k] == v for k, v in shards.items())
    assert m["mtp"]["status"] == "converted"


def test_download_verified_against_lfs_sha256(hub: FakeHub, source_repo: str, hf_cache: Path, tmp_path: Path) -> None:
    """A shard whose bytes differ from the Hub's LFS oid is refused, naming the file and both hashes."""
    src = open_source(SRC_REPO)
    try:
        good = src.wait("model-00001-of-00003.safetensors")
        real = good.resolve()
        data = bytearray(real.read_bytes())
        data[-1] ^= 0xFF
        real.chmod(0o644)
        real.write_bytes(bytes(data))
    finally:
        src.close()
    src = open_source(SRC_REPO)  # the cache now holds a damaged copy
    try:
        with pytest.raises(BadInputError, match=r"model-00001-of-00003.safetensors: sha256 [0-9a-f]{64}, the Hub's "
                                                r"LFS oid is [0-9a-f]{64}") as ei:
            src.wait("model-00001-of-00003.safetensors")
        assert "delete it" in str(ei.value)
    finally:
        src.close()


def test_offline_from_cache_and_not_cached(hub: FakeHub, source_repo: str, hf_cache: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, snapshot_download

    # Lay the cache out with huggingface_hub's own download, as a user's earlier run would.
    snapshot_download(SRC_REPO, allow_patterns=allow_patterns({}, {"auto_map": {"AutoTokenizer": ["tokenization_tiny.Tok", None]}}))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n0 = len(hub.requests)
    m = atom_convert.convert(SRC_REPO, tmp_path / "out", "gfx950")
    assert len(hub.requests) == n0, "offline mode sent requests"
    assert m["source"]["hub"]["commit"] == source_repo
    assert m["conversion"]["source"] == f"{SRC_REPO}@{source_repo}"
    with pytest.raises(BadInputError, match="offline") as ei:
        atom_convert.convert("deepseek-ai/not-cached", tmp_path / "out2", "gfx950")
    assert "HF_HUB_OFFLINE" in str(ei.value) and "not in the local" in str(ei.value)
    assert not (tmp_path / "out2").exists()


def test_refusals_name_the_repo_and_what_to_do(hub: FakeHub, source_repo: str, hf_cache: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"\0" * 64)
    api.create_repo("meta/tiny-llama", exist_ok=True)
    api.upload_folder(folder_path=llama, repo_id="meta/tiny-llama")
    api.create_repo("gated-org/tiny-v3", exist_ok=True)
    api.upload_folder(folder_path=hub_files(hub, SRC_REPO, tmp_path / "copy"), repo_id="gated-org/tiny-v3")
    hub.repos["gated-org/tiny-v3"].gated = True
    n0 = len(hub.events)
    with pytest.raises(BadInputError, match="LlamaForCausalLM") as ei:
        atom_convert.convert("meta/tiny-llama", tmp_path / "o1")
    assert "meta/tiny-llama" in str(ei.value)
    assert "model.safetensors" not in downloads(hub, n0)  # refused before anything large was fetched
    with pytest.raises(BadInputError, match="revision 'no-such-branch' does not exist"):
        atom_convert.convert(f"{SRC_REPO}@no-such-branch", tmp_path / "o2")
    with pytest.raises(BadInputError, match="no such repository on the Hub"):
        atom_convert.convert("deepseek-ai/no-such-repo", tmp_path / "o3")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(BadInputError, match="gated") as ei:
        atom_convert.convert("gated-org/tiny-v3", tmp_path / "o4")
    assert "HF_TOKEN" in str(ei.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    open_source("gated-org/tiny-v3").close()  # with the token it resolves
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def hub_files(hub: FakeHub, repo: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for p, data in hub.files(repo).items():
        (out / p).parent.mkdir(parents=True, exist_ok=True)
        (out / p).write_bytes(data)
    return out


def card_of(hub: FakeHub, repo: str, revision: str = "main") -> Any:
    from huggingface_hub import ModelCard

    return ModelCard(hub.files(repo, revision)["README.md"].decode())


@pytest.fixture(scope="module")
def hub_converted(hub: FakeHub, source_repo: str, tmp_path_factory: pytest.TempPathFactory, source_dir: Path) -> Path:
    """A conversion of the Hub source (tp=2), with `verify --json` saved beside its manifest."""
    from huggingface_hub import constants

    from atom_convert.check.verify import verify

    d = tmp_path_factory.mktemp("hubconv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(d / "hf-cache"))
        atom_convert.convert(SRC_REPO, d / "conv", "gfx950", tp=2)
    r = verify(d / "conv", source_dir, layers=[0], tokens=4)
    (d / "conv" / "atom_verify.json").write_text(json.dumps(r.as_dict(), indent=1))
    return d / "conv"


def test_upload_with_model_card(hub: FakeHub, hub_converted: Path) -> None:
    repo = "my-org/tiny-v3-atom-gfx950-tp2"
    r = atom_convert.upload(hub_converted, repo, private=True)
    assert hub.repos[repo].private
    manifest = json.loads((hub_converted / "atom_manifest.json").read_text())
    remote = hub.files(repo)
    want = set(manifest["files"]) | {"atom_manifest.json", "atom_verify.json", "README.md"}
    assert set(remote) == want | {".gitattributes"}  # the latter from the repo's creation
    for name in want - {"README.md"}:
        assert remote[name] == (hub_converted / name).read_bytes(), name
    assert sorted(n for n, _ in r.files) == sorted(want)
    card = card_of(hub, repo)
    meta = card.data.to_dict()
    assert meta["base_model"] == SRC_REPO
    assert {"atom", "rocm", "mla", "gfx950", "tp2", "DeepseekV3ForCausalLM", "bf16"} <= set(meta["tags"])
    ac = meta["atom_convert"]
    assert ac["content_key"] == manifest["conversion"]["content_key"]
    assert (ac["target"], ac["tp"], ac["ep"], ac["quant_format"]) == ("gfx950", 2, 1, "bf16")
    assert ac["layout_revision"]["atom"] == manifest["layout"]["atom_revision"]
    assert ac["source_commit"] == manifest["source"]["hub"]["commit"]
    assert manifest["conversion"]["command"] in card.text
    assert f"atom-convert {atom_convert.__version__}" in card.text
    verify_rows = json.loads((hub_converted / "atom_verify.json").read_text())["rows"]
    assert verify_rows and all(row["what"] in card.text for row in verify_rows)
    assert "open_converted" in card.text
    # Again: everything is there already, so no large file is sent twice.
    puts = len(hub.lfs_puts)
    atom_convert.upload(hub_converted, repo)
    assert len(hub.lfs_puts) == puts


@pytest.mark.parametrize("edit,says", [
    (lambda v: v.__setitem__("rows", "all good"), "rows is a string, expected a list"),
    (lambda v: v["rows"][0].pop("rel_l2"), "rows[0].rel_l2 is missing, expected a number"),
    (lambda v: v["rows"][0].__setitem__("cosine", "1.0"), "rows[0].cosine is a string '1.0', expected a number"),
], ids=["rows-string", "row-missing-key", "row-string-number"])
def test_upload_refuses_a_malformed_verify_result(hub: FakeHub, hub_converted: Path, tmp_path: Path, edit,
                                                  says: str) -> None:
    """The card shows the saved verify result: one that is not what verify --json writes is bad input
    naming the row and key (once a KeyError, an internal error), refused before anything is sent."""
    d = tmp_path / "conv"
    shutil.copytree(hub_converted, d)
    v = json.loads((d / "atom_verify.json").read_text())
    edit(v)
    (d / "atom_verify.json").write_text(json.dumps(v))
    with pytest.raises(atom_convert.BadInputError, match=re.escape(says)):
        atom_convert.upload(d, "my-org/malformed-verify", dry_run=True)


def test_upload_without_the_hub_is_bad_input(hub: FakeHub, hub_converted: Path, monkeypatch) -> None:
    """Offline (or the Hub unreachable): a BadInputError saying what to check, not an internal error."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(atom_convert.BadInputError, match="the Hub cannot be reached") as ei:
        atom_convert.upload(hub_converted, "my-org/offline")
    assert "HF_HUB_OFFLINE" in str(ei.value)


def test_upload_resumes_after_an_interrupted_commit(hub: FakeHub, hub_converted: Path) -> None:
    repo = "my-org/resume"
    hub.fail_next_commits = 1
    with pytest.raises(BadInputError, match="re-run the same command to resume"):
        atom_convert.upload(hub_converted, repo)
    sent = set(hub.lfs_puts)
    shards = {k for k in json.loads((hub_converted / "atom_manifest.json").read_text())["files"]
              if k.endswith(".safetensors")}
    assert len(sent) >= len(shards)
    puts = len(hub.lfs_puts)
    atom_convert.upload(hub_converted, repo)
    assert len(hub.lfs_puts) == puts, "LFS objects uploaded before the interruption were sent again"
    assert shards <= set(hub.files(repo))


def test_upload_pr_branch_and_refusal(hub: FakeHub, hub_converted: Path, tmp_path: Path) -> None:
    repo = "my-org/prs"
    r = atom_convert.upload(hub_converted, repo, create_pr=True, base_model="someone/else")
    assert r.pr_url and r.pr_url.endswith("/discussions/1")
    assert set(hub.files(repo)) == {".gitattributes"}  # main untouched
    pr = hub.files(repo, "refs/pr/1")
    assert "atom_manifest.json" in pr and "README.md" in pr
    assert card_of(hub, repo, "refs/pr/1").data.to_dict()["base_model"] == "someone/else"
    atom_convert.upload(hub_converted, repo, revision="gfx950-tp2")
    assert "README.md" in hub.files(repo, "gfx950-tp2") and set(hub.files(repo)) == {".gitattributes"}
    # A directory that no longer matches its manifest is refused before anything is sent.
    bad = tmp_path / "bad"
    shutil.copytree(hub_converted, bad)
    shard = next(p for p in sorted(bad.glob("*.safetensors")))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    n0 = len(hub.requests)
    with pytest.raises(ConvertedCheckError, match=f"{shard.name}: xxh3_blocks .* \\(corrupted\\)"):
        atom_convert.upload(bad, "my-org/never")
    assert len(hub.requests) == n0 and "my-org/never" not in hub.repos


def test_pull_instead_of_convert(hub: FakeHub, source_repo: str, hub_converted: Path, hf_cache: Path,
                                 tmp_path: Path, recorder: Recorder) -> None:
    repo = "my-org/tiny-v3-cache"
    atom_convert.upload(hub_converted, repo)
    n0 = len(hub.events)
    m = atom_convert.convert(SRC_REPO, tmp_path / "pulled", "gfx950", tp=2, hub_cache=repo)
    assert m["pulled_from"] == repo
    shards_fetched = [p for p in downloads(hub, n0) if p.endswith(".safetensors")]
    src_shards = {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert not src_shards & set(shards_fetched), "the source's shards were downloaded although the cache matched"
    assert not any("converting" in msg for _, msg in recorder.records)
    for name, meta in m["files"].items():
        assert (tmp_path / "pulled" / name).read_bytes() == (hub_converted / name).read_bytes()
    assert not (tmp_path / "pulled" / ".cache").exists()
    # Another tp is another content key: converted, not pulled.
    m1 = atom_convert.convert(SRC_REPO, tmp_path / "tp1", "gfx950", tp=1, hub_cache=repo)
    assert "pulled_from" not in m1 and m1["tp_size"] == 1
    assert m1["conversion"]["content_key"] != m["conversion"]["content_key"]


def test_ensure_converted_pulls_from_a_hub_cache(hub: FakeHub, source_dir: Path, tmp_path: Path,
                                                 recorder: Recorder) -> None:
    """Serving startup with a Hub cache: a matching converted repo is downloaded instead of converting;
    a call with other options converts."""
    conv = tmp_path / "conv"
    atom_convert.convert(source_dir, conv, "gfx950", tp=2)
    repo = "my-org/tiny-v3-local-cache"
    atom_convert.upload(conv, repo)
    n = len(recorder.records)
    got = atom_convert.ensure_converted(source_dir, tmp_path / "cache", target="gfx950", tp=2, hub_cache=repo)
    assert not any("converting" in msg for _, msg in recorder.records[n:]), "converted although the cache matched"
    m = json.loads((got / "atom_manifest.json").read_text())
    for name in m["files"]:
        assert (got / name).read_bytes() == (conv / name).read_bytes(), name
    assert atom_convert.ensure_converted(source_dir, tmp_path / "cache", target="gfx950", tp=2, hub_cache=repo) == got
    n = len(recorder.records)
    other = atom_convert.ensure_converted(source_dir, tmp_path / "cache", target="gfx942", tp=2, hub_cache=repo)
    assert other != got and any("converting" in msg for _, msg in recorder.records[n:])


def test_ensure_converted_from_a_repo_id(hub: FakeHub, source_dir: Path, hf_cache: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started with a repo id: the entry is keyed by the commit its revision resolves to,
    found again without converting (also offline, from the local cache), converted again when the
    branch moves to a new commit; the bytes are a local conversion's."""
    from huggingface_hub import HfApi, constants

    repo = "deepseek-ai/tiny-v3-moving"
    api = HfApi()
    api.create_repo(repo)
    api.upload_folder(folder_path=source_dir, repo_id=repo)
    first = hub.repos[repo].branches["main"]
    cache_dir = tmp_path / "cache"
    calls: list[str] = []
    real = atom_convert.engine.cache.convert
    monkeypatch.setattr(atom_convert.engine.cache, "convert", lambda src, *a, **k: calls.append(str(src)) or real(src, *a, **k))
    dst = atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=2)
    assert calls == [f"{repo}@{first}"]  # pinned to the commit the key was taken from
    assert dst.name.startswith("deepseek-ai--tiny-v3-moving-gfx950-tp2-")
    m = json.loads((dst / "atom_manifest.json").read_text())
    assert m["source"]["hub"]["commit"] == first
    local = atom_convert.convert(source_dir, tmp_path / "local", "gfx950", tp=2)
    assert all(m["files"][k] == v for k, v in local["files"].items() if k.endswith(".safetensors"))
    assert atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=2) == dst and len(calls) == 1
    with monkeypatch.context() as mp:  # offline: the cache that conversion filled answers
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        n0 = len(hub.requests)
        assert atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=2) == dst and len(calls) == 1
        assert len(hub.requests) == n0
    gen = json.loads((source_dir / "generation_config.json").read_text())
    gen["temperature"] = 0.25
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    api.upload_file(path_or_fileobj=str(tmp_path / "generation_config.json"), path_in_repo="generation_config.json",
                    repo_id=repo)
    second = hub.repos[repo].branches["main"]
    assert second != first
    assert atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=2) == dst
    assert calls[-1] == f"{repo}@{second}" and len(calls) == 2
    assert json.loads((dst / "generation_config.json").read_text())["temperature"] == 0.25
    # Offline with the Hugging Face cache gone (its shards deleted once converted): the entry converted
    # from that repo with these options is used, with a warning; other options have none: refused.
    shutil.rmtree(hf_cache)
    with monkeypatch.context() as mp:
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        assert atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=2) == dst and len(calls) == 2
        with pytest.raises(HubOfflineError, match="offline"):
            atom_convert.ensure_converted(repo, cache_dir, target="gfx950", tp=1)
    with pytest.raises(BadInputError, match="nor a Hub repo id"):
        atom_convert.ensure_converted(tmp_path / "no-such-folder", cache_dir)


def test_offline_after_an_online_conversion(hub: FakeHub, source_repo: str, hf_cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A repo converted once online converts again offline: the first run recorded the revision's
    commit in the Hugging Face cache (configs downloaded by revision, not by commit)."""
    from huggingface_hub import constants

    online = atom_convert.convert(SRC_REPO, tmp_path / "online", "gfx950")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n0 = len(hub.requests)
    offline = atom_convert.convert(SRC_REPO, tmp_path / "offline", "gfx950")
    assert len(hub.requests) == n0
    assert offline["source"]["hub"]["commit"] == online["source"]["hub"]["commit"] == source_repo
    assert offline["files"] == online["files"]


def test_pull_refuses_a_corrupt_cache_repo(hub: FakeHub, source_repo: str, hub_converted: Path, hf_cache: Path,
                                          tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    repo = "my-org/corrupt-cache"
    atom_convert.upload(hub_converted, repo)
    shard = sorted(n for n in hub.files(repo) if n.endswith(".safetensors"))[0]
    data = bytearray(hub.files(repo)[shard])
    data[100] ^= 1
    HfApi().upload_file(path_or_fileobj=bytes(data), path_in_repo=shard, repo_id=repo)
    with pytest.raises(ConvertedCheckError, match=f"{shard}: xxh3_blocks "):
        atom_convert.convert(SRC_REPO, tmp_path / "x", "gfx950", tp=2, hub_cache=repo)
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.")]


def test_cli_reads_the_hub_environment(hub: FakeHub, source_repo: str, hub_converted: Path, tmp_path: Path) -> None:
    """The real environment variables, in a fresh process: HF_ENDPOINT, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
           "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": str(Path(atom_convert.__file__).parents[1])}
    env.pop("HF_HUB_OFFLINE", None)
    exe = [sys.executable, "-c", "from atom_convert.cli import main; main()"]
    r = subprocess.run([*exe, "upload", str(hub_converted), "my-org/cli-upload", "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "atom_manifest.json" in r.stdout and "base_model: deepseek-ai/tiny-v3" in r.stdout
    assert "my-org/cli-upload" not in hub.repos
    r = subprocess.run([*exe, "convert", SRC_REPO, str(tmp_path / "out"), "--tp", "2", "--json"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["conversion"]["source"] == f"{SRC_REPO}@{source_repo}"
    assert (tmp_path / "hf-home" / "hub" / "models--deepseek-ai--tiny-v3" / "snapshots" / source_repo).is_dir()
    r = subprocess.run([*exe, "convert", "deepseek-ai/elsewhere", str(tmp_path / "out2")],
                       env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "offline" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
