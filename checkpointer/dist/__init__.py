"""The only package that calls ``torch.distributed`` (here and in :mod:`.arrivals`). Everything works with no process group.

Collectives move bytes (JSON the callers made), never pickles, and each one waits at most
``CHECKPOINTER_TIMEOUT_S`` seconds (default 300) so a rank that died cannot hang the job.
:func:`agree` is how a phase ends: every rank says whether it succeeded, and if any failed,
every rank raises.

When a collective fails, the survivors name the rank that stopped answering (:mod:`.arrivals`).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import settings
from ..buffers import memoryview_of
from ..errors import RankError, RankFailedError, remote_error
from .arrivals import DIFFERENT_CALLS, _Arrival, _straggler_s, _watcher, _who_stopped

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


_PULSE_S = 5.0  # how often ranks that wait for another's long work show they are alive


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
        limit = f"{TIMEOUT_ENV}={timeout_seconds():g}s"
        if not who:  # every rank is waiting, in collectives that do not match
            raise RankFailedError(f"{what}: no rank answered within {limit}: {detail}: {ex}") from ex
        raise RankFailedError(f"{what}: {who} stopped answering (died, or exceeded {limit}){detail}: {ex}") from ex
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


def _out_of_step() -> RankFailedError:
    """A slot's width or length that only another rank's other collective can have given."""
    return RankFailedError(f"exchange: the collectives of the ranks do not match: {DIFFERENT_CALLS}")


def _slot(payload: bytes, width: int, group: Any = None) -> torch.Tensor:
    if _LENGTH + len(payload) > width:  # the all-reduce of the widths met another rank's other collective
        raise _out_of_step()
    return _to_tensor(len(payload).to_bytes(_LENGTH, "little") + payload, width, group)


def _unslot(slot: torch.Tensor) -> bytes:
    """The payload of a slot, without the padding after it."""
    n = int.from_bytes(_bytes(slot[:_LENGTH]), "little")
    if _LENGTH + n > slot.numel():
        raise _out_of_step()
    return _bytes(slot[_LENGTH : _LENGTH + n])


def all_gather_bytes(payload: bytes, group: Any = None) -> list[bytes]:
    if not is_distributed():
        return [payload]
    arrival = _Arrival(group, "all-gather")
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
    arrival = _Arrival(kind="broadcast")
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
    arrival = _Arrival(group, "gather")
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
    arrival = _Arrival(group, "all-reduce")
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
        # Unwatched: a data broadcast waits on a read (seconds, from remote storage) every batch, and
        # a late rank's store write for each would load the store. A rank that died is still named.
        arrival = _Arrival(kind="two-stage broadcast", watched=False)
        _wait(dist.broadcast(wire, reader, async_op=True), "two-stage broadcast", arrival)
    elif me == reader:
        works = [(r, dist.isend(wire, dst=r, tag=tag)) for r in ranks if r != reader]
        for r, work in works:
            _wait(work, "two-stage send", peer=r)
    else:
        _wait(dist.irecv(wire, src=reader, tag=tag), "two-stage receive", peer=reader)
    if wire is not buf and me != reader:
        buf.copy_(wire)


def new_cpu_group() -> Any:
    """A gloo group over every rank, for collectives that run beside training (async saves).
    Every rank makes it together: one that does not (its save is synchronous) fails the others'."""
    if not is_distributed():
        return None
    try:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds()))
    except (RuntimeError, ValueError) as ex:  # torch's store timeout (DistStoreError) among them
        raise RankFailedError(
            f"making the process group of the first async save failed ({type(ex).__name__}: {ex}): every rank "
            "must make its first async save together; did a rank save synchronously, or not at all?"
        ) from ex


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
    """Make ``torch.distributed.destroy_process_group`` call ``wait()`` before it destroys the
    default group (installed once per process; calls through ``torch.distributed`` are covered, a
    reference taken earlier by ``from torch.distributed import destroy_process_group`` is not). A
    subgroup's destruction, which only some ranks may call, does not wait."""
    original = dist.destroy_process_group
    if getattr(original, "_checkpointer_wait", None) is wait:
        return

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or group is dist.group.WORLD:
            wait()
        return original(*args, **kwargs)

    destroy_process_group._checkpointer_wait = wait  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
