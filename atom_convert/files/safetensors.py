"""One reader of a checkpoint's files: safetensors headers, the files a checkpoint consists of, and
the side files carried beside the converted shards (issue 27).

Headers (`read_header`): an 8-byte little-endian length of at most `MAX_HEADER` = 100,000,000 bytes
(safetensors' own MAX_HEADER_SIZE; checked before anything more is read), then a JSON object with no
key twice; every entry but `__metadata__` has a dtype string, a shape list of integers >= 0 and
data_offsets [begin, end] with begin <= end and end - begin = dtype size x elements, and the spans lie
back to back from byte 0 of the data section to its end (none overlaps another, none lies past the
end of the file). These are the rules `safe_open` enforces, so a file accepted here is never refused
later mid-stream. `header_bytes` reads the same bytes without judging them (the source fingerprint
hashes them); `check_length` is the length check alone (a file mapped after its header was read).

Files (`member_problem`, `weight_files`, `select_side_files`), with one symlink policy for every
file of SRC that is read: its path is relative to SRC without `..`, and it resolves (through any
symlinks) inside SRC, or into the `blobs/` folder of the Hugging Face cache when SRC is one of the
cache's snapshots (hub/models--org--name/snapshots/REV/ links each file to ../../blobs/HASH). A file
that resolves anywhere else is refused, the error naming it and where it leads, and is never opened.

The checkpoint's weights are the shards its index (model.safetensors.index.json) names, or the
single model.safetensors. Its side files are the top-level files copied beside the shards: configs,
tokenizer files (`SIDE_FILES`, `*.tiktoken`) and Python files, which the configs load with
`trust_remote_code`. `auto_map` in config.json and tokenizer_config.json names classes as
`module.Class`, a list of such names (AutoTokenizer: [slow, fast], either may be null), or
`repo_id--module.Class` for code kept in another repository (not carried: transformers fetches it
from there); a module may import sibling modules of the folder (`from .configuration_deepseek import
...`), so every top-level `*.py` file is carried, once, whether an auto_map names it or not.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

from ..errors import CheckpointError, json_kind
from .reading import (ErrorFactory, SpecialFileError, load_json, loads, no_duplicates, open_regular, os_error,
                      read_regular)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE (bytes of JSON after the 8-byte length)
FIX_SOURCE = "Re-download the file; compare its size with the one on the Hub."

# Files copied from SRC beside the shards (whatever of them exists), besides *.tiktoken and *.py.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "tiktoken.model")
SIDE_SUFFIXES = (".tiktoken",)
CODE_SUFFIX = ".py"
CONFIG_FILES = ("config.json", "tokenizer_config.json")  # the files whose auto_map names code

def is_count(v: Any) -> bool:
    """A JSON integer >= 0 (safetensors' usize); JSON true/false are not integers."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ------------------------------------------------------------------------------------------------
# safetensors headers
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A validated safetensors header."""

    path: Path
    size: int  # the file's size in bytes
    data_start: int  # 8 + the header length: where byte 0 of the data section lies
    header: dict[str, Any]  # the JSON object as stored, `__metadata__` included
    raw: bytes = field(repr=False)  # the 8-byte length and the JSON bytes, as stored

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        """name -> {"dtype", "shape", "data_offsets"}, without `__metadata__`."""
        return {k: v for k, v in self.header.items() if k != "__metadata__"}


def header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, the first bytes of the file): the 8-byte length and, when the length is within
    `MAX_HEADER` and the file, the JSON header after it. Nothing is judged (a file shorter than 8
    bytes gives what it holds); OSError when the file cannot be read."""
    with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or device: refused, never waited on
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= min(MAX_HEADER, size - 8):
                head += f.read(n)
    return size, head


def check_length(head: bytes, size: int, name: str, fix: str = FIX_SOURCE,
                 error: ErrorFactory = CheckpointError) -> int:
    """The header length the first 8 bytes `head` of a file of `size` bytes give, checked against
    safetensors' limit and the file (before the header itself is read)."""
    if len(head) < 8:
        raise error([f"{name}: not a safetensors file ({size} bytes, expected at least 8)"], fix)
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise error([f"{name}: not a safetensors file: header length {n} bytes exceeds safetensors' limit of "
                     f"{MAX_HEADER} bytes (file size {size} bytes)"], fix)
    if 8 + n > size:
        raise error([f"{name}: truncated or not a safetensors file: header length {n} bytes, file size {size} bytes"],
                    fix)
    return n


def validate_entries(name: str, header: dict[str, Any], data_size: int) -> list[str]:
    """Every entry against the safetensors format (the module docstring's rules); the problems
    found, each naming the file `name` and the tensor, the expected and the actual value."""
    from .dtypes import DTYPE_FROM_ST  # here, not at the top: the command line imports this module without torch

    problems = []
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        problems.append(f"{name}: __metadata__ is {json_kind(meta)}, expected an object of strings")
    elif meta is not None:
        bad = [k for k, v in meta.items() if not isinstance(v, str)]
        if bad:
            problems.append(f"{name}: __metadata__[{bad[0]!r}] is {json_kind(meta[bad[0]])}, expected a string "
                            f"(__metadata__ maps strings to strings)" + (f"; {len(bad) - 1} more key(s) alike"
                                                                          if len(bad) > 1 else ""))
    spans: list[tuple[int, int, str]] = []
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        where = f"{name}: tensor {tensor!r}"
        if not isinstance(entry, dict):
            problems.append(f"{where}: entry is {json_kind(entry)}, expected an object with dtype, shape, data_offsets")
            continue
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            problems.append(f"{where}: entry has no {', '.join(missing)} (has {sorted(entry)})")
            continue
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = True
        if not isinstance(dtype, str):
            problems.append(f"{where}: dtype is {json_kind(dtype)} {dtype!r}, expected a string such as 'BF16'")
            ok = False
        if not (isinstance(shape, list) and all(is_count(d) for d in shape)):
            problems.append(f"{where}: shape {shape!r} is not a list of integers >= 0")
            ok = False
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_count(o) for o in offs) and offs[0] <= offs[1]):
            problems.append(f"{where}: data_offsets {offs!r} is not [begin, end] with integers 0 <= begin <= end")
            continue
        spans.append((offs[0], offs[1], tensor))
        dt = DTYPE_FROM_ST.get(dtype) if ok else None
        if dt is not None:
            want = math.prod(shape) * dt.itemsize
            if offs[1] - offs[0] != want:
                problems.append(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes, but dtype {dtype} x "
                                f"shape {shape} is {want} bytes")
    pos, prev = 0, None
    for b, e, tensor in sorted(spans):
        if b < pos:
            problems.append(f"{name}: tensor {tensor!r} (bytes {b}..{e}) overlaps tensor {prev!r} (which ends at {pos})")
        elif b > pos:
            problems.append(f"{name}: bytes {pos}..{b} of the data belong to no tensor (a gap before {tensor!r}); "
                            f"safetensors stores tensors back to back")
        pos, prev = max(pos, e), tensor
    if not problems and pos > data_size:
        problems.append(f"{name}: truncated: its tensors need {pos} data bytes, the file holds {data_size}")
    elif not problems and pos < data_size:
        problems.append(f"{name}: {data_size - pos} bytes after the last tensor belong to no tensor "
                        f"(safetensors files end with their last tensor)")
    return problems


def read_header(path: Path, *, name: str | None = None, fix: str = FIX_SOURCE,
                error: ErrorFactory = CheckpointError) -> Header:
    """Read and validate a safetensors file's header (never its data).

    Problems are raised as `error(problems, fix)` (CheckpointError by default), each naming the
    file as `name` (default: the file name) and the tensor; a file that cannot be read raises a
    BadInputError saying why.
    """
    name = path.name if name is None else name
    try:
        size, raw = header_bytes(path)
    except FileNotFoundError:
        raise error([f"{name}: does not exist"], fix) from None
    except SpecialFileError:
        raise error([f"{name}: is not a regular file (a device, FIFO or socket), expected a safetensors file"],
                    fix) from None
    except OSError as e:
        raise os_error(path, e) from None
    n = check_length(raw, size, name, fix, error)
    if len(raw) < 8 + n:  # the file shrank while it was read
        raise error([f"{name}: truncated or not a safetensors file: header length {n} bytes, file size "
                     f"{len(raw)} bytes"], fix)
    try:
        header = loads(raw[8:], object_pairs_hook=no_duplicates(f"{name}: safetensors header", error))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise error([f"{name}: safetensors header is not valid JSON ({e})"], fix) from None
    if not isinstance(header, dict):
        raise error([f"{name}: safetensors header is {json_kind(header)}, expected a JSON object "
                     f"(tensor name -> dtype, shape, data_offsets)"], fix)
    start = 8 + n
    # Truncation first, with the whole file's numbers: the usual cause is an interrupted download.
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and is_count(e["data_offsets"][1])]
    if ends and start + max(ends) > size:
        raise error([f"{name}: truncated: its header says the data ends at byte {start + max(ends)}, "
                     f"but the file has {size} bytes"], fix)
    problems = validate_entries(name, header, size - start)
    if problems:
        raise error(problems, fix)
    return Header(path=path, size=size, data_start=start, header=header, raw=raw)


# ------------------------------------------------------------------------------------------------
# the files of a checkpoint folder
# ------------------------------------------------------------------------------------------------


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def inside(real: Path, root: Path) -> bool:
    """The one symlink policy: whether a resolved path `real` may be read for the checkpoint folder
    whose resolved path is `root`: inside it, or in the blobs/ of the Hugging Face cache it is a
    snapshot of."""
    if _under(real, root):
        return True
    # A Hugging Face cache snapshot (hub/models--org--name/snapshots/REV/) links every file
    # to ../../blobs/HASH: the one place outside SRC a checkpoint legitimately lives.
    return root.parent.name == "snapshots" and _under(real, root.parent.parent / "blobs")


def member_problem(folder: Path, rel: str, what: str, root: Path | None = None,
                   expected: str = "a safetensors file") -> tuple[str, str] | None:
    """Why the file `rel` of the checkpoint folder cannot be read as `what`: (kind, message), or
    None if it can. kind: "path" (absolute, `..`, NUL), "outside" (resolves outside the folder:
    refused, never opened), "unresolvable" (a symlink loop), "dangling", "missing", "unreadable",
    "directory", "special" (a device, FIFO or socket). `root`: folder.resolve(), if known."""
    if "\0" in rel:
        return "path", f"{what}: path {rel!r} holds a NUL character"
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        return "path", (f"{what}: path {rel!r} leaves the checkpoint folder; shard paths must be relative to SRC, "
                        f"without '..'")
    root = folder.resolve() if root is None else root
    p = folder / rel
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        return "unresolvable", f"{what}: {rel} cannot be resolved ({e})"
    if not inside(real, root):
        return "outside", (f"{what}: {rel} is a symlink to {real}, outside the checkpoint folder {root}; "
                           f"atom-convert reads only files inside SRC (a Hugging Face cache snapshot's blobs/ "
                           f"excepted): copy the file into SRC")
    try:
        st = real.stat()
    except FileNotFoundError:
        if p.is_symlink():
            return "dangling", f"{what}: {rel} is a dangling symlink (to {real})"
        return "missing", f"{what}: {rel} does not exist"
    except OSError as e:
        return "unreadable", f"{what}: {rel} cannot be read: {os_error(p, e)}"
    if stat.S_ISDIR(st.st_mode):
        return "directory", f"{what}: {rel} is a directory, expected {expected}"
    if not stat.S_ISREG(st.st_mode):
        return "special", f"{what}: {rel} is not a regular file (a device, FIFO or socket); expected {expected}"
    return None


def check_member(folder: Path, rel: str, what: str, root: Path | None = None) -> str | None:
    """`member_problem`'s message alone."""
    problem = member_problem(folder, rel, what, root)
    return None if problem is None else problem[1]


_INDEX_HINT = "Re-download the index, or remove it when the checkpoint is one model.safetensors."


def weight_map(data: Any) -> dict[str, str]:
    """The weight_map of a parsed index, checked: an object mapping tensor names to file names."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{INDEX_NAME}: is {json_kind(data)}, expected a JSON object with a weight_map")
    wm = data.get("weight_map")
    if not isinstance(wm, dict):
        raise CheckpointError(
            f"{INDEX_NAME}: weight_map is {'missing' if 'weight_map' not in data else json_kind(wm)}, expected an "
            f"object mapping each tensor name to its shard file", hint=_INDEX_HINT)
    if not wm:
        raise CheckpointError(f"{INDEX_NAME}: weight_map is empty (no tensor is mapped to a file)", hint=_INDEX_HINT)
    bad = [f"{INDEX_NAME}: weight_map[{k!r}] is {json_kind(v)} {v!r}, expected a shard file name"
           for k, v in wm.items() if not (isinstance(v, str) and v)]
    if bad:
        raise CheckpointError(bad)
    return wm


def weight_files(folder: Path, check: Callable[[str, str], str | None] | None = None
                 ) -> tuple[str | None, list[str], dict[str, str] | None]:
    """(index file or None, the safetensors files, the index's weight_map or None) of a checkpoint
    folder: the files its index names, else the single model.safetensors.

    `check(rel, what)` says why a file cannot be read (None if it can); default `check_member`.
    Raises CheckpointError for a malformed index, for files that fail the check (all of them
    listed), or when the folder has neither an index nor model.safetensors.
    """
    if check is None:
        root = folder.resolve()

        def check(rel: str, what: str) -> str | None:
            return check_member(folder, rel, what, root)

    index = folder / INDEX_NAME
    if os.path.lexists(index):
        problem = check(INDEX_NAME, INDEX_NAME)
        if problem:
            raise CheckpointError(problem)
        wm = weight_map(load_json(index, INDEX_NAME))
        files = sorted(set(wm.values()))
        problems = []
        for f in files:
            problem = check(f, INDEX_NAME)
            if problem:
                n = sum(1 for v in wm.values() if v == f)
                problems.append(f"{problem} (it holds {n} tensors)" if "does not exist" not in problem else
                                f"{INDEX_NAME} names {f} ({n} tensors), but the file does not exist")
        if problems:
            raise CheckpointError(problems, hint="Download the missing files, or fix the index.")
        return INDEX_NAME, files, wm
    if os.path.lexists(folder / SINGLE_NAME):
        problem = check(SINGLE_NAME, SINGLE_NAME)
        if problem:
            raise CheckpointError(problem)
        return None, [SINGLE_NAME], None
    try:
        others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    except OSError:
        others = []
    if others:  # names only: nothing else of them is read
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise CheckpointError(f"{folder}: no {SINGLE_NAME} and no {INDEX_NAME}, but {len(others)} other .safetensors "
                              f"file(s): {shown}",
                              hint=f"A checkpoint in several files needs its {INDEX_NAME} (download it from the "
                                   f"release into SRC); a checkpoint in one file must be named {SINGLE_NAME}.")
    raise CheckpointError(f"{folder}: no {SINGLE_NAME} and no {INDEX_NAME}",
                          hint="Point SRC at the folder holding the checkpoint's safetensors files.")


# ------------------------------------------------------------------------------------------------
# side files and the code auto_map names
# ------------------------------------------------------------------------------------------------


def _class_refs(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _class_refs(v)


def auto_map_modules(config: Any) -> dict[str, str]:
    """{module file: "auto_map.KEY"} for every module of this repository a parsed config's
    auto_map names ("module.Class" -> module.py); "org/repo--module.Class" (code of another
    repository) and names without a module are skipped."""
    amap = config.get("auto_map") if isinstance(config, dict) else None
    out: dict[str, str] = {}
    if not isinstance(amap, dict):
        return out
    for key, value in amap.items():
        for ref in _class_refs(value):
            if "--" in ref or "." not in ref:
                continue
            module = ref.rsplit(".", 1)[0]
            if all(module.split(".")):  # not ".Class" nor "a..b.Class"
                out.setdefault(module.replace(".", "/") + CODE_SUFFIX, f"auto_map.{key}")
    return out


def is_side_name(name: str) -> bool:
    """Whether a top-level file of SRC of this name is a side file."""
    return name in SIDE_FILES or name.endswith(SIDE_SUFFIXES) or name.endswith(CODE_SUFFIX)


@dataclass(frozen=True)
class SideFiles:
    """The side files of a checkpoint folder (`select_side_files`)."""

    names: list[str]  # top-level regular files to copy beside the shards, sorted, each once
    refused: dict[str, str]  # side file -> why it is not read (it resolves outside SRC)
    auto_map: dict[str, str]  # every module file an auto_map names -> where ("config.json auto_map.AutoConfig")
    code_missing: dict[str, str]  # those of them the folder lacks (or refuses) -> where

    def require(self) -> list[str]:
        """`names`, or CheckpointError naming every refused file."""
        if self.refused:
            raise CheckpointError(list(self.refused.values()))
        return self.names


def select_side_files(folder: Path) -> SideFiles:
    """Configs, tokenizer files and Python files at the top of `folder` (the module docstring),
    under the one symlink policy: a side file that resolves outside the folder is refused, never
    opened; a name that is no regular file (a directory, a dangling symlink) is no side file."""
    root = folder.resolve()
    names: list[str] = []
    refused: dict[str, str] = {}
    for p in sorted(folder.iterdir()):
        if not is_side_name(p.name):
            continue
        problem = member_problem(folder, p.name, "side file", root, expected="a file")
        if problem is None:
            names.append(p.name)
        elif problem[0] in ("outside", "unreadable"):
            refused[p.name] = problem[1]
    auto_map: dict[str, str] = {}
    for cfg_name in CONFIG_FILES:
        if cfg_name not in names:
            continue
        try:
            cfg = loads(read_regular(folder / cfg_name))
        except (OSError, ValueError):
            continue  # its reader reports it (SourceCheckpoint: config.json)
        for f, where in auto_map_modules(cfg).items():
            auto_map.setdefault(f, f"{cfg_name} {where}")
    code_missing = {f: where for f, where in auto_map.items() if member_problem(folder, f, f, root) is not None}
    return SideFiles(names, refused, auto_map, code_missing)


def side_files(folder: Path) -> list[str]:
    """The side files to copy from `folder`; CheckpointError naming any that resolves outside it."""
    return select_side_files(folder).require()
