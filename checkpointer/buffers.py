"""Raw bytes of tensors, without copies, and reusable host buffers."""

from __future__ import annotations

import ctypes
import threading

import torch

__all__ = ["memoryview_of", "overlapping_memory", "StagingBlocks"]


def memoryview_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory; the view keeps the tensor alive
    (``memoryview_of(t.cpu())`` of a CUDA ``t`` would otherwise read freed memory)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("memoryview_of needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    raw.owner = t
    return memoryview(raw).cast("B")


def overlapping_memory(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The names of the CPU tensors whose memory (from their first byte to their last, strides
    and all) overlaps another's; views of disjoint parts of one buffer do not count."""
    spans = []
    for name, t in tensors.items():
        if t.device.type == "cpu" and t.numel():
            last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
            spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size(), name))
    found: set[str] = set()
    open_spans: list[tuple[int, str]] = []  # (end, name) of the spans that may reach the next start
    for start, end, name in sorted(spans):
        open_spans = [(e, n) for e, n in open_spans if e > start]
        if open_spans:
            found.add(name)
            found.update(n for _, n in open_spans)
        open_spans.append((end, name))
    return found


class StagingBlocks:
    """Host buffers of at least ``block_bytes`` each (more where a caller asks for more), reused
    (fresh ones for each block let the allocator's heap grow): a free one that fits is taken; when
    none fits, one is let go for the new one, so no more are kept than were ever held at once."""

    def __init__(self, block_bytes: int = 0) -> None:
        self._block_bytes = block_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            if self._free:
                self._free.pop()
        return torch.empty(max(nbytes, self._block_bytes), dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
