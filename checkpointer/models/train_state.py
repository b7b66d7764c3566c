"""The training run's own state (step, schedulers, data position, RNG) in ``dir/train/``.

``dir/train/`` is a checkpoint directory like ``model/`` (``metadata.json`` plus rank files), so
it is written, committed and checked by the same engine. Its keys:

- ``manifest``: JSON naming the job keys, the per-rank keys and the world size that saved them;
- ``job.{key}``: the JSON of a value that is the job's (the same on every rank): written once;
  a save whose ranks disagree on its JSON is refused before anything is written, and on a tensor
  it holds, at the commit, by the replica check (``CHECKPOINTER_VERIFY_REPLICAS``);
- ``rank{r}.{key}``: the JSON of rank ``r``'s own value (``PerRank``, ``RNGState``), held by
  rank ``r`` alone;
- ``{json key}/{i}``: the tensors a JSON refers to (:mod:`~checkpointer.models.train_codec`).

JSON texts are stored as 1-D uint8 tensors. Saving, in order:

1. Every rank calls :func:`save_parts` before its save is planned: each value is taken
   (``state_dict()`` of a stateful object) and encoded now, and the ranks compare their job
   values (one all-reduce of a digest; their descriptions are gathered only when they differ).
2. The state dict it returns is saved to ``dir/train`` before ``model/`` and ``optim/``, whose
   commit comes last: a step whose ``optim/`` committed has its train state committed too.

Loading: :func:`read_train_state`, before the model and optimizer are filled, reads ``manifest``,
the job values and this rank's own, and checks the keys asked for; then :meth:`ReadTrainState.apply`
fills the stateful objects passed in place and returns every value by key. ``PerRank`` values at
another world size: rank ``r`` gets what rank ``r`` saved; a rank beyond the saved world size
gets nothing for those keys: they are listed in ``missing_keys`` (as ``train_state.{key}``),
a warning names them, and their objects are left untouched.
"""

from __future__ import annotations

import hashlib
import random
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn

from .. import dist
from ..buffers import memoryview_of
from ..engine.async_save import wait_for_writes_into
from ..engine.checkpointer import Checkpointer
from ..engine.locate import holds_anything
from ..engine.reader import CheckpointReader
from ..errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from ..format.layout import METADATA_FILENAME
from ..storage.base import Storage
from . import train_codec
from .names import model_state_dict
from .optim_layout import flatten_optim_state

__all__ = ["PerRank", "RNGState", "save_parts", "read_train_state", "ReadTrainState", "TRAIN_PART"]

TRAIN_PART = "train"
_FORMAT = 1


class PerRank:
    """A ``train_state`` value that each rank keeps its own of (a data loader's position, say)."""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


class RNGState:
    """This rank's random generators: Python's ``random``, NumPy's global one (when NumPy is
    installed), torch's CPU generator and every CUDA device's (when CUDA is initialised).

    Always per rank: ``train_state={"rng": RNGState()}`` saves each rank's own. Restore it after
    creating a ``DataLoader`` iterator (``iter(loader)`` draws from torch's generator)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        out: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            out["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = list(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            py = state["python"]
            random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
            torch.set_rng_state(_uint8(state["torch"]))
            if "numpy" in state:
                import numpy as np

                n = state["numpy"]
                keys = n["keys"].numpy().astype(np.uint32)
                np.random.set_state((str(n["kind"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
            if "cuda" in state and torch.cuda.is_available():
                saved = [_uint8(s) for s in state["cuda"]]
                if len(saved) != torch.cuda.device_count():
                    warnings.warn(f"RNGState: {len(saved)} CUDA generators saved, {torch.cuda.device_count()} devices now; CUDA RNG not restored", stacklevel=2)
                else:
                    torch.cuda.set_rng_state_all(saved)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as ex:
            raise CorruptCheckpointError(f"RNGState: malformed saved state ({type(ex).__name__}: {ex})") from ex


def _uint8(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise TypeError("a generator state is a uint8 tensor")
    return value.contiguous().cpu()


def _is_per_rank(value: Any) -> bool:
    return isinstance(value, (PerRank, RNGState))


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, PerRank) else value


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


_JSON_ROUNDING = 256


def _json_tensor(data: bytes) -> torch.Tensor:
    """``data`` padded with spaces (JSON whitespace) to a multiple of :data:`_JSON_ROUNDING` bytes:
    its shape then stays the same while a step counter or a data position grows, and an async
    save reuses its cached plan."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    padded = bytearray(data)
    padded += b" " * (-len(padded) % _JSON_ROUNDING)
    return torch.frombuffer(padded, dtype=torch.uint8)


def save_parts(
    dir: str, model: nn.Module, optim: torch.optim.Optimizer, train_state: Mapping[str, Any] | None
) -> list[tuple[str, dict[str, Any]]]:
    """Every rank: the parts of a model + optimizer save as ``(dir/part, state dict)``, in commit
    order: ``train/`` (when ``train_state`` is given; recipe step 1), ``model/``, then ``optim/``,
    whose commit is the checkpoint's. One rank's error here (a value that cannot be stored,
    optimizer state that is not a tensor) stops every rank, before the job values are compared."""
    def model_and_optim() -> list[tuple[str, Mapping[str, Any]]]:
        model_state = model_state_dict(model)
        return [(f"{dir}/model", model_state), (f"{dir}/optim", flatten_optim_state(model, optim, model_state))]

    if train_state is None:  # an error goes into the save, whose planning brings it to every rank
        parts, error = dist.attempt(model_and_optim)
        return parts if error is None else [(f"{dir}/{part}", _Unsaveable(error)) for part in ("model", "optim")]
    with dist.phase("save"):
        if not isinstance(train_state, Mapping):
            raise TypeError(f"train_state must be a dict, not {type(train_state).__name__}")
        parts = model_and_optim()
        flat, digests, manifest = _encode_all(train_state)
    _check_job_values_agree(digests, manifest)
    return [(f"{dir}/{TRAIN_PART}", flat), *parts]


class _Unsaveable(Mapping):
    """A state dict this rank could not make: reading it raises that error, which the save's
    description of its values carries into its planning, whose agreement reaches every rank
    (no collective of its own: a repeated async save keeps one all-reduce)."""

    def __init__(self, error: BaseException):
        self.error = error

    def __getitem__(self, key: str) -> Any:
        raise self.error

    def __iter__(self):
        raise self.error

    def __len__(self) -> int:
        raise self.error


def _encode_all(train_state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    flat: dict[str, torch.Tensor] = {}
    digests: dict[str, int] = {}
    job, per_rank = [], []
    for key, value in train_state.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"train_state key {key!r}: keys are non-empty strings without '/'")
        name = f"rank{rank}.{key}" if _is_per_rank(value) else f"job.{key}"
        (per_rank if _is_per_rank(value) else job).append(key)
        inner = _unwrap(value)
        if _is_stateful(inner):
            inner = inner.state_dict()
        tensors: list[torch.Tensor] = []

        def add(t: torch.Tensor, name: str = name, tensors: list = tensors) -> str:
            # A copy: taken now, whenever the save stages (an async save's in the background), and
            # never one tensor under two keys (a save stores that once, as an alias).
            tensors.append(t.detach().clone())
            return f"{name}/{len(tensors) - 1}"

        try:
            text = train_codec.dumps(train_codec.encode(inner, f"train_state[{key!r}]", add))
        except train_codec.UnstorableValueError as ex:
            raise CheckpointMismatchError(str(ex)) from None
        flat[name] = _json_tensor(text)
        flat.update((f"{name}/{i}", t) for i, t in enumerate(tensors))
        if name.startswith("job."):  # the tensors' bytes too: a tensor differing is named here, by its key
            digest = zlib.crc32(text)
            for t in tensors:
                digest = zlib.crc32(memoryview_of(t.cpu().contiguous().reshape(-1)), digest)
            digests[key] = digest
    manifest = {"format": _FORMAT, "world_size": world, "job": job, "per_rank": per_rank}
    flat["manifest"] = _json_tensor(train_codec.dumps(manifest))
    return flat, digests, manifest


def _check_job_values_agree(digests: dict[str, int], manifest: dict[str, Any]) -> None:
    """A job value must be the same on every rank: compared here, so that a per-rank value the
    user did not wrap in ``PerRank`` is refused by name instead of one rank's being kept."""
    if not dist.is_distributed():
        return
    mine = train_codec.dumps({"keys": [manifest["job"], manifest["per_rank"]], "digests": digests})
    same, _ = dist.all_equal_and_least(int.from_bytes(hashlib.sha256(mine).digest()[:7], "little"), 0)
    if same:
        return  # one all-reduce; the descriptions are gathered only to say what differs
    everyone = dist.all_gather_bytes(mine)
    first = train_codec.loads(everyone[0], "train_state")
    for rank, data in enumerate(everyone):
        other = train_codec.loads(data, "train_state")
        if other["keys"] != first["keys"]:
            raise ValueError(
                f"train_state keys differ across ranks: rank 0 passes {first['keys']}, rank {rank} {other['keys']} "
                "(every rank passes the same keys; each rank's own values go in PerRank)"
            )
        for key, digest in other["digests"].items():
            if first["digests"].get(key) != digest:
                raise CheckpointMismatchError(
                    f"train_state[{key!r}] differs between rank 0 and rank {rank}: a value each rank keeps "
                    f"its own of must be wrapped in checkpointer.PerRank(...)"
                )


@dataclass
class ReadTrainState:
    """A checkpoint's training state, read, checked and decoded (recipe: before the model and
    optimizer are filled, so that a key it lacks or a damaged value changes nothing), and what
    :meth:`apply` still does after them."""

    values: dict[str, Any]
    lost: list[str]  # per-rank keys this rank has no saved value of (another world size)
    wanted: dict[str, Any]
    where: str

    def apply(self, missing: list[str]) -> dict[str, Any]:
        """Fill the stateful objects asked for; note the lost keys in ``missing``. Returns every
        value. Runs inside the load's last phase (``then`` of
        :func:`~checkpointer.models.optim_layout.load_model_and_optim`), which brings one rank's
        failure to every rank."""
        missing.extend(f"train_state.{k}" for k in self.lost)
        for key, target in self.wanted.items():
            inner = _unwrap(target)
            if key in self.values and _is_stateful(inner):
                try:
                    inner.load_state_dict(self.values[key])
                except (KeyError, TypeError, ValueError, AttributeError, IndexError, CorruptCheckpointError) as ex:
                    raise CorruptCheckpointError(
                        f"{self.where}: train_state[{key!r}] does not load into its {type(inner).__name__} "
                        f"({type(ex).__name__}: {ex})"
                    ) from ex
        return self.values


def read_train_state(
    storage: Storage, train_state: Mapping[str, Any] | None, *, prepared_error: BaseException | None = None
) -> ReadTrainState:
    """Every rank: read ``storage`` (a ``dir/train``) and decode every saved value this rank
    gets (none when the checkpoint has no training state and none is asked for; a ``train/``
    holding files but no ``metadata.json`` is incomplete). Keys passed that the checkpoint lacks
    are a :class:`CheckpointMismatchError`; per-rank keys this rank has no value for at another
    world size are warned about. Errors reach every rank, ``prepared_error`` too (a failure of
    this rank before the load's first phase)."""
    wanted = dict(train_state or {})
    wait_for_writes_into(storage)  # an async save of this process writing it: its metadata comes last
    with dist.phase("load"):
        if prepared_error is not None:
            raise prepared_error
        if not storage.exists(METADATA_FILENAME):
            if holds_anything(storage):  # its save began and never committed: a copy cut short, say
                raise IncompleteCheckpointError(
                    f"{storage.join(METADATA_FILENAME)} is missing: this step's training state was never committed"
                )
            if wanted:
                raise CheckpointMismatchError(
                    f"{storage.url}: the checkpoint holds no training state, asked for {sorted(wanted)[:10]}"
                )
            return ReadTrainState({}, [], wanted, storage.url)
        return _read(storage, wanted)


def _read(storage: Storage, wanted: dict[str, Any]) -> ReadTrainState:
    where = storage.url
    metadata = Checkpointer().get_metadata(storage, no_dist=True)
    reader = CheckpointReader(storage, metadata)
    manifest = _read_json(reader, "manifest", where)
    if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT
            and all(isinstance(manifest.get(k), list) and all(isinstance(x, str) for x in manifest[k]) for k in ("job", "per_rank"))
            and isinstance(manifest.get("world_size"), int)):
        raise CorruptCheckpointError(f"{where}: the training-state manifest is malformed")
    job, per_rank = manifest["job"], manifest["per_rank"]
    absent = [k for k in wanted if k not in job and k not in per_rank]
    if absent:
        raise CheckpointMismatchError(f"{where}: train_state keys the checkpoint does not hold: {absent[:10]}")
    rank = dist.get_rank()
    names = {k: f"job.{k}" for k in job}
    lost = []
    for key in per_rank:
        if f"rank{rank}.{key}" in metadata.tensors:
            names[key] = f"rank{rank}.{key}"
        else:
            lost.append(key)
    if lost:
        warnings.warn(
            f"{where}: saved by {manifest['world_size']} ranks; rank {rank} has no saved value of the per-rank "
            f"train_state keys {lost} (left as they are)", stacklevel=4,
        )
    saved_ranks, ranks = manifest["world_size"], dist.get_world_size()
    if per_rank and rank == 0 and saved_ranks > ranks:
        others = f"rank {ranks}" if saved_ranks == ranks + 1 else f"ranks {ranks} to {saved_ranks - 1}"
        warnings.warn(
            f"{where}: saved by {saved_ranks} ranks, loaded by {ranks}: no rank loads the values of the per-rank "
            f"train_state keys {per_rank} that {others} saved", stacklevel=4,
        )
    values: dict[str, Any] = {}
    for key, name in names.items():
        tree = _read_json(reader, name, where)
        # aliases too: one tensor under two keys of a value, as saves before copies stored it
        tensor_keys = [k for k in [*metadata.tensors, *(metadata.aliases or {})] if k.startswith(f"{name}/")]
        tensors = reader.full_tensors(tensor_keys, verify=True) if tensor_keys else {}
        values[key] = train_codec.decode(tree, f"{where}: {name}", tensors)
    return ReadTrainState(values, lost, wanted, where)


def _read_json(reader: CheckpointReader, key: str, where: str) -> Any:
    if key not in reader.metadata.tensors:
        raise CorruptCheckpointError(f"{where}: the training state has no {key!r}")
    if reader.metadata.tensors[key].dtype != "U8" or len(reader.metadata.tensors[key].shape) != 1:
        raise CorruptCheckpointError(f"{where}: {key!r} is not a 1-D U8 tensor of JSON")
    data = reader.full_tensors([key], verify=True)[key]
    return train_codec.loads(memoryview_of(data.contiguous()).tobytes(), f"{where}: {key}")


def has_train_state(checkpoint: Storage) -> bool:
    """``dir/train`` holds a committed training state."""
    return checkpoint.part(TRAIN_PART).exists(METADATA_FILENAME)
