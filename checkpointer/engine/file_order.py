"""The order of the pieces in a rank file, for a writer that sends tensor memory to disk uncopied
only where its address agrees with its file offset (local ``O_DIRECT``)."""

from __future__ import annotations

from typing import Sequence

from ..format.dtypes import itemsize
from ..format.safetensors_header import DATA_ALIGNMENT
from ..sharding import LocalTensor

__all__ = ["order_for_alignment"]


def order_for_alignment(
    tensors: Sequence[tuple[str, LocalTensor]], align: int, min_bytes: int
) -> tuple[list[tuple[str, LocalTensor]], tuple[int, int] | None]:
    """A file order, and where the data must start (``(remainder, align)`` for
    :func:`build_header`), so that as many bytes as possible sit in the file at offsets that
    agree with their memory addresses modulo ``align``: those a local ``O_DIRECT`` writer sends
    from tensor memory, uncopied.

    Contiguous CPU pieces of at least ``min_bytes`` (smaller ones reach the writer in batches,
    copied) whose sizes are multiples of ``align`` keep each other's agreement when they follow
    one another. The remainder of their addresses shared by the most bytes wins, and those
    pieces go first, in their order; the rest follows, in its order. ``(tensors, None)`` when
    no piece qualifies."""
    if align % DATA_ALIGNMENT:
        return list(tensors), None
    remainders = [_address_remainder(lt, align, min_bytes) for _, lt in tensors]
    bytes_at: dict[int, int] = {}
    for (_, lt), r in zip(tensors, remainders):
        if r is not None:
            bytes_at[r] = bytes_at.get(r, 0) + lt.numel * itemsize(lt.dtype)
    if not bytes_at:
        return list(tensors), None
    best = max(bytes_at, key=lambda r: (bytes_at[r], -r))
    first = [kt for kt, r in zip(tensors, remainders) if r == best]
    rest = [kt for kt, r in zip(tensors, remainders) if r != best]
    return first + rest, (best, align)


def _address_remainder(lt: LocalTensor, align: int, min_bytes: int) -> int | None:
    data = lt.data
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    nbytes = lt.numel * itemsize(lt.dtype)
    address = data.data_ptr()
    if nbytes < min_bytes or nbytes % align or address % DATA_ALIGNMENT:
        return None
    return address % align
