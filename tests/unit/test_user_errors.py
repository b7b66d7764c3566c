"""Mistakes a user makes with paths, and the messages that tell them what to do instead.

- ``None`` where a checkpoint directory goes (what ``latest_checkpoint`` returns when there is
  none) is a ``TypeError`` saying so, not a read of a directory named ``None``.
- A directory that does not exist is a ``CheckpointError`` naming it.
- A run directory (checkpoints in sub-directories), or a directory one level too shallow or too
  deep, is an error that names the directory to pass: the newest complete checkpoint inside.
- A URL whose ``//`` was folded into ``/`` (``Path("s3://b/k")`` is ``s3:/b/k``) is refused
  instead of becoming a local directory named ``s3:``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import checkpointer
from checkpointer import CheckpointError, Checkpointer, CorruptCheckpointError, IncompleteCheckpointError


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


@pytest.fixture
def run_dir(tmp_path) -> str:
    """``run/step10`` and ``run/step20`` complete, ``run/step30`` a save that died before ``optim/``."""
    run = tmp_path / "run"
    model, optim = _model()
    for step in (10, 20, 30):
        checkpointer.save_model_and_optim_state(str(run / f"step{step}"), model, optim)
    os.remove(run / "step30" / "optim" / "metadata.json")
    return str(run)


# ---------------------------------------------------------------------------------------------
# None
# ---------------------------------------------------------------------------------------------


def _calls_taking_a_dir(model, optim):
    return {
        "load_model_and_optim_state": lambda d: checkpointer.load_model_and_optim_state(d, model, optim),
        "unshard_model_state": lambda d: checkpointer.unshard_model_state(d),
        "unshard_optim_state": lambda d: checkpointer.unshard_optim_state(d),
        "Checkpointer.load": lambda d: Checkpointer().load(d, {"w": torch.zeros(2)}),
        "Checkpointer.unshard": lambda d: Checkpointer().unshard(d),
        "Checkpointer.get_metadata": lambda d: Checkpointer().get_metadata(d),
        "export_safetensors": lambda d: checkpointer.export_safetensors(d, "out.safetensors"),
        "lazy_load": lambda d: list(checkpointer.lazy_load(d)),
    }


@pytest.mark.parametrize("call", sorted(_calls_taking_a_dir(None, None)))
def test_none_as_the_checkpoint_dir_is_a_type_error_naming_latest_checkpoint(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optim = _model()
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    last = checkpointer.latest_checkpoint(str(empty_run))
    assert last is None
    with pytest.raises(TypeError, match=r"is None.*latest_checkpoint\(run_dir\) returned None"):
        _calls_taking_a_dir(model, optim)[call](last)
    assert not (tmp_path / "None").exists() and not (tmp_path / "out.safetensors").exists()


def test_none_as_the_export_output_or_run_dir_is_a_type_error(run_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="output path is None"):
        checkpointer.export_safetensors(os.path.join(run_dir, "step10"), None)
    with pytest.raises(TypeError, match="run directory is None"):
        checkpointer.latest_checkpoint(None)
    assert not (tmp_path / "None").exists()


def test_a_dir_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="path or URL.*not int"):
        Checkpointer().get_metadata(3)


def test_path_objects_are_accepted(run_dir):
    model, optim = _model()
    checkpointer.load_model_and_optim_state(Path(run_dir) / "step20", model, optim)


# ---------------------------------------------------------------------------------------------
# Directories that do not exist, or are the wrong level
# ---------------------------------------------------------------------------------------------


def test_a_dir_that_does_not_exist_is_named(tmp_path):
    model, optim = _model()
    nowhere = str(tmp_path / "nowhere")
    for call in _calls_taking_a_dir(model, optim).values():
        with pytest.raises((CheckpointError, FileNotFoundError)) as ex:
            call(nowhere)
        assert nowhere in str(ex.value)
        assert "does not exist" in str(ex.value)
    with pytest.raises(IncompleteCheckpointError, match=f"no checkpoint at {nowhere}.*{nowhere} does not exist"):
        Checkpointer().load(nowhere, {"w": torch.zeros(2)})


def test_latest_checkpoint_skips_the_incomplete_save(run_dir):
    assert checkpointer.latest_checkpoint(run_dir) == f"{run_dir}/step20"


def test_a_run_dir_names_its_newest_complete_checkpoint(run_dir):
    model, optim = _model()
    newest = f"{run_dir}/step20"
    for call in _calls_taking_a_dir(model, optim).values():
        with pytest.raises(CheckpointError) as ex:
            call(run_dir)
        assert newest in str(ex.value), str(ex.value)
        assert "step30" not in str(ex.value)
    with pytest.raises(IncompleteCheckpointError) as ex:
        checkpointer.load_model_and_optim_state(run_dir, model, optim)
    assert f"latest_checkpoint({run_dir!r})" in str(ex.value)


def test_a_run_dir_without_a_complete_checkpoint_says_so(run_dir):
    shutil.rmtree(os.path.join(run_dir, "step10"))
    shutil.rmtree(os.path.join(run_dir, "step20"))
    with pytest.raises(IncompleteCheckpointError, match="holds no complete checkpoint"):
        Checkpointer().load(run_dir, {"w": torch.zeros(2)})


def test_one_level_too_shallow_names_model_and_optim(run_dir):
    step = f"{run_dir}/step20"
    for call in (
        lambda: Checkpointer().load(step, {"w": torch.zeros(2)}),
        lambda: Checkpointer().unshard(step),
        lambda: Checkpointer().get_metadata(step),
    ):
        with pytest.raises(IncompleteCheckpointError) as ex:
            call()
        message = str(ex.value)
        assert f"{step}/model" in message and f"{step}/optim" in message
        assert "load_model_and_optim_state" in message


def test_one_level_too_deep_names_the_parent(run_dir):
    model, optim = _model()
    step = f"{run_dir}/step20"
    for part in ("model", "optim"):
        with pytest.raises(IncompleteCheckpointError) as ex:
            checkpointer.load_model_and_optim_state(f"{step}/{part}", model, optim)
        assert f"pass {step}," in str(ex.value), str(ex.value)
        with pytest.raises(IncompleteCheckpointError) as ex:
            checkpointer.unshard_optim_state(f"{step}/{part}")
        assert f"pass {step}," in str(ex.value), str(ex.value)
    with pytest.raises(IncompleteCheckpointError) as ex:
        Checkpointer().unshard(f"{step}/model/weights")
    assert f"pass {step}/model" in str(ex.value)


def test_a_save_that_never_finished_is_still_called_incomplete(run_dir):
    with pytest.raises(IncompleteCheckpointError, match="not a complete checkpoint .its save never finished"):
        Checkpointer().get_metadata(f"{run_dir}/step30/optim")


def test_a_flat_save_that_never_finished_is_called_incomplete_by_the_model_and_optim_loader(tmp_path):
    step = tmp_path / "step40"
    Checkpointer().save(str(step), {"w": torch.arange(6.0)})
    os.remove(step / "metadata.json")
    with pytest.raises(IncompleteCheckpointError, match="metadata.json is missing: .* is not a complete checkpoint .its save never finished") as ex:
        checkpointer.load_model_and_optim_state(str(step), *_model())
    assert str(step) in str(ex.value)


def test_the_right_dirs_still_load(run_dir):
    model, optim = _model()
    checkpointer.load_model_and_optim_state(f"{run_dir}/step20", model, optim)
    assert set(Checkpointer().unshard(f"{run_dir}/step20/model")) == set(dict(model.state_dict()))
    assert len(list(checkpointer.lazy_load(f"{run_dir}/step20"))) == len(model.state_dict())


# ---------------------------------------------------------------------------------------------
# s3:/bucket (a URL that went through pathlib)
# ---------------------------------------------------------------------------------------------

MANGLED = ["s3:/bucket/run/step1", "gs:/bucket/run/step1", "S3:/bucket/x", "file:/tmp/x", "https:/host/x"]


@pytest.mark.parametrize("url", MANGLED)
def test_single_slash_urls_are_refused(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optim = _model()
    scheme = url.split(":")[0]
    calls = [
        lambda: Checkpointer().save(url, {"w": torch.zeros(2)}),
        lambda: checkpointer.save_model_and_optim_state(url, model, optim),
        lambda: checkpointer.async_save_model_and_optim_state(url, model, optim).result(),
        lambda: checkpointer.load_model_and_optim_state(url, model, optim),
        lambda: list(checkpointer.lazy_load(url)),
        lambda: checkpointer.latest_checkpoint(url),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"{scheme}: needs two slashes") as ex:
            call()
        assert "pathlib" in str(ex.value)
    assert os.listdir(tmp_path) == []


def test_the_refusal_names_the_url_meant():
    with pytest.raises(ValueError, match="'s3://bucket/run/step1'"):
        Checkpointer().get_metadata("s3:/bucket/run/step1")
    with pytest.raises(ValueError, match="'file:///tmp/x'"):
        Checkpointer().get_metadata("file:/tmp/x")


def test_a_path_object_made_from_a_url_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optim = _model()
    with pytest.raises(ValueError, match="needs two slashes"):
        checkpointer.save_model_and_optim_state(Path("s3://bucket/run/step1"), model, optim)
    with pytest.raises(ValueError, match="needs two slashes"):
        checkpointer.export_safetensors(str(tmp_path), Path("gs://bucket/out"))
    assert os.listdir(tmp_path) == []


def test_a_local_dir_named_like_a_scheme_can_be_given_with_dot_slash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Checkpointer().save("./s3:/x", {"w": torch.ones(2)})
    assert (tmp_path / "s3:" / "x" / "metadata.json").exists()


# ---------------------------------------------------------------------------------------------
# Shape and dtype mismatches name the checkpoint and the key; a dtype mismatch says how to convert
# ---------------------------------------------------------------------------------------------


def test_shape_mismatch_names_the_checkpoint_and_the_key(tmp_path):
    ckpt = str(tmp_path / "c")
    Checkpointer().save(ckpt, {"layer.w": torch.zeros(2, 3)})
    with pytest.raises(checkpointer.CheckpointMismatchError) as ex:
        Checkpointer().load(ckpt, {"layer.w": torch.zeros(3, 2)})
    message = str(ex.value)
    assert "'layer.w'" in message and ckpt in message
    assert "[2, 3]" in message and "[3, 2]" in message


def test_dtype_mismatch_names_the_checkpoint_and_says_how_to_convert(tmp_path):
    ckpt = str(tmp_path / "c")
    Checkpointer().save(ckpt, {"layer.w": torch.zeros(2, 3)})
    with pytest.raises(checkpointer.CheckpointMismatchError) as ex:
        Checkpointer().load(ckpt, {"layer.w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    message = str(ex.value)
    assert "'layer.w'" in message and ckpt in message
    assert "F32 (torch.float32)" in message and "BF16 (torch.bfloat16)" in message
    assert "never casts" in message and ".to(torch.bfloat16)" in message


def test_integer_dtype_mismatch_does_not_advise_module_to(tmp_path):
    # Module.to(dtype) casts only floating-point tensors, so it is no advice for a step counter.
    ckpt = str(tmp_path / "c")
    Checkpointer().save(ckpt, {"step": torch.tensor(7, dtype=torch.int64)})
    with pytest.raises(checkpointer.CheckpointMismatchError) as ex:
        Checkpointer().load(ckpt, {"step": torch.tensor(0.0)})
    message = str(ex.value)
    assert "I64 (torch.int64)" in message and "F32 (torch.float32)" in message
    assert "model.to" not in message
    assert "put a torch.int64 tensor under 'step'" in message and ".to(torch.float32)" in message
    target = {"step": torch.tensor(0, dtype=torch.int64)}  # as the message says
    Checkpointer().load(ckpt, target)
    assert target["step"].to(torch.float32).item() == 7.0


def test_model_dtype_mismatch_names_the_model_checkpoint(run_dir):
    model, optim = _model()
    model.to(torch.bfloat16)
    step = f"{run_dir}/step20"
    with pytest.raises(checkpointer.CheckpointMismatchError, match=f"in the checkpoint at {step}/model.*model.to"):
        checkpointer.load_model_and_optim_state(step, model, optim)
    model.to(torch.float32)  # as the message says: load in the checkpoint's dtype, then convert
    checkpointer.load_model_and_optim_state(step, model, optim)


def test_a_failing_hint_does_not_hide_the_missing_checkpoint(tmp_path, monkeypatch):
    from checkpointer.engine import locate

    def probe_fails(storage):
        raise OSError("listing refused")

    monkeypatch.setattr(locate, "wrong_directory_hint", probe_fails)
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(IncompleteCheckpointError, match=f"no checkpoint at {nowhere}: {nowhere} does not exist"):
        Checkpointer().get_metadata(nowhere)


def test_a_sparse_tensor_is_refused_naming_its_key(tmp_path):
    """It raised torch's 'Cannot access data pointer of Tensor that doesn't have storage'."""
    from checkpointer import CheckpointError, Checkpointer

    with pytest.raises(CheckpointError, match=r"cannot save 'w': it is a torch.sparse_coo tensor"):
        Checkpointer().save(str(tmp_path), {"a": torch.ones(2), "w": torch.eye(3).to_sparse()})
    assert not (tmp_path / "metadata.json").exists()


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_refused_value_leaves_the_step_it_would_overwrite(tmp_path, how):
    """save_overwrite=True with a value no rank can save (a buffer on the meta device): the save
    is refused before the step's claim, which made the old step incomplete before the refusal."""
    import checkpointer

    step = str(tmp_path / "step1")
    model = nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer.save_model_and_optim_state(step, model, optim)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.register_buffer("stat", torch.empty(3, device="meta"))
    with pytest.raises(checkpointer.CheckpointError, match="'stat': it is on the meta device"):
        if how == "sync":
            checkpointer.save_model_and_optim_state(step, model, optim, save_overwrite=True)
        else:
            checkpointer.async_save_model_and_optim_state(step, model, optim, save_overwrite=True).result(timeout=60)
    fresh = nn.Linear(4, 4)
    checkpointer.load_model_and_optim_state(step, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("how", ["sync", "async"])
def test_an_overwrite_describes_each_part_once(tmp_path, monkeypatch, how):
    """Planned ahead of the claim, then saved from the same descriptions (the sync save described
    every part a second time, found by a self-review); and the step is overwritten."""
    from checkpointer import api
    from checkpointer.engine import async_save, checkpointer as engine, save

    model = nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = str(tmp_path / "step1")
    checkpointer.save_model_and_optim_state(step, model, optim, train_state={"step": 1})
    api._DEFAULT._plan_cache.clear()  # planned afresh, ahead of the claim
    calls = []
    real = save.describe_for_save
    counting = lambda sd: (calls.append(len(sd)), real(sd))[1]  # noqa: E731
    for module in (save, engine, async_save):
        monkeypatch.setattr(module, "describe_for_save", counting)
    with torch.no_grad():
        model.weight.fill_(2.0)
    if how == "sync":
        checkpointer.save_model_and_optim_state(step, model, optim, train_state={"step": 2}, save_overwrite=True)
    else:
        checkpointer.async_save_model_and_optim_state(step, model, optim, train_state={"step": 2},
                                                      save_overwrite=True).result(timeout=60)
    assert len(calls) == 3, calls  # model, optim, train
    fresh = nn.Linear(4, 4)
    result = checkpointer.load_model_and_optim_state(step, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert torch.equal(fresh.weight, torch.full((4, 4), 2.0)) and result.train_state == {"step": 2}


def test_a_negated_view_is_saved_with_its_sign_and_refused_as_a_destination(tmp_path):
    """torch's lazy ``.conj()`` marks ``.imag`` of it negated without changing its memory: written
    from memory, it lost its sign, and beside the plain ``.imag`` it was taken for an alias of it
    (found by a review)."""
    c = torch.tensor([7 - 3j, 1 + 2j])
    state = {"im": c.imag, "im_conj": c.conj().imag, "scalar": torch.tensor(7 - 3j).conj().imag}
    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, state)
    got = Checkpointer().unshard(path, no_dist=True)
    assert {k: v.tolist() for k, v in got.items()} == {"im": [-3.0, 2.0], "im_conj": [3.0, -2.0], "scalar": 3.0}
    with pytest.raises(CheckpointError, match="cannot load into 'im_conj': it is a negated or conjugated view"):
        Checkpointer().load(path, {"im_conj": torch.zeros(2, dtype=torch.complex64).conj().imag}, no_dist=True)


def test_a_file_whose_header_no_reader_would_read_is_not_written(tmp_path, monkeypatch):
    """A safetensors header over ``MAX_HEADER_BYTES`` (safetensors' own limit) is refused by every
    reader. Before: a save (and an export) wrote one and committed it; every load then failed.
    Now the writer refuses it, and the save commits nothing. The limit is lowered here so that
    200 tensors pass it."""
    from checkpointer.format import safetensors_header

    state = {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(200)}
    saved, again = str(tmp_path / "saved"), str(tmp_path / "again")
    Checkpointer().save(saved, state)
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(CorruptCheckpointError, match="is over the limit of 4096 bytes"):  # what readers do
        Checkpointer().load(saved, {k: torch.zeros(2) for k in state})
    with pytest.raises(CheckpointError, match="over the 4,096 bytes that safetensors") as err:
        Checkpointer().save(again, state)
    assert "200 tensors" in str(err.value) or "201 tensors" in str(err.value)
    assert not os.path.exists(again) or sorted(os.listdir(again)) == []
    monkeypatch.undo()
    got = {k: torch.zeros(2) for k in state}
    Checkpointer().load(saved, got)
    assert all(torch.equal(got[k], v) for k, v in state.items())

    # An export's header (written before any tensor, built before the file is opened).
    from checkpointer.tools.export import ExportTensor, shaped_header

    tensors = [ExportTensor(k, k, (2,), "F32") for k in state]
    assert len(shaped_header(tensors)) > 4096
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(CheckpointError, match="over the 4,096 bytes that safetensors"):
        shaped_header(tensors)
