"""Models kept ready between uses: ``ModelCache``, ``ModelSpec`` and
``ModelOffloader`` (the piper-offload surface).

Python's part is attachment only.  A model is built by its factory, its
tensors are handed to a C schedule (``LADEN_SCHED_CACHE``) that packs them
into host memory per block, and its parameters are pointed at that memory.
Every decision after that -- whole model or streaming, which blocks get a
device copy, which idle models give way, what is pinned -- is the C cache
engine's (``include/laden/cache.h``); Python calls it at the start and end
of each use and re-points the parameters of the models whose addresses
changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, \
    Union

from . import _lib, doors, planning, sharing
from ._lib import LOOKAHEAD_DEFAULT as LOOKAHEAD
from ._lib import check, error_for, lib
from ._units import fmt_bytes, parse_size
from ._wrapped import detach_all
from .adapters import _CacheAdapters, _HostAdapters
from .training import _CacheTrainer, materialize_peft
from .checkpoint import Checkpoint, PathLike
from .errors import InvalidArgumentError, StateError
from ._bind import (_meta, _Owned, _set_run, _set_tensor, _tensor_view,
                    expanded_view, run_of, tensor_value)
from ._describe import (KeyMap, _destroy_schedule, _nbytes, _Tensor,
                        check_lookahead, describe, fill, new_schedule,
                        progress_to)
from ._devices import _compute_stream, _dev_index, _device
from ._hooks import _unwrap_all, _wrap_forward, relaid_check

log = logging.getLogger("laden")

BLOCK_MODES = {"auto": _lib.CACHE_AUTO, "resident": _lib.CACHE_RESIDENT,
               "streaming": _lib.CACHE_STREAMING}
_MODE_NAMES = {_lib.CACHE_RESIDENT: "resident",
               _lib.CACHE_STREAMING: "streaming"}


class _FrozenMap(dict):
    """A key_map given as a mapping, copied and hashable."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _refuse(self, *a, **k):
        raise TypeError("a ModelSpec's key_map cannot be changed")

    __setitem__ = __delitem__ = update = pop = clear = setdefault = _refuse


class ModelNotFoundError(StateError, KeyError):
    """No model is registered under the key."""

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and how to run it.

    ``factory()`` returns a ``torch.nn.Module`` built on the CPU (its
    storage is taken over by laden) or on ``meta`` with ``checkpoint``
    naming a safetensors file, index or directory whose tensor names are the
    model's (read by laden's reader, converted between float32, float16
    and bfloat16 to the dtypes the model was built with).  ``key_map``
    (checkpoint name -> model name: a dict, or a function returning None
    to drop a name) and ``skip_prefixes`` (checkpoint names to ignore)
    match a checkpoint whose names differ, as in ``stream_load``.  Tensors
    the checkpoint lacks are taken as the factory built them (not on
    meta).  ``block_paths``
    names the block lists (``"transformer_blocks"``) that may be streamed
    when the model does not fit; ``block_mode`` is ``"auto"`` (whole model
    on the device when it fits the budget, else streaming), ``"resident"``
    or ``"streaming"`` (every block streamed, only the parts outside blocks
    resident).  ``estimated_bytes`` lets the cache make room in RAM before
    the first build.  ``shared=True``: the model's host copy is shared
    with the host's other processes that load the same checkpoint the same
    way (see ``laden.stream_load``); every tensor must then come from
    ``checkpoint``.

    ``compression="lossless"``: the BF16 and F16 weights are kept
    entropy-coded in the model's host copy (about 0.67 of their bytes for
    bf16 weights; those that do not code below 15/16 stay as they are),
    cross the link coded, and are decoded on the device: into a device
    copy as it is uploaded (a resident block runs at full speed), or at
    each call of a block that streams.  Every value is the one stored.
    ``lossless_cache`` names a directory where ``laden.compress`` wrote
    the checkpoint's coded weights (default ``LADEN_LOSSLESS_CACHE``):
    they are read instead of encoded.  Outside a use the coded weights
    are on ``meta`` (their host copy is coded); ``state_dict()`` decodes
    them.  Not with ``trainable`` or ``shared`` yet.

    ``trainable=True``: the model trains in the cache.  Every parameter
    the factory left ``requires_grad`` trains through its host copy,
    which is then the only copy of its weights: ``cache.parameters(key)``
    gives those host copies (with their ``.grad`` after a backward) for
    the optimizer, the next forward computes with what it stepped, and
    the cache never drops the model from RAM to make room (it evicts only
    device copies, which never hold anything the host copy lacks).
    Streamed blocks are checkpointed and entered again in backward, as
    ``install_offload(train=True)`` does; run backward inside the
    ``cache.use`` that ran the forward.  Freeze the base in the factory
    (``requires_grad_(False)``) to train only adapters (peft's LoRA
    modules).  ``clear()`` refuses while a trainable model holds stepped
    weights; ``unregister(key)`` drops them for good."""

    key: str
    factory: Callable[[], Any]
    checkpoint: Optional[PathLike] = field(default=None, kw_only=True)
    block_paths: Sequence[str] = field(default=(), kw_only=True)
    block_mode: str = field(default="auto", kw_only=True)
    estimated_bytes: int = field(default=0, kw_only=True)
    key_map: KeyMap = field(default=None, kw_only=True)
    skip_prefixes: Sequence[str] = field(default=(), kw_only=True)
    shared: bool = field(default=False, kw_only=True)
    trainable: bool = field(default=False, kw_only=True)
    compression: Optional[str] = field(default=None, kw_only=True)
    lossless_cache: Optional[PathLike] = field(default=None, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            raise InvalidArgumentError(
                f"ModelSpec key {self.key!r}: give a non-empty string",
                "E_INVAL")
        if not callable(self.factory):
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': factory {self.factory!r} is not "
                "callable", "E_INVAL")
        if self.block_mode not in BLOCK_MODES:
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': block_mode {self.block_mode!r}; "
                f"use one of {', '.join(BLOCK_MODES)}", "E_INVAL")
        paths = self.block_paths
        if isinstance(paths, str):
            paths = (paths,)
        paths = tuple(paths)
        if not all(isinstance(p, str) and p for p in paths):
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': block_paths must be module paths "
                f"(strings), got {self.block_paths!r}", "E_INVAL")
        object.__setattr__(self, "block_paths", paths)
        skip = self.skip_prefixes
        skip = (skip,) if isinstance(skip, str) else tuple(skip or ())
        if not all(isinstance(p, str) and p for p in skip):
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': skip_prefixes must be strings, "
                f"got {self.skip_prefixes!r}", "E_INVAL")
        object.__setattr__(self, "skip_prefixes", skip)
        if not isinstance(self.shared, bool):
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': shared must be True or False, got "
                f"{self.shared!r}", "E_INVAL")
        if not isinstance(self.trainable, bool):
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': trainable must be True or False, "
                f"got {self.trainable!r}", "E_INVAL")
        if self.trainable and self.shared:
            raise InvalidArgumentError(
                f"ModelSpec '{self.key}': trainable=True with shared=True: "
                "a host copy shared with other processes is never written, "
                "and a trainable model's optimizer writes its host copy",
                "E_INVAL")
        where = f"ModelSpec '{self.key}'"
        object.__setattr__(self, "lossless_cache", planning.lossless_cache_dir(
            self.compression, self.lossless_cache, where))
        if self.compression and (self.trainable or self.shared):
            raise InvalidArgumentError(
                f"{where}: compression={self.compression!r} with "
                + ("trainable=True: the optimizer steps the host copy, "
                   "which is coded" if self.trainable else
                   "shared=True: a shared host copy is kept as stored")
                + " (not supported yet)", "E_UNSUPPORTED")
        km = self.key_map
        if km is not None and not callable(km):
            if not hasattr(km, "get"):
                raise InvalidArgumentError(
                    f"ModelSpec '{self.key}': key_map must be a mapping or a "
                    f"function, got {type(km).__name__}", "E_INVAL")
            # A mapping is frozen, so that two specs compare by content.
            object.__setattr__(self, "key_map", _FrozenMap(km))
        try:
            est = parse_size(self.estimated_bytes)
        except ValueError as e:
            raise InvalidArgumentError(f"ModelSpec '{self.key}': {e}",
                                       "E_INVAL") from None
        object.__setattr__(self, "estimated_bytes", est)


@dataclass
class CacheInfo:
    """Where a cached model's weights are now (bytes)."""

    key: str
    device: Optional[str]   # where it runs; None before its first use
    size_bytes: int         # its weights as laden keeps them
    vram_bytes: int         # on the device (device copies and slots)
    pinned_bytes: int       # host copy, pinned
    pageable_bytes: int     # host copy, not pinned
    disk_bytes: int         # only in the checkpoint (re-read on next use)
    uses: int
    last_use: Optional[float]  # time.time() when its last use ended
    in_use: bool
    mode: Optional[str]     # "resident" or "streaming" at its last use
    # A laden.sharing.Shared if its host copy is shared (ModelSpec shared)
    shared: Optional[Any] = None
    # compression="lossless": (coded bytes, their raw bytes) of the weights
    # kept coded in the host copy
    lossless: Optional[tuple] = None


def _budget(value, what: str) -> Optional[int]:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise InvalidArgumentError(f"{what}: {e}", "E_INVAL") from None


class _Runtime:
    """One built model on one device: its C schedule and what is bound."""

    def __init__(self, spec: ModelSpec, device, dc: "_DeviceCache"):
        self.spec = spec
        self.device = device
        self.dc = dc
        self.model = None
        # The schedule: destroyed when the last tensor over its memory and
        # this runtime let go of it; `binding` is its (cache, id) in the C
        # cache while bound, for the destructor to unbind it first.
        self.owner: Optional[_Owned] = None
        self.binding: list = [None]
        self.block_names: Dict[int, str] = {}
        self.gone: Dict[int, str] = {}  # storage address -> streamed block
        # id(tensor) -> its storage's use count when bound on the device:
        # more means a tensor derived from it (a view, state_dict()) lives.
        self.dev_refs: Dict[int, int] = {}
        self.tensors: List[_Tensor] = []
        self.fixed = 0
        self.gen = -1
        self.shared = None  # a sharing.Shared once loaded shared
        self.id: Optional[int] = None
        self.wrapped: List[tuple] = []
        self.size = 0
        self.in_use = False
        self.mode: Optional[int] = None
        self.adapters = None  # adapters._CacheAdapters, once asked for
        self.uses = 0
        self.last_use: Optional[float] = None
        self.doors = None  # laden.doors.Doors once built
        self.claimed: list = []
        self.trainer = None  # training._CacheTrainer for a trainable spec

    # -- building ------------------------------------------------------------
    def build(self, model=None) -> None:
        import torch

        spec = self.spec
        adopted = model is not None
        if model is None:
            model = spec.factory()
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"the factory of '{spec.key}' returned "
                f"{type(model).__name__}, not a torch.nn.Module", "E_INVAL")
        doors.refuse_owned(model, f"ModelCache model '{spec.key}'")
        if not adopted and spec.checkpoint is not None:
            # peft's factors over a base on meta: no checkpoint has them.
            materialize_peft(model, torch.device("cpu"))
        ck = Checkpoint(spec.checkpoint) if spec.checkpoint is not None \
            else None
        try:
            desc = describe(model, ck, spec.block_paths,
                            key_map=spec.key_map,
                            skip_prefixes=spec.skip_prefixes, compact=False,
                            label=f"model '{spec.key}'")
            for b in desc.blocks:
                b.tier = _lib.TIER_RAM
            self._load(desc, ck)
        finally:
            if ck is not None:
                ck.close()
        self.model = model
        self.tensors = desc.tensors
        if spec.trainable:
            self.trainer = _CacheTrainer(self)
        for b in desc.blocks:
            self.block_names[b.c_block] = b.name
            self._wrap(b.module, b.c_block)
        if self.trainer is not None:
            try:
                self.trainer.attach(self.owner)
            except BaseException:
                self.destroy(restore=adopted)
                raise
            tr = self.trainer
            # What an optimizer stepped reaches the device before the
            # parts outside blocks run (blocks check at their own call).
            self.wrapped.append(("hook", model.register_forward_pre_hook(
                lambda mod, args: tr.sync() if self.in_use else None),
                None))
        mods = [(model, "")] + [(b.module, b.name) for b in desc.blocks]
        self.doors = doors.Doors(
            f"model '{spec.key}'", desc.tensors,
            lambda t: self._value(t), mods)
        self.claimed = [m for m, _ in mods]
        doors.claim(self.claimed, f"ModelCache model '{spec.key}'")
        st = self.stats()
        self.size = sum(lib.laden_sched_block_bytes(self.sched, b)
                        for b in range(lib.laden_sched_block_count(
                            self.sched)))
        self.gen = st.generation

    @property
    def sched(self) -> ctypes.c_void_p:
        if self.owner is None:
            raise StateError(f"model '{self.spec.key}' was dropped from the "
                             "cache", "E_STATE")
        return self.owner.h

    def _load(self, desc, ck) -> None:
        h = new_schedule(self.device, ck, flags=_lib.SCHED_CACHE,
                         name=self.spec.key)
        # The VRAM context (if any) outlives the VBAR the schedule keeps
        # in it.
        self.owner = _Owned(h, _destroy_schedule, self.binding, self.dc.vram)
        groups: List[List[_Tensor]] = []
        done = 0  # groups whose tensors point at laden's copy
        try:
            # The parts outside blocks in pieces, so that a model gives up
            # device memory in steps; then one per block.
            groups = fill(self.sched, desc, ck, _lib.TIER_RAM,
                          rest_in_pieces=True)
            self.fixed = len(groups) - len(desc.blocks)
            if self.spec.compression:
                if self.device.type == "cpu":
                    log.warning(
                        "laden: model '%s' with compression=%r on the CPU "
                        "device: its resident blocks run from decoded copies "
                        "beside the coded host copy (more RAM than without "
                        "compression, not less); compression pays where "
                        "weights cross a link to a GPU", self.spec.key,
                        self.spec.compression)
                planning.mark_lossless(self.sched, self.spec.lossless_cache)
            from_ckpt = all(t.ckpt_name is not None for t in desc.tensors)
            if self.spec.shared:
                if not from_ckpt:
                    raise InvalidArgumentError(
                        f"model '{self.spec.key}': shared=True needs every "
                        "tensor from the checkpoint (these are not in it: "
                        + ", ".join(t.name for t in desc.tensors
                                    if t.ckpt_name is None)[:300] + ")",
                        "E_INVAL")
                sharing.ask(self.sched, True, f"model '{self.spec.key}'")
            with progress_to(self.sched, self.spec.key, None) as pt:
                if from_ckpt:
                    # All from the checkpoint: one load, several blocks'
                    # reads in flight.
                    check(lib.laden_sched_load(self.sched))
                    done = len(groups)
                    self._mark_coded(desc.tensors)
                    for t in desc.tensors:
                        _set_tensor(t, self._home(t))
                else:
                    # Block by block: each block's tensors are pointed at
                    # laden's copy as soon as it is made, so the factory's
                    # storage is freed as the copy proceeds (host memory
                    # peaks at the model plus a block, not twice it).
                    for b, ts in enumerate(groups):
                        check(lib.laden_sched_load_block(self.sched, b))
                        if b == 0:  # the first encodes them all
                            self._mark_coded(desc.tensors)
                        for t in ts:
                            t.source = None
                            _set_tensor(t, self._home(t))
                        done = b + 1
                        pt.check()
            self.shared = sharing.info(self.sched, f"model '{self.spec.key}'")
            if self.dc.vram is not None:
                check(lib.laden_sched_use_vram(self.sched,
                                               self.dc.vram._h))
        except BaseException:
            # Tensors pointing at laden's copy get their bytes back before
            # the schedule goes.
            for ts in groups[:done]:
                for t in ts:
                    _set_tensor(t, self._value(t))
            self.owner = None
            raise
        finally:
            for t in desc.tensors:
                t.source = None

    # -- binding -----------------------------------------------------------------
    def _host_view(self, t: _Tensor):
        return _tensor_view(self.owner, t, "home", None)

    def _mark_coded(self, tensors) -> None:
        """The tensors C keeps lossless (known once the load began)."""
        for t in tensors if self.spec.compression else ():
            if lib.laden_sched_tensor_lossless(self.sched, t.c_block,
                                               t.c_index):
                t.store = "lossless"

    def _home(self, t: _Tensor):
        """What t's modules hold outside a use: its host copy, or meta for
        a tensor kept lossless (its host copy is its blob)."""
        return _meta(t) if t.store == "lossless" else self._host_view(t)

    def _value(self, t: _Tensor):
        """t's value in a CPU tensor of its own (decoded by C when kept
        lossless)."""
        if t.store != "lossless":
            return self._host_view(t).clone()
        return tensor_value(self.sched, t)

    def _decoded(self, t: _Tensor, streamed: bool):
        """Where lossless tensor t is decoded on the device: the expansion
        workspace while a streamed block runs, else its block's device
        copy (decoded: the tensor's own size, not its blob's)."""
        if streamed:
            return expanded_view(self.owner, t, self.device)
        return _tensor_view(self.owner, t, "run", self.device,
                            nbytes=_nbytes(t))

    def rebind(self) -> bool:
        """Points every tensor where it is now: its block's device copy or
        slot, else its host copy.  Only if an address changed."""
        st = self.stats()
        if st.generation == self.gen:
            return False
        started = st.nslots > 0
        o = self.owner
        self.gone.clear()
        self.dev_refs.clear()
        counted = []
        for t in self.tensors:
            streamed = started and lib.laden_sched_is_streamed(o.h,
                                                                t.c_block)
            on_dev = streamed or lib.laden_sched_is_resident(o.h, t.c_block)
            if t.store == "lossless":
                value = self._decoded(t, streamed) if on_dev else _meta(t)
            else:
                value = _tensor_view(o, t, "run" if on_dev else "home",
                                     self.device)
            if streamed:
                block = self.block_names.get(
                    t.c_block, f"part {t.c_block} of the rest")
                self.gone[value.untyped_storage().data_ptr()] = block
                # The slot only inside its block; outside, the host copy.
                # A trainable model's backward enters the block again: its
                # gradients are right, so nothing refuses them.
                _set_run(t, value, self._home(t),
                         None if self.trainer is not None else block)
            else:
                _set_tensor(t, value)
            del value  # counted otherwise
            if on_dev and _USE_COUNT:
                counted.append(t)
        # Counted once every tensor is in place: a quantized wrapper,
        # rebuilt as its inner tensors move, holds each of them too.
        for t in counted:
            self.dev_refs[id(t)] = _storage_refs(run_of(t))
        self.gen = st.generation
        if self.trainer is not None:
            self.trainer.rehook()  # on the tensors it computes with now
        return True

    def derived(self) -> Optional[str]:
        """The name of a tensor of this model on the device whose memory a
        tensor derived from it (a view, ``.detach()``, a ``state_dict()``
        entry) still uses, or None.  Such memory must not be freed."""
        if not self.dev_refs:
            return None
        for t in self.tensors:
            base = self.dev_refs.get(id(t))
            if base is not None and _storage_refs(run_of(t)) > base:
                return t.names[0]
        return None

    def _wrap(self, mod, c_block: int) -> None:
        rt = self

        def guard():
            if not rt.in_use:
                raise StateError(
                    f"model '{rt.spec.key}' runs only inside "
                    "cache.use(...) or between activate() and deactivate()",
                    "E_STATE")

        def after_enter(c):
            if rt.adapters is not None:
                rt.adapters.after_enter(c)

        mine = [t for t in self.tensors if t.c_block == c_block]
        if getattr(self, "relaid", None) is None:
            self.relaid = relaid_check(self.owner, self.rebind)
        _wrap_forward(mod, self.owner, c_block, self.device, self.wrapped,
                      guard=guard, gone=self.gone, after_enter=after_enter,
                      slot_tensors=mine, binds=mine, relaid=self.relaid,
                      trainer=self.trainer)

    def lossless(self) -> Optional[tuple]:
        st = self.stats()
        return (st.lossless_bytes, st.lossless_raw_bytes) \
            if st.lossless_raw_bytes else None

    def stats(self) -> "_lib.SchedStats":
        st = _lib.SchedStats()
        check(lib.laden_sched_stats(self.sched, ctypes.byref(st)))
        return st

    # -- ending ------------------------------------------------------------------
    def destroy(self, restore: bool) -> None:
        """Frees the schedule.  The model's tensors become ordinary CPU
        tensors (restore: copied out of laden's memory) or meta."""
        import torch

        _unwrap_all(self.wrapped)
        if self.trainer is not None:
            self.trainer.close()  # the host Parameters keep their memory
            self.trainer = None
        if self.doors is not None:
            self.doors.close()
            self.doors = None
        doors.unclaim(self.claimed)
        self.claimed = []
        self.gone.clear()
        for t in self.tensors:
            _set_tensor(t, self._value(t) if restore else _meta(t))
        if restore and self.model is not None:
            detach_all(self.model)  # handed back: plain wrappers again
        if self.device.type == "cuda":
            # Its kernels must be done with the memory before it goes (a
            # VBAR's pages are unmapped without the wait of a free).
            torch.cuda.synchronize(self.device)
        self.owner = None  # freed now unless tensors taken from it live on
        self.tensors = []
        self.model = None


# How many tensors share a storage.  torch has it in every build we know of
# since 2.1; without it the check for derived tensors is skipped.
def _find_use_count():
    import torch

    return getattr(torch._C, "_storage_Use_Count", None)


_USE_COUNT = None


def _storage_refs(t) -> int:
    return _USE_COUNT(t.untyped_storage()._cdata)


class _DeviceCache:
    """The C cache of one device, and the runtimes bound to it."""

    def __init__(self, device, vram_budget: Optional[int],
                 pinned_budget: Optional[int], vram=None, peer=None):
        self.device = device
        self.vram = vram
        if vram_budget is None:  # C's default (laden_cache_default_budget)
            b = ctypes.c_uint64()
            check(lib.laden_cache_default_budget(
                _dev_index(device),
                vram.info()["budget_bytes"] if vram is not None else 0,
                ctypes.byref(b)))
            vram_budget = b.value
        c = ctypes.c_void_p()
        check(lib.laden_cache_create(vram_budget, pinned_budget or 0,
                                     ctypes.byref(c)))
        if peer is not None:  # the host's other devices: one host budget
            s = lib.laden_cache_join(c, peer.c)
            if s:
                lib.laden_cache_destroy(c)
                check(s)
        # Its models' schedules hold it until they are destroyed.
        self.owner = _Owned(c, lib.laden_cache_destroy)
        self.c = c
        self.by_id: Dict[int, _Runtime] = {}

    def stats(self) -> "_lib.CacheStats":
        st = _lib.CacheStats()
        check(lib.laden_cache_stats(self.c, ctypes.byref(st)))
        return st

    def evictions(self, n: int):
        return (_lib.CacheEvict * max(n, 1))()


class ModelCache:
    """Models kept ready between uses, on the GPU while there is room and
    in host RAM (pinned within ``pinned_budget``) otherwise.

    ``with cache.use(spec, device=...) as model:`` builds the model on its
    first use, makes it ready on the device (the whole model when it fits
    ``vram_budget``, else its blocks streamed) and yields it.  After the
    ``with`` the model stays on the device until another model needs the
    room; idle models give way least recently used first, and partly when
    that is enough.  Using a model still on the device copies nothing.

    Budgets take bytes or strings ("24GB").  ``vram_budget`` counts weights
    and slots on each device (default: the free memory at the device's
    first use, less 1.5 GiB for activations); a dict gives each device its
    own (``{"cuda:0": "20GB", "cuda:1": "60GB"}``).  Each device has a
    cache of its own: ``use(spec, device="auto")`` runs a model where it
    already is, else on the device with the most room left in its budget
    (among those the dict names, or every GPU); ``stats(device)`` and
    ``info(key).device`` report per device.  ``pinned_budget`` counts
    pinned host copies (default: no limit).  ``ram_budget`` counts all
    host copies of the models and of the adapters read for them; beyond
    it idle adapters, then idle models are dropped, least recently used
    first, and read again or rebuilt by their factory on their next use
    (default: no limit for models; idle adapters keep at most
    ``laden.adapters.IDLE_HOST_BYTES``, 4 GiB).  Both host budgets are the
    host's, shared by every device: a model pinned for one GPU may unpin
    an idle model of another, and "least recently used" compares models
    across devices.

    ``vram`` (a ``laden.vbar.VRAM``) keeps the models' device copies in
    VBARs of that context: a model the cache evicts is only unpinned, its
    pages stay until the context's budget needs them (by other models'
    weights or, with the elastic allocator, by activations), and its next
    use copies nothing if they are still there; a block the context has no
    room for streams.

    One runtime per key, used by one caller at a time.  Buffers changed on
    the device are not copied back: they keep their values while the model
    stays on the device and return to the built values once evicted.

    Threads: the cache's methods may be called from several threads (they
    take its lock), and different models run in different threads at
    once.  One model is used by one thread at a time, as every streamed
    model is: while a thread runs one of its blocks, a call of that model
    from another thread raises StateError at once (two threads in one
    model's slots would corrupt each other).  A cache dropped without
    ``clear()`` frees its models' memory, files and threads when the
    garbage collector takes it; tensors taken from a model keep its memory
    valid while they live; where the cache would have to free device
    memory that such a tensor still uses (an eviction, ``clear()``), it
    raises StateError naming the model instead.  In a VRAM context
    (``vram=``) an idle model's pages go whenever the context needs room:
    there, tensors derived from a model are valid only inside its use."""

    def __init__(self, *, vram_budget=None, ram_budget=None,
                 pinned_budget=None, vram=None):
        self._vram_budgets = None  # per device, when given as a dict
        if isinstance(vram_budget, dict):
            self._vram_budgets = {
                _device(d): _budget(v, f"vram_budget[{d!r}]")
                for d, v in vram_budget.items()}
            vram_budget = None
        self.vram_budget = _budget(vram_budget, "vram_budget")
        self.vram = vram
        self.ram_budget = _budget(ram_budget, "ram_budget")
        self.pinned_budget = _budget(pinned_budget, "pinned_budget")
        self._specs: Dict[str, ModelSpec] = {}
        self._rt: Dict[str, _Runtime] = {}
        self._dev: Dict[Any, _DeviceCache] = {}
        self._known_size: Dict[str, int] = {}
        self._uses: Dict[str, int] = {}
        self._last: Dict[str, float] = {}
        global _USE_COUNT
        if _USE_COUNT is None:
            _USE_COUNT = _find_use_count() or False
        self._lock = threading.RLock()
        # Adapters as read, for all models and devices: entries of C's
        # host policy, in the group the device caches join.
        self._adapter_host = _HostAdapters(self.pinned_budget or 0)
        self._failed: set = set()  # keys whose build raised, never built
        self._built: set = set()   # keys built at least once
        self.builds = 0
        self.drops = 0

    # -- registry --------------------------------------------------------------
    def register(self, spec: ModelSpec) -> ModelSpec:
        """Registers a spec (``use`` also does) and returns the one the
        cache keeps.  A key names one model: a later spec with the same key
        and the same checkpoint, block paths and block mode stands for the
        model already registered (its factory is not called again); one
        that differs in those raises StateError."""
        if not isinstance(spec, ModelSpec):
            raise InvalidArgumentError(
                f"register: give a ModelSpec, not {type(spec).__name__}",
                "E_INVAL")
        with self._lock:
            have = self._specs.get(spec.key)
            if have is None:
                self._specs[spec.key] = spec
                return spec
            fields = ("checkpoint", "block_paths", "block_mode", "key_map",
                      "skip_prefixes", "trainable", "compression",
                      "lossless_cache")
            differ = [f for f in fields
                      if getattr(have, f) != getattr(spec, f)]
            if differ:
                raise StateError(
                    f"model '{spec.key}' is registered with another "
                    f"{', '.join(differ)} ({have}); unregister it first",
                    "E_STATE")
            return have

    def unregister(self, key: str) -> None:
        """Forgets a model and frees everything laden holds for it.  Its
        module's tensors are left on ``meta``."""
        with self._lock:
            self._spec(key)
            self._drop(key, "unregister")
            del self._specs[key]
            self._known_size.pop(key, None)

    def keys(self) -> List[str]:
        return list(self._specs)

    def __contains__(self, key) -> bool:
        return key in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def _spec(self, key: str) -> ModelSpec:
        spec = self._specs.get(key)
        if spec is None:
            raise ModelNotFoundError(
                f"no model '{key}' in the cache (registered: "
                f"{', '.join(self._specs) or 'none'})", "E_NOTFOUND")
        return spec

    # -- use -------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, spec: Union[ModelSpec, str], device=None, *,
            lookahead: int = LOOKAHEAD, adapters=None, strengths=None,
            mode: str = "merge") -> Iterator[Any]:
        """Activates the model and yields it; deactivates on exit.  Inputs
        go on ``device`` (default: the GPU the model is on already, else
        the current CUDA device, else the CPU; ``"auto"``: where it is,
        else the device with the most room).  Another device than the model's
        moves it there (it is rebuilt).  The model runs on the current
        stream of that device.

        ``adapters`` (``laden.AdapterSpec``s) with their ``strengths``
        (default 1.0 each) apply for this use.  ``mode="merge"``: added
        to the model's device copies and slots, never to its host copy;
        a device copy kept between uses keeps its merge (the same adapters
        next time cost nothing) and is written again from the host copy
        when the adapters change or go (no bytes read from the drive).
        ``mode="routed"``: the low-rank residual added to ``nn.Linear``
        outputs, the weights untouched."""
        rt = self._activate(spec, device, lookahead,
                            adapters=(adapters, strengths, mode))
        try:
            yield rt.model
        finally:
            self._deactivate(rt)

    def _activate(self, spec, device, lookahead: int,
                  adopt=None, adapters=((), None, "merge")) -> _Runtime:
        if isinstance(spec, str):
            spec = self._spec(spec)
        else:
            spec = self.register(spec)
        check_lookahead(lookahead)
        if spec.trainable and adapters[0] and adapters[2] == "merge":
            raise InvalidArgumentError(
                f"model '{spec.key}' is trainable: its adapters apply with "
                "mode='routed' (merged into its device copies, they would "
                "be undone by the next update its optimizer makes)",
                "E_INVAL")
        here = self._rt.get(spec.key) if device is None else None
        if device == "auto":
            dev = self._place(spec)
        elif here is not None and here.device.type == "cuda":
            dev = here.device  # the GPU it is on, not the current one
        else:
            dev = _device(device)
        if dev.type == "cuda":
            import torch
            torch.cuda.init()
        with self._lock:
            rt = self._rt.get(spec.key)
            if rt is not None and rt.in_use:
                raise StateError(
                    f"model '{spec.key}' is in use: a model has one runtime, "
                    "used by one caller at a time (register a second model "
                    "under another key for concurrent use)", "E_STATE")
            if rt is not None and rt.device != dev and \
                    rt.trainer is not None:
                raise StateError(
                    f"model '{spec.key}' is trainable and was built for "
                    f"{rt.device}: moving it to {dev} would rebuild it from "
                    "its factory and lose what its optimizer stepped; use it "
                    f"on {rt.device}, or unregister('{spec.key}') first",
                    "E_STATE")
            if rt is not None and rt.device != dev:
                log.debug("laden cache: '%s' moves from %s to %s: rebuilt",
                          spec.key, rt.device, dev)
                self._drop(spec.key, "device change", restore=adopt is not None)
                rt = None
            if rt is None:
                try:
                    rt = self._build(spec, dev, adopt)
                except BaseException:
                    if spec.key not in self._built:
                        self._failed.add(spec.key)
                    raise
                self._failed.discard(spec.key)
                self._built.add(spec.key)
            self._run(rt, lookahead)
            if adapters[0] or rt.adapters is not None:
                try:
                    if rt.adapters is None:
                        rt.adapters = _CacheAdapters(rt,
                                                     self._adapter_host)
                    rt.adapters.apply(*adapters)
                    self._fit_host(self._dc(dev), rt, 0)
                except BaseException:
                    self._deactivate(rt)
                    raise
            return rt

    def _place(self, spec: ModelSpec):
        """device="auto": where the model is, else the device with the most
        room left in its budget (the dict's devices, or every GPU; the CPU
        without GPUs)."""
        import torch

        with self._lock:
            rt = self._rt.get(spec.key)
            if rt is not None:
                return rt.device
            if self.vram is not None:  # the cache's VRAM context's device
                return self.vram.device
            if self._vram_budgets is not None:
                devs = list(self._vram_budgets)
            else:
                devs = [torch.device("cuda", i)
                        for i in range(torch.cuda.device_count())]
            if not devs:
                return torch.device("cpu")
            # C chooses among the devices' caches (made here if new).
            cs = (ctypes.c_void_p * len(devs))(
                *[self._dc(d).c.value for d in devs])
            at = ctypes.c_uint32()
            check(lib.laden_cache_roomiest(cs, len(devs), ctypes.byref(at)))
            return devs[at.value]

    def _dc(self, dev) -> _DeviceCache:
        dc = self._dev.get(dev)
        if dc is None:
            vram = self.vram
            if vram is not None and vram.device != dev:
                raise InvalidArgumentError(
                    f"the cache's VRAM context is for {vram.device}, not "
                    f"{dev}", "E_INVAL")
            budget = self.vram_budget
            if self._vram_budgets is not None:
                if dev not in self._vram_budgets:
                    raise InvalidArgumentError(
                        f"the cache's vram_budget names "
                        f"{', '.join(map(str, self._vram_budgets))}, not "
                        f"{dev}", "E_INVAL")
                budget = self._vram_budgets[dev]
            # One group for all devices and the adapters read for them:
            # the pinned and RAM budgets are the host's, recency compares
            # across devices.
            dc = _DeviceCache(dev, budget, self.pinned_budget, vram,
                              self._adapter_host)
            self._dev[dev] = dc
        return dc

    def _build(self, spec: ModelSpec, dev, adopt) -> _Runtime:
        dc = self._dc(dev)
        need = self._known_size.get(spec.key, spec.estimated_bytes)
        self._fit_host(dc, None, need)
        t0 = time.perf_counter()
        rt = _Runtime(spec, dev, dc)
        rt.build(adopt)
        cid = ctypes.c_uint32()
        try:
            check(lib.laden_cache_add(dc.c, spec.key.encode(), rt.size,
                                      ctypes.byref(cid)))
            # Marked before it is bound: a failure of either leaves only
            # an unbound model to remove.
            s = lib.laden_cache_keep_host(dc.c, cid.value, 1) \
                if spec.trainable else 0  # its host copy is the only copy
            if not s:
                s = lib.laden_cache_bind(dc.c, cid.value, rt.sched, rt.fixed)
            if s:
                err = error_for(s)
                lib.laden_cache_remove(dc.c, cid.value)
                raise err
        except BaseException:
            rt.destroy(restore=adopt is not None)
            raise
        rt.id = cid.value
        rt.binding[0] = (dc.owner, rt.id)
        dc.by_id[rt.id] = rt
        self._rt[spec.key] = rt
        self._known_size[spec.key] = rt.size
        self.builds += 1
        log.debug("laden cache: built '%s' for %s: %s in %u blocks (%u "
                  "outside blocks) in %.2f s", spec.key, dev,
                  fmt_bytes(rt.size), lib.laden_sched_block_count(rt.sched),
                  rt.fixed, time.perf_counter() - t0)
        self._fit_host(dc, rt, 0)
        return rt

    def _fit_host(self, dc: _DeviceCache, rt: Optional[_Runtime],
                  need: int) -> None:
        """Makes room in host RAM for `need` more bytes: C's host policy
        decides over every device's models (one group) and the adapters
        read for them, and Python drops what it names.  Idle adapters
        (cheap to read again) give way first, then idle models; the
        adapters of models in use (and rt's) stay."""
        store = self._adapter_host
        keep = [a for r in self._rt.values()
                if r.adapters is not None and (r.in_use or r is rt)
                for a in r.adapters.current]
        s, ev, n = store.fit(
            keep, dc.c, rt.id if rt is not None else 0xFFFFFFFF,
            _lib.CACHE_RAM_UNLIMITED if self.ram_budget is None
            else self.ram_budget, need,
            sum(len(d.by_id) for d in self._dev.values()))
        if s:
            log.warning("laden cache: %s", error_for(s))
            return
        by_c = {d.c.value: d for d in self._dev.values()}
        for i in range(n):
            victim = by_c[ev[i].cache].by_id[ev[i].model]
            log.debug("laden cache: RAM budget: dropping idle '%s' (%s of "
                      "host memory); it is rebuilt on its next use",
                      victim.spec.key, fmt_bytes(ev[i].drop_bytes))
            self._drop(victim.spec.key, "RAM budget")

    def _refuse_derived(self, rts, what: str) -> None:
        """StateError, before anything changes, if one of the idle models
        `rts` has device memory that tensors derived from its weights still
        use: the cache may have to free it."""
        for other in rts:
            if other.in_use:
                continue
            name = other.derived()
            if name is not None:
                raise StateError(
                    f"{what}: model '{other.spec.key}' cannot give up its "
                    f"device memory: tensors derived from its weights (from "
                    f"'{name}': a view, .detach() or a state_dict() entry) "
                    "are alive outside cache.use() and would point at freed "
                    "memory; drop them, or .clone() them inside "
                    "cache.use()", "E_STATE")

    def _run(self, rt: _Runtime, lookahead: int) -> None:
        dc = rt.dc
        may = ctypes.c_int32(0)
        if _USE_COUNT:  # C says whether idle models may give up memory
            check(lib.laden_cache_may_evict(dc.c, rt.id, ctypes.byref(may)))
        if may.value:
            self._refuse_derived(dc.by_id.values(),
                                 f"use '{rt.spec.key}'")
        ev = dc.evictions(len(dc.by_id))
        n = ctypes.c_uint32()
        act = _lib.CacheActivation()
        mode = BLOCK_MODES[rt.spec.block_mode]
        t0 = time.perf_counter()
        s = lib.laden_cache_activate(dc.c, rt.id, mode, lookahead,
                                     _compute_stream(rt.device), ev,
                                     len(dc.by_id), ctypes.byref(n),
                                     ctypes.byref(act))
        try:
            # Idle models that gave up memory point at their host copies
            # now, also when the activation failed half way.  Models in use
            # gave up nothing (and may be running in another thread).
            for other in list(dc.by_id.values()):
                if other is not rt and not other.in_use:
                    other.rebind()
            if s:
                err = error_for(s)
                rt.rebind()
                raise err
            rt.in_use = True
            rt.rebind()
            if rt.trainer is not None:
                rt.trainer.sync()  # what an optimizer stepped since
        except BaseException:
            if not s:  # activated in C: undone, or the key stays in use
                rt.in_use = True
                self._deactivate(rt)
            raise
        rt.mode = act.mode
        rt.uses += 1
        if log.isEnabledFor(logging.DEBUG):
            gone = ", ".join(
                f"'{dc.by_id[ev[i].model].spec.key}' -{fmt_bytes(ev[i].drop_bytes)}"
                for i in range(n.value) if ev[i].model in dc.by_id)
            log.debug(
                "laden cache: use '%s' on %s: %s, %u blocks resident, %u "
                "streamed; uploaded %s (%s into regions handed over), kept %s on "
                "the device, slots %s; "
                "evicted %s from %u idle model(s)%s; pinned %s, unpinned %s "
                "of others%s%s; %.2f ms", rt.spec.key, rt.device,
                _MODE_NAMES.get(act.mode, "?"), act.resident_blocks,
                act.streamed_blocks, fmt_bytes(act.upload_bytes),
                fmt_bytes(act.reused_bytes), fmt_bytes(act.kept_bytes), fmt_bytes(act.slot_bytes),
                fmt_bytes(act.evicted_bytes), act.evicted_models,
                f" ({gone})" if gone else "", fmt_bytes(act.pinned_bytes),
                fmt_bytes(act.unpinned_bytes),
                " (pinning failed: copy stays pageable)"
                if act.pin_failed else "",
                f"; {act.offloaded_blocks} block(s) offloaded by the VRAM "
                "budget, streamed" if act.offloaded_blocks else "",
                (time.perf_counter() - t0) * 1e3)

    def _deactivate(self, rt: _Runtime) -> None:
        with self._lock:
            if not rt.in_use:
                return
            rt.last_use = time.time()
            try:  # C ends the use even when the fence fails
                check(lib.laden_cache_deactivate(rt.dc.c, rt.id,
                                                 _compute_stream(rt.device)))
            finally:
                rt.in_use = False

    # -- releasing -------------------------------------------------------------
    def _drop(self, key: str, why: str, restore: bool = False) -> None:
        rt = self._rt.get(key)
        if rt is None:
            return
        if rt.in_use:
            raise StateError(f"model '{key}' is in use and cannot be "
                             f"dropped ({why})", "E_STATE")
        if _USE_COUNT:
            self._refuse_derived([rt], why)
        dc = rt.dc
        check(lib.laden_cache_unbind(dc.c, rt.id))
        check(lib.laden_cache_remove(dc.c, rt.id))
        rt.binding[0] = None
        del dc.by_id[rt.id]
        del self._rt[key]
        self._uses[key] = self._uses.get(key, 0) + rt.uses
        if rt.last_use is not None:
            self._last[key] = rt.last_use
        rt.destroy(restore)
        self.drops += 1

    def evict(self, key: str) -> int:
        """Frees a model's device memory and unpins its host copy, which
        stays in RAM.  Returns the device bytes freed.  StateError if in
        use."""
        with self._lock:
            self._spec(key)
            rt = self._rt.get(key)
            if rt is None:
                return 0
            if _USE_COUNT:
                self._refuse_derived([rt], f"evict('{key}')")
            freed = ctypes.c_uint64()
            check(lib.laden_cache_drop(rt.dc.c, rt.id, (1 << 64) - 1, 1,
                                       ctypes.byref(freed)))
            rt.rebind()
            log.debug("laden cache: evicted '%s': %s of device memory",
                      key, fmt_bytes(freed.value))
            return freed.value

    def evict_bytes(self, nbytes, device=None) -> int:
        """Frees at least ``nbytes`` of device memory from idle models on
        ``device`` (default: on each device the cache uses, ``nbytes`` from
        each), least recently used first; returns what was freed (less if
        the idle models held less)."""
        want = _budget(nbytes, "evict_bytes")
        dev = _device(device) if device is not None else None
        with self._lock:
            total = 0
            dcs = [dc for d, dc in self._dev.items()
                   if dev is None or d == dev]
            if _USE_COUNT:
                self._refuse_derived([rt for dc in dcs
                                      for rt in dc.by_id.values()],
                                     "evict_bytes")
            for dc in dcs:
                before = dc.stats().vram_bytes
                ev = dc.evictions(len(dc.by_id))
                n = ctypes.c_uint32()
                check(lib.laden_cache_free_vram(dc.c, want, ev,
                                                len(dc.by_id),
                                                ctypes.byref(n)))
                for rt in dc.by_id.values():
                    if not rt.in_use:
                        rt.rebind()
                total += before - dc.stats().vram_bytes
            return total

    def clear(self) -> None:
        """Frees every model's device and host memory (they are rebuilt on
        their next use; specs stay registered, except those whose build
        failed: they are forgotten).  StateError, with nothing freed, if a
        model is in use."""
        with self._lock:
            busy = [k for k, rt in self._rt.items() if rt.in_use]
            if busy:
                raise StateError(
                    f"clear: models in use: {', '.join(busy)}", "E_STATE")
            trained = [k for k, rt in self._rt.items()
                       if rt.trainer is not None and rt.trainer.changed()]
            if trained:
                raise StateError(
                    "clear: trainable models hold weights their optimizer "
                    f"changed, which only their host copies have: "
                    f"{', '.join(trained)}; save them (cache.named_parameters"
                    "(key), or state_dict() inside cache.use) and "
                    "unregister(key) to let them go", "E_STATE")
            if _USE_COUNT:
                self._refuse_derived(self._rt.values(), "clear")
            for key in list(self._rt):
                self._drop(key, "clear")
            self._adapter_host.clear()
            for key in self._failed:
                self._specs.pop(key, None)
                self._known_size.pop(key, None)
            self._failed.clear()

    # -- training --------------------------------------------------------------
    def _trainer(self, key: str, what: str):
        with self._lock:
            spec = self._spec(key)
            if not spec.trainable:
                raise InvalidArgumentError(
                    f"{what}('{key}'): the model is not trainable (register "
                    "it with ModelSpec(..., trainable=True))", "E_INVAL")
            rt = self._rt.get(key)
            if rt is None:
                raise StateError(
                    f"{what}('{key}'): the model is not built yet; its "
                    "parameters exist once cache.use() built it (make the "
                    "optimizer inside the first use)", "E_STATE")
            return rt.trainer

    def named_parameters(self, key: str) -> Iterator[tuple]:
        """A trainable model's parameters that train, in its order and with
        its names: each the host copy an optimizer steps (a torch
        Parameter on the CPU, with the gradients of the backwards since
        ``zero_grad()`` in its ``.grad``)."""
        return self._trainer(key, "named_parameters").named_parameters()

    def parameters(self, key: str) -> Iterator[Any]:
        """``named_parameters(key)`` without the names: what to give an
        optimizer."""
        return iter([p for _, p in self.named_parameters(key)])

    # -- reporting -------------------------------------------------------------
    def info(self, key: str) -> CacheInfo:
        with self._lock:
            spec = self._spec(key)
            rt = self._rt.get(key)
            if rt is None:
                size = self._known_size.get(key, spec.estimated_bytes)
                return CacheInfo(key, None, size, 0, 0, 0,
                                 size if spec.checkpoint is not None else 0,
                                 self._uses.get(key, 0), self._last.get(key),
                                 False, None)
            ci = _lib.CacheInfo()
            check(lib.laden_cache_info(rt.dc.c, rt.id, ctypes.byref(ci)))
            return CacheInfo(
                key, str(rt.device), rt.size, ci.vram_bytes, ci.pinned_bytes,
                rt.size - ci.pinned_bytes, 0,
                self._uses.get(key, 0) + rt.uses,
                rt.last_use if rt.last_use is not None else
                self._last.get(key), rt.in_use,
                _MODE_NAMES.get(rt.mode) if rt.mode is not None else None,
                rt.shared, rt.lossless())

    def stats(self, device=None) -> Dict[str, int]:
        """Totals over every device, or over `device` alone: bytes held
        and budgets, activations, hits (activations that copied nothing),
        bytes uploaded, evictions and evicted bytes, bytes pinned and
        unpinned, builds and drops (of every device)."""
        dev = _device(device) if device is not None else None
        rts = [rt for rt in self._rt.values()
               if dev is None or rt.device == dev]
        out = {"models": len(self._specs), "built": len(rts),
               "in_use": 0, "vram_bytes": 0, "pinned_bytes": 0,
               "host_bytes": sum(rt.size for rt in rts),
               "adapter_host_bytes": self._adapter_host.bytes,
               "vram_budget_bytes": 0, "pinned_budget_bytes":
               self.pinned_budget or 0, "ram_budget_bytes":
               self.ram_budget or 0, "activations": 0, "hits": 0,
               "upload_bytes": 0, "evictions": 0, "evicted_bytes": 0,
               "pin_bytes": 0, "unpin_bytes": 0, "builds": self.builds,
               "drops": self.drops}
        with self._lock:
            for d, dc in self._dev.items():
                if dev is not None and d != dev:
                    continue
                st = dc.stats()
                out["in_use"] += st.in_use
                out["vram_bytes"] += st.vram_bytes
                out["pinned_bytes"] += st.pinned_bytes
                out["vram_budget_bytes"] += st.vram_budget_bytes
                out["activations"] += st.acquires
                for f in ("hits", "upload_bytes", "evictions",
                          "evicted_bytes", "pin_bytes", "unpin_bytes"):
                    out[f] += getattr(st, f)
        return out

    def __repr__(self) -> str:
        st = self.stats()
        return (f"ModelCache({st['models']} models, {st['built']} built, "
                f"device copies {fmt_bytes(st['vram_bytes'])}, pinned "
                f"{fmt_bytes(st['pinned_bytes'])}, host "
                f"{fmt_bytes(st['host_bytes'])})")


class ModelOffloader:
    """Direct control of one model's lifecycle: ``activate(device)`` puts
    it on the device (whole, or streamed by blocks when it does not fit
    ``vram_budget``) and returns it; ``deactivate()`` frees its device
    memory and keeps its pinned host copy.  ``close()`` gives the module
    back as an ordinary CPU module (its tensors copied out of laden's
    memory).  ``cache``: a ModelCache shared with other models (its
    budgets apply) instead of one of its own.  ``compression="lossless"``:
    as ``ModelSpec``'s (the weights are encoded from the module's memory
    as it is taken over)."""

    def __init__(self, model, *, block_paths: Sequence[str] = (),
                 block_mode: str = "auto", vram_budget=None,
                 pinned_budget=None, key: Optional[str] = None,
                 cache: Optional["ModelCache"] = None,
                 compression: Optional[str] = None):
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"ModelOffloader: give a torch.nn.Module, not "
                f"{type(model).__name__}", "E_INVAL")
        doors.refuse_owned(model, "ModelOffloader")
        self._module = model
        self.key = key or f"{type(model).__name__}@{id(model):x}"
        self.spec = ModelSpec(self.key, lambda: self._module,
                              block_paths=block_paths, block_mode=block_mode,
                              compression=compression)
        if cache is not None and (vram_budget is not None or
                                  pinned_budget is not None):
            raise InvalidArgumentError(
                "ModelOffloader: give a cache or budgets, not both (the "
                "cache's budgets apply)", "E_INVAL")
        self._cache = cache if cache is not None else ModelCache(
            vram_budget=vram_budget, pinned_budget=pinned_budget)
        self._cache.register(self.spec)
        self._rt: Optional[_Runtime] = None

    @classmethod
    def from_module(cls, model, *, block_paths: Sequence[str] = (),
                    **kwargs) -> "ModelOffloader":
        """Takes over a model built on the CPU (its storage is packed into
        laden's host memory; the module's tensors point there)."""
        return cls(model, block_paths=block_paths, **kwargs)

    @property
    def model(self):
        return self._module

    @property
    def active(self) -> bool:
        return self._rt is not None and self._rt.in_use

    def activate(self, device=None, *, lookahead: int = LOOKAHEAD):
        """Makes the model ready on ``device`` and returns it."""
        if self.active:
            raise StateError(f"{self.key}: already active", "E_STATE")
        self._rt = self._cache._activate(self.spec, device, lookahead,
                                         adopt=self._module)
        return self._module

    def deactivate(self, *, evict: bool = True) -> None:
        """Ends the use and frees the model's device memory; with
        ``evict=False`` the model stays on the device until its cache needs
        the room (its next activation then copies nothing)."""
        if not self.active:
            raise StateError(f"{self.key}: not active", "E_STATE")
        self._cache._deactivate(self._rt)
        if evict:
            self._cache.evict(self.key)

    def info(self) -> CacheInfo:
        return self._cache.info(self.key)

    def close(self) -> None:
        """Frees everything laden holds; the module keeps its weights as
        ordinary CPU tensors."""
        if self.active:
            raise StateError(f"{self.key}: deactivate() first", "E_STATE")
        with self._cache._lock:
            self._cache._drop(self.key, "close", restore=True)
        self._rt = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.active:
            self.deactivate()
        self.close()
