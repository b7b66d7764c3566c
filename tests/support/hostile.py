"""Editing a checkpoint copy into hostile shapes, and checking every loader against the rule."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable

import rel_helpers
from rel_helpers import Copy

import checkpointer


def meta_path(copy: Copy, part: str) -> str:
    return os.path.join(copy.part(part), "metadata.json")


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def edit_metadata(copy: Copy, part: str, edit: Callable[[dict], Any]) -> None:
    path = meta_path(copy, part)
    meta = read_json(path)
    edit(meta)
    write_json(path, meta)


def write_metadata_text(copy: Copy, part: str, text: str | bytes) -> None:
    rel_helpers.rewrite(meta_path(copy, part), text.encode() if isinstance(text, str) else text)


def split_rank_file(path: str) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data area."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_rank_file(path: str, header: Any, data: bytes, *, length: int | None = None) -> None:
    """Write a safetensors file from a header (dict, or raw bytes/str) and a data area.

    ``length`` overrides the 8-byte header length (a lie about the header's size).
    """
    if isinstance(header, (bytes, str)):
        hb = header.encode() if isinstance(header, str) else header
    else:
        hb = json.dumps(header, separators=(",", ":")).encode()
    prefix = struct.pack("<Q", len(hb) if length is None else length)
    rel_helpers.rewrite(path, prefix + hb + data)


def edit_header(path: str, edit: Callable[[dict], Any]) -> None:
    header, data = split_rank_file(path)
    edit(header)
    write_rank_file(path, header, data)


def file_holding(copy: Copy, part: str, key: str) -> str:
    """A rank file of ``part`` that holds a piece of ``key``."""
    specs = read_json(meta_path(copy, part))["tensors"][key]["shard_spec_per_file"]
    return os.path.join(copy.part(part), sorted(specs)[0])


def replace_tensor(copy: Copy, part: str, key: str, value: Any, *, shape: list[int] | None = None, dtype: str | None = None) -> None:
    """Store ``value`` (a tensor) as the whole of ``key`` in one rank file, and say so in metadata."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = file_holding(copy, part, key)
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        user_metadata = f.metadata()  # the file id metadata.json lists
    tensors[key] = value.reshape(-1).clone()
    save_file(tensors, path, metadata=user_metadata)

    def edit(meta: dict) -> None:
        entry = meta["tensors"][key]
        entry["shape"] = list(value.shape) if shape is None else shape
        entry["dtype"] = dtype or {torch.uint8: "U8", torch.int64: "I64", torch.float32: "F32"}[value.dtype]
        entry["shard_spec_per_file"] = {
            os.path.basename(path): {"flattened_offsets": [[0, value.numel()]], "local_shape": None, "global_offset": None}
        }

    edit_metadata(copy, part, edit)


def run_part(
    copy: Copy, part: str, tmp_path: Any, *, only: set[str] | None = None, hang_s: float = rel_helpers.HANG_S
) -> dict[str, rel_helpers.Outcome]:
    calls = rel_helpers.part_loaders(copy, part)
    if only is not None:
        calls = {k: v for k, v in calls.items() if k in only}
    return rel_helpers.run_loaders(calls, copy.top, (str(tmp_path),), hang_s=hang_s)


def check_part(
    copy: Copy,
    part: str,
    tmp_path: Any,
    *needles: str,
    scope: str = "all",
    cls: type = checkpointer.CheckpointError,
    only: set[str] | None = None,
    must: set[str] | None = None,
    hang_s: float = rel_helpers.HANG_S,
) -> dict[str, rel_helpers.Outcome]:
    """Run every loader of ``part``; assert the rule, and that the loaders that read the damage
    raise ``cls`` naming one of ``needles``.

    ``scope``: "all" (metadata.json is damaged: everything but latest_checkpoint reads it),
    "data" (a rank file or a tensor's entry: loaders that read only metadata may succeed),
    "none" (nothing has to raise; only the rule holds). ``must`` names the loaders that must
    raise instead. ``only``: run just these loaders.
    """
    __tracebackhide__ = True
    outcomes = run_part(copy, part, tmp_path, only=only, hang_s=hang_s)
    if must is not None:
        pass
    elif scope == "all":
        must = set(outcomes) - {"latest_checkpoint"}
    elif scope == "data":
        must = set(outcomes) - rel_helpers.METADATA_ONLY
    else:
        must = set()
    rel_helpers.assert_rule(outcomes, must_raise=must, needles=needles, cls=cls)
    return outcomes
