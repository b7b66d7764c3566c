"""Many short runs of a file read into memory with few system calls.

A tensor-parallel piece is often thousands of short runs of its stored piece (a column block
of a matrix saved by rows): one run per row, each a few KiB, with gaps between them. One
``preadv`` per 512 runs reads the file span that holds them, putting each run where it belongs
in the destination and every gap into one small scratch buffer, which stays in the CPU cache.
So the destination receives exactly its bytes, once, with no staging copy, and Python builds
the ``iovec`` arrays with numpy: its work does not grow with the number of runs.

Gaps longer than :data:`MAX_GAP` end a call (reading them would cost more than another call).
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os

import numpy as np

from . import libc

__all__ = ["available", "preadv_runs", "MAX_GAP", "RUNS_PER_CALL"]

MAX_GAP = 256 << 10
_IOV_MAX = 1024  # POSIX's minimum; Linux's own
RUNS_PER_CALL = (_IOV_MAX + 1) // 2
"""The most runs one ``preadv`` takes (a run, then a gap, alternating)."""
_EINTR = _errno.EINTR


_PREADV = libc.function("preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t)


def available() -> bool:
    return _PREADV is not None


def preadv_runs(fd: int, file_offsets: np.ndarray, addresses: np.ndarray, length: int, where: str) -> None:
    """Read ``length`` bytes at each of ``file_offsets`` (increasing) into memory at each of
    ``addresses``. The caller keeps that memory alive. Raises ``EOFError`` on a short file."""
    n = len(file_offsets)
    if n == 0 or length == 0:
        return
    file_offsets = np.ascontiguousarray(file_offsets, dtype=np.int64)
    addresses = np.ascontiguousarray(addresses, dtype=np.uint64)
    gaps = file_offsets[1:] - (file_offsets[:-1] + length)
    cuts = np.flatnonzero((gaps < 0) | (gaps > MAX_GAP)) + 1
    bounds = [0, *cuts.tolist(), n]
    fitting = gaps[(gaps >= 0) & (gaps <= MAX_GAP)]
    scratch = np.empty(max(1, int(fitting.max()) if len(fitting) else 1), dtype=np.uint8)
    scratch_address = scratch.ctypes.data
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for a in range(lo, hi, RUNS_PER_CALL):
            b = min(hi, a + RUNS_PER_CALL)
            k = b - a
            iov = np.empty((2 * k - 1, 2), dtype=np.uint64)
            iov[0::2, 0] = addresses[a:b]
            iov[0::2, 1] = length
            iov[1::2, 0] = scratch_address
            iov[1::2, 1] = gaps[a : b - 1]
            _preadv_all(fd, iov, int(file_offsets[a]), where)


def _preadv_all(fd: int, iov: np.ndarray, offset: int, where: str) -> None:
    """One ``preadv`` of the ``(address, length)`` rows of ``iov``; after a short read (a signal, a
    network or FUSE file system) another from where it stopped. ``EOFError`` where the file ends."""
    total = int(iov[:, 1].sum())
    while True:
        got = _PREADV(fd, iov.ctypes.data, len(iov), offset)
        if got < 0:
            errno = ctypes.get_errno()
            if errno == _EINTR:
                continue
            raise OSError(errno, f"{where}: {os.strerror(errno)}")
        if got == total:
            return
        if got == 0:
            raise EOFError(f"{where}: read nothing at offset {offset} of the {total} bytes asked: the file is truncated")
        ends = np.cumsum(iov[:, 1])
        done = int(np.searchsorted(ends, got, side="right"))  # rows read whole
        into = got - (int(ends[done - 1]) if done else 0)
        iov = iov[done:].copy()
        iov[0, 0] += into
        iov[0, 1] -= into
        offset, total = offset + got, total - got
