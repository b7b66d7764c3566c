"""``checkpointer convert SRC DST --to {checkpointer,dcp,hf}`` in each direction; DCP needs --allow-pickle."""

from __future__ import annotations

import os
import pathlib
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import assert_same_tensors, cli, without
from safetensors.torch import load_file

from checkpointer import Checkpointer, CorruptCheckpointError
from checkpointer.tools.dcp import read_dcp_metadata

TIED = ["head.weight"]


def load_dcp(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole (test code may unpickle its own files)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(path).read_metadata()
    out = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def unshard(path: str) -> dict[str, torch.Tensor]:
    return Checkpointer().unshard(path, no_dist=True)


@pytest.fixture(scope="module")
def dcp1(ckpts, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dcp1") / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(ckpts.ws1_full), checkpoint_id=path, no_dist=True)
    return path


def test_dcp_source_needs_allow_pickle(dcp1, capsys, tmp_path):
    code, out, err = cli(capsys, "convert", dcp1, str(tmp_path / "ours"), "--to", "checkpointer")
    assert (code, out) == (1, "")
    assert err == (
        f"checkpointer: error: {dcp1}/.metadata is a Python pickle, and unpickling can run arbitrary code: "
        "pass --allow-pickle (allow_pickle=True) only for a DCP checkpoint you trust\n"
    )
    assert not (tmp_path / "ours").exists()


def test_hostile_dcp_metadata_is_never_run_without_allow_pickle(capsys, tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
    for to in ("checkpointer", "hf", "dcp"):
        code, _, err = cli(capsys, "convert", str(src), str(tmp_path / f"out-{to}"), "--to", to)
        assert code == 1 and "--allow-pickle" in err
    assert not marker.exists()


@pytest.mark.parametrize("ws", [1, 3])
def test_dcp_to_ours_to_dcp_round_trip(ckpts, dcp1, capsys, tmp_path, ws):
    src = dcp1 if ws == 1 else ckpts.dcp3
    full = ckpts.ws1_full if ws == 1 else ckpts.ws3_full
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    code, out, err = cli(capsys, "convert", src, ours, "--to", "checkpointer", "--allow-pickle")
    assert (code, err) == (0, "")
    assert out == f"wrote 2 files ({_size(ours)}) to {ours}\n"
    assert_same_tensors(unshard(ours), full)  # DCP holds the tied name too
    assert cli(capsys, "verify", ours, "-q") == (0, "", "")
    assert cli(capsys, "convert", ours, back, "--to", "dcp")[0] == 0
    assert_same_tensors(load_dcp(back), load_dcp(src))


def _size(path: str) -> str:
    from checkpointer.progress import format_bytes

    return format_bytes(sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)))


def test_ours_to_dcp_to_ours_keeps_tied_names(ckpts, capsys, tmp_path):
    mid, back = str(tmp_path / "dcp"), str(tmp_path / "back")
    note = f"checkpointer: note: only the model is converted: the optimizer state in {ckpts.ws3}/optim is not\n"
    assert cli(capsys, "convert", ckpts.ws3, mid, "--to", "dcp", "-q") == (0, "", note)
    assert_same_tensors(load_dcp(mid), ckpts.ws3_full)
    assert cli(capsys, "convert", f"{ckpts.ws3}/model", str(tmp_path / "dcp2"), "--to", "dcp", "-q") == (0, "", "")
    assert cli(capsys, "convert", mid, back, "--to", "checkpointer", "--allow-pickle", "-q") == (0, "", "")
    assert_same_tensors(unshard(back), ckpts.ws3_full)


@pytest.mark.parametrize("ws", [1, 3])
def test_ours_to_hf_to_ours(ckpts, capsys, tmp_path, ws):
    src = ckpts.ws1 if ws == 1 else ckpts.ws3
    full = ckpts.ws1_full if ws == 1 else ckpts.ws3_full
    hf, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert cli(capsys, "convert", src, hf, "--to", "hf", "--max-shard-size", "256B", "-q")[0] == 0
    assert len(os.listdir(hf)) > 3
    assert cli(capsys, "convert", hf, back, "--to", "checkpointer", "-q")[0] == 0
    assert_same_tensors(unshard(back), without(full, TIED))
    one = str(tmp_path / "one.safetensors")
    assert cli(capsys, "convert", back, one, "--to", "hf", "-q")[0] == 0
    assert_same_tensors(load_file(one), without(full, TIED))


def test_hf_dcp_both_ways(ckpts, capsys, tmp_path):
    hf, mid, again = str(tmp_path / "model.safetensors"), str(tmp_path / "dcp"), str(tmp_path / "hf")
    assert cli(capsys, "convert", ckpts.dcp3, hf, "--to", "hf", "--allow-pickle", "--dtype", "bf16", "-q")[0] == 0
    want = {k: v.to(torch.bfloat16) for k, v in ckpts.ws3_full.items()}
    assert_same_tensors(load_file(hf), want)
    assert cli(capsys, "convert", hf, mid, "--to", "dcp", "-q")[0] == 0
    assert_same_tensors(load_dcp(mid), want)
    assert cli(capsys, "convert", mid, again, "--to", "hf", "--allow-pickle", "-q")[0] == 0
    assert_same_tensors(load_file(os.path.join(again, "model-00001-of-00001.safetensors")), want)


def test_non_tensor_dcp_entries_are_named(capsys, tmp_path):
    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), "note": {"lr": 0.1}}, checkpoint_id=src, no_dist=True)
    code, _, err = cli(capsys, "convert", src, str(tmp_path / "ours"), "--to", "checkpointer", "--allow-pickle")
    assert code == 0
    assert err == f"checkpointer: note: 1 non-tensor entries of {src} were not converted: 'note.lr'\n"
    assert_same_tensors(unshard(str(tmp_path / "ours")), {"w": torch.arange(4.0)})


def test_convert_refuses_to_overwrite(ckpts, capsys, tmp_path):
    dst = str(tmp_path / "ours")
    assert cli(capsys, "convert", ckpts.flat3, dst, "--to", "checkpointer", "-q")[0] == 0
    code, _, err = cli(capsys, "convert", ckpts.flat3, dst, "--to", "checkpointer")
    assert code == 1
    assert err == (
        f"checkpointer: error: {dst}/metadata.json exists: a checkpoint is already saved there "
        "(pass --overwrite to replace it)\n"
    )
    assert cli(capsys, "convert", ckpts.flat3, dst, "--to", "checkpointer", "--overwrite", "-q")[0] == 0
    assert_same_tensors(unshard(dst), ckpts.flat3_full)


def test_convert_refuses_to_write_over_its_own_source(ckpts, capsys, tmp_path):
    """With --overwrite, the source's metadata.json went before it was read: a failure part-way
    left the source unreadable (a review's suspicion, confirmed)."""
    src = str(tmp_path / "ours")
    assert cli(capsys, "convert", ckpts.flat3, src, "--to", "checkpointer", "-q")[0] == 0
    link = str(tmp_path / "link")  # the same directory by another name
    os.symlink(src, link)
    for target in ("checkpointer", "dcp", "hf", "olmo"):
        for dst in (src + "/", link):
            code, _, err = cli(capsys, "convert", src, dst, "--to", target, "--overwrite")
            assert code == 1 and "is the source itself" in err and dst in err, err
    assert sorted(os.listdir(src)) == ["metadata.json", "rank_0.safetensors"]
    assert_same_tensors(unshard(src), ckpts.flat3_full)


def test_convert_unknown_source(capsys, tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    code, _, err = cli(capsys, "convert", str(tmp_path), str(tmp_path / "x"), "--to", "hf")
    assert code == 1
    assert err.startswith(f"checkpointer: error: cannot tell the format of {tmp_path}: expected metadata.json")
    code, _, err = cli(capsys, "convert", str(tmp_path), str(tmp_path / "x"), "--to", "safetensors")
    assert code == 2 and "invalid choice: 'safetensors'" in err


def test_only_the_dcp_reader_unpickles(monkeypatch, tmp_path):
    """No pickle.load(s) in the package; DCP's metadata reader is called from one function only,
    and only once the caller allowed it."""
    root = pathlib.Path(__file__).resolve().parents[2] / "checkpointer"
    loads, dcp_reads = [], []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bpickle\.loads?\(", line):
                loads.append(f"{path.relative_to(root)}:{number}")
            if re.search(r"FileSystemReader\(.*\)\.read_metadata\(", line):
                dcp_reads.append(f"{path.relative_to(root)}: {line.strip()}")
    assert loads == []
    assert dcp_reads == ["tools/dcp.py: return FileSystemReader(path).read_metadata()"]

    from checkpointer.errors import CheckpointError
    from checkpointer.tools import dcp as dcp_module

    def refuse(path):
        raise AssertionError("unpickled without allow_pickle")

    monkeypatch.setattr(dcp_module, "_read_trusted_dcp_metadata", refuse)
    (tmp_path / ".metadata").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="allow-pickle"):
        dcp_module.read_dcp_metadata(str(tmp_path))
    with pytest.raises(CheckpointError, match="unpickled without") as raised:  # the reader ran, its error wrapped
        dcp_module.read_dcp_metadata(str(tmp_path), allow_pickle=True)
    assert isinstance(raised.value.__cause__, AssertionError)


@pytest.mark.parametrize("damage", ["dict", "truncated", "text"])
def test_damaged_dcp_metadata_is_one_line_error(dcp1, capsys, tmp_path, damage):
    """With --allow-pickle, a .metadata that does not unpickle to DCP's Metadata is a one-line
    CorruptCheckpointError naming the file, not a traceback."""
    import pickle

    src = tmp_path / "dcp"
    src.mkdir()
    real = (pathlib.Path(dcp1) / ".metadata").read_bytes()
    data = {"dict": pickle.dumps({"state_dict_metadata": {}}), "truncated": real[: len(real) // 2], "text": b"garbage\n"}
    (src / ".metadata").write_bytes(data[damage])
    code, out, err = cli(capsys, "convert", str(src), str(tmp_path / "ours"), "--to", "checkpointer", "--allow-pickle")
    assert (code, out) == (1, "")
    assert err.startswith(f"checkpointer: error: {src}/.metadata: not a torch DCP metadata file (")
    assert err.count("\n") == 1
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{src}/.metadata: not a torch DCP metadata file")):
        read_dcp_metadata(str(src), allow_pickle=True)


def test_damaged_dcp_data_is_one_line_error(dcp1, capsys, tmp_path):
    """A DCP data file that cannot be read is a one-line error naming the source (DCP raises a
    BaseException for it), and the failed convert leaves DST free for the next one."""
    import shutil

    src, dst = tmp_path / "dcp", str(tmp_path / "ours")
    shutil.copytree(dcp1, src)
    for data in src.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:10])
    code, out, err = cli(capsys, "convert", str(src), dst, "--to", "checkpointer", "--allow-pickle")
    assert (code, out) == (1, "")
    assert err.startswith(f"checkpointer: error: {src}: cannot read tensor ")
    assert err.count("\n") == 1
    for to, out_path in (("dcp", tmp_path / "dcp-out"), ("hf", tmp_path / "out.safetensors")):
        code, out, again = cli(capsys, "convert", str(src), str(out_path), "--to", to, "--allow-pickle")
        assert (code, out) == (1, ""), to
        assert again.startswith(f"checkpointer: error: {src}: cannot read tensor ") and again.count("\n") == 1, to
    shutil.rmtree(src)
    shutil.copytree(dcp1, src)
    assert cli(capsys, "convert", str(src), dst, "--to", "checkpointer", "--allow-pickle", "-q") == (0, "", "")
    assert_same_tensors(unshard(dst), load_dcp(dcp1))


@pytest.mark.parametrize("to, out", [("checkpointer", "ours"), ("hf", "m.safetensors")])
def test_a_dcp_tensor_named_as_safetensors_metadata_is_refused_before_writing(capsys, tmp_path, to, out):
    """DCP takes any key; a safetensors file reserves ``__metadata__`` (found by a review: the HF
    file came out unreadable; the checkpoint's save lock stayed behind)."""
    src, dst = str(tmp_path / "dcp"), str(tmp_path / out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"__metadata__": torch.ones(3), "w": torch.arange(4.0)}, checkpoint_id=src, no_dist=True)
    code, _, err = cli(capsys, "convert", src, dst, "--to", to, "--allow-pickle")
    assert code == 1 and "cannot write the tensor '__metadata__'" in err and "reserves the name" in err, err
    assert not os.path.exists(dst) or os.listdir(dst) == []
    if to == "checkpointer":  # nothing left to refuse the next convert
        Checkpointer().save(str(tmp_path / "good"), {"v": torch.ones(2)})
        assert cli(capsys, "convert", str(tmp_path / "good"), dst, "--to", to, "-q") == (0, "", "")


def test_failed_convert_leaves_no_lock(ckpts, capsys, tmp_path):
    """A convert that fails while writing (a source tensor fails its checksum) releases DST's save
    lock, as a failed save does: the next convert into DST needs no --overwrite."""
    import shutil

    src, dst = tmp_path / "src", str(tmp_path / "ours")
    shutil.copytree(ckpts.flat3, src)
    rank_file = src / "rank_0.safetensors"
    good = rank_file.read_bytes()
    rank_file.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    code, _, err = cli(capsys, "convert", str(src), dst, "--to", "checkpointer")
    assert code == 1 and err.startswith(f"checkpointer: error: {rank_file}: checksum mismatch")
    assert os.listdir(dst) == []
    code, _, err = cli(capsys, "convert", str(src), str(tmp_path / "dcp"), "--to", "dcp")
    assert code == 1 and re.fullmatch(f"checkpointer: error: {re.escape(str(rank_file))}: checksum mismatch in tensor '[^']+', chunk 0\n", err)
    rank_file.write_bytes(good)
    assert cli(capsys, "convert", str(src), dst, "--to", "checkpointer", "-q") == (0, "", "")
    assert_same_tensors(unshard(dst), ckpts.flat3_full)


def test_convert_a_file_it_cannot_read_says_so(capsys, tmp_path):
    """A SRC file that is not .safetensors is named as such, not as missing."""
    src = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    code, out, err = cli(capsys, "convert", str(src), str(tmp_path / "x"), "--to", "checkpointer")
    assert (code, out) == (1, "")
    assert err == (
        f"checkpointer: error: cannot tell the format of {src}: it is a file; expected a directory "
        "(checkpointer, torch DCP, Hugging Face) or a .safetensors file\n"
    )


def test_failed_dcp_overwrite_retires_the_old_checkpoint(capsys, tmp_path):
    """``--to dcp --overwrite`` rewrites DST's data files in place. When it fails half-way, the old
    ``.metadata`` must not be left indexing files that now hold the new tensors: it is removed
    before any file is rewritten (as an overwrite of this library's checkpoint removes its
    metadata.json), and the files this convert created are removed."""
    dst, src = tmp_path / "dcp", tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.arange(4.0), "y": torch.arange(3.0), "z": torch.arange(2.0)}, checkpoint_id=str(dst), no_dist=True)
    old_files = set(os.listdir(dst))
    Checkpointer().save(str(src), {"x": torch.full((4,), 7.0), "y": torch.full((3,), 8.0), "w": torch.ones(2), "z": torch.zeros(5)})
    rank_file = src / "rank_0.safetensors"
    good = rank_file.read_bytes()
    rank_file.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # z, written last, fails its checksum
    code, out, err = cli(capsys, "convert", str(src), str(dst), "--to", "dcp", "--overwrite")
    assert (code, out) == (1, "")
    assert re.fullmatch(f"checkpointer: error: {re.escape(str(rank_file))}: checksum mismatch in tensor 'z', chunk 0\n", err)
    assert ".metadata" not in os.listdir(dst)  # before: the old index, now reading x as 7.0
    assert set(os.listdir(dst)) <= old_files - {".metadata"}
    rank_file.write_bytes(good)
    assert cli(capsys, "convert", str(src), str(dst), "--to", "dcp", "-q") == (0, "", "")
    assert_same_tensors(load_dcp(str(dst)), unshard(str(src)))


def test_a_long_convert_in_a_process_group_does_not_time_out(ckpts, tmp_path, run_distributed):
    """Under torchrun the conversions other than checkpointer -> hf run on rank 0 while the other
    ranks wait. They waited in one collective bounded by CHECKPOINTER_TIMEOUT_S (default 300 s),
    so a conversion that took longer failed on every rank as 'rank 0 stopped answering'."""
    from cli_workers import slow_convert

    dst = str(tmp_path / "dcp")
    errors = run_distributed(slow_convert, 2, ckpts.flat3, dst, "dcp", 6.0, "2", timeout=120)
    assert errors == [None, None]
    assert_same_tensors(load_dcp(dst), ckpts.flat3_full)
    again = run_distributed(slow_convert, 2, ckpts.flat3, dst, "dcp", 0.0, "2", timeout=120)
    assert [e and e["type"] for e in again] == ["FileExistsError", "FileExistsError"]  # rank 0's error, everywhere


def test_convert_that_cannot_commit_leaves_no_lock(ckpts, capsys, tmp_path, monkeypatch):
    """Writing metadata.json fails (a full disk): the error is one line, and DST's save lock is
    released, as a save that fails to commit releases it; the next convert needs no --overwrite."""
    from checkpointer.format.layout import LOCK_FILENAME
    from checkpointer.storage.local import LocalStorage

    dst = tmp_path / "ours"
    real = LocalStorage.write

    def full_disk(self, name, data):
        if name == "metadata.json":
            raise OSError(28, "No space left on device", self.join(name))
        return real(self, name, data)

    monkeypatch.setattr(LocalStorage, "write", full_disk)
    code, _, err = cli(capsys, "convert", ckpts.flat3, str(dst), "--to", "checkpointer")
    assert code == 1 and err.startswith("checkpointer: error: [Errno 28] No space left on device") and err.count("\n") == 1
    assert LOCK_FILENAME not in os.listdir(dst)
    monkeypatch.setattr(LocalStorage, "write", real)
    assert cli(capsys, "convert", ckpts.flat3, str(dst), "--to", "checkpointer", "-q") == (0, "", "")
    assert_same_tensors(unshard(str(dst)), ckpts.flat3_full)


def test_dcp_overwrite_reports_and_keeps_only_its_own_files(capsys, tmp_path):
    """``--to dcp --overwrite`` printed only the files new since the last convert (``wrote 1
    file``: the index), and left the data files of a larger earlier checkpoint beside its own
    (found by a review)."""
    big, small, dst = tmp_path / "big", tmp_path / "small", tmp_path / "dcp"
    Checkpointer().save(str(big), {f"t{i}": torch.full((4,), float(i)) for i in range(4)})
    Checkpointer().save(str(small), {"t0": torch.full((3,), 9.0), "t1": torch.ones(2)})
    code, out, _ = cli(capsys, "convert", str(big), str(dst), "--to", "dcp")
    assert code == 0 and out.startswith("wrote 5 files ") and out.endswith(f" to {dst}\n"), out
    code, out, _ = cli(capsys, "convert", str(small), str(dst), "--to", "dcp", "--overwrite")
    assert code == 0 and out.startswith("wrote 3 files "), out
    assert len(os.listdir(dst)) == 3 and ".metadata" in os.listdir(dst)
    assert_same_tensors(load_dcp(str(dst)), unshard(str(small)))


def test_dtype_casts_every_floating_point_tensor_of_a_hf_source(capsys, tmp_path):
    """The FNUZ float8 codes too, which other writers' files hold (found by a review); integers
    and complex numbers keep theirs."""
    from safetensors.torch import save_file

    src, out = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    state = {
        "a": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fnuz),
        "b": torch.tensor([1.0, 4.0]).to(torch.float8_e5m2fnuz),
        "c": torch.tensor([1.5, 3.0]),
        "i": torch.tensor([7, 8], dtype=torch.int32),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    save_file(state, src)
    assert cli(capsys, "convert", src, out, "--to", "hf", "--dtype", "bf16", "-q") == (0, "", "")
    got = load_file(out)
    assert {k: v.dtype for k, v in got.items()} == {
        "a": torch.bfloat16, "b": torch.bfloat16, "c": torch.bfloat16, "i": torch.int32, "z": torch.complex64
    }
    assert all(torch.equal(got[k], state[k].to(got[k].dtype)) for k in state)
