"""storage/local.py's writers (and the exclusive create of the save lock) where a crash follows
or a system call does less than asked: a commit has fsynced the file before renaming it into
place and fsynced the directory after (else the rename itself may be lost in a crash, though
the save reported the file written); a short ``writev`` is continued where it stopped; an
``O_DIRECT`` write that writes nothing is an error naming the file, not a loop. The real
system calls run; they are only recorded, in order, or cut short."""

from __future__ import annotations

import errno
import os

import pytest

from checkpointer.storage import direct
from checkpointer.storage.local import LocalStorage, LocalWriter


@pytest.fixture
def root(tmp_path) -> str:
    return os.path.realpath(tmp_path)  # as /proc/self/fd names it


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, ...]]:
    """``fsync`` (with the path its descriptor names), ``rename`` and ``link``, as they happen."""
    seen: list[tuple[str, ...]] = []
    fsync, rename, link = os.fsync, os.rename, os.link

    def recording_fsync(fd):
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_rename(src, dst):
        seen.append(("rename", os.fspath(src), os.fspath(dst)))
        return rename(src, dst)

    def recording_link(src, dst):
        seen.append(("link", os.fspath(src), os.fspath(dst)))
        return link(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    monkeypatch.setattr(os, "link", recording_link)
    return seen


@pytest.mark.parametrize("direct_io", ["0", "1"])
def test_a_commit_fsyncs_the_file_then_renames_it_then_fsyncs_the_directory(root, calls, monkeypatch, direct_io):
    monkeypatch.setenv("CHECKPOINTER_DIRECT_IO", direct_io)
    data = os.urandom((1 << 20) + 3)
    with LocalStorage(root).open_writer("rank_0.safetensors") as writer:
        writer.write([memoryview(data)])
        tmp = writer.tmp
        writer.commit()
    path = os.path.join(root, "rank_0.safetensors")
    assert calls == [("fsync", tmp), ("rename", tmp, path), ("fsync", root)]
    assert open(path, "rb").read() == data and os.listdir(root) == ["rank_0.safetensors"]


def test_an_exclusive_create_fsyncs_the_file_then_links_it_then_fsyncs_the_directory(root, calls):
    LocalStorage(root).create_exclusive(".lock", b'{"token": "x"}')
    path = os.path.join(root, ".lock")
    assert [call[0] for call in calls] == ["fsync", "link", "fsync"]
    (_, tmp), link, last = calls
    assert link == ("link", tmp, path) and last == ("fsync", root)
    assert open(path, "rb").read() == b'{"token": "x"}' and os.listdir(root) == [".lock"]


@pytest.mark.parametrize("cap", [1, 1000, 4096])
@pytest.mark.timeout(60)
def test_a_short_buffered_write_goes_on_where_it_stopped(root, monkeypatch, cap):
    """``writev`` may write fewer bytes than asked (a signal, a file system near full): the rest
    of the buffer it stopped in, and the buffers after it, are written next, each byte once."""
    real, counts = os.writev, []

    def short(fd, buffers):
        out, room = [], cap
        for buf in buffers:
            if room == 0:
                break
            out.append(memoryview(buf)[:room])
            room -= len(out[-1])
        counts.append(real(fd, out))
        return counts[-1]

    monkeypatch.setattr(os, "writev", short)
    parts = [os.urandom(n) for n in (3000, 1, 0, 5000, 4096)]
    path = os.path.join(root, "f")
    with LocalWriter(path, direct=False) as writer:
        writer.write([memoryview(p) for p in parts])
        writer.commit()
    assert open(path, "rb").read() == b"".join(parts) and os.listdir(root) == ["f"]
    assert max(counts) <= cap and sum(counts) == len(b"".join(parts))


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.timeout(60)
def test_a_direct_write_that_writes_nothing_is_an_error_naming_the_file(root, monkeypatch):
    """A ``pwrite`` returning 0 would return 0 again at the same offset: EIO, not a loop."""
    monkeypatch.setattr(direct.os, "pwrite", lambda fd, data, offset: 0)
    path = os.path.join(root, "f")
    with pytest.raises(OSError, match="wrote nothing") as caught:
        with LocalWriter(path, direct=True) as writer:
            writer.write([memoryview(os.urandom(direct.BLOCK_BYTES + 5))])
            writer.commit()
    assert caught.value.errno == errno.EIO and caught.value.filename == path
    assert os.listdir(root) == []
