"""Fixtures of the storage and remote tests: real S3 and GCS emulators on loopback, a fault proxy.

``tests/storage/conftest.py`` and ``tests/remote/conftest.py`` import the fixtures they use
from here (a fixture imported into a conftest is that folder's fixture).

``moto_server`` (S3) and ``gcp-storage-emulator`` (GCS) run as subprocesses on free ports of
127.0.0.1 for the whole session, with test-only credentials. The backends find them through
the standard settings (``AWS_ENDPOINT_URL_S3``, ``STORAGE_EMULATOR_HOST``), exactly as they
would find AWS, GCS or MinIO. No test sends traffic anywhere but loopback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Callable, Iterator

import pytest

from storage_servers import (
    GCS_BUCKET,
    S3_BUCKET,
    SECRET_KEY,
    FaultProxy,
    RangeFileServer,
    free_port,
    stop,
    unique,
    wait_listening,
)

BIN = os.path.dirname(sys.executable)


def _tool(name: str) -> str:
    path = os.path.join(BIN, name)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed: pip install -e '.[test]'")
    return found


@pytest.fixture(scope="session")
def loopback_env() -> Iterator[None]:
    """Test credentials, no config files, no proxies: nothing can leave 127.0.0.1."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                    "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "GOOGLE_APPLICATION_CREDENTIALS"):
            mp.delenv(var, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("AWS_ACCESS_KEY_ID", "test-access-key")
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("GOOGLE_CLOUD_PROJECT", "test-project")
        yield


def _start(argv: list[str], port: int, what: str, workdir) -> subprocess.Popen:
    """Start an emulator with its output in ``workdir/<what>.log`` (a pipe nobody reads would
    block ``moto_server``, which logs a line per request); the log's tail is in the error if it
    does not come up."""
    with open(workdir / f"{what}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    try:
        wait_listening(port, proc, what)
    except RuntimeError as e:
        stop(proc)
        raise RuntimeError(f"{e}\n{(workdir / f'{what}.log').read_text(errors='replace')[-4000:]}") from None
    return proc


@pytest.fixture(scope="session")
def moto_endpoint(loopback_env, tmp_path_factory) -> Iterator[str]:
    """``moto_server`` on a free loopback port, with the test bucket created."""
    port = free_port()
    proc = _start([_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, "moto_server",
                  tmp_path_factory.mktemp("moto"))
    try:
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def gcs_endpoint(loopback_env, tmp_path_factory) -> Iterator[str]:
    """``gcp-storage-emulator`` (in memory) on a free loopback port, with the test bucket."""
    port = free_port()
    proc = _start([_tool("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port),
                   "--in-memory", "--default-bucket", GCS_BUCKET, "--quiet"], port, "gcp-storage-emulator",
                  tmp_path_factory.mktemp("gcs"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def s3_client(moto_endpoint):
    """One boto3 client for the contract tests (creating one costs about half a second)."""
    import boto3
    import botocore.config

    config = botocore.config.Config(retries={"total_max_attempts": 1}, max_pool_connections=16)
    return boto3.session.Session().client("s3", endpoint_url=moto_endpoint, config=config)


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch) -> str:
    """The standard setting that points boto3 at moto (a test may repoint it at a proxy)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    return moto_endpoint


@pytest.fixture
def gcs_env(gcs_endpoint, monkeypatch) -> str:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    return gcs_endpoint


@pytest.fixture
def s3_url(s3_env) -> str:
    return f"s3://{S3_BUCKET}/{unique()}/ckpt"


@pytest.fixture
def gcs_url(gcs_env) -> str:
    return f"gs://{GCS_BUCKET}/{unique()}/ckpt"


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """``fault_proxy(upstream_url)`` starts a :class:`FaultProxy`; all are closed after the test."""
    proxies: list[FaultProxy] = []

    def start(upstream: str, **options) -> FaultProxy:
        proxies.append(FaultProxy(upstream, **options))
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def file_server() -> Iterator[Callable[..., RangeFileServer]]:
    servers: list[RangeFileServer] = []

    def start(root: str, **kw) -> RangeFileServer:
        servers.append(RangeFileServer(root, **kw))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
