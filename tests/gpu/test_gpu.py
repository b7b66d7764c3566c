"""CUDA tensors, NCCL, FSDP1 and FSDP2 on GPUs, pinned host staging. Skipped without CUDA.

With one GPU, NCCL runs at world size 1 (NCCL refuses two ranks on one device); resharding
of CUDA tensors across ranks runs in gloo groups whose ranks share the GPU. Tests that need
NCCL at world size 2 skip unless two GPUs are there. Every check compares exact values with
what was saved, and checkpoints cross between GPU and CPU jobs in both directions.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import checkpointer
from checkpointer import Checkpointer, CheckpointError
from checkpointer.storage.local import LocalStorage

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA")]

NCCL = "nccl"
MIXED = "cpu:gloo,cuda:nccl"


def _needs_gpus(world_size: int) -> None:
    if GPUS < world_size:
        pytest.skip(f"NCCL at world size {world_size} needs {world_size} GPUs; {GPUS} here")


# ---------------------------------------------------------------------------------------
# Models trained on a device, wrapped with FSDP2 or FSDP1
# ---------------------------------------------------------------------------------------


def _model(seed: int, device: str) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8), nn.Linear(8, 3, bias=False)).to(device)


def _fsdp2(seed: int, device: str, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed, device)
    fully_shard(model, mesh=init_device_mesh(device, (world_size,)))
    return model


def _fsdp1(seed: int, device: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    device_id = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    return FSDP(_model(seed, device), use_orig_params=True, device_id=device_id)


def _train(model: nn.Module, optim: torch.optim.Optimizer, device: str, steps: int = 2) -> None:
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded parameters and optimizer state on the CPU, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    params = {k: v.detach().cpu().clone() for k, v in model_sd.items()}
    states = {
        f"{name}.{field}": value.cpu().clone()
        for name, state in optim_sd["state"].items()
        for field, value in state.items()
    }
    return params, states


def _devices(model: nn.Module, optim: torch.optim.Optimizer) -> set[str]:
    tensors = list(model.parameters()) + [v for s in optim.state.values() for v in s.values() if v.dim() > 0]
    return {(t.to_local() if isinstance(t, DTensor) else t).device.type for t in tensors}


def _save_trained(rank: int, world_size: int, ckpt: str, device: str, wrap: str) -> tuple[dict, dict]:
    model = _fsdp2(0, device, world_size) if wrap == "fsdp2" else _fsdp1(0, device)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, optim, device)
    assert _devices(model, optim) == {torch.device(device).type}
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    return _full_state(model, optim)


def _load_fresh(rank: int, world_size: int, ckpt: str, device: str, wrap: str, strategy: str = "default"):
    model = {"fsdp2": lambda: _fsdp2(7, device, world_size), "fsdp1": lambda: _fsdp1(7, device)}.get(
        wrap, lambda: _model(7, device)
    )()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    checkpointer.load_model_and_optim_state(ckpt, model, optim, strategy=strategy)
    loaded = _full_state(model, optim)
    devices = _devices(model, optim)
    _train(model, optim, device, steps=1)  # the loaded state trains
    return loaded, devices


def _assert_same(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    for got_part, want_part in zip(got, want):
        assert got_part.keys() == want_part.keys()
        for key, value in want_part.items():
            assert got_part[key].dtype == value.dtype, key
            assert torch.equal(got_part[key], value), key


@pytest.mark.parametrize("backend", [NCCL, MIXED])
def test_fsdp2_on_gpu_saves_and_loads_there_and_on_cpu(run_distributed, tmp_path, backend):
    ckpt = str(tmp_path / "fsdp2-cuda")
    saved = run_distributed(_save_trained, 1, ckpt, "cuda", "fsdp2", backend=backend)[0]
    for strategy in ("default", "two_stage"):
        loaded, devices = run_distributed(_load_fresh, 1, ckpt, "cuda", "fsdp2", strategy, backend=backend)[0]
        assert devices == {"cuda"}
        _assert_same(loaded, saved)
    for loaded, devices in run_distributed(_load_fresh, 2, ckpt, "cpu", "fsdp2"):  # GPU -> 2 CPU ranks
        assert devices == {"cpu"}
        _assert_same(loaded, saved)
    full = checkpointer.unshard_model_state(ckpt, device="cuda", no_dist=True)
    assert {v.device.type for v in full.values()} == {"cuda"}
    _assert_same(({k: v.cpu() for k, v in full.items()}, {}), (saved[0], {}))


def test_fsdp2_saved_on_cpu_loads_onto_gpu(run_distributed, tmp_path):
    ckpt = str(tmp_path / "fsdp2-cpu")
    saved = run_distributed(_save_trained, 2, ckpt, "cpu", "fsdp2")[0]
    for wrap in ("fsdp2", "plain"):
        loaded, devices = run_distributed(_load_fresh, 1, ckpt, "cuda", wrap, backend=NCCL)[0]
        assert devices == {"cuda"}
        _assert_same(loaded, saved)


def test_fsdp1_on_gpu_saves_and_loads_across_devices(run_distributed, tmp_path):
    on_gpu, on_cpu = str(tmp_path / "fsdp1-cuda"), str(tmp_path / "fsdp1-cpu")
    saved_gpu = run_distributed(_save_trained, 1, on_gpu, "cuda", "fsdp1", backend=NCCL)[0]
    saved_cpu = run_distributed(_save_trained, 2, on_cpu, "cpu", "fsdp1")[0]
    for ckpt, saved in ((on_gpu, saved_gpu), (on_cpu, saved_cpu)):
        loaded, devices = run_distributed(_load_fresh, 1, ckpt, "cuda", "fsdp1", backend=NCCL)[0]
        assert devices == {"cuda"}
        _assert_same(loaded, saved)
    for loaded, _ in run_distributed(_load_fresh, 3, on_gpu, "cpu", "fsdp2"):
        _assert_same(loaded, saved_gpu)


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_fsdp2_over_two_gpus_with_nccl(run_distributed, tmp_path, strategy):
    _needs_gpus(2)
    ckpt = str(tmp_path / "fsdp2-2gpu")
    saved = run_distributed(_save_trained, 2, ckpt, "cuda", "fsdp2", backend=NCCL)[0]
    for loaded, devices in run_distributed(_load_fresh, 2, ckpt, "cuda", "fsdp2", strategy, backend=NCCL):
        assert devices == {"cuda"}
        _assert_same(loaded, saved)
    loaded, _ = run_distributed(_load_fresh, 1, ckpt, "cuda", "fsdp2", strategy, backend=NCCL)[0]
    _assert_same(loaded, saved)


def _raise_on_rank_one(rank: int, world_size: int, ckpt: str) -> str:
    model = _fsdp2(7, "cuda", world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    injected = OSError("injected read failure")
    failing = mock.patch.object(LocalStorage, "read_into", side_effect=injected)
    try:
        with failing if rank == 1 else contextlib.nullcontext():
            checkpointer.load_model_and_optim_state(ckpt, model, optim)
    except (CheckpointError, OSError) as ex:
        return str(ex)
    return "no error"


def test_a_failing_rank_is_reported_under_nccl(run_distributed, tmp_path):
    _needs_gpus(2)
    ckpt = str(tmp_path / "fsdp2-2gpu")
    run_distributed(_save_trained, 2, ckpt, "cuda", "fsdp2", backend=NCCL)
    messages = run_distributed(_raise_on_rank_one, 2, ckpt, backend=NCCL, timeout=120)
    assert "injected read failure" in messages[1]
    assert "rank 1" in messages[0] and "injected read failure" in messages[0], messages[0]


# ---------------------------------------------------------------------------------------
# CUDA DTensors resharded between world sizes (gloo groups whose ranks share the GPU)
# ---------------------------------------------------------------------------------------


def _full_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(13, 6, generator=gen),
        "cols": torch.randn(5, 9, generator=gen),
        "half": torch.randn(11, 4, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(7 * 3, dtype=torch.int64).reshape(7, 3) * 1_000_003,
        "scale": torch.tensor(0.25),
    }


_DIMS = {"rows": 0, "cols": 1, "half": 0, "ids": 0}


def _cuda_state(rank: int, world_size: int, fill: bool, strided: bool = False) -> dict:
    """This rank's part of every tensor as a CUDA DTensor (``scale``: a plain replicated tensor);
    zeros unless ``fill``; ``strided`` makes the local tensors non-contiguous."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world_size,))
    state: dict = {}
    for key, full in _full_tensors().items():
        part = full.chunk(world_size, dim=_DIMS[key])[rank] if key in _DIMS else full
        local = (part if fill else torch.zeros_like(part)).cuda()
        if strided and local.dim() == 2:
            local = local.t().contiguous().t()  # the same values, column-major
        if key not in _DIMS:
            state[key] = local
            continue
        placements = [Shard(_DIMS[key])]
        state[key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return state


def _save_cuda_dtensors(rank: int, world_size: int, ckpt: str) -> None:
    Checkpointer().save(ckpt, _cuda_state(rank, world_size, fill=True))


def _load_cuda_dtensors(rank: int, world_size: int, ckpt: str, strategy: str) -> list[str]:
    state = _cuda_state(rank, world_size, fill=False, strided=True)
    Checkpointer().load(ckpt, state, strategy=strategy, verify=True)
    wrong = []
    for key, full in _full_tensors().items():
        value = state[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        assert local.is_cuda, key
        want = full.chunk(world_size, dim=_DIMS[key])[rank] if key in _DIMS else full
        if not torch.equal(local.cpu(), want):
            wrong.append(key)
    return wrong


@pytest.mark.parametrize("strategy", ["default", "two_stage"])
def test_cuda_dtensors_reshard_from_two_ranks_to_three(run_distributed, tmp_path, strategy):
    ckpt = str(tmp_path / "cuda-dtensors")
    run_distributed(_save_cuda_dtensors, 2, ckpt)
    assert run_distributed(_load_cuda_dtensors, 3, ckpt, strategy) == [[], [], []]
    assert run_distributed(_load_cuda_dtensors, 1, ckpt, strategy, backend=NCCL) == [[]]
    full = Checkpointer().unshard(ckpt, no_dist=True)
    for key, want in _full_tensors().items():
        assert torch.equal(full[key], want), key


def _two_stage_through_device_buffers(rank: int, world_size: int, ckpt: str) -> dict:
    """Two-stage load of whole tensors on every rank (one reads, a broadcast shares), with the
    collectives' device set to the GPU as under NCCL; gloo carries the CUDA broadcasts here."""
    import torch.distributed as torch_dist

    devices: list[str] = []
    real_broadcast = torch_dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return real_broadcast(tensor, *args, **kwargs)

    state = {k: torch.zeros_like(v).cuda() for k, v in _full_tensors().items()}
    with mock.patch("checkpointer.dist._device", lambda group=None: torch.device("cuda", 0)), mock.patch.object(
        torch_dist, "broadcast", broadcast
    ):
        Checkpointer().load(ckpt, state, strategy="two_stage", verify=True)
    wrong = [k for k, v in _full_tensors().items() if not torch.equal(state[k].cpu(), v)]
    return {"wrong": wrong, "broadcast_devices": sorted(set(devices))}


def test_two_stage_shares_host_pieces_through_device_buffers(run_distributed, tmp_path):
    ckpt = str(tmp_path / "cuda-dtensors")
    run_distributed(_save_cuda_dtensors, 2, ckpt)
    for got in run_distributed(_two_stage_through_device_buffers, 2, ckpt):
        assert got == {"wrong": [], "broadcast_devices": ["cuda"]}


# ---------------------------------------------------------------------------------------
# Host staging: pinned, bounded, reused
# ---------------------------------------------------------------------------------------


def _staged_save_and_load(rank: int, world_size: int, ckpt: str) -> dict:
    """Save CUDA tensors larger than a 1 MiB staging budget, and load them back into CUDA
    tensors, recording every host buffer that staging asked for."""
    from checkpointer.engine import rankfile

    taken: list[tuple[int, bool]] = []
    real_take = rankfile._Staging.take

    def take(self, nbytes, pinned):
        buf = real_take(self, nbytes, pinned)
        taken.append((nbytes, buf.is_pinned()))
        return buf

    gen = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(768, 1024, generator=gen).cuda(),  # 3 MiB
        "wide": torch.randn(3, 600_000, generator=gen).cuda(),  # rows of 2.3 MiB, above the budget
        "strided": torch.randn(512, 700, generator=gen).cuda().t(),
    }
    expected = {k: v.cpu() for k, v in state.items()}
    with mock.patch.dict(os.environ, {"CHECKPOINTER_STAGING_MIB": "1"}), mock.patch.object(
        rankfile._Staging, "take", take
    ):
        Checkpointer().save(ckpt, state)

    host_buffers: list[bool] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if kwargs.get("pin_memory"):
            host_buffers.append(t.is_pinned())
        return t

    loaded = {k: torch.full_like(v, -1.0) for k, v in state.items()}
    with mock.patch.object(torch, "empty", empty):
        Checkpointer().load(ckpt, loaded, verify=True)
    return {
        "saved_equal": all(torch.equal(expected[k], v.cpu()) for k, v in loaded.items()),
        "staged": taken,
        "load_pinned": host_buffers,
        "loaded_on_cuda": all(v.is_cuda for v in loaded.values()),
    }


def test_save_and_load_of_cuda_tensors_stage_through_pinned_memory(run_distributed, tmp_path):
    got = run_distributed(_staged_save_and_load, 1, str(tmp_path / "staged"), backend=NCCL)[0]
    assert got["saved_equal"] and got["loaded_on_cuda"]
    assert got["staged"] and all(pinned for _, pinned in got["staged"]), got["staged"]
    budget, wide_row = 1 << 20, 600_000 * 4
    # Blocks are whole rows within the budget; a row larger than the budget goes alone.
    assert all(nbytes <= budget or nbytes == wide_row for nbytes, _ in got["staged"]), got["staged"]
    assert got["load_pinned"] and all(got["load_pinned"]), got["load_pinned"]


def _async_from_cuda(rank: int, world_size: int, first: str, second: str) -> dict:
    gen = torch.Generator().manual_seed(9)
    state = {
        "w": torch.randn(300, 257, generator=gen).cuda(),
        "steps": torch.arange(10, dtype=torch.int64).cuda(),
        "t": torch.randn(64, 48, generator=gen).cuda().t(),
    }
    before = {k: v.cpu() for k, v in state.items()}
    ckp = Checkpointer()
    future = ckp.async_save(first, state)
    arena = ckp._async._arenas[0]
    for value in state.values():
        value.add_(1)  # training goes on while the save writes
    future.result()
    ckp.async_save(second, state).result()
    reused = ckp._async._arenas[0] is arena
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    ckp.load(first, loaded, verify=True)
    return {
        # Registered with cudaHostRegister (torch's is_pinned() knows only its own allocator's blocks).
        "page_locked": arena.registered or arena.base.is_pinned(),
        "size_within_a_page_per_piece": arena.base.numel() <= nbytes + 64 * len(state) + 4096,
        "reused": reused,
        "snapshot": all(torch.equal(loaded[k].cpu(), before[k]) for k in before),
    }


def test_async_save_of_cuda_tensors_snapshots_into_reused_pinned_buffers(run_distributed, tmp_path):
    got = run_distributed(_async_from_cuda, 1, str(tmp_path / "a"), str(tmp_path / "b"), backend=NCCL)[0]
    assert got == {
        "page_locked": True,
        "size_within_a_page_per_piece": True,
        "reused": True,
        "snapshot": True,
    }


def _async_fsdp2_cuda(rank: int, world_size: int, ckpt: str, background: bool) -> tuple[dict, dict]:
    """An async save, training on meanwhile. With ``background``, as torchtitan's trainer in an
    async mode: the save is called right after the step (its kernels may still run: the copy must
    wait for them), returns before the copy to pinned memory, the next forward and backward run
    meanwhile, and the optimizer step waits for ``staged``."""
    model = _fsdp2(0, "cuda", world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, optim, "cuda")
    if not background:
        saved = _full_state(model, optim)
        future = checkpointer.async_save_model_and_optim_state(ckpt, model, optim)
        _train(model, optim, "cuda", steps=1)
        future.result()
        return saved
    future = checkpointer.async_save_model_and_optim_state(ckpt, model, optim, stage_in_background=True)
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).cuda()).square().sum().backward()
    future.staged.result(timeout=60)
    saved = _full_state(model, optim)  # as at the call: nothing has stepped the optimizer since
    optim.step()
    optim.zero_grad()
    future.result()
    return saved


@pytest.mark.parametrize("background", [False, True])
def test_async_save_of_a_gpu_model_keeps_the_state_it_was_called_with(run_distributed, tmp_path, background):
    ckpt = str(tmp_path / "async-fsdp2")
    saved = run_distributed(_async_fsdp2_cuda, 1, ckpt, background, backend=NCCL)[0]
    loaded, devices = run_distributed(_load_fresh, 1, ckpt, "cuda", "fsdp2", backend=NCCL)[0]
    assert devices == {"cuda"}
    _assert_same(loaded, saved)


def _load_in_many_batches(rank: int, world_size: int, ckpt: str) -> list[str]:
    """Loads into CUDA tensors in batches of 0.5 MiB, so that each batch's copies to the GPU are
    still running while the next batch is read into other pinned buffers."""
    from checkpointer.engine import load as load_module

    gen = torch.Generator().manual_seed(11)
    saved = {f"t{i}": torch.randn(128 + i, 257, generator=gen) for i in range(24)}
    saved["half"] = torch.randn(300, 300, generator=gen).to(torch.bfloat16)
    Checkpointer().save(ckpt, saved)
    wrong = []
    for verify in (False, True):
        loaded = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
        loaded["t3"] = torch.zeros(saved["t3"].shape[1], saved["t3"].shape[0], device="cuda").t()
        with mock.patch.object(load_module, "_STAGE_BYTES", 1 << 20):
            Checkpointer().load(ckpt, loaded, verify=verify)
        wrong += [f"{k} (verify={verify})" for k, v in saved.items() if not torch.equal(loaded[k].cpu(), v)]
    return wrong


def test_loads_into_cuda_tensors_are_exact_across_many_overlapping_batches(run_distributed, tmp_path):
    assert run_distributed(_load_in_many_batches, 1, str(tmp_path / "batches"), backend=NCCL) == [[]]
