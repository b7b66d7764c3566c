"""Threads kept between calls: the daemon threads of the store requests (``on_idle_thread``)
and the read tasks of a load (``reads._run``, in which the caller's thread takes turns); and the
threads of one writer (``Workers``), which take work while the interpreter exits; and the beat of
``Periodic`` (the save lock's heartbeat)."""

from __future__ import annotations

import concurrent.futures.thread
import gc
import queue
import threading
import time
import weakref

import pytest

from checkpointer.engine import reads
from checkpointer.storage.parallel import Periodic, Workers, on_idle_thread, run_parallel


def test_an_idle_thread_takes_the_next_call():
    """The second call starts no thread. (Not necessarily the first call's thread: a thread of an
    earlier test's store request may become idle in between, and the latest idle one is taken.)"""
    first = on_idle_thread(threading.current_thread, name="test-idle").result(timeout=5)
    before = set(threading.enumerate())
    second = on_idle_thread(threading.current_thread, name="test-idle").result(timeout=5)
    assert second in before, (first, second)
    assert first is not threading.current_thread()


def test_a_stuck_thread_holds_up_no_later_call():
    release = threading.Event()
    stuck = on_idle_thread(lambda: release.wait(10), name="test-stuck")
    try:
        other = on_idle_thread(threading.get_ident, name="test-stuck").result(timeout=5)
        assert not stuck.done()
    finally:
        release.set()
    assert stuck.result(timeout=5) is True
    assert other != threading.get_ident()


def test_errors_reach_the_caller_and_nothing_of_a_call_stays_with_the_thread():
    class Held:
        pass

    held = Held()
    gone = weakref.ref(held)

    def fail(obj=held):
        raise KeyError(f"no {type(obj).__name__}")

    future = on_idle_thread(fail, name="test-error")
    with pytest.raises(KeyError, match="no Held"):
        future.result(timeout=5)
    del fail, future, held
    time.sleep(0.05)
    gc.collect()
    assert gone() is None


def test_a_failed_calls_frames_hold_nothing_once_its_caller_hears_back():
    """The error stays with the caller; the locals of the frames it came from do not (a store
    reference dropped later, on the kept thread, at process exit, aborts the process)."""

    class Held:
        pass

    refs: list[weakref.ref] = []

    def fail():
        held = Held()  # a local of the failing frame only
        refs.append(weakref.ref(held))
        raise KeyError("store gone")

    future = on_idle_thread(fail, name="test-frames")
    error = future.exception(timeout=5)
    assert isinstance(error, KeyError) and error.__traceback__ is not None
    gc.collect()
    assert refs[0]() is None


def test_reads_run_runs_every_task_without_grad_on_every_thread():
    import torch

    modes: list[bool] = []
    with torch.enable_grad():
        reads._run(1, [(lambda: modes.append(torch.is_grad_enabled()),)])
        reads._run(3, [(lambda: (time.sleep(0.005), modes.append(torch.is_grad_enabled())),) for _ in range(12)])
    assert modes == [False] * 13


def test_a_call_cancelled_before_its_turn_is_skipped_and_the_thread_serves_the_next():
    from concurrent.futures import Future

    from checkpointer.storage import parallel

    inbox = queue.SimpleQueue()
    ran: list[str] = []
    skipped, served = Future(), Future()
    skipped.cancel()
    inbox.put((lambda: ran.append("skipped"), skipped))
    inbox.put((lambda: ran.append("served") or 7, served))
    threading.Thread(target=parallel._serve, args=(inbox,), daemon=True).start()
    try:
        assert served.result(timeout=5) == 7 and ran == ["served"]
    finally:  # two calls put in one inbox by hand made it idle twice: the others' calls must not meet it
        with parallel._shared_lock:
            parallel._idle[:] = [q for q in parallel._idle if q is not inbox]


def test_reads_run_every_task_once_on_the_callers_thread_too():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        time.sleep(0.002)
        with lock:
            seen.append((i, threading.get_ident()))

    reads._run(3, [(task, i) for i in range(40)])
    assert sorted(i for i, _ in seen) == list(range(40))
    threads = {t for _, t in seen}
    assert threading.get_ident() in threads and 1 < len(threads) <= 3


def test_reads_run_keeps_a_small_payload_on_the_callers_thread():
    """Read tasks that fill less than one thread's share of bytes run on the caller's thread
    alone (many small tasks are mostly Python: threads sharing the GIL only slow them down); a
    larger payload is shared out as before."""
    seen: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        time.sleep(0.002)
        with lock:
            seen.append(threading.get_ident())

    reads._run(3, [(task, i) for i in range(40)], 40 * 4096)
    assert len(seen) == 40 and set(seen) == {threading.get_ident()}
    seen.clear()
    reads._run(3, [(task, i) for i in range(40)], 3 * reads._BYTES_PER_THREAD)
    assert len(seen) == 40 and 1 < len(set(seen)) <= 3


def test_reads_run_stops_after_a_failure_and_raises_it():
    ran: list[int] = []

    def task(i: int) -> None:
        if i == 2:
            raise OSError("bad read of rank_1.safetensors")
        time.sleep(0.01)
        ran.append(i)

    with pytest.raises(OSError, match="rank_1.safetensors"):
        reads._run(2, [(task, i) for i in range(50)])
    assert len(ran) < 48  # the rest never started
    n = len(ran)
    time.sleep(0.05)
    assert len(ran) == n  # and nothing runs once _run has returned


def test_reads_run_does_not_wait_for_a_pool_busy_with_other_work():
    """The caller's thread does every task when the shared pool's threads are all taken (another
    load's reads, say), and returns without waiting for them to free up."""
    from checkpointer.storage.parallel import shared_pool

    size = 7  # a pool of its own size: no other test's
    release = threading.Event()
    busy = [shared_pool(size).submit(release.wait, 10) for _ in range(size)]
    try:
        seen: list[int] = []
        done = threading.Event()
        caller = threading.Thread(target=lambda: (reads._run(size, [(seen.append, i) for i in range(20)]), done.set()))
        caller.start()
        assert done.wait(5), "reads._run waited for the busy pool"
        assert seen == list(range(20))
    finally:
        release.set()
        for future in busy:
            future.result(timeout=10)


def test_reads_run_interrupted_stops_every_thread_before_it_raises():
    caller = threading.current_thread()
    ran: list[int] = []

    def task(i: int) -> None:
        if threading.current_thread() is caller and i >= 4:
            raise KeyboardInterrupt
        time.sleep(0.01)
        ran.append(i)

    with pytest.raises(KeyboardInterrupt):
        reads._run(2, [(task, i) for i in range(60)])
    n = len(ran)
    time.sleep(0.05)
    assert len(ran) == n  # nothing ran once _run had raised
    assert n < 50  # and the tasks not started were dropped


def test_a_second_interrupt_while_the_helpers_stop_waits_for_them(monkeypatch):
    """A raw read into a tensor its caller frees once _run raises would corrupt memory: an
    interrupt during the wait for the helpers is raised only once they have stopped."""
    from concurrent.futures import wait as real_wait

    calls = []

    def interrupted_once(futures):
        calls.append(len(futures))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(futures)

    monkeypatch.setattr(reads, "wait", interrupted_once)
    finished: list[int] = []

    def task(i: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)  # a helper's task outlasts the caller's
        finished.append(i)

    with pytest.raises(KeyboardInterrupt):
        reads._run(2, [(task, i) for i in range(2)])
    assert sorted(finished) == [0, 1] and calls[1:] == calls[:1]


def test_workers_take_work_once_the_interpreter_exits(monkeypatch):
    """concurrent.futures refuses new work once its exit hook ran (and an async save still
    writing then needs threads); Workers and run_parallel do not."""
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        concurrent.futures.ThreadPoolExecutor(1).submit(int)
    with Workers(2, "test-exit") as workers:
        assert [f.result(timeout=5) for f in [workers.submit(lambda x: x * 2, i) for i in range(5)]] == [0, 2, 4, 6, 8]
    seen = []
    run_parallel(seen.append, range(4), 3)
    assert sorted(seen) == [0, 1, 2, 3]


def test_workers_run_at_most_their_count_at_once_and_end_their_threads():
    running, most, lock = [0], [0], threading.Lock()

    def task(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        if i == 3:
            raise ValueError("task 3")
        return i

    workers = Workers(2, "test-bound")
    futures = [workers.submit(task, i) for i in range(6)]
    assert [f.result(timeout=5) for f in futures if f is not futures[3]] == [0, 1, 2, 4, 5]
    with pytest.raises(ValueError, match="task 3"):
        futures[3].result()
    workers.shutdown()
    assert most[0] == 2
    assert not [t for t in threading.enumerate() if t.name.startswith("test-bound")]


def test_workers_shutdown_cancels_what_has_not_started():
    release = threading.Event()
    workers = Workers(1, "test-cancel")
    first = workers.submit(release.wait, 5)
    deadline = time.monotonic() + 5
    while not first.running() and time.monotonic() < deadline:  # a kept thread takes it when it wakes
        time.sleep(0.001)
    queued = [workers.submit(int) for _ in range(3)]
    stopping = threading.Thread(target=workers.shutdown, kwargs={"cancel_futures": True})
    stopping.start()  # cancels the queued calls, then waits for the running one
    deadline = time.monotonic() + 5
    while not all(f.cancelled() for f in queued) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(f.cancelled() for f in queued) and not first.done()
    release.set()
    stopping.join(5)
    assert first.result() is True
    assert not [t for t in threading.enumerate() if t.name.startswith("test-cancel")]


def _no_thread_starts(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)


def test_workers_run_on_threads_started_earlier_when_none_can_start(monkeypatch):
    """Python 3.12.0-3.12.2 start no thread once the interpreter exits: a Workers then serves its
    calls on the idle threads earlier ones left, as many at once as it asks for."""
    with Workers(2, "test-early") as workers:
        meet = threading.Barrier(2, timeout=5)
        assert [f.result(timeout=5) for f in [workers.submit(meet.wait) for _ in range(2)]] != []
    _no_thread_starts(monkeypatch)
    meet = threading.Barrier(3, timeout=5)  # the two calls and this thread: both calls run at once
    with Workers(2, "test-late") as workers:
        futures = [workers.submit(lambda: (meet.wait(), threading.current_thread().name)[1]) for _ in range(2)]
        meet.wait()
        assert sorted(f.result(timeout=5) for f in futures) == ["test-late_0", "test-late_1"]
    assert not [t for t in threading.enumerate() if t.name.startswith("test-late")]  # idle again, renamed


def test_workers_run_calls_in_the_caller_when_no_thread_is_there(monkeypatch):
    from checkpointer.storage import parallel

    _no_thread_starts(monkeypatch)
    with parallel._shared_lock:  # no idle thread either, for the test; they are put back after it
        kept, parallel._idle[:] = parallel._idle[:], []
    try:
        with Workers(3, "test-inline") as workers:
            futures = [workers.submit(lambda x: (x, threading.current_thread()), i) for i in range(4)]
            assert [f.result(timeout=5) for f in futures] == [(i, threading.current_thread()) for i in range(4)]
            with pytest.raises(ZeroDivisionError):
                workers.submit(lambda: 1 / 0).result(timeout=5)
    finally:
        with parallel._shared_lock:
            parallel._idle[:0] = kept


def test_a_workers_dropped_without_shutdown_ends_its_turns():
    workers = Workers(2, "test-dropped")
    assert workers.submit(int, "7").result(timeout=5) == 7
    turns = list(workers._serving)
    del workers
    gc.collect()
    concurrent.futures.wait(turns, timeout=5)
    assert all(turn.done() for turn in turns)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-dropped")]


def test_periodic_beats_what_is_held_until_released_and_a_new_hold_wakes_it_to_the_new_period():
    beats: list[tuple[str, float]] = []
    period = [30.0]
    ticker = Periodic(lambda v: beats.append((v, time.monotonic())), lambda: period[0], "test-periodic")
    ticker.hold("a", "a")  # the thread now waits 30 s
    time.sleep(0.1)
    period[0] = 0.05
    start = time.monotonic()
    ticker.hold("b", "b")  # wakes it: the next beat within the new period, of both
    deadline = start + 5
    while len({v for v, _ in beats}) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {v for v, _ in beats} == {"a", "b"} and beats[0][1] - start < 1.0, beats
    ticker.release("a")
    ticker.release("b")
    time.sleep(0.2)  # its next beat finds nothing held, and it stops
    count = len(beats)
    time.sleep(0.3)
    assert len(beats) == count and not ticker._running  # nothing held: the thread has gone back idle


def test_periodic_goes_on_after_a_failed_beat_and_a_failed_period():
    """One value's beat raising, or ``period()`` raising (a bad setting), ends neither the other
    values' beats nor the thread: it beat nothing more after either before."""
    beats: list[str] = []
    state = {"fail": False}

    def period() -> float:
        if state["fail"]:
            raise ValueError("a bad setting")
        return 0.02

    def beat(value: str) -> None:
        beats.append(value)
        if value == "bad":
            raise RuntimeError("this beat fails")

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 5
        while beats.count("good") < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beats.count("good") >= count, beats

    ticker = Periodic(beat, period, "test-periodic-errors")
    ticker.hold("bad", "bad")
    ticker.hold("good", "good")
    wait_for(3)
    state["fail"] = True
    wait_for(beats.count("good") + 3)
    ticker.release("bad")
    ticker.release("good")


def test_run_parallel_starts_no_new_item_after_a_failure():
    """Two at a time; the first item fails while the second runs: the second finishes, the
    failure is raised, and of the items waiting for a thread at most one starts (the failed
    item's thread may take the next before the failure is seen)."""
    started, second_runs = [], threading.Event()

    def work(i):
        started.append(i)
        if i == 0:
            second_runs.wait(10)
            raise ValueError("item 0")
        if i == 1:
            second_runs.set()
        time.sleep(0.2)  # item 1 runs when item 0 fails; a later item takes as long

    with pytest.raises(ValueError, match="item 0"):
        run_parallel(work, range(8), 2)
    time.sleep(0.3)  # what a cancelled item would have needed to start
    assert {0, 1} <= set(started) <= {0, 1, 2}, started
