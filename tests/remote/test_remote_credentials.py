"""S3 with no credentials: an ``OSError`` (API.md's type for I/O failures) that names the URL and
says what to set, not botocore's bare "Unable to locate credentials". Against moto on loopback;
without credentials botocore refuses to sign, so no request leaves the process."""

from __future__ import annotations

import uuid

import pytest
import torch

import checkpointer
from checkpointer import Checkpointer
from checkpointer.cli import main as cli_main
from storage_servers import S3_BUCKET

_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@pytest.fixture
def s3_url(moto_endpoint, monkeypatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    return f"s3://{S3_BUCKET}/creds-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def no_credentials(monkeypatch):
    """The credential chain finds nothing: no variables, no files (loopback_env), no instance role."""
    for var in _CREDENTIALS:
        monkeypatch.delenv(var, raising=False)


def _says_what_to_set(ex: BaseException, url: str) -> None:
    message = str(ex)
    assert url in message
    assert "no AWS credentials found" in message
    for setting in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        assert setting in message, setting


def test_load_without_credentials_says_what_to_set(s3_url, monkeypatch):
    Checkpointer().save(f"{s3_url}/ckpt", {"w": torch.ones(3)})  # with the test credentials
    for var in _CREDENTIALS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(OSError) as ex:
        Checkpointer().load(f"{s3_url}/ckpt", {"w": torch.zeros(3)})
    _says_what_to_set(ex.value, f"{s3_url}/ckpt")
    assert type(ex.value.__cause__).__name__ == "NoCredentialsError"  # the cause is kept


def test_save_and_latest_checkpoint_without_credentials_say_what_to_set(s3_url, no_credentials):
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OSError) as ex:
        checkpointer.save_model_and_optim_state(f"{s3_url}/step1", model, optim)
    _says_what_to_set(ex.value, f"{s3_url}/step1")
    with pytest.raises(OSError) as ex:  # an error, not "no checkpoint there" (None)
        checkpointer.latest_checkpoint(s3_url)
    _says_what_to_set(ex.value, s3_url)


def test_cli_without_credentials_is_one_line_saying_what_to_set(s3_url, no_credentials, capsys):
    capsys.readouterr()
    code = cli_main(["inspect", f"{s3_url}/ckpt"])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and err.startswith("checkpointer: error: ")
    assert "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err
