"""storage/urls.py: paths and URLs taken apart as text, the one place outside the backends."""

from __future__ import annotations

import os

import pytest

from checkpointer.storage.urls import is_url, local_path, parent_url, scheme_of, split_path, split_url


@pytest.mark.parametrize(
    "url, local",
    [
        ("ckpt", "ckpt"),
        ("/data/ckpt/", "/data/ckpt/"),
        ("~/ckpt", "~/ckpt"),  # as written: the caller expands ~
        ("file:///data/ckpt", "/data/ckpt"),
        ("FILE:///data/ckpt", "/data/ckpt"),  # schemes are case-insensitive, as in open_storage
        ("file://localhost/data/ckpt", "/data/ckpt"),  # was ./localhost/data/ckpt (found by a review)
        ("file://LOCALHOST/", "/"),
        ("s3://b/ckpt", None),
        ("gs://b/ckpt", None),
        ("https://host/ckpt?sig=x", None),
    ],
)
def test_local_path(url, local):
    assert local_path(url) == local
    assert is_url(url) is ("://" in url)


def test_a_file_url_naming_another_host_is_refused():
    with pytest.raises(ValueError, match=r"'file://server/share/ckpt': a file URL names a path on this host .* not on 'server'"):
        local_path("file://server/share/ckpt")


def test_scheme_of():
    assert [scheme_of(u) for u in ("ckpt", "S3://b", "gs://b/k", "file:///x", "https://h/p")] == ["", "s3", "gs", "file", "https"]


@pytest.mark.parametrize(
    "url, parent, name",
    [
        ("s3://b/run/ckpt/model.safetensors", "s3://b/run/ckpt", "model.safetensors"),
        ("gs://b/run/ckpt/", "gs://b/run", "ckpt"),
        ("s3://b/a%20b#c?d", "s3://b", "a%20b#c?d"),  # an object key is taken as it is
        ("s3://b", "s3://b", ""),  # a bucket: no name
        ("file:///tmp/x.safetensors", "file:///tmp", "x.safetensors"),
        ("https://host/p/a%20b.safetensors?sig=1", "https://host/p?sig=1", "a b.safetensors"),  # query kept, name decoded
        ("http://host/file", "http://host", "file"),
    ],
)
def test_split_url(url, parent, name):
    assert split_url(url) == (parent, name)


def test_split_path_makes_local_paths_absolute_and_splits_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert split_path("out.safetensors") == (str(tmp_path), "out.safetensors")
    assert split_path("~/x/out.safetensors") == (os.path.join(str(tmp_path), "home", "x"), "out.safetensors")
    assert split_path("s3://b/k/out.safetensors") == ("s3://b/k", "out.safetensors")


@pytest.mark.parametrize(
    "url, parent",
    [
        ("/data/run/ckpt", "/data/run"),
        ("/data/run/ckpt/", "/data/run"),
        ("/data", "/"),
        ("/", None),
        ("s3://b/run/ckpt", "s3://b/run"),
        ("gs://b/ckpt/", "gs://b"),
        ("s3://b", None),  # a bucket's root
        ("s3://b/", None),
        ("https://host/run/ckpt", None),  # http(s) directories cannot be listed
    ],
)
def test_parent_url(url, parent):
    assert parent_url(url) == parent
