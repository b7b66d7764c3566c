"""``checkpointer inspect DIR [--json]`` on checkpoints of world size 1 and 3."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_helpers import cli

RANKS3 = ["rank_0.safetensors", "rank_1.safetensors", "rank_2.safetensors"]
CODES = {"torch.float32": "F32", "torch.int32": "I32", "torch.int64": "I64"}


def expected_rows(full, *, world_size, sharded_keys):
    rows = {}
    for key, t in full.items():
        if key == "head.weight":  # tied to embed.weight: saved once
            continue
        pieces = world_size if key in sharded_keys else 1
        rows[key] = {
            "shape": list(t.shape),
            "dtype": CODES[str(t.dtype)],
            "is_sharded": key in sharded_keys,
            "pieces": pieces,
            "numel": t.numel(),
            "bytes": t.numel() * t.element_size(),
        }
    return rows


@pytest.mark.parametrize("ws", [1, 3])
def test_inspect_json_model(ckpts, capsys, ws):
    path, full = (os.path.join(ckpts.ws1, "model"), ckpts.ws1_full) if ws == 1 else (os.path.join(ckpts.ws3, "model"), ckpts.ws3_full)
    code, out, err = cli(capsys, "inspect", path, "--json")
    assert (code, err) == (0, "")
    info = json.loads(out)
    sharded = {"embed.weight", "up.weight", "up.bias", "down.weight", "down.bias"} if ws == 3 else set()
    want = expected_rows(full, world_size=ws, sharded_keys=sharded)
    got = {t["key"]: {k: t[k] for k in ("shape", "dtype", "is_sharded", "pieces", "numel", "bytes")} for t in info["tensors"]}
    assert got == want
    for t in info["tensors"]:
        assert len(t["files"]) == t["pieces"]
        assert set(t["files"]) <= set(RANKS3[:ws])
        assert t["checksummed"] is True
        if t["pieces"] == ws:
            assert sorted(t["files"]) == RANKS3[:ws]
    assert info["aliases"] == {"head.weight": "embed.weight"}
    assert info["num_tensors"] == len(want)
    assert info["num_aliases"] == 1
    assert info["total_bytes"] == sum(r["bytes"] for r in want.values())
    assert info["format_version"] == 2
    assert info["world_size"] == ws
    assert info["files"] == RANKS3[:ws]
    assert info["path"] == os.path.abspath(path)


def test_inspect_table_top_level_covers_model_and_optim(ckpts, capsys):
    code, out, err = cli(capsys, "inspect", ckpts.ws3)
    assert (code, err) == (0, "")
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 2
    model, optim = blocks
    assert model.splitlines()[0] == f"checkpoint: {os.path.join(ckpts.ws3, 'model')} (model)"
    assert optim.splitlines()[0] == f"checkpoint: {os.path.join(ckpts.ws3, 'optim')} (optim)"
    rows = {line.split()[0]: line.split() for line in model.splitlines()[2:-1]}
    assert rows["up.weight"][:6] == ["up.weight", "[13,", "6]", "F32", "sharded,", "3"]
    assert rows["up.weight"][-1] == "rank_[0-2]"
    assert rows["scale"][1:7] == ["[6]", "F32", "whole,", "1", "piece", "24"]
    assert " ".join(rows["head.weight"]) == "head.weight tied to embed.weight -"
    total = model.splitlines()[-1]
    nbytes = sum(t.numel() * 4 for k, t in ckpts.ws3_full.items() if k != "head.weight")
    assert total == (
        f"total: 6 tensors (+1 tied), {nbytes} B ({nbytes} bytes) in 3 files; format version 2, saved with world size 3"
    )
    assert "state.up.weight.__exp_avg" in optim
    assert optim.splitlines()[-1].endswith("format version 2, saved with world size 3")


def test_inspect_json_top_level_has_both_parts(ckpts, capsys):
    code, out, _ = cli(capsys, "inspect", ckpts.ws1, "--json")
    assert code == 0
    info = json.loads(out)
    assert sorted(info) == ["model", "optim"]
    keys = {t["key"] for t in info["optim"]["tensors"]}
    assert {"num_param_groups", "param_group0", "state_keys", "state.embed.weight.__exp_avg"} <= keys
    assert info["model"]["world_size"] == info["optim"]["world_size"] == 1


def test_inspect_flat_sharded_pieces(ckpts, capsys):
    code, out, _ = cli(capsys, "inspect", ckpts.flat3, "--json")
    assert code == 0
    info = json.loads(out)
    got = {t["key"]: (t["shape"], t["dtype"], t["pieces"], t["bytes"], t["is_sharded"]) for t in info["tensors"]}
    assert got == {"b": ([20], "I32", 3, 80, True), "w": ([5, 8], "F32", 3, 160, True)}
    assert info["aliases"] == {} and info["num_aliases"] == 0


def test_inspect_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    code, out, err = cli(capsys, "inspect", str(tmp_path))
    assert code == 1 and out == ""
    assert err == (
        f"checkpointer: error: {tmp_path} is not a checkpoint: it holds no metadata.json (missing, or its save "
        "never finished) and no model/ or optim/ sub-directory\n"
    )
    code, out, err = cli(capsys, "inspect", str(tmp_path / "nowhere"))
    assert (code, out) == (1, "")
    assert err == f"checkpointer: error: {tmp_path / 'nowhere'} does not exist or is empty: no checkpoint there\n"


def test_inspect_a_file_says_it_is_a_file(ckpts, capsys, tmp_path):
    """DIR naming a file (a rank file, an exported .safetensors) is refused with the right reason."""
    rank_file = os.path.join(ckpts.ws1, "model", "rank_0.safetensors")
    for command in ("inspect", "verify"):
        code, out, err = cli(capsys, command, rank_file)
        reason = f"{rank_file} is a file, not a checkpoint directory (one holding metadata.json, or model/ and optim/)\n"
        assert code == 1
        if command == "inspect":
            assert (out, err) == ("", f"checkpointer: error: {reason}")
        else:  # verify lists its problems, then sums them up
            assert (out, err) == (reason, f"checkpointer: error: 1 problem found in {rank_file}\n")


HOSTILE_KEYS = {
    "w\x1b]0;pwned\x07\x1b[2J": r"w\x1b]0;pwned\x07\x1b[2J",  # set the title, clear the screen
    "a\nfake.row  [1]  F32": r"a\nfake.row  [1]  F32",  # a line of its own
    "b\r\u202eevil": r"b\r\u202eevil",  # carriage return, right-to-left override
    "é.ok": "é.ok",  # printable non-ASCII stays as it is
}


def test_inspect_escapes_non_printable_characters_in_keys(tmp_path, capsys):
    """Keys are a stranger's text: the table shows their non-printable characters escaped."""
    from checkpointer import Checkpointer

    path = str(tmp_path / "ckpt")
    state = {key: torch.ones(1) for key in HOSTILE_KEYS}
    state["plain"] = torch.ones(1)
    Checkpointer().save(path, state)
    # An alias (a tied name) and its target are printed too.
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    meta["aliases"] = {"tied\x1b[5m": "plain"}
    with open(meta_file, "w") as f:
        json.dump(meta, f)

    code, out, err = cli(capsys, "inspect", path)
    assert (code, err) == (0, "")
    assert all(ch.isprintable() for ch in out.replace("\n", ""))
    lines = out.splitlines()
    assert len(lines) == 2 + len(state) + 1 + 1  # head, column names, tensors, the alias, total
    for shown in [*HOSTILE_KEYS.values(), "plain", r"tied\x1b[5m"]:
        assert sum(line.startswith(shown + " ") for line in lines[2:-1]) == 1, shown

    code, out, _ = cli(capsys, "inspect", path, "--json")  # JSON escapes them itself
    assert code == 0 and "\x1b" not in out
    assert {t["key"] for t in json.loads(out)["tensors"]} == set(state)


def test_error_line_escapes_non_printable_characters(tmp_path, capsys):
    """The one error line (which quotes names from the checkpoint, or here the path) stays one plain line."""
    where = str(tmp_path / "x\x1b[2Jy")
    code, out, err = cli(capsys, "inspect", where)
    assert (code, out) == (1, "")
    assert err == f"checkpointer: error: {tmp_path}/x\\x1b[2Jy does not exist or is empty: no checkpoint there\n"


def test_inspect_counts_bytes_by_item_size(tmp_path, capsys):
    """Tensors of 1, 2 and 8 bytes an element (the other tests' were all 4: a mutant that counted
    4 bytes an element passed every test)."""
    from checkpointer import Checkpointer

    path = str(tmp_path / "ckpt")
    state = {"h": torch.ones(3, dtype=torch.bfloat16), "d": torch.ones(5, dtype=torch.float64), "m": torch.ones(7, dtype=torch.bool)}
    Checkpointer().save(path, state)
    code, out, err = cli(capsys, "inspect", path, "--json")
    assert (code, err) == (0, "")
    info = json.loads(out)
    assert {t["key"]: (t["dtype"], t["numel"], t["bytes"]) for t in info["tensors"]} == {
        "h": ("BF16", 3, 6), "d": ("F64", 5, 40), "m": ("BOOL", 7, 7)
    }
    assert info["total_bytes"] == 53


def test_inspect_a_tensor_checksummed_in_some_files_only(tmp_path, capsys):
    """A format-1 tensor is checksummed only when every piece lists its checksums (a mutant
    that took any piece's passed every test)."""
    from checkpointer.checksums import CHUNK_BYTES, chunk_crcs
    from checkpointer.format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
    from safetensors.torch import save_file

    full = torch.arange(10, dtype=torch.float32)
    specs = {}
    for name, (s, e), crcs in (("rank_0.safetensors", (0, 6), True), ("rank_1.safetensors", (6, 10), False)):
        save_file({"w": full[s:e].clone(), "v": full[s:e].clone()}, str(tmp_path / name))
        specs[name] = TensorShardSpec(flattened_offsets=((s, e),), checksums=tuple(chunk_crcs(memoryview(full[s:e].numpy().tobytes()))))
    partly = {**specs, "rank_1.safetensors": specs["rank_1.safetensors"].model_copy(update={"checksums": None})}
    tensors = {
        "v": TensorStorageMetadata(shape=(10,), is_sharded=True, dtype="F32", shard_spec_per_file=specs),
        "w": TensorStorageMetadata(shape=(10,), is_sharded=True, dtype="F32", shard_spec_per_file=partly),
    }
    meta = StorageMetadata(tensors=tensors, format_version=1, world_size=2, checksum_algorithm="crc32c", checksum_chunk_bytes=CHUNK_BYTES)
    (tmp_path / "metadata.json").write_bytes(meta.to_json_bytes())
    code, out, err = cli(capsys, "inspect", str(tmp_path), "--json")
    assert (code, err) == (0, "")
    assert {t["key"]: t["checksummed"] for t in json.loads(out)["tensors"]} == {"v": True, "w": False}
