"""torchtitan 0.3.0's own trainer, saving and resuming through ``checkpointer.integrations.torchtitan``.

Its llama3 debugmodel trains with FSDP on 2 CPU ranks (gloo) under ``torchrun``, launched by
``tests/support/titan_launcher.py`` (which also holds the CPU shims and the config functions).
Skipped where torchtitan is not installed: ``make test-torchtitan`` makes a venv that has it.

Two module-scoped sets of launches (each launch about 20 s of startup and steps on 2 cores). The
first:

- ``reference``: 4 steps uninterrupted, saving asynchronously every step with ``keep_latest_k=2``,
  its folder listed right after each ``save()`` returned (the step just staged still writing);
- ``stopped``: the same job killed after step 2 (its async save of step 2 done), then
  ``resumed``: a new launch of the same command, which finds step 2 and trains steps 3-4 (and
  saves its last step as the model alone, in bfloat16: ``last_save_model_only``, ``export_dtype``);
- ``one_rank``: a world size 1 launch that resumes from (a copy of) the 2-rank step 2 and trains
  steps 3-4 (saving step 4 synchronously, which a 2-rank launch of a single test then loads).

The second (``seeded``): a 1-rank seed checkpoint, a 2-rank job that starts from it and saves its
last step as Hugging Face shards, and a 2-rank job that starts from those. One more launch, in
its own test, loads ``one_rank``'s step 4 at 2 ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
torch = pytest.importorskip("torch")

import titan_launcher  # noqa: E402  (tests/support; after the skip: it needs torchtitan's tokenizers)

STEPS = 4


def _launch(root: Path, name: str, assets: tuple[Path, Path], *, world_size: int = 2, stop: int | None = None,
            dump_folder: str, extra: list[str] = (), dump_loaded: bool = False, steps: int = STEPS,
            config: str = "debugmodel_checkpointer") -> dict[str, Path]:
    out = {"losses": root / f"{name}.losses", "end": root / f"{name}.end.pt", "loaded": root / f"{name}.loaded.pt"}
    out["timings"] = root / f"{name}.timings"
    out["folders"] = root / f"{name}.folders"
    env = {"TITAN_LOSSES": str(out["losses"]), "TITAN_DUMP_END": str(out["end"]), "TITAN_TIMINGS": str(out["timings"]),
           "TITAN_FOLDERS": str(out["folders"])}
    if stop is not None:
        env["TITAN_STOP_AFTER"] = str(stop)
    if dump_loaded:
        env["TITAN_DUMP_LOADED"] = str(out["loaded"])
    tokenizer, data = assets
    args = titan_launcher.train_args(tokenizer=tokenizer, data=data, dump=root / dump_folder, steps=steps, extra=extra,
                                     config=config)
    titan_launcher.launch(world_size, args, env, log=root / f"{name}.log")
    return out


def _losses(path: Path) -> list[tuple[int, float]]:
    return [tuple(x) for x in json.loads(Path(f"{path}.0").read_text())]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    assets = titan_launcher.write_assets(root / "assets")
    every_step = ["--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]
    runs = {"root": root, "assets": assets}
    async_save = ["--checkpoint.async_mode", "async"]
    runs["reference"] = _launch(root, "reference", assets, dump_folder="reference", extra=every_step + async_save)
    runs["stopped"] = _launch(root, "stopped", assets, stop=2, dump_folder="job", extra=async_save)
    shutil.copytree(root / "job/checkpoint/step-2", root / "one_rank/checkpoint/step-2")
    last_model_only = ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    runs["resumed"] = _launch(root, "resumed", assets, dump_folder="job", extra=async_save + last_model_only)
    runs["one_rank"] = _launch(root, "one_rank", assets, world_size=1, dump_folder="one_rank", dump_loaded=True)
    return runs


def _assert_equal(expected, actual, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert torch.equal(expected, actual), f"{where} differs"
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), f"{where}: keys {sorted(set(expected) ^ set(actual))}"
        for key in expected:
            _assert_equal(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            _assert_equal(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def test_a_resumed_job_matches_an_uninterrupted_one_bitwise(runs):
    reference = _losses(runs["reference"]["losses"])
    assert [s for s, _ in reference] == [1, 2, 3, 4]
    assert _losses(runs["stopped"]["losses"]) == reference[:2]
    assert _losses(runs["resumed"]["losses"]) == reference[2:], "the resumed steps' losses differ"
    for rank in (0, 1):
        saves = json.loads(Path(f"{runs['stopped']['timings']}.{rank}").read_text())
        assert saves["save_steps"] == [2] and saves["returned_future"] == [True], "async_mode=async saved synchronously"
        saves = json.loads(Path(f"{runs['reference']['timings']}.{rank}").read_text())
        assert saves["save_steps"] == [1, 2, 3, 4] and saves["returned_future"] == [True] * 4
    end = torch.load(runs["reference"]["end"], weights_only=True)
    resumed = torch.load(runs["resumed"]["end"], weights_only=True)
    assert end["step"] == resumed["step"] == STEPS
    _assert_equal(end, resumed, "state after step 4")


def test_the_checkpoints_are_ordinary_checkpointer_checkpoints(runs):
    import checkpointer

    job = runs["root"] / "job/checkpoint"
    assert checkpointer.latest_checkpoint(str(job)) == f"{job}/step-2", "a model-only step is not a resume point"
    stopped_end = torch.load(runs["stopped"]["end"], weights_only=True)
    full = checkpointer.unshard_model_state(f"{job}/step-2", no_dist=True)
    # torchtitan saves its fused wqkv as wq/wk/wv; the other parameters are saved as they are.
    for name, value in stopped_end["model"].items():
        assert torch.equal(full[name], value), name
    assert sorted(p.name for p in (job / "step-2").iterdir()) == ["model", "optim", "train"], "no titan/ side files"
    train = dict(checkpointer.lazy_load(str(job / "step-2/train")))

    def value(key):
        return json.loads(bytes(train[key].tolist()))

    assert value("manifest")["job"] == ["lr_scheduler", "train_state"]
    assert value("manifest")["per_rank"] == ["dataloader"]
    assert value("job.lr_scheduler") == {"last_epoch": 2}
    assert value("job.train_state")["step"] == 2
    for rank in (0, 1):
        loader = value(f"rank{rank}.dataloader")
        assert (loader["dp_rank"], loader["dp_world_size"]) == (rank, 2)


def test_the_last_step_saves_the_model_alone_in_the_export_dtype(runs):
    import checkpointer

    step4 = runs["root"] / "job/checkpoint/step-4"
    assert sorted(p.name for p in step4.iterdir()) == ["model"]
    end = torch.load(runs["resumed"]["end"], weights_only=True)["model"]
    exported = checkpointer.unshard_model_state(str(step4), no_dist=True)
    for name, value in end.items():
        assert exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name


def test_keep_latest_k_keeps_the_newest_complete_steps(runs):
    """``keep_latest_k=2``: the run ends with steps 2-4. The last async save ends in ``close()``,
    which makes no collective, so no prune follows it (torchtitan's DCP backend does the same):
    step 2 goes at the next run's first save."""
    folder = runs["root"] / "reference/checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3", "step-4"]
    for step in ("step-2", "step-3", "step-4"):
        for part in ("model", "optim"):
            assert (folder / step / part / "metadata.json").is_file(), (step, part)


def test_keep_latest_k_with_an_async_save_in_flight_keeps_the_newest_complete_step(runs):
    """Right after each ``save()`` of step N returned (step N still writing), the folder holds
    step N and the newest complete step N-1; later, N-1 and N only (``keep_latest_k=2``)."""
    listings = json.loads(runs["reference"]["folders"].read_text())
    assert [x["step"] for x in listings] == [1, 2, 3, 4]
    for listing in listings:
        step = listing["step"]
        assert f"step-{step}" in listing["dirs"], listing
        if step > 1:
            assert f"step-{step - 1}" in listing["complete"], listing
            assert listing["latest"] in (f"step-{step - 1}", f"step-{step}"), listing
        assert all(int(d.removeprefix("step-")) >= step - 2 for d in listing["dirs"]), listing


def test_a_checkpoint_of_two_ranks_loads_exactly_on_one(runs):
    saved = torch.load(runs["stopped"]["end"], weights_only=True)
    loaded = torch.load(runs["one_rank"]["loaded"], weights_only=True)
    for part in ("model", "optimizer", "lr_scheduler"):
        _assert_equal(saved[part], loaded[part], part)
    assert loaded["step"] == 2
    log = (runs["root"] / "one_rank.log").read_text()
    assert "the data loader was saved at data-parallel size 2, this job has 1" in log


def test_a_checkpoint_of_one_rank_loads_exactly_on_two(runs, tmp_path):
    """1 -> 2 ranks (``one_rank``'s synchronous save of step 4): model, optimizer and LR state
    exact; rank 1 has no saved loader position (``LoadResult.missing_keys``) and rank 0's belongs
    to another data-parallel size: both warn."""
    saved = runs["one_rank"]
    shutil.copytree(runs["root"] / "one_rank/checkpoint/step-4", tmp_path / "job/checkpoint/step-4")
    loaded = _launch(tmp_path, "two", runs["assets"], stop=STEPS, dump_folder="job", dump_loaded=True)
    saves = json.loads(Path(f"{saved['timings']}.0").read_text())
    assert saves["save_steps"] == [STEPS] and saves["returned_future"] == [False], "a synchronous save"
    expected = torch.load(saved["end"], weights_only=True)
    actual = torch.load(loaded["loaded"], weights_only=True)
    for part in ("model", "optimizer", "lr_scheduler"):
        _assert_equal(expected[part], actual[part], part)
    assert actual["step"] == STEPS
    log = (tmp_path / "two.log").read_text()
    assert "the data loader was saved by fewer ranks than this job has (rank 1 has no saved position)" in log
    assert "the data loader was saved at data-parallel size 1, this job has 2" in log


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Three launches: ``seed`` (1 rank) makes a seed checkpoint; ``hf_save`` (2 ranks) starts from
    it, trains one step and saves it as Hugging Face shards; ``hf_start`` (2 ranks) starts from those.
    The adapter of their config renames only."""
    root = tmp_path_factory.mktemp("titan_seeded")
    assets = titan_launcher.write_assets(root / "assets")
    hf_names = "debugmodel_checkpointer_hf_names"
    seed_flags = ["--checkpoint.create_seed_checkpoint", "--checkpoint.last_save_model_only", "--debug.seed", "11"]
    _launch(root, "seed", assets, world_size=1, dump_folder="job", extra=seed_flags, config=hf_names)
    hf_flags = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]
    saved = _launch(root, "hf_save", assets, dump_folder="job", steps=1, extra=hf_flags, dump_loaded=True,
                    config=hf_names)
    step1 = root / "job/checkpoint/step-1"
    hf_load = ["--checkpoint.initial_load_path", str(step1), "--checkpoint.initial_load_in_hf", "--debug.seed", "13"]
    started = _launch(root, "hf_start", assets, stop=0, dump_folder="started", extra=hf_load, dump_loaded=True,
                      config=hf_names)
    return {"root": root, "hf_save": saved, "hf_start": started}


def test_a_seed_checkpoint_starts_a_job(seeded):
    """``--checkpoint.create_seed_checkpoint`` on one rank saves ``step-0`` (the model alone); a
    2-rank job started on that folder begins from it (the seed was made with another RNG seed)."""
    import checkpointer

    step0 = seeded["root"] / "job/checkpoint/step-0"
    assert sorted(p.name for p in step0.iterdir()) == ["model"]
    seeded_model = checkpointer.unshard_model_state(str(step0), no_dist=True)
    loaded = torch.load(seeded["hf_save"]["loaded"], weights_only=True)["model"]
    assert set(loaded) == set(seeded_model)
    for name, value in loaded.items():
        assert torch.equal(seeded_model[name], value), name


def test_a_job_starts_from_a_hugging_face_checkpoint(seeded):
    """``last_save_in_hf`` writes the last step as Hugging Face shards (the adapter's names); a new
    2-rank job with ``initial_load_in_hf`` starts from them with the exact trained parameters. The
    adapter renames only (llama3's own permutes wq/wk: refused, in ``test_torchtitan_manager.py``)."""
    step1 = seeded["root"] / "job/checkpoint/step-1"
    names = sorted(p.name for p in step1.iterdir())
    assert "model.safetensors.index.json" in names and "model" not in names, names
    index = json.loads((step1 / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"]
    expected = torch.load(seeded["hf_save"]["end"], weights_only=True)["model"]
    loaded = torch.load(seeded["hf_start"]["loaded"], weights_only=True)["model"]
    _assert_equal(expected, loaded, "model")
