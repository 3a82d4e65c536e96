"""The C library calls the tool makes through ctypes, declared in one place.

They are the ones Python's `os` and `mmap` modules lack (fallocate, the file system type from
fstatfs, mincore, prctl, mallopt) or make while holding the GIL (madvise; mmap and munmap around
MADV_POPULATE_READ): ctypes releases the GIL around each foreign call, so a populate that waits for
the disk, or a madvise per expert from 16 workers, stalls no other thread of the process.

Linux with a 64-bit C library. Elsewhere `function` returns None and the typed helpers raise
OSError(ENOSYS) or do nothing (each says which), and their callers fall back.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from typing import Any, Callable

_VOIDP, _SIZE, _INT, _OFF = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64
# name -> (result type, argument types); off_t is 64-bit on the 64-bit Linux ABIs this targets
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "mmap": (_VOIDP, [_VOIDP, _SIZE, _INT, _INT, _INT, _OFF]),
    "munmap": (_INT, [_VOIDP, _SIZE]),
    "madvise": (_INT, [_VOIDP, _SIZE, _INT]),
    "mincore": (_INT, [_VOIDP, _SIZE, _VOIDP]),
    "fallocate": (_INT, [_INT, _INT, _OFF, _OFF]),
    "fstatfs": (_INT, [_INT, ctypes.c_char_p]),
    "prctl": (_INT, [_INT, ctypes.c_ulong]),
    "mallopt": (_INT, [_INT, _INT]),
}
TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs (and of /dev/shm)
_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3


@functools.lru_cache(maxsize=None)
def _handle() -> Any:
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - a platform without a C library to load
        return None


@functools.lru_cache(maxsize=None)
def function(name: str) -> Callable[..., Any] | None:
    """The C library's `name` with its declared types (`_SIGNATURES`), or None where the platform
    has none. Sets errno for `ctypes.get_errno()` (use_errno)."""
    lib = _handle()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.restype, fn.argtypes = _SIGNATURES[name]
    return fn


def _raise_errno() -> None:
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e))


def fs_type(fd: int) -> int | None:
    """The file system's magic number of an open file (fstatfs's f_type), None where it cannot be read."""
    fn = function("fstatfs")
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
    if fn(fd, buf) != 0:
        return None
    return struct.unpack_from("l", buf.raw)[0]


def fallocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's pages in [offset, offset + length) (fallocate(2), mode 0: no byte that is
    there changes; the file grows to the range's end). The system call itself: glibc's
    posix_fallocate writes zeros where a file system has no fallocate, which could overwrite a
    concurrent writer's bytes. OSError with the call's errno, ENOSYS where there is no such call."""
    fn = function("fallocate")
    if fn is None:
        raise OSError(errno.ENOSYS, "fallocate is not available")
    if fn(fd, 0, offset, length) != 0:
        _raise_errno()


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG);
    whether it was set."""
    fn = function("prctl")
    return fn is not None and fn(_PR_SET_PDEATHSIG, sig) == 0


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc's M_MMAP_THRESHOLD (mallopt): allocations of `nbytes` or more get a mapping of their
    own, returned to the system when freed. Whether it was set (False: not glibc)."""
    fn = function("mallopt")
    return fn is not None and fn(_M_MMAP_THRESHOLD, nbytes) == 1
