"""Byte views of tensor memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from checkpointer.buffers import memoryview_of, overlapping_memory


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


def test_overlapping_memory_names_the_tensors_whose_memory_meets_anothers():
    """Spans from first to last byte, strides and all: views of disjoint parts of one buffer (as
    FSDP1's flat parameter hands out) do not overlap; a transposed or shifted view of the same
    bytes does, and so does every tensor a long span covers."""
    buf = torch.zeros(64)
    assert overlapping_memory({"a": buf[0:16], "b": buf[16:32].view(4, 4), "c": torch.zeros(3)}) == set()
    assert overlapping_memory({"a": buf[0:8], "b": buf[4:12], "c": buf[12:20]}) == {"a", "b"}
    m = buf.view(8, 8)
    assert overlapping_memory({"m": m, "t": m.t(), "other": torch.zeros(8, 8)}) == {"m", "t"}
    assert overlapping_memory({"long": buf[0:40], "x": buf[2:4], "y": buf[30:34], "after": buf[40:48]}) == {"long", "x", "y"}
    # Elements 10-11 lie inside the column block's span (0 to 57) though it holds none of them: counted.
    assert overlapping_memory({"cols": m[:, 0:2], "inside": buf[10:12], "tail": buf[60:64]}) == {"cols", "inside"}
    assert overlapping_memory({"empty": buf[0:0], "a": buf[0:8], "bytes": buf.view(torch.uint8)[32:40]}) == set()
