""":func:`open_storage`: the one place a URL scheme is dispatched to a backend.

Backends are imported when their scheme is first asked for, so that boto3 or
google-cloud-storage load only for a job that uses them. No backend imports this module
(they import :mod:`~checkpointer.storage.base`), so the dispatch makes no import cycle.
"""

from __future__ import annotations

from .base import Storage, path_arg
from .redact import redact
from .urls import local_path, scheme_of

__all__ = ["open_storage"]


def open_storage(url: str | Storage) -> Storage:
    """The backend for a URL: a local path, ``file://``, ``s3://``, ``gs://``, ``http(s)://``."""
    if isinstance(url, Storage):
        return url
    url = path_arg(url)  # also check_url
    if not url.strip():
        raise ValueError("the path is empty (write '.' for the current directory)")
    local = local_path(url)
    if local is not None:
        from .local import LocalStorage

        return LocalStorage(local)
    scheme = scheme_of(url)
    if scheme == "s3":
        from .s3 import S3Storage

        return S3Storage(url)
    if scheme in ("gs", "gcs"):
        from .gcs import GCSStorage

        return GCSStorage(url)
    if scheme in ("http", "https"):
        from .http import HTTPStorage

        return HTTPStorage(url)
    # a mistyped https:// URL may carry a password or a token
    raise ValueError(f"unsupported storage URL {redact(url)!r}: use a path, file://, s3://, gs:// or http(s)://")
