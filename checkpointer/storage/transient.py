"""Which failures of a remote request are transient (worth retrying) and which are final.

Stdlib only. :func:`is_transient` knows the builtin ones (connection errors, timeouts, an
:class:`HTTPStatusError` with a status :func:`transient_status` accepts); each backend adds
its vendor errors. :func:`certificate_refused` finds a failed certificate check, which client
libraries report as a connection error but no retry can change.
"""

from __future__ import annotations

import ssl

__all__ = ["HTTPStatusError", "transient_status", "is_transient", "certificate_refused"]


class HTTPStatusError(OSError):
    """An HTTP response whose status means failure (raised by the raw HTTP paths)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def transient_status(status: int) -> bool:
    """Request timeout, throttling and server errors (not 501) are worth retrying; other 4xx are not."""
    return status in (408, 429) or (500 <= status <= 599 and status != 501)


def is_transient(exc: BaseException) -> bool:
    """The builtin transient failures; backends add their vendor errors to this."""
    if isinstance(exc, HTTPStatusError):
        return transient_status(exc.status)
    return isinstance(exc, (ConnectionError, TimeoutError))


def certificate_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps) is a server certificate that failed verification:
    client libraries report it as a connection error, but no retry can change it."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen or len(seen) > 32:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            return True
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None), *e.args,
                     *(getattr(e, "kwargs", None) or {}).values()])
    return False
