"""Integrity on load: ``load(..., verify=True)`` checks the CRC32C of the bytes it reads (whole
checksummed chunks, re-read where a load reads only part of one); ``verify=False`` skips it.
The cost is measured by ``benchmarks/verify_cost.py``.
"""

from __future__ import annotations

import os
import struct
import sys

import pytest

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # harness workers import this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rel_helpers  # noqa: E402
import torch  # noqa: E402
from hostile import edit_metadata  # noqa: E402

import checkpointer  # noqa: E402
from checkpointer import Checkpointer, CorruptCheckpointError, FlatShardedTensor  # noqa: E402


def flip(path: str, key: str, element: int) -> None:
    """Flip one bit of element ``element`` (local index) of ``key``'s piece in a rank file."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        import json

        entry = json.loads(f.read(n))[key]
        itemsize = {"F32": 4, "BF16": 2, "F64": 8, "I8": 1}[entry["dtype"]]
        pos = 8 + n + entry["data_offsets"][0] + element * itemsize
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_catches_a_flipped_bit_and_verify_false_skips_it(ckpt):
    path = ckpt.part("flat")
    full = ckpt.expected["flat"]
    flip(os.path.join(path, "rank_1.safetensors"), "flat.w", 3)  # element 8 of the full tensor
    with pytest.raises(CorruptCheckpointError) as info:
        rel_helpers.load_part(path, full, verify=True)
    assert "rank_1.safetensors" in str(info.value) and "flat.w" in str(info.value)
    got = rel_helpers.load_part(path, full, verify=False)  # no check: the flipped value comes through
    assert not torch.equal(got["flat.w"], full["flat.w"])
    assert (got["flat.w"] != full["flat.w"]).sum() == 1
    assert all(torch.equal(got[k], v) for k, v in full.items() if k != "flat.w")


def test_verify_checks_the_whole_chunk_of_a_partial_read(ckpt):
    """Reading elements [0, 10) of flat.w touches rank_0's and rank_1's pieces only in part:
    a flipped bit elsewhere in those pieces (same checksummed chunk) is still caught."""
    path = ckpt.part("flat")
    full = ckpt.expected["flat"]["flat.w"]
    flip(os.path.join(path, "rank_0.safetensors"), "flat.w", 7)  # element 17: not read
    state = {"flat.w": FlatShardedTensor(local=torch.zeros(10), shape=(7, 9), flattened_offsets=((0, 10),))}
    Checkpointer().load(path, state, verify=False)
    assert torch.equal(state["flat.w"].local, full.reshape(-1)[:10])
    with pytest.raises(CorruptCheckpointError, match="rank_0.safetensors"):
        Checkpointer().load(path, state, verify=True)


def test_verify_on_a_checkpoint_without_checksums(ckpt):
    """Checkpoints of OLMo-core 0.1.0 carry no checksums: verify=True has nothing to check and loads."""
    path = ckpt.part("flat")

    def strip(meta):
        meta.pop("checksum_algorithm")
        meta.pop("checksum_chunk_bytes")
        for entry in meta["tensors"].values():
            for spec in entry["shard_spec_per_file"].values():
                spec.pop("checksums")

    edit_metadata(ckpt, "flat", strip)
    got = rel_helpers.load_part(path, ckpt.expected["flat"], verify=True)
    assert all(torch.equal(got[k], v) for k, v in ckpt.expected["flat"].items())


def test_verify_with_checksums_of_small_chunks(tmp_path):
    """Many chunks per piece (the chunk size is read from metadata.json): each one is checked.
    The metadata is rewritten with CRC32C per 4 KiB chunk, computed here from the file's bytes."""
    import json

    import google_crc32c

    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"big": torch.arange(300_000, dtype=torch.float32)})
    with open(os.path.join(path, "rank_0.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(n))["big"]["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(end - start)
    crcs = [google_crc32c.value(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    meta["checksum_chunk_bytes"] = 4096
    meta["tensors"]["big"]["shard_spec_per_file"]["rank_0.safetensors"]["checksums"] = crcs
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)
    target = {"big": torch.zeros(300_000)}
    Checkpointer().load(path, target, verify=True)
    assert torch.equal(target["big"], torch.arange(300_000, dtype=torch.float32))
    flip(os.path.join(path, "rank_0.safetensors"), "big", 250_000)
    Checkpointer().load(path, target, verify=False)
    with pytest.raises(CorruptCheckpointError, match="chunk 244"):
        Checkpointer().load(path, target, verify=True)


def _load_verify_task(rank, world_size, path, strategy):
    from dist_helpers import catch

    from test_rank_failures import _zeros_local

    return catch(Checkpointer().load, path, _zeros_local(rank, world_size), strategy=strategy, verify=True)


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_verify_in_a_process_group(run_distributed, ckpt, strategy):
    """A flipped bit in a piece only rank 2 needs (rows 8-10 of flat.bf16) is reported on every
    rank; with the default strategy rank 2 reads it, and the others name rank 2."""
    flip(os.path.join(ckpt.part("flat"), "rank_2.safetensors"), "flat.bf16", 1)
    results = run_distributed(_load_verify_task, 3, ckpt.part("flat"), strategy, timeout=120)
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} loaded a corrupt checkpoint with verify=True"
        assert issubclass(getattr(checkpointer, r["type"]), CorruptCheckpointError), f"rank {rank}: {r['type']}: {r['msg']}"
        assert "rank_2.safetensors" in r["msg"] and "flat.bf16" in r["msg"], r["msg"]
        if strategy == "default" and rank != 2:
            assert "on rank 2" in r["msg"], f"rank {rank} does not name rank 2: {r['msg']}"
