"""Thread pools for batches of I/O: one bounded pool per batch of remote requests (ranged GETs,
composes, deletes), and process-wide pools that a load's reads reuse from one load to the next."""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

__all__ = ["run_parallel", "shared_pool"]

T = TypeVar("T")

_MAX_SHARED = 8  # distinct pool sizes kept; more (a caller trying many) get a pool of their own
_shared: dict[int, ThreadPoolExecutor] = {}
_shared_lock = threading.Lock()
_on_shared = threading.local()


def run_parallel(fn: Callable[[T], None], items: Iterable[T], max_workers: int) -> None:
    """Call ``fn`` on every item, at most ``max_workers`` at a time; the first failure is raised.

    After a failure no new item starts; the ones running finish first.
    """
    items = list(items)
    if len(items) <= 1 or max_workers <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="ckpt-io") as pool:
        futures = [pool.submit(fn, item) for item in items]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        for fut in futures:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]


def shared_pool(workers: int) -> ThreadPoolExecutor | None:
    """This process's pool of ``workers`` threads, started on first use and kept: a load after
    the first starts no thread (each start waits for the new thread to be scheduled, about a
    millisecond on a busy machine). None on a thread of a shared pool (a task that waited on
    its own pool could wait forever) or past :data:`_MAX_SHARED` sizes: the caller makes its own.
    A forked child starts afresh (the parent's threads do not exist there)."""
    if getattr(_on_shared, "flag", False):
        return None
    with _shared_lock:
        pool = _shared.get(workers)
        if pool is None and len(_shared) < _MAX_SHARED:
            pool = _shared[workers] = ThreadPoolExecutor(
                workers, thread_name_prefix=f"checkpointer-io{workers}", initializer=_mark_shared
            )
        return pool


def _mark_shared() -> None:
    _on_shared.flag = True


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # a parent's thread may have held it at the fork
    _shared.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
