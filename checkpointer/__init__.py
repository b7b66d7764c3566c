"""checkpointer: fast, safe, resharding distributed checkpoints for PyTorch.

One safetensors file per rank plus a small JSON ``metadata.json`` (OLMo-core 0.1.0's layout);
save with one topology, load in place with any other; unshard to full tensors.
"""

from .api import (
    async_save_model_and_optim_state,
    latest_checkpoint,
    load_model_and_optim_state,
    prune,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from .engine.checkpointer import Checkpointer
from .models.load_result import LoadResult
from .models.train_state import PerRank, RNGState
from .tools.export import export_safetensors
from .tools.lazy import lazy_load
from .planning.reshard import reshard_tensor
from .sharding import get_shard_dims
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankFailedError,
    ReplicaMismatchError,
)
from .format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from .sharding import FlatShardedTensor

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
    "export_safetensors",
    "Checkpointer",
    "lazy_load",
    "reshard_tensor",
    "get_shard_dims",
    "FlatShardedTensor",
    "StorageMetadata",
    "TensorStorageMetadata",
    "TensorShardSpec",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "CheckpointMismatchError",
    "RankFailedError",
    "ReplicaMismatchError",
]

__version__ = "0.1.0"
