"""Faults between the ranks and the store, injected by loopback proxies (503s, 401s, dropped connections).

Within the retry budget a save and a load succeed; beyond it (``CHECKPOINTER_IO_RETRIES``)
they fail cleanly: every rank raises, quickly, the failing rank an ``OSError`` naming the
URL, and a save that failed leaves no ``metadata.json`` (an incomplete checkpoint).
"""

from __future__ import annotations

import collections

import pytest
from remote_workers import caught, flat_full, flat_state, load_flat, save_flat

from checkpointer import Checkpointer, IncompleteCheckpointError, latest_checkpoint

FAST_S = 30.0  # "cleanly": far below the library's 300 s timeout and the harness's


def check_all_raised(results, failing_rank: int, url: str) -> None:
    """Every rank raised within seconds; the failing one an OSError naming ``url``, the others naming it."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} raised nothing"
        assert r["seconds"] < FAST_S, f"rank {rank} took {r['seconds']:.1f}s to raise"
        if rank == failing_rank:
            assert "OSError" in r["mro"], f"rank {rank} raised {r['type']}:\n{r['traceback']}"
            assert url in r["msg"] and "attempts" in r["msg"], r["msg"]
        else:
            assert f"rank {failing_rank}" in r["msg"], f"rank {rank}: {r['msg']!r}"
            assert "CheckpointError" in r["mro"] or "OSError" in r["mro"], r["traceback"]


def test_transient_faults_within_the_budget(backend, run_distributed, proxies):
    """The first requests answer 503 (during the save) or drop the connection (during the load)."""
    url = backend.url("ckpt")
    proxy = proxies(backend.endpoint)
    env = backend.env(proxy.url)
    slow_down = proxy.fail(4, "503")
    run_distributed(save_flat, 2, env, url)
    assert slow_down.fired == 4
    assert backend.names(url) == ["metadata.json", "rank_0.safetensors", "rank_1.safetensors"]
    dropped = proxy.fail(4, "drop", method="GET")
    run_distributed(load_flat, 3, env, url)
    assert dropped.fired == 4
    assert [e.status for e in proxy.exchanges].count(None) == 4  # four went unanswered


def test_beyond_the_budget_every_rank_fails_cleanly(backend, run_distributed, proxies, monkeypatch):
    url = backend.url("ckpt")
    # Rank 1's store is down for good; the other ranks' is fine.
    down = proxies(backend.endpoint)
    down.fail(10**6, "503")
    envs = [backend.env(CHECKPOINTER_IO_RETRIES="2") for _ in range(3)]
    envs[1] = backend.env(down.url, CHECKPOINTER_IO_RETRIES="2")
    results = run_distributed(caught, 3, envs, "save_flat", url)
    check_all_raised(results, 1, f"{url}/")
    # Rank 1's first request: its file's upload, or (a small file is sent whole when it takes its
    # name) the check, just before, that no other save committed the directory meanwhile.
    assert f"{url}/rank_1.safetensors" in results[1]["msg"] or f"HEAD {url}/metadata.json" in results[1]["msg"], results[1]["msg"]
    # Each request rank 1 made: the first attempt and two retries, no more.
    tries = collections.Counter((e.method, e.path.split("?")[0]) for e in down.exchanges)
    assert tries and max(tries.values()) == 3, tries

    # Nothing was committed: the prefix holds no metadata.json, so it is not a checkpoint.
    assert "metadata.json" not in backend.names(url)
    with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
        Checkpointer().load(url, flat_state(flat_full(), 1))
    assert latest_checkpoint(url.rsplit("/", 1)[0]) is None

    # A load whose rank 2 cannot reach the store: every rank raises.
    run_distributed(save_flat, 2, backend.env(), url, "small", 0, True)
    assert backend.names(url) == ["metadata.json", "rank_0.safetensors", "rank_1.safetensors"]  # rank_2 removed
    envs = [backend.env(CHECKPOINTER_IO_RETRIES="2") for _ in range(3)]
    dropping = proxies(backend.endpoint)
    dropping.fail(10**6, "drop")
    envs[2] = backend.env(dropping.url, CHECKPOINTER_IO_RETRIES="2")
    results = run_distributed(caught, 3, envs, "load_flat", url)
    check_all_raised(results, 2, url)

    # And the same with every rank's requests dropped (rank 0 reads metadata.json first).
    results = run_distributed(caught, 3, backend.env(dropping.url, CHECKPOINTER_IO_RETRIES="2"), "load_flat", url)
    check_all_raised(results, 0, f"{url}/metadata.json")


class _EmptyUploadsAsGCS:
    """A :class:`FaultProxy` mixin: an empty ``uploadType=media`` POST creates an empty object, as
    GCS does (gcp-storage-emulator drops the connection instead)."""

    def _forward(self, method, path, headers, body):
        import http.client
        import json
        import urllib.parse

        if not (method == "POST" and "uploadType=media" in path and not body):
            return super()._forward(method, path, headers, body)
        name = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["name"][0]
        bucket = path.split("/b/", 1)[1].split("/", 1)[0]
        conn = http.client.HTTPConnection(*self._up, timeout=30)
        conn.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name=" + urllib.parse.quote(name, safe=""),
                     body=json.dumps({"name": name}), headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        session = urllib.parse.urlsplit(answer.getheader("Location"))
        conn.request("PUT", f"{session.path}?{session.query}", body=b"", headers={"Content-Range": "bytes */0"})
        answer = conn.getresponse()
        return answer.status, answer.reason, answer.getheaders(), answer.read()


@pytest.mark.parametrize("part_size", [32 << 20, 256 << 10], ids=["one request", "composed parts"])
def test_a_gcs_upload_answered_401_sends_every_byte(gcs_endpoint, part_size):
    """After a 401 the authorized session refreshes its token and sends the request again with the
    same body object, which an upload of several segments had read to its end: the rank file was
    stored empty, or a part of it, and the save committed (found by a review). The object each
    upload completes is now checked against the bytes sent, and sent again whole."""
    import torch
    from google.auth import credentials as ga_credentials
    from google.cloud import storage as gcs
    from storage_fixtures import GCS_BUCKET, unique
    from storage_servers import FaultProxy

    from checkpointer.storage.gcs import GCSStorage

    class Refreshing(ga_credentials.Credentials):
        def refresh(self, request):
            self.token, self.expiry = "token", None

    class Proxy(_EmptyUploadsAsGCS, FaultProxy):
        pass

    proxy = Proxy(gcs_endpoint)
    try:
        client = gcs.Client(project="test", credentials=Refreshing(), client_options={"api_endpoint": proxy.url})
        state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(16)}
        url = f"gs://{GCS_BUCKET}/{unique()}/step1"
        proxy.fail(1, mode="error", status=401, code="Unauthorized", method="POST", path="rank_0.safetensors")
        Checkpointer().save(GCSStorage(url, client=client, part_size=part_size, max_concurrency=1), state)
        assert any(s.fault == "error" for s in proxy.seen)  # the 401 was answered
        direct = gcs.Client(project="test", credentials=ga_credentials.AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_endpoint})
        back = Checkpointer().unshard(GCSStorage(url, client=direct), no_dist=True)
        assert all(torch.equal(back[k], v) for k, v in state.items())
    finally:
        proxy.close()
