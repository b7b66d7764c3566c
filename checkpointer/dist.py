"""The only module that calls ``torch.distributed``. Everything works with no process group.

Collectives move bytes (JSON the callers made), never pickles, and each one waits at most
``CHECKPOINTER_TIMEOUT_S`` seconds (default 300) so a rank that died cannot hang the job.
:func:`agree` is how a phase ends: every rank says whether it succeeded, and if any failed,
every rank raises.

When a collective fails, the survivors say which rank stopped answering: a rank numbers the
byte collectives below as it enters them, and one still inside a collective after
:func:`_late_s` records that number in the rendezvous store (from a watching thread, so a store
that stopped answering never holds up the collective); a survivor compares its number with
the others' and names the ranks that never arrived. A collective that ends sooner touches
neither the store nor another thread: at thousands of ranks, a store write per rank and
collective would load the one store server. Every store access on the failure path is bounded
in time: when the store itself is gone (under ``env://`` or ``tcp://`` rank 0 hosts it), the
error says so.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import settings
from .buffers import memoryview_of
from .errors import RankError, RankFailedError, remote_error
from .storage.parallel import on_idle_thread

__all__ = [
    "is_distributed", "get_rank", "get_world_size", "timeout_seconds", "all_gather_bytes", "broadcast_bytes", "gather_bytes",
    "all_reduce_min", "all_equal_and_least", "all_equal_each_and_least", "agree", "agree_after", "barrier", "share_from",
    "share_tensor", "new_cpu_group", "join_from_env", "leave_group", "meet_before_destroy", "wait_before_destroy",
]

TIMEOUT_ENV = settings.TIMEOUT_S_ENV


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def timeout_seconds() -> float:
    return settings.timeout_s()


def _device(group: Any = None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_ARRIVALS = "checkpointer/arrivals"
_STRAGGLER_S = 5.0  # how long a survivor waits for ranks that have not arrived yet, at most
_STORE_S = 10.0  # the most the store may take to answer on the failure path
_LATE_S = 1.0  # a rank still inside a collective this long records its arrival, at most


def _straggler_s() -> float:
    return min(_STRAGGLER_S, timeout_seconds() / 4)


def _late_s() -> float:
    return min(_LATE_S, _straggler_s() / 2)
_PULSE_S = 5.0  # how often ranks that wait for another's long work show they are alive


class _Arrival:
    """This rank entering one byte collective of ``group`` (numbered per group in this process).
    While :func:`_wait` waits for one of its collectives, :class:`_Watcher` may record the
    number in the rendezvous store."""

    _entered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> collectives entered

    def __init__(self, group: Any = None):
        self.group = group or dist.group.WORLD
        self.me = get_rank()
        self.number = _Arrival._entered[self.group] = _Arrival._entered.get(self.group, 0) + 1
        self.since = 0.0
        self.recorded: Future | None = None  # the store write, once started

    def _key(self, rank: int) -> str:
        return f"{_ARRIVALS}/{self.group.group_name}/{rank}"

    def watch(self) -> None:
        self.since = time.monotonic()
        _watcher.add(self)

    def record(self) -> Future:
        """Start writing this rank's number to the store (once); the caller holds the watcher's lock."""
        if self.recorded is None:
            key, number = self._key(self.me), str(self.number)
            self.recorded = _in_thread(lambda: _store().set(key, number))
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

    def missing(self) -> list[int]:
        """The ranks that have not entered this collective (after waiting a little for stragglers)."""
        _watcher.record_now(self).result()  # raises what the store raised
        mine = self.number
        deadline = time.monotonic() + _straggler_s()
        behind = [r for r in dist.get_process_group_ranks(self.group) if r != self.me]
        behind = [r for r, n in zip(behind, self._counts(behind)) if n < mine]
        while behind and time.monotonic() < deadline:
            time.sleep(0.2)
            behind = [r for r, n in zip(behind, self._counts(behind)) if n < mine]
        return behind

    def _counts(self, ranks: list[int]) -> list[int]:
        store, keys = _store(), [self._key(r) for r in ranks]
        if store.check(keys):  # one request for all (a rank that never recorded has no key)
            return [int(v) for v in store.multi_get(keys)]
        return [int(store.add(k, 0)) for k in keys]


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
                self.pid = os.getpid()
                threading.Thread(target=self._run, name="checkpointer-arrivals", daemon=True).start()

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
                        arrival.record()


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
        missing = _in_thread(arrival.missing).result(timeout=_STORE_S + _STRAGGLER_S)
    except FutureTimeout:
        return store, f"; the store did not answer within {_STORE_S:g}s"
    except Exception as ex:  # noqa: BLE001 - the store's own failure is the diagnosis
        return store, f"; the store is unreachable ({type(ex).__name__}: {ex})"
    if not missing:
        return "another rank", "; every rank had entered this collective, so one stopped inside it"
    many = len(missing) > 1
    return f"rank{'s' if many else ''} {', '.join(map(str, missing))}", f"; {'they' if many else 'it'} never entered this collective: did {'they' if many else 'it'} call this function? Every rank must call it together (a save or load under `if rank == 0:` waits for the others; pass no_dist=True where offered to work alone)"


def _wait(work: dist.Work | None, what: str, arrival: _Arrival | None = None, peer: int | None = None) -> None:
    """Wait for ``work``; when it fails, raise :class:`RankFailedError` naming the rank that stopped.

    ``arrival``: this rank's arrival at the collective ``work`` belongs to; ``peer``: the one
    rank a point-to-point ``work`` depends on.
    """
    if work is None:
        return
    if arrival is not None:
        arrival.watch()
    try:
        # The wait for stragglers comes out of the timeout: the error comes within it.
        work.wait(timeout=datetime.timedelta(seconds=timeout_seconds() - (_straggler_s() if arrival else 0.0)))
    except Exception as ex:
        who, detail = _who_stopped(arrival, peer)
        if arrival is not None:
            _watcher.remove(arrival)
        raise RankFailedError(
            f"{what}: {who} stopped answering (died, or exceeded {TIMEOUT_ENV}={timeout_seconds():g}s){detail}: {ex}"
        ) from ex
    if arrival is not None:
        arrival.settle()


def _to_tensor(payload: bytes, size: int, group: Any = None) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf.to(_device(group))


_LENGTH = 8  # each rank's payload goes in a slot of the longest one's width, after its length


def _slot_width(n: int, arrival: _Arrival, group: Any = None) -> int:
    """The width of every rank's slot: the longest payload of any rank and its length, found by
    one all-reduce (an all-gather of every rank's length costs several times as much in gloo)."""
    longest = torch.tensor([n], dtype=torch.int64, device=_device(group))
    _wait(dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group, async_op=True), "exchange", arrival)
    return _LENGTH + int(longest.item())


def _slot(payload: bytes, width: int, group: Any = None) -> torch.Tensor:
    return _to_tensor(len(payload).to_bytes(_LENGTH, "little") + payload, width, group)


def _unslot(slot: torch.Tensor) -> bytes:
    raw = _bytes(slot)
    return raw[_LENGTH : _LENGTH + int.from_bytes(raw[:_LENGTH], "little")]


def all_gather_bytes(payload: bytes, group: Any = None) -> list[bytes]:
    if not is_distributed():
        return [payload]
    arrival = _Arrival(group)
    width = _slot_width(len(payload), arrival, group)
    out = [torch.empty(width, dtype=torch.uint8, device=_device(group)) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(out, _slot(payload, width, group), group=group, async_op=True), "all-gather", arrival)
    return [_unslot(t) for t in out]


def _bytes(t: torch.Tensor) -> bytes:
    return memoryview_of(t.cpu().contiguous()).tobytes()


_FIRST_BYTES = 64 << 10  # what the first broadcast carries (a metadata.json of ~500 tensors): one collective


def broadcast_bytes(payload: bytes | None, src: int = 0) -> bytes:
    """``src``'s payload on every rank: one broadcast of its size and first :data:`_FIRST_BYTES`
    bytes, and a second of the whole payload only when there is more."""
    if not is_distributed():
        assert payload is not None
        return payload
    arrival = _Arrival()
    payload = payload if get_rank() == src and payload is not None else b""
    head = _to_tensor(len(payload).to_bytes(8, "little") + payload[:_FIRST_BYTES], 8 + _FIRST_BYTES)
    _wait(dist.broadcast(head, src, async_op=True), "broadcast", arrival)
    first = _bytes(head)
    size = int.from_bytes(first[:8], "little")
    if size <= _FIRST_BYTES:
        return first[8 : 8 + size]
    del first, head
    whole = _to_tensor(payload, size)
    _wait(dist.broadcast(whole, src, async_op=True), "broadcast", arrival)
    return _bytes(whole)


def gather_bytes(payload: bytes, dst: int = 0, group: Any = None) -> list[bytes] | None:
    """Every rank's payload on ``dst`` (None elsewhere)."""
    if not is_distributed():
        return [payload]
    arrival = _Arrival(group)
    width = _slot_width(len(payload), arrival, group)
    mine = _slot(payload, width, group)
    out = None
    if get_rank() == dst:
        out = [torch.empty(width, dtype=torch.uint8, device=_device(group)) for _ in range(dist.get_world_size(group))]
    _wait(dist.gather(mine, out, dst=dst, group=group, async_op=True), "gather", arrival)
    if out is None:
        return None
    return [_unslot(t) for t in out]


def all_reduce_min(value: int, group: Any = None) -> int:
    return all_equal_each_and_least([], value, group)[1]


def all_equal_and_least(value: int, pick: int) -> tuple[bool, int]:
    """Whether every rank passed the same ``value``, and the least ``pick`` of any rank (one
    all-reduce; ``|value| < 2**63``)."""
    same, least = all_equal_each_and_least([value], pick)
    return same[0], least


def all_equal_each_and_least(values: Sequence[int], pick: int, group: Any = None) -> tuple[list[bool], int]:
    """:func:`all_equal_and_least` of each of ``values``, in the same one all-reduce."""
    if not is_distributed():
        return [True] * len(values), pick
    arrival = _Arrival(group)
    t = torch.tensor([x for v in values for x in (v, -v)] + [pick], dtype=torch.int64, device=_device(group))
    _wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True), "all-reduce", arrival)
    got = t.tolist()
    return [got[2 * i] == -got[2 * i + 1] for i in range(len(values))], int(got[-1])


def barrier() -> None:
    agree(None, "barrier")


def agree(error: BaseException | None, what: str, *, no_dist: bool = False, group: Any = None) -> None:
    """End a phase on every rank: raise on all ranks if any rank brought an error.

    The failing rank re-raises its own exception; the others raise the same library error
    class (or :class:`RankFailedError`) naming the failing rank, with its message and traceback,
    and every failing rank's :class:`~checkpointer.errors.RankError` in ``failures``.
    """
    if not (no_dist or not is_distributed()):
        _settle(error, what, group)
    if error is not None:
        raise error


class phase:
    """``with dist.phase("load"):`` runs its block on every rank, then ends the phase together
    (:func:`agree`): an exception on any rank makes every rank raise, the failing rank its own.

    The one way a cross-rank step ends (after DCP's ``_DistWrapper``)::

        with dist.phase("load", no_dist=no_dist):
            plans = plan_local_loads(...)
        # every rank planned, or every rank has raised
    """

    def __init__(self, what: str, *, no_dist: bool = False, group: Any = None):
        self.what, self.no_dist, self.group = what, no_dist, group

    def __enter__(self) -> phase:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if not (self.no_dist or not is_distributed()):
            _settle(error, self.what, self.group)
        return False  # this rank's own error, if any, goes on as it is


def attempt(work: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``(work(), None)``, or ``(None, its error)``: for a step whose error travels to the other
    ranks in an exchange of its own, then ends in :func:`agree` (or :func:`remote_error`)."""
    try:
        return work(), None
    except BaseException as ex:  # noqa: BLE001 - carried to every rank by the caller's exchange
        return None, ex


def _settle(error: BaseException | None, what: str, group: Any = None) -> None:
    """One all-reduce when every rank succeeded; else the failures are exchanged, and a rank that
    did not fail raises the first failing rank's error."""
    if all_reduce_min(0 if error is not None else 1, group) == 1:
        return  # every rank succeeded: one all-reduce; messages are exchanged only after a failure
    mine = RankError.of(get_rank(), error).to_json() if error is not None else b""
    failures = [RankError.from_json(b) for b in all_gather_bytes(mine, group) if b]
    if failures and error is None:
        raise remote_error(failures, what)


def error_payload(error: BaseException) -> bytes:
    """This rank's error as the bytes :func:`remote_error` reads (for exchanges of their own)."""
    return RankError.of(get_rank(), error).to_json()


def agree_after(work: Callable[[], Any], what: str, *, no_dist: bool = False) -> Any:
    """Run ``work()`` on every rank, then :func:`agree` on its outcome; returns its result.

    Work of very different lengths (one rank writing a whole file) must not look like a dead
    rank: while it runs, on a thread, every rank answers a short all-gather every
    :data:`_PULSE_S` seconds until all are done, so only a rank that stops answering for
    ``CHECKPOINTER_TIMEOUT_S`` fails the phase, however long the work takes."""
    if no_dist or not is_distributed():
        return work()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as ex:  # noqa: BLE001 - brought to the agreement
            outcome["error"] = ex
        finally:
            done.set()

    worker = threading.Thread(target=run, name="checkpointer-work", daemon=True)
    worker.start()
    while True:
        done.wait(min(_PULSE_S, timeout_seconds() / 4))
        finished = [json.loads(b) for b in all_gather_bytes(json.dumps(done.is_set()).encode())]
        if all(finished):
            break
    worker.join()  # gone before the caller goes on (to exit, say), not only done
    agree(outcome.get("error"), what)
    return outcome.get("result")


def share_from(src: int, produce, what: str, *, no_dist: bool = False) -> bytes:
    """Run ``produce()`` on ``src`` and give its bytes to every rank; its error, if any, reaches all."""
    if no_dist or not is_distributed():
        return produce()
    payload: bytes | None = None
    error: BaseException | None = None
    if get_rank() == src:
        produced, error = attempt(produce)
        payload = b"\x00" + produced if error is None else b"\x01" + error_payload(error)
    data = broadcast_bytes(payload, src=src)
    if data[:1] == b"\x00":
        return data[1:]
    if error is not None:
        raise error
    raise remote_error([RankError.from_json(data[1:])], what)


def share_tensor(buf: torch.Tensor, reader: int, ranks: Sequence[int], tag: int) -> None:
    """Give ``buf`` (host memory) from ``reader`` to every rank in ``ranks``: one broadcast when
    that is every rank, point-to-point sends otherwise. Every rank in ``ranks`` calls it; others
    must not. Under NCCL the bytes travel through a device buffer of the same size."""
    if not is_distributed() or len(ranks) <= 1:
        return
    me = get_rank()
    dev = _device()
    if dev.type == "cpu":
        wire = buf
    else:
        wire = buf.to(dev) if me == reader else torch.empty(buf.shape, dtype=buf.dtype, device=dev)
    if len(ranks) == get_world_size():
        _wait(dist.broadcast(wire, reader, async_op=True), "two-stage broadcast")
    elif me == reader:
        works = [(r, dist.isend(wire, dst=r, tag=tag)) for r in ranks if r != reader]
        for r, work in works:
            _wait(work, "two-stage send", peer=r)
    else:
        _wait(dist.irecv(wire, src=reader, tag=tag), "two-stage receive", peer=reader)
    if wire is not buf and me != reader:
        buf.copy_(wire)


def new_cpu_group() -> Any:
    """A gloo group over every rank, for collectives that run beside training (async saves)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds())) if is_distributed() else None


def join_from_env() -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), join its process group with gloo (the command
    line's work is on the CPU). Returns whether this call created the group."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ or is_distributed():
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_seconds()))
    return True


def leave_group() -> None:
    """Destroy the group :func:`join_from_env` created, once every rank is here."""
    if is_distributed():
        meet_before_destroy()
        dist.destroy_process_group()


def meet_before_destroy(group: Any = None) -> None:
    """Wait (at most 30 s) for every rank of ``group`` before it is destroyed: a rank that destroys
    a group while another is still in a collective can abort a process at exit ("terminate called
    without an active exception"). A rank that is gone does not hold this one up past that."""
    try:
        dist.barrier(group=group, async_op=True).wait(timeout=datetime.timedelta(seconds=min(30.0, timeout_seconds())))
    except Exception:  # noqa: BLE001 - leaving anyway: what the group was for is already decided
        pass


def wait_before_destroy(wait: Callable[[], None]) -> None:
    """Make ``torch.distributed.destroy_process_group`` call ``wait()`` before it destroys
    (installed once per process; calls through ``torch.distributed`` are covered, a reference
    taken earlier by ``from torch.distributed import destroy_process_group`` is not)."""
    original = dist.destroy_process_group
    if getattr(original, "_checkpointer_wait", None) is wait:
        return

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        wait()
        return original(*args, **kwargs)

    destroy_process_group._checkpointer_wait = wait  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
