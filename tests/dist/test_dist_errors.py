"""Errors raised on purpose: the class from API.md, on every rank, naming the key or file, fast."""

from __future__ import annotations

import os
import re

import pytest
import torch
from dist_helpers import build_model, build_optim, catch, metadata_form, model_full_state, to_layout, train

import checkpointer
from checkpointer import (
    Checkpointer,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
)

FAST_S = 20.0  # "within seconds": far below the library's 300 s timeout and the harness's


def flat_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"alpha_weight": torch.randn(8, 17, generator=g), "beta_bias": torch.randn(5, generator=g)}


def flat_state(world_size: int) -> dict[str, torch.Tensor]:
    full = flat_full()
    layout = {1: "plain", 2: "shard0@2", 3: "shard0@3", 4: "shard0@4"}[world_size]
    return {"alpha_weight": to_layout(full["alpha_weight"], layout), "beta_bias": full["beta_bias"]}


def _save_flat(rank, world_size, ckpt, compact=True):
    with metadata_form(compact):
        Checkpointer().save(ckpt, flat_state(world_size))
    return True


def _load_flat(rank, world_size, ckpt, overrides=None, only_rank=None):
    """Load into ``flat_state``; ``overrides`` replace (or add, or with None remove) entries."""
    state = flat_state(world_size)
    if overrides and (only_rank is None or rank == only_rank):
        for k, v in overrides.items():
            if v is None:
                state.pop(k)
            else:
                state[k] = v
    return catch(Checkpointer().load, ckpt, state)


def check_all_raised(results, cls, *needles, world_size=None):
    """Every rank raised ``cls`` (or a subclass), naming every needle, within seconds."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} raised nothing (expected {cls.__name__})"
        assert cls.__name__ in r["mro"], f"rank {rank} raised {r['type']}, not {cls.__name__}:\n{r['traceback']}"
        for needle in needles:
            assert needle in r["msg"], f"rank {rank}: {needle!r} not in message {r['msg']!r}"
        assert r["seconds"] < FAST_S, f"rank {rank} took {r['seconds']:.1f}s to raise"


@pytest.fixture
def flat_ckpt(run_distributed, tmp_path):
    """A fresh flat checkpoint saved by 2 ranks (one file each), to be damaged by the test."""
    ckpt = str(tmp_path / "flat")
    run_distributed(_save_flat, 2, ckpt)
    assert sorted(os.listdir(ckpt)) == ["metadata.json", "rank_0.safetensors", "rank_1.safetensors"]
    return ckpt


@pytest.fixture
def listed_ckpt(run_distributed, tmp_path):
    """The same in format 1 (every piece listed file by file), for tests that edit those lists
    (hostile shard rules: ``reliability/test_hostile_rules.py``)."""
    ckpt = str(tmp_path / "flat")
    run_distributed(_save_flat, 2, ckpt, False)
    return ckpt


# --------------------------------------------------------------------------------------
# FileExistsError
# --------------------------------------------------------------------------------------


def _save_twice(rank, world_size, ckpt):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    save_model_and_optim_state(ckpt, model, optim)
    train(model, optim, range(1, 2))
    second = catch(save_model_and_optim_state, ckpt, model, optim)
    flat = catch(Checkpointer().save, f"{ckpt}/model", {"x": torch.ones(3)})
    save_model_and_optim_state(ckpt, model, optim, save_overwrite=True)
    return second, flat, model_full_state(model)


def _load_model(rank, world_size, ckpt, expected):
    model = build_model(world_size, seed=1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    got = model_full_state(model)
    return all(torch.equal(got[k], v) for k, v in expected.items())


def test_save_over_existing_checkpoint(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_save_twice, 2, ckpt)
    check_all_raised([r[0] for r in results], FileExistsError)
    check_all_raised([r[1] for r in results], FileExistsError)
    for r in results:
        assert ckpt in r[0]["msg"] or "model" in r[0]["msg"], r[0]["msg"]
    # save_overwrite=True replaced it with the state after the second step.
    assert run_distributed(_load_model, 3, ckpt, results[0][2]) == [True] * 3


# --------------------------------------------------------------------------------------
# Damaged checkpoints: CorruptCheckpointError / IncompleteCheckpointError
# --------------------------------------------------------------------------------------


def _try_all_loads(rank, world_size, ckpt):
    """Checkpointer.load, .unshard, .get_metadata on a damaged flat checkpoint."""
    return {
        "load": _load_flat(rank, world_size, ckpt),
        "unshard": catch(Checkpointer().unshard, ckpt),
        "unshard_no_dist": catch(Checkpointer().unshard, ckpt, no_dist=True),
    }


@pytest.mark.parametrize("load_ws", [2, 3])
def test_missing_metadata_is_incomplete(run_distributed, flat_ckpt, load_ws):
    os.remove(os.path.join(flat_ckpt, "metadata.json"))
    results = run_distributed(_try_all_loads, load_ws, flat_ckpt, timeout=60)
    for what in ("load", "unshard", "unshard_no_dist"):
        check_all_raised([r[what] for r in results], checkpointer.IncompleteCheckpointError, "metadata.json")
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError)


def test_bad_json_metadata(run_distributed, flat_ckpt):
    with open(os.path.join(flat_ckpt, "metadata.json"), "w") as f:
        f.write('{"tensors": {"alpha_weight": ')
    results = run_distributed(_try_all_loads, 2, flat_ckpt, timeout=60)
    for what in ("load", "unshard"):
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError, "metadata.json")


def test_metadata_of_wrong_structure(run_distributed, flat_ckpt):
    with open(os.path.join(flat_ckpt, "metadata.json"), "w") as f:
        f.write('{"tensors": {"alpha_weight": {"shape": "eight"}}}')
    results = run_distributed(_try_all_loads, 2, flat_ckpt, timeout=60)
    check_all_raised([r["load"] for r in results], checkpointer.CorruptCheckpointError, "metadata.json")


@pytest.mark.parametrize("cut", ["data", "header"])
@pytest.mark.parametrize("load_ws", [2, 3])
def test_truncated_rank_file(run_distributed, flat_ckpt, cut, load_ws):
    path = os.path.join(flat_ckpt, "rank_1.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 4 if cut == "data" else 12)
    results = run_distributed(_try_all_loads, load_ws, flat_ckpt, timeout=60)
    for what in ("load", "unshard"):
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError, "rank_1.safetensors")


@pytest.mark.parametrize("load_ws", [2, 3])
def test_missing_rank_file(run_distributed, flat_ckpt, load_ws):
    os.remove(os.path.join(flat_ckpt, "rank_1.safetensors"))
    results = run_distributed(_try_all_loads, load_ws, flat_ckpt, timeout=60)
    for what in ("load", "unshard"):
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError, "rank_1.safetensors")


def test_rank_file_with_garbage_header(run_distributed, flat_ckpt):
    path = os.path.join(flat_ckpt, "rank_0.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"[not json")
    results = run_distributed(_try_all_loads, 2, flat_ckpt, timeout=60)
    check_all_raised([r["load"] for r in results], checkpointer.CorruptCheckpointError, "rank_0.safetensors")


# --------------------------------------------------------------------------------------
# CheckpointMismatchError: the state dict disagrees with the checkpoint
# --------------------------------------------------------------------------------------


def _mismatches(rank, world_size, ckpt):
    return {
        "missing_key": _load_flat(rank, world_size, ckpt, {"gamma_missing": torch.zeros(3)}),
        "shape": _load_flat(rank, world_size, ckpt, {"beta_bias": torch.zeros(19)}),
        "shape_dtensor": _load_flat(
            rank, world_size, ckpt, {"alpha_weight": to_layout(torch.zeros(8, 19), f"shard0@{world_size}")}
        ),
        "dtype": _load_flat(rank, world_size, ckpt, {"beta_bias": torch.zeros(5, dtype=torch.float16)}),
        "dtype_int": _load_flat(rank, world_size, ckpt, {"beta_bias": torch.zeros(5, dtype=torch.int64)}),
        # A model built on the meta device and never materialised: nothing can be loaded into it.
        "meta": _load_flat(rank, world_size, ckpt, {"beta_bias": torch.zeros(5, device="meta")}),
        "meta_save": catch(Checkpointer().save, f"{ckpt}-meta", {"meta_weight": torch.zeros(2, 3, device="meta")}),
        # safetensors keeps this name for the file's own metadata.
        "reserved_save": catch(Checkpointer().save, f"{ckpt}-reserved", {"__metadata__": torch.zeros(2)}),
    }


def test_state_dict_mismatches(run_distributed, flat_ckpt):
    results = run_distributed(_mismatches, 2, flat_ckpt, timeout=60)
    err = checkpointer.CheckpointMismatchError
    check_all_raised([r["missing_key"] for r in results], err, "gamma_missing")
    check_all_raised([r["shape"] for r in results], err, "beta_bias", "19", "5")
    check_all_raised([r["shape_dtensor"] for r in results], err, "alpha_weight", "19", "17")
    for what, other in (("dtype", ("float16", "F16")), ("dtype_int", ("int64", "I64"))):
        check_all_raised([r[what] for r in results], err, "beta_bias")
        for rank, r in enumerate(results):
            msg = r[what]["msg"]
            assert any(s in msg for s in other) and any(s in msg for s in ("float32", "F32")), (rank, msg)
    check_all_raised([r["meta"] for r in results], checkpointer.CheckpointError, "beta_bias", "meta")
    check_all_raised([r["meta_save"] for r in results], checkpointer.CheckpointError, "meta_weight", "meta")
    check_all_raised([r["reserved_save"] for r in results], checkpointer.CheckpointError, "__metadata__", "reserves")


def _model_mismatch(rank, world_size, ckpt):
    model = build_model(world_size, seed=1)
    import torch.nn as nn

    # A model whose proj layer has a different shape than the checkpoint's Linear(7, 13).
    torch.manual_seed(0)
    other = build_model(1, seed=0, fsdp=False)
    other.proj = nn.Linear(7, 14)
    if world_size > 1:
        from dist_helpers import mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(other.embed, mesh=mesh((world_size,)))
        fully_shard(other.proj, mesh=mesh((world_size,)))
        fully_shard(other, mesh=mesh((world_size,)))
    del model
    return catch(load_model_and_optim_state, ckpt, other, build_optim(other, "adamw"))


def _save_model(rank, world_size, ckpt, compact=True):
    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(1))
    with metadata_form(compact):
        save_model_and_optim_state(ckpt, model, optim)
    return True


def test_model_shape_mismatch(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_model, 2, ckpt)
    for load_ws in (1, 3):
        results = run_distributed(_model_mismatch, load_ws, ckpt, timeout=60)
        check_all_raised(results, checkpointer.CheckpointMismatchError, "proj.weight")


def _optim_mismatch(rank, world_size, ckpt):
    """Two param groups where the checkpoint has one: raised before any tensor is written."""
    model = build_model(world_size, seed=1)
    before = model_full_state(model)
    params = list(model.parameters())
    optim = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3)
    out = catch(load_model_and_optim_state, ckpt, model, optim)
    after = model_full_state(model)
    out["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
    out["optim_state"] = len(optim.state)
    return out


def test_optimizer_mismatch_leaves_the_model_untouched(run_distributed, tmp_path):
    """The model and its optimizer are planned together: an optimizer that does not fit the
    checkpoint is found before the model is overwritten, on every rank."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_model, 2, ckpt)
    results = run_distributed(_optim_mismatch, 2, ckpt, timeout=60)
    check_all_raised(results, checkpointer.CheckpointMismatchError, "param groups")
    for rank, r in enumerate(results):
        assert r["changed"] == [] and r["optim_state"] == 0, (rank, r["changed"], r["optim_state"])


# --------------------------------------------------------------------------------------
# One rank fails in the middle of a load: every rank raises, quickly, none hangs
# --------------------------------------------------------------------------------------


def names_rank(msg: str, rank: int) -> bool:
    return re.search(rf"rank\D{{0,3}}{rank}\b", msg) is not None


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_with_a_wrong_shape(run_distributed, tmp_path, world_size):
    ckpt = str(tmp_path / "flat")
    run_distributed(_save_flat, 2, ckpt)
    results = run_distributed(
        _load_flat, world_size, ckpt, {"beta_bias": torch.zeros(19)}, 1, timeout=60
    )
    check_all_raised(results, checkpointer.CheckpointMismatchError, "beta_bias")
    for rank, r in enumerate(results):
        if rank != 1:
            assert names_rank(r["msg"], 1), f"rank {rank}'s error does not name rank 1: {r['msg']!r}"


def _unfillable_destination_on_rank1(rank, world_size, ckpt, strategy):
    """Rank 1's tensor is an expanded view (its elements share memory): it cannot be filled,
    which shows only when the bytes read (or received) are copied into it, at the very end."""
    state = flat_state(world_size)
    if rank == 1:
        state["beta_bias"] = torch.zeros(1).expand(5)
    return catch(Checkpointer().load, ckpt, state, strategy=strategy)


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_destination_that_cannot_be_filled_on_one_rank(run_distributed, flat_ckpt, strategy):
    results = run_distributed(_unfillable_destination_on_rank1, 3, flat_ckpt, strategy, timeout=60)
    check_all_raised(results, checkpointer.CheckpointError, "beta_bias")


def _reader_fails_on_rank1(rank, world_size, ckpt, api):
    from unittest import mock

    from checkpointer.storage.local import LocalStorage

    real_read, real_read_into = LocalStorage.read, LocalStorage.read_into

    def read(self, name, *args, **kwargs):
        if name.endswith(".safetensors"):
            raise RuntimeError(f"injected read failure of {name}")
        return real_read(self, name, *args, **kwargs)

    def read_into(self, name, *args, **kwargs):
        if name.endswith(".safetensors"):
            raise RuntimeError(f"injected read failure of {name}")
        return real_read_into(self, name, *args, **kwargs)

    with mock.patch.object(LocalStorage, "read", read), mock.patch.object(LocalStorage, "read_into", read_into):
        return _call_api(api, rank, world_size, ckpt)


def _call_api(api, rank, world_size, ckpt):
    if api == "flat":
        return _load_flat(rank, world_size, ckpt)
    if api == "model":
        model = build_model(world_size, seed=1)
        return catch(load_model_and_optim_state, ckpt, model, build_optim(model, "adamw"))
    return catch(unshard_model_state, ckpt)


def _reader_fails_only_on_rank1(rank, world_size, ckpt, api):
    if rank == 1:
        return _reader_fails_on_rank1(rank, world_size, ckpt, api)
    return _call_api(api, rank, world_size, ckpt)


@pytest.mark.parametrize("api", ["flat", "model", "unshard"])
def test_reader_failure_on_one_rank(run_distributed, tmp_path, api):
    ckpt = str(tmp_path / "ckpt")
    if api == "flat":
        run_distributed(_save_flat, 2, ckpt)
    else:
        run_distributed(_save_model, 2, ckpt)
    results = run_distributed(_reader_fails_only_on_rank1, 3, ckpt, api, timeout=60)
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} raised nothing"
        assert r["seconds"] < FAST_S, f"rank {rank} took {r['seconds']:.1f}s"
        assert "injected read failure" in r["msg"], f"rank {rank}: {r['type']}: {r['msg']}"
        if rank != 1:
            assert "CheckpointError" in r["mro"], f"rank {rank} raised {r['type']}"
            assert names_rank(r["msg"], 1), f"rank {rank}'s error does not name rank 1: {r['msg']!r}"


# --------------------------------------------------------------------------------------
# Metadata that does not add up, flipped bits, hostile pickles
# --------------------------------------------------------------------------------------


def _edit_metadata(ckpt, edit):
    import json

    path = os.path.join(ckpt, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    edit(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def test_metadata_that_does_not_cover_a_tensor(run_distributed, listed_ckpt):
    """One file's piece of a sharded tensor is dropped from metadata: loading must not leave a hole."""
    _edit_metadata(listed_ckpt, lambda m: m["tensors"]["alpha_weight"]["shard_spec_per_file"].pop("rank_1.safetensors"))
    results = run_distributed(_try_all_loads, 3, listed_ckpt, timeout=60)
    for what in ("load", "unshard"):
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError, "alpha_weight")


def test_metadata_naming_a_file_outside_the_checkpoint(run_distributed, listed_ckpt):
    def edit(m):
        specs = m["tensors"]["beta_bias"]["shard_spec_per_file"]
        specs["../rank_0.safetensors"] = specs.pop(next(iter(specs)))

    _edit_metadata(listed_ckpt, edit)
    results = run_distributed(_try_all_loads, 2, listed_ckpt, timeout=60)
    check_all_raised([r["load"] for r in results], checkpointer.CorruptCheckpointError, "../rank_0.safetensors")


def test_overlapping_pieces_in_metadata(run_distributed, listed_ckpt):
    """Two files claiming the same elements (and none claiming others) do not add up."""

    def edit(m):
        specs = m["tensors"]["alpha_weight"]["shard_spec_per_file"]
        specs["rank_1.safetensors"] = dict(specs["rank_1.safetensors"])
        first = specs["rank_0.safetensors"]
        for field in ("flattened_offsets", "local_shape", "global_offset"):
            specs["rank_1.safetensors"][field] = first[field]
        specs["rank_1.safetensors"].pop("checksums", None)

    _edit_metadata(listed_ckpt, edit)
    results = run_distributed(_try_all_loads, 2, listed_ckpt, timeout=60)
    check_all_raised([r["load"] for r in results], checkpointer.CorruptCheckpointError, "alpha_weight")


def _load_verify(rank, world_size, ckpt, verify):
    state = flat_state(world_size)
    for v in state.values():
        (v.to_local() if hasattr(v, "to_local") else v).zero_()
    return catch(Checkpointer().load, ckpt, state, verify=verify)


def test_flipped_bit_is_caught_by_verify(run_distributed, flat_ckpt):
    from safetensors import safe_open

    path = os.path.join(flat_ckpt, "rank_1.safetensors")
    with safe_open(path, framework="pt") as f:
        assert "alpha_weight" in set(f.keys())
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    results = run_distributed(_load_verify, 2, flat_ckpt, True, timeout=60)
    check_all_raised(results, checkpointer.CorruptCheckpointError, "rank_1.safetensors")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_in_param_group_is_refused(run_distributed, tmp_path):
    import json
    import pickle

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_model, 1, ckpt, False)  # format 1: the file's checksums in metadata.json
    marker = str(tmp_path / "pwned")
    optim_dir = os.path.join(ckpt, "optim")
    evil = torch.frombuffer(bytearray(pickle.dumps({"lr": _Evil(marker)}, protocol=2)), dtype=torch.uint8)
    rank0 = os.path.join(optim_dir, "rank_0.safetensors")
    tensors = load_file(rank0)
    with safe_open(rank0, framework="pt") as f:
        header_metadata = f.metadata()  # the file's id, which metadata.json lists: the file stays "ours"
    tensors["param_group0"] = evil.clone()
    save_file(tensors, rank0, metadata=header_metadata)
    with open(os.path.join(optim_dir, "metadata.json")) as f:
        meta = json.load(f)
    entry = meta["tensors"]["param_group0"]
    entry["shape"] = [evil.numel()]
    spec = entry["shard_spec_per_file"]["rank_0.safetensors"]
    spec["flattened_offsets"] = [[0, evil.numel()]]
    spec.pop("checksums", None)
    with open(os.path.join(optim_dir, "metadata.json"), "w") as f:
        json.dump(meta, f)
    results = run_distributed(_load_and_unshard_optim, 2, ckpt, timeout=60)
    assert not os.path.exists(marker), "the pickle's global was executed"
    for what in ("load", "unshard"):
        check_all_raised([r[what] for r in results], checkpointer.CorruptCheckpointError, "param_group0")


def _load_and_unshard_optim(rank, world_size, ckpt):
    model = build_model(world_size, seed=1)
    return {
        "load": catch(load_model_and_optim_state, ckpt, model, build_optim(model, "adamw")),
        "unshard": catch(checkpointer.unshard_optim_state, ckpt),
    }


def _collectives_with_a_slow_store(rank, world_size, marker):
    """Rank 1 enters once rank 0 has started recording its arrival, in a store that takes 0.3 s
    to answer: the collective can end while that record is in flight. Has every record ended
    when the collectives return?"""
    import os as _os
    import time as _time

    from checkpointer import dist as cdist
    from checkpointer.dist import arrivals

    real, late, real_init = arrivals._store, arrivals._LATE_S, arrivals._Arrival.__init__

    class SlowStore:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            open(marker, "w").close()
            _time.sleep(0.3)
            return self.store.set(key, value)

    seen = []

    def init(self, group=None, kind=""):
        real_init(self, group, kind)
        seen.append(self)

    arrivals._store, arrivals._LATE_S = (lambda: SlowStore(real())), 0.2
    arrivals._Arrival.__init__ = init
    try:
        if rank == 1:
            deadline = _time.monotonic() + 30
            while not _os.path.exists(marker) and _time.monotonic() < deadline:
                _time.sleep(0.01)
        cdist.all_gather_bytes(b"x" * rank)
        cdist.agree(None, "test")
        return [(a.recorded is not None, a.recorded is None or a.recorded.done()) for a in seen]
    finally:
        arrivals._store, arrivals._Arrival.__init__, arrivals._LATE_S = real, real_init, late


def test_no_store_record_outlives_its_collective(run_distributed, tmp_path):
    """A record still inside the store's C++ client when the process exits aborted it ('terminate
    called without an active exception', about 1 in 12 CLI runs under torchrun on a busy host)."""
    first, second = run_distributed(_collectives_with_a_slow_store, 2, str(tmp_path / "recording"))
    assert first[0] == (True, True), first  # rank 0 recorded, and the record had ended
    assert all(done for _, done in first + second), (first, second)  # rank 1 may then wait for rank 0's record


# ---------------------------------------------------------------------------------------
# One way to end a collective phase: the failing rank's traceback reaches the others
# ---------------------------------------------------------------------------------------


def _fail_deep_in_rank_one():
    raise ValueError("boom on rank 1")


def _phase_failure(rank, world_size):
    from checkpointer import dist as cdist
    from checkpointer.errors import RankFailedError

    try:
        with cdist.phase("test step"):
            if rank == 1:
                _fail_deep_in_rank_one()
    except RankFailedError as ex:
        return {"rank": rank, "type": "RankFailedError", "msg": str(ex),
                "failures": {r: (f.type, f.message, f.traceback) for r, f in ex.failures.items()}}
    except ValueError as ex:
        return {"rank": rank, "type": "ValueError", "msg": str(ex)}
    return {"rank": rank, "type": None}


def test_a_failed_phase_carries_the_failing_ranks_traceback(run_distributed):
    results = run_distributed(_phase_failure, 3)
    assert results[1] == {"rank": 1, "type": "ValueError", "msg": "boom on rank 1"}
    for rank in (0, 2):
        r = results[rank]
        assert r["type"] == "RankFailedError", r
        assert "test step failed on rank 1: ValueError: boom on rank 1" in r["msg"]
        assert "rank 1's traceback" in r["msg"] and "_fail_deep_in_rank_one" in r["msg"], r["msg"]
        assert list(r["failures"]) == [1]
        kind, message, trace = r["failures"][1]
        assert (kind, message) == ("ValueError", "boom on rank 1")
        assert trace.startswith("Traceback") and "_fail_deep_in_rank_one" in trace


def test_a_shape_mismatch_on_rank_one_shows_its_traceback_on_rank_zero(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ck")
    run_distributed(_save_flat, 2, ckpt)
    results = run_distributed(_load_flat, 2, ckpt, {"beta_bias": torch.zeros(6)}, 1)
    check_all_raised(results, checkpointer.CheckpointMismatchError, "beta_bias")
    assert "rank 1's traceback" in results[0]["msg"] and "plan_local_loads" in results[0]["msg"]


def _save_to_different_directories(rank, world_size, root):
    """Ranks that pass different directories (a rank-dependent path, or node-local disks): each
    committed a metadata.json listing rank files that were written elsewhere (found by a review)."""
    from resume_helpers import build_job

    job = build_job(world_size, seed=0)
    ckpt = Checkpointer()
    out = {"first": catch(ckpt.save, os.path.join(root, f"flat{rank}"), flat_state(world_size))}
    ckpt.save(os.path.join(root, "same"), flat_state(world_size))  # the plan is cached for the next save
    out["cached"] = catch(ckpt.save, os.path.join(root, f"cached{rank}"), flat_state(world_size))
    out["parts"] = catch(checkpointer.save_model_and_optim_state, os.path.join(root, f"step{rank}"), job.model, job.optim)
    out["after"] = catch(ckpt.save, os.path.join(root, "after"), flat_state(world_size))  # in step afterwards
    return out


def test_ranks_saving_to_different_directories_are_refused(run_distributed, tmp_path):
    results = run_distributed(_save_to_different_directories, 2, str(tmp_path))
    for case in ("first", "cached", "parts"):
        check_all_raised([r[case] for r in results], checkpointer.CheckpointError, "the ranks passed different directories")
    assert [r["after"] for r in results] == [None, None]
    committed = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs
                       if f == "metadata.json")
    assert committed == ["after/metadata.json", "same/metadata.json"], committed


class _HookFailsOnRank1(torch.nn.Linear):
    """A model whose ``state_dict`` hook raises on rank 1 once ``armed``."""

    armed = False

    def __init__(self):
        super().__init__(4, 4)
        self.register_state_dict_post_hook(self._hook)

    @staticmethod
    def _hook(module, state_dict, prefix, local_metadata):
        import torch.distributed as tdist

        if module.armed and tdist.get_rank() == 1:
            raise RuntimeError("the hook failed on rank 1")


def _a_rank_failing_before_the_first_collective(rank, world_size, root):
    from safetensors.torch import save_file

    torch.manual_seed(0)  # one model on every rank (replicated)
    model = _HookFailsOnRank1()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer.save_model_and_optim_state(os.path.join(root, "ours"), model, optim)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(root, "hf.safetensors"))
    torch.distributed.barrier()
    model.armed = True
    out = {"load": catch(checkpointer.load_model_and_optim_state, os.path.join(root, "ours"), model, optim),
           "hf": catch(checkpointer.load_model_and_optim_state, os.path.join(root, "hf.safetensors"), model)}
    model.armed = False
    out["train_state"] = catch(checkpointer.save_model_and_optim_state, os.path.join(root, "bad"), model, optim,
                               train_state={"step": 1} if rank == 0 else [1])
    out["after"] = catch(checkpointer.load_model_and_optim_state, os.path.join(root, "ours"), model, optim)
    return out


def test_a_rank_failing_before_the_first_collective_fails_every_rank_at_once(run_distributed, tmp_path):
    """A load whose model hook raised on one rank, or a save given a train_state that is not a dict
    on one rank, raised there before the first collective: the other ranks waited out the
    timeout, then the group stayed a collective out of step (found by a review)."""
    results = run_distributed(_a_rank_failing_before_the_first_collective, 2, str(tmp_path))
    for case, cls, says in [("load", RuntimeError, "the hook failed on rank 1"), ("hf", RuntimeError, "the hook failed on rank 1"),
                            ("train_state", TypeError, "train_state must be a dict, not list")]:
        check_all_raised([results[1][case]], cls, says)
        check_all_raised([results[0][case]], checkpointer.RankFailedError, "rank 1", says)
    assert [r["after"] for r in results] == [None, None]
    assert not os.path.exists(tmp_path / "bad" / "model" / "metadata.json")
