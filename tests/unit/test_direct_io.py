"""storage/direct.py: O_DIRECT writes through aligned buffers give exactly the bytes written,
use O_DIRECT for whole blocks where the file system takes it, and fall back to ordinary writes
where it does not; a failed write reaches the caller and leaves no temp file or thread."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointer.storage import direct
from checkpointer.storage.direct import BLOCK_BYTES, DirectStream, direct_io_enabled
from checkpointer.storage.local import LocalStorage, LocalWriter

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")

SIZES = [0, 1, 4095, 4096, 4097, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 2 * BLOCK_BYTES + 4096 + 3]


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed + i // 4099) % 256 for i in range(n)) if n < 4096 else os.urandom(n)


def write_through(path: str, parts: list[bytes], direct_io: bool = True) -> LocalWriter:
    writer = LocalWriter(path, direct=direct_io)
    writer.write([memoryview(p) for p in parts])
    writer.commit()
    return writer


def assert_holds(path: str, data: bytes) -> None:
    with open(path, "rb") as f:
        assert f.read() == data


def hidden(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".")]


@pytest.mark.parametrize("size", SIZES)
def test_one_write_of_any_size_round_trips(tmp_path, size):
    data = pattern(size)
    path = str(tmp_path / "f")
    writer = write_through(path, [data])
    assert writer.stream is not None
    assert_holds(path, data)
    assert hidden(tmp_path) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 65536, 1 << 20, 3 << 20, BLOCK_BYTES - 5, BLOCK_BYTES + 9]), max_size=6))
def test_many_writes_round_trip(tmp_path, sizes):
    parts = [pattern(n, seed=i) for i, n in enumerate(sizes)]
    path = str(tmp_path / "many")
    write_through(path, parts)
    assert_holds(path, b"".join(parts))


def test_whole_blocks_are_written_with_o_direct(tmp_path, monkeypatch, takes_o_direct):
    """Every aligned write goes out with O_DIRECT set on the descriptor (where this file system
    takes it); only the last, partial block is written without."""
    probed = takes_o_direct(str(tmp_path))  # before os.pwrite is patched below
    seen: list[tuple[int, int, bool]] = []
    real_pwrite = os.pwrite

    def recording_pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        seen.append((offset, n, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return n

    monkeypatch.setattr(direct.os, "pwrite", recording_pwrite)
    data = os.urandom(2 * BLOCK_BYTES + 8192 + 100)
    path = str(tmp_path / "f")
    writer = write_through(path, [data])
    assert_holds(path, data)
    if not probed:
        pytest.skip("this file system refuses O_DIRECT")
    assert not writer.stream.refused
    assert seen == [
        (0, BLOCK_BYTES, True),
        (BLOCK_BYTES, BLOCK_BYTES, True),
        (2 * BLOCK_BYTES, 8192, True),
        (2 * BLOCK_BYTES + 8192, 100, False),
    ]


def test_fcntl_refusing_o_direct_writes_the_ordinary_way(tmp_path, monkeypatch):
    real_fcntl = fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    data = os.urandom(BLOCK_BYTES * 2 + 17)
    path = str(tmp_path / "f")
    writer = write_through(path, [data])
    assert writer.stream.refused and not writer.stream.direct
    assert_holds(path, data)


def test_a_write_refusing_o_direct_is_written_again_the_ordinary_way(tmp_path, monkeypatch):
    """Some file systems accept O_DIRECT at fcntl and refuse it at write (EINVAL)."""
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    data = os.urandom(BLOCK_BYTES * 3 + 5000)
    path = str(tmp_path / "f")
    writer = write_through(path, [data])
    assert refused == [0] and writer.stream.refused
    assert_holds(path, data)


def test_a_short_write_goes_on_without_o_direct_for_the_unaligned_rest(tmp_path, monkeypatch):
    real_pwrite = os.pwrite
    calls = []

    def short_once(fd, data, offset):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        calls.append((offset, len(data), bool(flags & os.O_DIRECT)))
        if len(calls) > 1:
            return real_pwrite(fd, data, offset)
        # The first write stops after 1000 bytes (written for real, without O_DIRECT, which
        # would refuse an unaligned length).
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        n = real_pwrite(fd, data[:1000], offset)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return n

    monkeypatch.setattr(direct.os, "pwrite", short_once)
    data = os.urandom(BLOCK_BYTES + 10)
    path = str(tmp_path / "f")
    write_through(path, [data])
    assert_holds(path, data)
    assert calls[1] == (1000, BLOCK_BYTES - 1000, False)


def test_a_failing_write_reaches_the_caller_and_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC in the background thread is raised at the next write or at commit; the temp file
    is removed and the thread has ended."""
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if offset >= BLOCK_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", full)
    path = str(tmp_path / "f")
    with pytest.raises(OSError) as info:
        with LocalWriter(path, direct=True) as writer:
            for _ in range(4):
                writer.write([memoryview(os.urandom(BLOCK_BYTES))])
            writer.commit()
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpointer-write")]


def test_abort_mid_write_removes_the_temp_file(tmp_path):
    path = str(tmp_path / "f")
    with LocalWriter(path, direct=True) as writer:
        writer.write([memoryview(os.urandom(2 * BLOCK_BYTES + 1))])
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpointer-write")]


def test_buffered_and_direct_files_are_the_same(tmp_path):
    parts = [pattern(n, seed=n) for n in (100, BLOCK_BYTES + 3, 4096, 1 << 20)]
    write_through(str(tmp_path / "a"), parts, direct_io=True)
    write_through(str(tmp_path / "b"), parts, direct_io=False)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"".join(parts)


@pytest.mark.parametrize("value, expected", [("0", False), ("", False), ("1", True), (None, True)])
def test_checkpointer_direct_io_switch(tmp_path, monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CHECKPOINTER_DIRECT_IO", raising=False)
    else:
        monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", value)
    assert direct_io_enabled() is expected
    storage = LocalStorage(str(tmp_path))
    writer = storage.open_writer("x")
    try:
        assert (writer.stream is not None) is expected
    finally:
        writer.abort()


def test_stream_alone_appends_from_offset_zero(tmp_path):
    path = str(tmp_path / "raw")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        stream = DirectStream(fd, path)
        data = os.urandom(BLOCK_BYTES + 4096 * 3 + 1)
        stream.write([memoryview(data)[:5], memoryview(data)[5:]])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, data)


def test_writes_run_in_parallel_within_depth_buffers(tmp_path, monkeypatch):
    """After the first block, up to DEPTH - 1 blocks are written at once while the caller fills
    another buffer, and no more than DEPTH buffers are ever allocated."""
    real_pwrite = os.pwrite
    lock = threading.Lock()
    in_flight = [0]
    most = [0]

    def slow_pwrite(fd, data, offset):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            if offset:
                threading.Event().wait(0.05)  # a slow disk: the caller runs ahead
            return real_pwrite(fd, data, offset)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(direct.os, "pwrite", slow_pwrite)
    blocks = 3 * direct.DEPTH
    data = os.urandom(blocks * BLOCK_BYTES + 123)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        stream = DirectStream(fd, path)
        allocated = []
        for i in range(blocks):
            stream.write([memoryview(data)[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]])
            allocated.append(len(stream._buffers))
        stream.write([memoryview(data)[blocks * BLOCK_BYTES :]])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, data)
    assert most[0] == direct.DEPTH - 1, most[0]
    assert max(allocated) == direct.DEPTH, allocated
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpointer-write")]


def test_a_short_write_in_a_writer_thread_is_finished_once_nothing_is_in_flight(tmp_path, monkeypatch, takes_o_direct):
    """A block written in parallel that stops short leaves its unaligned rest to the caller, who
    writes it without O_DIRECT after the other writes end; later blocks use O_DIRECT again."""
    probed = takes_o_direct(str(tmp_path))
    real_pwrite = os.pwrite
    calls: list[tuple[int, int, bool]] = []
    lock = threading.Lock()

    def short_at_block_two(fd, data, offset):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        with lock:
            calls.append((offset, len(data), bool(flags & os.O_DIRECT)))
        if offset == 2 * BLOCK_BYTES and len(data) == BLOCK_BYTES:
            # 1000 bytes land (written for real without O_DIRECT through a second descriptor,
            # leaving this one's flags alone while other writes are in flight).
            other = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
            try:
                return real_pwrite(other, data[:1000], offset)
            finally:
                os.close(other)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", short_at_block_two)
    data = os.urandom(8 * BLOCK_BYTES + 4096 + 7)
    path = str(tmp_path / "f")
    writer = write_through(path, [data])
    assert_holds(path, data)
    rest = [c for c in calls if c[0] == 2 * BLOCK_BYTES + 1000]
    assert rest == [(2 * BLOCK_BYTES + 1000, BLOCK_BYTES - 1000, False)], calls
    if probed:
        assert not writer.stream.refused
        late = [c for c in calls if c[0] >= 4 * BLOCK_BYTES and c[1] == BLOCK_BYTES]
        assert late and all(direct_on for _, _, direct_on in late), calls


# Writes straight from the caller's memory (write_stable)


def aligned_source(n: int, remainder: int) -> tuple[mmap.mmap, memoryview]:
    """``n`` bytes at an address that leaves ``remainder`` modulo 4096 (page-aligned mmap +
    remainder): 32-bit words counting up from a random start, so that no two 4-byte words of a
    source, and almost surely of two sources, are equal (cheaper than random bytes)."""
    buf = mmap.mmap(-1, n + remainder + 4096)
    view = memoryview(buf)[remainder : remainder + n]
    words = np.arange(-(-n // 4), dtype=np.uint32)
    words += np.uint32(int.from_bytes(os.urandom(4), "little"))  # wraps around past 2**32 - 1
    view[:] = words.view(np.uint8)[:n]
    return buf, view


def recorded_stream(
    path: str, monkeypatch, most_in_flight: list[int] | None = None
) -> tuple[int, DirectStream, list[tuple[int, int, bool, int]]]:
    """A stream on a new file whose pwrites are recorded: (offset, length, O_DIRECT on, address).
    With ``most_in_flight``, writes after the first are slowed down and the most at once is kept."""
    real_pwrite = os.pwrite
    seen: list[tuple[int, int, bool, int]] = []
    lock = threading.Lock()
    in_flight = [0]

    def recording(fd, data, offset):
        view = memoryview(data)
        address = direct._address(view) if not view.readonly else -1
        with lock:
            in_flight[0] += 1
            if most_in_flight is not None:
                most_in_flight[0] = max(most_in_flight[0], in_flight[0])
        try:
            if most_in_flight is not None and offset:
                threading.Event().wait(0.05)  # a slow disk: the caller runs ahead
            n = real_pwrite(fd, data, offset)
        finally:
            with lock:
                in_flight[0] -= 1
        with lock:
            seen.append((offset, n, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), address))
        return n

    monkeypatch.setattr(direct.os, "pwrite", recording)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    return fd, DirectStream(fd, path), seen


def test_dio_alignment_is_one_o_direct_takes(tmp_path, takes_o_direct):
    """The alignment statx reports (4096 without it) works for an address and an offset that
    are odd multiples of it; where a smaller one would not, O_DIRECT refuses."""
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        align = direct.dio_alignment(fd)
        assert BLOCK_BYTES % align == 0 and align >= 512
        if not takes_o_direct(str(tmp_path)):
            pytest.skip("this file system refuses O_DIRECT")
        span = max(align, 4096)  # a write within one page may pass unaligned
        buf, view = aligned_source(2 * span + align, align if align < 4096 else 0)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        assert os.pwrite(fd, view[: 2 * span], align) == 2 * span
        with pytest.raises(OSError) as info:
            os.pwrite(fd, view[align // 2 : align // 2 + span], 0)  # half the alignment off
        assert info.value.errno == errno.EINVAL
        view.release()
        buf.close()
    finally:
        os.close(fd)


def test_write_alignment_is_the_file_systems_block_where_that_is_larger(tmp_path):
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        align, block = direct.write_alignment(fd), os.fstat(fd).st_blksize
        assert align % direct.dio_alignment(fd) == 0 and BLOCK_BYTES % align == 0
        if block <= 64 << 10 and block & (block - 1) == 0:
            assert align == max(block, direct.dio_alignment(fd))
    finally:
        os.close(fd)


@pytest.mark.parametrize("block", [0, 3000, 1 << 20])
def test_a_block_size_that_is_none_odd_or_a_transfer_size_leaves_the_o_direct_alignment(tmp_path, monkeypatch, block):
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        expected = direct.dio_alignment(fd)
        monkeypatch.setattr(direct.os, "fstat", lambda _fd: types.SimpleNamespace(st_blksize=block))
        assert direct.write_alignment(fd) == expected
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_every_o_direct_write_starts_and_ends_on_a_file_system_block(tmp_path, monkeypatch, takes_o_direct):
    """ext4 runs a write that starts or ends inside a block alone, after every write in flight:
    a save of buffers whose addresses agree with their offsets only modulo 512 never sends one."""
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    path = str(tmp_path / "f")
    fd, stream, seen = recorded_stream(path, monkeypatch)
    block = os.fstat(fd).st_blksize
    if block > 64 << 10 or block & (block - 1) or block <= direct.dio_alignment(fd):
        os.close(fd)
        pytest.skip(f"the file system's block ({block}) is no coarser than O_DIRECT's alignment")
    lead = os.urandom(512)
    sources = [aligned_source(2 * direct.PIECE_BYTES + 512, 1024) for _ in range(3)]  # 512 off a block
    try:
        stream.write([memoryview(lead)])
        for _, view in sources:
            stream.write_stable([view])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, lead + b"".join(bytes(view) for _, view in sources))
    direct_writes = [(o, n) for o, n, on, _ in seen if on]
    assert sum(n for _, n in direct_writes) > 5 * direct.PIECE_BYTES
    assert all(o % block == 0 and n % block == 0 for o, n in direct_writes), direct_writes
    for buf, view in sources:
        view.release()
        buf.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 100, 4096, (1 << 20) + 7, BLOCK_BYTES + 512, direct.MIN_FROM_SOURCE, 17 << 20]),
            st.sampled_from([0, 64, 448, 512, 1024, 4032]),
            st.booleans(),
        ),
        max_size=5,
    )
)
def test_stable_writes_round_trip_and_go_from_memory_where_aligned(tmp_path_factory, parts):
    """Any mix of copied and stable writes, at any address: the file holds exactly the bytes.
    A stable buffer of at least MIN_FROM_SOURCE whose address agrees with its file offset is
    written from its own memory, all but the unaligned ends; any other is copied."""
    path = str(tmp_path_factory.mktemp("stable") / "f")
    sources = [aligned_source(n, r) for n, r, _ in parts]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        stream = DirectStream(fd, path)
        expected_from_source = 0
        for (n, _, stable), (_, view) in zip(parts, sources):
            if not stable:
                stream.write([view])
                continue
            position = stream.position
            address = direct._address(view) if n else None
            if n >= direct.MIN_FROM_SOURCE and (address - position) % stream.align == 0:
                head = -position % stream.align
                expected_from_source += (n - head) // stream.align * stream.align
            stream.write_stable([view])
        stream.finish()
        assert stream.from_source == expected_from_source
        assert stream.copied == sum(n for n, _, _ in parts) - expected_from_source
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(view) for _, view in sources)
    for buf, view in sources:
        view.release()
        buf.close()


def test_an_aligned_stable_buffer_is_written_from_its_memory_in_pieces(tmp_path, monkeypatch, takes_o_direct):
    """The unaligned head is copied and written with the bytes before it; the aligned middle
    goes out from the buffer's own addresses, PIECE_BYTES at a time, at most DEPTH - 1 at once
    and with no buffer of the stream's own for it; the tail is copied."""
    path = str(tmp_path / "f")
    most = [0]
    fd, stream, seen = recorded_stream(path, monkeypatch, most)
    lead = os.urandom(1000)
    n = 6 * direct.PIECE_BYTES + 5000
    buf, view = aligned_source(n, 1000 % 4096)  # address agrees with the offset it lands at
    try:
        stream.write([memoryview(lead)])
        stream.write_stable([view])
        done_at_return = len(seen)  # the caller is held back: no queue of writes builds up
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, lead + bytes(view))
    assert len(seen) - done_at_return <= direct.DEPTH - 1 + 1  # + the tail's, at finish
    align = stream.align
    head = -1000 % align
    body = (n - head) // align * align
    assert stream.from_source == body and stream.copied == 1000 + n - body
    base = direct._address(view)
    from_memory = sorted((o, length) for o, length, _, a in seen if base <= a < base + n)
    starts = [1000 + head + i * direct.PIECE_BYTES for i in range(-(-body // direct.PIECE_BYTES))]
    assert [o for o, _ in from_memory] == starts
    assert sum(length for _, length in from_memory) == body
    assert len(stream._buffers) <= 2  # the head's buffer and the tail's: nothing for the middle
    assert most[0] == direct.DEPTH - 1, most[0]
    if takes_o_direct(str(tmp_path)):
        assert all(on for o, _, on, a in seen if base <= a < base + n)
    view.release()
    buf.close()


def test_a_misaligned_stable_buffer_is_copied(tmp_path, monkeypatch):
    """As is an aligned one under MIN_FROM_SOURCE (the round-trip test above counts both)."""
    path = str(tmp_path / "f")
    fd, stream, seen = recorded_stream(path, monkeypatch)
    buf, view = aligned_source(2 * direct.MIN_FROM_SOURCE, 64)  # lands at offset 0: 64 bytes off
    try:
        stream.write_stable([view])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, bytes(view))
    assert stream.from_source == 0 and stream.copied == 2 * direct.MIN_FROM_SOURCE
    base = direct._address(view)
    assert not [s for s in seen if base <= s[3] < base + len(view)]
    view.release()
    buf.close()


def test_a_refusal_at_the_first_write_from_memory_is_written_the_ordinary_way(tmp_path, monkeypatch, takes_o_direct):
    """A file system that takes O_DIRECT from the stream's page-aligned buffers but not from the
    caller's memory: the first write from memory runs in the caller's thread, is refused, and
    everything from then on is written without O_DIRECT, the same bytes."""
    real_pwrite = os.pwrite
    refused = []
    source: list[int] = []

    def picky(fd, data, offset):
        view = memoryview(data)
        address = direct._address(view) if not view.readonly else -1
        if source and source[0] <= address < source[1] and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append((offset, threading.current_thread() is threading.main_thread()))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", picky)
    path = str(tmp_path / "f")
    buf, view = aligned_source(2 * direct.PIECE_BYTES, 0)
    source[:] = [direct._address(view), direct._address(view) + len(view)]
    lead = os.urandom(BLOCK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        stream = DirectStream(fd, path)
        stream.write([memoryview(lead)])
        stream.write_stable([view])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, lead + bytes(view))
    if takes_o_direct(str(tmp_path)):
        assert refused == [(BLOCK_BYTES, True)] and stream.refused
    view.release()
    buf.close()


def test_memory_o_direct_refuses_in_a_writer_thread_is_written_the_ordinary_way(tmp_path, monkeypatch, takes_o_direct):
    """One buffer among others whose memory O_DIRECT will not take (EFAULT, as for a mapping it
    cannot pin), written in a writer thread: its bytes are written again without O_DIRECT once
    nothing is in flight, the save goes on, and later writes use O_DIRECT again."""
    probed = takes_o_direct(str(tmp_path))
    real_pwrite = os.pwrite
    odd: list[int] = []
    refused: list[int] = []
    calls: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def picky(fd, data, offset):
        view = memoryview(data)
        address = direct._address(view) if not view.readonly else -1
        on = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        with lock:
            calls.append((offset, on))
        if odd and odd[0] <= address < odd[1] and on:
            with lock:
                refused.append(offset)
            raise OSError(errno.EFAULT, "Bad address")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", picky)
    sources = [aligned_source(2 * direct.PIECE_BYTES, 0) for _ in range(3)]
    odd[:] = [direct._address(sources[1][1]), direct._address(sources[1][1]) + len(sources[1][1])]
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        stream = DirectStream(fd, path)
        for _, view in sources:
            stream.write_stable([view])
        stream.finish()
    finally:
        os.close(fd)
    assert_holds(path, b"".join(bytes(view) for _, view in sources))
    if probed:
        piece = direct.PIECE_BYTES
        assert sorted(refused) == [2 * piece, 3 * piece] and not stream.refused  # two writer threads: either first
        assert stream.from_source == 6 * piece
        assert (2 * piece, False) in calls and (3 * piece, False) in calls  # again, the ordinary way
        assert all(on for offset, on in calls if offset >= 4 * piece)
    for buf, view in sources:
        view.release()
        buf.close()
