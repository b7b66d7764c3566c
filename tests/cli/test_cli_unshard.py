"""``checkpointer unshard DIR OUT`` and ``export_safetensors``: equal to ``unshard_model_state``, streamed."""

from __future__ import annotations

import hashlib
import json
import os
import weakref

import pytest
import torch
from cli_helpers import assert_same_tensors, cli, without
from cli_workers import export_ws
from safetensors import safe_open
from safetensors.torch import load_file

import checkpointer
from checkpointer import export_safetensors, unshard_model_state
from checkpointer.tools import checkpoint_tensors
from checkpointer.engine import reader as reader_module
from checkpointer.tools import export as export_module
from checkpointer.tools.convert import convert

TIED = ["head.weight"]


def top_dir(ckpts, ws: int) -> str:
    return ckpts.ws1 if ws == 1 else ckpts.ws3


def read_dir(out: str) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(out, name))
        assert {k for k, v in index["weight_map"].items() if v == name} == set(part)
        tensors.update(part)
    return index, tensors


@pytest.mark.parametrize("ws", [1, 3])
def test_unshard_one_file_equals_unshard_model_state(ckpts, capsys, tmp_path, ws):
    out = str(tmp_path / "model.safetensors")
    code, stdout, err = cli(capsys, "unshard", top_dir(ckpts, ws), out)
    assert (code, err) == (0, "")
    assert stdout.startswith("wrote 1 file (") and stdout.endswith(f") to {out}\n")
    want = unshard_model_state(top_dir(ckpts, ws), no_dist=True)
    assert_same_tensors(load_file(out), without(want, TIED))
    assert_same_tensors(without(want, []), ckpts.ws1_full if ws == 1 else ckpts.ws3_full)
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("ws", [1, 3])
def test_unshard_to_hf_shards(ckpts, capsys, tmp_path, ws):
    out = str(tmp_path / "hf")
    code, _, err = cli(capsys, "unshard", os.path.join(top_dir(ckpts, ws), "model"), out, "--max-shard-size", "300B")
    assert (code, err) == (0, "")
    index, got = read_dir(out)
    want = without(unshard_model_state(top_dir(ckpts, ws), no_dist=True), TIED)
    assert_same_tensors(got, want)
    files = sorted(os.listdir(out))
    n = len(files) - 1
    assert n >= 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + ["model.safetensors.index.json"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    for name in files[:-1]:
        part = load_file(os.path.join(out, name))
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        assert nbytes <= 300 or len(part) == 1
    if hasattr(checkpointer, "lazy_load"):
        assert_same_tensors(dict(checkpointer.lazy_load(out)), want)


def test_unshard_dtype_and_keys(ckpts, capsys, tmp_path):
    out = str(tmp_path / "bf16.safetensors")
    code, _, _ = cli(capsys, "unshard", ckpts.ws3, out, "--dtype", "bf16", "--keys", r"^(up|down)\.|scale")
    assert code == 0
    want = {k: v.to(torch.bfloat16) for k, v in ckpts.ws3_full.items() if k.startswith(("up.", "down.")) or k == "scale"}
    assert_same_tensors(load_file(out), want)
    # Only the tied name matches: its data is written under that name.
    out = str(tmp_path / "head.safetensors")
    assert cli(capsys, "unshard", ckpts.ws1, out, "--keys", "^head")[0] == 0
    assert_same_tensors(load_file(out), {"head.weight": ckpts.ws1_full["embed.weight"]})


def test_unshard_optimizer_ints_keep_their_dtype(ckpts, tmp_path):
    out = str(tmp_path / "optim.safetensors")
    export_safetensors(os.path.join(ckpts.ws1, "optim"), out, dtype=torch.float16)
    got = load_file(out)
    assert got["num_param_groups"].dtype == torch.int64
    assert got["state_keys"].dtype == torch.uint8
    assert got["state.up.weight.__exp_avg"].dtype == torch.float16


def test_unshard_errors(ckpts, capsys, tmp_path):
    code, out, err = cli(capsys, "unshard", ckpts.ws1, str(tmp_path / "x.safetensors"), "--keys", "^nothing$")
    assert (code, out) == (1, "")
    assert err == f"checkpointer: error: no tensor of {os.path.join(ckpts.ws1, 'model')} matches --keys '^nothing$'\n"
    code, _, err = cli(capsys, "unshard", ckpts.ws1, str(tmp_path / "d"), "--max-shard-size", "lots")
    assert code == 1 and err.startswith("checkpointer: error: cannot read 'lots' as a size")
    code, _, err = cli(capsys, "unshard", ckpts.ws1, str(tmp_path / "d"), "--dtype", "int3")
    assert code == 1 and err == "checkpointer: error: unknown dtype 'int3': use bf16, fp16, fp32 or fp64\n"
    code, _, err = cli(capsys, "unshard", ckpts.ws1, str(tmp_path / "d"), "--keys", "(")
    assert code == 1 and err.startswith("checkpointer: error: --keys '(' is not a valid regular expression: ")
    assert not os.path.exists(tmp_path / "d")


def test_export_streams_one_tensor_at_a_time(ckpts, tmp_path, monkeypatch):
    alive: list[weakref.ref] = []
    most = [0]
    fetch = checkpoint_tensors.CheckpointTensors.fetch

    def tracking_fetch(self, key):
        live = sum(1 for r in alive if r() is not None)
        most[0] = max(most[0], live)
        t = fetch(self, key)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(checkpoint_tensors.CheckpointTensors, "fetch", tracking_fetch)
    export_safetensors(ckpts.ws3, str(tmp_path / "out"), max_shard_size="100B", dtype="bf16")
    assert len(alive) == 6
    assert most[0] == 0  # each tensor was released before the next one was read
    assert all(r() is None for r in alive)


def test_export_in_three_processes_equals_one(ckpts, tmp_path, run_distributed):
    alone = str(tmp_path / "alone")
    files = export_safetensors(ckpts.ws3, alone, max_shard_size="200B")
    together = str(tmp_path / "together")
    per_rank = run_distributed(export_ws, 3, ckpts.ws3, together, "200B", timeout=300)
    written = [sorted(os.path.basename(f) for f in files) for files in per_rank]
    assert all(written), written  # every rank wrote a share
    assert sorted(sum(written, [])) == sorted(os.listdir(together))
    assert sorted(os.path.basename(f) for f in files) == sorted(os.listdir(alone))
    assert "model.safetensors.index.json" in written[0]

    def digest(d):
        return {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest() for n in os.listdir(d)}

    assert digest(together) == digest(alone)


def test_export_replaces_an_earlier_export(ckpts, tmp_path):
    out = str(tmp_path / "out")
    export_safetensors(ckpts.ws1, out, max_shard_size="100B")
    many = len(os.listdir(out))
    export_safetensors(ckpts.ws1, out)
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert many > 3
    _, got = read_dir(out)
    assert_same_tensors(got, without(ckpts.ws1_full, TIED))


def test_parse_size_and_dtype():
    assert export_module.parse_size("5GB") == 5 * 10**9
    assert export_module.parse_size("2GiB") == 2 * 2**30
    assert export_module.parse_size("500mb") == 500 * 10**6
    assert export_module.parse_size("1.5KB") == 1500
    assert export_module.parse_size(123) == 123
    for bad in ("", "GB", "-1", "0", "5XB"):
        with pytest.raises(ValueError):
            export_module.parse_size(bad)
    assert [export_module.parse_dtype(x) for x in ("bf16", "float16", torch.float32, "F64", None)] == [
        "BF16", "F16", "F32", "F64", None,
    ]
    for bad in ("int8", torch.int8, torch.int64, torch.bool, torch.uint8):
        with pytest.raises(ValueError, match="bf16"):
            export_module.parse_dtype(bad)


def test_export_refuses_a_dtype_that_is_not_floating_point(tmp_path):
    """``dtype=torch.int8`` would truncate every weight to an integer: refused like ``"int8"``."""
    checkpointer.Checkpointer().save(str(tmp_path / "ck"), {"w": torch.randn(4, 3)})
    with pytest.raises(ValueError, match="torch.int8"):
        export_safetensors(str(tmp_path / "ck"), str(tmp_path / "out.safetensors"), dtype=torch.int8)
    assert not os.path.exists(tmp_path / "out.safetensors")


def _flip_byte_of(path: str, key: str, at: float) -> None:
    """Flip one bit inside ``key``'s data in a safetensors file, ``at`` (0..1) of the way in."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(n))[key]["data_offsets"]
        pos = 8 + n + begin + int((end - begin - 1) * at)
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x04]))


@pytest.mark.parametrize("block", [100, 4096])
@pytest.mark.parametrize("ws", [1, 3])
def test_export_in_many_blocks_per_tensor_equals_the_checkpoint(ckpts, tmp_path, monkeypatch, ws, block):
    """Tensors streamed in several blocks each (the tests' tensors fit in one 4 MiB block)."""
    monkeypatch.setattr(reader_module, "_STREAM_BLOCK", block)
    out = str(tmp_path / "model.safetensors")
    export_safetensors(top_dir(ckpts, ws), out)
    assert_same_tensors(load_file(out), without(ckpts.ws1_full if ws == 1 else ckpts.ws3_full, TIED))


@pytest.mark.parametrize("block", [None, 100])
@pytest.mark.parametrize("at", [0.0, 0.5, 1.0])
def test_export_catches_a_flipped_bit_while_streaming(ckpts, tmp_path, monkeypatch, at, block):
    import shutil

    if block is not None:
        monkeypatch.setattr(reader_module, "_STREAM_BLOCK", block)

    src = str(tmp_path / "ckpt")
    shutil.copytree(ckpts.ws3, src)
    rank_file = os.path.join(src, "model", "rank_1.safetensors")
    with safe_open(rank_file, "pt") as f:
        key = max(f.keys(), key=lambda k: f.get_slice(k).get_shape()[0] if f.get_slice(k).get_shape() else 0)
    _flip_byte_of(rank_file, key, at)
    out = str(tmp_path / "model.safetensors")
    with pytest.raises(checkpointer.CorruptCheckpointError, match=f"rank_1.safetensors.*checksum mismatch in tensor '{key}'"):
        export_safetensors(src, out)
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".model.safetensors")]


@pytest.mark.parametrize("block", [None, 100])
def test_export_and_inspect_of_format2_use_the_checksums_in_the_rank_files(ckpts, tmp_path, capsys, monkeypatch, block):
    """Format 2 lists no checksums in metadata.json: export reads each file's own (a flipped bit
    fails), and inspect says every tensor is checksummed."""
    import shutil

    if block is not None:
        monkeypatch.setattr(reader_module, "_STREAM_BLOCK", block)
    src = str(tmp_path / "ckpt")
    shutil.copytree(ckpts.ws3, src)
    meta = json.loads(open(os.path.join(src, "model", "metadata.json")).read())
    assert meta["format_version"] == 2 and meta["checksums_in_files"] is True
    assert all(
        spec.get("checksums") is None for t in meta["tensors"].values() for spec in t.get("shard_spec_per_file", {}).values()
    )
    code, out, _ = cli(capsys, "inspect", os.path.join(src, "model"), "--json")
    assert code == 0 and all(t["checksummed"] is True for t in json.loads(out)["tensors"])
    _flip_byte_of(os.path.join(src, "model", "rank_2.safetensors"), "down.weight", 0.5)
    out_file = str(tmp_path / "model.safetensors")
    with pytest.raises(checkpointer.CorruptCheckpointError, match="rank_2.safetensors.*checksum mismatch in tensor 'down.weight'"):
        export_safetensors(src, out_file)
    assert not os.path.exists(out_file)
    code, _, err = cli(capsys, "unshard", src, out_file, "-q")
    assert code == 1 and "checksum mismatch in tensor 'down.weight'" in err, err


def test_export_keys_as_a_list_of_names(ckpts, tmp_path):
    """``keys`` may also be the names to export (as a user of ``keys=`` expects), not only a regex."""
    out = str(tmp_path / "two.safetensors")
    export_safetensors(ckpts.ws3, out, keys=["up.weight", "scale"])
    assert_same_tensors(load_file(out), {k: ckpts.ws3_full[k] for k in ("up.weight", "scale")})
    out = str(tmp_path / "head.safetensors")  # only the tied name: its data under that name
    export_safetensors(ckpts.ws1, out, keys=("head.weight",))
    assert_same_tensors(load_file(out), {"head.weight": ckpts.ws1_full["embed.weight"]})
    with pytest.raises(ValueError, match=r"^keys not in the checkpoint at .*: \['nope'\]$"):
        export_safetensors(ckpts.ws1, str(tmp_path / "x.safetensors"), keys=["up.weight", "nope"])
    assert not os.path.exists(tmp_path / "x.safetensors")


@pytest.mark.parametrize("argv", [("unshard", "{ck}", ""), ("unshard", "", "{out}"), ("convert", "{ck}", " ", "--to", "dcp")])
def test_an_empty_path_is_refused(ckpts, capsys, tmp_path, monkeypatch, argv):
    """An empty output path used to mean the current directory: HF shards written into it."""
    monkeypatch.chdir(tmp_path)
    argv = [a.format(ck=top_dir(ckpts, 1), out=str(tmp_path / "m.safetensors")) for a in argv]
    code, stdout, err = cli(capsys, *argv)
    assert (code, stdout) == (1, "")
    assert "the path is empty" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_one_file_export_longer_than_the_timeout_under_a_process_group(tmp_path, run_distributed):
    """Under torchrun a one-file export is rank 0's work alone; the other ranks waited for it in a
    collective bounded by CHECKPOINTER_TIMEOUT_S, so every export longer than that (300 s: any
    large model) failed on all ranks with 'rank 0 stopped answering' though rank 0 was writing."""
    from cli_workers import export_one_file_slowly

    src = str(tmp_path / "ck")
    checkpointer.Checkpointer().save(src, {"a": torch.arange(6.0), "b": torch.ones(2, 3)})
    out = str(tmp_path / "one.safetensors")
    per_rank = run_distributed(export_one_file_slowly, 2, src, out, "2", 2.5, timeout=120)
    assert per_rank == [[out], []]
    assert_same_tensors(load_file(out), {"a": torch.arange(6.0), "b": torch.ones(2, 3)})


def test_export_data_starts_on_a_64_byte_boundary(ckpts, tmp_path):
    one = str(tmp_path / "one.safetensors")
    export_safetensors(ckpts.ws1, one)
    shards = str(tmp_path / "shards")
    export_safetensors(ckpts.ws1, shards, max_shard_size="300B")
    files = [one] + [os.path.join(shards, n) for n in sorted(os.listdir(shards)) if n.endswith(".safetensors")]
    assert len(files) > 3
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        assert (8 + n) % 64 == 0, path
        ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        assert ends[0][0] == 0 and os.path.getsize(path) == 8 + n + ends[-1][1], path


def test_export_refuses_to_write_over_a_file_of_its_checkpoint(tmp_path, capsys):
    """Found by a review: ``unshard ck ck/rank_0.safetensors`` replaced the rank file it read."""
    ck = tmp_path / "ck"
    model = torch.nn.Linear(4, 4)
    checkpointer.save_model_and_optim_state(str(ck), model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = (ck / "model" / "rank_0.safetensors").read_bytes()
    os.symlink(ck / "model", tmp_path / "link")
    for out in (ck / "model" / "rank_0.safetensors", tmp_path / "link" / "rank_0.safetensors"):
        code, _, err = cli(capsys, "unshard", str(ck), str(out))
        assert code == 1 and f"{out} is a file of the checkpoint it would export ({ck}/model)" in err, err
    with pytest.raises(checkpointer.CheckpointError, match="is a file of the checkpoint"):
        convert(str(ck / "model"), str(ck / "model" / "rank_0.safetensors"), to="hf")
    assert (ck / "model" / "rank_0.safetensors").read_bytes() == before
    export_safetensors(str(ck), str(ck / "model" / "export.safetensors"))  # another name beside them is fine
    assert_same_tensors(load_file(str(ck / "model" / "export.safetensors")), model.state_dict())
