"""Checkpoint dtype names and their torch dtypes (where torch has one)."""

from __future__ import annotations

_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8",
    "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32",
    "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
    # F4, F6_E2M3, F6_E3M2: sub-byte, no torch dtype with one element each.
}


def torch_dtype(name: str):
    """The torch dtype for a checkpoint dtype name, or None if this torch
    has none."""
    import torch

    attr = _TORCH_NAMES.get(name)
    return getattr(torch, attr, None) if attr else None


def checkpoint_dtype(dtype) -> str:
    """The checkpoint dtype name for a torch dtype."""
    import torch

    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise ValueError(f"torch dtype {dtype} has no safetensors dtype")
