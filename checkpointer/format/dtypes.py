"""Safetensors dtype codes <-> torch dtypes."""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError

__all__ = ["DTYPE_CODES", "READABLE_CODES", "dtype_from_code", "code_from_dtype", "itemsize", "LARGEST_ITEMSIZE"]

DTYPE_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
READABLE_CODES: dict[str, torch.dtype] = {
    **DTYPE_CODES,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
"""Every code read from other writers' safetensors files (``lazy_load``, ``convert``): those of
this library's format (:data:`DTYPE_CODES`, the only ones it saves) and the others
``safetensors.torch`` writes."""
_CODE_OF: dict[torch.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}
_ITEMSIZE: dict[str, int] = {code: torch.empty((), dtype=dt).element_size() for code, dt in READABLE_CODES.items()}
LARGEST_ITEMSIZE = max(_ITEMSIZE.values())


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return READABLE_CODES[code]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {code!r}; expected one of {sorted(READABLE_CODES)}") from None


def code_from_dtype(dtype: torch.dtype) -> str:
    try:
        return _CODE_OF[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def itemsize(code: str) -> int:
    try:
        return _ITEMSIZE[code]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {code!r}") from None
