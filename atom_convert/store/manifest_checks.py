"""Validation of a manifest as read: its structure and types, its format version, and that every file
it names is a plain relative path inside its directory (store/manifest.read_manifest runs it)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..layout.parallel import REPLICATED, Parallel, ParallelLayout, Split
from ..errors import BadInputError, ConvertedCheckError, json_kind
from ..files.dtypes import FP8_DTYPE_BY_TARGET, ST_DTYPE, dtype_from_name, dtype_name
from ..files.targets import TARGETS
from . import digest

if TYPE_CHECKING:
    pass


# the version this code writes (store/manifest.py re-exports it); what digest each version's files
# carry (5: xxh3_blocks, 4: blake3_blocks, 3: blake3, 1 and 2: sha256) is store/digest.py's KEY_OF_VERSION, and
# each is still checked as it is
FORMAT_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)


# ------------------------------------------------------------------------------------------------
# Checking a manifest before anything reads it (a damaged, hand-edited or hostile manifest is bad
# input: refused naming the file, the entry, the expected and the actual value, and what to do)
# ------------------------------------------------------------------------------------------------

_FIX_AGAIN = ("the manifest is damaged, was edited, or was not written by atom-convert: convert the checkpoint "
              "again (atom-convert convert SRC DST --force)")
_FIX_PATHS = ("every file a manifest names must be a plain relative path inside its directory (no '..', not "
              "absolute, no symlink leading out; a Hugging Face cache snapshot's blobs/ excepted): convert the "
              "checkpoint again (atom-convert convert SRC DST --force) rather than editing the manifest")
_FIX_VERSION = ("upgrade atom-convert (pip install -U atom-convert) to read it, or convert the checkpoint again "
                "with this version (atom-convert convert SRC DST --force)")
SPLIT_KINDS = ("replicated", "dim", "heads", "experts")
PLACEMENTS = ("per_rank", "common")
_HEX = re.compile(r"[0-9a-f]+")


def _is_hex(v: Any, digits: int) -> bool:
    """A digest of `digits` lower-case hex digits (store/digest.py HEX_DIGITS)."""
    return isinstance(v, str) and len(v) == digits and _HEX.fullmatch(v) is not None


def converted_error(problems: list[str], fix: str, listed: bool = False) -> ConvertedCheckError:
    """The error for a converted directory that fails a check: the problems (each naming the file
    and the entry), then what to do. `listed`: the first line is a heading, the rest listed under it
    (an ErrorFactory of files/safetensors.py)."""
    if listed:
        head, rest = problems[0], problems[1:]
    elif len(problems) == 1:
        head, rest = problems[0], []
    else:
        head, rest = f"{len(problems)} problems:", problems
    lines = [head] + [f"  - {x}" for x in rest[:20]]
    if len(rest) > 20:
        lines.append(f"  ... and {len(rest) - 20} more")
    lines.append(fix[0].upper() + fix[1:] + ("" if fix.endswith(".") else "."))
    return ConvertedCheckError("\n".join(lines))


def _refuse(p: Path, problems: list[str], fix: str) -> ConvertedCheckError:
    """The manifest `p` refused: its problems (one, or each listed), then what to do."""
    if len(problems) == 1:
        return converted_error([f"{p}: {problems[0]}"], fix)
    return converted_error([f"{p}: {len(problems)} problems:"] + problems, fix, listed=True)


def _check_paths(p: Path, m: dict[str, Any], directory: Path) -> None:
    """Every file name the manifest gives: tensors' file and rank_files, the files list, the MTP
    set's folder and manifest. Each offending path is named once, with the first entry naming it
    and how many more do."""
    root = _own_root(directory)
    named: dict[str, list[str]] = {}
    for name, e in m["tensors"].items():
        if "file" in e:
            named.setdefault(e["file"], []).append(f"tensors[{name!r}].file")
        for r, f in enumerate(e["rank_files"]):
            named.setdefault(f, []).append(f"tensors[{name!r}].rank_files[{r}]")
    for rel in m["files"]:
        named.setdefault(rel, []).append(f"files[{rel!r}]")
    mtp = m.get("mtp") or {}
    if mtp.get("status") == "converted":
        named.setdefault(mtp["path"], []).append("mtp.path")
        if "manifest" in mtp:
            named.setdefault(mtp["manifest"], []).append("mtp.manifest")
    problems = []
    for rel, where in named.items():
        why = path_problem(directory, root, rel)
        if why is not None:
            more = f" (and {len(where) - 1} more entries)" if len(where) > 1 else ""
            problems.append(f"{where[0]}{more} names {rel!r}: {why}")
    if problems:
        raise _refuse(p, problems, _FIX_PATHS)


def _own_root(directory: Path) -> Path:
    try:
        return directory.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(directory))


def _resolved(p: Path) -> Path | None:
    try:
        return p.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return None


def _confined(real: Path, root: Path) -> bool:
    """Whether a resolved path lies inside the resolved directory `root`, or in the blobs/ of the
    Hugging Face cache when `root` (or, for an `mtp/` set, its parent) is a cache snapshot
    (hub/models--org--name/snapshots/REV/ links each file to ../../blobs/HASH): the one symlink
    policy of files/safetensors.py."""
    if real == root or real.is_relative_to(root):
        return True
    return any(a.parent.name == "snapshots" and real.is_relative_to(a.parent.parent / "blobs")
               for a in (root, root.parent))


def path_problem(directory: Path, root: Path, rel: str) -> str | None:
    """Why the file name `rel` a manifest of `directory` gives is refused (None: it is a plain
    relative path that resolves inside the directory)."""
    if not rel:
        return "an empty path"
    if "\0" in rel:
        return "a path holding a NUL character"
    if "\\" in rel:
        return "a path holding a backslash (a path separator elsewhere)"
    if rel.startswith("/"):
        return "an absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return "a path with '..', which leaves the directory"
    if "" in parts or "." in parts:
        return "not a plain relative path (an empty or '.' component)"
    real = _resolved(directory / rel)
    if real is None:
        return "a path that cannot be resolved (a symlink loop)"
    if not _confined(real, root):
        return f"a path that resolves through a symlink to {real}, outside {root}"
    return None


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and v != ""


def _is_strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in v.values())


def _is_shape(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(d) for d in v)


def _is_dtype(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        return dtype_from_name(v) in ST_DTYPE
    except ValueError:
        return False


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _Checker:
    """Collects what is wrong with a manifest, each problem naming the entry."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def field(self, obj: dict[str, Any], where: str, key: str, test: Any, expected: str,
              required: bool = True) -> bool:
        """Whether obj[key] is there (or optional and absent) and passes `test`; a problem if not."""
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                self.problems.append(f"{name}: missing, expected {expected}")
            return False
        v = obj[key]
        if not test(v):
            self.problems.append(f"{name} is {json_kind(v)} {_show(v)}, expected {expected}")
            return False
        return True


def _check_version(p: Path, m: dict[str, Any]) -> int:
    if "format_version" not in m:
        raise converted_error([f"{p}: has no format_version (this atom-convert {__version__} writes format_version "
                               f"{FORMAT_VERSION})"], _FIX_AGAIN)
    v = m["format_version"]
    readable = ", ".join(map(str, READABLE_VERSIONS))
    if _is_int(v, 1) and v > FORMAT_VERSION:
        raise converted_error([f"{p}: format_version {v} was written by a newer atom-convert; this atom-convert "
                               f"{__version__} writes format_version {FORMAT_VERSION} and reads {readable}"],
                              _FIX_VERSION)
    if not (_is_int(v) and v in READABLE_VERSIONS):
        raise converted_error([f"{p}: format_version {_show(v)} is unknown; this atom-convert {__version__} writes "
                               f"format_version {FORMAT_VERSION} and reads {readable}"], _FIX_VERSION)
    return v


def _check_parallel(c: _Checker, par: Any, tp: int) -> int | None:
    """The parallel block; returns its world size when it can be used."""
    if not isinstance(par, dict):
        c.problems.append(f"parallel is {json_kind(par)}, expected an object (tp, ep, dp_attention, ranks, ...)")
        return None
    for key in ("tp", "dp", "ep", "attn_tp", "moe_tp", "world"):
        c.field(par, "parallel", key, lambda v: _is_int(v, 1), "an integer >= 1")
    for key in ("dp_attention", "mori_importable", "common_files"):
        c.field(par, "parallel", key, lambda v: isinstance(v, bool), "true or false")
    for key in ("shared_experts", "shared_expert_mode"):
        c.field(par, "parallel", key, _is_str, "a string")
    world = par.get("world")
    if not _is_int(world, 1):
        return None
    if world != tp:
        c.problems.append(f"parallel.world is {world}, but tp_size is {tp}; they are the same number")
    if not c.field(par, "parallel", "ranks", lambda v: isinstance(v, list) and len(v) == world,
                   f"a list of {world} rank layouts (one per rank)"):
        return None
    for i, r in enumerate(par["ranks"]):
        where = f"parallel.ranks[{i}]"
        if not isinstance(r, dict):
            c.problems.append(f"{where} is {json_kind(r)}, expected an object (rank, routed, slots, ...)")
            continue
        c.field(r, where, "rank", lambda v, i=i: _is_int(v) and v == i, f"{i} (its index)")
        for key in ("attn_tp_rank", "moe_tp_rank", "ep_rank"):
            c.field(r, where, key, _is_int, "an integer >= 0")
        c.field(r, where, "routed", lambda v: _is_shape(v) and len(v) == 2 and v[0] <= v[1],
                "[first, end) of the routed expert ids")
        c.field(r, where, "slots", lambda v: _is_shape(v), "a list of expert ids")
        c.field(r, where, "expert_map", lambda v: v is None or (isinstance(v, list) and all(_is_int(x, -1) for x in v)),
                "null or a list of integers >= -1", required=False)
    return world


def _check_tensor(c: _Checker, name: str, e: Any, world: int | None) -> None:
    where = f"tensors[{name!r}]"
    if not isinstance(e, dict):
        c.problems.append(f"{where} is {json_kind(e)}, expected an object (dtype, shape, rank_files, ...)")
        return
    c.field(e, where, "dtype", _is_dtype, "a dtype name safetensors stores, such as 'bfloat16'")
    c.field(e, where, "shape", _is_shape, "a list of integers >= 0")
    c.field(e, where, "is_shuffled", lambda v: isinstance(v, bool), "true or false")
    c.field(e, where, "sources", _is_strs, "a list of source tensor names")
    c.field(e, where, "placement", lambda v: v in PLACEMENTS, " or ".join(map(repr, PLACEMENTS)))
    c.field(e, where, "runtime_dtype", lambda v: v is None or _is_str(v), "null or a dtype name", required=False)
    c.field(e, where, "layout", lambda v: v is None or isinstance(v, dict), "null or an object", required=False)
    if c.field(e, where, "split", lambda v: isinstance(v, dict), "an object (kind, ways, dim)"):
        s = e["split"]
        c.field(s, f"{where}.split", "kind", lambda v: v in SPLIT_KINDS, " | ".join(SPLIT_KINDS))
        c.field(s, f"{where}.split", "ways", lambda v: _is_int(v, 1), "an integer >= 1", required=False)
        c.field(s, f"{where}.split", "dim", _is_int, "an integer >= 0", required=False)
    c.field(e, where, "file", lambda v: isinstance(v, str), "a file name", required=False)
    if world is not None and c.field(e, where, "rank_files", lambda v: _is_strs(v) and len(v) == world,
                                     f"a list of {world} file names (one per rank)"):
        files = e["rank_files"]
        if "file" in e and e["file"] != files[0]:
            c.problems.append(f"{where}.file is {e['file']!r}, but rank_files[0] is {files[0]!r}; they are the same file")
        if e.get("placement") == "common" and len(set(files)) != 1:
            c.problems.append(f"{where}: placement 'common' (one file every rank maps), but rank_files names "
                              f"{len(set(files))} different files")


def check_manifest(p: Path, m: Any, directory: Path) -> None:
    """Refuse a parsed manifest `m` (of the directory `directory`, read from `p`) that a reader
    could trip over: not an object, a format_version this atom-convert does not read (newer or
    unknown), a required key missing or of the wrong type, a tensor twice (an alias naming a
    tensor), or a file name that is no plain relative path inside `directory` (tensors' file and
    rank_files, the files list, the MTP set's path). Version 1 is upgraded in place."""
    if not isinstance(m, dict):
        raise converted_error([f"{p}: the manifest is {json_kind(m)}, expected a JSON object (format_version, "
                               f"tensors, files, ...)"], _FIX_AGAIN)
    version = _check_version(p, m)
    c = _Checker()
    c.field(m, "", "tool_version", _is_str, "a string")
    target_ok = c.field(m, "", "target", lambda v: v in TARGETS, " or ".join(map(repr, TARGETS)))
    if c.field(m, "", "fp8_dtype", _is_str, "a dtype name") and target_ok:
        want = dtype_name(FP8_DTYPE_BY_TARGET[m["target"]])
        if m["fp8_dtype"] != want:
            c.problems.append(f"fp8_dtype is {m['fp8_dtype']!r}, but target {m['target']!r} stores {want!r}")
    tp_ok = c.field(m, "", "tp_size", lambda v: _is_int(v, 1), "an integer >= 1")
    c.field(m, "", "role", _is_str, "'main' or 'mtp'", required=False)
    if c.field(m, "", "layout", lambda v: isinstance(v, dict), "an object (atom_revision, profile, flags)"):
        for key in ("atom_revision", "aiter_revision", "profile"):
            c.field(m["layout"], "layout", key, _is_str, "a string")
        c.field(m["layout"], "layout", "flags", lambda v: isinstance(v, dict), "an object")
    if c.field(m, "", "source", lambda v: isinstance(v, dict), "an object (architecture, model_type, quant_format)"):
        for key in ("architecture", "model_type", "quant_format"):
            c.field(m["source"], "source", key, _is_str, "a string")
        c.field(m["source"], "source", "hub", lambda v: isinstance(v, dict), "an object", required=False)
    if c.field(m, "", "model", lambda v: isinstance(v, dict), "an object (n_routed_experts, moe_layers)"):
        c.field(m["model"], "model", "n_routed_experts", _is_int, "an integer >= 0")
        c.field(m["model"], "model", "moe_layers", _is_str_map, "an object of layer -> kind")
    tensors_ok = c.field(m, "", "tensors", lambda v: isinstance(v, dict), "an object of tensor name -> entry")
    c.field(m, "", "aliases", _is_str_map, "an object of alias -> tensor name", required=False)
    digest_key = digest.KEY_OF_VERSION[version]
    if c.field(m, "", "files", lambda v: isinstance(v, dict), f"an object of file name -> bytes, {digest_key}"):
        for rel, meta in m["files"].items():
            where = f"files[{rel!r}]"
            if not isinstance(meta, dict):
                c.problems.append(f"{where} is {json_kind(meta)}, expected an object (bytes, {digest_key})")
                continue
            c.field(meta, where, "bytes", _is_int, "an integer >= 0")
            c.field(meta, where, digest_key, lambda v: _is_hex(v, digest.HEX_DIGITS[digest_key]),
                    f"{digest.HEX_DIGITS[digest_key]} hex digits")
    c.field(m, "", "dropped", lambda v: isinstance(v, dict), "an object of source tensor -> reason", required=False)
    c.field(m, "", "copied_files", _is_strs, "a list of file names", required=False)
    if c.field(m, "", "mtp", lambda v: isinstance(v, dict), "an object (status, path)", required=False):
        if c.field(m["mtp"], "mtp", "status", _is_str, "'converted', 'dropped' or 'absent'") \
                and m["mtp"]["status"] == "converted":
            c.field(m["mtp"], "mtp", "path", _is_str, "the MTP set's folder name")
            c.field(m["mtp"], "mtp", "manifest", _is_str, "the MTP set's manifest path", required=False)
    if c.field(m, "", "value_checks", lambda v: isinstance(v, dict), "an object", required=False):
        c.field(m["value_checks"], "value_checks", "warnings",
                lambda v: isinstance(v, list) and all(isinstance(w, dict) and isinstance(w.get("tensor"), str) for w in v),
                "a list of objects naming a tensor", required=False)
    c.field(m, "", "conversion", lambda v: isinstance(v, dict), "an object", required=False)
    if tensors_ok and version == 1:
        bad = [n for n, e in m["tensors"].items() if not (isinstance(e, dict) and isinstance(e.get("file"), str))]
        c.problems += [f"tensors[{n!r}].file: missing or not a string (version 1 names one file per tensor)"
                       for n in bad]
        if tp_ok and not bad and not c.problems:
            try:
                _upgrade_v1(m)
            except (BadInputError, KeyError, TypeError, ValueError, IndexError) as e:
                c.problems.append(f"version 1 cannot be read in version 2's terms ({e})")
    if c.problems:
        raise _refuse(p, c.problems, _FIX_AGAIN)
    world = _check_parallel(c, m.get("parallel"), m["tp_size"])
    for name, e in m["tensors"].items():
        _check_tensor(c, name, e, world)
    if c.problems:
        raise _refuse(p, c.problems, _FIX_AGAIN)
    _check_paths(p, m, directory)
    # what refers to what: an alias is no tensor name and names a tensor; every shard is listed
    for alias, target in (m.get("aliases") or {}).items():
        if alias in m["tensors"]:
            c.problems.append(f"aliases[{alias!r}]: names a tensor the manifest lists as well (a tensor named twice)")
        elif target not in m["tensors"]:
            c.problems.append(f"aliases[{alias!r}] is {target!r}, which is not a tensor of the manifest")
    unlisted: dict[str, str] = {}
    for name, e in m["tensors"].items():
        for r, f in enumerate(e["rank_files"]):
            if f not in m["files"]:
                unlisted.setdefault(f, f"tensors[{name!r}].rank_files[{r}]")
    c.problems += [f"{where} names {f!r}, which the files list lacks (its size and digest are not recorded)"
                   for f, where in unlisted.items()]
    if c.problems:
        raise _refuse(p, c.problems, _FIX_AGAIN)


def _v1_split(name: str, tp: int) -> Split:
    """Version 1 manifests had plain TP only and no split record: the split follows from the
    tensor's module (spec §5), as the loader's tables state it."""
    if tp == 1:
        return REPLICATED
    base = name.rsplit(".", 1)[0] if not name.endswith(("_weight", "_weight_scale")) else name
    if ".mlp.experts.w" in name:
        return Split("experts", tp)
    if ".W_K" in name or ".W_V" in name:
        return Split("heads", tp)
    if base.endswith(("embed_tokens", "lm_head", "shared_head.head", "q_b_proj", "q_proj", "kv_b_proj",
                      "gate_up_proj")):
        return Split("dim", tp, 0)
    if base.endswith(("o_proj", "down_proj")):
        return Split("dim", tp, 1)
    return REPLICATED


def _upgrade_v1(m: dict[str, Any]) -> None:
    """Version 1 (plain TP, every tensor per rank) in version 2's terms, in memory only."""
    tp = int(m["tp_size"])
    for name, e in m["tensors"].items():
        e.setdefault("rank_files", [e["file"]] * tp)
        e.setdefault("placement", "per_rank")
        e.setdefault("split", _v1_split(name, tp).as_dict())
    if "parallel" not in m:
        n_experts = int(m.get("model", {}).get("n_routed_experts") or 0)
        fused = "fused_shared_expert" in m.get("model", {}).get("moe_layers", {}).values()
        m["parallel"] = ParallelLayout.of(Parallel(tp=tp), n_experts, 1 if fused else 0, fused).as_dict()
