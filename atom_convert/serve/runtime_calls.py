"""The GPU runtime's own copy and event calls, through ctypes, for the loader's copy threads.

Each host-to-device copy that torch enqueues (`Tensor.copy_`) costs a Python dispatch and an event
recorded by torch's pinned-memory allocator; a ctypes call costs about a microsecond and holds no
GIL while it runs. The library is the one torch has already loaded into the process (found in
/proc/self/maps), so the calls share torch's device, context and streams: CUDA's libcudart, or
ROCm's libamdhip64, whose entry points take the same arguments under a `hip` prefix.

`calls()` is None where no such library is loaded (a CPU build, a runtime linked statically, a
platform without /proc), and the loader then enqueues through torch.
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from typing import Any

# library file name -> entry point prefix; the same signatures and constants in both
LIBRARIES = ((re.compile(r"/libcudart\.so[.\d]*$"), "cuda"), (re.compile(r"/libamdhip64\.so[.\d]*$"), "hip"))
HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice, hipMemcpyHostToDevice
EVENT_DISABLE_TIMING = 0x02  # cudaEventDisableTiming, hipEventDisableTiming
EVENT_BLOCKING_SYNC = 0x01  # cudaEventBlockingSync, hipEventBlockingSync: wait asleep, not spinning


class RuntimeCallError(RuntimeError):
    """A runtime call returned an error code (a GPU fault or a bad pointer: an internal error)."""


@dataclass(frozen=True)
class RuntimeCalls:
    """Bound entry points of one runtime library (`prefix` "cuda" or "hip")."""

    path: str
    prefix: str
    lib: Any

    def _check(self, what: str, code: int) -> None:
        if code != 0:
            text = self.lib[f"{self.prefix}GetErrorString"]
            text.restype = ctypes.c_char_p
            raise RuntimeCallError(f"{self.prefix}{what} failed with {code}: {text(code).decode(errors='replace')}")

    def copy_to_device(self, dst: int, src: int, n: int, stream: int) -> None:
        """Enqueue a copy of n bytes from host address src to device address dst on `stream`."""
        self._check("MemcpyAsync", self._memcpy(dst, src, n, HOST_TO_DEVICE, stream))

    def new_event(self, blocking: bool = False) -> int:
        ev = ctypes.c_void_p()
        flags = EVENT_DISABLE_TIMING | (EVENT_BLOCKING_SYNC if blocking else 0)
        self._check("EventCreateWithFlags", self._create(ctypes.byref(ev), flags))
        return ev.value or 0

    def record(self, event: int, stream: int) -> None:
        self._check("EventRecord", self._record(event, stream))

    def wait(self, event: int) -> None:
        """Block (without the GIL) until the work recorded in `event` is done."""
        self._check("EventSynchronize", self._sync(event))

    def free_event(self, event: int) -> None:
        self._check("EventDestroy", self._destroy(event))

    def __post_init__(self) -> None:
        p = self.prefix
        fns = {
            "_memcpy": (f"{p}MemcpyAsync", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                             ctypes.c_void_p]),
            "_create": (f"{p}EventCreateWithFlags", [ctypes.c_void_p, ctypes.c_uint]),
            "_record": (f"{p}EventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
            "_sync": (f"{p}EventSynchronize", [ctypes.c_void_p]),
            "_destroy": (f"{p}EventDestroy", [ctypes.c_void_p]),
        }
        for attr, (name, args) in fns.items():
            fn = self.lib[name]
            fn.argtypes = args
            fn.restype = ctypes.c_int
            object.__setattr__(self, attr, fn)


_lock = threading.Lock()
_found: list[RuntimeCalls | None] = []


def loaded_library(maps: str) -> tuple[str, str] | None:
    """(path, prefix) of the first runtime library named in a /proc/<pid>/maps text, or None."""
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, device, inode, path
        path = fields[5].strip() if len(fields) == 6 else ""
        for pattern, prefix in LIBRARIES:
            if pattern.search(path):
                return path, prefix
    return None


def calls() -> RuntimeCalls | None:
    """The runtime library torch loaded, bound once per process; None where there is none."""
    with _lock:
        if not _found:
            _found.append(_bind())
        return _found[0]


def _bind() -> RuntimeCalls | None:
    try:
        with open("/proc/self/maps") as f:
            hit = loaded_library(f.read())
        if hit is None:
            return None
        return RuntimeCalls(hit[0], hit[1], ctypes.CDLL(hit[0]))
    except (OSError, AttributeError):
        return None
