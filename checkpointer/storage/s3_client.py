"""The boto3 client the S3 storage and its writers share, and how its errors read.

botocore's own retries are off in every client built here: each call goes through
:func:`~checkpointer.storage.retry.call_with_retry`, which :func:`transient` advises.
"""

from __future__ import annotations

import functools
from typing import Any

from .transient import is_transient, transient_status

__all__ = ["CLIENT_SETTINGS", "NO_CREDENTIALS", "NOT_FOUND", "boto_modules", "error_code", "shared_client", "transient"]

NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
            "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
            "ConditionalRequestConflict"}  # 409: a conditional write to the same key in progress; retry


def boto_modules():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as e:  # pragma: no cover - boto3 is a dependency
        raise ImportError("s3:// URLs need boto3: pip install boto3") from e
    return boto3, botocore


def error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(response.get("Error", {}).get("Code", "")), int(status or 0)


def transient(exc: BaseException) -> bool:
    _, botocore = boto_modules()
    e = botocore.exceptions
    if isinstance(exc, e.ClientError):
        code, status = error_code(exc)
        return code in THROTTLE or transient_status(status)
    if isinstance(exc, (e.HTTPClientError, e.ConnectionError, e.IncompleteReadError, e.ChecksumError,
                        e.CredentialRetrievalError)):
        return True
    import urllib3.exceptions

    return isinstance(exc, (urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)) or is_transient(exc)


NO_CREDENTIALS = (
    "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN "
    "for temporary ones), or AWS_PROFILE naming a profile of ~/.aws/credentials or ~/.aws/config "
    "(aws configure; aws sso login), or run where an instance or container role provides them; for "
    "MinIO or another S3-compatible store, also AWS_ENDPOINT_URL_S3"
)
"""What to set when boto3's credential chain found nothing (botocore says only "Unable to locate credentials")."""

# The environment settings a client is built from: a client is shared while they are unchanged.
CLIENT_SETTINGS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
)


@functools.lru_cache(maxsize=8)
def shared_client(settings: tuple, max_concurrency: int, timeouts: tuple[float, float]) -> Any:
    """One boto3 client per set of settings (clients are thread-safe; building one costs ~0.3 s)."""
    boto3, botocore = boto_modules()
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=2 * max_concurrency + 4,
        connect_timeout=timeouts[0],
        read_timeout=timeouts[1],
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", config=config)
