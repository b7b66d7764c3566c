"""write_rank_file: bytes straight from contiguous tensors, staged in bounded blocks otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from checkpointer.checksums import CHUNK_BYTES, chunk_crcs
from checkpointer.buffers import memoryview_of
from checkpointer.engine import rankfile
from checkpointer.engine.rankfile import write_rank_file
from checkpointer.format.dtypes import code_from_dtype
from checkpointer.storage.local import LocalStorage


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
