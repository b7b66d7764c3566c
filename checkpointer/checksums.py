"""CRC32C of tensor bytes in fixed-size chunks, computed from memory without copies."""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Callable

import google_crc32c

__all__ = ["ALGORITHM", "CHUNK_BYTES", "crc32c", "crc32c_extend", "chunk_crcs"]

ALGORITHM = "crc32c"
CHUNK_BYTES = 16 << 20


def crc32c(view: memoryview) -> int:
    """CRC32C of a byte view (any buffer; no copy for writable views of tensor memory)."""
    return crc32c_extend(0, view)


def _load_native_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, nbytes)`` of the library inside the google-crc32c wheel.

    Called through ctypes it releases the GIL for any buffer; the wheel's Python binding releases
    it only for ``bytes``, so hashing tensor memory there would stall every other thread."""
    package = os.path.dirname(google_crc32c.__file__)
    for path in sorted(glob.glob(os.path.join(package, os.pardir, "google_crc32c.libs", "libcrc32c*"))):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    return None


_native_extend = _load_native_extend()


def crc32c_extend(crc: int, view: memoryview) -> int:
    """``crc`` extended over the bytes of ``view``."""
    n = len(view)
    if n == 0:
        return crc
    if view.readonly:
        return google_crc32c.extend(crc, bytes(view))
    if _native_extend is not None:
        return _native_extend(crc, ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
    return google_crc32c.extend(crc, (ctypes.c_char * n).from_buffer(view))


def chunk_crcs(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """One CRC32C per ``chunk_bytes`` of ``view`` (the last chunk may be shorter; none if empty)."""
    return [crc32c(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]
