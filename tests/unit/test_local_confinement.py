"""storage/local.py under files that change while they are read (issue 26, items 3-5): reads go
through the descriptor that was checked, a pinned view keeps reading the file it first opened,
and a link swapped between an inside and an outside target never yields outside bytes."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from checkpointer.storage import local as local_module
from checkpointer.storage.base import FileChangedError
from checkpointer.storage.local import PINNED_FILES, LocalStorage
from checkpointer.storage.open_files import OpenFiles

INSIDE = b"inside " * 512
OUTSIDE = b"OUTSIDE" * 512


@pytest.fixture
def root(tmp_path) -> str:
    d = tmp_path / "ckpt"
    (d / "blobs").mkdir(parents=True)
    (d / "blobs" / "r0").write_bytes(INSIDE)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "r0").write_bytes(OUTSIDE)
    return str(d)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_once_settled(expected: int) -> int:
    """The open file count, given up to 2 s to reach ``expected``: a thread an earlier test left
    (a lock's heartbeat writing its beat file) may hold a file for a moment."""
    deadline = time.monotonic() + 2.0
    while (count := open_fds()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def read_all(storage: LocalStorage, name: str) -> bytes:
    buf = bytearray(storage.size(name))
    storage.read_into(name, [(0, memoryview(buf))])
    return bytes(buf)


# ---------------------------------------------------------------------------------------------
# A pinned view reads the file it first opened
# ---------------------------------------------------------------------------------------------


def test_a_pinned_view_keeps_reading_the_file_it_opened(root, tmp_path):
    path = os.path.join(root, "f")
    with open(path, "wb") as f:
        f.write(INSIDE)
    plain = LocalStorage(root)
    view = plain.pinned()
    assert view.pinned() is view and view.url == plain.url
    assert view.size("f") == len(INSIDE) and view.read("f", 0, 7) == b"inside "
    other = tmp_path / "other"
    other.write_bytes(OUTSIDE + b"longer")
    os.replace(other, path)  # another save's file renamed over it
    assert view.read("f") == INSIDE and read_all(view, "f") == INSIDE and view.size("f") == len(INSIDE)
    assert plain.read("f") == OUTSIDE + b"longer"  # a plain storage reads what is there now
    assert plain.pinned().read("f", 0, 7) == b"OUTSIDE"  # a new view: a new reader


def _view_that_closed_a(root: str):
    """A pinned view of files ``a`` and ``b`` that keeps one open: it read ``a``, then ``b``, which closed ``a``."""
    for name in ("a", "b"):
        with open(os.path.join(root, name), "wb") as f:
            f.write(INSIDE)
    view = LocalStorage(root).pinned()
    view._files = OpenFiles(limit=1)
    assert view.read("a", 0, 6) == b"inside"
    assert view.read("b", 0, 6) == b"inside"  # closes a
    return view


def test_a_file_opened_again_must_be_the_first_one(root, tmp_path):
    """Past its limit a view closes the least recently used file; one opened again under the
    same name that is not the same file is refused, never read."""
    view = _view_that_closed_a(root)
    assert view.read("a", 0, 6) == b"inside"  # the same file: fine (closes b)
    other = tmp_path / "other"
    other.write_bytes(INSIDE)  # the same bytes, another file
    os.replace(other, os.path.join(root, "b"))
    with pytest.raises(FileChangedError, match="not the file first opened under this name"):
        view.read("b", 0, 6)
    with open(os.path.join(root, "a"), "ab") as f:
        f.write(b"more")  # rewritten in place: open now, so read as it is
    assert view.read("a", len(INSIDE)) == b"more"


def test_a_file_rewritten_in_place_while_closed_is_refused_when_opened_again(root):
    """The same inode is not enough: a file whose size or modification time changed while the
    view had it closed is another file's bytes under the old name, and is refused."""
    view = _view_that_closed_a(root)
    inode = os.stat(os.path.join(root, "a")).st_ino
    with open(os.path.join(root, "a"), "r+b") as f:
        f.write(OUTSIDE)  # the same inode and size, other bytes, a later modification time
    os.utime(os.path.join(root, "a"), ns=(time.time_ns() + 10**9,) * 2)
    assert os.stat(os.path.join(root, "a")).st_ino == inode
    with pytest.raises(FileChangedError, match="not the file first opened under this name"):
        view.read("a", 0, 7)


def test_a_file_cut_short_under_a_reader_is_a_file_changed_error(root):
    path = os.path.join(root, "f")
    with open(path, "wb") as f:
        f.write(INSIDE)
    view = LocalStorage(root).pinned()
    assert view.size("f") == len(INSIDE)
    os.truncate(path, 100)
    with pytest.raises(FileChangedError, match="truncated") as err:
        view.read_into("f", [(0, memoryview(bytearray(200)))])
    assert path in str(err.value)
    assert isinstance(err.value, OSError)


def test_a_pinned_view_holds_a_bounded_number_of_files_and_closes_them(root):
    for i in range(PINNED_FILES + 20):
        with open(os.path.join(root, f"f{i}"), "wb") as f:
            f.write(b"x")
    gc.collect()  # views of earlier tests, closed when collected
    before = open_fds()
    view = LocalStorage(root).pinned()
    for i in range(PINNED_FILES + 20):
        assert view.read(f"f{i}") == b"x"
    assert fds_once_settled(before + PINNED_FILES) - before == PINNED_FILES
    view.close()
    assert fds_once_settled(before) == before
    assert view.read("f0") == b"x" and fds_once_settled(before) == before  # still readable, nothing kept
    view = LocalStorage(root).pinned()
    view.read("f1")
    assert fds_once_settled(before + 1) == before + 1
    del view
    gc.collect()
    assert fds_once_settled(before) == before  # dropped: closed


def test_threads_share_a_pinned_view(root):
    names = [f"f{i}" for i in range(8)]
    for i, name in enumerate(names):
        with open(os.path.join(root, name), "wb") as f:
            f.write(bytes([i]) * 4096)
    view = LocalStorage(root).pinned()
    view._files = OpenFiles(limit=2)  # files closed and opened again while other threads read them
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for j in range(300):
                i = (j * (k + 1)) % len(names)
                buf = bytearray(4096)
                view.read_into(names[i], [(0, memoryview(buf))])
                assert buf == bytes([i]) * 4096
        except BaseException as ex:  # noqa: BLE001 - reported below
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Reads go through the descriptor that was checked
# ---------------------------------------------------------------------------------------------


def test_a_directory_swapped_for_a_link_after_the_check_is_refused(root, tmp_path, monkeypatch):
    """Between resolving ``blobs/r0`` (inside) and opening it, ``blobs`` becomes a link to a
    directory outside: the kernel says where the descriptor leads, and it is refused unread."""
    storage = LocalStorage(root)
    real_open = os.open
    swapped = []

    def open_after_a_swap(path, flags, *args, **kwargs):
        if not swapped and path.endswith(os.path.join("blobs", "r0")):
            swapped.append(path)
            os.rename(os.path.join(root, "blobs"), os.path.join(root, "blobs.old"))
            os.symlink(str(tmp_path / "outside"), os.path.join(root, "blobs"))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local_module.os, "open", open_after_a_swap)
    with pytest.raises(PermissionError, match="outside|changed while it was opened") as err:
        storage.read("blobs/r0")
    assert swapped and "blobs/r0" in str(err.value)


def test_a_final_component_swapped_for_a_link_after_the_check_is_refused(root, tmp_path, monkeypatch):
    storage = LocalStorage(root)
    real_open = os.open

    def open_after_a_swap(path, flags, *args, **kwargs):
        if path.endswith(os.path.join("blobs", "r0")) and not os.path.islink(path):
            os.replace(path, path + ".old")
            os.symlink(str(tmp_path / "outside" / "r0"), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local_module.os, "open", open_after_a_swap)
    for call in (lambda: storage.read("blobs/r0"), lambda: storage.size("blobs/r0"), lambda: read_all(storage, "blobs/r0")):
        with pytest.raises(PermissionError, match="blobs/r0"):
            call()


def test_without_procfs_the_opened_file_is_checked_by_its_inode(root, tmp_path, monkeypatch):
    real_readlink = os.readlink

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(local_module.os, "readlink", no_proc)
    monkeypatch.setattr("checkpointer.storage.open_files.os.readlink", no_proc)
    storage = LocalStorage(root)
    os.symlink("blobs/r0", os.path.join(root, "link"))
    assert storage.read("link") == INSIDE and storage.read("blobs/r0") == INSIDE
    test_a_directory_swapped_for_a_link_after_the_check_is_refused(root, tmp_path, monkeypatch)


@pytest.mark.timeout(60)
def test_a_link_swapped_in_a_loop_never_yields_outside_bytes(root, tmp_path):
    """A thread swaps ``r0`` between a link inside and one outside; every read returns the
    inside bytes or raises an OSError naming ``r0``. (Before: a check of the path, then an open
    of the path, and about one read in a hundred returned the outside bytes.)"""
    link = os.path.join(root, "r0")
    os.symlink("blobs/r0", link)
    stop = threading.Event()

    def swap() -> None:
        i = 0
        while not stop.is_set():
            tmp = f"{link}.tmp"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink("blobs/r0" if i % 2 else str(tmp_path / "outside" / "r0"), tmp)
            os.replace(tmp, link)
            i += 1

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    storage = LocalStorage(root)
    seen = {"inside": 0, "refused": 0}
    deadline = time.monotonic() + 30
    try:
        n = 0
        # At least 3000 reads, and on until the race has gone both ways (a loaded machine can
        # starve the swapping thread: a short sleep now and then hands it the GIL).
        while (n < 3000 or not (seen["inside"] and seen["refused"])) and time.monotonic() < deadline:
            n += 1
            if n % 100 == 0:
                time.sleep(0.001)
            try:
                data = storage.read("r0") if n % 2 else read_all(storage, "r0")
            except OSError as ex:
                assert "r0" in str(ex), ex
                seen["refused"] += 1
                continue
            assert data == INSIDE, f"read {data[:7]!r} after {n} reads"
            seen["inside"] += 1
    finally:
        stop.set()
        thread.join()
    assert seen["inside"] and seen["refused"], seen  # the race ran both ways


# ---------------------------------------------------------------------------------------------
# Parts of a checkpoint read nothing outside it
# ---------------------------------------------------------------------------------------------


def test_a_part_reads_nothing_outside_its_checkpoint(tmp_path):
    top = tmp_path / "top"
    top.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metadata.json").write_bytes(b"{}")
    (top / "inside").mkdir()
    (top / "inside" / "metadata.json").write_bytes(b"{}")
    os.symlink(str(tmp_path / "elsewhere"), top / "model")
    os.symlink("inside", top / "optim")
    storage = LocalStorage(str(top))
    model, optim = storage.part("model"), storage.part("optim")
    assert optim.read("metadata.json") == b"{}" and optim.list() == ["metadata.json"]
    assert not model.exists("metadata.json") and model.list() == []
    for call in (lambda: model.read("metadata.json"), lambda: model.size("metadata.json")):
        with pytest.raises(PermissionError, match=f"outside {top}"):
            call()
    # The directory itself, given as the root, is the user's choice: read wherever it is.
    assert storage.child("model").read("metadata.json") == b"{}"
    assert LocalStorage(str(top / "model")).read("metadata.json") == b"{}"


# ---------------------------------------------------------------------------------------------
# Only regular files are read
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_a_fifo_or_a_directory_is_refused_naming_it_by_every_call(root, make):
    """Where a rank file should be: an error naming it, from ``size`` as from the reads, not a
    size of 0 (a FIFO) or of the directory's blocks, nor a read's bare ESPIPE or EISDIR."""
    make(os.path.join(root, "blobs", "odd"))
    storage = LocalStorage(root)
    calls = [
        lambda view: view.size("blobs/odd"),
        lambda view: view.read("blobs/odd"),
        lambda view: view.read_into("blobs/odd", [(0, memoryview(bytearray(1)))]),
    ]
    for view in (storage, storage.pinned()):
        for call in calls:
            with pytest.raises(OSError, match=f"{root}/blobs/odd is not a regular file"):
                call(view)


def test_a_sibling_whose_name_extends_the_root_is_outside_it(tmp_path):
    """``/x/ckpt-old`` is not inside ``/x/ckpt``: a link there is refused like any outside one."""
    root = tmp_path / "ckpt"
    root.mkdir()
    sibling = tmp_path / "ckpt-old"
    sibling.mkdir()
    (sibling / "r0").write_bytes(OUTSIDE)
    os.symlink(sibling / "r0", root / "r0")
    os.symlink(sibling, root / "model")
    storage = LocalStorage(str(root))
    for call in (lambda: storage.read("r0"), lambda: storage.size("r0"), lambda: storage.part("model").read("r0")):
        with pytest.raises(PermissionError, match=f"outside {root}"):
            call()
    assert not storage.exists("r0") and storage.part("model").list() == []
