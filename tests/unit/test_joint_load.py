"""Several checkpoints loaded as one (a model's and its optimizer's): metadata read together,
reads in one pool, nothing written before every state dict is planned."""

from __future__ import annotations

import pytest
import torch

from checkpointer import Checkpointer, CheckpointMismatchError, CorruptCheckpointError
from checkpointer.engine.load import load_state_dicts, read_metadata, read_metadatas
from checkpointer.storage.local import LocalStorage


def _state(seed: int, n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(3 + i, 5, generator=gen) for i in range(n)}


@pytest.fixture()
def two(tmp_path):
    """Two checkpoints of different tensors (and metadata of different lengths)."""
    states = [_state(1, 2), _state(2, 5)]
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path, state in zip(paths, states):
        Checkpointer().save(path, state)
    return [LocalStorage(p) for p in paths], states


def test_metadata_of_several_checkpoints_each_its_own(two):
    storages, states = two
    metas = read_metadatas(storages, no_dist=True)
    assert [sorted(m.tensors) for m in metas] == [sorted(s) for s in states]
    assert metas == [read_metadata(s, no_dist=True) for s in storages]
    assert read_metadatas([], no_dist=True) == []


@pytest.mark.parametrize("verify", [False, True])
def test_both_filled_in_place_then_finish_runs(two, verify):
    storages, states = two
    targets = [{k: torch.zeros_like(v) for k, v in s.items()} for s in states]
    ids = [{k: v.data_ptr() for k, v in t.items()} for t in targets]
    seen: list[list[str]] = []
    finished: list[bool] = []

    def state_dicts(readers):
        seen.append([sorted(r.metadata.tensors) for r in readers])
        return targets

    load_state_dicts(storages, state_dicts, finish=lambda: finished.append(True), no_dist=True, verify=verify)
    assert seen == [[sorted(s) for s in states]] and finished == [True]
    for target, state, ptrs in zip(targets, states, ids):
        for k, v in state.items():
            assert torch.equal(target[k], v) and target[k].data_ptr() == ptrs[k], k


def test_a_given_metadata_is_not_read_again(two):
    storages, states = two
    given = read_metadata(storages[0], no_dist=True)
    got: list = []

    def state_dicts(readers):
        got.extend(r.metadata for r in readers)
        return [{k: torch.zeros_like(v) for k, v in s.items()} for s in states]

    load_state_dicts(storages, state_dicts, metadatas=[given, None], no_dist=True)
    assert got[0] is given and sorted(got[1].tensors) == sorted(states[1])


def test_nothing_is_written_when_the_second_does_not_plan(two):
    """A mismatch in the second state dict is raised before the first is filled."""
    storages, states = two
    first = {k: torch.zeros_like(v) for k, v in states[0].items()}
    second = {k: torch.zeros_like(v) for k, v in states[1].items()}
    second["t4"] = torch.zeros(99, 5)
    with pytest.raises(CheckpointMismatchError, match="t4"):
        load_state_dicts(storages, lambda readers: [first, second], no_dist=True)
    assert all(not v.any() for v in first.values())


def test_an_error_in_finish_is_raised(two):
    storages, states = two

    def fail() -> None:
        raise CorruptCheckpointError("finish saw something wrong")

    targets = [{k: torch.zeros_like(v) for k, v in s.items()} for s in states]
    with pytest.raises(CorruptCheckpointError, match="finish saw"):
        load_state_dicts(storages, lambda readers: targets, finish=fail, no_dist=True)


def test_a_model_and_optimizer_load_reads_each_header_once(tmp_path, monkeypatch):
    """The optimizer's planning (its small tensors, its state's sizes) and the load share one
    reader: each rank file's header is read and parsed once."""
    import checkpointer
    from checkpointer.engine import checks

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    ckpt = str(tmp_path / "ckpt")
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    parsed: list[str] = []
    real = checks.parse_header
    monkeypatch.setattr(checks, "parse_header", lambda data, *, where, **kw: (parsed.append(where), real(data, where=where, **kw))[1])
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpointer.load_model_and_optim_state(ckpt, fresh, fresh_optim)
    assert sorted(parsed) == sorted(set(parsed)) and len(parsed) == 2, parsed  # model/rank_0, optim/rank_0
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
