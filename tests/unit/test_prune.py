"""``checkpointer.prune`` on a local run directory of real checkpoints saved at world size 1, and
:func:`~checkpointer.engine.locate.is_complete` with a ``train/`` part."""

from __future__ import annotations

import json
import os

import pytest
import torch

import checkpointer
from checkpointer.engine.locate import is_complete, newest_checkpoint
from checkpointer.storage.memory import MemoryStorage
from checkpointer.tools.retention import Step, choose, delete_checkpoint, plan_prune
from prune_helpers import DELETED, KEPT, make_run


def test_prune_keeps_the_newest_and_the_multiples_and_newer_incomplete_ones(tmp_path):
    run = str(tmp_path / "run")
    make_run(run)
    assert checkpointer.latest_checkpoint(run) == f"{run}/step500"
    deleted = checkpointer.prune(run, keep_last=2, keep_every=200)
    assert deleted == [f"{run}/{name}" for name in DELETED]
    assert sorted(os.listdir(run)) == KEPT
    assert os.listdir(f"{run}/notes_step150") == ["notes.txt"]
    assert checkpointer.latest_checkpoint(run) == f"{run}/step500"
    assert torch.equal(checkpointer.Checkpointer().unshard(f"{run}/step200")["w"], torch.full((4,), 200.0))
    assert checkpointer.prune(run + "/", keep_last=2, keep_every=200) == []  # nothing more to do

    # keep_last=0 still keeps the newest complete checkpoint; keep_every keeps complete ones only.
    assert checkpointer.prune(run, keep_last=0) == [f"{run}/step200", f"{run}/step400"]
    assert sorted(os.listdir(run)) == ["notes_step150", "step500", "step600"]
    assert checkpointer.latest_checkpoint(run) == f"{run}/step500"


def test_prune_without_a_complete_checkpoint_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    checkpointer.Checkpointer().save(str(run / "step1"), {"w": torch.zeros(2)})
    os.remove(run / "step1" / "metadata.json")
    assert checkpointer.prune(str(run), keep_last=1) == []
    assert os.listdir(run) == ["step1"]
    assert checkpointer.prune(str(tmp_path / "missing"), keep_last=1) == []


def test_prune_refuses_bad_counts(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        checkpointer.prune(str(tmp_path), keep_last=-1)
    with pytest.raises(ValueError, match="keep_every"):
        checkpointer.prune(str(tmp_path), keep_last=1, keep_every=0)
    with pytest.raises(TypeError, match="keep_last"):
        checkpointer.prune(str(tmp_path), keep_last=None)
    with pytest.raises(TypeError, match="run directory is None"):
        checkpointer.prune(None, keep_last=1)


def test_a_linked_checkpoint_loses_its_link_not_what_it_leads_to(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    checkpointer.Checkpointer().save(str(elsewhere / "step1"), {"w": torch.zeros(2)})
    checkpointer.Checkpointer().save(str(run / "step2"), {"w": torch.zeros(2)})
    os.symlink(elsewhere / "step1", run / "step1")
    assert checkpointer.prune(str(run), keep_last=1) == [f"{run}/step1"]
    assert os.listdir(run) == ["step2"]
    assert sorted(os.listdir(elsewhere / "step1")) == ["metadata.json", "rank_0.safetensors"]


def test_choose_never_takes_the_newest_complete_nor_a_busy_one():
    steps = [Step("s1", 1, True), Step("s2", 2, True), Step("s3", 3, False), Step("s0", 0, False),
             Step("s4", 4, True), Step("x0", 0, False, save_leftovers=False)]
    assert choose(steps, 0, None) == ["s0", "s1", "s2", "s3"]
    assert choose(steps, 1, 2) == ["s0", "s1", "s3"]
    assert choose(steps, 0, None, busy={"s1", "s3"}) == ["s0", "s2"]
    assert choose([Step("s1", 1, False)], 0, None) == []
    # An incomplete step numbered as the newest complete one may be a save still writing (another
    # name for the same step): only older incomplete ones are taken.
    assert choose([Step("step300", 300, True), Step("epoch2-step300", 300, False), Step("a-step299", 299, False)],
                  0, None) == ["a-step299"]


@pytest.mark.parametrize("saved_through", ["run", "link"])
def test_prune_keeps_a_step_an_async_save_of_this_process_is_writing(tmp_path, monkeypatch, saved_through):
    """Only ``choose``'s ``busy`` was tested (found by mutation): here prune runs while this
    process's async save of an older step is held before it writes, next to ``step1``, whose
    name its path begins with; also with the save given the run directory through a link."""
    import threading

    from checkpointer.engine import async_save

    run = str(tmp_path / "run")
    os.makedirs(run)
    os.symlink(run, tmp_path / "link")
    ckpt = checkpointer.Checkpointer()
    for step in (1, 200):
        ckpt.save(f"{run}/step{step}", {"w": torch.full((4,), float(step))})
    gate = threading.Event()
    write_and_commit = async_save.write_and_commit
    monkeypatch.setattr(async_save, "write_and_commit", lambda *a, **k: (gate.wait(60), write_and_commit(*a, **k))[1])
    future = ckpt.async_save(f"{tmp_path / saved_through}/step10", {"w": torch.full((4,), 10.0)})
    try:
        for _ in range(600):  # until its lock is taken: the directory is there, holding what a save leaves
            if os.path.isdir(f"{run}/step10"):
                break
            threading.Event().wait(0.01)
        assert os.path.isdir(f"{run}/step10")
        assert checkpointer.prune(run, keep_last=1) == [f"{run}/step1"]
    finally:
        gate.set()
    future.result(timeout=60)
    assert sorted(os.listdir(run)) == ["step10", "step200"]
    assert torch.equal(ckpt.unshard(f"{run}/step10")["w"], torch.full((4,), 10.0))
    assert checkpointer.prune(run, keep_last=1) == [f"{run}/step10"]


def test_prune_in_another_thread_keeps_a_step_an_async_save_is_still_planning(tmp_path, monkeypatch):
    """Found by review: an async save that plans afresh makes its step directory and lock in the
    caller's thread, before it hands the write to its thread. Before: a prune in another thread
    during that window deleted the step (older than the newest complete one) and the save
    failed with FileNotFoundError. Here prune runs while the save stages its pieces."""
    import threading

    from checkpointer.engine import async_save

    run = str(tmp_path / "run")
    ckpt = checkpointer.Checkpointer()
    for step in (100, 200, 300):
        ckpt.save(f"{run}/step{step}", {"w": torch.full((4,), float(step))})
    pruned: list[list[str]] = []
    stage = async_save.AsyncSaver._stage

    def prune_while_staging(self, index, planned):
        if not pruned:
            assert os.path.isdir(f"{run}/step250")  # planned: its directory and lock are there
            worker = threading.Thread(target=lambda: pruned.append(checkpointer.prune(run, keep_last=3)))
            worker.start()
            worker.join(60)
        return stage(self, index, planned)

    monkeypatch.setattr(async_save.AsyncSaver, "_stage", prune_while_staging)
    fresh = checkpointer.Checkpointer()  # no cached plan: this one plans in the caller's thread
    fresh.async_save(f"{run}/step250", {"w": torch.full((4,), 250.0)}).result(timeout=60)
    assert pruned == [[]]
    assert torch.equal(ckpt.unshard(f"{run}/step250")["w"], torch.full((4,), 250.0))
    assert checkpointer.prune(run, keep_last=3) == [f"{run}/step100"]


class _DeleteFails(MemoryStorage):
    def delete_tree(self, name: str) -> None:
        raise OSError(f"{self.join(name)}: injected failure")

    def child(self, name: str) -> MemoryStorage:
        return MemoryStorage(self._key(name), _files=self._files)


def test_a_half_deleted_checkpoint_reads_as_incomplete():
    run = _DeleteFails()
    for part in ("model", "optim", "train"):
        run.write(f"step1/{part}/metadata.json", b"{}")
        run.write(f"step1/{part}/rank_0.safetensors", b"x")
    assert is_complete(run.child("step1"))
    with pytest.raises(OSError, match="injected"):
        delete_checkpoint(run, "step1")
    assert not is_complete(run.child("step1"))
    assert run.exists("step1/model/rank_0.safetensors")


def test_every_part_present_must_have_committed():
    step = MemoryStorage().child("step1")
    for part in ("model", "optim"):
        step.write(f"{part}/metadata.json", b"{}")
    assert is_complete(step)
    step.write("train/rank_0.safetensors", b"x")  # a train/ part whose save never committed
    assert not is_complete(step)
    step.write("train/metadata.json", b"{}")
    assert is_complete(step)
    step.child("model").delete("metadata.json")
    assert not is_complete(step)


def test_a_model_saved_alone_in_a_step_directory_is_not_deleted(tmp_path):
    """``step5/model`` committed without ``optim/`` is a model saved on its own (not the leftovers
    of a model + optimizer save, which locks ``optim/`` before committing ``model/``): kept."""
    run = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    checkpointer.Checkpointer().save(str(run / "step5" / "model"), model.state_dict())
    checkpointer.save_model_and_optim_state(str(run / "step10"), model, torch.optim.AdamW(model.parameters()))
    checkpointer.Checkpointer().save(str(run / "step7" / "model"), model.state_dict())
    (run / "step7" / "optim").mkdir()  # a model + optimizer save that died before optim/ committed
    assert checkpointer.prune(str(run), keep_last=5) == [f"{run}/step7"]
    assert sorted(os.listdir(run)) == ["step10", "step5"]
    assert torch.equal(checkpointer.Checkpointer().unshard(str(run / "step5" / "model"))["weight"], model.weight)


def test_a_directory_of_other_files_under_a_part_name_is_not_deleted(tmp_path):
    """Only ``model/``, ``optim/`` and ``train/`` as a save leaves them make an incomplete step a
    save's leftovers: ``data_v2/train/shard0.jsonl`` is the user's (found by a review)."""
    run = tmp_path / "run"
    checkpointer.Checkpointer().save(str(run / "step200"), {"w": torch.zeros(2)})
    for rel in ("data_v2/train/shard0.jsonl", "export_step150/model/config.json", "eval5/optim/results.txt"):
        (run / rel).parent.mkdir(parents=True)
        (run / rel).write_text("the user's")
    checkpointer.Checkpointer().save(str(run / "step100" / "train"), {"w": torch.zeros(2)})
    (run / "step100" / "optim").mkdir()
    (run / "step100" / "optim" / ".rank_0.safetensors.tmp-0123456789ab").write_bytes(b"x")  # a save died here
    assert checkpointer.prune(str(run), keep_last=1) == [f"{run}/step100"]
    assert sorted(os.listdir(run)) == ["data_v2", "eval5", "export_step150", "step200"]


def test_a_link_named_for_its_step_keeps_what_it_leads_to(tmp_path):
    """``final_step300 -> step300``: both the newest step. Ranked by name, the link was kept as
    the newest and ``step300`` deleted under it, leaving no checkpoint (found by a review)."""
    run = tmp_path / "run"
    for step in (100, 200, 300):
        checkpointer.Checkpointer().save(str(run / f"step{step}"), {"w": torch.full((2,), float(step))})
    os.symlink("step300", run / "final_step300")
    assert checkpointer.prune(str(run), keep_last=1) == [f"{run}/step100", f"{run}/step200"]
    assert sorted(os.listdir(run)) == ["final_step300", "step300"]
    assert checkpointer.latest_checkpoint(str(run)) in (f"{run}/step300", f"{run}/final_step300")
    steps = [Step("final_step3", 3, True), Step("step3", 3, True), Step("step2", 2, True), Step("step1", 1, True)]
    assert choose(steps, 2, None) == ["step1"]
    assert choose(steps, 1, 2) == ["step1"]


def test_another_tools_metadata_json_makes_no_checkpoint(tmp_path):
    """A directory is complete by a checkpoint's ``metadata.json``, not by any file of that name
    (found by a review: ``eval_step300/metadata.json`` was the newest checkpoint, and prune
    deleted every real one)."""
    run = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    for step in (100, 200):
        checkpointer.save_model_and_optim_state(str(run / f"step{step}"), model, torch.optim.AdamW(model.parameters()))
    for name, text in (("eval_step300", '{"accuracy": 0.91}'), ("eval_step400", "[1, 2]"), ("eval_step500", "{")):
        (run / name).mkdir()
        (run / name / "metadata.json").write_text(text)
    assert checkpointer.latest_checkpoint(str(run)) == f"{run}/step200"
    assert checkpointer.prune(str(run), keep_last=1) == [f"{run}/step100"]
    assert sorted(os.listdir(run)) == ["eval_step300", "eval_step400", "eval_step500", "step200"]


def test_a_step_is_judged_by_its_parts_whatever_metadata_json_it_holds():
    """The user's notes in ``step1/metadata.json`` do not make a step whose ``optim/`` never
    committed complete (found by a review)."""
    step = MemoryStorage().child("step1")
    step.write("metadata.json", b'{"tensors": {}}')
    step.write("model/metadata.json", b"{}")
    step.write("optim/rank_0.safetensors", b"x")
    assert not is_complete(step)
    step.write("optim/metadata.json", b"{}")
    assert is_complete(step)


def test_a_checkpoints_metadata_json_counts_in_any_key_order(tmp_path, monkeypatch):
    run = tmp_path / "run"
    checkpointer.Checkpointer().save(str(run / "step1"), {"w": torch.zeros(2)})
    metadata = run / "step1" / "metadata.json"
    metadata.write_text(json.dumps(json.loads(metadata.read_text()), sort_keys=True, indent=2))
    assert checkpointer.latest_checkpoint(str(run)) == f"{run}/step1"
    assert torch.equal(checkpointer.Checkpointer().unshard(f"{run}/step1")["w"], torch.zeros(2))
    monkeypatch.setenv("CHECKPOINTER_MAX_METADATA_MIB", "0.0001")  # one a load would refuse
    assert checkpointer.latest_checkpoint(str(run)) is None


def test_a_listed_name_no_storage_takes_is_not_a_step():
    """An object key of another tool's, ``backup\\step9``, made latest_checkpoint and prune raise
    a ValueError naming no URL (found by a review, on S3 and GCS)."""

    class Listing(MemoryStorage):
        def list(self) -> list[str]:
            return [*super().list(), "backup\\step9"]

        def child(self, name: str) -> MemoryStorage:
            return MemoryStorage(self._key(name), _files=self._files)

    run = Listing()
    for step in (1, 2):
        for part in ("model", "optim"):
            run.write(f"step{step}/{part}/metadata.json", b"{}")
            run.write(f"step{step}/{part}/rank_0.safetensors", b"x")
    assert newest_checkpoint(run) == "step2"
    assert plan_prune(run, 1, None) == ["step1"]
