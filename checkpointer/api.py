"""Model and optimizer helpers: the functions an FSDP training loop calls.

The optimizer is flattened as OLMo-core 0.1.0 does, keyed by parameter *name* so it
survives any change of topology: ``num_param_groups``, ``param_group{i}`` (builtins pickle
with ``_param_names``), ``state_keys``, and ``state.{param}.__{key}`` tensors sharded like
their parameter. Optimizer state is never created by stepping the optimizer: a save writes
the state that exists, and a load allocates whatever state the checkpoint has.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Iterator

import torch
import torch.nn as nn

from . import dist
from .buffers import memoryview_of
from .engine.async_save import wait_for_writes_into
from .engine.checkpointer import Checkpointer
from .engine.load import load_state_dicts
from .engine.locate import newest_checkpoint
from .engine.checks import HeaderCache, check_files_hold
from .engine.commit import claim_parts
from .engine.reader import CheckpointReader
from .errors import CheckpointMismatchError, CorruptCheckpointError
from .format.builtins_pickle import decode_builtins, encode_builtins
from .format.dtypes import dtype_from_code
from .format.metadata import StorageMetadata, TensorStorageMetadata
from .sharding import describe, fsdp1_flat_views, local_data, with_sharding_of
from .storage import open_storage
from .storage.base import Storage, path_arg

__all__ = [
    "save_model_and_optim_state",
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "latest_checkpoint",
    "model_state_dict",
    "flatten_optim_state",
]

# The one piece of module state: the top-level save functions share a checkpointer so that
# repeated saves reuse their plan and an async save can make the next one wait for it.
_DEFAULT = Checkpointer()

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's parameters and persistent buffers by clean name, as views of their memory.

    FSDP2 and DTensor parameters come as DTensors; FSDP1 (``use_orig_params=True``) ones as
    :class:`~checkpointer.FlatShardedTensor`. Tied parameters appear under every name.
    """
    model = _unwrap(model)
    if _is_fsdp1(model):
        flat = fsdp1_flat_views(model)
        state: dict[str, Any] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            state[_clean_name(name)] = flat.get(param, param.detach())
        for name, buf in model.named_buffers():
            state[_clean_name(name)] = buf.detach()
        return state
    return {_clean_name(k): v for k, v in model.state_dict().items()}


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): _clean_name(n) for n, p in _unwrap(model).named_parameters()}


def flatten_optim_state(model: nn.Module, optim: torch.optim.Optimizer, model_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state in OLMo-core's flat, name-keyed layout (no copies of state tensors)."""
    names = _param_names(model)
    flat: dict[str, Any] = {"num_param_groups": torch.tensor(len(optim.param_groups))}
    state_keys: set[str] = set()
    for i, group in enumerate(optim.param_groups):
        saved: dict[str, Any] = {}
        for k, v in group.items():
            if k == "params":
                continue
            saved[k] = v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
        params = group["params"]
        missing = [p for p in params if id(p) not in names]
        if missing:
            raise CheckpointMismatchError(f"param group {i} holds {len(missing)} tensors that are not parameters of the model")
        offset = sum(len(g["params"]) for g in optim.param_groups[:i])
        saved["params"] = list(range(offset, offset + len(params)))
        saved["_param_names"] = [names[id(p)] for p in params]
        try:
            flat[f"param_group{i}"] = _bytes_tensor(encode_builtins(saved, where=f"param group {i}"))
        except ValueError as ex:
            raise CheckpointMismatchError(f"cannot save optimizer: {ex}") from ex
        for p in params:
            name = names[id(p)]
            for key, value in optim.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointMismatchError(
                        f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, not a tensor"
                    )
                state_keys.add(key)
                flat[f"state.{name}.__{key}"] = _shard_like_param(value, model_state.get(name, p))
    flat["state_keys"] = _bytes_tensor(encode_builtins(sorted(state_keys), where="state_keys"))
    return flat


def _shard_like_param(value: torch.Tensor, param: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value
    param_local = local_data(param)
    if value.dim() > 0 and tuple(value.shape) == tuple(param_local.shape) and describe(param).is_sharded:
        return with_sharding_of(value, param)
    return value


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@torch.no_grad()
def save_model_and_optim_state(
    dir: str, model: nn.Module, optim: torch.optim.Optimizer, *, save_overwrite: bool = False
) -> list[str]:
    """Save the model to ``dir/model`` and the optimizer to ``dir/optim``; returns this rank's files.

    Works for plain modules, DDP, FSDP2, DTensor tensor parallelism and FSDP1 with
    ``use_orig_params=True``. The optimizer is not stepped: parameters and step counts are
    untouched. Every rank calls it together.

    Args:
        dir: a local path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix`` URL
            (a ``str``: ``pathlib.Path("s3://b/k")`` is ``s3:/b/k``, which is refused).
        model: the model, sharded any way.
        optim: its optimizer; the state it has is saved, keyed by parameter name.
        save_overwrite: replace a checkpoint already saved in ``dir``.

    Returns:
        The files this rank created.

    Raises:
        FileExistsError: ``dir`` holds a checkpoint and ``save_overwrite`` is False (no rank
            writes anything then).
        ReplicaMismatchError: ranks holding copies of one tensor (a replicated parameter, say)
            hold different bytes; nothing is committed (``CHECKPOINTER_VERIFY_REPLICAS=0`` skips
            the check).

    Example::

        checkpointer.save_model_and_optim_state(f"{run_dir}/step{step}", model, optim)
    """
    dir = path_arg(dir).rstrip("/")
    model_state = model_state_dict(model)
    optim_state = flatten_optim_state(model, optim, model_state)
    _DEFAULT.wait()
    claim_parts(open_storage(f"{dir}/model"), open_storage(f"{dir}/optim"), save_overwrite)
    _, model_files = _DEFAULT.save(f"{dir}/model", model_state, save_overwrite=save_overwrite)
    _, optim_files = _DEFAULT.save(f"{dir}/optim", optim_state, save_overwrite=save_overwrite)
    return model_files + optim_files


def async_save_model_and_optim_state(
    dir: str, model: nn.Module, optim: torch.optim.Optimizer, *, save_overwrite: bool = False
) -> Future[list[str]]:
    """Like :func:`save_model_and_optim_state`, but returns once the state is staged in host memory.

    Writing goes on in the background while training continues; the future gives this
    rank's files, and errors surface from ``.result()``. A new save waits for the one in flight.
    The write uses the process group: wait for ``.result()`` before ``destroy_process_group()``.

    Args:
        dir, model, optim, save_overwrite: as for :func:`save_model_and_optim_state`.

    Returns:
        A ``concurrent.futures.Future`` of this rank's files; ``FileExistsError`` (no
        ``save_overwrite``) and write errors come from its ``.result()``.
    """
    dir = path_arg(dir).rstrip("/")
    with torch.no_grad():
        model_state = model_state_dict(model)
        optim_state = flatten_optim_state(model, optim, model_state)
        _DEFAULT.wait()
        files: Future[list[str]] = Future()
        # The async saver locks both parts (retiring old ones) before writing either.
        both = _DEFAULT.async_save_many(
            [(f"{dir}/model", model_state), (f"{dir}/optim", optim_state)], save_overwrite=save_overwrite
        )

    def done(f: Future) -> None:
        if f.exception() is not None:
            files.set_exception(f.exception())
        else:
            files.set_result([name for _, created in f.result() for name in created])

    both.add_done_callback(done)
    return files


@torch.no_grad()
def load_model_and_optim_state(
    dir: str,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    validate: bool = True,
    strategy: str = "default",
) -> None:
    """Load ``dir/model`` (and ``dir/optim``) in place, whatever topology saved them.

    Tensors already allocated in the model and optimizer are filled one at a time; missing
    optimizer state is allocated. Every rank calls it together.

    Args:
        dir: the directory :func:`save_model_and_optim_state` wrote (path or URL), e.g. what
            :func:`latest_checkpoint` returns (check it for None first).
        model: the model to fill, sharded any way.
        optim: its optimizer, or None to load the model only.
        validate: every element of every tensor is proven loaded: each rank's read plan must
            cover all its local elements, and every read must return all its bytes. Kept for
            OLMo-core compatibility; the proof is always on.
        strategy: ``"default"`` (every rank reads what it needs) or ``"two_stage"`` (each piece
            several ranks need is read once and broadcast).

    Raises:
        TypeError: ``dir`` is None.
        IncompleteCheckpointError: no ``metadata.json`` (the message names the directory meant
            when ``dir`` is a run directory or one level off).
        CorruptCheckpointError: the files are damaged or disagree with the metadata.
        CheckpointMismatchError: a key is missing, or a shape or dtype differs (no casting).

    Example::

        last = checkpointer.latest_checkpoint(run_dir)
        if last is not None:
            checkpointer.load_model_and_optim_state(last, model, optim)
    """
    dir = path_arg(dir).rstrip("/")
    model_state = model_state_dict(model)
    if optim is not None and strategy == "default":
        _load_model_and_optim(dir, model, optim, model_state)
        return
    checkpointer = Checkpointer()
    checkpointer.load(_part(dir, "model"), model_state, strategy=strategy)
    if optim is not None:
        _load_optim(checkpointer, _part(dir, "optim"), model, optim, model_state, strategy)


def _part(dir: str, name: str) -> Storage:
    """``dir/name`` (``model`` or ``optim``), read as a part of the checkpoint ``dir``: a local
    ``name`` that is a link leading out of ``dir`` is not followed."""
    return open_storage(dir).part(name)


def _load_model_and_optim(dir: str, model: nn.Module, optim: torch.optim.Optimizer, model_state: dict[str, Any]) -> None:
    """Both checkpoints as one load: one metadata broadcast, one pool of reads, and no tensor
    of either written before every rank has planned both."""
    storages = [_part(dir, "model"), _part(dir, "optim")]
    optim_dir = storages[1].url
    for storage in storages:
        wait_for_writes_into(storage.url)
    torch_state: dict[str, Any] = {}

    def state_dicts(metadatas: list[StorageMetadata]) -> list[dict[str, Any]]:
        with _malformed(optim_dir):
            to_fill, torch_state["optim"] = _plan_optim_load(storages[1], metadatas[1], model, optim, model_state)
        return [model_state, to_fill]

    def finish() -> None:
        with _malformed(optim_dir):
            optim.load_state_dict(torch_state["optim"])

    load_state_dicts(storages, state_dicts, finish=finish)


def _load_optim(
    checkpointer: Checkpointer,
    storage: Storage,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    model_state: dict[str, Any],
    strategy: str,
) -> None:
    dir = storage.url
    metadata = checkpointer.get_metadata(storage)
    with dist.phase("load optimizer"), _malformed(dir):
        to_fill, torch_state = _plan_optim_load(storage, metadata, model, optim, model_state)
    checkpointer.load(storage, to_fill, metadata=metadata, strategy=strategy)
    # Agreed on: a rank left behind would wait in training's next collective.
    with dist.phase("load optimizer"), _malformed(dir):
        optim.load_state_dict(torch_state)


@contextlib.contextmanager
def _malformed(where: str) -> Iterator[None]:
    """Optimizer records that decode but do not have the expected form are corrupt checkpoints."""
    try:
        yield
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as ex:
        raise CorruptCheckpointError(f"{where}: malformed optimizer checkpoint ({type(ex).__name__}: {ex})") from ex


def _plan_optim_load(
    storage: Storage,
    metadata: StorageMetadata,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    model_state: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state tensors to fill in place, and the state dict to hand the optimizer afterwards."""
    dir = storage.url
    for key in ("num_param_groups", "state_keys"):
        if key not in metadata.tensors:
            raise CorruptCheckpointError(f"{dir}: optimizer checkpoint has no {key!r}")
    reader = CheckpointReader(storage, metadata)
    small = reader.full_tensors([k for k in metadata.tensors if not k.startswith("state.")])
    num_groups = int(small["num_param_groups"].item())
    if num_groups != len(optim.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {num_groups} optimizer param groups, the optimizer has {len(optim.param_groups)}"
        )
    state_keys = decode_builtins(_tensor_bytes(small["state_keys"]), where=f"{dir}: state_keys")
    names = _param_names(model)
    groups: list[dict[str, Any]] = []
    to_fill: dict[str, Any] = {}
    state_of: dict[int, dict[str, torch.Tensor]] = {}
    aliases = metadata.aliases or {}
    shared: dict[str, torch.Tensor] = {}  # saved key -> the state tensor that holds it (one per saved tensor)
    index = 0
    for i, group in enumerate(optim.param_groups):
        key = f"param_group{i}"
        if key not in small:
            raise CorruptCheckpointError(f"{dir}: optimizer checkpoint has no {key!r}")
        saved = decode_builtins(_tensor_bytes(small[key]), where=f"{dir}: {key}")
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{dir}: {key} is not a dict")
        saved_names = saved.pop("_param_names", None)
        current = [names.get(id(p)) for p in group["params"]]
        if not isinstance(saved_names, list) or sorted(map(str, saved_names)) != sorted(map(str, current)):
            raise CheckpointMismatchError(
                f"optimizer param group {i}: the checkpoint holds {saved_names}, the optimizer holds {current}"
            )
        saved["params"] = list(range(index, index + len(current)))
        for k, v in saved.items():
            now = group.get(k)
            if isinstance(now, torch.Tensor) and now.numel() == 1 and type(v) in (int, float):
                saved[k] = torch.full_like(now, v)  # saved as a number: a tensor hyperparameter stays one
        groups.append(saved)
        for param, name in zip(group["params"], current):
            value = model_state.get(name, param)
            existing = optim.state.get(param, {})
            param_state = {}
            for state_key in state_keys:
                flat_key = f"state.{name}.__{state_key}"
                # A state tensor shared by several parameters was saved once, the other keys as aliases of it.
                saved_key = aliases.get(flat_key, flat_key)
                meta = metadata.tensors.get(saved_key)
                if meta is None:
                    continue
                dest = shared.get(saved_key)
                if dest is None or not _fits(dest, meta, value):
                    dest = existing.get(state_key)
                    if not _fits(dest, meta, value):
                        dest = _allocate_state(flat_key, meta, value, reader.headers)
                    shared.setdefault(saved_key, dest)
                param_state[state_key] = dest
                to_fill[flat_key] = _shard_like_param(dest, value)
            if param_state:
                state_of[index] = param_state
            index += 1
    return to_fill, {"state": state_of, "param_groups": groups}


def _fits(dest: Any, meta: TensorStorageMetadata, param: Any) -> bool:
    """An existing state tensor can be filled in place (global shape, or the param's local shape)."""
    if not isinstance(dest, torch.Tensor) or dest.dtype != dtype_from_code(meta.dtype):
        return False
    if tuple(dest.shape) == tuple(meta.shape):
        return True
    return tuple(meta.shape) == tuple(param.shape) and tuple(dest.shape) == tuple(local_data(param).shape)


def _allocate_state(key: str, meta: TensorStorageMetadata, param: Any, headers: HeaderCache) -> torch.Tensor:
    """A state tensor for the checkpoint's values: sharded like ``param`` when it has its shape
    (the model justifies that size), else of the checkpoint's shape once the files are seen to hold it.
    A 0-dim state is like a 0-dim param only where it was saved sharded, as a DTensor (``step`` never is)."""
    dtype = dtype_from_code(meta.dtype)
    if tuple(meta.shape) == tuple(param.shape) and (meta.shape or meta.is_sharded):
        like = param if isinstance(param, torch.Tensor) else local_data(param)
        return torch.empty_like(like.detach(), dtype=dtype)
    check_files_hold(headers, key, meta)
    return torch.empty(meta.shape, dtype=dtype)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.dtype != torch.uint8:
        raise CorruptCheckpointError(f"expected a uint8 tensor of pickled builtins, got {t.dtype}")
    return memoryview_of(t.contiguous().cpu()).tobytes()


@torch.no_grad()
def unshard_model_state(
    dir: str, *, device: torch.device | str | None = None, rank0_only: bool = False, no_dist: bool = False
) -> dict[str, torch.Tensor]:
    """Full model tensors by name (every tied name included) from ``dir/model``.

    Args:
        dir: the directory :func:`save_model_and_optim_state` wrote (path or URL).
        device: where the tensors go (CPU by default).
        rank0_only: only rank 0 reads; the other ranks get ``{}``.
        no_dist: no collectives; this process reads everything alone.
    """
    return Checkpointer().unshard(_part(path_arg(dir), "model"), device=device, rank0_only=rank0_only, no_dist=no_dist)


@torch.no_grad()
def unshard_optim_state(
    dir: str, *, device: torch.device | str | None = None, rank0_only: bool = False, no_dist: bool = False
) -> dict[str, Any]:
    """The full optimizer state from ``dir/optim``, in ``torch.optim.Optimizer.state_dict()`` form.

    ``param_groups[i]["params"]`` are indices, as ``state_dict()`` has them, in the saved order;
    state tensors are full (unsharded).

    Args:
        dir: the directory :func:`save_model_and_optim_state` wrote (path or URL).
        device: where the tensors go (CPU by default).
        rank0_only: only rank 0 reads; the other ranks get ``{}``.
        no_dist: no collectives; this process reads everything alone.
    """
    storage = _part(path_arg(dir), "optim")
    where = storage.url
    flat = Checkpointer().unshard(storage, device=device, rank0_only=rank0_only, no_dist=no_dist)
    if not flat:
        return {}
    with _malformed(where):
        return _unflatten_optim(flat, where)


def _unflatten_optim(flat: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    state_keys = decode_builtins(_tensor_bytes(flat["state_keys"]), where=f"{where}: state_keys")
    groups, state = [], {}
    for i in range(int(flat["num_param_groups"].item())):
        group = decode_builtins(_tensor_bytes(flat[f"param_group{i}"]), where=f"{where}: param_group{i}")
        if not isinstance(group, dict) or not isinstance(group.get("_param_names", []), list):
            raise CorruptCheckpointError(f"{where}: param_group{i} is not a param group dict with a _param_names list")
        names = group.pop("_param_names", [])
        for name, pid in zip(names, group["params"]):
            entry = {k: flat[f"state.{name}.__{k}"] for k in state_keys if f"state.{name}.__{k}" in flat}
            if entry:
                state[pid] = entry
        groups.append(group)
    return {"state": state, "param_groups": groups}


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint among the sub-directories of ``run_dir``, or None.

    Newest is the highest step: the number after ``step`` in the name (``epoch2-step900``),
    else its last number. A sub-directory is complete when it holds ``metadata.json`` or
    ``model/`` and ``optim/`` that both do; incomplete ones (a save that died) are skipped.

    Example::

        last = checkpointer.latest_checkpoint("/ckpt/run1")   # "/ckpt/run1/step1000", or None
        if last is not None:
            checkpointer.load_model_and_optim_state(last, model, optim)
    """
    run_dir = path_arg(run_dir, "run directory")
    newest = newest_checkpoint(open_storage(run_dir))
    return None if newest is None else f"{run_dir.rstrip('/')}/{newest}"
