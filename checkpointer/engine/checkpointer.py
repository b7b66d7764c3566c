"""The :class:`Checkpointer`: save, load and unshard flat state dicts."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Literal, Mapping, Sequence, get_args

import torch

from ..format.metadata import StorageMetadata
from ..storage import open_storage
from ..storage.base import Storage
from .. import dist
from .load import load_state_dict, load_state_dicts, read_metadata, read_metadatas
from .async_save import AsyncSaver, WatchedFuture, wait_for_writes_into
from .save import SavePlanCache, describe_for_save, plan_ahead, save_state_dicts
from .two_stage import LoadStats, load_two_stage, prepare_two_stage
from .reader import CheckpointReader
from .load import unshard_state_dict

__all__ = ["Checkpointer"]

Strategy = Literal["default", "two_stage"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


class Checkpointer:
    """Saves and loads flat state dicts (string keys; no nesting).

    Values may be ``torch.Tensor``, ``nn.Parameter``, ``DTensor`` (``Shard``/``Replicate`` on
    any mesh, and the ``_StridedShard`` of FSDP2 over tensor parallelism)
    or :class:`~checkpointer.FlatShardedTensor`. In a process group every rank
    calls each method together, with the same keys.

    A checkpointer remembers its last save plan: saving the same structure again exchanges
    no per-tensor plans between ranks.

    Example::

        ckpt = Checkpointer()
        ckpt.save("/ckpt/step100/model", model.state_dict())
        ckpt.load("/ckpt/step100/model", model.state_dict())   # in place
    """

    def __init__(self) -> None:
        self._plan_cache: dict[str, SavePlanCache] = {}
        self._async: AsyncSaver | None = None
        self.last_load_stats: LoadStats | None = None
        """Per-phase timings of the last two-stage load (``print`` it)."""

    @torch.no_grad()
    def save(
        self, dir: str | Storage, state_dict: Mapping[str, Any], *, save_overwrite: bool = False
    ) -> tuple[StorageMetadata, list[str]]:
        """Save ``state_dict`` to ``dir``.

        Args:
            dir: local path, ``file://``, ``s3://`` or ``gs://`` URL of the checkpoint directory.
            state_dict: the values to save; each rank passes its local view.
            save_overwrite: replace a checkpoint already saved in ``dir``.

        Returns:
            The metadata planned (every tensor's layout, the same on every rank; the checksums
            and file ids that rank 0 adds at commit are in ``metadata.json`` only), and the
            files this rank created.

        Raises:
            FileExistsError: ``dir`` holds a checkpoint and ``save_overwrite`` is False.
            ReplicaMismatchError: ranks holding copies of one piece (a plain tensor every rank
                passes, a ``Replicate`` placement) hold different bytes; nothing is committed.
        """
        return self.save_many([(dir, state_dict)], save_overwrite=save_overwrite)[0]

    @torch.no_grad()
    def save_many(
        self, targets: list[tuple[str | Storage, Mapping[str, Any]]], *, save_overwrite: bool = False,
        claim: Callable[[], None] | None = None,
    ) -> list[tuple[StorageMetadata, list[str]]]:
        """:meth:`save` of several ``(dir, state_dict)`` as one save: all are planned and locked
        before any is written, then written and committed in order (the last commit is the save's).
        ``claim``: run by rank 0 before any lock (its error raised on every rank); with
        ``save_overwrite``, only once every target's plan is agreed, as it may retire an old checkpoint."""
        if self._async is not None:
            self._async.wait()
        opened: list[tuple[Storage, Any]] = [(open_storage(d), sd) for d, sd in targets]
        if claim is not None:
            if save_overwrite:  # described once: the save below plans from these
                opened = [(storage, describe_for_save(sd)) for storage, sd in opened]
                plan_ahead(opened, save_overwrite=True, cache=self._plan_cache)
            dist.share_from(0, lambda: claim() or b"", "save")
        return save_state_dicts(opened, save_overwrite=save_overwrite, cache=self._plan_cache)

    def async_save(
        self, dir: str | Storage, state_dict: Mapping[str, Any], *, save_overwrite: bool = False
    ) -> Future[tuple[StorageMetadata, list[str]]]:
        """Like :meth:`save`, but returns once this rank's pieces are staged in host memory.

        The file is written and committed in the background while training goes on; the
        future holds :meth:`save`'s result, and its errors surface from ``.result()``. A new
        save (async or not) first waits for the one in flight. Every rank calls it together.
        The write uses the process group: wait for ``.result()`` before ``destroy_process_group()``.

        Args:
            dir, state_dict, save_overwrite: as for :meth:`save`.

        Returns:
            A ``concurrent.futures.Future`` of ``(metadata, files this rank created)``.
        """
        return _first(self.async_save_many([(dir, state_dict)], save_overwrite=save_overwrite))

    def async_save_many(
        self, targets: list[tuple[str | Storage, Mapping[str, Any]]], *, save_overwrite: bool = False,
        absent: Sequence[str | Storage] = (), stage_in_background: bool = False,
        claim: Callable[[], None] | None = None,
    ) -> WatchedFuture:
        """:meth:`async_save` of several ``(dir, state_dict)`` at once, written one after another.
        Without ``save_overwrite``, a checkpoint in any of ``absent`` refuses it as one in a target does.
        ``stage_in_background``, ``claim``: :meth:`AsyncSaver.save`'s."""
        if self._async is None:
            self._async = AsyncSaver()
        opened = [(open_storage(d), sd) for d, sd in targets]
        return self._async.save(opened, save_overwrite=save_overwrite, cache=self._plan_cache,
                                absent=[open_storage(d) for d in absent], stage_in_background=stage_in_background,
                                claim=claim)

    def wait(self) -> None:
        """Block until an async save in flight has finished."""
        if self._async is not None:
            self._async.wait()

    @torch.no_grad()
    def load(
        self,
        dir: str | Storage,
        state_dict: Mapping[str, Any],
        *,
        no_dist: bool = False,
        metadata: StorageMetadata | None = None,
        strategy: Strategy = "default",
        verify: bool = False,
    ) -> None:
        """Fill the tensors of ``state_dict`` in place from the checkpoint in ``dir`` (after an
        async save of this process into ``dir``, if one is still writing).

        Args:
            dir: the checkpoint directory (path or URL).
            state_dict: tensors to fill; any sharding, independent of the one saved.
            no_dist: read and check alone, with no collective even inside a process group.
            metadata: the checkpoint's metadata, if already read. With ``verify``, one without
                checksums (as ``save`` returns) is read again from ``metadata.json``.
            strategy: ``"default"`` (every rank reads what it needs) or ``"two_stage"``.
            verify: check the checksums of the bytes read, where the checkpoint has them.

        Raises:
            IncompleteCheckpointError: ``dir`` has no ``metadata.json``.
            CorruptCheckpointError: the files are damaged or disagree with the metadata.
            CheckpointMismatchError: a key is missing, or a shape or dtype differs.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown load strategy {strategy!r}; expected one of {STRATEGIES}")
        storage = open_storage(dir)
        wait_for_writes_into(storage)
        if verify and metadata is not None and metadata.checksum_algorithm is None:
            metadata = None  # the checksums are in metadata.json: verifying must not skip them
        if strategy == "two_stage" and not no_dist and dist.is_distributed():
            metadata = metadata or read_metadata(storage)
            self.last_load_stats = load_two_stage(storage, state_dict, metadata, verify=verify)
        else:
            load_state_dict(storage, state_dict, no_dist=no_dist, metadata=metadata, verify=verify)

    @torch.no_grad()
    def unshard(
        self,
        dir: str | Storage,
        *,
        device: torch.device | str | None = None,
        rank0_only: bool = False,
        no_dist: bool = False,
        num_threads: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors of every key, tied keys included.

        Args:
            dir: the checkpoint directory (path or URL).
            device: where the tensors go (CPU by default).
            rank0_only: only rank 0 reads; other ranks get ``{}``.
            no_dist: no collectives; this process reads everything alone.
            num_threads: parallel reads (default ``CHECKPOINTER_IO_THREADS`` or 4).
        """
        storage = open_storage(dir)
        wait_for_writes_into(storage)
        return unshard_state_dict(
            storage, device=device, rank0_only=rank0_only, no_dist=no_dist, num_threads=num_threads
        )

    def get_metadata(self, dir: str | Storage, *, no_dist: bool = False) -> StorageMetadata:
        """The checkpoint's metadata: what ``metadata.json`` in ``dir`` holds.

        Args:
            dir: the checkpoint directory (path or URL).
            no_dist: read it in this process alone; by default rank 0 reads it and shares it.

        Raises:
            IncompleteCheckpointError: ``dir`` has no ``metadata.json``.
            CorruptCheckpointError: it is not valid metadata.
        """
        storage = open_storage(dir)
        wait_for_writes_into(storage)
        return read_metadata(storage, no_dist=no_dist)


def _first(future: Future[list[Any]]) -> Future[Any]:
    out: Future[Any] = WatchedFuture(getattr(future, "what", "a checkpoint"))

    def done(f: Future[list[Any]]) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result()[0])

    future.add_done_callback(done)
    return out


def load_parts(
    storages: Sequence[Storage],
    state_dicts: Callable[[list[CheckpointReader]], Sequence[Mapping[str, Any]]],
    *,
    finish: Callable[[], None] | None = None,
    strategy: Strategy = "default",
    verify: bool = False,
    metadatas: Sequence[StorageMetadata] | None = None,
) -> None:
    """Load several checkpoints (a model's and its optimizer's) in place as one load, whatever the
    strategy: ``state_dicts(readers)`` gives the state dict to fill from each, given a reader of
    each (its metadata and header cache, shared with the load: the one plan function), ``finish()`` runs once every tensor is filled (the one finish function).
    ``metadatas``: each storage's, when known already (the same on every rank: a Hugging Face
    checkpoint described as one), instead of its ``metadata.json``.

    ``"default"``: one metadata broadcast, one pool of reads, nothing written before every rank
    has planned every part. ``"two_stage"``: every rank plans every part, then each part is
    read once per piece and broadcast (:func:`~checkpointer.engine.two_stage.load_two_stage`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown load strategy {strategy!r}; expected one of {STRATEGIES}")
    for storage in storages:
        wait_for_writes_into(storage)
    if strategy == "default" or not dist.is_distributed():
        load_state_dicts(storages, state_dicts, metadatas=metadatas, finish=finish, verify=verify)
        return
    metadatas = list(metadatas) if metadatas is not None else read_metadatas(storages)
    readers = [CheckpointReader(storage, metadata) for storage, metadata in zip(storages, metadatas, strict=True)]
    with dist.phase("load"), torch.no_grad():
        planned = list(state_dicts(readers))
    # every part planned on every rank before any is filled: a damaged optimizer checkpoint
    # found by its planning leaves the model as it was
    runs = [prepare_two_stage(reader, state_dict, verify=verify) for reader, state_dict in zip(readers, planned, strict=True)]
    for run in runs:
        run()
    if finish is not None:
        with dist.phase("load"):
            finish()
