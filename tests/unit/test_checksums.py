"""CRC32C implementations: each one the module may pick must agree with google-crc32c's value."""

from __future__ import annotations

import random

import google_crc32c
import pytest

from checkpointer import checksums


def _buffers() -> list[bytearray]:
    rng = random.Random(7)
    sizes = [1, 3, 8, 15, 63, 64, 65, 255, 4096, 4099, 65_537, (1 << 20) + 13]
    return [bytearray(rng.randbytes(n)) for n in sizes]


def _native(name: str):
    loader = {"isal": checksums._load_isal, "google": checksums._load_google}[name]
    extend = loader()
    if extend is None:
        pytest.skip(f"{name} is not installed")
    return extend


@pytest.mark.parametrize("name", ["isal", "google"])
def test_native_implementation_matches_google_crc32c_at_every_split(name):
    import ctypes

    extend = _native(name)
    assert checksums._passes_check(extend)
    for buf in _buffers():
        address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        want = google_crc32c.value(bytes(buf))
        assert extend(0, address, len(buf)) == want
        cut = len(buf) // 3 + 1 if len(buf) > 1 else 0
        assert extend(extend(0, address, cut), address + cut, len(buf) - cut) == want


def test_isal_splits_calls_longer_than_a_c_int(monkeypatch):
    import ctypes

    extend = _native("isal")
    monkeypatch.setattr(checksums, "_MAX_CALL_BYTES", 1000)  # read at each call
    buf = _buffers()[-1]
    address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    assert extend(0, address, len(buf)) == google_crc32c.value(bytes(buf))
    assert extend(12345, address, 2500) == google_crc32c.extend(12345, bytes(buf[:2500]))


def test_public_functions_on_writable_readonly_and_empty_views():
    for buf in _buffers():
        want = google_crc32c.value(bytes(buf))
        assert checksums.crc32c(memoryview(buf)) == want
        assert checksums.crc32c(memoryview(bytes(buf))) == want  # read-only: through the Python binding
        half = len(buf) // 2
        assert checksums.crc32c_extend(checksums.crc32c(memoryview(buf)[:half]), memoryview(buf)[half:]) == want
    assert checksums.crc32c(memoryview(bytearray())) == 0
    data = _buffers()[-1]
    crcs = checksums.chunk_crcs(memoryview(data), 4096)
    assert crcs == [google_crc32c.value(bytes(data[i : i + 4096])) for i in range(0, len(data), 4096)]


def test_the_choice_prefers_isal_and_can_be_forced_to_google(monkeypatch):
    monkeypatch.delenv("CHECKPOINTER_CRC32C", raising=False)
    name, _ = checksums._pick()
    assert name == ("isal" if checksums._load_isal() is not None else "google-crc32c")
    monkeypatch.setenv("CHECKPOINTER_CRC32C", "google")
    name, extend = checksums._pick()
    assert name == "google-crc32c" and extend is not None


def test_an_implementation_that_disagrees_is_not_picked(monkeypatch):
    monkeypatch.delenv("CHECKPOINTER_CRC32C", raising=False)
    monkeypatch.setattr(checksums, "_load_isal", lambda: (lambda crc, address, n: 0))
    name, extend = checksums._pick()
    assert name == "google-crc32c" and checksums._passes_check(extend)
