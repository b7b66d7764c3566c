"""Retrying a remote request: how often and how long (:class:`RetryPolicy`), and the loop.

Stdlib only; each backend says which of its vendor errors are transient
(:mod:`~checkpointer.storage.transient`).

* :func:`call_with_retry` retries a transient failure (throttling, 5xx, reset connections,
  timeouts) with exponential backoff and jitter, bounded in count (``CHECKPOINTER_IO_RETRIES``,
  default 8) and in time; then an ``OSError`` names the operation and the URL.
* :func:`holds` tells a conditional create's own file from someone else's after a lost answer.

What the remote backends share besides: ranged reads in :mod:`~checkpointer.storage.ranges`,
one bounded pool in :mod:`~checkpointer.storage.parallel`, uploads in parts in
:mod:`~checkpointer.storage.parts`, redaction of credentials in
:mod:`~checkpointer.storage.redact`, bucket URLs in :mod:`~checkpointer.storage.urls`.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from .. import settings
from .base import Storage
from .redact import redact
from .transient import certificate_refused, is_transient

__all__ = ["RetryPolicy", "call_with_retry", "holds"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one operation.

    Args:
        retries: retries after the first attempt (default: ``CHECKPOINTER_IO_RETRIES`` or 8).
        base_delay: the first backoff, in seconds; each retry doubles it, up to ``max_delay``.
        max_delay: the longest single backoff.
        max_elapsed: no retry starts after this many seconds spent on the operation.
    """

    retries: int = field(default_factory=settings.io_retries)
    base_delay: float = 0.25
    max_delay: float = 20.0
    max_elapsed: float = 600.0

    def delay(self, retry: int) -> float:
        """Backoff before retry number ``retry`` (1-based): exponential, jittered in its upper half."""
        cap = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return _JITTER.uniform(cap / 2, cap)


_JITTER = random.Random()  # its own: retries must not move the sequence of a user's seeded `random`


def call_with_retry(
    fn: Callable[[int], T],
    *,
    op: str,
    url: str,
    transient: Callable[[BaseException], bool] = is_transient,
    policy: RetryPolicy | None = None,
) -> T:
    """Call ``fn(attempt)`` until it returns, retrying transient failures.

    Args:
        fn: the operation; it gets the attempt number (0 first) so that a retry can resume.
        op: what is being done, for messages (``"GET bytes 0-99"``).
        url: the object's URL, for messages; it must already be free of credentials.
        transient: says which exceptions are worth retrying; others propagate unchanged.
        policy: count and time bounds (default: :class:`RetryPolicy`).

    Returns:
        What ``fn`` returned.

    Raises:
        OSError: naming ``op`` and ``url`` when the retries or the time run out (the last
            failure is the cause).
    """
    policy = policy or RetryPolicy()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as exc:
            if not transient(exc) or certificate_refused(exc):
                raise
            attempt += 1
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt > policy.retries or elapsed + pause > policy.max_elapsed:
                raise OSError(
                    f"{op} {url} failed after {attempt} attempts in {elapsed:.1f}s "
                    f"(limit {policy.retries} retries, {settings.IO_RETRIES_ENV}): "
                    f"{type(exc).__name__}: {redact(str(exc))}"
                ) from exc
            log.debug("%s %s: retry %d in %.2fs after %s", op, url, attempt, pause, type(exc).__name__)
            time.sleep(pause)


def holds(storage: Storage, name: str, data: bytes) -> bool:
    """Whether the file ``name`` holds exactly ``data``: after a conditional create whose
    answer was lost, a retry that finds the file tells ours from someone else's this way."""
    try:
        return storage.read(name) == data
    except OSError:
        return False
