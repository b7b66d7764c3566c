"""Conditional creates (the save lock) on S3 and GCS, through a loopback proxy that makes the
stores' conditions atomic (see ``FaultProxy``): one caller creates the file, every other one
gets ``FileExistsError``, also after a lost answer."""

from __future__ import annotations

import threading

import pytest

from checkpointer.storage.gcs import GCSStorage
from checkpointer.storage.s3 import S3Storage
from storage_servers import FAST, GCS_BUCKET, S3_BUCKET, unique


def _store_behind_conditional_proxy(kind_, request, fault_proxy, monkeypatch):
    """An S3 or GCS store whose requests pass a proxy that makes conditional creates atomic."""
    request.getfixturevalue("loopback_env")
    upstream = request.getfixturevalue("moto_endpoint" if kind_ == "s3" else "gcs_endpoint")
    proxy = fault_proxy(upstream, conditional=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if kind_ == "s3" else "STORAGE_EMULATOR_HOST", proxy.url)
    url = f"s3://{S3_BUCKET}/{unique()}" if kind_ == "s3" else f"gs://{GCS_BUCKET}/{unique()}"
    return (S3Storage if kind_ == "s3" else GCSStorage)(url, retry=FAST), proxy


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
