"""The host arena an async save stages one target's pieces into."""

from __future__ import annotations

import torch

from checkpointer.engine.async_save import _HostArena
from checkpointer.storage.direct import MIN_FROM_SOURCE


def test_pieces_are_aligned_disjoint_views_of_one_allocation():
    layout = [
        ("a", 3, torch.float32, False),
        ("empty", 0, torch.int64, False),
        ("b", 1001, torch.bfloat16, False),
        ("c", 17, torch.int64, False),
        ("d", 1, torch.uint8, False),
    ]
    arena = _HostArena(layout)
    assert not arena.pinned and not arena.registered
    pieces = [arena.piece(slot) for slot in range(len(layout))]
    for (_, numel, dtype, _), piece in zip(layout, pieces):
        assert piece.dtype == dtype and piece.numel() == numel and piece.is_contiguous()
        assert piece.untyped_storage().data_ptr() == arena.base.untyped_storage().data_ptr()
        assert (piece.data_ptr() - arena.base.data_ptr()) % 64 == 0
    for slot, piece in enumerate(pieces):
        piece.fill_(slot + 1)
    for slot, piece in enumerate(pieces):
        assert bool((piece == slot + 1).all()), layout[slot][0]  # no piece overlaps another
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in pieces if p.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert arena.base.numel() <= sum(-(-n * d.itemsize // 64) * 64 for _, n, d, _ in layout)


def test_pieces_a_save_writes_from_memory_start_on_pages():
    """Pieces of MIN_FROM_SOURCE and more start on page boundaries (so all of them agree modulo
    any O_DIRECT alignment, and a local save writes them uncopied); smaller ones pack at 64 bytes."""
    big = MIN_FROM_SOURCE
    layout = [
        ("step", 1, torch.float32, False),
        ("w", big // 4 + 3, torch.float32, False),
        ("bias", 10, torch.bfloat16, False),
        ("w2", big // 2 + 32, torch.bfloat16, False),  # ends 64 bytes past a page
        ("under", (big - 4096) // 4, torch.float32, False),
        ("tail", 5, torch.int64, False),
    ]
    arena = _HostArena(layout)
    pieces = [arena.piece(slot) for slot in range(len(layout))]
    assert arena.base.data_ptr() % 4096 == 0
    assert pieces[1].data_ptr() % 4096 == 0 and pieces[3].data_ptr() % 4096 == 0
    assert pieces[2].data_ptr() - pieces[1].data_ptr() == -(-(big + 12) // 64) * 64  # packed after w
    assert pieces[4].data_ptr() - pieces[3].data_ptr() == big + 64  # under the size: packed, not on a page
    assert all(p.data_ptr() % 64 == 0 for p in pieces)
    for slot, piece in enumerate(pieces):
        piece.fill_(slot + 1)
    for slot, piece in enumerate(pieces):
        assert bool((piece == slot + 1).all()), layout[slot][0]
