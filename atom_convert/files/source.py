"""A lazy index of the tensors of a Hugging Face checkpoint directory.

Only headers are read up front (a few KB per file); tensor data is read on
demand as views of one copy-on-write mapping per file, shared by every worker
thread, a slice at a time. When the last view of a read goes, its pages leave
the process's resident set (madvise DONTNEED; they stay in the page cache), so
the resident set stays bounded by what the current step holds. The files are
mapped once: mapping and unmapping them per expert, per thread (safe_open),
serialised the workers on the kernel's mmap lock (BENCHMARKS.md, issue 9).

Column reads are the exception (`sharing_columns`): a rank's column slice of a
row-major tensor touches every page of it, so while one worker makes every rank's
slice of the same experts, the tensor's pages stay mapped until the last rank's
slice is made, instead of being faulted in once per rank.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..errors import BadInputError, CheckpointError, ConfigError, json_kind
from . import libc
from .dtypes import DTYPE_FROM_ST
from .values import ValueGuard
from .reading import load_json, open_regular, os_error
from .safetensors import INDEX_NAME, SINGLE_NAME, check_length, check_member, read_header, side_files, weight_files

__all__ = ["INDEX_NAME", "SINGLE_NAME", "SourceCheckpoint", "TensorInfo", "load_json", "read_safetensors_header"]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    begin: int = 0  # offset of the data in the file's data section (after the header)


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header; returns (header dict, data start offset).

    Raises CheckpointError naming the file (and the tensor) for a malformed or
    truncated file, BadInputError for one that cannot be read (safetensors_file.read_header).
    """
    h = read_header(path)
    return h.header, h.data_start


_PAGE = mmap.PAGESIZE
# madvise through ctypes releases the GIL (mmap.madvise holds it): 16 workers call it per expert
_MADVISE = libc.function("madvise")


class _MappedFile:
    """A safetensors file mapped once, copy-on-write (as safetensors itself maps it: a stray
    in-place op on a source view changes this process's copy, never the file)."""

    def __init__(self, path: Path):
        try:
            fd = open_regular(path)
        except OSError as e:
            raise os_error(path, e) from None
        try:
            size = os.fstat(fd).st_size
            self.data_start = 8 + check_length(os.pread(fd, 8, 0), size, path.name)
            self.mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
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
        if _MADVISE is not None:
            _MADVISE(self.addr + a, b - a, mmap.MADV_DONTNEED)
        else:  # pragma: no cover
            self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)


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
        # A side file (config.json among them) that resolves outside SRC is refused before any is read.
        side_files(self.path)
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
        self._local = threading.local()  # .columns: this thread's shared column views (sharing_columns)
        self._scan()

    # -- indexing --------------------------------------------------------------------
    def _check_file(self, rel: str, what: str) -> str | None:
        """Why the file `rel` of SRC cannot be read as `what` (None if it can): the one symlink
        policy of safetensors_file.member_problem."""
        return check_member(self.path, rel, what, self._root)

    def _scan(self) -> None:
        problems: list[str] = []
        self.index_file, files, weight_map = weight_files(self.path, self._check_file)
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
        self._local = threading.local()
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
        shared: dict[str, torch.Tensor] | None = getattr(self._local, "columns", None)
        whole = None if shared is None else shared.get(name)
        if whole is None:
            whole = self._view(info)
            if shared is not None:
                shared[name] = whole
        cols = whole[:, start:stop]
        if contiguous:
            cols = cols.contiguous()
        if check:
            self.values.check(name, info.file, cols, (0, start))
        return cols

    @contextmanager
    def sharing_columns(self) -> Iterator[None]:
        """Within this block, on this thread, the column reads (`get_cols`) of one tensor share one
        view of it, whose pages leave the resident set only after the block (when no chunk made
        from them is still queued for writing). For a worker that makes every rank's slice of the
        same experts (workers.Item.span): under MoE tensor parallel each rank's slice of a
        down_proj is a column slice that touches every page of it, and a page faulted in once per
        rank cost about two thirds of that read's time (BENCHMARKS.md, twenty-ninth round)."""
        outer = getattr(self._local, "columns", None)
        self._local.columns = {} if outer is None else outer
        try:
            yield
        finally:
            self._local.columns = outer

    def recheck(self, name: str, t: torch.Tensor, origin: tuple[int, ...] = ()) -> Callable[[], None]:
        """The value check of `t` (read from `name` with check=False, at `origin`) as a call for
        later: the caller that found a bad value in the bytes it made from t runs it, and the report
        (error or --allow-nonfinite record) is the one the read would have made."""
        file = self.tensors[name].file
        return lambda: self.values.check(name, file, t, origin)

    def file_sizes(self) -> dict[str, int]:
        return {f: (self.path / f).stat().st_size for f in self.files}
