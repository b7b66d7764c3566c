"""Conditional requests on S3 and GCS, through a loopback proxy that makes the stores'
conditions atomic and answers GCS downloads as GCS does (see ``FaultProxy``).

- Conditional creates (the save lock): one caller creates the file, every other one gets
  ``FileExistsError``, also after a lost answer.
- Conditional reads (a load's pinned view): an object replaced after the view first read it is
  ``FileChangedError``, never the other object's bytes.
"""

from __future__ import annotations

import threading
import urllib.parse

import pytest

from checkpointer.storage.base import FileChangedError
from checkpointer.storage.gcs import GCSStorage
from checkpointer.storage.s3 import MIN_PART, S3Storage
from storage_servers import FAST, GCS_BUCKET, S3_BUCKET, unique


def _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch, **options):
    """An S3 or GCS store whose requests pass a proxy that makes conditional creates atomic."""
    request.getfixturevalue("loopback_env")
    upstream = request.getfixturevalue("moto_endpoint" if kind_ == "s3" else "gcs_endpoint")
    proxy = fault_proxy(upstream, conditional=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if kind_ == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    url = f"s3://{S3_BUCKET}/{unique()}" if kind_ == "s3" else f"gs://{GCS_BUCKET}/{unique()}"
    return (S3Storage if kind_ == "s3" else GCSStorage)(url, retry=FAST, **options), proxy


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_conditional_create_has_one_winner_when_all_start_at_once(kind_, request, fault_proxy, monkeypatch) -> None:
    """Every caller passes the check before the request (as when they start in the same
    instant); the store's condition alone then decides: one file, one winner. The proxy makes
    the condition atomic as the real stores do (see ``FaultProxy``)."""
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch)
    monkeypatch.setattr(type(store), "exists", lambda self, name: False)
    n = 6
    gate = threading.Barrier(n)
    results: list[object] = [None] * n

    def contend(i: int) -> None:
        gate.wait(10)
        try:
            store.create_exclusive("lock", f"caller {i}".encode())
            results[i] = "won"
        except FileExistsError as e:
            results[i] = e

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, r in enumerate(results) if r == "won"]
    assert len(winners) == 1 and all(isinstance(r, FileExistsError) for r in results if r != "won"), results
    assert store.read("lock") == f"caller {winners[0]}".encode()
    sent = [e for e in proxy.seen if e.method in ("PUT", "POST")]
    if kind_ == "s3":
        assert all(e.headers.get("If-None-Match") == "*" for e in sent)
    else:
        assert all("ifGenerationMatch=0" in e.path for e in sent)


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_conditional_create_retried_after_a_lost_answer_knows_its_own_file(kind_, request, fault_proxy,
                                                                            monkeypatch) -> None:
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch)
    lost = proxy.fail(1, "lost", method="PUT" if kind_ == "s3" else "POST", path="lock")
    store.create_exclusive("lock", b"mine")  # created, answer lost; the retry's 412 finds our bytes
    assert lost.fired == 1 and store.read("lock") == b"mine"
    with pytest.raises(FileExistsError):
        store.create_exclusive("lock", b"someone else")


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_conditional_create_of_the_same_bytes_loses_to_the_first(kind_, request, fault_proxy, monkeypatch) -> None:
    """Two callers create the lock with the same bytes, both past the check before the request:
    the second's refusal (412) at its first attempt is someone else's file, not its own
    earlier attempt, even though the bytes match."""
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch)
    monkeypatch.setattr(type(store), "exists", lambda self, name: False)
    store.create_exclusive("lock", b"same bytes")
    with pytest.raises(FileExistsError, match="lock"):
        store.create_exclusive("lock", b"same bytes")


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_conditional_create_after_a_lost_answer_does_not_take_someone_elses_file(kind_, request, fault_proxy,
                                                                                monkeypatch) -> None:
    """The first attempt is refused (the lock is someone else's) and that answer is lost: the
    retry's 412 finds other bytes in the file, so the caller does not hold the lock."""
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch)
    store.write("lock", b"theirs")
    monkeypatch.setattr(type(store), "exists", lambda self, name: False)
    lost = proxy.fail(1, "lost", method="PUT" if kind_ == "s3" else "POST", path="lock")
    with pytest.raises(FileExistsError, match="lock"):
        store.create_exclusive("lock", b"mine")
    assert lost.fired == 1 and store.read("lock") == b"theirs"


@pytest.mark.parametrize("first", ["size", "read", "read_into"])
@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_pinned_view_refuses_an_object_replaced_after_it_first_read_it(kind_, first, request, fault_proxy,
                                                                         monkeypatch) -> None:
    """Another save replaces the object between a load's first look at it (its size, its header)
    and its later reads. Before: the later reads returned the new object's bytes, mixing two
    saves in one load."""
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch)
    store.write("f", b"a" * 1000)
    view = store.pinned()
    assert view.pinned() is view and view.url == store.url
    if first == "size":
        assert view.size("f") == 1000
    elif first == "read":
        assert view.read("f", 0, 10) == b"a" * 10
    else:
        buf = bytearray(10)
        view.read_into("f", [(990, memoryview(buf))])
        assert buf == b"a" * 10
    first_seen = len(proxy.seen)
    view.read("f", 0, 10)
    reads = [e for e in proxy.seen[first_seen:] if e.method in ("GET", "HEAD")
             and urllib.parse.unquote(e.path.split("?")[0]).endswith("/f") and "/storage/v1/" not in e.path[:12]]
    conditions = [("If-Match" in e.headers) if kind_ == "s3" else ("ifGenerationMatch=" in e.path) for e in reads]
    assert conditions and all(conditions), reads  # each read after the first names the version it wants
    store.write("f", b"b" * 1000)
    seen = len(proxy.seen)
    for again in (lambda: view.read("f", 0, 10), lambda: view.read("f"),
                  lambda: view.read_into("f", [(0, memoryview(bytearray(10)))]), lambda: view.size("f")):
        with pytest.raises(FileChangedError, match="replaced while it was read") as err:
            again()
        assert store.join("f") in str(err.value)
    assert len(proxy.seen) > seen  # asked the store each time (nothing cached)
    assert store.read("f", 0, 10) == b"b" * 10  # the storage itself reads what is there now
    assert store.pinned().read("f", 0, 10) == b"b" * 10  # as does a new view
    store.write("g", b"c" * 10)
    assert view.read("g") == b"c" * 10  # other objects: pinned when first read


@pytest.mark.parametrize("kind_", ["s3", "gcs"])
def test_a_pinned_view_is_shared_by_its_threads_and_its_children(kind_, request, fault_proxy, monkeypatch) -> None:
    """The parallel range GETs of one ``read_into`` and a child view pin the same version."""
    part_size = MIN_PART if kind_ == "s3" else 256 * 1024
    store, proxy = _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch, part_size=part_size)
    sub = store.child("d")
    size = 3 * store.part_size + 5
    sub.write("f", bytes(size))
    view = store.pinned()
    buf = bytearray(size)
    view.child("d").read_into("f", [(0, memoryview(buf))])  # several GETs, in parallel
    assert buf == bytes(size)
    sub.write("f", b"x" * size)
    with pytest.raises(FileChangedError):
        view.child("d").read("f", 0, 1)
    with pytest.raises(FileChangedError):
        view.read("d/f", 0, 1)
