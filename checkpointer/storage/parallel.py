"""Threads for I/O: a bounded group per batch of remote requests (ranged GETs, composes,
deletes) or per writer (:class:`Workers`), process-wide pools that a load's reads reuse from one
load to the next, and daemon threads, kept when idle, for single requests their caller waits on
with a bound, or that beat while something is held (:class:`Periodic`).

What a save runs goes to :class:`Workers`, not to ``ThreadPoolExecutor``: ``concurrent.futures``
refuses new work once the interpreter starts to exit, and the exit waits for an async save still
writing (:mod:`~checkpointer.engine.async_save`), whose writes, uploads and hashing then need
threads."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

__all__ = ["Periodic", "Workers", "on_idle_thread", "run_parallel", "shared_pool"]

T = TypeVar("T")
log = logging.getLogger(__name__)

_FALLBACK_PERIOD = 1.0  # seconds: Periodic's beat where its period() fails from the start
_MAX_SHARED = 8  # distinct pool sizes kept; more (a caller trying many) get a pool of their own
_shared: dict[int, ThreadPoolExecutor] = {}
_shared_lock = threading.Lock()
_on_shared = threading.local()
_idle: list[queue.SimpleQueue] = []  # inboxes of the threads of on_idle_thread waiting for work


def run_parallel(fn: Callable[[T], None], items: Iterable[T], max_workers: int) -> None:
    """Call ``fn`` on every item, at most ``max_workers`` at a time; the first failure is raised.

    After a failure no new item starts; the ones running finish first.
    """
    items = list(items)
    if len(items) <= 1 or max_workers <= 1:
        for item in items:
            fn(item)
        return
    with Workers(min(max_workers, len(items)), "ckpt-io") as pool:
        futures = [pool.submit(fn, item) for item in items]
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        for fut in futures:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]


class Workers:
    """Up to ``workers`` threads running the calls given to :meth:`submit`, in order, each a
    future; :meth:`shutdown` (or leaving the ``with`` block) waits for them. Unlike
    ``ThreadPoolExecutor``, it takes work while the interpreter exits (see the module's text): its
    threads are the kept idle ones of :func:`on_idle_thread`, started by earlier work where
    possible (Python 3.12.0-3.12.2 start none at exit), and where not even one thread can start,
    a call runs in the caller. A ``Workers`` dropped without :meth:`shutdown` ends its threads."""

    def __init__(self, workers: int, name: str):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._serving: list[Future] = []
        self._workers, self._name = max(1, workers), name
        weakref.finalize(self, _end, self._work, self._serving)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        future: Future[T] = Future()
        if len(self._serving) < self._workers:
            name = f"{self._name}_{len(self._serving)}"
            try:
                self._serving.append(on_idle_thread(functools.partial(_drain, self._work, name), "checkpointer-idle"))
            except RuntimeError:  # no thread can start: the interpreter exits, or a limit
                if not self._serving:
                    _settle(future, *_outcome(fn, *args))
                    return future
        self._work.put((fn, args, future))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """End the threads' turns once the calls given have run (``cancel_futures``: those not
        started are cancelled); ``wait``: return only when they have ended."""
        if cancel_futures:
            while True:
                try:
                    task = self._work.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[2].cancel()
        serving, self._serving[:] = list(self._serving), []
        _end(self._work, serving)
        if wait:
            concurrent.futures.wait(serving)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _drain(work: queue.SimpleQueue, name: str) -> None:
    """One turn of a kept thread serving a :class:`Workers`, named ``name`` while it does."""
    thread = threading.current_thread()
    idle_name, thread.name = thread.name, name
    try:
        while True:
            task = work.get()
            if task is None:
                return
            fn, args, future = task
            del task
            if future.set_running_or_notify_cancel():
                _settle(future, *_outcome(fn, *args))
            del fn, args, future
    finally:
        thread.name = idle_name


def _end(work: queue.SimpleQueue, serving: list[Future]) -> None:
    for _ in serving:
        work.put(None)


def _settle(future: Future[T], result: T | None, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)  # type: ignore[arg-type]
    else:
        future.set_exception(error)


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


def on_idle_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` on a daemon thread: a future of its result or error. An idle thread of an earlier
    call takes it, else a new one starts (a start costs about a millisecond of a busy machine).
    A thread that never returns (stuck in a server that stopped answering) is never idle again,
    so it holds up no later call; and an idle thread holds nothing of the calls it ran. ``name``
    names a thread this call starts."""
    future: Future[T] = Future()
    with _shared_lock:
        inbox = _idle.pop() if _idle else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name=name, daemon=True).start()
    inbox.put((fn, future))
    return future


def _serve(inbox: queue.SimpleQueue) -> None:
    # The rendezvous store's last reference dropped on this thread at process exit aborts the
    # process (the arrival records of dist/arrivals.py): every reference a call made is gone before its caller
    # hears back, its error's frames included.
    while True:
        fn, future = inbox.get()
        ran = future.set_running_or_notify_cancel()  # False: cancelled before its turn
        result, error = _outcome(fn) if ran else (None, None)
        del fn
        with _shared_lock:  # idle before the caller hears back: its next call finds this thread
            _idle.append(inbox)
        if ran:
            _settle(future, result, error)
        del future, result, error  # nothing of the call stays with the thread while it waits


class Periodic:
    """Calls ``beat(value)`` for every value held, every ``period()`` seconds, on one kept thread
    (:func:`on_idle_thread`) that runs while any is held. A value held while the thread waits wakes
    it, to wait by ``period()`` as it is then. :meth:`hold` raises ``RuntimeError`` where no thread
    can start (the value is held all the same); :meth:`release` returns only once no beat of that
    value is under way. A forked child holds nothing and has no thread."""

    def __init__(self, beat: Callable[[T], None], period: Callable[[], float], name: str):
        self._beat, self._period, self._name = beat, period, name
        self._after_fork()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def hold(self, key: object, value: T) -> None:
        with self._mutex:
            self._held[key] = value
            if self._running:
                self._woken.set()
            else:
                on_idle_thread(self._run, self._name)
                self._running = True

    def release(self, key: object) -> None:
        with self._mutex:
            self._held.pop(key, None)

    def _run(self) -> None:
        ended = False  # by finding nothing held (under the mutex), not by an error
        try:
            period = self._period_or(_FALLBACK_PERIOD)
            due = time.monotonic() + period
            while True:
                woken = self._woken.wait(max(0.0, due - time.monotonic()))
                self._woken.clear()
                period = self._period_or(period)
                if woken:
                    due = min(due, time.monotonic() + period)
                    continue
                due = time.monotonic() + period
                with self._mutex:
                    if not self._held:
                        self._running, ended = False, True
                        return
                    for value in list(self._held.values()):
                        try:
                            self._beat(value)
                        except Exception:  # noqa: BLE001 - one failed beat ends neither the others nor the next
                            log.exception("%s: a beat failed", self._name)
        finally:
            if not ended:  # whatever else ended the loop: the next hold starts a thread
                with self._mutex:
                    self._running = False

    def _period_or(self, last: float) -> float:
        try:
            return self._period()
        except Exception:  # noqa: BLE001 - a bad setting: beat as before (its users see the error)
            log.exception("%s: no period, beating every %gs", self._name, last)
            return last

    def _after_fork(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict = {}
        self._running = False
        self._woken = threading.Event()


def _outcome(fn: Callable[..., T], *args: object) -> tuple[T | None, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, its error)`` with the error's frames cleared: a thread that
    goes on to wait for more work holds nothing of the call."""
    try:
        return fn(*args), None
    except BaseException as ex:  # noqa: BLE001 - handed to whoever waits on the call's future
        traceback.clear_frames(ex.__traceback__)
        return None, ex


def _mark_shared() -> None:
    _on_shared.flag = True


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # a parent's thread may have held it at the fork
    _shared.clear()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
