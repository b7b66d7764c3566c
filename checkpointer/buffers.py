"""Raw bytes of tensors, without copies."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["memoryview_of"]


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
