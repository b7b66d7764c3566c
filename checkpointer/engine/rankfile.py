"""Writing one rank's safetensors file: bytes straight from tensor memory, checksummed as they go."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import settings
from ..buffers import memoryview_of
from ..checksums import CHUNK_BYTES, chunk_crcs, crc32c, crc32c_extend
from ..format.layout import CHECKSUMS_KEY, FILE_ID_KEY
from ..format.safetensors_header import build_header
from ..errors import ReplicaMismatchError
from ..sharding import LocalTensor
from ..storage.base import Storage, Writer
from ..storage.direct import MIN_FROM_SOURCE
from ..storage.parallel import Workers
from ..format.dtypes import itemsize
from ..format.safetensors_header import DATA_ALIGNMENT

__all__ = [
    "write_rank_file", "hash_pieces", "staging_bytes", "io_threads", "order_for_alignment", "start_hashing", "Copies",
    "replica_check_enabled",
]

_WRITE_BLOCK = 2 << 20  # divides CHUNK_BYTES
_FROM_MEMORY_BLOCK = 64 << 20  # a multiple of CHUNK_BYTES, and 4x MIN_FROM_SOURCE


def io_threads() -> int:
    return settings.io_threads()


def write_rank_file(
    storage: Storage,
    name: str,
    tensors: Sequence[tuple[str, LocalTensor]],
    *,
    checksums: bool = True,
    file_id: str | None = None,
    checksums_in_file: bool = False,
    before_commit: Callable[[], None] | None = None,
) -> dict[str, list[int]]:
    """Write the local pieces as one safetensors file, streaming from tensor memory.
    ``before_commit`` runs once every byte is written, before the file takes its name (it
    raises to leave the name as it was).

    Returns each key's CRC32C per :data:`~checkpointer.checksums.CHUNK_BYTES` of its piece.
    Each block is checksummed right after it is written, while it is still in the CPU cache:
    on a machine whose memory bandwidth is the limit, that costs almost nothing extra.
    ``file_id`` goes into the header's ``__metadata__``, for ``metadata.json`` to list.
    ``checksums_in_file`` (format 2): the checksums also go into the file, as its last tensor
    (``CHECKSUMS_KEY``: its size is known before the pieces are hashed, its bytes after).

    Pieces already in contiguous CPU memory (and the header) stay alive and unchanged until
    the writer commits, so they go to :meth:`~checkpointer.storage.base.Writer.write_stable`:
    an object-store writer sends them from tensor memory, with no copy. A piece staged from
    another device or layout is a temporary, written with ``write`` (the writer copies what
    it keeps past the call). A local ``O_DIRECT`` writer sends them uncopied where their
    addresses agree with their file offsets: for it, the file is ordered and its header padded
    so that most bytes do (:func:`order_for_alignment`), and blocks end on aligned offsets.
    """
    result: dict[str, list[int]] = {}
    with storage.open_writer(name) as writer:
        align = writer.source_alignment()
        data_start = None
        uncopied = 0
        if align is not None:
            tensors, data_start, uncopied = order_for_alignment(tensors, align, MIN_FROM_SOURCE)
        entries = [(key, lt.dtype, lt.numel) for key, lt in tensors]
        if checksums_in_file:
            entries.append((CHECKSUMS_KEY, "U8", 4 * sum(_chunks(lt) for _, lt in tensors)))
        header, offsets = build_header(
            entries,
            user_metadata={FILE_ID_KEY: file_id} if file_id else None,
            data_start=data_start,
        )
        writer.expect_bytes(len(header) + sum(numel * itemsize(dtype) for _, dtype, numel in entries), uncopied)
        align = writer.source_alignment()  # None now if the writer chose to copy every byte
        # A writer that copies: each block is hashed while the copy is in the CPU cache. One
        # that writes from tensor memory: blocks of several of its writes.
        block = _FROM_MEMORY_BLOCK if align is not None else _WRITE_BLOCK
        min_block = MIN_FROM_SOURCE if align is not None else 0  # a shorter block would be copied
        pending: list[memoryview] = [memoryview(header)]
        pending_bytes = len(header)
        staging = _Staging()
        for (key, lt), offset in zip(tensors, offsets):
            data = lt.data
            if data.device.type != "cpu" or not data.is_contiguous():
                if pending:
                    writer.write_stable(pending)
                    pending, pending_bytes = [], 0
                # The staging buffer is reused: plain ``write``, which copies what it keeps.
                result[key] = _write_staged(writer, data.detach(), staging, checksums)
                continue
            view = memoryview_of(data)
            if len(view) < _WRITE_BLOCK:
                # Small pieces go out together; each is hashed now, while it is hot.
                result[key] = chunk_crcs(view) if checksums else []
                pending.append(view)
                pending_bytes += len(view)
                if pending_bytes >= _WRITE_BLOCK:
                    writer.write_stable(pending)
                    pending, pending_bytes = [], 0
                continue
            if pending:
                writer.write_stable(pending)
                pending, pending_bytes = [], 0
            result[key] = _write_hashed(writer.write_stable, view, checksums, block, offset, min_block)
        if pending:
            writer.write_stable(pending)
        if checksums_in_file:
            writer.write([memoryview(checksum_bytes(result, {key: _chunks(lt) for key, lt in tensors}))])
        if before_commit is not None:
            before_commit()
        writer.commit()
    return result


def _chunks(lt: LocalTensor) -> int:
    return -(-lt.numel * itemsize(lt.dtype) // CHUNK_BYTES)


def checksum_bytes(crcs: dict[str, list[int]], chunks: dict[str, int]) -> bytes:
    """The data of a rank file's ``CHECKSUMS_KEY`` tensor: each key's checksums, keys in order."""
    out = bytearray()
    for key in sorted(chunks):
        values = crcs[key]
        if len(values) != chunks[key]:
            raise AssertionError(f"{key!r}: {len(values)} checksums for {chunks[key]} chunks")
        out += b"".join(v.to_bytes(4, "little") for v in values)
    return bytes(out)


def hash_pieces(tensors: Sequence[torch.Tensor], *, threads: int = 1) -> list[list[int]]:
    """Each tensor's CRC32C per :data:`CHUNK_BYTES` of its bytes in element order, exactly as
    :func:`write_rank_file` computes them for a piece it writes, without writing it (a replica's
    copy, compared with the written one).

    Chunks of contiguous CPU tensors are hashed by ``threads`` threads (each chunk's checksum
    stands alone; the hashing releases the GIL). The others (on another device, or not
    contiguous) go through one staging buffer of at most :func:`staging_bytes`, in this thread.
    """
    direct = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and t.is_contiguous()]
    views = {i: memoryview_of(tensors[i].detach()) for i in direct}
    out: list[list[int]] = [[] for _ in tensors]
    chunks = [(i, view[at : at + CHUNK_BYTES]) for i, view in views.items() for at in range(0, len(view), CHUNK_BYTES)]
    pool = Workers(threads, "checkpointer-hash") if threads > 1 and len(chunks) > 1 else None
    try:
        hashed = [pool.submit(crc32c, c) for _, c in chunks] if pool is not None else None
        staging = _Staging()
        for i, data in enumerate(tensors):
            if i not in views:
                out[i] = _write_staged(_DISCARD, data.detach(), staging, True)
        crcs = (f.result() for f in hashed) if hashed is not None else map(crc32c, (c for _, c in chunks))
        for (i, _), crc in zip(chunks, crcs):
            out[i].append(crc)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return out


class _Discard:
    """A writer that keeps nothing: :func:`_write_staged` then only hashes."""

    def write(self, views: Sequence[memoryview]) -> None:
        pass


_DISCARD: Writer = _Discard()  # type: ignore[assignment]


def staging_bytes() -> int:
    """Host memory a save may use to copy tensors that cannot be written from where they are
    (on a GPU, or not contiguous): ``CHECKPOINTER_STAGING_MIB``, default 256."""
    return max(1, int(settings.staging_mib() * (1 << 20)))


class _Staging:
    """One reusable host buffer of at most :func:`staging_bytes` (pinned when copying from CUDA)."""

    def __init__(self) -> None:
        self.budget = staging_bytes()
        self._buf: torch.Tensor | None = None

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pinned and not buf.is_pinned()):
            self._buf = None
            size = max(nbytes, min(self.budget, 64 << 20))
            buf = self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return buf[:nbytes]


def _write_staged(writer: Writer, data: torch.Tensor, staging: _Staging, checksums: bool) -> list[int]:
    """Write a tensor through the staging buffer, a block of whole rows (dim 0) at a time.

    A block is at most the staging budget, or one row where a row is larger than that."""
    pinned = data.device.type == "cuda"
    if data.dim() == 0:
        data = data.reshape(1)
    if data.is_contiguous():
        data = data.reshape(-1)  # a view: blocks of elements
    rows = data.shape[0]
    row_bytes = max(1, data[:1].numel() * data.element_size())
    step = max(1, staging.budget // row_bytes)
    crcs: list[int] = []
    crc, in_chunk = 0, 0
    for start in range(0, rows, step):
        part = data[start : start + step]
        nbytes = part.numel() * part.element_size()
        host = staging.take(nbytes, pinned).view(part.dtype).view(part.shape)
        host.copy_(part)
        view = memoryview_of(host)
        pos = 0
        while pos < len(view):
            # Checksums restart every CHUNK_BYTES of the tensor, wherever the block boundaries fall.
            take = min(len(view) - pos, CHUNK_BYTES - in_chunk, _WRITE_BLOCK)
            block = view[pos : pos + take]
            writer.write([block])
            if checksums:
                crc = crc32c_extend(crc, block)
            pos += take
            in_chunk += take
            if in_chunk == CHUNK_BYTES:
                crcs.append(crc)
                crc, in_chunk = 0, 0
    if in_chunk:
        crcs.append(crc)
    return crcs if checksums else []


def _write_hashed(
    write: Callable[[Sequence[memoryview]], None],
    view: memoryview,
    checksums: bool,
    block_bytes: int,
    file_offset: int,
    min_block: int = 0,
) -> list[int]:
    """Write ``view`` (which starts at ``file_offset``) in blocks that end on multiples of
    ``block_bytes`` in the file, none shorter than ``min_block`` but the whole view, hashing
    each :data:`CHUNK_BYTES` of it."""
    crcs: list[int] = []
    crc, pos = 0, 0
    while pos < len(view):
        end = pos + block_bytes - (file_offset + pos) % block_bytes
        if end - pos < min_block:
            end += block_bytes
        if len(view) - end < min_block:
            end = len(view)
        end = min(len(view), end)
        write([view[pos:end]])
        while checksums and pos < end:
            cut = min(end, (pos // CHUNK_BYTES + 1) * CHUNK_BYTES)
            crc = crc32c_extend(crc, view[pos:cut])
            if cut % CHUNK_BYTES == 0 or cut == len(view):
                crcs.append(crc)
                crc = 0
            pos = cut
        pos = end
    return crcs


# The order of the pieces in a rank file, for a writer that sends tensor memory to disk uncopied
# only where its address agrees with its file offset (local O_DIRECT).




def order_for_alignment(
    tensors: Sequence[tuple[str, LocalTensor]], align: int, min_bytes: int
) -> tuple[list[tuple[str, LocalTensor]], tuple[int, int] | None, int]:
    """A file order, where the data must start (``(remainder, align)`` for
    :func:`build_header`), and how many bytes then go uncopied, so that as many bytes as
    possible sit in the file at offsets that agree with their memory addresses modulo
    ``align``: those a local ``O_DIRECT`` writer sends from tensor memory, uncopied.

    Contiguous CPU pieces of at least ``min_bytes`` (smaller ones reach the writer in batches,
    copied) whose sizes are multiples of ``align`` keep each other's agreement when they follow
    one another. The remainder of their addresses that sends the most bytes from memory wins
    (a piece whose address is not aligned loses one ``align`` block of its bytes), and those
    pieces go first, in their order; the rest follows, in its order. ``(tensors, None, 0)`` when
    no piece qualifies."""
    if align % DATA_ALIGNMENT:
        return list(tensors), None, 0
    remainders = [_address_remainder(lt, align, min_bytes) for _, lt in tensors]
    bytes_at: dict[int, int] = {}
    for (_, lt), r in zip(tensors, remainders):
        if r is not None:  # what goes from memory: all but the unaligned head and its block's rest
            bytes_at[r] = bytes_at.get(r, 0) + lt.numel * itemsize(lt.dtype) - (align if r else 0)
    if not bytes_at:
        return list(tensors), None, 0
    best = max(bytes_at, key=lambda r: (bytes_at[r], -r))
    first = [kt for kt, r in zip(tensors, remainders) if r == best]
    rest = [kt for kt, r in zip(tensors, remainders) if r != best]
    return first + rest, (best, align), bytes_at[best]


def _address_remainder(lt: LocalTensor, align: int, min_bytes: int) -> int | None:
    data = lt.data
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    nbytes = lt.numel * itemsize(lt.dtype)
    address = data.data_ptr()
    if nbytes < min_bytes or nbytes % align or address % DATA_ALIGNMENT:
        return None
    return address % align


# Hashing the copies of pieces another rank writes (the commit compares them: engine/commit.py).

_INLINE_BYTES = 4 << 20  # copies smaller than this in all are hashed by the caller (well under 1 ms)

Copies = list[list[Any]]
"""This rank's copies as its commit status carries them: ``[key, writer, crcs]`` each."""


def replica_check_enabled() -> bool:
    """Whether saves compare replicas (default on; ``CHECKPOINTER_VERIFY_REPLICAS=0`` is off)."""
    return settings.verify_replicas()


def start_hashing(copies: Mapping[str, int], described: Mapping[str, LocalTensor]) -> Future[Copies]:
    """Hash this rank's ``copies`` (key -> the rank writing that piece) on a thread (the hashing
    releases the GIL), the chunks of large ones on up to ``CHECKPOINTER_IO_THREADS`` threads; the
    future's result goes into the commit's status. Nothing to hash, or the check turned off: an
    empty result at once."""
    if not copies or not replica_check_enabled():
        done: Future[Copies] = Future()
        done.set_result([])
        return done
    keys = sorted(copies)
    tensors = [described[key].data for key in keys]

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    threads = max(1, min(io_threads(), os.cpu_count() or 1, nbytes // (4 * CHUNK_BYTES)))

    def run() -> Copies:
        return [[key, copies[key], crcs] for key, crcs in zip(keys, hash_pieces(tensors, threads=threads))]

    if nbytes < _INLINE_BYTES:
        done = Future()
        done.set_result(run())  # a few small tensors (an optimizer's steps): sooner than a thread starts
        return done
    pool = Workers(1, "checkpointer-replica-hash")
    try:
        return pool.submit(run)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


# ---------------------------------------------------------------------------------------
# Replicas agree before a commit: rank 0 compares every copy's checksums with the writer's
# ---------------------------------------------------------------------------------------

VERIFY_ENV = settings.VERIFY_REPLICAS_ENV
_SHOWN = 5  # tensors described in the error; the rest are counted


def check_copies(statuses: Sequence[Mapping[str, Any]]) -> None:
    """Rank 0, before committing: raise :class:`ReplicaMismatchError` if a copy in any rank's
    status (``copies``) differs from the checksums its writer reported (``crcs``)."""
    differing: set[tuple[str, int]] = set()
    for status in statuses:
        for key, writer, crcs in status.get("copies", ()):
            if crcs != statuses[writer]["crcs"].get(key):
                differing.add((key, writer))
    if not differing:
        return
    # Every holder of each differing piece, grouped by what it holds; the writer's group first.
    groups: dict[tuple[str, int], dict[tuple[int, ...], list[int]]] = {
        (key, writer): {tuple(statuses[writer]["crcs"].get(key) or ()): [writer]} for key, writer in differing
    }
    for rank, status in enumerate(statuses):
        for key, writer, crcs in status.get("copies", ()):
            if (key, writer) in differing:
                groups[key, writer].setdefault(tuple(crcs), []).append(rank)
    shown = sorted(differing)[:_SHOWN]
    details = "; ".join(_describe(key, writer, groups[key, writer]) for key, writer in shown)
    more = f"; and {len(differing) - len(shown)} more" if len(differing) > len(shown) else ""
    raise ReplicaMismatchError(
        f"replicas disagree, so this save is not committed: {details}{more}. A copy was corrupted in "
        "memory, or a value that differs per rank was saved under one key: save per-rank values under "
        f"per-rank keys (f'rng.rank{{rank}}'), or as PerRank(value) in train_state. {VERIFY_ENV}=0 turns this check off."
    )


def _describe(key: str, writer: int, groups: dict[tuple[int, ...], list[int]]) -> str:
    values = list(groups.items())  # the writer's group first (inserted first)
    who = [_ranks(sorted(ranks)) for _, ranks in values]
    who[0] += f" (rank {writer}'s copy was written)"
    a, b = values[0][0], values[1][0]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (
        f"tensor {key!r} differs between {' / '.join(who)}, first in the {CHUNK_BYTES >> 20} MiB chunk "
        f"at byte {first * CHUNK_BYTES} of the piece"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
