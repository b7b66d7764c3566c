"""engine/rankfile.py, writing: which bytes a writer may keep (write_stable) and which it must copy."""

from __future__ import annotations

import torch

from checkpointer import Checkpointer
from checkpointer.engine.rankfile import write_rank_file
from checkpointer.sharding import describe
from checkpointer.storage.base import Writer
from checkpointer.storage.memory import MemoryStorage


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
