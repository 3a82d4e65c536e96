"""Hugging Face Hub: repo ids as sources (this module); the content key and pulling (pull.py);
the model card and upload (publish.py).

How it works:
1. `parse_repo_spec` tells a repo id (`org/name`, `org/name@revision`) from a local path; an existing
   path always wins.
2. `open_source` (online): `model_info(files_metadata=True)` resolves the revision to a commit and lists
   every file with its size and LFS sha256. config.json and tokenizer_config.json come first (through
   `snapshot_download` by the revision asked for, which also records in the cache the commit that
   revision names, so that a later offline run resolves it); the config
   must describe a DeepSeek/Kimi checkpoint before anything large is fetched. Then the small files the
   conversion needs (`allow_patterns`), and the shard headers by ranged requests
   (`get_safetensors_metadata`): the plan needs only those.
3. `HubSource.begin` starts the shard downloads in the order the conversion reads them, a few at a
   time, each through `hf_hub_download` (huggingface_hub's own byte bars, cache and resume) and then
   verified: size, and sha256 against the Hub's LFS oid. A file's data is read only after its
   verification (`_before_open` waits for it), so a layer is converted as soon as its shards are in while
   later shards are still downloading.
   Offline (HF_HUB_OFFLINE=1, or the Hub unreachable), `snapshot_download(local_files_only=True)` finds
   the cached snapshot; every file the patterns select must be there.
4. The content key: sha256 over the source's identity (the Hub commit, or the local fingerprint), the
   options and the layout revision. It is written into the manifest and the model card, and a Hub repo
   of converted shards whose manifest carries the same key is downloaded and checked instead of
   converting (`pull_converted`).
5. `upload`: checks the directory against its manifest (`check.check_files`), creates the repo when
   missing, uploads the manifest's files with `upload_folder` (huggingface_hub's streamed, resumable
   path), then the model card README.md built from the manifest.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInputError, CheckpointError, HubOfflineError
from ..store.manifest import sha256_file
from ..files.reading import loads, os_error, read_regular
from ..files.safetensors import SIDE_FILES, SIDE_SUFFIXES, auto_map_modules
from ..files.source import INDEX_NAME, SINGLE_NAME, SourceCheckpoint


log = logging.getLogger(__name__)

CARD_NAME = "README.md"
DOWNLOAD_WORKERS = 4  # shards downloaded at once; the Hub serves each connection at a few hundred MB/s

# What a conversion needs from a source repo (besides the *.py files the configs' auto_map name).
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^@\s]+))?$")


@dataclass(frozen=True)
class RepoSpec:
    repo_id: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_repo_spec(src: str | Path, revision: str | None = None) -> RepoSpec | None:
    """A RepoSpec when `src` names a Hub repo, None for a local path (an existing path wins)."""
    text = str(src)
    m = _REPO_ID.match(text)
    if m is None or Path(text).exists():
        if revision is not None:
            raise BadInputError(f"--revision {revision} is given, but SRC {text} is a local path, not a Hub repo id "
                                "(org/name); drop --revision or name a repo")
        return None
    rev = m.group("rev")
    if rev and revision and rev != revision:
        raise BadInputError(f"SRC {text} names revision {rev!r} but --revision says {revision!r}; give one of them")
    return RepoSpec(m.group("repo"), rev or revision)


def auto_map_files(*configs: dict[str, Any]) -> list[str]:
    """The *.py files that configs' auto_map entries reference ("module.Class" -> module.py), each
    once (safetensors_file.auto_map_modules: entries of another repo, "org/repo--module.Class",
    are not in this repo and are skipped)."""
    return sorted({f for cfg in configs for f in auto_map_modules(cfg)})


def allow_patterns(config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> list[str]:
    """The snapshot patterns a conversion needs: configs, index, safetensors, tokenizer, auto_map code."""
    return [*SIDE_FILES, INDEX_NAME, "*.safetensors", *("*" + s for s in SIDE_SUFFIXES),
            *auto_map_files(config, tokenizer_config or {})]


def _hub_error(e: Exception, spec: RepoSpec) -> BadInputError:
    """A huggingface_hub error as a BadInputError that says what to do."""
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    rev = spec.revision or "main"
    if isinstance(e, GatedRepoError):
        return BadInputError(f"{spec.repo_id} is a gated repo and the request was refused (no token, or a token "
                             "without access): accept its terms on the repo's Hub page, then set HF_TOKEN to a "
                             "token of that account (or run `hf auth login`)")
    if isinstance(e, RevisionNotFoundError):
        return BadInputError(f"{spec.repo_id}: revision {rev!r} does not exist; give an existing branch, tag or "
                             "commit (org/name@revision or --revision), or leave it out for main")
    if isinstance(e, RepositoryNotFoundError):
        return BadInputError(f"{spec.repo_id}: no local folder of that name, and no such repository on the Hub (or "
                             "it is private and HF_TOKEN does not grant access); check the path or the repo id, or "
                             "set HF_TOKEN for a private repo")
    if isinstance(e, IncompleteSnapshotError):
        return HubOfflineError(f"{spec}: offline (HF_HUB_OFFLINE=1 or the Hub unreachable) and the local Hugging Face "
                             f"cache holds only part of the files a conversion needs ({e}); run once online, or "
                             f"`hf download {spec.repo_id}` with the same revision, then retry")
    if isinstance(e, LocalEntryNotFoundError):
        return HubOfflineError(f"{spec}: offline (HF_HUB_OFFLINE=1 or the Hub unreachable) and not in the local "
                             "Hugging Face cache (HF_HOME); run once with network access (unset HF_HUB_OFFLINE) or "
                             f"`hf download {spec.repo_id}` first, then retry")
    return BadInputError(f"{spec}: the Hub request failed: {type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the LFS oid; None for a file stored in git itself


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = loads(read_regular(path))
    except OSError as e:
        raise os_error(path, e) from None
    except ValueError as e:
        raise BadInputError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_architecture(config: dict[str, Any], where: str) -> None:
    from ..layout.model import ModelSpec

    ModelSpec.from_config(config, where=where)  # UnsupportedError naming the architecture found


def verify_download(path: Path, remote: RemoteFile, where: str) -> None:
    """Size, then the Hub's sha256 (the LFS oid, where the Hub gives one) of a downloaded file."""
    size = path.stat().st_size
    hint = (f"The copy in the Hugging Face cache ({path.resolve()}) is damaged: delete it (or "
            "`hf cache delete`) and run again.")
    if size != remote.size:
        raise CheckpointError(f"{where}: {size} bytes on disk, the Hub lists {remote.size}", hint=hint)
    if remote.sha256:
        digest = sha256_file(path)
        if digest != remote.sha256:
            raise CheckpointError(f"{where}: sha256 {digest}, the Hub's LFS oid is {remote.sha256}", hint=hint)


class HubSource(SourceCheckpoint):
    """A source checkpoint whose shards are still downloading: headers come from ranged requests,
    and reading a file's data waits until that file is downloaded and verified."""

    def __init__(self, folder: Path, spec: RepoSpec, commit: str, remote: dict[str, RemoteFile],
                 headers: dict[str, dict[str, Any]], workers: int = DOWNLOAD_WORKERS, allow_nonfinite: bool = False):
        self.spec = spec
        self.commit = commit
        self._remote = remote
        self._remote_headers = headers
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[Path]] = {}
        self._lock = threading.Lock()
        self.hub = {"repo_id": spec.repo_id, "revision": spec.revision or "main", "commit": commit}
        super().__init__(folder, allow_nonfinite=allow_nonfinite)

    def _file_present(self, file: str) -> bool:
        return file in self._remote

    def _check_file(self, rel: str, what: str) -> str | None:
        # The shards are not on disk yet: the repo's file list decides (each download is then
        # verified against the Hub's size and sha256 before use).
        if rel in ("config.json", INDEX_NAME) and (self.path / rel).is_file():
            return super()._check_file(rel, what)
        return None if rel in self._remote else f"{what}: {rel} is not in the repo {self.spec.repo_id}@{self.commit[:12]}"

    def _read_header(self, file: str) -> dict[str, Any]:
        return self._remote_headers[file]

    def _download(self, file: str) -> Path:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(self.spec.repo_id, file, revision=self.commit))
        verify_download(path, self._remote[file], f"{self.spec.repo_id}@{self.commit[:12]}:{file}")
        log.info("%s: downloaded and verified (%d bytes)", file, self._remote[file].size)
        return path

    def begin(self, file_order: list[str]) -> None:
        with self._lock:
            if self._pool is not None:
                return
            order = [f for f in file_order if f in self.files] + [f for f in self.files if f not in file_order]
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="atom-convert-download")
            for f in order:
                self._futures[f] = self._pool.submit(self._download, f)

    def wait(self, file: str) -> Path:
        """Block until `file` is downloaded and verified (starting the downloads if not yet)."""
        self.begin(self.files)
        return self._futures[file].result()

    def _before_open(self, file: str) -> None:
        if self._forked:  # a worker process: the converting process waited for it (wait_for)
            return
        self.wait(file)

    def after_fork(self) -> None:
        super().after_fork()
        self._lock = threading.Lock()

    def file_sizes(self) -> dict[str, int]:
        return {f: self._remote[f].size for f in self.files}

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            # Queued downloads are dropped; one in flight finishes in its thread (huggingface_hub
            # cannot be interrupted mid-file) and stays in the cache for the next run.
            self._pool.shutdown(wait=False, cancel_futures=True)


def open_source(src: str | Path, revision: str | None = None, *, allow_nonfinite: bool = False) -> SourceCheckpoint:
    """A local folder, or a Hub repo id resolved (online or from the cache) as described above."""
    spec = parse_repo_spec(src, revision)
    if spec is None:
        return SourceCheckpoint(src, allow_nonfinite=allow_nonfinite)
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(spec.repo_id, revision=spec.revision, files_metadata=True)
    except (OSError, httpx2.TransportError) as e:  # OfflineModeIsEnabled is a ConnectionError
        if isinstance(e, HfHubHTTPError) and not _is_transient(e):
            raise _hub_error(e, spec) from None
        log.info("%s: Hub not reachable (%s); using the local cache", spec, type(e).__name__)
        return _open_cached(spec, allow_nonfinite)
    commit = info.sha
    if not commit:
        raise BadInputError(f"{spec}: the Hub returned no commit for this revision")
    remote = {s.rfilename: RemoteFile(s.rfilename, int(s.lfs.size if s.lfs else (s.size or 0)),
                                      s.lfs.sha256 if s.lfs else None) for s in (info.siblings or [])}
    return _open_online(spec, commit, remote, allow_nonfinite)


def _is_transient(e: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError)):
        return False
    resp = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
    return resp is None or resp.status_code >= 500


def _snapshot(spec: RepoSpec, revision: str, patterns: list[str], offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(spec.repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise _hub_error(e, spec) from None


def _open_online(spec: RepoSpec, commit: str, remote: dict[str, RemoteFile], allow_nonfinite: bool = False) -> HubSource:
    from huggingface_hub import HfApi

    where = f"{spec.repo_id}@{commit[:12]}"
    if "config.json" not in remote:
        raise BadInputError(f"{where}: the repo has no config.json, so it is not a Hugging Face transformers "
                            "checkpoint; name a DeepSeek V2/V3/R1 or Kimi-K2 repo")
    # By the revision asked for, not the commit: huggingface_hub then records the revision -> commit
    # ref in the cache, which a later offline run (`_open_cached`) resolves the revision by.
    folder = _snapshot(spec, spec.revision or "main", ["config.json", "tokenizer_config.json"], offline=False)
    if folder.name != commit:
        raise BadInputError(f"{spec}: the revision moved from commit {commit[:12]} to {folder.name[:12]} while it was "
                            "being read; run again (or pin a commit: org/name@<commit>)")
    config = _read_json(folder / "config.json", f"{where}:config.json")
    _check_architecture(config, f"{where}:config.json")
    if INDEX_NAME not in remote and SINGLE_NAME not in remote:
        raise BadInputError(f"{where}: neither {INDEX_NAME} nor {SINGLE_NAME} in the repo; atom-convert reads "
                            "safetensors checkpoints only")
    tok = folder / "tokenizer_config.json"
    patterns = allow_patterns(config, _read_json(tok, f"{where}:tokenizer_config.json") if tok.is_file() else None)
    small = [f for f in remote if any(fnmatch.fnmatch(f, p) for p in patterns) and not f.endswith(".safetensors")]
    _snapshot(spec, commit, small, offline=False)
    meta = HfApi().get_safetensors_metadata(spec.repo_id, revision=commit)
    headers: dict[str, dict[str, Any]] = {}
    for f, fm in meta.files_metadata.items():
        if f not in remote:
            raise BadInputError(f"{where}: {INDEX_NAME} names {f}, which the repo does not hold")
        headers[f] = {n: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                      for n, t in fm.tensors.items()}
    return HubSource(folder, spec, commit, remote, headers, allow_nonfinite=allow_nonfinite)


def _open_cached(spec: RepoSpec, allow_nonfinite: bool = False) -> SourceCheckpoint:
    rev = spec.revision or "main"
    folder = _snapshot(spec, rev, ["config.json", "tokenizer_config.json"], offline=True)
    where = f"{spec.repo_id}@{folder.name[:12]} (cached)"
    config = _read_json(folder / "config.json", f"{where}:config.json")
    _check_architecture(config, f"{where}:config.json")
    tok = folder / "tokenizer_config.json"
    patterns = allow_patterns(config, _read_json(tok, f"{where}:tokenizer_config.json") if tok.is_file() else None)
    folder = _snapshot(spec, rev, patterns, offline=True)
    src = SourceCheckpoint(folder, allow_nonfinite=allow_nonfinite)
    src.hub = {"repo_id": spec.repo_id, "revision": rev, "commit": folder.name}  # snapshots/<commit>
    return src
