"""Storage URLs as strings: the one place outside the backends that takes them apart."""

from __future__ import annotations

__all__ = ["bucket_url"]


def bucket_url(url: str, schemes: tuple[str, ...]) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``scheme://bucket/prefix``, the prefix without outer slashes."""
    scheme, sep, rest = str(url).partition("://")
    if scheme.lower() not in schemes or not sep:
        raise ValueError(f"not a {schemes[0]}:// URL: {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: use {schemes[0]}://bucket/prefix")
    return bucket, prefix.strip("/")
