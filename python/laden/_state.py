"""One model's state as laden holds it (``_Stream``): its C schedule, its
tensors and where each is bound, and views of its compact tensors'
bytes.  Below loading (``streaming``) and running from slots
(``offload``), which both use it."""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, List, Optional

from . import _lib
from ._bind import (_fp8_dtype, _meta, _Owned, _set_run, _set_tensor,
                    _tensor_view, _view, tensor_layout)
from ._describe import (_DTYPE_CODE, BlockInfo, _destroy_schedule,
                        _dtype_code, _numel, _Tensor, new_schedule)
from ._expand import expand_fused
from ._lib import check, lib
from .checkpoint import Checkpoint
from .errors import StateError


class _Stream:
    """laden's state for one model: the C schedule and what is bound."""

    def __init__(self, device, path: Optional[str]):
        self.device = device
        self.path = path
        self.owner: Optional[_Owned] = None  # the schedule, until release
        self.blocks: List[BlockInfo] = []
        self.tensors: List[_Tensor] = []
        self.rest_bytes = 0
        self.kept: List[str] = []  # built, not in the checkpoint
        self.ckpt: Optional[Checkpoint] = None
        self.handle: Optional["OffloadHandle"] = None
        self.vram = None  # a laden.vbar.VRAM the schedule's memory is from
        self.name = "the model"
        self.hooks: list = []    # hook handles on disk-tier blocks
        self.gone: Dict[int, str] = {}  # storage address -> streamed block
        self.passes = threading.local()  # this thread's pass depth
        self.root = None  # (model, its previous forward, had its own)
        self.slot_views: list = []  # weakrefs to what views of slots hold
        self.kept_lookahead: Optional[int] = None  # slots remove() kept
        self.merged_for_good: set = set()  # merge_adapter's targets
        # A background load in progress: its progress bar (or None)
        # inside a one-element list; None once it has ended.
        self.loading: Optional[list] = None
        # Blocks must be awaited before they run: from the start of a
        # background load until it ends well (after a failure, for good:
        # every await raises the failure).
        self.awaiting = False
        self.load_t0 = 0.0
        self.load_seconds: Optional[float] = None
        self.training = False  # install_offload(train=True) is bound
        self.shared = None  # a sharing.Shared: the host copy is shared
        self.doors = None  # laden.doors.Doors: state_dict, copies, loads
        self.claimed: list = []  # modules claimed (laden.doors.claim)

    def create(self, ck, lookahead: int, vram=None) -> None:
        """Creates the C schedule, destroyed when the last tensor over its
        memory (or this state) lets go of it; `vram` (the context its
        memory comes from) outlives it."""
        h = new_schedule(self.device, ck, lookahead, name=self.name)
        self.vram = vram
        # What C may call or read until the schedule is destroyed (a
        # background load's progress callback and host sources): held by
        # the owner, which tensors over laden's memory keep alive.
        self.keep = []
        self.owner = _Owned(h, _destroy_schedule, None, vram, self.keep)

    def live(self, what: str) -> _Owned:
        """The schedule's owner, or StateError once the model was
        released.  Callers keep the returned object in a local while they
        call into C, so that the schedule outlives the call."""
        o = self.owner
        if o is None:
            raise StateError(
                f"{what}: {self.name} was released (laden.release); load it "
                "again with laden.stream_load", "E_STATE")
        return o

    def destroy(self) -> None:
        """Drops this state's hold on the schedule (freed now unless
        tensors taken from the model still use its memory) and closes the
        checkpoint."""
        self.owner = None
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None

    def stats(self, what: str = "stats") -> "_lib.SchedStats":
        o = self.live(what)
        st = _lib.SchedStats()
        check(lib.laden_sched_stats(o.h, ctypes.byref(st)))
        return st

    # -- binding parameters to laden memory --------------------------------
    def bind(self, t: _Tensor, where: str) -> None:
        """Points t at laden memory: 'run' (where the block runs from) or
        'home' (its RAM copy).  Disk-tier tensors have no home: they are
        on meta outside install_offload (a view of the checkpoint's pages
        would raise SIGBUS once the file is truncated)."""
        o = self.live("bind")
        if t.store == "gq":  # no view of its blocks has the tensor's shape
            _set_tensor(t, _meta(t))
            return
        if t.store != "plain":
            q, _ = _compact_views(self, t, "home")
            _set_tensor(t, q if q is not None else _meta(t))
            return
        if where == "home":
            value = _tensor_view(o, t, "home", None)
            _set_tensor(t, value if value is not None else _meta(t))
            return
        streamed = lib.laden_sched_is_streamed(o.h, t.c_block)
        value = _tensor_view(o, t, "run", self.device,
                             self.slot_views if streamed else None)
        if not streamed:
            _set_tensor(t, value)
            return
        block = self.blocks[t.block].name if t.block >= 0 else ""
        self.gone[value.untyped_storage().data_ptr()] = block
        # The slot is bound only inside the block; outside, its host copy
        # (meta on the disk tier).  In training, backward enters the block
        # again (laden.training): its gradients are right, so nothing
        # refuses them.
        home = _tensor_view(o, t, "home", None)
        _set_run(t, value, home if home is not None else _meta(t),
                 None if self.training else block)


def _compact_views(state, t: _Tensor, where: str):
    """Views of a compact tensor's bytes: the fp8 data and its scale (or
    None), where the block runs ('run') or in its RAM home ('home')."""
    import torch

    fetch = lib.laden_sched_tensor_ptr if where == "run" else \
        lib.laden_sched_host_ptr
    dev = state.device if where == "run" else torch.device("cpu")
    o = state.live("bind")
    track = state.slot_views if where == "run" else None

    def ptr(index):
        out = ctypes.c_uint64() if where == "run" else ctypes.c_void_p()
        check(fetch(o.h, t.c_block, index, ctypes.byref(out)))
        return out.value or 0

    base = ptr(t.c_index)
    if not base:
        return None, None
    nb, off, rows = tensor_layout(o.h, t.c_block, t.c_index)  # C's sizes
    if t.store == "gq":  # the blocks as stored
        return _view(base, nb, torch.uint8, (nb,), dev, o, track), None
    if t.store == "c16":
        return _view(base, nb, torch.bfloat16, t.shape, dev, o, track), None
    q = _view(base, _numel(t), _fp8_dtype(t.store_dtype if t.store == "ck8"
                                          else "F8_E4M3"), t.shape, dev, o,
              track)
    if t.store == "q8":  # the row scales after the codes, where C put them
        scale = _view(base + off, 4 * rows, torch.float32, (rows,), dev, o,
                      track)
    elif t.scale_name:
        info = state.ckpt.info(t.scale_name)
        scale = _view(ptr(t.scale_index), info.nbytes, info.torch_dtype,
                      info.shape, dev, o, track)
    else:
        scale = None
    return q, scale


def _own_value(state: _Stream, t: _Tensor):
    """t's true value, for a state_dict entry whose module holds meta: a
    disk-tier tensor read from the checkpoint; a compact one (fp8, GGUF
    blocks, bf16 storage) expanded by C on the host from its stored bytes,
    as the forward expands it.  A new CPU tensor, the caller's."""
    import torch

    o = state.live("state_dict")
    ck = state.ckpt
    if t.store == "plain":
        if ck is None or t.ckpt_name is None:
            raise StateError(
                f"state_dict of {state.name}: '{t.names[0]}' has no value in "
                "memory and no checkpoint to read it from", "E_STATE")
        v = ck.tensor(t.ckpt_name)
        if v.dtype != t.dtype:
            v = v.to(t.dtype)
        return _local_part(t, v)
    q, sc = _compact_views(state, t, "home")
    if q is None:
        run = lib.laden_sched_is_streamed(o.h, t.c_block) == 0
        if run:  # resident on the device: its own region, not a slot
            q, sc = _compact_views(state, t, "run")
            q = q.cpu()
            sc = sc.cpu() if sc is not None else None
        else:  # on the disk tier: the stored bytes from the checkpoint
            q, sc = _stored_compact(state, t)
    out = torch.empty(t.shape, dtype=t.dtype)
    if t.store == "gq":
        code = _DTYPE_CODE[t.store_dtype]
    else:
        code = _dtype_code(q.dtype, t)
    expand_fused(out, q, sc, t.scale_kind, code, _dtype_code(t.dtype, t),
                 torch.device("cpu"))()
    return out


def _stored_compact(state: _Stream, t: _Tensor):
    """A disk-tier compact tensor's stored bytes (and scale), read from
    the checkpoint into host memory, viewed as _compact_views gives them."""
    import torch

    ck = state.ckpt
    info = ck.info(t.ckpt_name)
    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    ck.read_into(t.ckpt_name, raw)
    if t.store == "gq":
        return raw, None
    if t.store == "c16":
        return raw.view(torch.bfloat16).view(t.shape), None
    q = raw.view(_fp8_dtype(t.store_dtype if t.store == "ck8" else
                            "F8_E4M3")).view(t.shape)
    scale = ck.tensor(t.scale_name) if t.scale_name else None
    return q, scale


def _local_part(t: _Tensor, v):
    """A whole checkpoint tensor cut to this rank's shard (a DTensor's
    local tensor), as laden loaded it."""
    if t.dist is None or t.dist.dim is None:
        return v
    return v.narrow(t.dist.dim, t.dist.start, t.dist.count).contiguous()
