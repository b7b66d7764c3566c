"""Replicas agree before a commit: the copies of a piece that several ranks hold are compared
with the one written, by CRC32C, and a save whose copies differ is refused.

A piece held by several ranks (a plain tensor every rank saves, DDP's parameters, a
``Replicate`` placement, each shard under HSDP) is written once, by one of them. Were the
copies different (a bit flipped in one replica's memory, or a value that differs per rank
saved under one key), one would be kept silently. So:

1. Each holder that does not write its piece hashes its copy
   (:meth:`~checkpointer.planning.plan.SavePlan.copies_for` says which, and whose piece it
   copies): CRC32C per :data:`~checkpointer.checksums.CHUNK_BYTES`, as the writer computes
   them while writing, so the written pieces take no extra pass. A synchronous save hashes on
   a thread while the rank writes its file; an async save before the call returns, while the
   state is the one it staged (training changes it afterwards).
2. The checksums go to rank 0 in the commit's gather of every rank's status (no collective of
   their own). Rank 0 compares each copy with the written piece's checksums and, where one
   differs, commits nothing and raises :class:`~checkpointer.errors.ReplicaMismatchError`
   naming the tensors and ranks; the agreement that ends the save raises it on every rank.

``CHECKPOINTER_VERIFY_REPLICAS=0`` turns the check off.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from .. import settings
from ..checksums import CHUNK_BYTES
from ..errors import ReplicaMismatchError
from ..sharding import LocalTensor
from .rankfile import hash_pieces, io_threads

__all__ = ["VERIFY_ENV", "enabled", "start_hashing", "check_copies"]

VERIFY_ENV = settings.VERIFY_REPLICAS_ENV
_SHOWN = 5  # tensors described in the error; the rest are counted
_INLINE_BYTES = 4 << 20  # copies smaller than this in all are hashed by the caller (well under 1 ms)

Copies = list[list[Any]]
"""This rank's copies as its commit status carries them: ``[key, writer, crcs]`` each."""


def enabled() -> bool:
    """Whether saves compare replicas (default on; ``CHECKPOINTER_VERIFY_REPLICAS=0`` is off)."""
    return settings.verify_replicas()


def start_hashing(copies: Mapping[str, int], described: Mapping[str, LocalTensor]) -> Future[Copies]:
    """Hash this rank's ``copies`` (key -> the rank writing that piece) on a thread (the hashing
    releases the GIL), the chunks of large ones on up to ``CHECKPOINTER_IO_THREADS`` threads; the
    future's result goes into the commit's status. Nothing to hash, or the check turned off: an
    empty result at once."""
    if not copies or not enabled():
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
    pool = ThreadPoolExecutor(1, thread_name_prefix="checkpointer-replica-hash")
    try:
        return pool.submit(run)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


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
        "memory, or a value that differs per rank was saved under one key (give each rank's value a key "
        f"of its own). {VERIFY_ENV}=0 turns this check off."
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
