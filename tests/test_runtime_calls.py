"""serve/runtime_calls.py: finding the GPU runtime library torch loaded, and its ctypes bindings.

No GPU runtime runs here, so the bindings are checked against a stand-in library built from C with
the same entry points: a copy is a memmove (addresses above 4 GiB included, which a binding without
argtypes would cut to 32 bits), and an error code comes back with the library's own text.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from atom_convert.serve import runtime_calls
from atom_convert.serve.runtime_calls import RuntimeCallError, RuntimeCalls, loaded_library

MAPS = """\
7f1c00000000-7f1c00021000 rw-p 00000000 00:00 0
7f1c2a000000-7f1c2a0a0000 r--p 00000000 08:01 123 /opt/venv/lib/python3.12/site-packages/torch/lib/libc10.so
7f1c2b000000-7f1c2b0c0000 r-xp 00000000 08:01 456 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f1c2c000000-7f1c2c0c0000 r-xp 00000000 08:01 789 /opt/rocm/lib/libamdhip64.so.6.4.43482
"""

FAKE = r"""
#include <stdint.h>
#include <string.h>
static int events = 0;
int last_kind = -1, records = 0, syncs = 0, destroyed = 0;
uintptr_t last_stream = 0;
int PREFIXMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (n == 0) return 1;
    last_kind = kind; last_stream = (uintptr_t)stream;
    memmove(dst, src, n);
    return 0;
}
int PREFIXEventCreateWithFlags(void **ev, unsigned flags) { *ev = (void *)(uintptr_t)(0x100000000ULL + flags + 16 * ++events); return 0; }
int PREFIXEventRecord(void *ev, void *stream) { records++; return (uintptr_t)ev >> 32 == 1 ? 0 : 400; }
int PREFIXEventSynchronize(void *ev) { syncs++; return (uintptr_t)ev >> 32 == 1 ? 0 : 400; }
int PREFIXEventDestroy(void *ev) { destroyed++; return 0; }
const char *PREFIXGetErrorString(int code) { return code == 1 ? "invalid argument" : "invalid resource handle"; }
"""


def test_the_library_torch_loaded_is_found_in_the_maps():
    assert loaded_library(MAPS) == ("/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13", "cuda")
    hip_only = "\n".join(ln for ln in MAPS.splitlines() if "cudart" not in ln)
    assert loaded_library(hip_only) == ("/opt/rocm/lib/libamdhip64.so.6.4.43482", "hip")
    assert loaded_library("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/libcudart_static_helper.so\n") is None
    assert loaded_library("") is None


def test_no_library_in_a_cpu_process():
    """This test process runs torch's CPU build: nothing to bind, so the loader enqueues through torch."""
    import torch

    if torch.cuda.is_available() or getattr(torch.version, "hip", None):
        pytest.skip("a GPU build of torch is loaded")
    runtime_calls._found.clear()
    try:
        assert runtime_calls.calls() is None
    finally:
        runtime_calls._found.clear()


@pytest.fixture(scope="module", params=["cuda", "hip"])
def fake_runtime(request, tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in runtime library")
    d = tmp_path_factory.mktemp(f"fake-{request.param}")
    src = d / "fake.c"
    src.write_text(FAKE.replace("PREFIX", request.param))
    lib = d / ("libcudart.so.13" if request.param == "cuda" else "libamdhip64.so.6")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return RuntimeCalls(str(lib), request.param, ctypes.CDLL(str(lib)))


def test_copies_and_events_through_the_bindings(fake_runtime):
    rt = fake_runtime
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    stream = 0x7F00DEADBEEF  # a 64-bit handle passed through unchanged
    for at, n in ((0, 1), (5, 4096), (1 << 20, 2 << 20)):
        rt.copy_to_device(dst.ctypes.data + at, src.ctypes.data + at, n, stream)
    assert np.array_equal(dst[5:4101], src[5:4101]) and np.array_equal(dst[1 << 20:3 << 20], src[1 << 20:3 << 20])
    assert dst[0] == src[0] and not dst[4101:1 << 20].any()
    assert ctypes.c_int.in_dll(rt.lib, "last_kind").value == runtime_calls.HOST_TO_DEVICE
    assert ctypes.c_size_t.in_dll(rt.lib, "last_stream").value == stream

    ev, sleeper = rt.new_event(), rt.new_event(blocking=True)
    assert ev >> 32 == 1 and ev & 0xF == runtime_calls.EVENT_DISABLE_TIMING  # the handle is kept whole, 64 bits
    assert sleeper & 0xF == runtime_calls.EVENT_DISABLE_TIMING | runtime_calls.EVENT_BLOCKING_SYNC
    rt.record(ev, stream)
    rt.wait(ev)
    rt.free_event(ev)
    assert [ctypes.c_int.in_dll(rt.lib, k).value for k in ("records", "syncs", "destroyed")] == [1, 1, 1]


def test_an_error_code_is_raised_with_the_runtimes_text(fake_runtime):
    rt = fake_runtime
    buf = np.zeros(8, dtype=np.uint8)
    with pytest.raises(RuntimeCallError, match=rf"{rt.prefix}MemcpyAsync failed with 1: invalid argument"):
        rt.copy_to_device(buf.ctypes.data, buf.ctypes.data, 0, 0)
    with pytest.raises(RuntimeCallError, match=rf"{rt.prefix}EventSynchronize failed with 400: invalid resource handle"):
        rt.wait(12345)
