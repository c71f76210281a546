"""One model's state as laden holds it (``_Stream``): its C schedule, its
tensors and where each is bound, its compact tensors' stored bytes and
their values (read and expanded by C).  Below loading (``streaming``) and running from slots
(``offload``), which both use it."""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, List, Optional

from . import _lib
from ._bind import (_fp8_dtype, _make, _meta, _Owned, _set_run,
                    _set_tensor, _tensor_view, _view, tensor_layout,
                    tensor_value)
from ._describe import (BlockInfo, _destroy_schedule, _numel,
                        _Tensor, new_schedule)
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
        self.report = None  # the LoadReport stream_load returned
        self.load_seconds: Optional[float] = None
        self.training = False  # install_offload(train=True) is bound
        self.shared = None  # a sharing.Shared: the host copy is shared
        self.doors = None  # laden.doors.Doors: state_dict, copies, loads
        self.claimed: list = []  # modules claimed (laden.doors.claim)
        # stream_load(lossless_cache=dir): the directory
        self.lossless_cache_dir: Optional[str] = None

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
    def _slot_view(self, o: _Owned, t: _Tensor):
        """Streamed tensor t's view of its block's slot, tracked with the
        slots' views and named for what backward may find there."""
        value = _tensor_view(o, t, "run", self.device, self.slot_views)
        block = self.blocks[t.block].name if t.block >= 0 else ""
        self.gone[value.untyped_storage().data_ptr()] = block
        return value, block

    def rebind_slots(self) -> None:
        """After C laid the streamed blocks out again (taught their call
        order: laden_sched_learn_order), each streamed tensor runs from its
        block's new slot.  Between a block's enter and its binding: no
        block holds its slot views then."""
        o = self.live("bind")
        for b in self.blocks:
            if not lib.laden_sched_is_streamed(o.h, b.c_block):
                continue
            for t in b.tensors:
                if t.store == "plain" and t.run is not None:
                    t.run = _make(t, self._slot_view(o, t)[0], t.run_block)

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
            q = _stored_view(self, t)
            _set_tensor(t, q if q is not None else _meta(t))
            return
        if where == "home":
            value = _tensor_view(o, t, "home", None)
            _set_tensor(t, value if value is not None else _meta(t))
            return
        if not lib.laden_sched_is_streamed(o.h, t.c_block):
            _set_tensor(t, _tensor_view(o, t, "run", self.device, None))
            return
        value, block = self._slot_view(o, t)
        # The slot is bound only inside the block; outside, its host copy
        # (meta on the disk tier).  In training, backward enters the block
        # again (laden.training): its gradients are right, so nothing
        # refuses them.
        home = _tensor_view(o, t, "home", None)
        _set_run(t, value, home if home is not None else _meta(t),
                 None if self.training else block)


def _stored_view(state, t: _Tensor):
    """A compact tensor's stored bytes in its RAM home (fp8 codes, GGUF
    blocks, bf16), or None where it has none."""
    import torch

    if t.store == "lossless":  # its blob: no view has the tensor's shape
        return None
    o = state.live("bind")
    out = ctypes.c_void_p()
    check(lib.laden_sched_host_ptr(o.h, t.c_block, t.c_index,
                                   ctypes.byref(out)))
    if not out.value:
        return None
    nb, _, _ = tensor_layout(o.h, t.c_block, t.c_index)  # C's sizes
    cpu = torch.device("cpu")
    if t.store == "gq":  # the blocks as stored
        return _view(out.value, nb, torch.uint8, (nb,), cpu, o)
    if t.store == "c16":
        return _view(out.value, nb, torch.bfloat16, t.shape, cpu, o)
    dtype = _fp8_dtype(t.store_dtype if t.store == "ck8" else "F8_E4M3")
    return _view(out.value, _numel(t), dtype, t.shape, cpu, o)  # the codes


def _own_value(state: _Stream, t: _Tensor):
    """t's true value, for a state_dict entry whose module holds meta (a
    disk-tier tensor; a compact one, which exists expanded only inside
    its block): read and expanded by C from where it is kept
    (laden_sched_tensor_value).  A new CPU tensor, the caller's."""
    return tensor_value(state.live("state_dict").h, t)
