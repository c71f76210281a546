"""Tensors over memory laden owns (no copy), and a model's parameters and
buffers pointed at them: for good, or, for memory other blocks reuse (a
slot, the expansion workspace), only between its block's enter and exit.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional, Tuple

from . import _wrapped
from ._describe import _dtype_code, _Tensor
from ._lib import check, lib
from ._wrapped import is_dtensor, refresh
from .errors import StateError


class _Owned:
    """One C object (a schedule, a cache, device memory) and its
    destructor.  Every tensor over its memory holds this object, and this
    object holds nothing that holds a module: dropping a model then frees
    its memory by reference counting, and tensors taken from it keep the
    memory valid for as long as they live (no cycle through a C++ storage,
    which Python's collector cannot see, keeps a model alive for good).
    ``keep`` are objects that must outlive the C object (a VRAM context)."""

    __slots__ = ("h", "_fin", "__weakref__")

    def __init__(self, h, destroy, *keep):
        self.h = h
        self._fin = weakref.finalize(self, destroy, h, *keep)


class _CudaMemory:
    """Device memory owned by a schedule, as torch sees it.  Holds the
    memory's owner (an _Owned), so the memory lives while any view of it
    does."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 3}
        self.owner = owner


def _view(ptr: int, nbytes: int, dtype, shape, device, owner, track=None):
    """A tensor over memory laden owns (no copy).  With `track` (a list), a
    weakref is appended that dies when the last tensor sharing this view's
    storage (the view, and anything derived from it) is gone."""
    import torch

    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cuda":
        buf = _CudaMemory(ptr, nbytes, owner)
        with torch.cuda.device(device):
            flat = torch.as_tensor(buf, device=device)
    else:
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf._laden_owner = owner
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    if track is not None:
        track.append(weakref.ref(buf))
    return flat.view(dtype).view(shape)


def tensor_layout(h, block: int, index: int) -> Tuple[int, int, int]:
    """C's layout of a tensor of schedule `h` (laden_sched_tensor_layout):
    its bytes as kept, where its float32 row scales start in them (0:
    none) and how many there are."""
    size, off, rows = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.laden_sched_tensor_layout(h, block, index, ctypes.byref(size),
                                        ctypes.byref(off),
                                        ctypes.byref(rows)))
    return size.value, off.value, rows.value


def _tensor_view(owner, t, where: str, device, track=None, nbytes=None):
    """A tensor over t's bytes in the schedule `owner` holds: 'run' (the
    device address its block runs from; `device`), or 'home' (its host
    copy, None when it has none: the disk tier).  Its length is C's
    unless `nbytes` says (a cache's device copy holds a lossless tensor
    decoded)."""
    import torch

    if nbytes is None:
        nbytes = tensor_layout(owner.h, t.c_block, t.c_index)[0]
    if where == "run":
        p = ctypes.c_uint64()
        check(lib.laden_sched_tensor_ptr(owner.h, t.c_block, t.c_index,
                                         ctypes.byref(p)))
        return _view(p.value, nbytes, t.dtype, t.shape, device, owner,
                     track)
    hp = ctypes.c_void_p()
    check(lib.laden_sched_host_ptr(owner.h, t.c_block, t.c_index,
                                   ctypes.byref(hp)))
    return _view(hp.value, nbytes, t.dtype, t.shape,
                 torch.device("cpu"), owner) if hp.value else None


def expanded_view(owner, t, device, track=None):
    """Where C expands compact tensor t while its block runs
    (laden_sched_expanded_at: the workspace)."""
    p, n = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.laden_sched_expanded_at(owner.h, t.c_block, t.c_index,
                                      ctypes.byref(p), ctypes.byref(n)))
    return _view(p.value, n.value, t.dtype, t.shape, device, owner, track)


def tensor_value(h, t):
    """t's value as its block computes with it, read and expanded (or
    decoded) by C from where it is kept (laden_sched_tensor_value): a new
    CPU tensor, the caller's."""
    import torch

    out = torch.empty(t.shape, dtype=t.dtype)
    check(lib.laden_sched_tensor_value(
        h, t.c_block, t.c_index, _dtype_code(t.dtype, t),
        ctypes.c_void_p(out.data_ptr()), out.numel() * out.element_size()))
    return out


def _meta(t: _Tensor):
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _swap(old, new) -> bool:
    """Gives the tensor object `old` the contents of `new`, so that every
    reference to `old` (held by the user, an optimizer, tied modules)
    follows laden's memory as it moves, and nothing keeps pointing at
    memory laden gave back.  False where torch refuses (weakrefs)."""
    import torch

    try:
        torch.utils.swap_tensors(old, new)
        return True
    except (RuntimeError, TypeError, AttributeError):
        return False


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor
    return DTensor


def _make(t: _Tensor, value, streamed_in: Optional[str] = None):
    """The tensor object t's aliases get for `value`: a Parameter
    following the user's requires_grad, a DTensor around a shard."""
    import torch

    if t.dist is not None and not is_dtensor(value):
        d = t.dist
        from_local = _dtensor_cls().from_local
        value = from_local(value, d.mesh, d.placements, run_check=False,
                           shape=torch.Size(d.shape), stride=d.stride)
    if not t.is_param:
        return value.detach()
    # The user may have frozen or unfrozen it since it was loaded.
    rg = t.param.requires_grad if t.param is not None else t.requires_grad
    new = torch.nn.Parameter(
        value, requires_grad=rg and value.dtype.is_floating_point)
    if streamed_in is not None and new.requires_grad:
        new.register_hook(_refuse_grad(t.names[0], streamed_in))
        new._laden_refusing = True
    return new


def _set_tensor(t: _Tensor, value, streamed_in: Optional[str] = None
                ) -> None:
    """Points every alias of t at `value`, for good (no run binding).
    The tensor object laden made for t keeps its identity (its contents
    are swapped); `streamed_in` names the block whose slot or workspace
    `value` is in: a gradient for it would be wrong, so computing one
    raises."""
    t.run = t.run_block = None
    new = _make(t, value, streamed_in)
    if t.param is not None and t.param.__class__ is new.__class__ and \
            _swap(t.param, new):
        new = t.param
    t.param = new
    table = "_parameters" if t.is_param else "_buffers"
    for mod, attr in t.aliases:
        getattr(mod, table)[attr] = new
        refresh(mod)  # a quantized wrapper's inner tensor: rebuilt


def _set_run(t: _Tensor, value, home, streamed_in: Optional[str]) -> None:
    """t runs from `value`, memory other blocks reuse (a slot, the
    expansion workspace), bound into its modules only inside its block
    (bind_in); outside, they hold `home` (its host copy; meta where it has
    none), so that state_dict(), parameters() and attribute reads never
    see another block's bytes.  `streamed_in`: see _set_tensor."""
    _set_tensor(t, home)
    t.run = _make(t, value, streamed_in)
    t.run_block = streamed_in


def bind_in(ts, grad: bool) -> None:
    """Between a block's enter and exit: its modules hold what it runs
    from.  With gradients on, each run tensor follows its own tensor's
    requires_grad (the user may freeze the parameters they can see)."""
    for t in ts:
        r = t.run
        if r is None:
            continue
        if grad and t.is_param and r.requires_grad != t.param.requires_grad:
            _follow_grad(t, r)
        _put(t, r)


def bind_out(ts) -> None:
    """After a block's exit: its modules hold each tensor's own value
    again."""
    for t in ts:
        if t.run is not None:
            _put(t, t.param)


def _put(t: "_Tensor", value) -> None:
    """Every module that holds t (its aliases) holds `value` as it."""
    slots = "_parameters" if t.is_param else "_buffers"
    for mod, attr in t.aliases:
        getattr(mod, slots)[attr] = value
    if _wrapped._HOLDER is not None:
        for mod, _ in t.aliases:
            refresh(mod)


def _follow_grad(t: _Tensor, r) -> None:
    want = t.param.requires_grad and r.dtype.is_floating_point
    r.requires_grad_(want)
    if want and t.run_block is not None and \
            not getattr(r, "_laden_refusing", False):
        r.register_hook(_refuse_grad(t.names[0], t.run_block))
        r._laden_refusing = True


def run_of(t: _Tensor):
    """The tensor object t's block computes with: where adapters merge
    and gradients land."""
    return t.run if t.run is not None else t.param


def _training_error(what: str) -> StateError:
    return StateError(
        f"backward through {what}: laden streamed its weights through "
        "device memory that later blocks have overwritten, so its gradient "
        "would be wrong. To train through streamed blocks, load the model "
        "with laden.stream_load and call laden.install_offload(model, "
        "train=True) (a ModelCache model: ModelSpec(trainable=True)); for "
        "inference run the forward under torch.no_grad() or "
        "torch.inference_mode(); or keep the blocks that need gradients "
        "resident (resident_prefixes)", "E_STATE")


def _refuse_grad(name: str, block: str):
    def hook(grad):
        raise _training_error(f"parameter '{name}' of streamed block "
                              f"'{block}'")
    return hook


def _fp8_dtype(name: Optional[str]):
    import torch

    return torch.float8_e5m2 if name == "F8_E5M2" else torch.float8_e4m3fn
