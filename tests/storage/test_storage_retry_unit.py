"""The shared remote-I/O helpers on their own: retry bounds, range planning, redaction, upload parts."""

from __future__ import annotations

import array
import io
import time

import pytest

from checkpointer.settings import io_retries
from checkpointer.storage.parallel import run_parallel
from checkpointer.storage.parts import PartBuffer, PartReader
from checkpointer.storage.ranges import (
    RangeTask, check_range_start, content_length, ended_as_sent, ends_before, fill_range, plan_ranges,
)
from checkpointer.storage.redact import redact
from checkpointer.storage.retry import RetryPolicy, call_with_retry
from checkpointer.storage.transient import HTTPStatusError
from checkpointer.storage.urls import bucket_url


def _spans(tasks: list[RangeTask]) -> list[tuple[int, int]]:
    return [(t.start, t.end) for t in tasks]


def test_plan_ranges_coalesces_and_splits() -> None:
    a, b, c = bytearray(4), bytearray(4), bytearray(2)
    tasks = plan_ranges([(20, memoryview(c)), (0, memoryview(a)), (4, memoryview(b))], max_range=6)
    assert _spans(tasks) == [(0, 6), (6, 8), (20, 22)]
    assert [len(v) for v in tasks[0].buffers] == [4, 2]  # b straddles the cut: sliced
    assert tasks[1].buffers[0].obj is b


def test_plan_ranges_keeps_gaps_and_overlaps_apart_and_drops_empty() -> None:
    reqs = [(0, memoryview(bytearray(10))), (5, memoryview(bytearray(10))), (16, memoryview(bytearray(1))),
            (30, memoryview(bytearray(0)))]
    assert _spans(plan_ranges(reqs, max_range=100)) == [(0, 10), (5, 15), (16, 17)]


def test_plan_ranges_flattens_typed_buffers() -> None:
    floats = array.array("f", [0.0] * 4)
    (task,) = plan_ranges([(8, memoryview(floats))], max_range=100)
    assert (task.start, task.end) == (8, 24) and task.buffers[0].format == "B"
    with pytest.raises(ValueError):
        plan_ranges([(0, memoryview(b"readonly"))], max_range=100)


def test_fill_range_resumes_where_it_stopped() -> None:
    data = bytes(range(100))
    out1, out2 = bytearray(30), bytearray(40)
    (task,) = plan_ranges([(10, memoryview(out1)), (40, memoryview(out2))], max_range=1000)

    class Broken(io.BytesIO):
        def readinto(self, b):  # delivers 45 bytes, then the connection "drops"
            if self.tell() >= 45:
                raise ConnectionResetError("reset")
            return super().readinto(b[: 45 - self.tell()])

    with pytest.raises(ConnectionResetError):
        fill_range(task, Broken(data[10:80]), block=7)
    assert task.done == 45
    fill_range(task, io.BytesIO(data[10 + task.done : 80]))
    assert bytes(out1) + bytes(out2) == data[10:80]
    (short,) = plan_ranges([(0, memoryview(bytearray(10)))], max_range=1000)
    with pytest.raises(ConnectionError, match="ended at byte 4"):
        fill_range(short, io.BytesIO(b"1234"))


def test_what_an_answer_says_of_the_file_size() -> None:
    # a GET of bytes [100, 200): the file ends before 200 when the answer says so
    assert ends_before(200, 100, 206, "50", None) and not ends_before(200, 100, 206, "100", None)
    assert ends_before(200, 100, 200, "150", None) and not ends_before(200, 100, 200, 200, None)
    assert ends_before(200, 100, 206, None, "bytes 100-149/150")
    assert not ends_before(200, 100, 206, None, "bytes 100-149/1000")  # a part of a longer file
    assert not ends_before(200, 100, 206, None, "bytes 100-149/*") and not ends_before(200, 100, 206, None, None)
    assert ended_as_sent(True, None) and ended_as_sent(True, "bytes 100-149/*")
    assert not ended_as_sent(True, "bytes 100-149/1000") and not ended_as_sent(False, None)
    for length in ("abc", "-50", "50.0", "50, 50", "\u00b2", ""):  # a ValueError from int() before
        with pytest.raises(OSError, match="GET https://h/x: the server's Content-Length .* is not a number of bytes"):
            ends_before(200, 100, 206, length, None, where="GET https://h/x")
    assert content_length(" 50 ", "x") == 50 and content_length(None, "x") is None


def test_an_answer_must_start_at_the_byte_asked_for() -> None:
    check_range_start(100, 206, "bytes 100-149/150", "GET x")
    check_range_start(100, 206, None, "GET x")  # nothing to check
    check_range_start(0, 200, None, "GET x")
    for header in ("bytes 0-49/150", "bytes 101-149/150", "bytes */150", "items 100-149/150", "bytes -1-4/9"):
        with pytest.raises(OSError, match=r"GET x: asked for bytes from 100, the server answered with"):
            check_range_start(100, 206, header, "GET x")


def test_retry_counts_and_names_the_operation() -> None:
    calls: list[int] = []

    def flaky(attempt: int) -> str:
        calls.append(attempt)
        if attempt < 3:
            raise HTTPStatusError(503, "slow down")
        return "ok"

    policy = RetryPolicy(retries=3, base_delay=0.001, max_delay=0.002)
    assert call_with_retry(flaky, op="GET", url="s3://b/k", policy=policy) == "ok"
    assert calls == [0, 1, 2, 3]
    calls.clear()
    with pytest.raises(OSError, match=r"GET bytes 0-9 s3://b/k failed after 3 attempts") as err:
        call_with_retry(flaky, op="GET bytes 0-9", url="s3://b/k", policy=RetryPolicy(2, 0.001, 0.002))
    assert isinstance(err.value.__cause__, HTTPStatusError)
    assert calls == [0, 1, 2]


def test_retry_passes_permanent_errors_through() -> None:
    calls: list[int] = []

    def denied(attempt: int) -> None:
        calls.append(attempt)
        raise HTTPStatusError(403, "denied")

    with pytest.raises(HTTPStatusError):
        call_with_retry(denied, op="GET", url="u", policy=RetryPolicy(5, 0.001, 0.002))
    assert calls == [0]


def test_retry_is_bounded_in_time() -> None:
    def down(attempt: int) -> None:
        raise ConnectionResetError("reset")

    start = time.monotonic()
    with pytest.raises(OSError, match="failed after"):
        call_with_retry(down, op="GET", url="u", policy=RetryPolicy(1000, 0.05, 0.05, max_elapsed=0.3))
    assert time.monotonic() - start < 2.0  # 1000 attempts unbounded would take 50 s


def test_backoff_grows_exponentially_with_jitter() -> None:
    policy = RetryPolicy(retries=8, base_delay=0.1, max_delay=1.0)
    for retry, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.0), (8, 1.0)]:
        delays = {policy.delay(retry) for _ in range(20)}
        assert all(cap / 2 <= d <= cap for d in delays) and len(delays) > 1


def test_redact_takes_the_user_info_up_to_its_last_at_sign() -> None:
    """urlsplit ends the user-info at the authority's last "@": so must redaction, or the tail of a
    password with an unencoded "@" shows in every message."""
    from checkpointer.storage.http import HTTPStorage

    assert redact("GET https://alice:s3cr@t-pass@127.0.0.1:9/ckpt/x@y failed") == "GET https://***@127.0.0.1:9/ckpt/x@y failed"
    assert redact("see https://h/a@b and s3://b/k?e=a@b") == "see https://h/a@b and s3://b/k?***"
    store = HTTPStorage("https://alice:s3cr@t-pass@127.0.0.1:9/ckpt")
    assert "pass" not in store.url and "pass" not in store.join("metadata.json")
    assert store.url == "https://***@127.0.0.1:9/ckpt"


def test_io_retries_env(monkeypatch) -> None:
    monkeypatch.delenv("CHECKPOINTER_IO_RETRIES", raising=False)
    assert io_retries() == 8 and RetryPolicy().retries == 8
    monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", "2")
    assert RetryPolicy().retries == 2
    for bad in ("-1", "many"):
        monkeypatch.setenv("CHECKPOINTER_IO_RETRIES", bad)
        with pytest.raises(ValueError, match="CHECKPOINTER_IO_RETRIES"):
            io_retries()


def test_redact_removes_userinfo_and_queries() -> None:
    text = ("GET https://alice:hunter2@example.test/ckpt/rank_0?token=s3cr3t failed; "
            "url: /upload/storage/v1/b/x/o?uploadType=resumable&upload_id=ABC (Caused by reset)")
    out = redact(text)
    assert "hunter2" not in out and "s3cr3t" not in out and "ABC" not in out
    assert "https://***@example.test/ckpt/rank_0?***" in out
    assert "/upload/storage/v1/b/x/o?***" in out
    assert redact("s3://bucket/prefix/file") == "s3://bucket/prefix/file"


def test_run_parallel_raises_the_first_failure() -> None:
    seen: list[int] = []

    def work(i: int) -> None:
        if i == 3:
            raise OSError("task 3 failed")
        seen.append(i)

    with pytest.raises(OSError, match="task 3"):
        run_parallel(work, range(6), max_workers=2)
    seen.clear()
    run_parallel(work, [0, 1, 2], max_workers=4)
    assert sorted(seen) == [0, 1, 2]


def _joined(part) -> bytes:
    return b"".join(bytes(seg) for seg in part)


def test_part_buffer_copies_small_buffers_and_borrows_large_ones() -> None:
    parts = PartBuffer(8)
    big = bytearray(range(20))
    out = list(parts.feed([memoryview(b"abc"), memoryview(b"defgh"), memoryview(big)]))
    assert [(_joined(p), borrowed) for p, borrowed in out] == [
        (b"abcdefgh", False), (bytes(range(8)), True), (bytes(range(8, 16)), True)]
    assert len(out[0][0]) == 1  # the small buffers were copied into one part buffer
    assert out[1][0][0].obj is big  # no copy
    out = list(parts.feed([memoryview(b"x" * 5)]))
    assert [(_joined(p), b) for p, b in out] == [(bytes(range(16, 20)) + b"xxxx", False)]
    assert _joined(parts.rest()) == b"x" and parts.rest() == []
    assert parts.total == 3 + 5 + 20 + 5
    floats = array.array("f", [1.0, 2.0, 3.0])
    assert _joined(next(iter(PartBuffer(12).feed([memoryview(floats)])))[0]) == floats.tobytes()


def test_part_buffer_slices_stable_buffers_and_copies_only_the_rest() -> None:
    parts = PartBuffer(8)
    a, b, c = bytearray(b"abc"), bytearray(b"defghij"), bytearray(range(20))
    out = list(parts.feed([memoryview(a), memoryview(b)], stable=True))
    assert [(_joined(p), borrowed) for p, borrowed in out] == [(b"abcdefgh", False)]
    assert [seg.obj for seg in out[0][0]] == [a, b]  # slices of the caller's memory
    out = list(parts.feed([memoryview(b"XY")]))  # not stable: copied after the stable tail
    out += list(parts.feed([memoryview(c)], stable=True))  # never borrowed: write need not wait
    assert [(_joined(p), borrowed) for p, borrowed in out] == [
        (b"ijXY" + bytes(range(4)), False), (bytes(range(4, 12)), False), (bytes(range(12, 20)), False)]
    first = out[0][0]
    assert first[0].obj is b and first[1].obj is not c and first[2].obj is c
    assert parts.rest() == []


def test_part_reader_reads_across_segments_and_seeks() -> None:
    part = [memoryview(b"abc"), memoryview(bytearray(b"defg")), memoryview(b"hi")]
    reader = PartReader(part)
    assert len(reader) == 9
    assert reader.read(2) == b"ab" and reader.read(4) == b"cdef" and reader.read() == b"ghi"
    assert reader.read(5) == b"" and reader.tell() == 9
    reader.seek(0)
    assert all(isinstance(reader.read(3), bytes) for _ in range(3))
    tail = PartReader(part, 4)  # a resumed upload sends from byte 4 on
    assert len(tail) == 5 and tail.tell() == 0 and tail.read() == b"efghi"
    tail.seek(-2, 2)
    assert tail.read() == b"hi"
    assert PartReader([]).read() == b""


def test_bucket_url() -> None:
    assert bucket_url("s3://b/a/b/", ("s3",)) == ("b", "a/b")
    assert bucket_url("gcs://b", ("gs", "gcs")) == ("b", "")
    for bad in ("s3://", "s3:///x", "gs://b/x"):
        with pytest.raises(ValueError):
            bucket_url(bad, ("s3",))


def test_part_writer_grows_parts_and_bounds_their_count() -> None:
    from checkpointer.storage.parts import PartWriter, part_bytes

    class Recording(PartWriter):
        def __init__(self, **kw):
            super().__init__("mem://f", 4, workers=2, in_flight=2, **kw)
            self.sizes: dict[int, int] = {}

        def _upload(self, number, offset, part, total):
            self.sizes[number] = part_bytes(part)

        def commit(self):
            self._finish_parts(last_if_empty=False)
            self._close()

        def abort(self):
            self._close()

    writer = Recording(grow_every=2)
    data = bytes(range(36))
    writer.write_stable([memoryview(data)])
    writer.commit()
    # 4, 4, then 8, 8, then 16 (the last 12 bytes: a short last part)
    assert [writer.sizes[n] for n in sorted(writer.sizes)] == [4, 4, 8, 8, 12]
    capped = Recording(max_parts=3)
    with pytest.raises(OSError, match="more than 3 parts: raise part_size"):
        capped.write([memoryview(data)])
    capped.abort()
    exactly = Recording(max_parts=3)  # the limit itself is allowed (S3 takes part 10,000)
    exactly.write([memoryview(data[:12])])
    exactly.commit()
    assert [exactly.sizes[n] for n in sorted(exactly.sizes)] == [4, 4, 4]


def test_backoff_jitter_leaves_the_global_random_alone():
    """A job that seeds ``random`` gets the same numbers whether or not a transfer retried."""
    import random

    from checkpointer.storage.retry import RetryPolicy

    random.seed(1234)
    want = [random.random() for _ in range(3)]
    random.seed(1234)
    delays = [RetryPolicy(retries=3).delay(n) for n in (1, 2, 3)]
    assert [random.random() for _ in range(3)] == want
    assert 0.125 <= delays[0] <= 0.25 and 0.5 <= delays[2] <= 1.0
