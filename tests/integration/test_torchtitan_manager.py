"""``CheckpointerManager`` against torchtitan's own DCP ``CheckpointManager``, one process, no
trainer launch (``tests/support/titan_job.py``): what each backend does with the same settings.
Each case was found by a review where the two differed; the later ones, each a setting of
``CheckpointerManager`` alone, by mutation testing of the module (each failed with a mutant that
passed every other test here). Skipped without torchtitan."""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
torch = pytest.importorskip("torch")

import checkpointer  # noqa: E402
from titan_job import Job  # noqa: E402  (tests/support; after the skip: it needs torchtitan)

BACKENDS = ["dcp", "checkpointer"]


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "weights"} == {k: v for k, v in b.items() if k != "weights"} and all(
        torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


def _where_step_leaves(backend: str, folder: str, step: int) -> dict:
    """Where a new job stands once it has loaded ``step`` from ``folder``."""
    job = Job(backend, folder, seed=2, load_step=step)
    job.ckpt.load(step=step)
    return job.where()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_whole_initial_load_restores_the_run_not_just_the_model(backend, tmp_path):
    """``initial_load_model_only=False``: the schedule, the data position and the step come back
    too (the run restarted at step 0 with a fresh schedule)."""
    first = Job(backend, str(tmp_path / "a"), interval=3, last_save_model_only=False)
    first.train(3)
    first.finish()
    resumed = Job(backend, str(tmp_path / "b"), seed=1, initial_load_path=str(tmp_path / "a" / "checkpoint" / "step-3"),
                  initial_load_model_only=False)
    resumed.ckpt.load()
    assert _same(resumed.where(), first.where())


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_rolled_back_with_load_step_saves_over_the_later_steps(backend, async_mode, tmp_path):
    """``load_step=2`` while steps 3 and 4 exist: the resumed run saves them again (it failed with
    FileExistsError at its next save), and step 3 is the new run's."""
    first = Job(backend, str(tmp_path), interval=1, async_mode=async_mode, last_save_model_only=False)
    first.train(4)
    first.finish()
    again = Job(backend, str(tmp_path), seed=1, interval=1, async_mode=async_mode, load_step=2, last_save_model_only=False)
    again.ckpt.load(step=2)
    again.train(2)
    again.finish()
    assert _same(_where_step_leaves(backend, str(tmp_path), 4), again.where())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_longer_than_an_earlier_one_saves_over_its_last_step(backend, tmp_path):
    """The earlier run's last step is the model alone; a longer run reaching it saves it whole."""
    first = Job(backend, str(tmp_path), interval=2, last_save_model_only=True)
    first.train(1, save=False)
    first.ckpt.save(1, last_step=True)
    first.finish()
    longer = Job(backend, str(tmp_path), seed=1, interval=1, last_save_model_only=True)
    longer.train(2)
    longer.finish()
    assert _same(_where_step_leaves(backend, str(tmp_path), 2), longer.where())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_saved_in_the_export_dtype_starts_an_fp32_job(backend, tmp_path):
    """The last step, the model alone in bfloat16 (torchtitan's defaults make it so), as the
    ``initial_load_path`` of an fp32 job: cast as it is loaded (it was a dtype mismatch)."""
    first = Job(backend, str(tmp_path / "a"), interval=10, last_save_model_only=True, export_dtype="bfloat16")
    first.train(2, save=False)
    first.ckpt.save(2, last_step=True)
    first.finish()
    fresh = Job(backend, str(tmp_path / "b"), seed=1, initial_load_path=str(tmp_path / "a" / "checkpoint" / "step-2"))
    fresh.ckpt.load()
    for got, saved in zip(fresh.model.parameters(), first.model.parameters()):
        assert got.dtype == torch.float32 and torch.equal(got, saved.to(torch.bfloat16).float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unknown_name_in_exclude_from_loading_is_an_error(backend, tmp_path):
    first = Job(backend, str(tmp_path), interval=2, last_save_model_only=False)
    first.train(2)
    first.finish()
    typo = Job(backend, str(tmp_path), exclude_from_loading=["lr_schedulers"])
    with pytest.raises(ValueError, match="lr_schedulers not found in state_dict"):
        typo.ckpt.load()


def test_closing_with_an_async_save_in_flight_makes_no_collective(tmp_path, monkeypatch):
    """torchtitan closes a rank that failed while the others wait in a step's collective: close
    finishes the save in flight and returns (it pruned, a collective, and hung there)."""
    import checkpointer

    job = Job("checkpointer", str(tmp_path), interval=1, async_mode="async", keep_latest_k=2, last_save_model_only=False)
    job.train(2)
    called: list[str] = []
    monkeypatch.setattr(checkpointer, "prune", lambda *a, **k: called.append("prune"))
    job.ckpt.close()
    assert called == [] and job.ckpt.save_future is None
    assert checkpointer.latest_checkpoint(str(tmp_path / "checkpoint")) == str(tmp_path / "checkpoint" / "step-2")


def test_a_hugging_face_directory_as_the_initial_load_path_loads_as_it_is(tmp_path):
    """Not this library's checkpoint: the model-only load takes it as ``load_model_and_optim_state``
    does (Hugging Face safetensors by the model's own names), with no dtype probe in the way."""
    from safetensors.torch import save_file

    source = Job("checkpointer", str(tmp_path / "a"), seed=3)
    save_file({k: v.contiguous() for k, v in source.model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fresh = Job("checkpointer", str(tmp_path / "b"), seed=1, initial_load_path=str(tmp_path))
    fresh.ckpt.load()
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), source.model.parameters()))


def test_an_adapter_that_changes_values_is_refused_for_hugging_face_loads(tmp_path):
    """llama3's own adapter permutes wq/wk on the way to Hugging Face names: a key map would load
    them wrong, so the manager refuses it when torchtitan builds it, naming the tensors."""
    from checkpointer.integrations.torchtitan import CheckpointerManager
    from titan_job import ensure_process_group
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    ensure_process_group()
    spec = llama3_debugmodel().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    optimizers = type("Optimizers", (), {"optimizers": [object()]})()
    config = CheckpointerManager.Config(enable=True, initial_load_path=str(tmp_path), initial_load_in_hf=True)
    with pytest.raises(ValueError, match="changes the values of") as refused:
        CheckpointerManager(config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                            states={}, sd_adapter=adapter, base_folder=str(tmp_path))
    assert "model.layers.0.self_attn.q_proj.weight" in str(refused.value)


def _steps(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_load_only_saves_nothing(tmp_path):
    job = Job("checkpointer", str(tmp_path), interval=1, load_only=True, last_save_model_only=False)
    job.train(2)
    job.ckpt.save(3, last_step=True)
    assert _steps(tmp_path / "checkpoint") == []


def test_enable_first_step_checkpoint_saves_step_1(tmp_path):
    job = Job("checkpointer", str(tmp_path), interval=10, enable_first_step_checkpoint=True,
              last_save_model_only=False)
    job.train(3)
    assert _steps(tmp_path / "checkpoint") == ["step-1"]


def test_without_last_save_model_only_the_last_step_is_a_resume_point(tmp_path):
    job = Job("checkpointer", str(tmp_path), interval=10, last_save_model_only=False)
    job.train(1, save=False)
    job.ckpt.save(1, last_step=True)
    folder = tmp_path / "checkpoint"
    assert checkpointer.latest_checkpoint(str(folder)) == str(folder / "step-1")
    assert sorted(os.listdir(folder / "step-1")) == ["model", "optim", "train"]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_keep_latest_k_keeps_the_newest_k_steps(async_mode, tmp_path):
    job = Job("checkpointer", str(tmp_path), interval=1, keep_latest_k=2, async_mode=async_mode,
              last_save_model_only=False)
    job.train(4)
    job.ckpt.maybe_wait_for_saving()
    assert _steps(tmp_path / "checkpoint") == ["step-3", "step-4"]


def _stub_async_save(monkeypatch, error: Exception | None = None) -> tuple[list[dict], list[str]]:
    """``async_save_model_and_optim_state`` writes nothing and hands back a done future (failed
    with ``error``, if given) whose ``staged`` notes each wait; returns (each call's keyword
    arguments, the waits)."""
    calls: list[dict] = []
    waits: list[str] = []

    class Staged:
        def result(self, timeout=None):
            waits.append("staged")

    def async_save(step_dir, model, optim, **kwargs):
        calls.append(kwargs)
        future: Future = Future()
        future.staged = Staged()
        future.set_exception(error) if error is not None else future.set_result(None)
        return future

    monkeypatch.setattr(checkpointer, "async_save_model_and_optim_state", async_save)
    return calls, waits


def test_a_failed_async_save_is_raised_at_the_next_save(tmp_path, monkeypatch):
    _stub_async_save(monkeypatch, OSError("disk full"))
    job = Job("checkpointer", str(tmp_path), interval=1, async_mode="async", last_save_model_only=False)
    job.train(1)
    with pytest.raises(OSError, match="disk full"):
        job.train(1)
    assert job.ckpt.save_future is None


def test_maybe_wait_for_staging_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    _, waits = _stub_async_save(monkeypatch)
    job = Job("checkpointer", str(tmp_path), interval=1, async_mode="async", last_save_model_only=False)
    job.train(1)
    assert waits == []
    job.ckpt.maybe_wait_for_staging()
    assert waits == ["staged"]


@pytest.mark.parametrize("in_background", [True, False])
def test_stage_in_background_is_passed_to_the_async_save(in_background, tmp_path, monkeypatch):
    calls, _ = _stub_async_save(monkeypatch)
    job = Job("checkpointer", str(tmp_path), interval=1, async_mode="async", stage_in_background=in_background,
              last_save_model_only=False)
    job.train(1)
    assert [c["stage_in_background"] for c in calls] == [in_background]


def _whole_run(folder: str, steps: int, **config) -> Job:
    """A finished run that saved every step whole."""
    job = Job("checkpointer", folder, interval=1, last_save_model_only=False, **config)
    job.train(steps)
    job.finish()
    return job


def test_load_step_loads_that_step(tmp_path):
    _whole_run(str(tmp_path), 4)
    job = Job("checkpointer", str(tmp_path), seed=1, load_step=2)
    job.ckpt.load(step=2)
    where = job.where()
    assert (where["step"], where["last_epoch"], where["next_batch"]) == (2, 2, 4)


def test_load_step_of_a_missing_step_is_an_error(tmp_path):
    _whole_run(str(tmp_path), 2)
    job = Job("checkpointer", str(tmp_path), seed=1, load_step=7)
    with pytest.raises(FileNotFoundError, match="load_step=7: no complete checkpoint at .*step-7"):
        job.ckpt.load(step=7)


def test_a_seed_checkpoint_loads_at_load_step_0_and_yields_to_later_steps(tmp_path):
    """``step-0`` (the model alone): the start of a job on the folder, and what ``load_step=0``
    loads once later steps exist; a plain load then takes the newest step."""
    seed = Job("checkpointer", str(tmp_path), seed=5)
    seed.ckpt.save(0, last_step=True)
    run = Job("checkpointer", str(tmp_path), seed=1, interval=1, last_save_model_only=False)
    run.ckpt.load()
    assert all(torch.equal(a, b) for a, b in zip(run.where()["weights"], seed.where()["weights"]))
    run.train(2)
    run.finish()
    latest = Job("checkpointer", str(tmp_path), seed=2)
    latest.ckpt.load()
    assert latest.where()["step"] == 2
    again = Job("checkpointer", str(tmp_path), seed=2, load_step=0)
    again.ckpt.load(step=0)
    assert again.where()["step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(again.where()["weights"], seed.where()["weights"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_exclude_from_loading_leaves_those_states_as_they_are(backend, tmp_path):
    first = Job(backend, str(tmp_path), interval=2, last_save_model_only=False)
    first.train(2)
    first.finish()
    job = Job(backend, str(tmp_path), seed=1,
              exclude_from_loading=["optimizer", "lr_scheduler", "dataloader", "train_state"])
    job.ckpt.load()
    where = job.where()
    assert (where["step"], where["last_epoch"], where["next_batch"], where["optimizer_states"]) == (0, 0, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(where["weights"], first.where()["weights"]))


@pytest.mark.parametrize(("saved_at", "loaded_at"), [((1, 2), (0, 1)), ((1, 2), (0, 2))])
def test_a_loader_position_of_another_data_parallel_rank_is_not_restored(saved_at, loaded_at, tmp_path):
    first = Job("checkpointer", str(tmp_path), interval=2, last_save_model_only=False)
    first.loader.dp_rank, first.loader.dp_world_size = saved_at
    first.train(2)
    job = Job("checkpointer", str(tmp_path), seed=1)
    job.loader.dp_rank, job.loader.dp_world_size = loaded_at
    with pytest.warns(UserWarning, match=f"saved at data-parallel size {saved_at[1]}, this job has {loaded_at[1]} "
                                         f"\\(data-parallel rank {saved_at[0]} saved, this is {loaded_at[0]}\\)"):
        job.ckpt.load()
    assert (job.where()["step"], job.where()["next_batch"]) == (2, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_folders_own_checkpoint_wins_over_initial_load_path(backend, tmp_path):
    other = Job(backend, str(tmp_path / "other"), interval=2, last_save_model_only=False)
    other.train(2)
    other.finish()
    own = Job(backend, str(tmp_path / "own"), seed=1, interval=3, last_save_model_only=False)
    own.train(3)
    own.finish()
    job = Job(backend, str(tmp_path / "own"), seed=2, initial_load_model_only=False,
              initial_load_path=str(tmp_path / "other" / "checkpoint" / "step-2"))
    job.ckpt.load()
    assert job.where()["step"] == 3


def test_a_rolled_back_run_saves_its_model_only_last_step_over_a_whole_one(tmp_path):
    """Steps 1-3 saved whole; a run rolled back to step 1 saves step 3 as its last, the model
    alone: the earlier optimizer and training state go, so step 3 is no resume point."""
    _whole_run(str(tmp_path), 3)
    again = Job("checkpointer", str(tmp_path), seed=1, interval=1, load_step=1, last_save_model_only=True)
    again.ckpt.load(step=1)
    again.train(1)
    again.train(1, save=False)
    again.ckpt.save(3, last_step=True)
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder / "step-3")) == ["model"]
    assert checkpointer.latest_checkpoint(str(folder)) == str(folder / "step-2")
    saved = {k: torch.empty_like(v) for k, v in again.model.state_dict().items()}
    checkpointer.Checkpointer().load(str(folder / "step-3" / "model"), saved)
    assert all(torch.equal(saved[k], v) for k, v in again.model.state_dict().items())


def test_hugging_face_names_without_an_adapter_are_refused(tmp_path):
    with pytest.raises(ValueError, match="need the model's state_dict_adapter; this model has none"):
        Job("checkpointer", str(tmp_path), last_save_in_hf=True)


def test_pipeline_parallel_model_parts_are_refused(tmp_path):
    job = Job("checkpointer", str(tmp_path))
    config = job.ckpt.config
    with pytest.raises(ValueError, match="this job has 2 model parts"):
        type(job.ckpt)(config, dataloader=job.loader, model_parts=[job.model, job.model], optimizers=job.optimizers,
                       lr_schedulers=job.schedulers, states={}, base_folder=str(tmp_path))


def test_config_lowers_async_mode_and_refuses_quantized_hugging_face_loads(tmp_path):
    from checkpointer.integrations.torchtitan import CheckpointerManager

    assert CheckpointerManager.Config(async_mode="Async").async_mode == "async"
    with pytest.raises(ValueError, match="quantized"):
        CheckpointerManager.Config(enable=True, initial_load_path=str(tmp_path), initial_load_in_hf=True,
                                   initial_load_in_hf_quantized=True)


class _RenamingAdapter:
    """A ``state_dict_adapter`` that only renames (``0.weight`` <-> ``hf.0.weight``)."""

    def __init__(self, hf_assets_path: str | None = None):
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state: dict) -> dict:
        return {f"hf.{k}": v for k, v in state.items()}


def test_a_job_starts_from_the_adapters_hugging_face_checkpoint_in_bfloat16(tmp_path):
    """``initial_load_in_hf`` with no ``initial_load_path``: the adapter's ``hf_assets_path``,
    its bfloat16 shards cast into the fp32 model as they load."""
    from safetensors.torch import save_file

    source = Job("checkpointer", str(tmp_path / "a"), seed=3)
    hf = {f"hf.{k}": v.to(torch.bfloat16).contiguous() for k, v in source.model.state_dict().items()}
    save_file(hf, str(tmp_path / "model.safetensors"))
    job = Job("checkpointer", str(tmp_path / "b"), seed=1, sd_adapter=_RenamingAdapter(str(tmp_path)),
              initial_load_in_hf=True)
    assert job.ckpt.load()
    for k, v in job.model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, hf[f"hf.{k}"].float()), k


def test_last_save_in_hf_writes_the_last_step_as_hugging_face_shards(tmp_path):
    from safetensors.torch import load_file

    job = Job("checkpointer", str(tmp_path), sd_adapter=_RenamingAdapter(), interval=10, last_save_in_hf=True,
              export_dtype="bfloat16")
    job.train(1, save=False)
    job.ckpt.save(1, last_step=True)
    step = tmp_path / "checkpoint" / "step-1"
    assert "model" not in os.listdir(step)
    shards = {}
    for name in os.listdir(step):
        if name.endswith(".safetensors"):
            shards.update(load_file(str(step / name)))
    expected = {f"hf.{k}": v.to(torch.bfloat16) for k, v in job.model.state_dict().items()}
    assert set(shards) == set(expected) and all(torch.equal(shards[k], v) for k, v in expected.items())


def test_the_loader_position_is_saved_per_rank_and_the_rest_as_job_values(tmp_path):
    import json

    job = Job("checkpointer", str(tmp_path), interval=2, last_save_model_only=False)
    job.train(2)
    train = dict(checkpointer.lazy_load(str(tmp_path / "checkpoint" / "step-2" / "train")))
    manifest = json.loads(bytes(train["manifest"].tolist()))
    assert (manifest["job"], manifest["per_rank"]) == (["lr_scheduler", "train_state"], ["dataloader"])
