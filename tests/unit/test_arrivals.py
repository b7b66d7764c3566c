"""dist/arrivals.py without a process group: the watcher that records a rank kept waiting."""

from __future__ import annotations

import time
from concurrent.futures import Future

from checkpointer.dist import arrivals


class FakeArrival:
    """What the watcher reads and calls: when it started waiting, and its record."""

    def __init__(self, refusals: int) -> None:
        self.since = time.monotonic() - 10.0
        self.recorded: Future | None = None
        self.refusals = refusals
        self.calls = 0

    def record(self) -> Future:
        self.calls += 1
        if self.calls <= self.refusals:
            raise RuntimeError("can't start new thread")
        self.recorded = Future()
        self.recorded.set_result(None)
        return self.recorded


def wait_for(condition, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_record_that_cannot_start_is_tried_again_and_the_watcher_goes_on(monkeypatch):
    monkeypatch.setattr(arrivals, "_LATE_S", 0.05)
    watcher = arrivals._Watcher()
    first, second = FakeArrival(refusals=2), FakeArrival(refusals=0)
    watcher.add(first)
    assert wait_for(lambda: first.recorded is not None), first.calls
    assert first.calls == 3  # refused twice (no thread could start), recorded at the third look
    watcher.add(second)  # the same watching thread, still alive, records the next one
    assert wait_for(lambda: second.recorded is not None)
    assert watcher.remove(first) is first.recorded and watcher.remove(second) is second.recorded
    assert watcher.waiting == {}


def test_a_collective_ending_in_time_is_never_recorded(monkeypatch):
    monkeypatch.setattr(arrivals, "_LATE_S", 0.4)  # the watcher looks every 0.2 s
    watcher = arrivals._Watcher()
    quick = FakeArrival(refusals=0)
    quick.since = time.monotonic()
    watcher.add(quick)
    time.sleep(0.3)  # one look has passed while it was watched, not yet late
    assert watcher.remove(quick) is None and quick.calls == 0
    time.sleep(0.3)  # past _LATE_S: once removed, it is not looked at again
    assert quick.calls == 0
