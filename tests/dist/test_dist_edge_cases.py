"""Edge cases: overwriting with another world size, odd keys, views, failing and dying ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_helpers import (
    read_metadata_listed,
    assert_local_same,
    assert_same,
    build_model,
    build_optim,
    catch,
    collectives_called,
    files_under,
    model_full_state,
    optim_full_state,
    to_layout,
    train,
    zeros_like_layout,
)

import checkpointer
from checkpointer import Checkpointer, load_model_and_optim_state, save_model_and_optim_state

FAST_S = 20.0


def _save_model(rank, world_size, ckpt, seed, overwrite):
    model = build_model(world_size, seed=seed)
    optim = build_optim(model, "sgd")
    train(model, optim, range(2))
    save_model_and_optim_state(ckpt, model, optim, save_overwrite=overwrite)
    return model_full_state(model), optim_full_state(model, optim)


def _load_model(rank, world_size, ckpt, expected_model, expected_optim):
    model = build_model(world_size, seed=99)
    optim = build_optim(model, "sgd", fresh=True)
    load_model_and_optim_state(ckpt, model, optim)
    assert_same(expected_model, model_full_state(model), "model")
    assert_same(expected_optim, optim_full_state(model, optim), "optimizer")
    return True


@pytest.mark.parametrize("first_ws,second_ws", [(4, 2), (1, 3)])
def test_overwrite_with_another_world_size(run_distributed, tmp_path, first_ws, second_ws):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_model, first_ws, ckpt, 0, False)
    expected = run_distributed(_save_model, second_ws, ckpt, 5, True)[0]
    for load_ws in (1, 3):
        assert run_distributed(_load_model, load_ws, ckpt, *expected) == [True] * load_ws
    # No rank file of the first save is left to be mistaken for part of the second.
    for sub in ("model", "optim"):
        names = sorted(os.listdir(os.path.join(ckpt, sub)))
        stale = [n for n in names if n.startswith("rank_") and int(n[5:].split(".")[0]) >= second_ws]
        assert not stale, f"{sub}: files of the overwritten checkpoint remain: {names}"


ODD = {
    "layers.0.attn/q_proj.weight": torch.arange(12.0).reshape(3, 4),
    "ünïcode key ✓": torch.tensor([1, 2, 3], dtype=torch.int64),
    "state.x.__step": torch.tensor(4.0),
    "a": torch.ones(1),
}


def _odd_keys(rank, world_size, ckpt):
    Checkpointer().save(ckpt, {k: v.clone() for k, v in ODD.items()})
    target = {k: torch.zeros_like(v) for k, v in ODD.items()}
    Checkpointer().load(ckpt, target)
    assert_same(ODD, target, "odd keys")
    assert_same(ODD, Checkpointer().unshard(ckpt), "odd keys (unshard)")
    empty_dir = f"{ckpt}-empty"
    Checkpointer().save(empty_dir, {})
    Checkpointer().load(empty_dir, {})
    assert Checkpointer().unshard(empty_dir) == {}
    return True


def test_odd_keys_and_empty_state_dict(run_distributed, tmp_path):
    assert run_distributed(_odd_keys, 2, str(tmp_path / "ckpt")) == [True, True]


def _stages(rank, world_size, ckpt):
    """Pipeline stages: beside a sharded tensor, each rank holds a key no other rank has."""
    shared = to_layout(torch.arange(24.0).reshape(6, 4), f"shard0@{world_size}")
    own = torch.full((rank + 2,), float(rank + 1))
    Checkpointer().save(ckpt, {"shared": shared, f"stage{rank}": own})
    dest = {"shared": zeros_like_layout({"shared": shared})["shared"], f"stage{rank}": torch.zeros(rank + 2)}
    Checkpointer().load(ckpt, dest)
    assert_local_same({"shared": torch.arange(24.0).reshape(6, 4), f"stage{rank}": own}, dest, "stages")
    return True


def test_ranks_holding_different_keys(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run_distributed(_stages, 3, ckpt) == [True] * 3
    full = Checkpointer().unshard(ckpt, no_dist=True)
    assert torch.equal(full["shared"], torch.arange(24.0).reshape(6, 4))
    for rank in range(3):
        assert torch.equal(full[f"stage{rank}"], torch.full((rank + 2,), float(rank + 1)))
    tensors = read_metadata_listed(ckpt)["tensors"]
    for rank in range(3):
        assert list(tensors[f"stage{rank}"]["shard_spec_per_file"]) == [f"rank_{rank}.safetensors"]


def _pieces_move_between_saves(rank, world_size, base):
    """One checkpointer saving thrice: rank 0 holds the same thing each time, ranks 1 and 2
    swap their halves of ``b`` and swap back. Each rank's own structure has been saved before,
    but in the third save not together with the other ranks' (rank 0 last saw the second)."""
    from checkpointer import FlatShardedTensor

    b = torch.arange(6.0)
    halves = {1: (0, 3), 2: (3, 6)}
    ckpt = Checkpointer()
    for i, swap in enumerate((False, True, False)):
        state = {"a": torch.ones(2)}
        if rank:
            start, end = halves[3 - rank if swap else rank]
            state["b"] = FlatShardedTensor(b[start:end].clone(), (6,), ((start, end),))
        ckpt.save(f"{base}/save{i}", state)
    target = {"a": torch.zeros(2), "b": torch.zeros(6)}
    Checkpointer().load(f"{base}/save2", target)
    assert_same({"a": torch.ones(2), "b": b}, target, f"third save, loaded on rank {rank}")
    return True


def test_repeated_saves_whose_pieces_move_between_ranks(run_distributed, tmp_path):
    assert run_distributed(_pieces_move_between_saves, 3, str(tmp_path)) == [True] * 3


def _collectives_of_repeated_saves(rank, world_size, base):
    """The collectives of three saves of one structure by one Checkpointer, then of a fourth
    whose structure changed; and what the third save holds."""
    state = {"w": to_layout(torch.arange(91.0).reshape(7, 13), f"shard0@{world_size}"), "r": torch.ones(3)}
    saver = Checkpointer()
    per_save = []
    for i in range(3):
        state["r"].fill_(i)
        with collectives_called() as calls:
            saver.save(f"{base}/save{i}", state)
        per_save.append(calls)
    state["added"] = torch.zeros(2)
    with collectives_called() as calls:
        saver.save(f"{base}/changed", state)
    per_save.append(calls)
    target = {"w": zeros_like_layout({"w": state["w"]})["w"], "r": torch.zeros(3)}
    Checkpointer().load(f"{base}/save2", target)
    assert_local_same({"w": torch.arange(91.0).reshape(7, 13), "r": torch.full((3,), 2.0)}, target, "third save")
    return per_save


def test_a_repeated_save_exchanges_no_plans(run_distributed, tmp_path):
    """Plan caching: a save of a structure saved before confirms it with one all-reduce and
    exchanges no pieces; the rest is the commit. A changed structure is planned again, here
    from its layouts (a DTensor over every rank, a plain tensor): the cache's all-reduce, the
    layouts' all-reduce, the agreement on the plan; no pieces exchanged either."""
    commit = ["all_reduce", "gather", "all_reduce"]  # statuses to rank 0 (the longest one's length, then bytes); the closing agreement
    for rank, (first, second, third, changed) in enumerate(run_distributed(_collectives_of_repeated_saves, 3, str(tmp_path))):
        assert second == third == ["all_reduce"] + commit, f"rank {rank}: {second} / {third}"
        for planned in (first, changed):
            assert planned == ["all_reduce"] * 3 + commit, f"rank {rank}: {planned}"


def _views(rank, world_size, ckpt):
    base = torch.arange(60.0).reshape(6, 10)
    state = {
        "transposed": base.t(),  # non-contiguous
        "sliced": base[1:4, 2:7],  # non-contiguous view into a bigger storage
        "strided": base[::2, ::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # stride 0
        "dt": to_layout(base.t().contiguous(), "shard1@2"),
    }
    expected = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}
    Checkpointer().save(ckpt, state)
    assert torch.equal(base, torch.arange(60.0).reshape(6, 10)), "save changed its input"
    # Load into non-contiguous destinations inside a bigger buffer: only the view may change.
    holder = torch.full((12, 20), -1.0)
    dest = {
        "transposed": holder[:10, :6],
        "sliced": holder[:3, 7:12],
        "strided": torch.zeros(6, 8)[::2, ::2],
        "expanded": torch.zeros(3, 2),
        "dt": zeros_like_layout({"dt": state["dt"]})["dt"],
    }
    Checkpointer().load(ckpt, dest)
    assert_local_same(expected, dest, "views")
    outside = torch.ones_like(holder, dtype=torch.bool)
    outside[:10, :6] = False
    outside[:3, 7:12] = False
    assert (holder[outside] == -1).all(), "load wrote outside the views"
    return True


def test_non_contiguous_sources_and_destinations(run_distributed, tmp_path):
    assert run_distributed(_views, 2, str(tmp_path / "ckpt")) == [True, True]


def _failing_write_on_rank1(rank, world_size, ckpt):
    from unittest import mock

    from checkpointer.storage.local import LocalWriter

    state = {"w": to_layout(torch.arange(91.0).reshape(7, 13), f"shard0@{world_size}"), "r": torch.ones(3)}

    def write(self, buffers):
        raise OSError(f"injected write failure of {self.path}")

    if rank == 1:  # rank files go through write_stable, other files through write
        with mock.patch.object(LocalWriter, "write", write), mock.patch.object(LocalWriter, "write_stable", write):
            failed = catch(Checkpointer().save, ckpt, state)
    else:
        failed = catch(Checkpointer().save, ckpt, state)
    # The failed save left no checkpoint, and the same directory can be saved to afterwards.
    incomplete = catch(Checkpointer().load, ckpt, zeros_like_layout(state))
    Checkpointer().save(ckpt, state)
    target = zeros_like_layout(state)
    Checkpointer().load(ckpt, target)
    assert_local_same({"w": torch.arange(91.0).reshape(7, 13), "r": torch.ones(3)}, target)
    return failed, incomplete


def test_write_failure_on_one_rank(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_failing_write_on_rank1, 3, ckpt, timeout=60)
    for rank, (failed, incomplete) in enumerate(results):
        assert failed is not None, f"rank {rank}: the save did not fail"
        assert failed["seconds"] < FAST_S, f"rank {rank} took {failed['seconds']:.1f}s"
        assert "injected write failure" in failed["msg"], f"rank {rank}: {failed['type']}: {failed['msg']}"
        assert incomplete is not None and "IncompleteCheckpointError" in incomplete["mro"], (rank, incomplete)
    assert not any(n.startswith(".") for n in files_under(ckpt)), f"temp files left: {files_under(ckpt)}"


def _inconsistent_replicated(rank, world_size, ckpt):
    """A plain tensor is replicated; ranks that disagree on its shape make every rank raise."""
    state = {"r": torch.ones(5 if rank != 1 else 6), "ok": torch.zeros(2)}
    return catch(Checkpointer().save, ckpt, state)


def test_save_of_inconsistent_shapes(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_inconsistent_replicated, 3, ckpt, timeout=60)
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank}: save of inconsistent shapes succeeded"
        assert "CheckpointError" in r["mro"] and ("'r'" in r["msg"] or '"r"' in r["msg"]), (rank, r["type"], r["msg"])
    assert not os.path.exists(os.path.join(ckpt, "metadata.json"))


def _rank1_dies_while_loading(rank, world_size, ckpt):
    from unittest import mock

    from checkpointer.storage.local import LocalStorage

    state = zeros_like_layout({"w": to_layout(torch.zeros(8, 17), f"shard0@{world_size}")})
    with mock.patch.dict(os.environ, {"CHECKPOINTER_TIMEOUT_S": "15"}):
        if rank == 1:

            def read_into(self, name, requests):
                os._exit(17)

            with mock.patch.object(LocalStorage, "read_into", read_into):
                Checkpointer().load(ckpt, state)
        return catch(Checkpointer().load, ckpt, state)


def _save_w(rank, world_size, ckpt):
    Checkpointer().save(ckpt, {"w": to_layout(torch.randn(8, 17), f"shard0@{world_size}")})
    return True


def test_a_rank_that_dies_does_not_hang_the_others(run_distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_w, 2, ckpt)
    results = run_distributed(_rank1_dies_while_loading, 3, ckpt, timeout=90, dead_ok=True)
    assert results[1] == "died", results[1]
    for rank in (0, 2):
        r = results[rank]
        assert r is not None and r != "died", f"rank {rank}: {r}"
        assert "CheckpointError" in r["mro"], f"rank {rank} raised {r['type']}: {r['msg']}"
        assert r["seconds"] < 60, f"rank {rank} took {r['seconds']:.1f}s"


def _store_use_across_collectives(rank, world_size):
    """Store handles taken during ten fast collectives and during one that rank 1 enters late:
    how many, how many still referenced afterwards, and by which threads."""
    import gc
    import threading
    import time
    import weakref

    from checkpointer import dist as cdist
    from checkpointer.dist import arrivals

    real, late = arrivals._store, arrivals._LATE_S
    handed: list = []
    takers: set = set()

    class Handle:
        def __init__(self, store):
            self.store = store

        def set(self, key, value):
            return self.store.set(key, value)

    def store():
        handle = Handle(real())
        handed.append(weakref.ref(handle))
        takers.add(threading.current_thread())
        return handle

    arrivals._store, arrivals._LATE_S = store, 0.2  # this worker process serves other tests: restored below
    try:
        for _ in range(10):
            cdist.barrier()
            cdist.all_gather_bytes(b"x" * rank)
        fast = len(handed)
        if rank == 1:
            time.sleep(1.2)  # rank 0 waits six times _LATE_S inside the collective (and past a poll begun at 1 s)
        cdist.all_gather_bytes(b"y")
        gc.collect()
        held = sum(ref() is not None for ref in handed)
        return fast, len(handed), held, all(t.daemon and t is not threading.main_thread() for t in takers)
    finally:
        arrivals._store, arrivals._LATE_S = real, late


def test_only_a_slow_collective_touches_the_store(run_distributed):
    """A collective that ends within _LATE_S touches neither the store nor another thread (at
    thousands of ranks, a write per rank and collective loads the one store server). A rank kept
    waiting longer records its arrival once, from a daemon thread, and no store reference
    outlives the collective (a thread holding the store when the group is destroyed can abort
    the process at exit)."""
    (fast0, all0, held0, daemons0), (fast1, all1, held1, _) = run_distributed(_store_use_across_collectives, 2)
    assert (fast0, fast1) == (0, 0)
    assert all1 == 0, "rank 1 entered last and waited for no one"
    assert all0 == 1 and held0 == 0 and daemons0, (all0, held0, daemons0)


def _broadcasts(rank, world_size):
    """Each payload as every rank received it from rank 1, with the collectives that carried it."""
    from checkpointer import dist as cdist

    out = []
    for size in (0, 10, 64 << 10, (64 << 10) + 1, 300_000):
        payload = bytes((i * 7 + size) % 251 for i in range(size))
        with collectives_called() as calls:
            got = cdist.broadcast_bytes(payload if rank == 1 else None, src=1)
        out.append((got == payload, calls))
    return out


def test_a_small_broadcast_is_one_collective(run_distributed):
    """Up to 64 KiB (a metadata.json of a few hundred tensors) travels with its size in one
    broadcast; a larger payload takes a second one."""
    for rank, got in enumerate(run_distributed(_broadcasts, 3)):
        assert got == [(True, ["broadcast"])] * 3 + [(True, ["broadcast"] * 2)] * 2, f"rank {rank}: {got}"


def _gathers(rank, world_size):
    """What every rank received from all_gather_bytes and gather_bytes (to rank 1) of payloads
    of different lengths per rank (empty, ending in zero bytes, long), with the collectives."""
    from checkpointer import dist as cdist

    def payload(r: int, case: int) -> bytes:
        size = [0, 3, 70_000][(r + case) % 3]
        return bytes((i * 13 + r) % 256 for i in range(size)) + b"\x00" * ((r + case) % 2)

    out = []
    for case in range(3):
        mine = payload(rank, case)
        want = [payload(r, case) for r in range(world_size)]
        with collectives_called() as calls:
            everyone = cdist.all_gather_bytes(mine)
            to_one = cdist.gather_bytes(mine, dst=1)
        out.append((everyone == want, to_one == want if rank == 1 else to_one is None, calls))
    return out


def test_gathered_payloads_of_any_length_come_back_exactly(run_distributed):
    """Each exchange finds the longest payload with one all-reduce, then moves every rank's
    bytes in slots of that width that carry their own length."""
    for rank, got in enumerate(run_distributed(_gathers, 3)):
        for everyone_ok, to_one_ok, calls in got:
            assert everyone_ok and to_one_ok, f"rank {rank}: {got}"
            assert calls == ["all_reduce", "all_gather", "all_reduce", "gather"], f"rank {rank}: {calls}"
