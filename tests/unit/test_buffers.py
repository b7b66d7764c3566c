"""Byte views of tensor memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from checkpointer.buffers import memoryview_of


def test_a_view_keeps_its_tensor_alive():
    """A view of a temporary (``memoryview_of(t.cpu())`` of a GPU tensor) must not outlive the
    memory it reads: the tensor stays alive until the view is released."""
    t = torch.arange(1000, dtype=torch.int32)
    alive = weakref.ref(t)
    view = memoryview_of(t)
    del t
    gc.collect()
    filler = [torch.full((1000,), -1, dtype=torch.int32) for _ in range(50)]  # would reuse freed memory
    assert alive() is not None
    assert view.tobytes() == torch.arange(1000, dtype=torch.int32).numpy().tobytes()
    view.release()
    del view, filler
    gc.collect()
    assert alive() is None


def test_a_view_writes_into_the_tensor():
    t = torch.zeros(3, dtype=torch.float32)
    memoryview_of(t)[4:8] = torch.tensor([2.5]).numpy().tobytes()
    assert t.tolist() == [0.0, 2.5, 0.0]


@pytest.mark.parametrize("tensor", [torch.zeros(4, 4).t(), torch.zeros(2, device="meta")])
def test_only_contiguous_cpu_tensors_have_views(tensor):
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        memoryview_of(tensor)
