"""Storage paths and URLs as strings: the one place outside the backends that takes them apart.

A location is a local path (``ckpt/``, ``~/ckpt``) or a URL (``scheme://...``): ``file://``
names a local path, ``s3://`` and ``gs://`` a bucket and a key prefix, ``http(s)://`` a
percent-encoded path that may carry a query. URLs stay ``str`` (``pathlib.Path`` folds
``//`` into ``/``). Which backend serves which scheme is :func:`~checkpointer.storage.open_storage`'s
business; this module only splits and joins text.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["is_url", "scheme_of", "local_path", "split_url", "split_path", "parent_url", "bucket_url"]


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in path


def scheme_of(url: str) -> str:
    """The scheme of a URL in lower case (``"s3"``); ``""`` for a local path."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


def local_path(url: str) -> str | None:
    """The local path that a path or a ``file://`` URL names (as written: ``~`` is not
    expanded); None for any other URL. ``ValueError`` for a file URL naming another host.

    Example:
        ``local_path("file:///data/ckpt")`` is ``"/data/ckpt"``, ``local_path("ckpt")`` is
        ``"ckpt"``, ``local_path("s3://b/ckpt")`` is None.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    if scheme.lower() != "file":
        return None
    host, slash, path = rest.partition("/")
    if host.lower() in ("", "localhost"):
        return slash + path
    raise ValueError(f"{url!r}: a file URL names a path on this host (file:///path or file://localhost/path), "
                     f"not on {host!r}")


def split_url(url: str) -> tuple[str, str]:
    """``(parent URL, file name)``. An http(s) path is percent-encoded and may carry a query
    (kept on the parent); the name is decoded, as storages take names. An object store's URL
    is its key as it is: ``#``, ``?`` and ``%`` are part of the name."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in ("http", "https"):
        parts = urlsplit(url)
        head, _, name = parts.path.rstrip("/").rpartition("/")
        return urlunsplit(parts._replace(path=head)), unquote(name)
    head, slash, name = rest.rstrip("/").rpartition("/")
    return (f"{scheme}{sep}{head}", name) if slash else (url, "")


def split_path(path: str) -> tuple[str, str]:
    """``(parent, file name)`` of a local path (the parent made absolute, ``~`` expanded) or of
    a URL (:func:`split_url`)."""
    if is_url(path):
        return split_url(path)
    return os.path.split(os.path.abspath(os.path.expanduser(path)))


def parent_url(url: str) -> str | None:
    """The directory above a local path, ``s3://`` or ``gs://`` URL; None at a root (``/``, a
    bucket) and for http(s), whose directories cannot be listed."""
    url = url.rstrip("/")
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in ("http", "https"):
        return None
    if not sep:
        head = os.path.dirname(url)
        return None if head == url else head
    bucket, _, key = rest.partition("/")
    if not key.strip("/"):
        return None  # a bucket's root
    head = key.rpartition("/")[0]
    return f"{scheme}://{bucket}" + (f"/{head}" if head else "")


def bucket_url(url: str, schemes: tuple[str, ...]) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``scheme://bucket/prefix``, the prefix without outer slashes."""
    scheme, sep, rest = str(url).partition("://")
    if scheme.lower() not in schemes or not sep:
        raise ValueError(f"not a {schemes[0]}:// URL: {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: use {schemes[0]}://bucket/prefix")
    return bucket, prefix.strip("/")
