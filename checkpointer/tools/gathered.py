"""Remote reads for the tools: many small ranges of one file become few ranged requests.

A box along a trailing dimension is a range per row; an object store charges per request and
answers each with a round trip, so :class:`GatheredReads` fetches ranges less than 1 MiB apart
as one (through a staging buffer of at most 64 MiB) and copies the parts out.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..storage.base import ReadRequest, Storage, Writer

__all__ = ["GatheredReads"]

_GAP_BYTES = 1 << 20
_SPAN_BYTES = 64 << 20


class GatheredReads(Storage):
    """A view of ``inner`` whose :meth:`read_into` fetches requests less than 1 MiB apart as one
    range (through a staging buffer of at most 64 MiB): a slice along a trailing dimension is
    a range per row, and an object store charges per request."""

    def __init__(self, inner: Storage, *, gap: int = _GAP_BYTES, span: int = _SPAN_BYTES):
        self.inner, self.gap, self.span = inner, gap, span
        self.url = inner.url

    def child(self, name: str) -> Storage:
        return GatheredReads(self.inner.child(name), gap=self.gap, span=self.span)

    def pinned(self) -> Storage:
        inner = self.inner.pinned()
        return self if inner is self.inner else GatheredReads(inner, gap=self.gap, span=self.span)

    def close(self) -> None:
        self.inner.close()

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def list(self) -> list[str]:
        return self.inner.list()

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.read(name, start, end)

    def write(self, name: str, data: bytes) -> None:
        self.inner.write(name, data)

    def open_writer(self, name: str) -> Writer:
        return self.inner.open_writer(name)

    def read_into(self, name: str, requests: Sequence[ReadRequest]) -> None:
        groups: list[list[ReadRequest]] = []
        end = -1
        for off, buf in sorted((r for r in requests if len(r[1])), key=lambda r: r[0]):
            if groups and end <= off <= end + self.gap and off + len(buf) - groups[-1][0][0] <= self.span:
                groups[-1].append((off, buf))
            else:
                groups.append([(off, buf)])
            end = off + len(buf)
        direct = [g[0] for g in groups if len(g) == 1]
        if direct:
            self.inner.read_into(name, direct)
        batch: list[tuple[list[ReadRequest], bytearray]] = []
        staged = 0
        for group in [g for g in groups if len(g) > 1] + [None]:  # type: ignore[list-item]
            if group is not None:
                first = group[0][0]
                stage = bytearray(group[-1][0] + len(group[-1][1]) - first)
                batch.append((group, stage))
                staged += len(stage)
            if batch and (group is None or staged >= self.span):
                self.inner.read_into(name, [(g[0][0], memoryview(s)) for g, s in batch])
                for g, s in batch:
                    view = memoryview(s)
                    for off, buf in g:
                        rel = off - g[0][0]
                        buf.cast("B")[:] = view[rel : rel + len(buf)]
                batch, staged = [], 0
