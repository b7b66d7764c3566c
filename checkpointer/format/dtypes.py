"""Safetensors dtype codes <-> torch dtypes."""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError

__all__ = ["DTYPE_CODES", "dtype_from_code", "code_from_dtype", "itemsize"]

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
_CODE_OF: dict[torch.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}
_ITEMSIZE: dict[str, int] = {code: torch.empty((), dtype=dt).element_size() for code, dt in DTYPE_CODES.items()}


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return DTYPE_CODES[code]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {code!r}; expected one of {sorted(DTYPE_CODES)}") from None


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
