"""The model card and `upload` (hub/repo.py's docstring, step 5)."""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import BadInputError, ConvertedCheckError, json_found, json_kind
from ..layout.options import check_path
from ..store.manifest import MANIFEST_NAME, VERIFY_NAME


from .repo import CARD_NAME, _read_json, parse_repo_spec

log = logging.getLogger(__name__)

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


_VERIFY_NUMBERS = ("rel_l2", "cosine", "max_abs")


def check_verify_result(result: Any, where: str) -> dict[str, Any]:
    """A saved `atom-convert verify --json` result, as the card shows it: an object whose `rows` are
    objects with `what` and numbers (`top1` optional); BadInputError naming the row and key else."""
    fix = "; save it again with atom-convert verify DST --source SRC --json > DST/" + VERIFY_NAME
    if not isinstance(result, dict):
        raise BadInputError(f"{where}: is {json_kind(result)}, expected the JSON object verify --json writes{fix}")
    rows = result.get("rows", [])
    if not isinstance(rows, list):
        raise BadInputError(f"{where}: rows is {json_kind(rows)}, expected a list{fix}")
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadInputError(f"{where}: rows[{i}] is {json_kind(row)}, expected an object{fix}")
        bad = [k for k in _VERIFY_NUMBERS if not number(row.get(k))]
        if "top1" in row and not number(row["top1"]):  # optional
            bad.append("top1")
        if not isinstance(row.get("what"), str):
            bad.append("what")
        if bad:
            k = bad[0]
            raise BadInputError(f"{where}: rows[{i}].{k} is {json_found(row, k)}, expected "
                                f"{'a string' if k == 'what' else 'a number'}{fix}")
    return result


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a Hub call raises when the Hub cannot be reached (offline mode included):
    ConnectionError and TimeoutError, and the transport errors of the HTTP client huggingface_hub
    uses (not every OSError: a shard that cannot be read is another matter, said as such)."""
    import importlib

    out: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(out)


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


def _published_files(dst: Path, names: list[str]) -> bool:
    """Refuse to publish anything but regular files inside DST: every file the manifest lists (and
    the manifest) must be a regular file reached without a symlink (a link could lead out of DST,
    and the Hub would receive the file it points to). Returns whether DST holds an atom_verify.json
    to show on the card: a regular file, not a symlink; anything else there is refused."""
    root = dst.resolve()
    problems = []
    for n in names:
        p = root / n
        real = p.resolve()
        if real != p:
            problems.append(f"{n}: reached through a symlink (it resolves to {real}); only regular files inside "
                            f"{dst} are uploaded")
        elif not p.is_file() or p.is_symlink():
            problems.append(f"{n}: not a regular file")
    v = root / VERIFY_NAME
    has_verify = False
    if os.path.lexists(v):
        st = os.lstat(v)
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{VERIFY_NAME}: a symlink (to {os.readlink(v)}), not a regular file; replace it with the "
                            f"file itself or remove it")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{VERIFY_NAME}: not a regular file; remove it")
        else:
            has_verify = True
    if problems:
        raise ConvertedCheckError(f"{dst}: not uploading ({len(problems)} problem(s)):\n"
                                  + "\n".join(f"  - {x}" for x in problems)
                                  + "\nupload publishes only the regular files inside DST that its manifest lists, "
                                    "the manifest, the model card and atom_verify.json; convert again (atom-convert "
                                    "convert --force) rather than linking files into DST.")
    return has_verify


def _literal(name: str) -> str:
    """`name` as an upload_folder pattern matching that file alone (fnmatch's * ? [ escaped)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


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

    Refuses a directory whose files do not match its manifest (sizes and digests). Creates `repo_id`
    when missing (`private` applies then), uploads the manifest's files with `upload_folder` (re-running
    after an interruption skips what the Hub already holds), then writes README.md.
    `base_model` defaults to the source repo id recorded in the manifest.

    Example:
        >>> atom_convert.upload("r1-atom", "my-org/DeepSeek-R1-atom-gfx950-tp8", private=True)
    """
    from ..check.tensors import check_files
    from ..store.manifest import read_manifest

    dst = check_path("dst", dst)
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
    has_verify = _published_files(dst, sorted(manifest["files"]) + [MANIFEST_NAME])
    base = base_model or (manifest["source"].get("hub") or {}).get("repo_id")
    verify = (check_verify_result(_read_json(dst / VERIFY_NAME, str(dst / VERIFY_NAME)), str(dst / VERIFY_NAME))
              if has_verify else None)
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
                                 allow_patterns=[_literal(n) for n in names],
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
    except _network_errors() as e:  # offline mode, no route to the Hub, a reset connection
        raise BadInputError(f"{repo_id}: the Hub cannot be reached ({type(e).__name__}: {e}); check the network, "
                            "HF_ENDPOINT and HF_HUB_OFFLINE (uploading needs the Hub), then re-run the same command "
                            "to resume") from None
    result.commit_url = card_info.commit_url
    result.pr_url = info.pr_url or card_info.pr_url
    return result

