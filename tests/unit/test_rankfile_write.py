"""engine/rankfile.py, writing: bytes straight from contiguous tensors (write_stable: a writer
may keep them), staged in bounded blocks otherwise (plain write: the writer copies)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from checkpointer import Checkpointer, CorruptCheckpointError
from checkpointer.buffers import memoryview_of
from checkpointer.checksums import CHUNK_BYTES, chunk_crcs
from checkpointer.engine import rankfile
from checkpointer.engine import reads as reads_module
from checkpointer.engine.checks import HeaderCache
from checkpointer.engine.rankfile import write_rank_file
from checkpointer.format.dtypes import code_from_dtype
from checkpointer.sharding import describe
from checkpointer.storage.base import Writer
from checkpointer.storage.local import LocalStorage
from checkpointer.storage.memory import MemoryStorage


def piece(t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(data=t, numel=t.numel(), dtype=code_from_dtype(t.dtype))


@pytest.mark.parametrize("staging_mib", ["0.01", "1", "256"])
def test_non_contiguous_tensors_are_written_through_a_bounded_buffer(tmp_path, monkeypatch, staging_mib):
    monkeypatch.setenv("CHECKPOINTER_STAGING_MIB", staging_mib)
    taken = []
    real_take = rankfile._Staging.take
    monkeypatch.setattr(rankfile._Staging, "take", lambda self, n, pinned: taken.append(n) or real_take(self, n, pinned))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "wide.T": torch.randn(1500, 3000, generator=g).t(),  # 18 MB: crosses a checksum chunk
        "every_other": torch.arange(40_000, dtype=torch.int64)[::2],
        "contiguous": torch.randn(1000, generator=g),
        "bf16.T": torch.randn(7, 13, generator=g).to(torch.bfloat16).t(),
        "scalar_view": torch.tensor([3.0, 4.0])[1:].squeeze(),
    }
    crcs = write_rank_file(LocalStorage(str(tmp_path)), "r.safetensors", [(k, piece(t)) for k, t in tensors.items()])
    with safe_open(str(tmp_path / "r.safetensors"), "pt") as f:
        for key, t in tensors.items():
            flat = t.contiguous().reshape(-1)
            assert torch.equal(f.get_tensor(key), flat), key
            assert crcs[key] == chunk_crcs(memoryview_of(flat)), key
    budget = rankfile.staging_bytes()
    row = 1500 * 4  # one row of wide.T
    assert taken and max(taken) <= max(budget, row)
    assert len(crcs["wide.T"]) == -(-1500 * 3000 * 4 // CHUNK_BYTES)


def test_small_non_contiguous_pieces_are_saved_intact(tmp_path):
    # Regression: a small piece staged into a temporary (here a transpose) was queued by
    # address and written after the temporary was freed; the next temporary of the same size
    # took its memory, so the file held the wrong bytes (and their checksums disagreed).
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(16, 24, generator=g).t() for i in range(6)}
    Checkpointer().save(str(tmp_path / "ckpt"), state)
    out = {k: torch.empty(v.shape) for k, v in state.items()}
    Checkpointer().load(str(tmp_path / "ckpt"), out, verify=True)
    for key in state:
        assert torch.equal(out[key], state[key]), key


class _RecordingWriter(Writer):
    def __init__(self, inner: Writer, calls: list[tuple[str, int]]):
        self.inner, self.calls = inner, calls

    def write(self, buffers):
        self.calls.append(("write", sum(len(b) for b in buffers)))
        self.inner.write(buffers)

    def write_stable(self, buffers):
        self.calls.append(("stable", sum(len(b) for b in buffers)))
        self.inner.write(buffers)

    def commit(self):
        self.inner.commit()

    def abort(self):
        self.inner.abort()


class _Recording(MemoryStorage):
    """Records, per writer call, whether the bytes came through ``write`` or ``write_stable``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def open_writer(self, name):
        return _RecordingWriter(super().open_writer(name), self.calls)


def test_contiguous_cpu_pieces_are_written_stable_and_temporaries_copied():
    storage = _Recording()
    contiguous = torch.arange(12.0)
    strided = torch.arange(24.0).reshape(4, 6).t()  # staged into a temporary
    pieces = [("a", describe(contiguous)), ("b", describe(strided))]
    write_rank_file(storage, "rank_0.safetensors", pieces)
    kinds = [kind for kind, _ in storage.calls]
    # The header and "a" may go together (stable); "b" is a temporary: plain write, on its own.
    assert kinds[-1] == "write" and storage.calls[-1][1] == 24 * 4
    assert set(kinds[:-1]) == {"stable"}
    data = storage.read("rank_0.safetensors")
    assert data.endswith(contiguous.numpy().tobytes() + strided.contiguous().numpy().tobytes())


def test_header_cache_refuses_a_file_whose_id_is_not_the_one_metadata_lists(tmp_path):
    storage = LocalStorage(str(tmp_path))
    pieces = [("w", piece(torch.arange(10, dtype=torch.float32)))]
    write_rank_file(storage, "rank_0.safetensors", pieces, file_id="aaaa")
    write_rank_file(storage, "rank_1.safetensors", pieces)  # no id, as files of other writers
    with safe_open(str(tmp_path / "rank_0.safetensors"), "pt") as f:
        assert f.metadata() == {"checkpointer_file_id": "aaaa"}

    assert HeaderCache(storage, {"rank_0.safetensors": "aaaa"}).get("rank_0.safetensors").entries["w"].numel == 10
    assert HeaderCache(storage).get("rank_0.safetensors").user_metadata == {"checkpointer_file_id": "aaaa"}
    assert HeaderCache(storage, {"rank_0.safetensors": "aaaa"}).get("rank_1.safetensors").user_metadata is None
    for ids, found in (({"rank_0.safetensors": "bbbb"}, "'aaaa'"), ({"rank_1.safetensors": "aaaa"}, "None")):
        name = next(iter(ids))
        with pytest.raises(CorruptCheckpointError, match=rf"{name}: written by another save .* \(file id {found}, expected"):
            HeaderCache(storage, ids).get(name)


def test_a_large_tensor_is_read_in_parts_shared_by_the_threads(tmp_path, monkeypatch):
    """One tensor larger than a read chunk is read as several reads, which run on several threads
    (a 129 MiB tensor was one read on one thread: loads through host staging ran at one thread's speed)."""
    import threading

    monkeypatch.setattr(reads_module, "_SPLIT_BYTES", 1 << 20)
    monkeypatch.setattr(reads_module, "_BYTES_PER_THREAD", 1 << 20)  # as large loads have: several threads
    saved = {"big": torch.randn(5 << 18, generator=torch.Generator().manual_seed(3))}  # 5 MiB
    Checkpointer().save(str(tmp_path / "ckpt"), saved)
    reads, threads = [], set()
    real_read_into = LocalStorage.read_into
    # The first two reads wait for each other: one thread doing all the reads would time out here.
    # (Merely counting threads was flaky: a pool reuses an idle thread when the reads are quick.)
    both_reading = threading.Barrier(2, timeout=60)
    calls = iter(range(1 << 30))

    def read_into(self, name, requests):
        reads.extend(len(buf) for _, buf in requests)
        threads.add(threading.get_ident())
        if next(calls) < 2:
            both_reading.wait()
        return real_read_into(self, name, requests)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    loaded = {"big": torch.zeros_like(saved["big"])}
    Checkpointer().load(str(tmp_path / "ckpt"), loaded, no_dist=True)
    assert torch.equal(loaded["big"], saved["big"])
    assert len(reads) >= 5 and max(reads) <= 1 << 20, reads
    assert len(threads) > 1
