"""One bounded thread pool for a batch of remote requests (ranged GETs, composes, deletes)."""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

__all__ = ["run_parallel"]

T = TypeVar("T")


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
