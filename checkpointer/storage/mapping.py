"""A range of a local file mapped into memory, for copies that take only part of it.

A tensor-parallel box is often short runs of its stored piece with gaps between them (a column
block of a matrix saved by rows). A read copies the gaps too (:mod:`.scatter` sends them to a
scratch buffer); a strided copy out of the file's mapped pages touches only the runs. For 1 KiB
runs with 1 KiB gaps over 64 MiB of cached file, on the development machine: 8.3 ms instead of
10.9 ms with ``preadv``.

Reading a mapped page the kernel cannot provide kills the process (``SIGBUS``) where a read
would raise an error: a page past the file's end, or one whose disk read fails. So a range is
mapped only after the file's size is checked, and used only while every page of it is in the
page cache; otherwise, or where the file system refuses the mapping, the caller reads it
instead. The kernel counts a range's cached pages (``cachestat``, Linux 6.5) in a quarter of the
time ``mincore`` takes to list them for a mapping (about 0.1 ms against 0.4 ms for 8 MiB here),
which older kernels use. (A file uncached from disk gains nothing from a mapping anyway: the
disk's time dominates.) What remains is a cached page dropped and its re-read failing between
the check and the copy, or a file shrunk in place meanwhile; the callers map only the rank files
a save wrote, which are never changed in place.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from . import libc

__all__ = ["available", "mapped_range"]

_MMAP = libc.function(
    "mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64], ctypes.c_void_p
)
_MUNMAP = libc.function("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
_MINCORE = libc.function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int)
_SYSCALL = libc.function(
    "syscall", [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_long
)
_MAP_FAILED = ctypes.c_void_p(-1).value
_CACHESTAT = 451  # the system call's number (Linux 6.5) on these architectures; MIPS and Alpha number it otherwise
_cachestat_works = (
    sys.platform.startswith("linux") and _SYSCALL is not None
    and platform.machine() in ("x86_64", "aarch64", "riscv64", "ppc64le", "s390x", "i686", "armv7l")
)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Counts(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def available() -> bool:
    return _MMAP is not None and _MUNMAP is not None and _MINCORE is not None


def _file_cached(fd: int, start: int, length: int) -> bool | None:
    """Whether every page of bytes ``[start, start + length)`` of ``fd`` is in the page cache, from
    the kernel's count of them (one call, no mapping, no array of pages); ``None`` where this kernel
    cannot say (older than Linux 6.5, or the call is filtered)."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    counts = _Counts()
    if _SYSCALL(_CACHESTAT, fd, ctypes.byref(_Range(start, length)), ctypes.byref(counts), 0) != 0:
        _cachestat_works = False
        return None
    first = start // mmap.PAGESIZE
    return counts.cache >= -(-(start + length) // mmap.PAGESIZE) - first


def _all_cached(address: int, length: int) -> bool:
    pages = np.empty(-(-length // mmap.PAGESIZE), dtype=np.uint8)
    if _MINCORE(address, length, pages.ctypes.data) != 0:
        return False
    return bool(np.all(pages & 1))


@contextmanager
def mapped_range(fd: int, start: int, nbytes: int, where: str) -> Iterator[memoryview | None]:
    """Bytes ``[start, start + nbytes)`` of the open file ``fd``, mapped read-only, or ``None``
    where they cannot be mapped safely now (see the module's docstring): the caller reads them.
    The caller only reads the view, and keeps none of it once the context ends. Raises
    ``EOFError`` where the file is shorter."""
    size = os.fstat(fd).st_size
    if start + nbytes > size:
        raise EOFError(f"{where}: {size} bytes, not the {start + nbytes} its header gives: the file is truncated")
    base = start - start % mmap.ALLOCATIONGRANULARITY
    length = start + nbytes - base
    cached = _file_cached(fd, base, length)
    if cached is False:
        yield None
        return
    address = _MMAP(None, length, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, base)
    if address is None or address == _MAP_FAILED:
        yield None  # refused (a file system without mappings, no address space left): read instead
        return
    if cached is None and not _all_cached(address, length):
        _MUNMAP(address, length)
        yield None
        return
    yield memoryview((ctypes.c_ubyte * nbytes).from_address(address + start - base))
    # Unmapped only when the copy returned: a traceback may keep a view alive, and reading an
    # unmapped page would end the process; after an error the mapping is left until exit.
    _MUNMAP(address, length)
