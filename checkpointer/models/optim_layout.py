"""The optimizer's state in OLMo-core 0.1.0's layout, both ways, keyed by parameter *name* so it
survives any change of topology: ``num_param_groups``, ``param_group{i}`` (builtins pickle with
``_param_names``), ``state_keys``, and ``state.{param}.__{key}`` tensors sharded like their
parameter. Optimizer state is never created by stepping the optimizer: a save writes the state
that exists, and a load allocates whatever state the checkpoint has.

A model and its optimizer load as one (:func:`load_model_and_optim`): the engine's load takes
the two state dicts from one plan function and calls one finish function, whatever the strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from ..buffers import memoryview_of
from ..engine.checks import HeaderCache, check_files_hold
from ..engine.checkpointer import load_parts
from ..engine.reader import CheckpointReader
from ..errors import CheckpointMismatchError, CorruptCheckpointError
from ..format.builtins_pickle import decode_builtins, encode_builtins
from ..format.dtypes import dtype_from_code
from ..format.metadata import TensorStorageMetadata
from ..sharding import describe, local_data, with_sharding_of
from ..storage.base import Storage
from .load_result import LoadResult
from .names import load_hook_copies, param_names
from .strict import (
    OPTIM_CLASS_KEY, OPTIM_PREFIX, check_optim_kind, difference_message, model_keys_to_load, optim_class_name,
)

__all__ = ["flatten_optim_state", "load_model_and_optim", "unflatten_optim", "malformed"]


def flatten_optim_state(model: nn.Module, optim: torch.optim.Optimizer, model_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state in OLMo-core's flat, name-keyed layout (no copies of state tensors)."""
    names = param_names(model)
    flat: dict[str, Any] = {"num_param_groups": torch.tensor(len(optim.param_groups))}
    state_keys: set[str] = set()
    for i, group in enumerate(optim.param_groups):
        saved: dict[str, Any] = {}
        for k, v in group.items():
            if k in ("params", "param_names"):  # torch's names (a named optimizer's): ours are ``_param_names``
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
    flat[OPTIM_CLASS_KEY] = _bytes_tensor(encode_builtins(optim_class_name(optim), where=OPTIM_CLASS_KEY))
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


def load_model_and_optim(
    storages: Sequence[Storage], model: nn.Module, optim: torch.optim.Optimizer | None, model_state: dict[str, Any],
    *, strict: bool = True, strategy: str = "default", then: Callable[[LoadResult], None] | None = None,
) -> LoadResult:
    """A model's checkpoint (``storages[0]``) and its optimizer's (``storages[1]``, when ``optim``
    is given) as one engine load: no tensor of either is written before every rank has planned
    both, and the optimizer takes its state once every tensor is filled; then ``then(result)``,
    in the same last phase (its error reaches every rank).

    The key differences are computed while every rank plans (so a refusal is raised on every
    rank); with ``strict=False`` they come back in the result (optimizer parameters as
    ``optim:{name}``), and what they name is left untouched."""
    torch_state: dict[str, Any] = {}
    result = LoadResult()
    optim_dir = storages[1].url if optim is not None else ""

    def state_dicts(readers: list[CheckpointReader]) -> list[dict[str, Any]]:
        result.missing_keys.clear()
        result.unexpected_keys.clear()
        to_load, missing, unexpected = model_keys_to_load(model_state, readers[0].metadata)
        if strict and (missing or unexpected):
            message = difference_message("model", storages[0].url, missing, unexpected, noun="model key")
            raise CheckpointMismatchError(message)
        result.missing_keys.extend(missing)
        result.unexpected_keys.extend(unexpected)
        if optim is None:
            return [to_load]
        with malformed(optim_dir):
            to_fill, torch_state["optim"], skipped = _plan_optim_load(readers[1], model, optim, model_state, strict=strict)
        result.missing_keys.extend(OPTIM_PREFIX + name for name in skipped[0])
        result.unexpected_keys.extend(OPTIM_PREFIX + name for name in skipped[1])
        return [to_load, to_fill]

    def finish() -> None:
        load_hook_copies(model, model_state)
        if optim is not None:
            with malformed(optim_dir):
                optim.load_state_dict(torch_state["optim"])
        if then is not None:
            then(result)

    parts = storages[:2] if optim is not None else storages[:1]
    load_parts(parts, state_dicts, finish=finish, strategy=strategy)
    return result


@contextlib.contextmanager
def malformed(where: str) -> Iterator[None]:
    """Optimizer records that decode but do not have the expected form are corrupt checkpoints."""
    try:
        yield
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as ex:
        raise CorruptCheckpointError(f"{where}: malformed optimizer checkpoint ({type(ex).__name__}: {ex})") from ex


def _plan_optim_load(
    reader: CheckpointReader,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    model_state: dict[str, Any],
    *,
    strict: bool = True,
) -> tuple[dict[str, Any], dict[str, Any], tuple[list[str], list[str]]]:
    """The state tensors to fill in place, the state dict to hand the optimizer afterwards, and
    the optimizer's parameter names the checkpoint lacks and the checkpoint's the optimizer lacks.

    Parameters are matched by name: in their own param group with ``strict`` (any difference
    raises; each group's hyperparameters come from the checkpoint's group of the same index), in
    any group without (the groups may differ in number: each takes the hyperparameters of the
    checkpoint's group that held its parameters, and keeps its own where they were in none, a new
    head's group, or in several). A parameter the checkpoint lacks keeps the state it has (none,
    for an optimizer just built)."""
    metadata = reader.metadata
    dir = reader.storage.url
    for key in ("num_param_groups", "state_keys"):
        if key not in metadata.tensors:
            raise CorruptCheckpointError(f"{dir}: optimizer checkpoint has no {key!r}")
    small = reader.full_tensors([k for k in metadata.tensors if not k.startswith("state.")])
    num_groups = int(small["num_param_groups"].item())
    if strict and num_groups != len(optim.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {num_groups} optimizer param groups, the optimizer has {len(optim.param_groups)}"
        )
    state_keys = decode_builtins(_tensor_bytes(small["state_keys"]), where=f"{dir}: state_keys")
    saved_class = None
    if OPTIM_CLASS_KEY in small:
        saved_class = decode_builtins(_tensor_bytes(small[OPTIM_CLASS_KEY]), where=f"{dir}: {OPTIM_CLASS_KEY}")
        if not isinstance(saved_class, str):
            raise CorruptCheckpointError(f"{dir}: {OPTIM_CLASS_KEY} is not a str")
    names = param_names(model)
    saved_groups, saved_names = [], []
    for i in range(num_groups):
        key = f"param_group{i}"
        if key not in small:
            raise CorruptCheckpointError(f"{dir}: optimizer checkpoint has no {key!r}")
        saved = decode_builtins(_tensor_bytes(small[key]), where=f"{dir}: {key}")
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{dir}: {key} is not a dict")
        group_names = saved.pop("_param_names", None)
        if not isinstance(group_names, list) or not all(isinstance(n, str) for n in group_names):
            raise CorruptCheckpointError(f"{dir}: {key} has no _param_names list of str")
        saved.pop("param_names", None)  # the optimizer keeps its own names, aligned with its own params
        saved_groups.append(saved)
        saved_names.append(group_names)
    if not isinstance(state_keys, list) or not all(isinstance(k, str) for k in state_keys):
        raise CorruptCheckpointError(f"{dir}: state_keys is not a list of str")
    # Judged by each saved group's hyperparameters over the parameters it held, however regrouped.
    by_name = {names[id(p)]: p for group in optim.param_groups for p in group["params"] if id(p) in names}
    held = [[by_name[n] for n in group_names if n in by_name] for group_names in saved_names]
    check_optim_kind(optim, saved_class, state_keys, saved_groups, dir, held)
    current_names = []
    for i, group in enumerate(optim.param_groups):
        current = [names.get(id(p)) for p in group["params"]]
        if None in current:
            raise CheckpointMismatchError(
                f"optimizer param group {i} holds tensors that are not parameters of the model"
            )
        current_names.append(current)
    skipped = _optim_difference(current_names, saved_names, strict, dir)
    if not strict:
        saved_groups = _groups_by_names(optim, current_names, saved_groups, saved_names)
    absent = set(skipped[0])
    groups: list[dict[str, Any]] = []
    to_fill: dict[str, Any] = {}
    state_of: dict[int, dict[str, torch.Tensor]] = {}
    aliases = metadata.aliases or {}
    shared: dict[str, torch.Tensor] = {}  # saved key -> the state tensor that holds it (one per saved tensor)
    index = 0
    for group, saved, current in zip(optim.param_groups, saved_groups, current_names):
        saved["params"] = list(range(index, index + len(current)))
        for k, v in saved.items():
            now = group.get(k)
            if isinstance(now, torch.Tensor) and now.numel() == 1 and type(v) in (int, float):
                saved[k] = torch.full_like(now, v)  # saved as a number: a tensor hyperparameter stays one
        groups.append(saved)
        for param, name in zip(group["params"], current):
            value = model_state.get(name, param)
            existing = optim.state.get(param, {})
            if name in absent:
                if existing:
                    state_of[index] = dict(existing)
                index += 1
                continue
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
    return to_fill, {"state": state_of, "param_groups": groups}, skipped


def _groups_by_names(
    optim: torch.optim.Optimizer, current: list[list[str]], saved_groups: list[dict[str, Any]], saved: list[list[str]]
) -> list[dict[str, Any]]:
    """Without ``strict``: each param group's hyperparameters, from the checkpoint's group that
    held its parameters, or its own where none or several did."""
    held_in = {name: i for i, names in enumerate(saved) for name in names}
    out = []
    for group, names in zip(optim.param_groups, current):
        sources = {held_in[n] for n in names if n in held_in}
        if len(sources) == 1:
            out.append(dict(saved_groups[sources.pop()]))
        else:
            out.append({k: v for k, v in group.items() if k not in ("params", "param_names")})
    return out


def _optim_difference(
    current: list[list[str]], saved: list[list[str]], strict: bool, dir: str
) -> tuple[list[str], list[str]]:
    """The optimizer's parameters the checkpoint lacks, and the checkpoint's the optimizer lacks:
    per param group with ``strict`` (raising on any), across all groups without."""
    if not strict:
        all_saved = {n for names in saved for n in names}
        all_current = {n for names in current for n in names}
        return ([n for names in current for n in names if n not in all_saved],
                [n for names in saved for n in names if n not in all_current])
    for i, (now, then) in enumerate(zip(current, saved)):
        now_set, then_set = set(now), set(then)
        missing = [n for n in now if n not in then_set]
        unexpected = [n for n in then if n not in now_set]
        if missing or unexpected:
            raise CheckpointMismatchError(
                difference_message(f"optimizer's param group {i}", dir, missing, unexpected, noun="parameter")
            )
    return [], []


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


def unflatten_optim(flat: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    state_keys = decode_builtins(_tensor_bytes(flat["state_keys"]), where=f"{where}: state_keys")
    groups, state = [], {}
    for i in range(int(flat["num_param_groups"].item())):
        group = decode_builtins(_tensor_bytes(flat[f"param_group{i}"]), where=f"{where}: param_group{i}")
        if not isinstance(group, dict) or not isinstance(group.get("_param_names", []), list):
            raise CorruptCheckpointError(f"{where}: param_group{i} is not a param group dict with a _param_names list")
        names = group.pop("_param_names", [])
        if not isinstance(group.get("params"), list) or len(group["params"]) != len(names):
            raise CorruptCheckpointError(f"{where}: param_group{i} has {len(names)} _param_names for its params")
        group["param_names"] = list(names)
        for name, pid in zip(names, group["params"]):
            entry = {k: flat[f"state.{name}.__{k}"] for k in state_keys if f"state.{name}.__{k}" in flat}
            if entry:
                state[pid] = entry
        groups.append(group)
    return {"state": state, "param_groups": groups}
