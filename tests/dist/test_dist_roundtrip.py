"""World size 1: a plain module and AdamW saved and loaded back into a fresh model."""

from __future__ import annotations

import pytest
from dist_helpers import (
    assert_same,
    build_model,
    build_optim,
    local_data_ptrs,
    model_full_state,
    optim_full_state,
    train,
)

from checkpointer import load_model_and_optim_state, save_model_and_optim_state


def _round_trip(rank, world_size, ckpt, optim_kind, as_url):
    model = build_model(1)
    optim = build_optim(model, optim_kind)
    train(model, optim, range(2))
    expected_model = model_full_state(model)
    expected_optim = optim_full_state(model, optim)
    target = f"file://{ckpt}" if as_url else ckpt
    files = save_model_and_optim_state(target, model, optim)
    assert files, "save returned no files"

    fresh = build_model(1, seed=1)
    fresh.scale.fill_(-1.0)  # buffers must be loaded too
    fresh_optim = build_optim(fresh, optim_kind, fresh=True)
    ptrs = local_data_ptrs(fresh)
    load_model_and_optim_state(target, fresh, fresh_optim)
    assert local_data_ptrs(fresh) == ptrs, "load replaced tensors instead of filling them in place"
    assert_same(expected_model, model_full_state(fresh), "model")
    assert_same(expected_optim, optim_full_state(fresh, fresh_optim), "optimizer")
    # Training goes on identically from the loaded copy.
    assert train(model, optim, range(2, 4)) == train(fresh, fresh_optim, range(2, 4))
    return True


@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
def test_round_trip_in_a_process_group_of_one(run_distributed, tmp_path, optim_kind):
    assert run_distributed(_round_trip, 1, str(tmp_path / "ckpt"), optim_kind, False) == [True]


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_round_trip_without_a_process_group(run_distributed, tmp_path, as_url):
    assert run_distributed(_round_trip, 1, str(tmp_path / "ckpt"), "adamw", as_url, init_pg=False) == [True]
