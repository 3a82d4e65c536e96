"""Hugging Face Hub: repo ids as sources, converted repos as a cache, publishing.

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

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .._version import __version__
from ..errors import BadInputError, CheckpointError, ConvertedCheckError, HubOfflineError
from ..store.manifest import AITER_REVISION, ATOM_REVISION, FORMAT_VERSION, MANIFEST_NAME, sha256_file
from ..files.safetensors import SIDE_FILES, SIDE_SUFFIXES, auto_map_modules
from ..files.source import INDEX_NAME, SINGLE_NAME, SourceCheckpoint
from ..store.staging import OLD_SUFFIX


if TYPE_CHECKING:
    from ..layout.options import ConversionOptions

log = logging.getLogger(__name__)

VERIFY_NAME = "atom_verify.json"  # `atom-convert verify DST --json > DST/atom_verify.json`: shown on the card
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
        data = json.loads(path.read_text())
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


# ------------------------------------------------------------------------------------------------
# Content key
# ------------------------------------------------------------------------------------------------


def source_identity(src: SourceCheckpoint) -> dict[str, Any]:
    """What identifies the source's content without reading tensor data: the Hub commit (content
    addressed), or for a local folder the hashes of config.json and the index plus every file's size."""
    hub = getattr(src, "hub", None)
    if hub:
        return {"hub_commit": hub["commit"]}
    ident: dict[str, Any] = {"config_sha256": sha256_file(src.path / "config.json")}
    if src.index_file:
        ident["index_sha256"] = sha256_file(src.path / src.index_file)
    ident["files"] = {f: (src.path / f).stat().st_size for f in src.files}
    return ident


def content_key(identity: dict[str, Any], options: dict[str, Any]) -> str:
    payload = {"source": identity, "options": options,
               "layout": {"format_version": FORMAT_VERSION, "atom_revision": ATOM_REVISION,
                          "aiter_revision": AITER_REVISION}}
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def conversion_record(src: SourceCheckpoint, options: "ConversionOptions") -> dict[str, Any]:
    """The manifest's `conversion` block: source, options, content key and the command that reproduces it."""
    hub = getattr(src, "hub", None)
    source = f"{hub['repo_id']}@{hub['commit']}" if hub else str(src.path.resolve())
    layout = options.layout()
    return {"source": source, "options": layout, "content_key": content_key(source_identity(src), layout),
            "command": options.command(source), "tool_version": __version__}


# ------------------------------------------------------------------------------------------------
# Pull instead of convert
# ------------------------------------------------------------------------------------------------


PULL_SUFFIX = ".atom-pull"  # beside DST while a pull downloads (staging.py names the others)


@contextlib.contextmanager
def _pull_into(dst: Path) -> Iterator[Path]:
    """A directory beside DST that becomes DST only when complete; removed on any failure.
    An existing DST was already checked by convert() (an earlier conversion or empty, with --force)."""
    dst = Path(os.path.abspath(dst))
    tmp = dst.parent / f".{dst.name}{PULL_SUFFIX}"
    if os.path.lexists(tmp):
        raise BadInputError(f"{tmp} exists: another pull into {dst} runs, or one was interrupted; remove {tmp} "
                            "(atom-convert's own download folder) and run again")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}{OLD_SUFFIX}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pull_converted(repo: str, key: str, dst: str | Path) -> dict[str, Any] | None:
    """Download the converted repo `repo` (`org/name[@revision]`) into `dst` when its manifest carries
    `key`; every file is then checked against the manifest (size, sha256). Returns the manifest, or
    None (logged with the reason) when the repo is missing or holds another conversion.
    `dst` is staged beside itself and appears only complete."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    from ..check.tensors import check_files

    spec = parse_repo_spec(repo)
    if spec is None:
        raise BadInputError(f"hub cache {repo}: expected a Hub repo id (org/name or org/name@revision)")
    try:
        mpath = hf_hub_download(spec.repo_id, MANIFEST_NAME, revision=spec.revision)
    except (EntryNotFoundError, HfHubHTTPError, OSError) as e:
        log.warning("hub cache %s: no usable %s (%s); converting", spec, MANIFEST_NAME, type(e).__name__)
        return None
    remote = _read_json(Path(mpath), f"{spec}:{MANIFEST_NAME}")
    have = (remote.get("conversion") or {}).get("content_key")
    if have != key:
        log.warning("hub cache %s holds content key %s, this conversion is %s; converting", spec, have, key)
        return None
    files = sorted(remote.get("files", {})) + [MANIFEST_NAME]
    dst = Path(dst)
    with _pull_into(dst) as tmp:
        try:
            snapshot_download(spec.repo_id, revision=spec.revision, allow_patterns=files, local_dir=tmp)
        except (HfHubHTTPError, OSError) as e:
            raise _hub_error(e, spec) from None
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's local_dir bookkeeping, written just now
        report = check_files(tmp)
        if report.problems:
            raise ConvertedCheckError(f"hub cache {spec}: the downloaded files do not match its manifest:\n"
                                      + "\n".join(f"  - {p}" for p in report.problems)
                                      + "\nRe-upload the conversion (atom-convert upload), or convert without "
                                        "--hub-cache.")
    log.info("hub cache %s: content key %s matched; downloaded and checked %d files", spec, key, report.files_checked)
    return remote


# ------------------------------------------------------------------------------------------------
# Model card and upload
# ------------------------------------------------------------------------------------------------


def card_metadata(manifest: dict[str, Any], base_model: str | None) -> dict[str, Any]:
    src = manifest["source"]
    conv = manifest.get("conversion") or {}
    par = manifest.get("parallel") or {}
    tags = ["atom", "rocm", "mla", "atom-convert", src["architecture"], src["model_type"], src["quant_format"],
            manifest["target"], f"tp{manifest['tp_size']}"] + ([f"ep{par['ep']}"] if par.get("ep", 1) > 1 else []) \
        + (["dp-attention"] if par.get("dp_attention") else [])
    meta: dict[str, Any] = {
        "library_name": "atom-convert",
        "tags": list(dict.fromkeys(tags)),
        "atom_convert": {
            "content_key": conv.get("content_key"),
            "architecture": src["architecture"],
            "model_type": src["model_type"],
            "quant_format": src["quant_format"],
            "target": manifest["target"],
            "tp": manifest["tp_size"],
            "ep": int(par.get("ep", 1)),  # the expert-parallel size; 1: experts split by MoE-TP
            "dp_attention": bool(par.get("dp_attention")),
            "layout_revision": {"atom": manifest["layout"]["atom_revision"],
                                "aiter": manifest["layout"]["aiter_revision"],
                                "format_version": manifest["format_version"]},
            "source_commit": (src.get("hub") or {}).get("commit"),
            "tool_version": manifest["tool_version"],
        },
    }
    if base_model:
        meta["base_model"] = base_model
    return meta


def _verify_table(result: dict[str, Any]) -> str:
    lines = ["| check | rel L2 | cosine | max abs | top-1 | result |", "|---|---|---|---|---|---|"]
    for row in result.get("rows", []):
        top1 = f"{row['top1']:.3f}" if "top1" in row else ""
        res = "info" if row.get("kind") == "info" else "ok" if row.get("ok") else "FAIL"
        lines.append(f"| {row['what']} | {row['rel_l2']:.3g} | {row['cosine']:.6f} | {row['max_abs']:.3g} | {top1} | {res} |")
    head = (f"`atom-convert verify --json` ({'passed' if result.get('ok') else 'FAILED'}): {result.get('files_checked')} "
            f"files checked, {result.get('tensors_checked')} tensor headers, {result.get('values_checked')} tensors "
            "decoded against the source.")
    return head + "\n\n" + "\n".join(lines)


def model_card(manifest: dict[str, Any], *, repo_id: str, base_model: str | None = None,
               verify: dict[str, Any] | None = None) -> str:
    """README.md for a converted repo: YAML metadata, how to load, how it was made, verification."""
    from huggingface_hub import ModelCard, ModelCardData

    src = manifest["source"]
    conv = manifest.get("conversion") or {}
    data = ModelCardData(**card_metadata(manifest, base_model))
    flags = "\n".join(f"| `{k}` | `{v}` |" for k, v in manifest["layout"]["flags"].items())
    what = base_model or src["architecture"]
    body = f"""
# {what} in ATOM's post-load layout ({manifest['target']}, tp={manifest['tp_size']})

These are the tensors the ROCm ATOM runtime holds after `process_weights_after_loading`, one set of
safetensors shards per tensor-parallel rank, written by
[atom-convert](https://pypi.org/project/atom-convert/) {manifest['tool_version']}. A loader maps them and
must never run `process_weights_after_loading` on them again; `atom_manifest.json` lists every tensor
with its file, dtype, shape and `is_shuffled`.

## Load

```python
from huggingface_hub import snapshot_download
import atom_convert

path = snapshot_download("{repo_id}")
with atom_convert.open_converted(path, rank=0) as ck:   # rank 0 of {manifest['tp_size']}
    for name in ck.keys():
        tensor = ck.get(name)
```

or let atom-convert fetch this repo instead of converting, when the source commit and options match
(content key `{conv.get('content_key')}`):

```bash
atom-convert convert {conv.get('source', what)} ./converted --target {manifest['target']} --tp {manifest['tp_size']} --hub-cache {repo_id}
```

## How it was made

```bash
{conv.get('command', '(not recorded)')}
```

| | |
|---|---|
| source | `{conv.get('source', src.get('path'))}` ({src['architecture']}, `{src['model_type']}`, {src['quant_format']}) |
| target | {manifest['target']} (fp8 `{manifest['fp8_dtype']}`) |
| parallel | tp={manifest['tp_size']}, ep={(manifest.get('parallel') or {}).get('ep', 1)}, dp_attention={bool((manifest.get('parallel') or {}).get('dp_attention'))} |
| ATOM layout revision | `{manifest['layout']['atom_revision']}` (aiter `{manifest['layout']['aiter_revision']}`), manifest format {manifest['format_version']} |
| tool version | atom-convert {manifest['tool_version']} |
| MTP | {manifest.get('mtp', {}).get('status')} |
| content key | `{conv.get('content_key')}` |

Runtime flags the layout assumes:

| flag | value |
|---|---|
{flags}

## Verification

{_verify_table(verify) if verify else "No `atom-convert verify --json` result was saved beside the manifest; run `atom-convert verify DST --source SRC --json > DST/" + VERIFY_NAME + "` before uploading to show it here."}
"""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


@dataclass
class UploadResult:
    repo_id: str
    files: list[tuple[str, int]]  # (path in repo, bytes), README.md included
    card: str
    commit_url: str | None = None
    pr_url: str | None = None
    dry_run: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def upload(dst: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
           create_pr: bool = False, dry_run: bool = False, base_model: str | None = None,
           token: str | None = None) -> UploadResult:
    """Publish a converted directory to the Hub with a model card.

    Refuses a directory whose files do not match its manifest (sizes and sha256). Creates `repo_id`
    when missing (`private` applies then), uploads the manifest's files with `upload_folder` (re-running
    after an interruption skips what the Hub already holds), then writes README.md.
    `base_model` defaults to the source repo id recorded in the manifest.

    Example:
        >>> atom_convert.upload("r1-atom", "my-org/DeepSeek-R1-atom-gfx950-tp8", private=True)
    """
    from ..check.tensors import check_files
    from ..store.manifest import read_manifest

    dst = Path(dst)
    if parse_repo_spec(repo_id) is None or "@" in repo_id:
        raise BadInputError(f"REPO_ID {repo_id!r}: expected org/name (a branch goes in --revision)")
    if create_pr and revision not in (None, "main"):
        raise BadInputError(f"--create-pr opens a pull request against main; --revision {revision} cannot be "
                            "combined with it: drop one of them")
    report = check_files(dst)
    if report.problems:
        raise ConvertedCheckError(f"{dst}: the files do not match {MANIFEST_NAME}; not uploading:\n"
                                  + "\n".join(f"  - {p}" for p in report.problems)
                                  + "\nConvert again (atom-convert convert --force) and upload the new directory.")
    manifest = read_manifest(dst)
    base = base_model or (manifest["source"].get("hub") or {}).get("repo_id")
    verify = _read_json(dst / VERIFY_NAME, str(dst / VERIFY_NAME)) if (dst / VERIFY_NAME).is_file() else None
    card = model_card(manifest, repo_id=repo_id, base_model=base, verify=verify)
    names = sorted(manifest["files"]) + [MANIFEST_NAME] + ([VERIFY_NAME] if verify else [])
    files = [(n, (dst / n).stat().st_size) for n in names] + [(CARD_NAME, len(card.encode()))]
    result = UploadResult(repo_id, files, card, dry_run=dry_run)
    if dry_run:
        return result
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=dst, repo_id=repo_id, revision=revision, create_pr=create_pr,
                                 allow_patterns=names,
                                 commit_message=f"atom-convert {__version__}: {manifest['source']['architecture']} "
                                                f"for {manifest['target']} tp={manifest['tp_size']}")
        # Into the pull request the files opened; when they were all on the Hub already (no PR),
        # the card alone opens one if it changed.
        in_pr = bool(create_pr and info.pr_revision)
        card_info = api.upload_file(path_or_fileobj=card.encode(), path_in_repo=CARD_NAME, repo_id=repo_id,
                                    revision=info.pr_revision if in_pr else revision,
                                    create_pr=create_pr and not in_pr, commit_message="Model card (atom-convert)")
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise BadInputError(f"{repo_id}: the Hub refused the upload ({status}); set HF_TOKEN to a token with "
                                "write access to this namespace (or run `hf auth login`)") from None
        raise BadInputError(f"{repo_id}: upload failed: {e}; re-run the same command to resume "
                            "(files the Hub already holds are skipped)") from None
    result.commit_url = card_info.commit_url
    result.pr_url = info.pr_url or card_info.pr_url
    return result
