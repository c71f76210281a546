"""Writes safetensors files from torch tensors: for samples, tests and
benchmarks, which must build their own checkpoints (nothing is fetched)."""

from __future__ import annotations

import ctypes
import json
import os
import struct
from typing import Dict, Mapping, Optional

from ._dtypes import checkpoint_dtype

_CHUNK = 64 << 20


def save_file(tensors: Mapping[str, "object"], path, metadata:
              Optional[Dict[str, str]] = None) -> int:
    """Writes ``tensors`` (name → CPU tensor) in order to ``path``; returns
    the file size.  The header is padded to 8 bytes, as safetensors does."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"cannot write {os.fspath(path)}: directory {parent} does not "
            "exist")
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    flat = []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": checkpoint_dtype(t.dtype),
                        "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        flat.append((t, n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = os.fspath(path) + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for t, n in flat:
                base = t.data_ptr()
                for at in range(0, n, _CHUNK):
                    f.write(ctypes.string_at(base + at, min(_CHUNK, n - at)))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)  # no half-written file left behind
        raise
    return 8 + len(text) + offset
