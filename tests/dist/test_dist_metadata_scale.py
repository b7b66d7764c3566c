"""metadata.json does not grow with the number of ranks (format 2), and format 1 still loads."""

from __future__ import annotations

import json
import os

import torch
from dist_helpers import build_model, build_optim, model_full_state, train

from checkpointer import Checkpointer, save_model_and_optim_state
from checkpointer.tools.verify import verify_checkpoint


def _save(rank, world_size, top, compact):
    from checkpointer.engine import save as engine_save

    engine_save.COMPACT_METADATA = compact
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    save_model_and_optim_state(top, model, optim)
    return model_full_state(model)


def test_metadata_size_at_4_ranks_against_2_and_the_old_form_still_loads(run_distributed, tmp_path):
    sizes = {}
    for world, compact in ((2, True), (4, True), (2, False)):  # 4: a pool the other tests start too
        top = str(tmp_path / f"w{world}-{compact}")
        full = run_distributed(_save, world, top, compact)[0]
        for part in ("model", "optim"):
            path = os.path.join(top, part)
            with open(os.path.join(path, "metadata.json")) as f:
                doc = json.load(f)
            sizes[world, compact, part] = os.path.getsize(os.path.join(path, "metadata.json"))
            assert doc["format_version"] == (2 if compact else 1)
            listed = any("shard_spec_per_file" in t for t in doc["tensors"].values())
            assert listed == (not compact), doc  # every tensor of an FSDP2 model follows a rule
            assert verify_checkpoint(path) == []
        got = Checkpointer().unshard(os.path.join(top, "model"))
        assert got.keys() == full.keys()
        for key, value in full.items():
            assert torch.equal(got[key], value), key
    for part in ("model", "optim"):
        assert sizes[4, True, part] <= 1.25 * sizes[2, True, part], sizes
        assert sizes[2, True, part] < sizes[2, False, part], sizes
