"""VRAM arenas and the elastic allocator (the comfy-aimdo surface).

A ``ModelVBAR`` reserves address space for a model's weights; memory is
mapped when a weight is faulted in and may be evicted again, lowest
priority first, when the budget of its ``VRAM`` context is needed -- by
another model's weights or, through ``elastic_pool``, by PyTorch's
activations.  The decisions are libladen's (``include/laden/vram.h``);
this module wraps them.

    vram = laden.vbar.VRAM("cuda", budget="20GB")
    vbar = laden.vbar.ModelVBAR(model_bytes, "cuda", vram=vram)
    w = vbar.alloc(weight.shape, weight.dtype)        # in priority order
    ...
    sig = vbar.fault(w)
    if sig is None:                  # offloaded: stream it this time
        t = weight.to("cuda", non_blocking=True)
    else:
        t = vbar.tensor(w)
        if sig != w.signature:       # replaced since written: copy again
            t.copy_(weight, non_blocking=True)
            w.signature = sig
    y = layer(x, t)
    vbar.unpin(w)                    # may be evicted from now on

    with torch.cuda.use_mem_pool(laden.vbar.elastic_pool(vram)):
        out = model(x)               # activations take unpinned weights' room
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import _lib
from ._lib import check, lib
from ._units import parse_size
from .errors import DeviceError, InvalidArgumentError, StateError
from ._bind import _view
from ._devices import _compute_stream, _dev_index, _device

_DEFAULT: Dict[object, "VRAM"] = {}


def _size(value, what: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise InvalidArgumentError(f"{what}: {e}", "E_INVAL") from None


class VRAM:
    """One device's budget for weights in VBARs and elastic allocations.
    ``budget`` None: no limit but the device's.  ``page_bytes``: the unit
    of mapping (default 32 MiB; mapping costs per call)."""

    def __init__(self, device=None, budget=None, *, page_bytes=None):
        # No torch.cuda.init() here: install_elastic must be able to swap
        # PyTorch's allocator before PyTorch initializes it.  laden works
        # in the device's primary context, which PyTorch shares.
        self.device = _device(device)
        self._h = ctypes.c_void_p()
        check(lib.laden_vram_create(
            _dev_index(self.device),
            0 if budget is None else _size(budget, "budget"),
            0 if page_bytes is None else _size(page_bytes, "page_bytes"),
            ctypes.byref(self._h)))
        self._fin = weakref.finalize(self, _close_vram, self._h,
                                     _dev_index(self.device))
        self._pool = None   # elastic_pool's MemPool
        self._alloc = None  # laden's allocator, once PyTorch was given it

    def set_budget(self, budget) -> None:
        check(lib.laden_vram_set_budget(
            self._h, 0 if budget is None else _size(budget, "budget")))

    def free_memory(self, nbytes) -> int:
        """Evicts unpinned weight pages, lowest priority first, until
        ``nbytes`` have been freed (or none are left); returns the bytes
        freed."""
        freed = ctypes.c_uint64()
        check(lib.laden_vram_free_memory(self._h, _size(nbytes, "nbytes"),
                                         ctypes.byref(freed)))
        return freed.value

    def info(self) -> Dict[str, int]:
        """Budget, bytes mapped / pinned / charged by activations, VBARs,
        faults, offloaded faults (and those failed fast at a watermark),
        pages mapped and evicted."""
        st = _lib.VramInfo()
        check(lib.laden_vram_info(self._h, ctypes.byref(st)))
        return {f: getattr(st, f) for f, _ in st._fields_}

    def close(self) -> None:
        """Detaches the elastic allocator and frees the context.  Refused
        (StateError) while VBARs use it: close the ModelVBARs, release()
        the models loaded with it and clear the ModelCaches on it first."""
        if not self._fin.alive:
            return
        n = self.info()["vbars"]
        if n:
            raise StateError(
                f"VRAM.close: {n} VBAR(s) still use the context (ModelVBARs, "
                "models loaded with stream_load(vram=...), ModelCache "
                "models); close, release or clear them first", "E_STATE")
        if self._alloc is not None:
            self._pool = None
            import torch
            torch.cuda.synchronize(self.device)
        self._fin()


def _close_vram(h, dev_index: int) -> None:
    lib.laden_elastic_attach(dev_index, None)
    lib.laden_vram_destroy(h)


def default_vram(device=None) -> VRAM:
    """The context ModelVBARs use when given none: one per device, no
    budget."""
    dev = _device(device)
    v = _DEFAULT.get(dev)
    if v is None or not v._fin.alive:
        v = _DEFAULT[dev] = VRAM(dev)
    return v


def free_memory(nbytes, device=None) -> int:
    """Evicts unpinned weight pages of the device's default context."""
    return default_vram(device).free_memory(nbytes)


@dataclass(eq=False)
class Weight:
    """A range of a VBAR handed out by ``alloc``.  ``signature`` is the
    caller's: set it to what ``fault`` returned when the weight was
    written."""

    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: object
    signature: Optional[int] = None
    _tensor: Optional[object] = field(default=None, repr=False)


class ModelVBAR:
    """A model's reserved range of device addresses.  Weights allocated
    first have priority within it; the VBAR created or prioritized last
    has priority over the others."""

    def __init__(self, size, device=None, *, vram: Optional[VRAM] = None):
        self.vram = vram if vram is not None else default_vram(device)
        if device is not None and _device(device) != self.vram.device:
            raise InvalidArgumentError(
                f"ModelVBAR: device {device} differs from the context's "
                f"{self.vram.device}", "E_INVAL")
        self.device = self.vram.device
        self._h = ctypes.c_void_p()
        check(lib.laden_vbar_create(self.vram._h, _size(size, "size"),
                                    ctypes.byref(self._h)))
        self._fin = weakref.finalize(self, lib.laden_vbar_destroy, self._h)
        self._vram_ref = self.vram  # the context outlives its VBARs
        info = self.info()
        self.base = info["base"]
        self.size = info["size_bytes"]

    def alloc(self, shape, dtype) -> Weight:
        """Hands out room for a tensor of ``shape`` and ``dtype``
        (256-byte aligned).  Nothing is mapped until ``fault``."""
        import torch

        shape = tuple(int(d) for d in (shape if isinstance(
            shape, (tuple, list, torch.Size)) else (shape,)))
        n = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            n *= d
        off = ctypes.c_uint64()
        check(lib.laden_vbar_alloc(self._h, n, ctypes.byref(off)))
        return Weight(off.value, n, shape, dtype)

    def _range(self, w) -> Tuple[int, int]:
        if isinstance(w, Weight):
            return w.offset, w.nbytes
        if isinstance(w, tuple) and len(w) == 2:
            return int(w[0]), int(w[1])
        raise InvalidArgumentError(
            f"give a Weight from alloc() or (offset, nbytes), not {w!r}",
            "E_INVAL")

    def fault(self, w) -> Optional[int]:
        """Makes the weight resident and pinned and returns its signature,
        or returns None if it is offloaded (stream it instead)."""
        off, n = self._range(w)
        res, sig = ctypes.c_int(), ctypes.c_uint64()
        check(lib.laden_vbar_fault(self._h, off, n, ctypes.byref(res),
                                   ctypes.byref(sig)))
        return sig.value if res.value else None

    def tensor(self, w: Weight):
        """The weight's tensor over the VBAR (valid while it is pinned by
        a fault; made once, on its first fault)."""
        if w._tensor is None:
            w._tensor = _view(self.base + w.offset, w.nbytes, w.dtype,
                              w.shape, self.device, self)
        return w._tensor

    def unpin(self, w) -> None:
        """Ends the weight's pin, after the work enqueued so far on the
        current stream: it may be evicted once that work is done."""
        off, n = self._range(w)
        check(lib.laden_vbar_unpin_after(self._h, off, n,
                                         _compute_stream(self.device)))

    def prioritize(self) -> None:
        """Most important VBAR of its context; its watermark is reset."""
        check(lib.laden_vbar_prioritize(self._h))

    def deprioritize(self) -> None:
        check(lib.laden_vbar_deprioritize(self._h))

    def set_floor(self, w) -> None:
        """Evictions never lower the watermark below this weight (or
        offset): weights before it keep trying to fault."""
        off = w.offset if isinstance(w, Weight) else int(w)
        check(lib.laden_vbar_set_floor(self._h, off))

    def free_memory(self, nbytes) -> int:
        return self.vram.free_memory(nbytes)

    @property
    def loaded_size(self) -> int:
        """Bytes of this VBAR mapped on the device now."""
        return self.info()["mapped_bytes"]

    def info(self) -> Dict[str, int]:
        st = _lib.VbarInfo()
        check(lib.laden_vbar_info(self._h, ctypes.byref(st)))
        return {f: getattr(st, f) for f, _ in st._fields_}

    def residency(self) -> List[int]:
        """Per page: 0 unmapped, 1 mapped, 2 mapped and pinned."""
        n = ctypes.c_uint32()
        check(lib.laden_vbar_residency(self._h, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_uint8 * max(n.value, 1))()
        check(lib.laden_vbar_residency(self._h, buf, n.value,
                                       ctypes.byref(n)))
        return list(buf[:n.value])

    def close(self) -> None:
        """Unmaps everything and releases the range."""
        self._fin()


def _check_pool_api(what: str):
    import torch

    if not hasattr(torch.cuda, "MemPool") or not hasattr(
            torch.cuda, "use_mem_pool"):
        raise DeviceError(
            f"{what} needs torch.cuda.MemPool (torch 2.6+); this is "
            f"torch {torch.__version__}", "E_UNSUPPORTED")


def _pluggable(vram: VRAM, what: str):
    """laden's allocator for PyTorch, serving ``vram``'s device (made and
    attached once per context)."""
    import torch

    if vram.device.type != "cuda":
        raise InvalidArgumentError(f"{what}: needs a CUDA device", "E_INVAL")
    _check_pool_api(what)
    if vram._alloc is None:
        check(lib.laden_elastic_attach(_dev_index(vram.device), vram._h))
        vram._alloc = torch.cuda.memory.CUDAPluggableAllocator(
            lib._name, "laden_elastic_malloc", "laden_elastic_free")
    return vram._alloc


def elastic_pool(vram: VRAM):
    """A ``torch.cuda.MemPool`` whose memory comes from laden within
    ``vram``'s budget: use it with ``torch.cuda.use_mem_pool(pool,
    device=vram.device)`` (without ``device`` torch routes the current
    device's allocations to it).
    When an allocation would exceed the budget, unpinned weights are
    evicted first; only then does PyTorch see an out-of-memory error.
    PyTorch keeps a live pool's segments: memory goes back to the weights
    only once the pool is gone.  ``elastic(vram)`` gives it back after
    every block of work."""
    import torch

    alloc = _pluggable(vram, "elastic_pool")
    if vram._pool is None:
        vram._pool = torch.cuda.MemPool(alloc.allocator())
    return vram._pool


@contextlib.contextmanager
def elastic(vram: VRAM):
    """Inside the block PyTorch's device allocations come from laden within
    ``vram``'s budget (unpinned weights give way before PyTorch sees an
    out-of-memory error); at its end the memory goes back to the budget,
    so weights can return to it.  Each use is a fresh ``MemPool``,
    released on exit and emptied with ``torch.cuda.empty_cache()`` (a
    device synchronize), because PyTorch keeps a live pool's segments.
    Tensors that outlive the block keep their memory until freed; laden
    keeps freed segments cached, charged to the budget, until a weight
    needs the room or another allocation reuses them.

        with laden.vbar.elastic(vram):
            y = model(x)
    """
    import torch

    alloc = _pluggable(vram, "elastic")
    pool = torch.cuda.MemPool(alloc.allocator())
    try:
        # The context's device, not the current one (torch's default).
        with torch.cuda.use_mem_pool(pool, device=vram.device):
            yield
    finally:
        del pool  # released: its free segments go back at empty_cache
        torch.cuda.empty_cache()


def install_elastic(vram: VRAM) -> None:
    """Makes laden the allocator of all of PyTorch's device memory in this
    process (``torch.cuda.memory.change_current_allocator``), within
    ``vram``'s budget.  Call it before anything is allocated on the device.
    PyTorch's pluggable allocator caches nothing itself: every free goes to
    laden at once, which keeps it cached for reuse and gives it to weights
    that fault back.  Caveat: when even evicting every unpinned weight
    cannot make room, PyTorch's pluggable allocator does not raise
    ``torch.OutOfMemoryError`` -- the tensor comes back without data and
    its first use raises a RuntimeError ("data is not allocated yet").
    ``elastic(vram)`` reports an out-of-memory error as usual.

    With several GPUs, call it once per device's context: the first call
    installs the allocator (for every device), the others attach their
    context to it.  A device with no context attached gets plain device
    memory from laden, without a budget."""
    import torch

    global _INSTALLED
    if vram.device.type != "cuda":
        raise InvalidArgumentError("install_elastic: needs a CUDA device",
                                   "E_INVAL")
    if vram._alloc is not None:
        raise StateError("install_elastic: the context serves a MemPool "
                         "already (elastic_pool / elastic)", "E_STATE")
    alloc = _INSTALLED
    if alloc is None:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            lib._name, "laden_elastic_malloc", "laden_elastic_free")
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise DeviceError(
                f"install_elastic: PyTorch has initialized CUDA in this "
                f"process already ({e}); call it first, or use elastic_pool",
                "E_STATE") from None
        _INSTALLED = alloc
    check(lib.laden_elastic_attach(_dev_index(vram.device), vram._h))
    vram._alloc = alloc


# laden's allocator once install_elastic made it PyTorch's (for every
# device; each device's context attaches to it).
_INSTALLED = None


def elastic_stats(device=None) -> Dict[str, int]:
    """Allocations, frees, reuses, failures; bytes in use, cached, peak;
    weight bytes evicted to make room."""
    st = _lib.ElasticStats()
    check(lib.laden_elastic_stats(_dev_index(_device(device)),
                                  ctypes.byref(st)))
    return {f: getattr(st, f) for f, _ in st._fields_}


def elastic_trim(device=None) -> None:
    """Frees the elastic allocator's cached blocks."""
    check(lib.laden_elastic_trim(_dev_index(_device(device))))


__all__ = ["VRAM", "ModelVBAR", "Weight", "default_vram", "free_memory",
           "elastic_pool", "install_elastic", "elastic_stats", "elastic_trim"]
