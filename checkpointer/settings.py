"""Every ``CHECKPOINTER_*`` environment variable the package reads: one getter each.

The one module that reads them (``tests/unit/test_settings.py`` checks). A getter reads its
variable when called, not at import, so a job (or a test) that changes the environment is
heard by the next call. :data:`SETTINGS` lists each variable with its default and meaning,
for documentation. Stdlib only: any module of the package may import this one.

Example::

    from checkpointer import settings

    deadline = settings.timeout_s()  # CHECKPOINTER_TIMEOUT_S, or 300.0
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = [
    "SETTINGS",
    "Setting",
    "TIMEOUT_S_ENV",
    "IO_RETRIES_ENV",
    "IO_THREADS_ENV",
    "STAGING_MIB_ENV",
    "MAX_METADATA_MIB_ENV",
    "DIRECT_IO_ENV",
    "CRC32C_ENV",
    "VERIFY_REPLICAS_ENV",
    "GCS_PARALLEL_UPLOAD_ENV",
    "LOCK_LEASE_S_ENV",
    "timeout_s",
    "io_retries",
    "io_threads",
    "staging_mib",
    "max_metadata_mib",
    "direct_io",
    "crc32c",
    "verify_replicas",
    "gcs_parallel_upload",
    "lock_lease_s",
]

TIMEOUT_S_ENV = "CHECKPOINTER_TIMEOUT_S"
IO_RETRIES_ENV = "CHECKPOINTER_IO_RETRIES"
IO_THREADS_ENV = "CHECKPOINTER_IO_THREADS"
STAGING_MIB_ENV = "CHECKPOINTER_STAGING_MIB"
MAX_METADATA_MIB_ENV = "CHECKPOINTER_MAX_METADATA_MIB"
DIRECT_IO_ENV = "CHECKPOINTER_DIRECT_IO"
CRC32C_ENV = "CHECKPOINTER_CRC32C"
VERIFY_REPLICAS_ENV = "CHECKPOINTER_VERIFY_REPLICAS"
GCS_PARALLEL_UPLOAD_ENV = "CHECKPOINTER_GCS_PARALLEL_UPLOAD"
LOCK_LEASE_S_ENV = "CHECKPOINTER_LOCK_LEASE_S"


class Setting(NamedTuple):
    """One environment variable: what its getter returns when it is unset, and what it does."""

    default: object
    meaning: str


SETTINGS: dict[str, Setting] = {
    TIMEOUT_S_ENV: Setting(300.0, "seconds a collective waits for the other ranks before the phase fails"),
    IO_RETRIES_ENV: Setting(8, "retries of a remote (S3, GCS, HTTP) request after a transient failure"),
    IO_THREADS_ENV: Setting(4, "threads that read (or hash) one rank's files in parallel"),
    STAGING_MIB_ENV: Setting(256.0, "MiB of host memory a save copies GPU or non-contiguous tensors through"),
    MAX_METADATA_MIB_ENV: Setting(4096.0, "MiB of metadata.json a load accepts before refusing it"),
    DIRECT_IO_ENV: Setting("auto", "write local files with O_DIRECT where available: 'auto' except a save's rank file most of whose bytes it would copy, 1 always, 0 or off never (buffered, written back 32 MiB at a time)"),
    CRC32C_ENV: Setting("", "'google' checksums with google-crc32c even where ISA-L is available"),
    VERIFY_REPLICAS_ENV: Setting(True, "a save checks that replicated tensors are equal on every rank (0: off)"),
    GCS_PARALLEL_UPLOAD_ENV: Setting(True, "GCS uploads a large file as parts composed at commit (0: one upload)"),
    LOCK_LEASE_S_ENV: Setting(120.0, "seconds without a heartbeat after which a save's lock is stale and taken over"),
}
"""Variable name -> its getter's default and its meaning (the getter is the name without
``CHECKPOINTER_``, in lower case: ``CHECKPOINTER_IO_THREADS`` -> :func:`io_threads`)."""

_OFF = ("0", "false", "no", "off")


def _on(name: str) -> bool:
    """A switch: on unless set to 0, false, no or off; unset or empty is on."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _OFF:
        return False
    if raw in ("", "1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r}: set it to 1 (on) or 0 (off)")


def _number(name: str, default: float, kind: type, *, least: float, equal: bool = True) -> Any:
    """The variable as a ``kind`` (int or float) of at least ``least`` (more than it, without
    ``equal``); unset or empty is ``default``. Anything else is refused, naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not (value >= least if equal else value > least):  # NaN fails both
        raise ValueError(f"{name}={raw!r} must be {'at least' if equal else 'more than'} {least:g}")
    return value


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks: ``CHECKPOINTER_TIMEOUT_S`` (default 300)."""
    return _number(TIMEOUT_S_ENV, 300.0, float, least=0, equal=False)


def io_retries() -> int:
    """Retries allowed after a transient failure: ``CHECKPOINTER_IO_RETRIES`` (default 8)."""
    return _number(IO_RETRIES_ENV, 8, int, least=0)


def io_threads() -> int:
    """Threads reading one rank's files in parallel: ``CHECKPOINTER_IO_THREADS`` (default 4)."""
    return _number(IO_THREADS_ENV, 4, int, least=1)


def staging_mib() -> float:
    """MiB of host memory for copying tensors a save cannot write in place: ``CHECKPOINTER_STAGING_MIB`` (default 256)."""
    return _number(STAGING_MIB_ENV, 256.0, float, least=0, equal=False)


def max_metadata_mib() -> float:
    """The largest ``metadata.json`` a load reads, in MiB: ``CHECKPOINTER_MAX_METADATA_MIB`` (default 4096)."""
    return _number(MAX_METADATA_MIB_ENV, 4096.0, float, least=0, equal=False)


def direct_io() -> str:
    """When local writes use ``O_DIRECT``: ``CHECKPOINTER_DIRECT_IO`` (``auto``, the default; ``1``/``on``: always; ``0``/``off``: never)."""
    raw = os.environ.get(DIRECT_IO_ENV, "auto").strip().lower()
    if raw == "auto":
        return "auto"
    if raw in _OFF or raw == "":
        return "never"
    if raw in ("1", "true", "yes", "on", "always"):
        return "always"
    raise ValueError(f"{DIRECT_IO_ENV}={raw!r}: set it to auto, 1 (always) or 0 (never)")


def crc32c() -> str:
    """The preferred CRC32C implementation: ``CHECKPOINTER_CRC32C`` (``google``; default ``""``, the fastest)."""
    raw = os.environ.get(CRC32C_ENV, "").strip().lower()
    if raw not in ("", "google"):
        raise ValueError(f"{CRC32C_ENV}={raw!r}: set it to google, or leave it unset for the fastest")
    return raw


def verify_replicas() -> bool:
    """Whether saves compare replicas: ``CHECKPOINTER_VERIFY_REPLICAS`` (default on; ``0`` is off)."""
    return _on(VERIFY_REPLICAS_ENV)


def gcs_parallel_upload() -> bool:
    """Whether GCS uploads large files as composed parts: ``CHECKPOINTER_GCS_PARALLEL_UPLOAD`` (default on)."""
    return _on(GCS_PARALLEL_UPLOAD_ENV)


def lock_lease_s() -> float:
    """``CHECKPOINTER_LOCK_LEASE_S``: a save's lock not refreshed for this long is stale (default 120)."""
    return _number(LOCK_LEASE_S_ENV, 120.0, float, least=0, equal=False)
