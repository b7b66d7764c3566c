"""Fixtures for the storage tests: real S3 and GCS emulators on loopback, a fault proxy.

Defined in ``tests/support/storage_fixtures.py`` (shared with ``tests/remote``), made this
folder's fixtures by importing them here.
"""

from __future__ import annotations

from storage_fixtures import (  # noqa: F401  (fixtures: pytest finds them by name)
    fault_proxy,
    file_server,
    gcs_endpoint,
    gcs_env,
    gcs_url,
    loopback_env,
    moto_endpoint,
    s3_client,
    s3_env,
    s3_url,
)
