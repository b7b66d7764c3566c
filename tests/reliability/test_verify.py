"""Integrity on load: ``load(..., verify=True)`` checks the CRC32C of the bytes it reads (whole
checksummed chunks, re-read where a load reads only part of one); ``verify=False`` skips it.
The cost is measured by ``benchmarks/verify_cost.py``.
"""

from __future__ import annotations

import os
import struct

import pytest

import rel_helpers
import torch

from checkpointer.engine import save as engine_save
from hostile import edit_metadata

import checkpointer
from checkpointer import Checkpointer, CorruptCheckpointError, FlatShardedTensor


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


def rechunk(path: str, chunk_bytes: int) -> None:
    """Rewrite a one-file checkpoint's checksums as CRC32C per ``chunk_bytes``, from the file's bytes."""
    import json

    import google_crc32c

    with open(os.path.join(path, "rank_0.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    meta["checksum_chunk_bytes"] = chunk_bytes
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        piece = data[entry["data_offsets"][0] : entry["data_offsets"][1]]
        crcs = [google_crc32c.value(piece[i : i + chunk_bytes]) for i in range(0, len(piece), chunk_bytes)]
        meta["tensors"][key]["shard_spec_per_file"]["rank_0.safetensors"]["checksums"] = crcs
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)


def test_verify_with_checksums_of_small_chunks(tmp_path, monkeypatch):
    """Many chunks per piece (the chunk size is read from metadata.json): each one is checked.
    The metadata is rewritten with CRC32C per 4 KiB chunk, computed here from the file's bytes
    (format 1, whose metadata.json lists the checksums)."""
    monkeypatch.setattr(engine_save, "COMPACT_METADATA", False)
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"big": torch.arange(300_000, dtype=torch.float32)})
    rechunk(path, 4096)
    target = {"big": torch.zeros(300_000)}
    Checkpointer().load(path, target, verify=True)
    assert torch.equal(target["big"], torch.arange(300_000, dtype=torch.float32))
    flip(os.path.join(path, "rank_0.safetensors"), "big", 250_000)
    Checkpointer().load(path, target, verify=False)
    with pytest.raises(CorruptCheckpointError, match="chunk 244"):
        Checkpointer().load(path, target, verify=True)


def test_verify_hashes_every_chunk_once_across_runs_and_tensors(tmp_path, monkeypatch):
    """Chunks of 4 KiB, runs of at most three chunks, tensors asked for in an order unlike the
    file's (the runs are read in file order): every value is exact, every chunk is hashed once,
    and a flipped bit is caught, naming its chunk."""
    from checkpointer.engine import checks as rankfile
    from checkpointer.engine import reads

    monkeypatch.setattr(engine_save, "COMPACT_METADATA", False)  # format 1: checksums in metadata.json
    sizes = {"a": 300_000, "b": 5_000, "c": 70_001}
    saved = {k: torch.arange(n, dtype=torch.float32) * 0.5 for k, n in sizes.items()}
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, saved)
    rechunk(path, 4096)
    monkeypatch.setattr(rankfile, "_SPLIT_BYTES", 3 * 4096)
    monkeypatch.setattr(reads, "_SPLIT_BYTES", 3 * 4096)
    monkeypatch.setattr(rankfile, "_HASH_BLOCK", 1024)  # a chunk read and hashed as 4 blocks
    hashed, blocks = [], []  # one entry per chunk checked (its bytes if hashed whole); bytes of each block
    real_crc32c, real_extend = rankfile.crc32c, rankfile.crc32c_extend

    def counting_crc32c(view):
        hashed.append(len(view))
        return real_crc32c(view)

    def counting_extend(crc, view):
        blocks.append(len(view))
        if crc == 0:  # a chunk's first block: count the chunk once, with its bytes in blocks
            hashed.append(0)
        return real_extend(crc, view)

    monkeypatch.setattr(rankfile, "crc32c", counting_crc32c)
    monkeypatch.setattr(rankfile, "crc32c_extend", counting_extend)
    read_order = []
    real_run = reads._run

    def recording_run(num_threads, tasks, *rest):
        read_order.extend((t[2], t[4]) for t in tasks if t[0] is rankfile.read_hashed)
        return real_run(num_threads, tasks, *rest)

    monkeypatch.setattr(reads, "_run", recording_run)
    target = {k: torch.zeros(sizes[k]) for k in ("c", "a", "b")}
    Checkpointer().load(path, target, verify=True)
    assert len(read_order) > 3 and read_order == sorted(read_order)
    assert all(torch.equal(target[k], saved[k]) for k in sizes)
    assert sum(hashed) + sum(blocks) == sum(n * 4 for n in sizes.values())
    assert len(hashed) == sum(-(-n * 4 // 4096) for n in sizes.values())
    assert len(blocks) > len(hashed) and max(blocks) == 1024
    flip(os.path.join(path, "rank_0.safetensors"), "a", 5 * 1024 + 300)  # byte 21,680: chunk 5
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'a', chunk 5\b"):
        Checkpointer().load(path, {k: torch.zeros(n) for k, n in sizes.items()}, verify=True)


def _load_verify_task(rank, world_size, path, strategy):
    from dist_helpers import catch

    return catch(Checkpointer().load, path, rel_helpers.zeros_local(rank, world_size), strategy=strategy, verify=True)


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


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_verify_with_the_metadata_save_returned(tmp_path, strategy):
    """``save`` returns the metadata it planned, which has no checksums (only metadata.json gets
    them, at commit); passing it back with verify=True still checks the bytes read."""
    path = str(tmp_path / "ckpt")
    state = {"w": torch.arange(64, dtype=torch.float32)}
    metadata, _ = Checkpointer().save(path, state)
    flip(os.path.join(path, "rank_0.safetensors"), "w", 5)
    target = {"w": torch.zeros(64)}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        Checkpointer().load(path, target, metadata=metadata, strategy=strategy, verify=True)
    Checkpointer().load(path, target, metadata=metadata, strategy=strategy, verify=False)
    assert (target["w"] != state["w"]).sum() == 1


def _load_strided_verify(rank, world_size, path, strategy):
    from dist_helpers import catch

    return catch(Checkpointer().load, path, {"w": torch.zeros(32, 64).t()}, strategy=strategy, verify=True)


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_verify_checks_destinations_filled_through_host_memory(run_distributed, tmp_path, strategy):
    """A destination that cannot be read into (strided here, on a GPU in a job) is filled through
    a host buffer; verify=True checks those bytes too, on every rank (a mutant of two_stage that
    skipped the check for them passed every test)."""
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)})
    flip(os.path.join(path, "rank_0.safetensors"), "w", 5)
    for rank, r in enumerate(run_distributed(_load_strided_verify, 2, path, strategy, timeout=120)):
        assert r is not None, f"rank {rank} loaded a corrupt checkpoint with verify=True"
        assert r["type"] == "CorruptCheckpointError" and "checksum mismatch in tensor 'w'" in r["msg"], (rank, r["msg"])
