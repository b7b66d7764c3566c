"""torch.distributed.checkpoint (DCP) directories: read them tensor by tensor, write them streaming.

DCP keeps its index, ``.metadata``, as a Python pickle, and unpickling runs whatever code the
file names. So reading a DCP directory needs an explicit ``allow_pickle=True`` (the command
line's ``--allow-pickle``), and the one call that unpickles, DCP's own
``FileSystemReader.read_metadata``, sits alone in :func:`_read_trusted_dcp_metadata`.
Nothing else in this library unpickles. The tensor data itself DCP reads with
``torch.load(weights_only=True)``.

Writing uses ``torch.distributed.checkpoint.save`` with a planner that fetches each tensor
only when DCP asks for its bytes, one file per tensor, so one tensor is in memory at a time.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.dtypes import code_from_dtype, dtype_from_code
from ..planning.plan import Piece, check_tiling
from ..storage import urls
from ..storage.base import check_url
from .sources import Entry, TensorSource, Where

__all__ = ["DCPSource", "read_dcp_metadata", "write_dcp", "DCP_METADATA", "local_path"]

DCP_METADATA = ".metadata"
PICKLE_WARNING = (
    "{where} is a Python pickle, and unpickling can run arbitrary code: pass --allow-pickle "
    "(allow_pickle=True) only for a DCP checkpoint you trust"
)


def local_path(url: str) -> str:
    """DCP directories are local: a path or ``file://`` URL."""
    url = check_url(str(url))
    path = urls.local_path(url)
    if path is None:
        raise CheckpointError(f"{url}: torch DCP directories are read and written on local disk only")
    return path


def read_dcp_metadata(path: str, *, allow_pickle: bool = False) -> Any:
    """The ``Metadata`` of a DCP directory; refuses unless ``allow_pickle`` (it is a pickle)."""
    path = local_path(path)
    where = os.path.join(path, DCP_METADATA)
    if not allow_pickle:
        raise CheckpointError(PICKLE_WARNING.format(where=where))
    if not os.path.isfile(where):
        raise CheckpointError(f"{where} is missing: {path} is not a complete torch DCP checkpoint")
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _read_trusted_dcp_metadata(path)
    except Exception as ex:  # noqa: BLE001 - whatever a damaged pickle raises
        raise CorruptCheckpointError(f"{where}: not a torch DCP metadata file ({type(ex).__name__}: {ex})") from ex
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: not a torch DCP metadata file (it holds a {type(metadata).__name__})")
    return metadata


def _read_trusted_dcp_metadata(path: str) -> Any:
    """The only place the library unpickles: DCP's reader, after the caller allowed it."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


class DCPSource(TensorSource):
    """The tensors of a DCP directory, each loaded whole (from however many ranks' chunks) on demand.

    Entries that are not tensors (pickled Python objects) are not read; :attr:`skipped` names them.
    """

    format = "dcp"
    looks_for = f"{DCP_METADATA} (torch DCP)"

    @classmethod
    def supports(cls, where: Where) -> bool:
        return where.name is None and where.storage.exists(DCP_METADATA)

    def __init__(self, where: Where, *, allow_pickle: bool = False, **_options: object):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = local_path(where.storage.url)
        self.url = self.path
        self.aliases: dict[str, str] = {}
        self.metadata = read_dcp_metadata(self.path, allow_pickle=allow_pickle)
        self._entries: list[tuple[str, tuple[int, ...], str]] = []
        self.skipped: list[str] = []
        for fqn, meta in self.metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                self.skipped.append(fqn)
                continue
            try:
                code = code_from_dtype(meta.properties.dtype)
            except TypeError as ex:
                raise CheckpointError(f"{self.path}: tensor {fqn!r}: {ex}") from ex
            _check_chunks(self.path, fqn, tuple(meta.size), meta.chunks)
            self._entries.append((fqn, tuple(meta.size), code))
        self._reader = _reader_with_metadata(self.path, self.metadata)

    def entries(self) -> list[Entry]:
        return list(self._entries)

    def fetch(self, key: str) -> torch.Tensor:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException

        meta = self.metadata.state_dict_metadata[key]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            with _single_process():
                load({key: out}, storage_reader=self._reader, no_dist=True)
        except (Exception, CheckpointException) as ex:  # DCP's CheckpointException is a BaseException
            cause = _unwrap(ex)
            raise CorruptCheckpointError(f"{self.path}: cannot read tensor {key!r} ({type(cause).__name__}: {cause})") from ex
        return out


def _check_chunks(path: str, key: str, shape: tuple[int, ...], chunks: Sequence[Any]) -> None:
    """DCP's load fills what a tensor's chunks cover and leaves the rest of the destination as it
    was (``torch.empty``'s bytes here): chunks that reach past the tensor, overlap or leave
    elements out are a corrupt checkpoint."""
    pieces = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not (len(offsets) == len(sizes) == len(shape)
                and all(0 <= o and 0 <= s and o + s <= d for o, s, d in zip(offsets, sizes, shape))):
            raise CorruptCheckpointError(
                f"{path}: tensor {key!r}: a chunk at {list(offsets)} of sizes {list(sizes)} lies outside its shape {list(shape)}"
            )
        pieces.append(Piece(local_shape=sizes, global_offset=offsets))
    try:
        check_tiling(key, shape, pieces)
    except ValueError as ex:
        raise CorruptCheckpointError(f"{path}: {ex}") from None


def _unwrap(ex: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (which holds each rank's error and traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(ex, CheckpointException) and ex.failures:
        failure = next(iter(ex.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return ex


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when asked for exactly that (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _reader_with_metadata(path: str, metadata: Any) -> Any:
    """A DCP reader that hands back the metadata already read instead of unpickling it again."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self) -> Any:  # noqa: D102 - DCP's interface
            return metadata

    return _Reader(path)


def write_dcp(
    dst: str,
    entries: Sequence[tuple[str, Sequence[int], str]],
    fetch: Callable[[str], torch.Tensor],
    *,
    save_overwrite: bool = False,
    make_progress: Callable[[int, int], Any] | None = None,
) -> list[str]:
    """Write ``entries`` (``(key, shape, dtype_code)``, fetched by key) as a DCP directory.

    Raises:
        FileExistsError: ``dst`` already holds a DCP checkpoint and ``save_overwrite`` is False.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    path = local_path(dst)
    if os.path.exists(os.path.join(path, DCP_METADATA)) and not save_overwrite:
        raise FileExistsError(f"{os.path.join(path, DCP_METADATA)} exists: a DCP checkpoint is already there (pass save_overwrite=True to replace it)")
    if not entries:
        raise CheckpointError("nothing to write: the source holds no tensor")
    shapes = {key: (tuple(shape), dtype_from_code(code)) for key, shape, code in entries}
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values())
    bar = make_progress(total, len(entries)) if make_progress else None

    class _FetchingPlanner(DefaultSavePlanner):
        """Plans from meta tensors; DCP's writer asks for each tensor's data when it writes it."""

        def resolve_data(self, write_item: Any) -> Any:  # noqa: D102 - DCP's interface
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            key = write_item.index.fqn
            data = fetch(key)
            shape, dtype = shapes[key]
            if tuple(data.shape) != shape or data.dtype != dtype:
                raise CheckpointError(f"tensor {key!r} came back as {list(data.shape)} {data.dtype}, expected {list(shape)} {dtype}")
            if bar is not None:
                bar.advance(data.numel() * data.element_size(), 1)
            return data

    state = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in shapes.items()}
    os.makedirs(path, exist_ok=True)
    # DCP rewrites the data files in place: the old index must not outlive them (a failure
    # half-way would leave it reading the new bytes), so the old checkpoint reads as incomplete.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, DCP_METADATA))
    before = set(os.listdir(path))
    written: set[str] = set()

    class _Writer(FileSystemWriter):
        """DCP's writer, noting the data files its index names (the files of this save)."""

        def finish(self, metadata: Any, results: Any) -> None:  # noqa: D102 - DCP's interface
            written.update(r.storage_data.relative_path for per_rank in results for r in per_rank)
            super().finish(metadata, results)

    try:
        # One file per tensor: DCP's writer keeps every tensor of a file alive until the file is done.
        writer = _Writer(path, single_file_per_rank=False, thread_count=1)
        with _single_process():
            save(state, storage_writer=writer, planner=_FetchingPlanner(), no_dist=True)
    except BaseException as ex:  # DCP's CheckpointException is a BaseException: an error of ours (fetch) or its own
        _remove_new_files(path, before)
        if not isinstance(ex, CheckpointException):
            raise
        cause = _unwrap(ex)
        if isinstance(cause, (CheckpointError, OSError)):
            raise cause from ex
        raise CheckpointError(f"{path}: cannot write the DCP checkpoint ({type(cause).__name__}: {cause})") from ex
    finally:
        if bar is not None:
            bar.close()
    for name in before - written:  # an earlier checkpoint's data files that this one does not name
        if _DATA_FILE.fullmatch(name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))
    return sorted(os.path.join(path, n) for n in written | {DCP_METADATA})


_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


def _remove_new_files(path: str, before: set[str]) -> None:
    """After a failed write: the files it created (it wrote no ``.metadata``), as far as it can."""
    for name in set(os.listdir(path)) - before:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, name))
