"""The functions an FSDP training loop calls (the optimizer's layout is :mod:`~checkpointer.models.optim_layout`).

The optimizer is flattened as OLMo-core 0.1.0 does, keyed by parameter *name* so it
survives any change of topology: ``num_param_groups``, ``param_group{i}`` (builtins pickle
with ``_param_names``), ``state_keys``, and ``state.{param}.__{key}`` tensors sharded like
their parameter. Optimizer state is never created by stepping the optimizer: a save writes
the state that exists, and a load allocates whatever state the checkpoint has.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.nn as nn

from . import dist
from .engine.checkpointer import Checkpointer, Strategy
from .engine.async_save import WatchedFuture
from .engine.commit import claim_step
from .engine.locate import newest_checkpoint
from .errors import IncompleteCheckpointError
from .format.layout import METADATA_FILENAME
from .models.hf_load import KeyMap, is_hf_checkpoint, load_hf
from .models.load_result import LoadResult
from .models.names import load_targets, model_state_dict
from .models.train_state import TRAIN_PART, PerRank, RNGState, read_train_state, save_parts
from .models.optim_layout import flatten_optim_state, load_model_and_optim, malformed, unflatten_optim
from .storage import open_storage
from .tools.retention import prune_run
from .storage.base import Storage, path_arg

__all__ = [
    "save_model_and_optim_state",
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "latest_checkpoint",
    "prune",
    "LoadResult",
    "PerRank",
    "RNGState",
    "model_state_dict",
    "flatten_optim_state",
]

# The one piece of module state: the top-level save functions share a checkpointer so that
# repeated saves reuse their plan and an async save can make the next one wait for it.
_DEFAULT = Checkpointer()


@torch.no_grad()
def save_model_and_optim_state(
    dir: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    train_state: dict[str, Any] | None = None,
    save_overwrite: bool = False,
) -> list[str]:
    """Save the model to ``dir/model``, the optimizer to ``dir/optim`` and ``train_state`` to
    ``dir/train``, committed as one; returns this rank's files.

    Works for plain modules, DDP, FSDP2, DTensor tensor parallelism and FSDP1 with
    ``use_orig_params=True``. The optimizer is not stepped: parameters and step counts are
    untouched. Every rank calls it together.

    Args:
        dir: a local path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix`` URL
            (a ``str``: ``pathlib.Path("s3://b/k")`` is ``s3:/b/k``, which is refused).
        model: the model, sharded any way.
        optim: its optimizer; the state it has is saved, keyed by parameter name.
        train_state: the run's own state by key: objects with ``state_dict()``/``load_state_dict()``
            (LR schedulers, ``GradScaler``, a ``StatefulDataLoader``, :class:`RNGState`), plain
            values (None, bool, int, float, str, lists/tuples/dicts of them), tensors, or
            ``PerRank(v)`` around any of these. Without ``PerRank`` a value is the job's: every
            rank must pass the same (compared; a difference is a ``CheckpointMismatchError``
            naming the key). Stored without pickle (JSON and safetensors).
        save_overwrite: replace a checkpoint already saved in ``dir``.

    Returns:
        The files this rank created.

    Raises:
        FileExistsError: ``dir`` holds a checkpoint and ``save_overwrite`` is False (no rank
            writes anything then). A step a dead save left incomplete (``model/`` or ``train/``
            committed, ``optim/`` not) is taken over instead; one whose save still holds its lock
            is refused.
        ReplicaMismatchError: ranks holding copies of one tensor (a replicated parameter, say)
            hold different bytes; nothing is committed (``CHECKPOINTER_VERIFY_REPLICAS=0`` skips
            the check).

    Example::

        checkpointer.save_model_and_optim_state(f"{run_dir}/step{step}", model, optim)
    """
    dir = path_arg(dir).rstrip("/")
    targets = save_parts(dir, model, optim, train_state)
    _DEFAULT.wait()
    model, optim_dir, train = (open_storage(f"{dir}/{part}") for part in ("model", "optim", TRAIN_PART))
    # Rank 0 claims the step once every part's plan is agreed (ranks that disagree refuse the save first).
    saved = _DEFAULT.save_many(targets, save_overwrite=save_overwrite, claim=lambda: claim_step(
        model, optim_dir, save_overwrite, train=train, keep_train=len(targets) == 3))
    return [name for _, created in saved for name in created]


def async_save_model_and_optim_state(
    dir: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    train_state: dict[str, Any] | None = None,
    save_overwrite: bool = False,
    stage_in_background: bool = False,
) -> Future[list[str]]:
    """Like :func:`save_model_and_optim_state`, but returns once the state is staged in host memory.

    Writing goes on in the background while training continues; the future gives this
    rank's files, and errors surface from ``.result()``. A new save waits for the one in flight.
    The write uses the process group: ``torch.distributed.destroy_process_group()`` waits for
    it first, and so does the end of the process; a failure no one read with ``.result()`` is
    printed at exit, naming ``dir``, and the exit status becomes 1.

    Args:
        dir, model, optim, train_state, save_overwrite: as for :func:`save_model_and_optim_state`;
            ``train_state`` is taken (``state_dict()``, tensors copied) before this returns.
        stage_in_background: return before the model's and optimizer's tensors are copied to
            host memory; the copy overlaps the caller's next forward and backward passes, and the
            caller leaves those tensors unchanged until the future's ``staged`` (a ``Future``)
            is done: wait for ``future.staged.result()`` just before the next optimizer step.

    Returns:
        A ``concurrent.futures.Future`` of this rank's files; ``FileExistsError`` (no
        ``save_overwrite``) and write errors come from its ``.result()``.
    """
    dir = path_arg(dir).rstrip("/")
    with torch.no_grad():
        targets = save_parts(dir, model, optim, train_state)
        _DEFAULT.wait()
        files = WatchedFuture(dir)
        # The async saver locks every part (retiring old ones) before writing any; rank 0 claims
        # the step first, in a collective the save makes anyway (a refusal from .result()).
        storages = [open_storage(f"{dir}/{name}") for name in ("model", "optim", TRAIN_PART)]
        both = _DEFAULT.async_save_many(
            targets, save_overwrite=save_overwrite, stage_in_background=stage_in_background,
            claim=lambda: claim_step(*storages[:2], save_overwrite, train=storages[2], keep_train=len(targets) == 3))

    def done(f: Future) -> None:
        if f.exception() is not None:
            files.set_exception(f.exception())
        else:
            files.set_result([name for _, created in f.result() for name in created])

    both.staged.add_done_callback(lambda _: files.staged.set_result(None))
    both.add_done_callback(done)
    return files


@torch.no_grad()
def load_model_and_optim_state(
    dir: str,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    train_state: dict[str, Any] | None = None,
    strict: bool = True,
    validate: bool = True,
    strategy: Strategy = "default",
    key_map: KeyMap = None,
    dtype: torch.dtype | None = None,
) -> LoadResult:
    """Load ``dir/model`` (and ``dir/optim``, and the training state) in place, whatever topology saved them,
    or a Hugging Face checkpoint into the model.

    Tensors already allocated in the model and optimizer are filled one at a time; missing
    optimizer state is allocated. Every rank calls it together.

    Keys are matched by name, model keys as :func:`model_state_dict` names them (wrapper
    prefixes dropped) and optimizer parameters by their model names. Tied parameters and keys
    saved as aliases count once: a key tied to one that loads is not missing, and a checkpoint
    alias of a loaded key is not unexpected. With ``strict=False`` the keys both have load and
    the rest is left untouched, for fine-tuning (a new or renamed head, the optimizer rebuilt):

    - ``LoadResult.missing_keys``: model keys the checkpoint lacks, then ``optim:{param}`` for
      each optimizer parameter the checkpoint holds nothing for (it keeps the state it has: none
      for an optimizer just built, so it starts fresh);
    - ``LoadResult.unexpected_keys``: checkpoint model keys the model lacks, then
      ``optim:{param}`` for each saved optimizer parameter the optimizer lacks (not read).

    Optimizer parameters are matched by name across param groups; with ``strict`` the param
    groups must be as many as saved, each taking the hyperparameters of the saved group of its
    index; without, each takes those of the saved group that held its parameters (its own where
    none or several did). A
    shape or dtype that differs is an error in both modes (no casting), as is an optimizer of
    another kind than the saved one: the class name a save records (``optim_class``) must be
    equal (Adam is not AdamW), and for a checkpoint without it (OLMo-core's, older saves) the
    saved state keys must be those this optimizer holds with the saved hyperparameters (found
    by stepping a new optimizer of its class over small stand-in parameters; where that fails,
    the optimizer's own state keys if it has state; else it is not judged).

    ``dir`` may instead be a Hugging Face checkpoint, detected as ``lazy_load`` detects it: a
    directory with ``model.safetensors.index.json`` and its shards, a directory holding a
    ``.safetensors`` file, or one such file (local, ``s3://``, ``gs://``, ``http(s)://``), or
    ``hf://ORG/NAME[@REVISION]`` (the index and the shards the model needs are fetched into the
    Hugging Face cache through cached-path, honouring ``HF_ENDPOINT``, ``HF_HOME`` and the token
    settings, and reused later). The model is filled in place whatever its sharding; each rank
    reads only its pieces' byte ranges. ``optim`` and ``train_state`` must be None then.

    Args:
        dir: the directory :func:`save_model_and_optim_state` wrote (path or URL), e.g. what
            :func:`latest_checkpoint` returns (check it for None first); or a Hugging Face
            checkpoint (above).
        model: the model to fill, sharded any way.
        optim: its optimizer, or None to load the model only (None for a Hugging Face checkpoint).
        train_state: objects to fill from ``dir/train``, by the keys they were saved under
            (``load_state_dict`` is called on each; other values need not be passed). Every
            saved value is in the result's ``train_state`` either way. A key the checkpoint
            lacks is a ``CheckpointMismatchError``. ``PerRank`` values at another world size:
            rank r gets rank r's; a rank the saving job did not have gets none (its keys are in
            ``missing_keys`` as ``train_state.{key}``, a warning names them, its objects are left
            as they are).
        strict: any difference of keys is an error (the default); False loads what both have
            and reports the rest in the result.
        validate: every element of every tensor is proven loaded: each rank's read plan must
            cover all its local elements, and every read must return all its bytes. Kept for
            OLMo-core compatibility; the proof is always on.
        strategy: ``"default"`` (every rank reads what it needs) or ``"two_stage"`` (each piece
            several ranks need is read once and broadcast).
        key_map: Hugging Face checkpoints only: checkpoint names to model names, a dict (names it
            does not list keep their own) or a callable returning the model's name, or None to
            skip that checkpoint key. Tied parameters count once (an ``lm_head.weight`` tied to
            the embedding the file holds is not missing).
        dtype: Hugging Face checkpoints only: cast every checkpoint tensor to this dtype as it is
            loaded (the model's tensors must have it). Without it, a dtype that differs is a
            ``CheckpointMismatchError``.

    Returns:
        A :class:`LoadResult`; its ``missing_keys`` and ``unexpected_keys`` are empty after a
        strict load.

    Raises:
        TypeError: ``dir`` is None.
        IncompleteCheckpointError: no ``metadata.json`` (the message names the directory meant
            when ``dir`` is a run directory or one level off).
        CorruptCheckpointError: the files are damaged or disagree with the metadata.
        ValueError: ``optim`` or ``train_state`` given for a Hugging Face checkpoint, or
            ``key_map`` or ``dtype`` for this library's (raised on every rank, before any read).
        CheckpointMismatchError: with ``strict``, a key of the model or optimizer the checkpoint
            lacks or a checkpoint key they lack (the message names the difference, at most 10
            keys of each side), or another number of param groups; in both modes, a shape or dtype
            that differs, or an optimizer of another kind (naming both). Raised on every rank.

    Example::

        last = checkpointer.latest_checkpoint(run_dir)
        if last is not None:
            checkpointer.load_model_and_optim_state(last, model, optim)
        # fine-tuning: the saved body, a new head, a new optimizer
        result = checkpointer.load_model_and_optim_state(ckpt, model, optim, strict=False)
        print(result.missing_keys)     # ['head.weight', 'head.bias', 'optim:head.weight', ...]
        # starting from a Hugging Face model (its names mapped to the model's)
        checkpointer.load_model_and_optim_state("hf://openai-community/gpt2", model,
                                                key_map=lambda k: k.removeprefix("transformer."))
    """
    dir = path_arg(dir).rstrip("/")
    if is_hf_checkpoint(dir):
        if optim is not None or train_state is not None:
            given = "optim" if optim is not None else "train_state"
            raise ValueError(
                f"{dir} is a Hugging Face checkpoint, which holds model weights only: pass {given}=None "
                "(and build the optimizer's state by training)"
            )
        return load_hf(dir, model, key_map=key_map, dtype=dtype, strict=strict, strategy=strategy)
    if key_map is not None or dtype is not None:
        top = open_storage(dir)
        if not (top.exists(METADATA_FILENAME) or top.part("model").exists(METADATA_FILENAME)):
            raise IncompleteCheckpointError(
                f"no checkpoint at {dir}: neither this library's (metadata.json) nor a Hugging Face one "
                "(model.safetensors, or its .index.json) is there (a directory served over http(s) cannot be "
                "listed: name its .safetensors file)"
            )
        raise ValueError(
            f"key_map and dtype are for Hugging Face checkpoints; {dir} is a checkpoint of this library "
            "(it loads by the model's own names and dtypes)"
        )
    # The training state is read and checked first: a key it lacks leaves the model untouched.
    # A model's state_dict hook failing on one rank reaches every rank in that first phase.
    model_state, error = dist.attempt(lambda: load_targets(model, strict=strict))
    saved_train_state = read_train_state(_part(dir, TRAIN_PART), train_state, prepared_error=error)
    storages = [_part(dir, "model")] + ([_part(dir, "optim")] if optim is not None else [])

    def fill_train_state(result: LoadResult) -> None:
        result.train_state = saved_train_state.apply(result.missing_keys)

    return load_model_and_optim(storages, model, optim, model_state, strict=strict, strategy=strategy,
                                then=fill_train_state)


def _part(dir: str, name: str) -> Storage:
    """``dir/name`` (``model`` or ``optim``), read as a part of the checkpoint ``dir``: a local
    ``name`` that is a link leading out of ``dir`` is not followed."""
    return open_storage(dir).part(name)


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

    ``param_groups[i]["params"]`` are indices, as ``state_dict()`` has them, in the saved order,
    and ``param_groups[i]["param_names"]`` the parameter names the checkpoint holds, aligned with
    them (as a named optimizer's ``state_dict()`` has them since torch 2.5; ``load_state_dict``
    of it gives an unnamed optimizer these names); state tensors are full (unsharded).

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
    with malformed(where):
        return unflatten_optim(flat, where)


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


def prune(run_dir: str, *, keep_last: int, keep_every: int | None = None) -> list[str]:
    """Delete old checkpoints of a run directory; returns the ones deleted (paths or URLs, oldest first).

    Keeps the newest ``keep_last`` complete checkpoints, and every complete one whose step is a
    multiple of ``keep_every``; deletes the other complete ones, and incomplete ones (saves that
    died) older than the newest complete one. An incomplete one newer than that may be a save
    still writing, and is kept; so is one an async save of this process is writing (it is
    skipped, not waited for). The newest complete checkpoint is never deleted. Steps and
    completeness are judged as :func:`latest_checkpoint` judges them; each checkpoint loses its
    ``metadata.json`` files first, so one half-deleted reads as incomplete. Local, ``s3://`` and
    ``gs://``.

    Every rank calls it together (rank 0 deletes, every rank gets the list), or one process
    alone, outside a process group: under ``if rank == 0:`` it fails after
    ``CHECKPOINTER_TIMEOUT_S``, having deleted nothing.

    Args:
        run_dir: the directory holding one sub-directory per checkpoint (``step100``, ...).
        keep_last: how many of the newest complete checkpoints to keep (0 keeps the newest only).
        keep_every: also keep every complete checkpoint whose step is a multiple of this.

    Raises:
        ValueError: ``keep_last`` below 0 or ``keep_every`` below 1.
        OSError: listing or deleting failed (what was deleted before stays deleted).

    Example::

        checkpointer.async_save_model_and_optim_state(f"{run_dir}/step{step}", model, optim)
        checkpointer.prune(run_dir, keep_last=3, keep_every=10_000)
    """
    return prune_run(path_arg(run_dir, "run directory").rstrip("/") or "/", keep_last, keep_every)
