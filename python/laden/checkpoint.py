"""Checkpoints: the tensor table from libladen's validated headers, and
reads through the C reader pool."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple, Union

from . import _lib
from ._dtypes import torch_dtype
from ._lib import check, lib
from .errors import FormatError, InvalidArgumentError

PathLike = Union[str, "os.PathLike[str]"]

log = logging.getLogger("laden")

# Reads of more bytes than this show a progress bar when stderr is a
# terminal and tqdm is installed.
PROGRESS_MIN_BYTES = 1 << 30


def read_text(path: PathLike, max_bytes: int, is_json: bool = False):
    """A small file's text, read whole and checked by C
    (laden_st_read_text: a regular file of at most max_bytes, UTF-8, with
    is_json strict JSON nested at most 64 deep), and with is_json parsed.
    A typed LadenError naming the path and what is wrong."""
    out, n = ctypes.c_void_p(), ctypes.c_uint64()
    check(lib.laden_st_read_text(os.fsencode(path), max_bytes,
                                 _lib.ST_TEXT_JSON if is_json else 0,
                                 ctypes.byref(out), ctypes.byref(n)))
    try:
        text = ctypes.string_at(out.value, n.value).decode("utf-8")
    finally:
        lib.laden_st_text_free(out)
    if not is_json:
        return text
    try:
        return json.loads(text, parse_float=_finite)
    except ValueError as e:  # a number beyond what Python reads
        raise FormatError(f"{os.fspath(path)}: not JSON laden reads: {e}",
                          "E_JSON") from None


def _finite(text: str) -> float:
    v = float(text)  # C refused NaN; 1e999 is JSON but not a double
    if math.isinf(v):
        raise ValueError(f"{text} does not fit a double")
    return v


def _progress_bar(total: int, desc: str, progress: Optional[bool]):
    if progress is False or (progress is None and (
            total < PROGRESS_MIN_BYTES or not sys.stderr.isatty())):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                leave=False)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its header declares it."""

    name: str
    dtype: str            # checkpoint dtype name, e.g. "BF16"
    shape: Tuple[int, ...]
    nbytes: int
    offset: int           # absolute byte offset in its file
    file_index: int
    file: str

    @property
    def torch_dtype(self):
        """The torch dtype, or None when torch has none (F4, F6)."""
        return torch_dtype(self.dtype)


class Reader:
    """A pool of reader threads (C).  ``threads`` and ``chunk_bytes`` of 0
    take the defaults; ``direct=False`` forces buffered reads, True lets C
    read cold bytes the faster way on each file system (O_DIRECT or
    buffered, measured; ``LADEN_IO_DIRECT`` overrides)."""

    def __init__(self, threads: int = 0, chunk_bytes: int = 0,
                 direct: bool = True):
        cfg = _lib.IoConfig(threads, chunk_bytes,
                            _lib.IO_DIRECT_AUTO if direct
                            else _lib.IO_DIRECT_OFF)
        h = ctypes.c_void_p()
        check(lib.laden_io_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h
        self._fin = weakref.finalize(self, lib.laden_io_destroy, h)

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._fin.alive:
            raise InvalidArgumentError("the reader is closed", "E_INVAL")
        return self._h

    def close(self) -> None:
        self._fin()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_reader: Optional[Reader] = None
_default_lock = threading.Lock()


def default_reader() -> Reader:
    """The process's shared reader pool, created on first use."""
    global _default_reader
    with _default_lock:
        if _default_reader is None:
            _default_reader = Reader()
        return _default_reader


class _File:
    """An open file of the checkpoint (C handle)."""

    def __init__(self, st_handle, index: int):
        h = ctypes.c_void_p()
        check(lib.laden_st_file_open(st_handle, index, ctypes.byref(h)))
        self.handle = h
        self._fin = weakref.finalize(self, lib.laden_io_file_close, h)

    def close(self) -> None:
        self._fin()


def _to_str(path: PathLike) -> str:
    return os.fspath(path)


class Checkpoint:
    """An open safetensors checkpoint: a file, a sharded index, or a
    directory holding one.  Every header is validated when it opens.

    Use as a context manager or call ``close()``; a checkpoint that is
    dropped is closed by its finalizer."""

    def __init__(self, path: PathLike):
        self.path = _to_str(path)
        h = ctypes.c_void_p()
        check(lib.laden_st_open(self.path.encode(), ctypes.byref(h)))
        self._h = h
        self._fin = weakref.finalize(self, lib.laden_st_close, h)
        n_files = lib.laden_st_file_count(h)
        self.files: List[str] = [
            lib.laden_st_file_path(h, i).decode() for i in range(n_files)]
        self.file_sizes: List[int] = [
            lib.laden_st_file_size(h, i) for i in range(n_files)]
        self._tensors: List[TensorInfo] = []
        t = _lib.StTensor()
        for i in range(lib.laden_st_count(h)):
            check(lib.laden_st_tensor_at(h, i, ctypes.byref(t)))
            self._tensors.append(TensorInfo(
                name=t.name.decode(),
                dtype=lib.laden_dtype_name(t.dtype).decode(),
                shape=tuple(t.shape[d] for d in range(t.ndim)),
                nbytes=t.size_bytes,
                offset=t.offset_bytes,
                file_index=t.file_index,
                file=self.files[t.file_index]))
        self._index: Dict[str, int] = {
            ti.name: i for i, ti in enumerate(self._tensors)}
        meta = {}
        k, v = ctypes.c_char_p(), ctypes.c_char_p()
        for i in range(lib.laden_st_metadata_count(h)):
            check(lib.laden_st_metadata_at(h, i, ctypes.byref(k),
                                           ctypes.byref(v)))
            # UTF-8: C checked (safetensors' JSON, GGUF's strings)
            meta[k.value.decode()] = v.value.decode()
        self.metadata: Dict[str, str] = meta
        self.total_bytes: int = lib.laden_st_total_bytes(h)
        # "gguf" for a GGUF file (its tensors' names and q/k rows are
        # llama.cpp's), else "safetensors".
        self.format: str = lib.laden_st_format(h).decode()
        self._files: Dict[int, _File] = {}
        self._lock = threading.Lock()
        log.debug("opened %s: %d tensors, %d bytes in %d file(s)", self.path,
                  len(self._tensors), self.total_bytes, len(self.files))

    # -- the table ------------------------------------------------------
    def names(self) -> List[str]:
        """Tensor names in file order."""
        return [t.name for t in self._tensors]

    def tensors(self) -> List[TensorInfo]:
        """Every tensor's info in file order."""
        return list(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        """The tensor's info; TensorNotFoundError if absent."""
        self._check_open()
        i = self._index.get(name)
        if i is None:
            idx = ctypes.c_size_t()
            check(lib.laden_st_find(self._h, name.encode(), ctypes.byref(idx)))
            i = idx.value  # not reached: C agrees the name is absent
        return self._tensors[i]

    # -- data -------------------------------------------------------------
    def _file(self, index: int) -> _File:
        with self._lock:
            f = self._files.get(index)
            if f is None:
                f = self._files[index] = _File(self._h, index)
            return f

    def tensor(self, name: str):
        """The tensor as a new CPU tensor, read with the reader pool.  It
        is the caller's: it stays valid after ``close()`` and whatever
        happens to the file (a view of the file's pages would raise SIGBUS
        once the file is truncated).  Reading a file that changed since
        this checkpoint first read from it raises FormatError."""
        import torch

        ti = self.info(name)
        dt = ti.torch_dtype
        if dt is None:
            raise InvalidArgumentError(
                f"tensor '{name}' is {ti.dtype}, which this torch has no "
                f"dtype for; read its raw bytes with read_into(name, "
                f"torch.empty({ti.nbytes}, dtype=torch.uint8))", "E_INVAL")
        out = torch.empty(ti.shape, dtype=dt)
        if ti.nbytes:
            self.read_into(name, out)
        return out

    def read_into(self, name: str, out, reader: Optional[Reader] = None):
        """Reads the tensor's bytes into ``out`` with the C reader pool and
        returns ``out``.  ``out`` must be a contiguous CPU tensor (pinned or
        not) of the tensor's dtype and shape, or a uint8 tensor of exactly
        its byte size.  On error ``out`` may hold partial data; the
        checkpoint is unchanged."""
        self.read_into_many([(name, out)], reader)
        return out

    def read_into_many(self, items, reader: Optional[Reader] = None,
                       progress: Optional[bool] = None) -> None:
        """Reads several tensors at once: every read is queued on the pool
        before the first is waited for, so small tensors share the drive's
        parallelism.  ``items`` is an iterable of (name, out) with ``out`` as
        for ``read_into``.  All outputs are checked before any read starts;
        if a read fails, the others are still waited for, then the first
        error is raised.  ``progress``: None shows a bar for reads over
        1 GiB when stderr is a terminal (needs tqdm), True always, False
        never."""
        items = list(items)
        plan = [(self._check_out(name, out), out) for name, out in items]
        r = reader or default_reader()
        reqs = []
        first_error = None
        total = sum(ti.nbytes for ti, _ in plan)
        bar = _progress_bar(total, os.path.basename(self.path), progress)
        try:
            for ti, out in plan:
                if not ti.nbytes:
                    continue
                f = self._file(ti.file_index)
                req = ctypes.c_void_p()
                st = lib.laden_io_submit(r.handle, f.handle, ti.offset,
                                         ti.nbytes,
                                         ctypes.c_void_p(out.data_ptr()),
                                         ctypes.byref(req))
                if st:
                    first_error = _lib.error_for(st)
                    break
                reqs.append((req, ti.nbytes))
        finally:
            for req, nbytes in reqs:
                st = lib.laden_io_wait(r.handle, req)
                if st and first_error is None:
                    first_error = _lib.error_for(st)
                if bar is not None:
                    bar.update(nbytes)
            if bar is not None:
                bar.close()
        if first_error is not None:
            raise first_error
        log.debug("read %d tensors, %d bytes from %s", len(reqs), total,
                  self.path)

    def _check_out(self, name: str, out) -> TensorInfo:
        import torch

        ti = self.info(name)
        if not isinstance(out, torch.Tensor):
            raise InvalidArgumentError(
                f"read_into('{name}'): out must be a torch.Tensor, not "
                f"{type(out).__name__}", "E_INVAL")
        if out.device.type != "cpu":
            raise InvalidArgumentError(
                f"read_into('{name}'): out is on {out.device}; it must be a "
                "CPU tensor", "E_INVAL")
        if not out.is_contiguous():
            raise InvalidArgumentError(
                f"read_into('{name}'): out must be contiguous", "E_INVAL")
        raw = out.dtype == torch.uint8 and out.dim() == 1 and ti.dtype != "U8"
        nbytes = out.numel() * out.element_size()
        if raw:
            if nbytes != ti.nbytes:
                raise InvalidArgumentError(
                    f"read_into('{name}'): out holds {nbytes} bytes, the "
                    f"tensor {ti.nbytes}", "E_INVAL")
        elif out.dtype != ti.torch_dtype or tuple(out.shape) != ti.shape:
            raise InvalidArgumentError(
                f"read_into('{name}'): out is {out.dtype} {tuple(out.shape)}"
                f", the tensor is {ti.dtype} {ti.shape}", "E_INVAL")
        return ti

    # -- lifetime ---------------------------------------------------------
    def _check_open(self) -> None:
        if not self._fin.alive:
            raise InvalidArgumentError(
                f"checkpoint {self.path} is closed", "E_INVAL")

    def close(self) -> None:
        """Frees the table and closes files.  Tensors made with
        ``tensor()`` stay valid."""
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
        self._fin()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({self.path!r}, {len(self)} tensors, "
                f"{self.total_bytes} bytes in {len(self.files)} file(s))")


def open(path: PathLike) -> Checkpoint:  # noqa: A001 - laden.open
    """Opens a checkpoint (file, sharded index, or directory)."""
    return Checkpoint(path)
