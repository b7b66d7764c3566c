"""The version of each object a pinned remote view has read: what keeps one load on one object.

An object store has no open file to hold. What it has is a version token per object (S3's ETag,
GCS's generation), which a read can be made conditional on. :class:`Versions` keeps, per object
key, the token a view first saw. Later reads send it as their condition. A read answered with
another token, or refused because the condition failed, is :class:`FileChangedError`: the object
was replaced since the view first read it.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, TypeVar

from .base import FileChangedError

__all__ = ["Versions", "pinned_copy", "replaced"]

S = TypeVar("S", bound=Any)


def pinned_copy(storage: S) -> S:
    """``storage`` itself where it keeps versions already (its ``_versions``), else a shallow copy
    that does: a pinned view sharing the storage's client."""
    if storage._versions is not None:
        return storage
    view = copy.copy(storage)
    view._versions = Versions()
    return view


def replaced(url: str) -> FileChangedError:
    return FileChangedError(f"{url}: not the object first read under this name (replaced while it was read)")


class Versions:
    """Object key -> the version token first seen for it; shared by the threads of one view."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[str, str] = {}

    def expected(self, key: str) -> str | None:
        """The token a read of ``key`` must match (None before the first read)."""
        with self._lock:
            return self._first.get(key)

    def saw(self, key: str, token: object, url: str) -> None:
        """Note that a read of ``key`` was answered by version ``token`` (None: the store did not
        say); :class:`FileChangedError` if an earlier read saw another version."""
        if token is None or token == "":
            return
        token = str(token)
        with self._lock:
            first = self._first.setdefault(key, token)
        if first != token:
            raise replaced(url)
