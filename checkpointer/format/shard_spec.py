"""One shard spec as a pydantic model: which elements of the full tensor one file holds.

Its own module so that both :mod:`~checkpointer.format.metadata` (whose models hold specs)
and :mod:`~checkpointer.format.specs` (which builds one on access) can import it without
importing each other. The two forms are described in :mod:`~checkpointer.format.metadata`.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["TensorShardSpec"]


class TensorShardSpec(BaseModel):
    """Which elements of the full tensor one file holds."""

    model_config = ConfigDict(frozen=True, extra="allow")

    flattened_offsets: tuple[tuple[int, int], ...] | None = None
    local_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    checksums: tuple[int, ...] | None = None
    """CRC32C of each ``StorageMetadata.checksum_chunk_bytes`` of this piece's bytes (new, optional)."""

    @model_validator(mode="after")
    def _one_form(self) -> TensorShardSpec:
        if self.flattened_offsets is not None:
            for start, end in self.flattened_offsets:
                if not 0 <= start <= end:
                    raise ValueError(f"bad flattened range [{start}, {end})")
        elif self.local_shape is not None and self.global_offset is not None:
            if len(self.local_shape) != len(self.global_offset):
                raise ValueError("local_shape and global_offset differ in length")
            if any(d < 0 for d in self.local_shape) or any(o < 0 for o in self.global_offset):
                raise ValueError("negative local_shape or global_offset")
        else:
            raise ValueError("a shard spec needs flattened_offsets, or local_shape and global_offset")
        return self

    @property
    def local_numel(self) -> int:
        if self.flattened_offsets is not None:
            return sum(end - start for start, end in self.flattened_offsets)
        assert self.local_shape is not None
        return math.prod(self.local_shape)
