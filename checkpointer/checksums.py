"""CRC32C of tensor bytes in fixed-size chunks, computed from memory without copies."""

from __future__ import annotations

import ctypes

import google_crc32c

__all__ = ["ALGORITHM", "CHUNK_BYTES", "crc32c", "crc32c_extend", "chunk_crcs"]

ALGORITHM = "crc32c"
CHUNK_BYTES = 16 << 20


def crc32c(view: memoryview) -> int:
    """CRC32C of a byte view (any buffer; no copy for writable views of tensor memory)."""
    return crc32c_extend(0, view)


def crc32c_extend(crc: int, view: memoryview) -> int:
    """``crc`` extended over the bytes of ``view``."""
    n = len(view)
    if n == 0:
        return crc
    if view.readonly:
        return google_crc32c.extend(crc, bytes(view))
    return google_crc32c.extend(crc, (ctypes.c_char * n).from_buffer(view))


def chunk_crcs(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """One CRC32C per ``chunk_bytes`` of ``view`` (the last chunk may be shorter; none if empty)."""
    return [crc32c(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]
