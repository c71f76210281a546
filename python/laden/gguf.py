"""GGUF files (llama.cpp's format): the table ``laden inspect`` prints
(``GgufFile``), and what loading one into a model needs.  A GGUF file is a
checkpoint like a safetensors file (``stream_load(model, "m.gguf",
key_map=laden.gguf.llama_key_map)``): its block-quantized tensors stay in
their bytes in RAM, on disk and on the link, and are expanded where their
block runs (see include/laden/expand.h); tensors outside the streamed
blocks are expanded once, on load.  ``llama_key_map`` maps llama.cpp's
names (``blk.N.attn_q.weight``) to transformers' Llama names; for a file
whose ``general.architecture`` is ``llama`` laden also puts the q and k
rows back in transformers' order (llama.cpp's converter interleaves each
head's two rotary halves)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

from . import _lib
from ._lib import check, lib
from .checkpoint import PathLike
from .errors import FormatError

__all__ = ["GgufFile", "GgufTensor", "llama_key_map", "LLAMA_NAMES",
           "rope_heads", "check_config"]

# llama.cpp's tensor names -> transformers' Llama names ("{}": the layer).
LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.ffn_norm.weight":
        "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# Tensors llama.cpp writes that a transformers model computes itself.
_LLAMA_DROPPED = ("rope_freqs.weight",)


def llama_key_map(name: str):
    """The transformers Llama name of a llama.cpp tensor name (None for
    the ones transformers computes: ``rope_freqs.weight``); a name it does
    not know is returned as is, so that a mismatch lists it."""
    if name in _LLAMA_DROPPED:
        return None
    if name in LLAMA_NAMES:
        return LLAMA_NAMES[name]
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        hf = LLAMA_NAMES.get("blk.{}." + rest)
        if hf is not None and layer.isascii() and layer.isdigit():
            return hf.format(layer)
    return name


# Sizes in a GGUF file's metadata: at least 1, at most this (what a
# transformers config or a C dimension takes).
_MAX_SIZE = (1 << 31) - 1


def _where(path) -> str:
    return f"{os.fspath(path)}: " if path is not None else ""


def _bad(path, key: str, v, need: str):
    return FormatError(
        f"{_where(path)}GGUF metadata '{key}' is "
        f"{'missing' if v is None else repr(v)}: {need}", "E_SCHEMA")


def _size(metadata, key: str, path=None, hi: int = _MAX_SIZE,
          required: bool = False, why: str = "", typed: bool = False):
    """metadata[key] as an integer in 1..hi (None if absent and not
    required), else FormatError naming the key and the file.  An integer:
    a Python int (not a bool) from GgufFile's typed metadata (`typed`),
    else also the decimal text Checkpoint.metadata renders the file's
    integer types as."""
    v = metadata.get(key)
    if v is None and not required:
        return None
    n = None
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif not typed and isinstance(v, str) and v.isascii() and v.isdigit() \
            and len(v) < 20:
        n = int(v)
    if n is None or not 1 <= n <= hi:
        raise _bad(path, key, v, f"laden needs an integer from 1 to {hi}"
                   f"{why}")
    return n


def rope_heads(metadata, path=None) -> Dict[str, int]:
    """For a Llama-architecture GGUF file: the heads over which each q and
    k projection's rows were interleaved by llama.cpp's converter, by
    tensor name pattern ("attn_q" / "attn_k"); {} for other files.  A
    Llama file without readable head counts (integers from 1 to 2^31 - 1,
    kv heads dividing heads) raises FormatError naming the key and `path`
    (its q/k rows cannot be put back in order without them)."""
    if metadata.get("general.architecture") != "llama":
        return {}
    need = "; laden needs it to put the q and k rows back in transformers' " \
        "order"
    heads = _size(metadata, "llama.attention.head_count", path,
                  required=True, why=need)
    kv = _size(metadata, "llama.attention.head_count_kv", path, why=need)
    if kv is None:
        kv = heads
    if heads % kv:
        raise _bad(path, "llama.attention.head_count_kv", kv,
                   f"it does not divide llama.attention.head_count "
                   f"({heads}){need}")
    return {"attn_q": heads, "attn_k": kv}


def check_config(path: PathLike) -> "GgufFile":
    """Checks the metadata a model's config is built from
    (``from_pretrained`` on a .gguf: transformers reads it) for type and
    range in C (laden_gguf_check_model: sizes integers from 1 to 2^31 - 1,
    the block count at most the tensor count, kv heads dividing heads,
    rope base and norm epsilons finite positive floats, ...), and returns
    the file's table.  A bad one raises FormatError naming the key and the
    file, before transformers would raise TypeError or ZeroDivisionError,
    or build a model of a billion layers."""
    h = ctypes.c_void_p()
    check(lib.laden_gguf_open(os.fsencode(path), ctypes.byref(h)))
    try:
        check(lib.laden_gguf_check_model(h, os.fsencode(path)))
    finally:
        lib.laden_gguf_close(h)
    return GgufFile(path)


def rope_heads_of(name: str, heads: Dict[str, int]) -> int:
    """The heads of tensor `name` (``blk.N.attn_q.weight``), or 0."""
    if not heads or not name.startswith("blk.") or \
            not name.endswith(".weight"):
        return 0
    kind = name.split(".")[2] if name.count(".") >= 3 else ""
    return heads.get(kind, 0)

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
                if typ == "string":  # C checked it is UTF-8
                    v: object = kv.str.decode()
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
