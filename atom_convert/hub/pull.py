"""The content key and pulling a converted repo instead of converting (hub/repo.py's docstring, step 4)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .._version import __version__
from ..errors import BadInputError, ConvertedCheckError
from ..store.manifest import AITER_REVISION, ATOM_REVISION, FORMAT_VERSION, MANIFEST_NAME, sha256_file
from ..files.source import SourceCheckpoint
from ..store.staging import OLD_SUFFIX


if TYPE_CHECKING:
    from ..layout.options import ConversionOptions

from .repo import _hub_error, _read_json, parse_repo_spec

log = logging.getLogger(__name__)

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
    try:
        tmp.mkdir()
    except FileExistsError:  # created between the check and here
        raise BadInputError(f"{tmp} exists: another pull into {dst} runs; wait for it, or remove {tmp} if no pull "
                            "runs, and run again") from None
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
    `key`; every file is then checked against the manifest (size, digest). Returns the manifest, or
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


