"""A lazy index of the tensors of a Hugging Face checkpoint directory.

Only headers are read up front (a few KB per file); tensor data is read on
demand as views of one copy-on-write mapping per file, shared by every worker
thread, a slice at a time. When the last view of a read goes, its pages leave
the process's resident set (madvise DONTNEED; they stay in the page cache), so
the resident set stays bounded by what the current step holds. The files are
mapped once: mapping and unmapping them per expert, per thread (safe_open),
serialised the workers on the kernel's mmap lock (BENCHMARKS.md, issue 9).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import stat
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import torch

from .errors import BadInputError, CheckpointError, ConfigError, json_kind
from .quant.formats import DTYPE_FROM_ST
from .quant.values import ValueGuard

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit (MAX_HEADER_SIZE)
_FIX_FILE = "Re-download the file; compare its size with the one on the Hub."


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    begin: int = 0  # offset of the data in the file's data section (after the header)


def _is_count(v: Any) -> bool:
    """A JSON integer >= 0 (safetensors' usize); JSON true/false are not integers."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _no_duplicates(where: str) -> Any:
    """json object_pairs_hook: Python keeps the last of two equal keys silently; a header or
    config with one key twice is ambiguous (which tensor is meant?), so it is refused."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{where}: key {k!r} appears twice in one JSON object; which one is meant is "
                                      f"ambiguous", hint="Remove the duplicate (the file is damaged or hand-edited).")
            out[k] = v
        return out

    return hook


def load_json(path: Path, what: str) -> Any:
    """Parse a JSON file of SRC, refusing duplicate keys; errors name the file."""
    try:
        text = path.read_bytes()
    except OSError as e:
        raise _os_error(path, e) from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(str(path)))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None


def _os_error(path: Path, e: OSError) -> BadInputError:
    if isinstance(e, PermissionError):
        return BadInputError(f"{path}: permission denied while reading it; make it readable by this user "
                             f"(e.g. chmod a+r) or run as its owner")
    if isinstance(e, IsADirectoryError):
        return BadInputError(f"{path}: is a directory, expected a file")
    return BadInputError(f"{path}: cannot be read ({e.strerror or e}); check the file and the disk")


def _validate_entries(name: str, header: dict[str, Any], data_size: int) -> list[str]:
    """Every entry against the safetensors format (the rules `safe_open` enforces, so that a file
    accepted here is never refused later mid-stream): dtype a string, shape a list of integers
    >= 0, data_offsets [begin, end] with end - begin = dtype size x elements, and the spans
    back to back from byte 0 of the data section to its end, in some order."""
    problems = []
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        problems.append(f"{name}: __metadata__ is {json_kind(meta)}, expected an object of strings")
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
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            problems.append(f"{where}: shape {shape!r} is not a list of integers >= 0")
            ok = False
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs) and offs[0] <= offs[1]):
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


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header; returns (header dict, data start offset).

    Raises CheckpointError naming the file (and the tensor) for a malformed or
    truncated file, BadInputError for one that cannot be read.
    """
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise _os_error(path, e) from None
    with f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path.name}: not a safetensors file ({size} bytes, expected at least 8)",
                                  hint=_FIX_FILE)
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > _MAX_HEADER:
            raise CheckpointError(
                f"{path.name}: not a safetensors file: header length {hlen} bytes exceeds safetensors' limit of "
                f"{_MAX_HEADER} bytes (file size {size} bytes)", hint=_FIX_FILE)
        if 8 + hlen > size:
            raise CheckpointError(
                f"{path.name}: truncated or not a safetensors file: header length {hlen} bytes, file size {size} bytes",
                hint=_FIX_FILE)
        try:
            header = json.loads(f.read(hlen), object_pairs_hook=_no_duplicates(f"{path.name}: safetensors header"))
        except ValueError as e:
            raise CheckpointError(f"{path.name}: safetensors header is not valid JSON ({e})", hint=_FIX_FILE) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is {json_kind(header)}, expected a JSON object "
                              f"(tensor name -> dtype, shape, data_offsets)", hint=_FIX_FILE)
    start = 8 + hlen
    # Truncation first, with the whole file's numbers: the usual cause is an interrupted download.
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and _is_count(e["data_offsets"][1])]
    if ends and start + max(ends) > size:
        raise CheckpointError(
            f"{path.name}: truncated: its header says the data ends at byte {start + max(ends)}, "
            f"but the file has {size} bytes", hint=_FIX_FILE)
    problems = _validate_entries(path.name, header, size - start)
    if problems:
        raise CheckpointError(problems, hint=_FIX_FILE)
    return header, start


_PAGE = mmap.PAGESIZE
try:  # madvise through ctypes releases the GIL (mmap.madvise holds it): 16 workers call it per expert
    _LIBC: Any = ctypes.CDLL(None, use_errno=True)
    _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):  # pragma: no cover - not a POSIX libc
    _LIBC = None


class _MappedFile:
    """A safetensors file mapped once, copy-on-write (as safetensors itself maps it: a stray
    in-place op on a source view changes this process's copy, never the file)."""

    def __init__(self, path: Path):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _os_error(path, e) from None
        try:
            (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            self.data_start = 8 + hlen
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        # The mapping's address, for madvise; this export also keeps the mapping from being
        # closed under a tensor view (it goes with the last reference).
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        t = torch.frombuffer(self.mm, dtype=torch.uint8, count=info.nbytes, offset=self.data_start + info.begin)
        return t.view(info.dtype).view(info.shape)

    def drop(self, lo: int, hi: int) -> None:
        """madvise(DONTNEED) on the pages holding data bytes [lo, hi): out of this process's resident
        set, still in the page cache. A page another thread still reads is faulted in again."""
        a = (self.data_start + lo) // _PAGE * _PAGE
        b = min(len(self.mm), -(-(self.data_start + hi) // _PAGE) * _PAGE)
        if b <= a:
            return
        if _LIBC is not None:
            _LIBC.madvise(self.addr + a, b - a, mmap.MADV_DONTNEED)
        else:  # pragma: no cover
            self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


class SourceCheckpoint:
    """The tensors of one checkpoint directory, indexed by name, read lazily.

    Every file it reads must lie inside SRC: index entries are relative paths
    without `..`, and a symlink may point elsewhere only as a Hugging Face cache
    snapshot's links point into the cache's `blobs/` folder.
    """

    hub: dict[str, str] | None = None  # repo_id, revision, commit when the folder is a Hub snapshot
    _forked = False  # True in a worker process (after_fork)

    def __init__(self, path: str | os.PathLike[str], *, allow_nonfinite: bool = False):
        self.path = Path(path)
        # Every read is checked for NaN/Inf and fp8 NaN codes (quant/values.py); codecs add
        # the checks only they can make (scales > 0, e8m0 NaN) through the same guard.
        self.values = ValueGuard(allow_nonfinite)
        if not self.path.is_dir():
            raise BadInputError(f"source {self.path} is not a directory (expected a Hugging Face checkpoint folder)")
        self._root = self.path.resolve()
        cfg = self.path / "config.json"
        if not os.path.lexists(cfg):
            raise BadInputError(f"{cfg}: missing; a Hugging Face checkpoint folder needs config.json")
        self._check_file("config.json", "config.json")
        config = load_json(cfg, "config.json")
        if not isinstance(config, dict):
            raise ConfigError(f"{cfg}: is {json_kind(config)}, expected a JSON object of model settings")
        self.config: dict[str, Any] = config
        self.tensors: dict[str, TensorInfo] = {}
        self.files: list[str] = []
        self.index_file: str | None = None
        # One copy-on-write mapping per file, shared by every worker thread: mapping and unmapping
        # per expert serialised the threads on the kernel's mmap lock and TLB shootdowns. A read's
        # pages leave the resident set when its last view goes instead (`_view`, madvise).
        self._maps: dict[str, _MappedFile] = {}
        self._maps_lock = threading.Lock()
        self._scan()

    # -- indexing --------------------------------------------------------------------
    def _check_file(self, rel: str, what: str) -> str | None:
        """Why the file `rel` of SRC cannot be read as `what` (None if it can)."""
        if "\0" in rel:
            return f"{what}: path {rel!r} holds a NUL character"
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            return (f"{what}: path {rel!r} leaves the checkpoint folder; shard paths must be relative to SRC, "
                    f"without '..'")
        p = self.path / rel
        try:
            real = p.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
            return f"{what}: {rel} cannot be resolved ({e})"
        if not _under(real, self._root):
            # A Hugging Face cache snapshot (hub/models--org--name/snapshots/REV/) links every file
            # to ../../blobs/HASH: the one place outside SRC a checkpoint legitimately lives.
            blobs = self._root.parent.parent / "blobs"
            if not (self._root.parent.name == "snapshots" and _under(real, blobs)):
                return (f"{what}: {rel} is a symlink to {real}, outside the checkpoint folder {self._root}; "
                        f"atom-convert reads only files inside SRC (a Hugging Face cache snapshot's blobs/ "
                        f"excepted): copy the file into SRC")
        try:
            st = real.stat()
        except FileNotFoundError:
            if p.is_symlink():
                return f"{what}: {rel} is a dangling symlink (to {real})"
            return f"{what}: {rel} does not exist"
        except OSError as e:
            return f"{what}: {rel} cannot be read: {_os_error(p, e)}"
        if stat.S_ISDIR(st.st_mode):
            return f"{what}: {rel} is a directory, expected a safetensors file"
        if not stat.S_ISREG(st.st_mode):
            return f"{what}: {rel} is not a regular file (a device, FIFO or socket); expected a safetensors file"
        return None

    def _require_file(self, rel: str, what: str) -> None:
        problem = self._check_file(rel, what)
        if problem:
            raise CheckpointError(problem)

    def _read_index(self, index: Path) -> dict[str, str]:
        self._require_file(INDEX_NAME, INDEX_NAME)
        data = load_json(index, INDEX_NAME)
        if not isinstance(data, dict):
            raise CheckpointError(f"{INDEX_NAME}: is {json_kind(data)}, expected a JSON object with a weight_map")
        wm = data.get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(
                f"{INDEX_NAME}: weight_map is {'missing' if 'weight_map' not in data else json_kind(wm)}, expected an "
                f"object mapping each tensor name to its shard file",
                hint="Re-download the index, or remove it when the checkpoint is one model.safetensors.")
        if not wm:
            raise CheckpointError(f"{INDEX_NAME}: weight_map is empty (no tensor is mapped to a file)",
                                  hint="Re-download the index, or remove it when the checkpoint is one model.safetensors.")
        bad = [f"{INDEX_NAME}: weight_map[{k!r}] is {json_kind(v)} {v!r}, expected a shard file name"
               for k, v in wm.items() if not (isinstance(v, str) and v)]
        if bad:
            raise CheckpointError(bad)
        return wm

    def _scan(self) -> None:
        problems: list[str] = []
        index = self.path / INDEX_NAME
        weight_map: dict[str, str] | None = None
        if os.path.lexists(index):
            self.index_file = INDEX_NAME
            weight_map = self._read_index(index)
            files = sorted(set(weight_map.values()))
            for f in files:
                problem = self._check_file(f, INDEX_NAME)
                if problem:
                    n = sum(1 for v in weight_map.values() if v == f)
                    problems.append(f"{problem} (it holds {n} tensors)" if "does not exist" not in problem else
                                    f"{INDEX_NAME} names {f} ({n} tensors), but the file does not exist")
        elif os.path.lexists(self.path / SINGLE_NAME):
            self._require_file(SINGLE_NAME, SINGLE_NAME)
            files = [SINGLE_NAME]
        else:
            raise CheckpointError(
                f"{self.path}: no {SINGLE_NAME} and no {INDEX_NAME}",
                hint="Point SRC at the folder holding the checkpoint's safetensors files.",
            )
        if problems:
            raise CheckpointError(problems, hint="Download the missing files, or fix the index.")
        self.files = files
        for f in files:
            try:
                header = self._read_header(f)
            except CheckpointError as e:
                problems.extend(e.problems)
                continue
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dt = DTYPE_FROM_ST.get(meta["dtype"])
                if dt is None:
                    problems.append(f"{f}: tensor {name} has dtype {meta['dtype']!r}, which atom-convert does not "
                                    f"read (it reads {', '.join(sorted(DTYPE_FROM_ST))})")
                    continue
                if name in self.tensors:
                    problems.append(f"tensor {name} is stored twice: in {self.tensors[name].file} and in {f}")
                    continue
                b, e = meta["data_offsets"]
                self.tensors[name] = TensorInfo(name, f, dt, tuple(meta["shape"]), e - b, b)
        if weight_map is not None:
            for name, f in weight_map.items():
                info = self.tensors.get(name)
                if info is None and f in files and not any(f in p for p in problems):
                    problems.append(f"{INDEX_NAME} maps {name} to {f}, but {f} does not contain it")
                elif info is not None and info.file != f:
                    problems.append(f"{INDEX_NAME} maps {name} to {f}, but it is stored in {info.file}")
            for name, info in self.tensors.items():
                if name not in weight_map:
                    problems.append(f"{info.file} holds {name}, which {INDEX_NAME} does not list")
        if problems:
            raise CheckpointError(problems)

    # Hooks for a source whose files are still arriving (hub.HubSource): where the headers come
    # from, whether a file exists, and the wait before a file's data is first read.
    def _file_present(self, file: str) -> bool:
        return (self.path / file).is_file()

    def _read_header(self, file: str) -> dict[str, Any]:
        return read_safetensors_header(self.path / file)[0]

    def begin(self, file_order: list[str]) -> None:
        """Called once the plan is known, with the files in the order conversion reads them."""

    def wait_for(self, files: list[str]) -> None:
        """Block until these files can be read (a Hub source: downloaded and verified). The
        converting process calls it before it hands a worker process an item that reads them."""
        for f in files:
            self._before_open(f)

    def after_fork(self) -> None:
        """In a worker process (procs.py), right after the fork: fresh locks (another thread of
        the parent may have held one at the fork), value records of its own. The mappings the
        parent had made stay valid; new ones are this process's. Files are read only once the
        parent's `wait_for` has returned for them, so nothing here waits for a download."""
        self._maps_lock = threading.Lock()
        self.values.after_fork()
        self._forked = True

    def close(self) -> None:
        with self._maps_lock:
            self._maps.clear()  # each mapping goes when its last tensor view does

    # -- access ------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _before_open(self, file: str) -> None:
        """Called before a file is first mapped (a Hub source waits for its download here)."""

    def _mapping(self, file: str) -> "_MappedFile":
        m = self._maps.get(file)
        if m is None:
            self._before_open(file)  # outside the lock: a wait for one file must not stall the others
            with self._maps_lock:
                m = self._maps.get(file)
                if m is None:
                    m = self._maps[file] = _MappedFile(self.path / file)
        return m

    def _view(self, info: TensorInfo, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The stored tensor as a view of its file's mapping, of which bytes [lo, hi) are about to
        be read: when the last view of it goes (a consumer may hand it to the writer's thread),
        those pages leave the resident set (`_MappedFile.drop`)."""
        m = self._mapping(info.file)
        t = m.tensor(info)
        if info.nbytes:
            weakref.finalize(t.untyped_storage(), m.drop, info.begin + lo, info.begin + (info.nbytes if hi is None else hi))
        return t

    def get(self, name: str, check: bool = True) -> torch.Tensor:
        """The stored tensor. check=False: the caller checks its values itself (`recheck`)."""
        info = self.tensors[name]
        t = self._view(info)
        if check:
            self.values.check(name, info.file, t)
        return t

    def get_rows(self, name: str, start: int, stop: int, check: bool = True) -> torch.Tensor:
        """Rows [start, stop) of dim 0, reading only those bytes."""
        info = self.tensors[name]
        if start == 0 and stop == info.shape[0]:
            return self.get(name, check)
        row = info.nbytes // max(1, info.shape[0])
        t = self._view(info, start * row, stop * row)[start:stop]
        if check:
            self.values.check(name, info.file, t, (start,))
        return t

    def get_cols(self, name: str, start: int, stop: int, contiguous: bool = True, check: bool = True) -> torch.Tensor:
        """Columns [start, stop) of dim 1 of a 2-D tensor; contiguous=False: a strided view of the
        mapping (for a consumer whose own copy gathers the columns, such as the shuffle)."""
        info = self.tensors[name]
        if start == 0 and stop == info.shape[1]:
            return self.get(name, check)
        cols = self._view(info)[:, start:stop]
        if contiguous:
            cols = cols.contiguous()
        if check:
            self.values.check(name, info.file, cols, (0, start))
        return cols

    def recheck(self, name: str, t: torch.Tensor, origin: tuple[int, ...] = ()) -> Callable[[], None]:
        """The value check of `t` (read from `name` with check=False, at `origin`) as a call for
        later: the caller that found a bad value in the bytes it made from t runs it, and the report
        (error or --allow-nonfinite record) is the one the read would have made."""
        file = self.tensors[name].file
        return lambda: self.values.check(name, file, t, origin)

    def file_sizes(self) -> dict[str, int]:
        return {f: (self.path / f).stat().st_size for f in self.files}
