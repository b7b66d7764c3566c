"""A loopback proxy that counts what it sends back: :class:`FaultProxy` of ``storage_servers``
(faults included), recording each exchange's status, start and end times and bytes.

Used by the remote tests (bytes fetched per rank, the order of uploads) and by
``benchmarks/remote_bench.py`` (bytes fetched per rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from storage_servers import FaultProxy

__all__ = ["CountingProxy", "Exchange"]


class _CountingWriter:
    """The handler's socket writer, counting the bytes written through it."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.count = 0

    def write(self, data: Any) -> int:
        n = self.inner.write(data)
        n = len(data) if n is None else n
        self.count += n
        return n

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Exchange:
    method: str
    path: str
    status: int | None  # None: no answer (a dropped connection)
    started: float  # time.monotonic()
    finished: float
    bytes_out: int  # everything the client was sent: status line, headers and body


@dataclass
class CountingProxy(FaultProxy):
    """:class:`FaultProxy` that records every exchange: bytes sent to the client, status, times."""

    exchanges: list[Exchange] = field(default_factory=list)

    def _serve(self, h) -> None:
        counter = _CountingWriter(h.wfile)
        h.wfile = counter
        status: list[int] = []
        send_response = h.send_response

        def record_status(code, message=None):
            status.append(code)
            send_response(code, message)

        h.send_response = record_status
        started = time.monotonic()
        try:
            super()._serve(h)
        finally:
            h.wfile = counter.inner
            with self._lock:
                self.exchanges.append(
                    Exchange(h.command, h.path, status[0] if status else None, started, time.monotonic(), counter.count)
                )

    @property
    def bytes_out(self) -> int:
        with self._lock:
            return sum(e.bytes_out for e in self.exchanges)
