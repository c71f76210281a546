"""GGUF files (llama.cpp's format) as laden's C reader sees them: the
tensor table and the metadata, validated when the file opens (see
include/laden/gguf.h).  Loading GGUF weights into a model is not built yet
(issue 16); this is the table ``laden inspect`` prints."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

from . import _lib
from ._lib import check, lib
from .checkpoint import PathLike

__all__ = ["GgufFile", "GgufTensor"]

_SCALARS = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32",
            6: "f32", 7: "bool", 8: "string", 9: "array", 10: "u64",
            11: "i64", 12: "f64"}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type: str                 # ggml type: "Q4_K", "F16", ...
    shape: Tuple[int, ...]    # outermost first, as torch orders it
    nbytes: int
    offset: int               # absolute, in the file


class GgufFile:
    """A GGUF file's table: ``tensors`` (file order), ``metadata`` (key ->
    value: numbers and strings as such, arrays as "array[type] x N"),
    ``version``, ``alignment``."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        h = ctypes.c_void_p()
        check(lib.laden_gguf_open(self.path.encode(), ctypes.byref(h)))
        try:
            self.version = lib.laden_gguf_version(h)
            self.alignment = lib.laden_gguf_alignment(h)
            t = _lib.GgufTensor()
            self.tensors: List[GgufTensor] = []
            for i in range(lib.laden_gguf_count(h)):
                check(lib.laden_gguf_tensor_at(h, i, ctypes.byref(t)))
                self.tensors.append(GgufTensor(
                    t.name.decode(), lib.laden_gguf_type_name(t.type).decode(),
                    tuple(t.dims[d] for d in reversed(range(t.ndim))),
                    t.size_bytes, t.offset_bytes))
            kv = _lib.GgufKv()
            self.metadata: Dict[str, object] = {}
            for i in range(lib.laden_gguf_metadata_count(h)):
                check(lib.laden_gguf_metadata_at(h, i, ctypes.byref(kv)))
                typ = _SCALARS.get(kv.type, "?")
                if typ == "string":
                    v: object = kv.str.decode(errors="replace")
                elif typ == "array":
                    v = f"array[{_SCALARS.get(kv.elem_type, '?')}] x {kv.count}"
                elif typ in ("f32", "f64"):
                    v = kv.f
                elif typ.startswith("i"):
                    v = kv.i
                elif typ == "bool":
                    v = bool(kv.u)
                else:
                    v = kv.u
                self.metadata[kv.key.decode()] = v
        finally:
            lib.laden_gguf_close(h)
        self.total_bytes = sum(x.nbytes for x in self.tensors)
