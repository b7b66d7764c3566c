"""Naming the rank that stopped answering, when a collective of :mod:`checkpointer.dist` fails.

A rank numbers the byte collectives of :mod:`checkpointer.dist` as it enters them, and one still
inside a collective after :func:`_late_s` records that number and the kind in the rendezvous
store (from a watching thread, so a store that stopped answering never holds up the collective);
a survivor compares its number with the others' and names the ranks that never arrived; where
ranks wait in collectives of one number but of different kinds (a broadcast, an all-reduce), it
says that the calls differ between ranks (``train_state`` passed on some ranks only, say). A
collective that ends sooner touches neither the store nor another thread: at thousands of ranks,
a store write per rank and collective would load the one store server. Every store access on the
failure path is bounded in time: when the store itself is gone (under ``env://`` or ``tcp://``
rank 0 hosts it), the error says so.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable

import torch.distributed as dist

from .. import settings
from ..storage.parallel import on_idle_thread

_ARRIVALS = "checkpointer/arrivals"
_STRAGGLER_S = 5.0  # how long a survivor waits for ranks that have not arrived yet, at most
_STORE_S = 10.0  # the most the store may take to answer on the failure path
_LATE_S = 1.0  # a rank still inside a collective this long records its arrival, at most
DIFFERENT_CALLS = (
    "they made different calls, or one call with arguments that differ between ranks (train_state=, optim=, "
    "strategy=, or models of other keys). Every rank must make the same calls with the same arguments"
)


def _straggler_s() -> float:
    return min(_STRAGGLER_S, settings.timeout_s() / 4)


def _late_s() -> float:
    return min(_LATE_S, _straggler_s() / 2)


class _Arrival:
    """This rank entering one byte collective of ``group`` (numbered per group in this process)
    of ``kind`` (``"broadcast"``, say). While :func:`_wait` waits for one of its collectives,
    :class:`_Watcher` may record the number and the kind in the rendezvous store."""

    _entered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> collectives entered

    def __init__(self, group: Any = None, kind: str = "", *, watched: bool = True):
        self.group = group or dist.group.WORLD
        self.kind = kind
        self.watched = watched  # else recorded only when the collective fails
        self.me = dist.get_rank()
        self.number = _Arrival._entered[self.group] = _Arrival._entered.get(self.group, 0) + 1
        self.since = 0.0
        self.recorded: Future | None = None  # the store write, once started

    def _key(self, rank: int) -> str:
        return f"{_ARRIVALS}/{self.group.group_name}/{rank}"

    def watch(self) -> None:
        self.since = time.monotonic()
        if self.watched:
            _watcher.add(self)

    def record(self) -> Future:
        """Start writing this rank's number and kind to the store (once); the caller holds the watcher's lock."""
        if self.recorded is None:
            key, entry = self._key(self.me), f"{self.number} {self.kind}"
            self.recorded = _in_thread(lambda: _store().set(key, entry))
        return self.recorded

    def settle(self) -> None:
        """After the collective: no record starts now, and one started has finished. A thread
        still inside the store's C++ client when the process exits (or destroys its group)
        aborts the process: 'terminate called without an active exception', seen at the end of
        CLI runs under torchrun."""
        recorded = _watcher.remove(self)
        if recorded is None:
            return
        try:
            recorded.exception(timeout=_STORE_S)
        except FutureTimeout:
            pass

    def missing(self) -> tuple[list[int], dict[int, str]]:
        """The ranks that have not entered this collective (after waiting a little for
        stragglers), and those whose collective of this number is of another kind."""
        _watcher.record_now(self).result()  # raises what the store raised
        mine = self.number
        deadline = time.monotonic() + _straggler_s()
        others = [r for r in dist.get_process_group_ranks(self.group) if r != self.me]
        entries = dict(zip(others, self._entries(others)))
        behind = [r for r in others if entries[r][0] < mine]
        while behind and time.monotonic() < deadline:
            time.sleep(0.2)
            entries.update(zip(behind, self._entries(behind)))
            behind = [r for r in behind if entries[r][0] < mine]
        return behind, {r: kind for r, (n, kind) in entries.items() if n == mine and kind != self.kind}

    def _entries(self, ranks: list[int]) -> list[tuple[int, str]]:
        """Each rank's last recorded (number, kind); (0, "") for a rank that never recorded."""
        store, keys = _store(), [self._key(r) for r in ranks]
        if store.check(keys):  # one request for all (a rank that never recorded has no key)
            values = store.multi_get(keys)
        else:
            values = [store.get(k) if store.check([k]) else b"0 " for k in keys]
        entries = [bytes(v).decode().partition(" ") for v in values]
        return [(int(number), kind) for number, _, kind in entries]


class _Watcher:
    """The collectives this process waits for; one daemon thread looks at them every
    :func:`_late_s` / 2 and records the arrival of any that has lasted :func:`_late_s`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: dict[int, _Arrival] = {}
        self.pid: int | None = None  # the process whose thread watches (a fork has none)

    def after_fork(self) -> None:
        """In a forked child: the parent's thread, and whatever it held, are not here."""
        self.lock = threading.Lock()
        self.waiting = {}
        self.pid = None

    def add(self, arrival: _Arrival) -> None:
        with self.lock:
            self.waiting[id(arrival)] = arrival
            if self.pid != os.getpid():
                try:
                    threading.Thread(target=self._run, name="checkpointer-arrivals", daemon=True).start()
                except RuntimeError:  # no thread can start (the interpreter exits): unwatched, not failed
                    return
                self.pid = os.getpid()

    def remove(self, arrival: _Arrival) -> Future | None:
        with self.lock:
            self.waiting.pop(id(arrival), None)
            return arrival.recorded

    def record_now(self, arrival: _Arrival) -> Future:
        with self.lock:
            return arrival.record()

    def _run(self) -> None:
        while True:
            time.sleep(_late_s() / 2)
            now = time.monotonic()
            with self.lock:
                for arrival in self.waiting.values():
                    if arrival.recorded is None and now - arrival.since >= _late_s():
                        try:
                            arrival.record()
                        except RuntimeError:  # no thread can start now: tried again at the next look
                            pass


_watcher = _Watcher()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_watcher.after_fork)


def _store() -> Any:
    # torch has no public accessor for the default group's store; this is the one use of it.
    return dist.distributed_c10d._get_default_store()


def _in_thread(fn: Callable[[], Any]) -> Future:
    """``fn()`` on a daemon thread: a future of its result or error, to be waited for with a
    bound (a thread stuck in a store that stopped answering holds up no later request)."""
    return on_idle_thread(fn, name="checkpointer-store")


def _who_stopped(arrival: _Arrival | None, peer: int | None) -> tuple[str, str]:
    """Which rank stopped answering, as far as the store tells within ``_STORE_S`` seconds;
    and what else is known."""
    if peer is not None:
        return f"rank {peer}", ""
    if arrival is None:
        return "another rank", ""
    store = "rank 0 or the rendezvous store (rank 0 hosts it under env:// and tcp://)"
    try:
        missing, elsewhere = _in_thread(arrival.missing).result(timeout=_STORE_S + _STRAGGLER_S)
    except FutureTimeout:
        return store, f"; the store did not answer within {_STORE_S:g}s"
    except Exception as ex:  # noqa: BLE001 - the store's own failure is the diagnosis
        return store, f"; the store is unreachable ({type(ex).__name__}: {ex})"
    if elsewhere:
        ranks = "; ".join(f"rank {r} in {_a(kind)}" for r, kind in sorted(elsewhere.items()))
        return "", f"the ranks are in different collectives (this rank, {arrival.me}, in {_a(arrival.kind)}; {ranks}): {DIFFERENT_CALLS}"
    if not missing:
        return "another rank", "; every rank had entered this collective, so one stopped inside it"
    many = len(missing) > 1
    return f"rank{'s' if many else ''} {', '.join(map(str, missing))}", f"; {'they' if many else 'it'} never entered this collective: did {'they' if many else 'it'} call this function? Every rank must call it together (a save or load under `if rank == 0:` waits for the others; pass no_dist=True where offered to work alone)"


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"
