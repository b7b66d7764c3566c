"""What the ranks run in the remote-storage tests (inside the harness's worker pools).

Every function takes ``env``: the settings that point this process at a store (endpoint,
test credentials, no proxies), one dict for every rank or a list with one dict per rank
(so that each rank can go through its own proxy). They are set in ``os.environ`` for the
call and restored afterwards, so the long-lived workers never keep a test's endpoint.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch

from dist_helpers import (
    assert_local_same,
    assert_same,
    build_model,
    build_optim,
    catch,
    local_data_ptrs,
    model_full_state,
    optim_full_state,
    to_layout,
    train,
    zeros_like_layout,
)
from torch.distributed.tensor import DTensor

from storage_servers import SECRET_KEY

from checkpointer import (
    Checkpointer,
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)

Env = dict[str, "str | None"]

_CLEARED = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "AWS_PROFILE",
            "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST",
            "GOOGLE_APPLICATION_CREDENTIALS", "CHECKPOINTER_IO_RETRIES")


def loopback_settings(extra: Env | None = None) -> Env:
    """Test credentials and no proxies or config files (``None`` removes a variable), plus ``extra``."""
    env: Env = {name: None for name in _CLEARED}
    env.update(
        NO_PROXY="127.0.0.1,localhost",
        AWS_ACCESS_KEY_ID="test-access-key",
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        GOOGLE_CLOUD_PROJECT="test-project",
    )
    env.update(extra or {})
    return env


@contextlib.contextmanager
def remote_env(env: Env | Sequence[Env] | None, rank: int = 0) -> Iterator[None]:
    """``os.environ`` with ``env`` (or ``env[rank]``) applied, restored on exit."""
    if env is None:
        yield
        return
    settings = env[rank] if isinstance(env, (list, tuple)) else env
    saved = {name: os.environ.get(name) for name in settings}
    try:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def caught(rank: int, world_size: int, env: Any, name: str, *args: Any) -> dict[str, Any] | None:
    """Run the function ``name`` of this module; what it raised (see ``dist_helpers.catch``), or None."""
    with remote_env(env, rank):
        return catch(globals()[name], rank, world_size, None, *args)


# --------------------------------------------------------------------------------------
# A model and AdamW (FSDP2 over all ranks when the world size is above 1)
# --------------------------------------------------------------------------------------


def save_model(rank: int, world_size: int, env: Any, url: str, overwrite: bool = False,
               use_async: bool = False) -> dict[str, Any]:
    with remote_env(env, rank):
        model = build_model(world_size)
        optim = build_optim(model, "adamw")
        train(model, optim, range(2))
        expected_model = model_full_state(model)
        expected_optim = optim_full_state(model, optim)
        if use_async:
            future = async_save_model_and_optim_state(url, model, optim, save_overwrite=overwrite)
            train(model, optim, range(2, 3))  # training goes on while the upload runs
            files = future.result()
        else:
            files = save_model_and_optim_state(url, model, optim, save_overwrite=overwrite)
    return {"model": expected_model, "optim": expected_optim, "files": files,
            "names": [n for n, _ in model.named_parameters()]}


def load_model(rank: int, world_size: int, env: Any, url: str, expected_model: dict, expected_optim: dict,
               strategy: str = "default") -> bool:
    with remote_env(env, rank):
        model = build_model(world_size, seed=1)
        model.scale.fill_(-1.0)
        optim = build_optim(model, "adamw", fresh=True)
        ptrs = local_data_ptrs(model)
        load_model_and_optim_state(url, model, optim, strategy=strategy)
    assert local_data_ptrs(model) == ptrs, "load replaced tensors instead of filling them in place"
    assert_same(expected_model, model_full_state(model), f"model on rank {rank}")
    assert_same(expected_optim, optim_full_state(model, optim), f"optimizer on rank {rank}")
    train(model, optim, range(2, 3))  # training goes on from the loaded state
    return True


def unshard_everywhere(rank: int, world_size: int, env: Any, url: str, expected_model: dict, expected_optim: dict,
                       names: list[str]) -> bool:
    """``unshard_*`` called by every rank of the group (each gets the full state), and rank 0 alone."""
    with remote_env(env, rank):
        full = unshard_model_state(url)
        optim = unshard_optim_state(url)
        only = unshard_model_state(url, rank0_only=True)
    assert_same(expected_model, full, f"unsharded model on rank {rank}")
    assert_same(expected_optim, optim_as_flat(optim, names), f"unsharded optimizer on rank {rank}")
    assert (only == {}) if rank else (sorted(only) == sorted(expected_model))
    return True


def optim_as_flat(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``unshard_optim_state``'s torch form keyed like ``dist_helpers.optim_full_state``."""
    out: dict[str, Any] = {}
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            out[f"state:{names[pid]}.{key}"] = value
    for i, group in enumerate(state["param_groups"]):
        assert group.get("param_names") == [names[p] for p in group["params"]], group.get("param_names")
        for key, value in group.items():
            if key != "param_names":
                out[f"group{i}:{key}"] = [names[p] for p in value] if key == "params" else value
    return out


# --------------------------------------------------------------------------------------
# Flat state dicts: tensors sharded on dim 0 over all ranks, and one replicated tensor
# --------------------------------------------------------------------------------------

REPLICATED = "r"


def flat_full(size: str = "small", seed: int = 0) -> dict[str, torch.Tensor]:
    """``small``: a few hundred bytes; ``big``: about 18 MB (for counting bytes fetched)."""
    g = torch.Generator().manual_seed(seed)
    if size == "big":
        return {
            "w": torch.randn(3001, 1024, generator=g),
            "v": torch.randn(1201, 1536, generator=g).to(torch.bfloat16),
            "i": torch.randint(-(2**40), 2**40, (997, 257), generator=g),
            REPLICATED: torch.randn(64, 1024, generator=g),
        }
    return {
        "w": torch.randn(37, 11, generator=g),
        "v": torch.randn(13, 5, generator=g).to(torch.bfloat16),
        "i": torch.randint(-100, 100, (9, 4), generator=g),
        REPLICATED: torch.randn(7, generator=g),
    }


def flat_state(full: dict[str, torch.Tensor], world_size: int) -> dict[str, torch.Tensor]:
    layout = "plain" if world_size == 1 else f"shard0@{world_size}"
    return {k: v.clone() if k == REPLICATED else to_layout(v, layout) for k, v in full.items()}


def local_bytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        t = value.to_local() if isinstance(value, DTensor) else value
        total += t.numel() * t.element_size()
    return total


def save_flat(rank: int, world_size: int, env: Any, url: str, size: str = "small", seed: int = 0,
              overwrite: bool = False) -> list[str]:
    with remote_env(env, rank):
        _, files = Checkpointer().save(url, flat_state(flat_full(size, seed), world_size), save_overwrite=overwrite)
    return files


def load_flat(rank: int, world_size: int, env: Any, url: str, size: str = "small", seed: int = 0,
              strategy: str = "default") -> int:
    """Load into zeros and check every local element; returns this rank's share in bytes.

    ``url`` may be a list: one URL per rank (the same checkpoint through each rank's proxy).
    """
    url = url[rank] if isinstance(url, list) else url
    full = flat_full(size, seed)
    state = zeros_like_layout(flat_state(full, world_size))
    with remote_env(env, rank):
        Checkpointer().load(url, state, strategy=strategy)
    assert_local_same(full, state, f"rank {rank}")
    return local_bytes(state)


def unshard_flat(rank: int, world_size: int, env: Any, url: str, size: str = "small", seed: int = 0) -> bool:
    with remote_env(env, rank):
        got = Checkpointer().unshard(url)
    assert_same(flat_full(size, seed), got, f"unsharded on rank {rank}")
    return True
