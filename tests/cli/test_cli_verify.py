"""``checkpointer verify DIR``: sound checkpoints pass; each kind of damage is one line naming it."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from dist_helpers import read_metadata_listed
import torch
from cli_helpers import cli
from safetensors.torch import save_file

from checkpointer.checksums import CHUNK_BYTES, chunk_crcs
from checkpointer.engine.checks import HeaderCache
from checkpointer.tools.hf import HFSource
from checkpointer.tools.verify import verify_checkpoint
from checkpointer.format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from checkpointer.storage.local import LocalStorage


def copy(src: str, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def byte_offset(dir: str, file: str, key: str) -> int:
    return HeaderCache(LocalStorage(dir)).get(file).entries[key].start


def problems_of(capsys, dir: str) -> tuple[int, list[str], str]:
    code, out, err = cli(capsys, "verify", dir)
    return code, out.splitlines(), err


@pytest.mark.parametrize("which", ["ws1", "ws3", "flat3"])
def test_sound_checkpoints_pass(ckpts, capsys, which):
    path = getattr(ckpts, which)
    code, out, err = cli(capsys, "verify", path)
    assert (code, err) == (0, "")
    assert out.startswith("ok: ") and out.count("\n") == 1
    if which != "flat3":  # top-level directories: both parts are checked
        assert os.path.join(path, "model") in out and os.path.join(path, "optim") in out
    assert verify_checkpoint(os.path.join(path, "model") if which != "flat3" else path) == []


def test_the_training_state_is_verified_too(capsys, tmp_path):
    """verify DIR read model/ and optim/ only: a flipped byte in train/, or a train/ that never
    committed, passed (found by a review), though loading the step refuses both."""
    import checkpointer
    from dist_helpers import build_model, build_optim

    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw")
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim, train_state={"t": torch.arange(100)})
    code, out, _ = cli(capsys, "verify", top)
    assert code == 0 and os.path.join(top, "train") in out
    assert os.path.join(top, "train") in cli(capsys, "inspect", top)[1]
    rank_file = os.path.join(top, "train", "rank_0.safetensors")
    original = open(rank_file, "rb").read()
    with open(rank_file, "r+b") as f:
        f.seek(len(original) - 5)
        f.write(bytes([original[-5] ^ 0xFF]))
    code, lines, _ = problems_of(capsys, top)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{rank_file}: checksum mismatch"), lines
    with open(rank_file, "wb") as f:
        f.write(original)
    os.remove(os.path.join(top, "train", "metadata.json"))
    code, lines, _ = problems_of(capsys, top)
    assert code == 1 and lines == [f"{os.path.join(top, 'train', 'metadata.json')} is missing: "
                                   f"{os.path.join(top, 'train')} is not a complete checkpoint (its save never finished)"], lines


def test_a_step_without_optim_is_incomplete(capsys, tmp_path):
    """model/ committed and optim/ never (a save that died between them) passed verify, though
    latest_checkpoint skips the step and a load with an optimizer refuses it (found by a review)."""
    import checkpointer
    from dist_helpers import build_model, build_optim

    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw")
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, optim)
    shutil.rmtree(os.path.join(top, "optim"))
    assert checkpointer.latest_checkpoint(str(tmp_path)) is None
    code, lines, err = problems_of(capsys, top)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"{os.path.join(top, 'optim', 'metadata.json')} is missing: {top} is not a complete checkpoint")
    assert err == f"checkpointer: error: 1 problem found in {top}\n"


def test_a_hugging_face_export_is_verified_without_checksums(capsys, tmp_path, monkeypatch):
    """verify refused an exported Hugging Face directory as "not a checkpoint", which inspect
    reads (found by a review): its headers and index are checked and every tensor read."""
    import checkpointer
    from dist_helpers import build_model, build_optim

    model = build_model(1, seed=1)
    top = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(top, model, build_optim(model, "adamw"))
    hf = str(tmp_path / "hf")
    assert cli(capsys, "unshard", top, hf, "--max-shard-size", "1")[0] == 0  # a shard per tensor
    shards = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))
    assert len(shards) > 1
    code, out, err = cli(capsys, "verify", hf)
    assert (code, err) == (0, "") and out == (f"ok: {hf} (Hugging Face safetensors, which hold no checksums): "
                                              "every tensor complete, every byte read\n")
    assert cli(capsys, "verify", os.path.join(hf, shards[0]))[0] == 1  # a file, as inspect refuses it
    # Read in blocks of rows: with 8-byte blocks a tensor is many reads, and still sound.
    from checkpointer.tools import verify
    reads = []
    real_read = HFSource.read
    monkeypatch.setattr(verify, "_READ_BYTES", 8)
    monkeypatch.setattr(HFSource, "read", lambda self, key, box: (reads.append((key, box)), real_read(self, key, box))[1])
    assert cli(capsys, "verify", hf)[0] == 0
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    assert all(box is None or box[0][0] * max(1, math.prod(box[0][1:])) * 4 <= max(8, 4 * math.prod(box[0][1:]))
               for _, box in reads), reads
    for key, shape in shapes.items():  # every row of every tensor read, once
        rows = sorted((box[1][0], box[1][0] + box[0][0]) for k, box in reads if k == key and box is not None)
        if shape:
            assert rows[0][0] == 0 and rows[-1][1] == shape[0] and all(a[1] == b[0] for a, b in zip(rows, rows[1:])), key
    monkeypatch.undo()
    victim = os.path.join(hf, shards[-1])
    os.truncate(victim, os.path.getsize(victim) - 4)
    code, lines, err = problems_of(capsys, hf)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{victim}: "), lines
    os.remove(victim)
    code, lines, err = problems_of(capsys, hf)
    assert code == 1 and len(lines) == 1 and shards[-1] in lines[0], lines


def test_quiet_prints_nothing_when_sound(ckpts, capsys):
    assert cli(capsys, "verify", ckpts.flat3, "--quiet") == (0, "", "")


@pytest.mark.parametrize("ws", [1, 3])
def test_flipped_byte(ckpts, capsys, tmp_path, ws):
    dir = copy(os.path.join(ckpts.ws1 if ws == 1 else ckpts.ws3, "model"), tmp_path)
    file = f"rank_{ws - 1}.safetensors"
    meta = read_metadata_listed(dir)
    key = next(k for k, t in sorted(meta["tensors"].items()) if file in t["shard_spec_per_file"])
    pos = byte_offset(dir, file, key) + 5
    with open(os.path.join(dir, file), "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    code, lines, err = problems_of(capsys, dir)
    assert code == 1
    assert lines == [f"{os.path.join(dir, file)}: checksum mismatch in tensor {key!r}, chunk 0 (file bytes [{pos - 5}, "
                     f"{pos - 5 + _piece_bytes(meta, key, file)}))"]
    assert err == f"checkpointer: error: 1 problem found in {dir}\n"


def _piece_bytes(meta, key, file):
    spec = meta["tensors"][key]["shard_spec_per_file"][file]
    if spec["flattened_offsets"] is not None:
        numel = sum(e - s for s, e in spec["flattened_offsets"])
    else:
        numel = 1
        for d in spec["local_shape"]:
            numel *= d
    return numel * 4


@pytest.mark.parametrize("ws", [1, 3])
def test_truncated_file(ckpts, capsys, tmp_path, ws):
    dir = copy(os.path.join(ckpts.ws1 if ws == 1 else ckpts.ws3, "optim"), tmp_path)
    file = f"rank_{ws - 1}.safetensors"
    path = os.path.join(dir, file)
    os.truncate(path, os.path.getsize(path) - 3)
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}: ") and "does not fit" in lines[0] and "file" in lines[0]


def test_missing_file(ckpts, capsys, tmp_path):
    dir = copy(os.path.join(ckpts.ws3, "model"), tmp_path)
    os.remove(os.path.join(dir, "rank_1.safetensors"))
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == [f"{os.path.join(dir, 'rank_1.safetensors')}: rank file listed in metadata.json is missing"]


def test_missing_metadata(ckpts, capsys, tmp_path):
    dir = copy(ckpts.flat3, tmp_path)
    os.remove(os.path.join(dir, "metadata.json"))
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert len(lines) == 1 and "metadata.json is missing" in lines[0]


def test_unlisted_rank_file(ckpts, capsys, tmp_path):
    dir = copy(ckpts.flat3, tmp_path)
    shutil.copy(os.path.join(dir, "rank_0.safetensors"), os.path.join(dir, "rank_7.safetensors"))
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == [f"{os.path.join(dir, 'rank_7.safetensors')}: rank file is not listed in metadata.json"]


def test_header_disagrees_with_metadata(ckpts, capsys, tmp_path):
    dir = copy(ckpts.flat3, tmp_path)
    path = os.path.join(dir, "metadata.json")
    meta = json.loads(open(path).read())
    meta["tensors"]["b"]["dtype"] = "F32"  # the files hold I32 (same item size)
    open(path, "w").write(json.dumps(meta))
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == [
        f"{os.path.join(dir, f'rank_{r}.safetensors')}: tensor 'b' is I32 x {n} in the file but F32 x {n} in metadata.json"
        for r, n in ((0, 8), (1, 6), (2, 6))
    ]


def handmade(tmp_path, pieces: dict[str, tuple[int, int]], *, checksums: bool = True) -> str:
    """A 10-element tensor ``w`` whose files hold the given flattened ranges (consistent headers)."""
    dir = tmp_path / "handmade"
    dir.mkdir()
    full = torch.arange(10, dtype=torch.float32)
    specs = {}
    for name, (s, e) in pieces.items():
        piece = full[s:e].clone()
        save_file({"w": piece}, str(dir / name))
        crcs = tuple(chunk_crcs(memoryview(piece.numpy().tobytes()))) if checksums else None
        specs[name] = TensorShardSpec(flattened_offsets=((s, e),), checksums=crcs)
    meta = StorageMetadata(
        tensors={"w": TensorStorageMetadata(shape=(10,), is_sharded=True, dtype="F32", shard_spec_per_file=specs)},
        format_version=1,
        world_size=len(pieces),
        checksum_algorithm="crc32c",
        checksum_chunk_bytes=CHUNK_BYTES,
    )
    (dir / "metadata.json").write_bytes(meta.to_json_bytes())
    return str(dir)


def test_handmade_sound(tmp_path, capsys):
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 6), "rank_1.safetensors": (6, 10)})
    assert verify_checkpoint(dir) == []
    assert cli(capsys, "verify", dir, "-q") == (0, "", "")


def test_overlapping_pieces(tmp_path, capsys):
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 6), "rank_1.safetensors": (4, 10)})
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == ["tensor 'w': elements [4, 6) are in more than one piece (rank_0.safetensors and rank_1.safetensors)"]


def test_one_piece_in_two_files(tmp_path, capsys):
    """The same piece listed in two files: loads accept it as a replica, but a save of this
    library writes a piece once, so verify names it (no test had it: found by mutation)."""
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10), "rank_1.safetensors": (0, 10)})
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == ["tensor 'w': elements [0, 10) are in more than one piece (rank_0.safetensors and rank_1.safetensors)"]


def test_elements_in_no_file(tmp_path, capsys):
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 4), "rank_1.safetensors": (6, 9)})
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == ["tensor 'w': elements [4, 6) of 10 are in no file", "tensor 'w': elements [9, 10) of 10 are in no file"]


def test_trailing_bytes_make_an_invalid_safetensors_file(tmp_path, capsys):
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "rank_0.safetensors")
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"junk")
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert lines == [f"{path}: bytes [{size}, {size + 4}) after the last tensor belong to no tensor"]


def test_top_level_reports_each_part(ckpts, capsys, tmp_path):
    dir = copy(ckpts.ws1, tmp_path)
    os.remove(os.path.join(dir, "optim", "metadata.json"))
    code, lines, _ = problems_of(capsys, dir)
    assert code == 1
    assert len(lines) == 1 and os.path.join(dir, "optim", "metadata.json") in lines[0]


def test_wrong_checksum_count_and_unknown_algorithm(tmp_path, capsys):
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "metadata.json")
    meta = json.loads(open(path).read())
    meta["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"]["checksums"] = [1, 2]
    open(path, "w").write(json.dumps(meta))
    rank0 = os.path.join(dir, "rank_0.safetensors")
    assert problems_of(capsys, dir)[1] == [f"{rank0}: tensor 'w' has 2 checksums, expected 1 for 40 bytes"]
    meta["checksum_algorithm"] = "md5"
    open(path, "w").write(json.dumps(meta))
    assert problems_of(capsys, dir)[1] == [f"{path}: unknown checksum algorithm 'md5' (expected 'crc32c'); checksums not checked"]


def test_header_disagreement_is_found_before_a_box_is_expanded(tmp_path, monkeypatch):
    """A box of 2**20 rows (a range per row) that the file does not hold: one line for the
    disagreement, and its ranges never listed (the old order built them all, then reported
    every gap between them: for 2**24 rows 30 s and 5 GiB)."""
    import checkpointer.planning.pieces as plan  # where pieces are expanded into ranges

    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)}, checksums=False)
    rows = 1 << 20
    path = os.path.join(dir, "metadata.json")
    meta = json.loads(open(path).read())
    meta["tensors"]["w"]["shape"] = [rows, 2]
    meta["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"].update(
        flattened_offsets=None, local_shape=[rows, 1], global_offset=[0, 0]
    )
    open(path, "w").write(json.dumps(meta))
    expanded = []
    real_box_ranges = plan.box_ranges
    monkeypatch.setattr(plan, "box_ranges", lambda *a: expanded.append(len(r := real_box_ranges(*a))) or r)
    assert verify_checkpoint(dir) == [
        f"{os.path.join(dir, 'rank_0.safetensors')}: tensor 'w' is F32 x 10 in the file but F32 x {rows} in metadata.json"
    ]
    assert expanded == []


def test_a_box_the_file_holds_is_still_checked_for_coverage(tmp_path):
    """Pieces whose headers agree are expanded: a box leaving out a column is a gap per row."""
    dir = tmp_path / "box"
    dir.mkdir()
    save_file({"w": torch.zeros(3)}, str(dir / "rank_0.safetensors"))
    specs = {"rank_0.safetensors": TensorShardSpec(local_shape=(3, 1), global_offset=(0, 0))}
    meta = StorageMetadata(
        tensors={"w": TensorStorageMetadata(shape=(3, 2), is_sharded=True, dtype="F32", shard_spec_per_file=specs)},
        format_version=1,
        world_size=1,
    )
    (dir / "metadata.json").write_bytes(meta.to_json_bytes())
    assert verify_checkpoint(str(dir)) == [
        "tensor 'w': elements [1, 2) of 6 are in no file",
        "tensor 'w': elements [3, 4) of 6 are in no file",
        "tensor 'w': elements [5, 6) of 6 are in no file",
    ]


def test_a_flipped_byte_in_the_last_of_several_chunks(tmp_path):
    """Checksums per 16 bytes: a 40-byte piece has three chunks, the last one 8 bytes; a byte
    flipped in it is found (a mutant that skipped each piece's last chunk passed every test)."""
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "metadata.json")
    meta = json.loads(open(path).read())
    meta["checksum_chunk_bytes"] = 16
    data = torch.arange(10, dtype=torch.float32).numpy().tobytes()
    meta["tensors"]["w"]["shard_spec_per_file"]["rank_0.safetensors"]["checksums"] = chunk_crcs(memoryview(data), 16)
    open(path, "w").write(json.dumps(meta))
    assert verify_checkpoint(dir) == []
    rank0 = os.path.join(dir, "rank_0.safetensors")
    start = byte_offset(dir, "rank_0.safetensors", "w")
    with open(rank0, "r+b") as f:
        f.seek(start + 37)
        f.write(bytes([data[37] ^ 0x01]))
    assert verify_checkpoint(dir) == [
        f"{rank0}: checksum mismatch in tensor 'w', chunk 2 (file bytes [{start + 32}, {start + 40}))"
    ]


def test_one_trailing_byte_makes_an_invalid_safetensors_file(tmp_path):
    """A single byte after the last tensor is named (a mutant that let one byte through passed every test)."""
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "rank_0.safetensors")
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x00")
    assert verify_checkpoint(dir) == [f"{path}: bytes [{size}, {size + 1}) after the last tensor belong to no tensor"]


def test_one_stray_byte_before_a_tensor(tmp_path):
    """A file whose only tensor starts one byte into its data area (safetensors allows such a
    header): that byte is named (a mutant that let a one-byte gap through passed every test)."""
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "rank_0.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [10], "data_offsets": [1, 41]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + b"\x00" + torch.arange(10, dtype=torch.float32).numpy().tobytes())
    data_start = 8 + len(header)
    assert verify_checkpoint(dir) == [f"{path}: bytes [{data_start}, {data_start + 1}) before tensor 'w' belong to no tensor"]


def test_a_piece_stored_with_a_shape_not_flat(tmp_path):
    """Pieces are stored flat: the same 10 elements stored as [2, 5] are named (a mutant that
    dropped the check passed every test)."""
    dir = handmade(tmp_path, {"rank_0.safetensors": (0, 10)})
    path = os.path.join(dir, "rank_0.safetensors")
    save_file({"w": torch.arange(10, dtype=torch.float32).reshape(2, 5)}, path)
    assert verify_checkpoint(dir) == [f"{path}: tensor 'w' is stored with shape [2, 5], not flat [10]"]
