"""The C library's functions that Python's ``os`` module lacks (``statx``, ``sync_file_range``,
``preadv`` over a raw ``iovec`` array), looked up once with ``ctypes``."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Sequence

__all__ = ["function"]


def function(name: str, argtypes: Sequence[Any], restype: Any) -> Any | None:
    """libc's ``name`` with these C types, setting ``errno`` for :func:`ctypes.get_errno`; ``None``
    where this C library has no such function (other systems, older libcs)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn
