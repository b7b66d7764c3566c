"""Asynchronous saves: plan and stage in the foreground, write and commit in the background.

The call returns once this rank's pieces are copied into host buffers (reused from one save to
the next, pinned for CUDA tensors), so training can change its tensors at once; or, with
``stage_in_background``, at once, the copy made by the background thread (on side CUDA streams)
while the caller's next forward and backward run, its future's ``staged`` done after it. The
copies of pieces another rank writes (replicas) are hashed before it returns too, on a thread
beside the copying, for the commit to compare them with the written pieces. A background thread
writes the rank file and commits through a separate gloo group, so its collectives never
interleave with the training loop's. A new save waits for the one in flight. Once the plans are
cached, the call's only collective confirms them: the save locks, and the agreement that every
rank staged its pieces (before them where an old checkpoint is retired), come in the background.

No save is lost silently when the process ends: ``torch.distributed.destroy_process_group``
waits for the saves in flight first (wrapped once an async save starts), the interpreter's exit
waits for them too (its thread joins the writer before ``atexit``), and at exit a save whose
error no one read (:class:`WatchedFuture`: nothing called ``.result()`` or ``.exception()``)
is printed to stderr, naming the checkpoint, and the exit status becomes 1.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import sys
import threading
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import dist
from ..format.metadata import StorageMetadata
from ..sharding import LocalTensor
from ..storage.base import Storage
from ..storage.direct import MIN_FROM_SOURCE
from .rankfile import Copies, start_hashing
from .commit import lock_everywhere, refuse_existing, refuse_existing_everywhere, release_locks, take_locks
from .save import DescribedState, PlannedSave, SavePlanCache, describe_for_save, plan_ahead, plan_in_full, write_and_commit

__all__ = ["AsyncSaver", "WatchedFuture", "wait_for_writes_into", "writing_under"]

_writing: Counter[str] = Counter()  # storage place -> async saves of this process planning or writing there
_writing_changed = threading.Condition()


def wait_for_writes_into(storage: Storage) -> None:
    """Block while an async save of this process is writing the checkpoint at ``storage``:
    reading it then would find it incomplete."""
    place = storage.place()
    with _writing_changed:
        _writing_changed.wait_for(lambda: _writing[place] == 0)


def writing_under(storage: Storage) -> bool:
    """Whether an async save of this process is writing at ``storage`` or anywhere under it
    (by place: a local path through a link counts)."""
    root = storage.place()
    with _writing_changed:
        return any(w == root or w.startswith(f"{root}/") for w in _writing)


def _track(storages: Sequence[Storage], step: int) -> None:
    with _writing_changed:
        for storage in storages:
            place = storage.place()
            _writing[place] += step
            if _writing[place] <= 0:
                del _writing[place]
        _writing_changed.notify_all()


_unread: set[WatchedFuture] = set()  # futures that failed, or are pending, and whose outcome no one read
_unread_lock = threading.Lock()


class WatchedFuture(Future):
    """The future of an async save (``what``: its checkpoint): until its outcome is read, a
    failure is reported at exit (:func:`_report_at_exit`)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.staged: Future[None] = Future()  # done once the state is in host buffers (or staging failed)
        with _unread_lock:
            _unread.add(self)
        self.add_done_callback(lambda f: f._read() if f.cancelled() or Future.exception(f) is None else None)

    def _read(self) -> None:
        with _unread_lock:
            _unread.discard(self)

    def result(self, timeout: float | None = None) -> Any:
        self._read()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._read()
        return super().exception(timeout)


def _wait_for_every_save() -> None:
    for saver in list(_savers):
        saver.wait()


def _before_destroy() -> None:
    """``destroy_process_group``: the saves in flight finish, then every rank leaves the savers'
    groups together (and the savers let go of them: a later save makes its own)."""
    _wait_for_every_save()
    for saver in list(_savers):
        saver.leave_group()


def _report_at_exit() -> None:
    """At exit: finish the saves in flight, then print each failed one whose error no one read,
    and end with status 1."""
    _wait_for_every_save()
    with _unread_lock:
        lost = [f for f in _unread if f.done() and not f.cancelled()]
    for f in lost:
        error = Future.exception(f)
        print(f"checkpointer: error: the async save of {f.what} failed, and nothing read its future's "
              f".result(): {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    if lost:
        sys.stdout.flush()
        os._exit(1)


atexit.register(_report_at_exit)


def _release_locks(planned: list[PlannedSave]) -> None:
    release_locks([(p.storage, p.lock) for p in planned])


class AsyncSaver:
    """One background writer with its staging buffers and process group."""

    def __init__(self) -> None:
        self._arenas: dict[int, _HostArena] = {}  # per save target of a call
        self._start_afresh()
        _savers.add(self)

    def _start_afresh(self) -> None:
        """No thread, group or save in flight (also in a forked child: none of its parent's are its own)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpointer-async-save")
        self._group: Any = None
        self._group_made = False
        self._inflight: Future | None = None
        self._lock = threading.Lock()

    def leave_group(self) -> None:
        """Every rank, once no save is in flight: meet on this saver's group, then drop it."""
        if self._group_made:
            dist.meet_before_destroy(self._group)
            self._group, self._group_made = None, False

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; its errors stay on its future."""
        inflight = self._inflight
        if inflight is not None:
            dist.attempt(inflight.result)  # its error stays on that save's own future

    def save(
        self,
        targets: list[tuple[Storage, Mapping[str, Any]]],
        *,
        save_overwrite: bool,
        cache: dict[str, SavePlanCache],
        absent: Sequence[Storage] = (),
        stage_in_background: bool = False,
        claim: Callable[[], None] | None = None,
    ) -> WatchedFuture:
        """Plan and stage every ``(storage, state_dict)`` now; write them all in the background.
        Without ``save_overwrite``, a checkpoint in any of ``absent`` refuses the save too. ``claim``:
        instead, rank 0's check before any lock (:func:`~checkpointer.engine.commit.claim_step`).

        With every plan cached, the caller waits for one all-reduce and the copy: rank 0 takes
        the save locks in the background, which then agrees on them and on every rank's
        staging before any rank writes. With ``stage_in_background``, the copy is made by the
        writer thread too: the caller must leave the tensors unchanged until the future's
        ``staged`` is done (a trainer waits for it before its next optimizer step).
        """
        with self._lock:
            self.wait()
            dist.wait_before_destroy(_before_destroy)
            result: Future[list[tuple[StorageMetadata, list[str]]]] = WatchedFuture(" and ".join(s.url for s, _ in targets))
            planned: list[PlannedSave] = []
            locked = False
            _track([st for st, _ in targets], +1)

            def plan() -> None:
                nonlocal planned, locked
                if not self._group_made:
                    self._group = dist.new_cpu_group()
                    self._group_made = True
                described = [(st, describe_for_save(sd)) for st, sd in targets]
                reused = _reuse_cached_plans_each(described, cache)
                locked = None in reused
                if not locked:
                    planned = reused  # type: ignore[assignment]
                    return
                if claim is not None and save_overwrite:  # the claim retires the old step: every plan agreed first
                    plan_ahead([(st, d) for (st, d), p in zip(described, reused) if p is None], save_overwrite=True, cache=cache)
                    reused = _reuse_cached_plans_each(described, cache)  # all of them now: none planned twice
                if claim is not None:  # before any target's lock: a refused save locks none
                    dist.share_from(0, lambda: claim() or b"", "async save")
                elif not save_overwrite:
                    refuse_existing_everywhere([st for st, _ in targets] + list(absent))
                # each plan and the locking end with an agreement: their errors reach every rank
                fresh: dict[int, PlannedSave] = {}
                for i, ((st, d), p) in enumerate(zip(described, reused)):
                    if p is None:
                        fresh[i] = plan_in_full(st, d, save_overwrite=save_overwrite, cache=cache)
                        planned.append(fresh[i])  # a later failure releases its lock
                kept = [p for p in reused if p is not None]  # their locks now, as the fresh plans took theirs
                locks = lock_everywhere([p.storage for p in kept], save_overwrite) if kept else []
                locked_reused = iter(replace(p, lock=lock) for p, lock in zip(kept, locks))
                planned[:] = [fresh[i] if i in fresh else next(locked_reused) for i in range(len(reused))]

            _, error = dist.attempt(plan)
            if error is not None:  # surfaces from .result()
                _track([st for st, _ in targets], -1)
                _release_locks(planned)
                result.staged.set_result(None)
                result.set_exception(error)
                return result
            staged: list[list[tuple[str, LocalTensor]]] = []
            copies: list[Copies] = []

            def stage() -> None:
                nonlocal staged, copies
                # Replicas are hashed now, from the state being staged: training changes it next.
                hashing = [start_hashing(p.copies, p.described) for p in planned]
                try:
                    for index in [i for i in self._arenas if i >= len(planned)]:
                        self._arenas.pop(index).release()
                    staged = [self._stage(i, p) for i, p in enumerate(planned)]
                finally:
                    copies = [h.result() for h in hashing]  # no hashing outlives the call

            if stage_in_background:
                ready, ready_error = dist.attempt(lambda: _ready_events(planned))

                def stage_then_write() -> None:
                    staging_error = ready_error or dist.attempt(lambda: _on_side_streams(ready, stage))[1]
                    result.staged.set_result(None)
                    self._write(planned, staged, copies, staging_error, locked, save_overwrite, result, absent, claim)

                return self._submit(result, planned, stage_then_write)
            # One rank's staging error: the background agreement tells the others.
            _, staging_error = dist.attempt(stage)
            result.staged.set_result(None)
            return self._submit(result, planned, lambda: self._write(
                planned, staged, copies, staging_error, locked, save_overwrite, result, absent, claim))

    def _submit(self, result: WatchedFuture, planned: list[PlannedSave], work: Any) -> WatchedFuture:
        """Hand ``work`` (which settles ``result``) to the writer thread; at exit, fail the save, its locks released."""
        try:
            self._inflight = self._executor.submit(work)
        except RuntimeError as ex:
            _track([p.storage for p in planned], -1)
            _release_locks(planned)
            if not result.staged.done():
                result.staged.set_result(None)
            result.set_exception(ex)
        return result

    def _write(
        self, planned: list[PlannedSave], staged: list[list[tuple[str, LocalTensor]]], copies: list[Copies],
        staging_error: BaseException | None, locked: bool, save_overwrite: bool, result: Future,
        absent: Sequence[Storage], claim: Callable[[], None] | None,
    ) -> None:
        out: list[tuple[StorageMetadata, list[str]]] = []
        try:
            error = staging_error
            if not locked and save_overwrite:  # every rank staged before rank 0 retires an old checkpoint
                dist.agree(error, "async save", group=self._group)
            if error is None and not locked and dist.get_rank() == 0:
                def refuse_then_lock() -> list[bytes | None]:
                    if claim is not None:
                        claim()
                    elif not save_overwrite:
                        refuse_existing(list(absent))
                    return take_locks([p.storage for p in planned], save_overwrite)

                locks, error = dist.attempt(refuse_then_lock)
                planned = [replace(p, lock=lock) for p, lock in zip(planned, locks)] if error is None else planned
            dist.agree(error, "async save", group=self._group)
            for p, s, c in zip(planned, staged, copies):
                out.append((p.metadata, write_and_commit(p, pieces=s, copies=c, group=self._group)))
        except BaseException as ex:  # noqa: BLE001 - surfaces from .result()
            _release_locks(planned[len(out) :])  # rank 0's locks of the saves this failure stopped
            _track([p.storage for p in planned], -1)
            result.set_exception(ex)
        else:
            _track([p.storage for p in planned], -1)
            result.set_result(out)

    def _stage(self, index: int, planned: PlannedSave) -> list[tuple[str, LocalTensor]]:
        """Copy this rank's pieces into a reusable host arena."""
        pieces = list(planned.local_pieces())
        layout = [(key, lt.data.numel(), lt.data.dtype, lt.data.is_cuda) for key, lt in pieces]
        arena = self._arenas.get(index)
        if arena is None or arena.layout != layout:
            if arena is not None:
                self._arenas.pop(index).release()
            arena = self._arenas[index] = _HostArena(layout)
        staged = []
        for slot, (key, lt) in enumerate(pieces):
            buf = arena.piece(slot)
            buf.view(lt.data.shape).copy_(lt.data, non_blocking=lt.data.is_cuda)
            staged.append((key, replace(lt, data=buf)))
        for device in {lt.data.device for _, lt in pieces if lt.data.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the copies above were queued on it
        return staged


def _reuse_cached_plans_each(
    targets: list[tuple[Storage, DescribedState]], cache: dict[str, SavePlanCache]
) -> list[PlannedSave | None]:
    """Each target's plan from ``cache`` where every rank has one from the same save (one
    all-reduce for all of them), else None for that target: a training state whose size changes
    from step to step is planned anew while the model's and optimizer's plans are reused. No
    lock is taken; the reused targets share one file id."""
    hits = [cache.get(d.fingerprint) if d.error is None else None for _, d in targets]
    same, save_id = dist.all_equal_each_and_least([h.plan_id if h is not None else -1 for h in hits], secrets.randbits(62))
    for (_, d), hit, agreed in zip(targets, hits, same):
        if hit is not None and agreed:  # newest again: plans made meanwhile push out the unused ones
            cache[d.fingerprint] = cache.pop(d.fingerprint)
    return [
        PlannedSave(storage, d.described, hit.keys, hit.metadata, d.fingerprint, None, hit.copies, f"{save_id:016x}")
        if hit is not None and agreed else None
        for (storage, d), hit, agreed in zip(targets, hits, same)
    ]


def _ready_events(planned: list[PlannedSave]) -> list[tuple[torch.device, Any]]:
    """For staging on another thread: per CUDA device of the pieces, an event on the caller's
    current stream there, recorded after the work that produced the state (an optimizer step)."""
    devices = {lt.data.device for p in planned for _, lt in p.local_pieces() if lt.data.is_cuda}
    events = []
    for device in sorted(devices, key=lambda d: d.index or 0):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append((device, event))
    return events


def _on_side_streams(ready: list[tuple[torch.device, Any]], work: Any) -> None:
    """``work()`` with, on each device of ``ready``, a stream of its own as the current one that
    first waits for that event: the copies to host then overlap the caller's next kernels and
    never run before those that made the state (a thread's current device is not the caller's:
    each stream is made on its event's device)."""
    with contextlib.ExitStack() as streams:
        made = []
        for device, event in ready:
            stream = torch.cuda.Stream(device=device)
            stream.wait_event(event)
            streams.enter_context(torch.cuda.stream(stream))
            made.append(stream)
        try:
            work()
        finally:  # copies queued before a failure finish before the buffers are reused
            for stream in made:
                stream.synchronize()


_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child (a data loader's worker, say) has only the thread that forked: a saver
    whose writer thread ran in the parent would queue the child's save for a thread that is
    not there, and wait for it forever."""
    global _writing_changed, _unread_lock
    _writing.clear()
    _writing_changed = threading.Condition()
    _unread_lock = threading.Lock()
    _unread.clear()
    for saver in list(_savers):
        saver._start_afresh()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_ALIGN = 64
_PAGE = 4096


class _HostArena:
    """One host allocation holding the staged pieces of one save target, in order. Pieces from a
    GPU make it page-locked, registered with CUDA at exactly its size (torch's pinned allocator
    rounds every allocation up to a power of two: 12 GiB for 6.2 GiB of 129 MiB pieces)."""

    def __init__(self, layout: list[tuple[str, int, torch.dtype, bool]]):
        self.layout = layout
        self.offsets: list[int] = []
        total = 0
        for _, numel, dtype, _ in layout:
            nbytes = numel * dtype.itemsize
            # Pieces a local save may write from memory start on pages, as the arena does: all
            # agree with one another modulo any O_DIRECT alignment, so they go uncopied.
            align = _PAGE if nbytes >= MIN_FROM_SOURCE else _ALIGN
            total = -(-total // align) * align
            self.offsets.append(total)
            total += -(-nbytes // _ALIGN) * _ALIGN
        self.pinned = any(cuda for *_, cuda in layout)
        self.registered = False
        if not self.pinned:
            whole = torch.empty(max(total, _ALIGN) + _PAGE, dtype=torch.uint8)
            skip = -whole.data_ptr() % _PAGE
            self.base = whole[skip : skip + max(total, _ALIGN)]
            return
        # Whole pages of its own: a page shared with another registered range cannot be registered.
        size = -(-max(total, 1) // _PAGE) * _PAGE
        whole = torch.empty(size + _PAGE, dtype=torch.uint8)
        skip = -whole.data_ptr() % _PAGE
        self.base = whole[skip : skip + size]
        cudart = torch.cuda.cudart()
        portable = 1  # cudaHostRegisterPortable: page-locked for every device's context, not one
        self.registered = int(cudart.cudaHostRegister(self.base.data_ptr(), size, portable)) == 0
        if not self.registered:
            if hasattr(cudart, "cudaGetLastError"):
                cudart.cudaGetLastError()  # or the next kernel launch check reports it
            self.base = torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def piece(self, slot: int) -> torch.Tensor:
        _, numel, dtype, _ = self.layout[slot]
        start = self.offsets[slot]
        return self.base[start : start + numel * dtype.itemsize].view(dtype)

    def release(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.registered = False

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - CUDA may be gone at interpreter exit
            pass
