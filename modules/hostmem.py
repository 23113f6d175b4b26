"""How the process's C allocator (glibc malloc) treats freed memory: a CPU speed knob.

PyTorch's CPU tensors come straight from malloc. glibc hands large blocks back to the kernel
when they are freed (mmap/munmap, and trimming the heap's top), so a training step that frees
and re-allocates the same activations every step takes every page back through a page fault
and a zero-fill: in a fresh process here, 5,000-8,000 faults per SqueezeNet training step at
64 px and 20,000-30,000 at 150 px (batch 32). glibc's sliding threshold adapts to some of
this over time, and not at all to blocks over 32 MiB (150 px activations at batch 32).
"retain" keeps freed blocks in the process for reuse, as PyTorch's CUDA caching allocator does
on a GPU and as Intel's CPU launcher does by preloading jemalloc. The cost: the process keeps
its peak heap instead of returning it to the system, and glibc's aligned allocations (PyTorch
asks for 64-byte alignment) grow the heap by several blocks before they fit in freed space:
allocating and freeing one 64 MiB tensor over and over settles after 6-8 rounds with 400-500
MiB held (SqueezeNet training at 150 px, batch 32: peak RSS 1055 vs 1039 MB). The free top
beyond RETAIN_TRIM_BYTES is still trimmed; "system" hands the rest back (malloc_trim).

The setting is process-wide, like torch.set_num_threads. glibc has no way back to its
start-up behaviour (its sliding mmap threshold stops sliding once set), so "system" after
"retain" fixes the values that sliding threshold tops out at: blocks over 32 MiB mmapped, the
heap's top trimmed past 64 MiB free. Elsewhere than glibc (macOS, Windows, musl) only "system" exists."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

from modules.config import CPU_ALLOCATORS as ALLOCATORS
RETAIN_TRIM_BYTES = 1 << 30  # free heap top kept before trimming it back to the system

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_SYSTEM = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_MMAP_MAX, 65536))
_RETAIN = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, RETAIN_TRIM_BYTES))

_libc = None
_current = "system"  # what this process runs with now


def _glibc():
    global _libc
    if _libc is None:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            _libc = False
        else:
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
            except OSError:
                _libc = False
    return _libc or None


def candidates() -> list[str]:
    """The allocator settings this process can switch between."""
    return list(ALLOCATORS) if _glibc() else ["system"]


def current() -> str:
    return _current


def apply(mode: str) -> None:
    """Switch the process to `mode` ("system" or "retain"); a no-op when it already is."""
    global _current
    if mode not in ALLOCATORS:
        raise ValueError(f"cpu_allocator must be one of {ALLOCATORS}, not {mode!r}")
    if mode == _current:
        return
    libc = _glibc()
    if libc is None:
        raise RuntimeError("cpu_allocator 'retain' needs glibc (Linux); this process has "
                           f"{platform.libc_ver()[0] or platform.system()}")
    for param, value in (_RETAIN if mode == "retain" else _SYSTEM):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc refused mallopt({param}, {value})")
    if mode == "system":
        libc.malloc_trim(ctypes.c_size_t(0))  # hand the retained free memory back now
    _current = mode


def release_free() -> None:
    """Hand freed memory back to the system now under "retain" (a no-op otherwise, where glibc
    returns large blocks as they are freed): a dropped decoded cache, hundreds of MB, would
    stay in the process, unseen by the cache's RAM budget, and counted in the run's peak."""
    libc = _glibc() if _current == "retain" else None
    if libc:
        libc.malloc_trim(ctypes.c_size_t(0))
