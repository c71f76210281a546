"""Block streaming: run a model whose weights do not fit the device.

Python's part is attachment only: it finds the blocks of a module tree,
matches the model's tensors to the checkpoint's, asks libladen's ``stream``
layer to load every tensor into its tier, points the parameters at the
memory laden owns, and wraps each streamed block's forward with one C call
before and one after.  Deciding, reading, copying and waiting happen in C.
Here: loading and releasing; running from slots is ``offload``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import time
import weakref
from typing import Dict, Optional, Sequence

from . import _lib, doors, planning, sharing
from ._lib import LOOKAHEAD_DEFAULT as LOOKAHEAD
from ._lib import check, error_for, lib
from ._bind import _meta, _Owned, _set_tensor
from ._describe import (TIER_NAMES, BlockInfo, KeyMap, _matches,
                        _resolve_dtype, _resolve_storage, check_lookahead,
                        describe, fill, progress_to)
from ._devices import _device
from ._expand import expand_fp8  # in __all__: its users import it here
from ._units import fmt_bytes, fmt_rate, parse_size
from ._moves import unguard_moves
from ._sched import _end_interrupted, _pass  # _pass: importable here
from ._state import _own_value, _Stream
from ._wrapped import detach_all
from . import checkpoint as _checkpoint
from .checkpoint import Checkpoint, PathLike
from .compile import close_open, compiling
from .doors import refuse_owned
from .errors import InvalidArgumentError, StateError
from .offload import OffloadHandle, _start, install_offload

__all__ = ["stream_load", "compress", "CompressReport", "install_offload", "offload_blocks", "release",
           "wait",
           "stage", "LoadReport", "OffloadHandle", "BlockInfo", "expand_fp8",
           "TIER_NAMES"]

log = logging.getLogger("laden")


def _cache_counts(state: "_Stream", st) -> Optional[dict]:
    """What the load took from its lossless cache directory, as C counts
    it (st: the schedule's stats); None without one."""
    if state.lossless_cache_dir is None:
        return None
    found, stale = ctypes.c_uint32(), ctypes.c_uint32()
    check(lib.laden_sched_lossless_cache_info(
        state.live("LoadReport").h, ctypes.byref(found), ctypes.byref(stale)))
    files = len(state.ckpt.files) if state.ckpt is not None else 0
    return {"dir": state.lossless_cache_dir, "files": files,
            "found": found.value, "stale": stale.value,
            "bytes": st.lossless_cache_bytes}


class LoadReport:
    """What ``stream_load`` did; ``str(report)`` is a table."""

    def __init__(self, state: "_Stream", seconds: float, read_bytes: int,
                 cached_bytes: int = 0):
        self.path = state.path
        self.device = str(state.device)
        self.blocks = [(b.name, b.nbytes, b.tier_name) for b in state.blocks]
        self.rest_bytes = state.rest_bytes
        self.kept = list(state.kept)
        self.seconds = seconds
        self.read_bytes = read_bytes
        self.cached_bytes = cached_bytes  # of read_bytes, from page cache
        self.tier_bytes = {"resident": state.rest_bytes, "ram": 0, "disk": 0}
        for _, n, t in self.blocks:
            self.tier_bytes[t] += n
        # Blocks chosen for the device that the VRAM context had no room
        # for: they stream from RAM.
        self.offloaded = [b.name for b in state.blocks if b.offloaded]
        # compression="lossless": (coded bytes, their raw bytes)
        st = state.stats()
        self.lossless = (st.lossless_bytes, st.lossless_raw_bytes)
        # lossless_cache: {"dir", "files", "found": files whose cache file
        # was read, "stale": files whose cache file was made from another
        # version, "bytes": blobs read from them}; None without a cache
        # directory
        self.lossless_cache = _cache_counts(state, st)
        # A laden.sharing.Shared when the host copy is shared (shared=True)
        self.shared = state.shared
        self._state = state if state.loading is not None else None
        self._t0 = time.perf_counter() - seconds

    @property
    def done(self) -> bool:
        """Whether the load has ended (always, unless ``background=True``
        and the blocks are still arriving)."""
        st = self._state
        return st is None or st.loading is None

    def wait(self) -> "LoadReport":
        """Waits for a ``background=True`` load to end (raising its error,
        if it failed), then fills in the time and bytes of the whole load.
        Returns the report; at once if the load has ended."""
        st = self._state
        if st is None or st.owner is None:  # ended, or released
            return self
        _loaded(st, "LoadReport.wait")  # raises a failure each time
        self._state = None
        self.seconds = st.load_seconds or time.perf_counter() - self._t0
        stats = st.stats("LoadReport.wait")
        self.read_bytes = stats.load_read_bytes
        self.cached_bytes = stats.load_cached_bytes
        self.lossless_cache = _cache_counts(st, stats)
        return self

    @property
    def gb_per_s(self) -> float:
        """Bytes read per second of the load, in GB/s."""
        return self.read_bytes / self.seconds / 1e9 if self.seconds > 0 \
            else 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.tier_bytes.values())

    def __str__(self) -> str:
        lines = [f"laden stream_load: {self.path} -> {self.device}",
                 f"  {'block':<40} {'bytes':>10}  tier"]
        for name, n, t in self.blocks:
            lines.append(f"  {name:<40} {fmt_bytes(n):>10}  {t}")
        lines.append(f"  {'(rest of the model)':<40} "
                     f"{fmt_bytes(self.rest_bytes):>10}  resident")
        lines.append(
            f"  totals: resident on {self.device} "
            f"{fmt_bytes(self.tier_bytes['resident'])}, RAM "
            f"{fmt_bytes(self.tier_bytes['ram'])}, disk "
            f"{fmt_bytes(self.tier_bytes['disk'])}")
        if self.lossless[1]:
            coded, raw = self.lossless
            lines.append(f"  lossless: {fmt_bytes(raw)} of weights kept in "
                         f"{fmt_bytes(coded)} ({coded / raw:.3f})")
        lc = self.lossless_cache
        if lc is not None:
            lines.append(f"  lossless cache {lc['dir']}: {lc['found']} of "
                         f"{lc['files']} file(s) read from it "
                         f"({fmt_bytes(lc['bytes'])})"
                         + (f", {lc['stale']} stale (made from another "
                            "version of the file: encoded at load instead; "
                            "run laden compress again)"
                            if lc['stale'] else ""))
        if self.offloaded:
            lines.append(f"  the VRAM context had no room for "
                         f"{len(self.offloaded)} block(s) chosen for the "
                         f"device; they stream from RAM")
        lines.append(f"  read {fmt_bytes(self.read_bytes)} in "
                     f"{self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s; "
                     f"{fmt_bytes(self.cached_bytes)} from the page cache, "
                     f"{fmt_bytes(self.read_bytes - self.cached_bytes)} "
                     "from the drive)")
        if self.shared is not None:
            sh = self.shared
            lines.append(
                f"  host copy shared with this host's processes "
                f"({fmt_bytes(sh.nbytes)}, laden-{sh.name}): "
                + ("this process read it" if sh.how == "made" else
                   "attached to another process's, nothing of it read"))
        if self.kept:
            lines.append(f"  kept as built (not in the checkpoint): "
                         f"{', '.join(self.kept[:8])}"
                         + (" ..." if len(self.kept) > 8 else ""))
        return "\n".join(lines)

    __repr__ = __str__


def _open_doors(model, state: _Stream, who: str) -> None:
    """state_dict(), load_state_dict(), copies and a second owner of the
    model (laden.doors)."""
    mods = ([(model, "")] if model is not None else []) + \
        [(b.module, b.name) for b in state.blocks]
    state.doors = doors.Doors(
        state.name, state.tensors, lambda t: _own_value(state, t), mods,
        loaded=(lambda: _loaded(state, "state_dict")) if state.awaiting
        else None)
    state.claimed = [m for m, _ in mods]
    doors.claim(state.claimed, who)


def _close_doors(state: _Stream) -> None:
    if state.doors is not None:
        state.doors.close()
        state.doors = None
    doors.unclaim(state.claimed)
    state.claimed = []


# ---- the public API ------------------------------------------------------------

def set_pinned_pool(size, device=None) -> Dict[str, int]:
    """Keeps up to ``size`` bytes (an int or "20GB") of pinned host memory
    in this process after a release, for the next load on ``device`` (a
    CUDA device; default the current one): a model released and loaded
    again (a workflow switched back) takes its RAM-tier blocks' pinned
    memory back instead of pinning new pages.  0, the default, gives every
    byte back at release; lowering it unpins the oldest at once.  Returns
    the pool's counters (budget, held, reused, kept, freed bytes)."""
    try:  # the size first: a bad one is named on any machine
        n = parse_size(size)
    except ValueError as e:
        raise InvalidArgumentError(f"set_pinned_pool: {e}", "E_INVAL") \
            from None
    dev = _device(device)
    if dev.type != "cuda":
        raise InvalidArgumentError(
            f"set_pinned_pool: device {dev}: the CPU device pins nothing; "
            "give a CUDA device", "E_INVAL")
    check(lib.laden_pinned_pool_set(dev.index, n))
    st = _lib.PinnedPoolStats()
    check(lib.laden_pinned_pool_stats(dev.index, ctypes.byref(st)))
    return {f: getattr(st, f) for f, _ in st._fields_}


def stream_load(model, path: PathLike, *, plan=None,
                offload_prefixes: Optional[Sequence[str]] = None,
                resident_prefixes: Optional[Sequence[str]] = None,
                disk_prefixes: Optional[Sequence[str]] = None,
                compute_dtype=None, key_map: KeyMap = None,
                skip_prefixes: Optional[Sequence[str]] = None,
                device=None, vram_budget=None, ram_budget=None,
                lookahead: int = LOOKAHEAD, storage_dtype=None,
                vram=None, progress: Optional[bool] = None,
                background: bool = False, shared=False,
                pinned_pool=None, expert_rows: bool = True,
                expert_cache=None, compression=None,
                lossless_cache=None) -> LoadReport:
    """Loads the checkpoint at ``path`` into ``model`` (built on ``meta``
    or not), each tensor read once, straight into the tier of its block.

    - ``offload_prefixes``: module paths whose blocks are streamed; a path
      naming a ModuleList/Sequential stands for each of its children
      (``["blocks."]``).  ``resident_prefixes`` keep some of those blocks
      on the device; ``disk_prefixes`` leave some in the checkpoint, read
      when they run.  Everything else is resident on ``device``.
    - ``vram_budget``: streamed blocks are kept resident, in order, while
      the device bytes (rest of the model, resident blocks, slots) fit.
      ``ram_budget``: streamed blocks go to pinned RAM, in order, while they
      fit; the rest stay on disk.  Sizes as bytes or strings ("9GB").
    - ``compute_dtype``: floating tensors are stored and run in this dtype
      (converted on load); by default each tensor takes the model's dtype.
    - ``key_map``: checkpoint name -> model name (a dict, or a function that
      returns None to drop a name); ``skip_prefixes``: checkpoint names to
      ignore.
    - ``storage_dtype``: None keeps weights as stored (converted to the
      model's or ``compute_dtype``); ``"bf16"`` casts floating weights to
      bf16; ``"fp8"`` quantizes the large 2-D weights of the blocks to
      float8_e4m3 with a scale per row (norms, biases and small tensors
      unchanged) and expands them on the device when their block runs.
      Checkpoints already in fp8 (with ``*_scale`` / ``*_scale_inv``
      tensors per tensor, per row or per 128 x 128 tile, or without) are
      kept compact and expanded the same way, whatever storage_dtype.
    - ``progress``: a tqdm bar while loading (default: on a terminal for
      1 GiB or more; True: always; False: never).  The report says GB/s
      and how many bytes came from the page cache (read at memory speed:
      chunks whose pages are all cached are copied from there) and how
      many from the drive (O_DIRECT, several reads in flight).
    - ``background``: returns once the model's memory is given, before
      its bytes arrive; a thread of laden's reads the blocks in order
      meanwhile.  A forward of the model (and install_offload) may start
      at once: each block waits for its own bytes, so the first output
      comes about one block after the last byte is read instead of after
      the load plus a whole forward.  ``state_dict()`` of the model and
      of its blocks waits for the load to end; a weight read outside a
      forward (an attribute, ``parameters()``) is not valid until
      ``report.wait()`` or ``laden.wait(model)`` (which raise the load's
      error if it failed; a forward raises it too).  ``release()`` stops
      the load.
    - ``lookahead``: the lookahead install_offload will use, so that
      ``vram_budget`` reserves room for its ``lookahead + 1`` slots.
    - ``shared``: one host copy for the processes of this host (data
      parallel ranks, several workers): the model's host memory -- its
      RAM-tier blocks, and on the CPU device its resident part, which
      runs there in place -- goes into shared memory named from the
      checkpoint's identity and the load's layout (``laden-<name>`` in
      ``LADEN_SHM_DIR``, default ``/dev/shm``).  The first process to load
      it reads the checkpoint; the others that load the same checkpoint
      the same way attach and read nothing (waiting for the first if it
      is still reading); the last to release it removes it.  Each pins it
      with its own CUDA context.  ``report.shared`` says which it was.
      The shared copy is never written: training, ``merge_adapter`` and
      (on the CPU) merged ``set_adapters`` are refused.  A
      ``torch.distributed`` process group instead of True also checks
      that the group's ranks on one host share one copy (a collective:
      every rank calls it), refusing mismatched checkpoints with
      MismatchError.
    - ``plan``: a ``laden.Plan`` (from ``laden.plan`` or ``Plan.manual``),
      followed exactly: its blocks and tiers replace the prefixes and
      budgets.
    - ``vram``: a ``laden.vbar.VRAM`` context; the model's device memory
      then comes from its budget, shared with other models and the elastic
      allocator: room for the slots is charged first, then the rest of the
      model is placed (it must fit), then the blocks chosen to stay on the
      device, in order; a block the context has no room for streams from
      pinned RAM instead of failing (``report.offloaded``).  Without
      ``vram_budget`` the blocks are chosen against the context's free
      room.
    - ``pinned_pool``: bytes of pinned host memory this process keeps
      after the model's release for the next load (``set_pinned_pool``):
      a model released and loaded again pins nothing anew.
    - ``expert_rows``: a mixture-of-experts layer's experts module (a
      transformers ``*Experts`` module: every expert fused in tensors whose
      first dimension is the expert) inside a streamed block streams as a
      block of its own whose calls copy only the rows of the experts the
      router picked (read from disk on the disk tier); the rest of the
      layer streams as before.  False: whole layers stream.  Such a model
      cannot be captured as a CUDA graph, trained or compiled by block.
    - ``expert_cache``: device memory (bytes or a string, "2GB") that
      keeps experts which crossed the link, those routed to most often
      (a newcomer replaces the least often routed entry only when it was
      routed to more often; counts halve as routing goes on, so a new
      routing takes over), so that a token routed to one again copies it
      from there instead of across the link (``handle.stats()``:
      ``expert_rows_cached``).  None: on CUDA the device memory the plan
      leaves free under ``vram_budget``, none on the CPU; 0: none.
    - ``compression="lossless"``: the BF16 and F16 weights of the blocks
      planned for the RAM tier are kept entropy-coded (about 0.67 of
      their bytes for BF16, 0.85 for F16; every bit kept), so the RAM
      tier, the slots and every copy over the link shrink by as much;
      each block's call decodes them on the device (a GPU kernel; the CPU
      device: C, one thread) before it runs.  They are read and encoded
      at load on the host's cores.  A tensor that would not shrink by a
      sixteenth stays as stored; disk-tier blocks are read as stored
      unless ``lossless_cache`` holds their weights.
      ``report.lossless`` gives (coded bytes, their raw bytes).  The
      plan counts the RAM tier at the coded sizes (estimated from samples
      of each tensor; the load checks the true ones), so under a
      ``ram_budget`` more blocks stay in RAM instead of on disk; a
      ``plan`` made with ``compression="lossless"`` loads with it.  Such
      tensors are ``meta`` outside their block's call (``state_dict()``
      decodes them), and adapters are not merged into them.
    - ``lossless_cache``: a directory where ``laden.compress`` (``laden
      compress``) wrote the checkpoint's lossless cache files (default:
      ``LADEN_LOSSLESS_CACHE`` from the environment, if set); with
      ``compression="lossless"`` the load reads the coded weights from
      there -- about 0.67 of the bytes, nothing encoded -- and the plan
      counts their exact sizes; disk-tier blocks stream their coded
      weights from the cache files at each call (fewer bytes from the
      drive), each read checked before its block runs.  A file without a
      cache file there, or
      whose cache file was made from another version of it, is read and
      encoded as without (``report.lossless_cache`` says which); a damaged
      cache file is refused naming it (``CorruptError``).

    Names that do not match raise one MismatchError listing the missing and
    unexpected names, before anything is allocated; a shape or dtype that
    cannot be loaded raises naming the tensor.  Then call install_offload.
    """
    group_checked = [False]  # shared=<group>: the ranks' check took place
    if pinned_pool is not None:
        set_pinned_pool(pinned_pool, device)
    try:
        return _stream_load(model, path, plan, offload_prefixes,
                            resident_prefixes, disk_prefixes, compute_dtype,
                            key_map, skip_prefixes, device, vram_budget,
                            ram_budget, lookahead, storage_dtype, vram,
                            progress, background, shared, group_checked,
                            expert_rows, expert_cache, compression,
                            lossless_cache)
    except BaseException as e:
        # The group's other ranks wait in its check for this one: it
        # takes part, failed, so that they raise naming it.
        if not group_checked[0]:
            try:
                sharing.check_group(shared, None, "stream_load", failed=e)
            except Exception:
                pass
        raise


def _stream_load(model, path, plan, offload_prefixes, resident_prefixes,
                 disk_prefixes, compute_dtype, key_map, skip_prefixes,
                 device, vram_budget, ram_budget, lookahead, storage_dtype,
                 vram, progress, background, shared,
                 group_checked, expert_rows=True,
                 expert_cache=None, compression=None,
                 lossless_cache=None) -> LoadReport:
    import torch

    plan_tiers = None
    if plan is not None:
        if offload_prefixes or resident_prefixes or disk_prefixes or \
                vram_budget is not None or ram_budget is not None:
            raise InvalidArgumentError(
                "stream_load: give a plan or prefixes and budgets, not both",
                "E_INVAL")
        names = [b.name for b in plan.blocks]
        # A block inside another (a layer's experts) is found again from
        # the one that holds it.
        offload_prefixes = [n for n in names
                            if not any(n != o and n.startswith(o)
                                       for o in names)]
        plan_tiers = {b.name: int(b.tier) for b in plan.blocks}
        if device is not None and _device(device) != _device(plan.device):
            raise InvalidArgumentError(
                f"stream_load: the plan is for {plan.device}, not "
                f"{_device(device)}: its tiers were sized by that device's "
                "free memory; plan for the device the model goes to",
                "E_INVAL")
        device = plan.device
        if compute_dtype is None:
            compute_dtype = plan.compute_dtype
        if storage_dtype is None:
            storage_dtype = plan.storage_dtype
        if compression is None:  # the RAM tier was counted coded
            compression = getattr(plan, "compression", None)
        lookahead = plan.lookahead
    if getattr(model, "_laden_stream", None) is not None:
        raise StateError("the model is already loaded by laden; release() it "
                         "first", "E_STATE")
    refuse_owned(model, "stream_load")
    check_lookahead(lookahead)
    if sharing.group_of(shared, "stream_load") is not None and background:
        raise InvalidArgumentError(
            "stream_load: shared=<process group> checks the ranks' copies "
            "when their loads end, which background=True does not wait "
            "for; use shared=True with background=True", "E_INVAL")
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.init()
    storage = _resolve_storage(storage_dtype)
    cdt = _resolve_dtype(compute_dtype)
    if storage == "bf16" and cdt is None:
        cdt = torch.bfloat16  # cast down and run in bf16
    if vram is not None and getattr(vram, "device", None) != dev:
        raise InvalidArgumentError(
            f"stream_load: vram is a context for "
            f"{getattr(vram, 'device', type(vram).__name__)}, the model "
            f"goes to {dev}", "E_INVAL")
    vram_has_budget = vram is not None and bool(vram.info()["budget_bytes"])
    lossless_cache = planning.lossless_cache_dir(compression, lossless_cache,
                                                 "stream_load")
    if expert_cache is not None:
        try:
            expert_cache = parse_size(expert_cache)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"stream_load: expert_cache: {e}",
                                       "E_INVAL") from None
    t0 = time.perf_counter()
    ck = Checkpoint(path)
    try:
        budgets = planning.load_budgets(dev, vram_budget, ram_budget,
                                        vram_has_budget, lookahead,
                                        shared=ck if shared else None)
        desc = describe(model, ck, offload_prefixes or (), key_map=key_map,
                        skip_prefixes=skip_prefixes, cdt=cdt,
                        storage=storage, device=dev,
                        expert_rows=expert_rows)
        # Blocks asked for the device take it in a VRAM context only if it
        # has room at load (TIER_VRAM); the others are the planner's.
        on_dev = _lib.TIER_VRAM if vram is not None else _lib.TIER_GPU
        for b in desc.blocks:
            if plan_tiers is not None:
                b.tier = plan_tiers.get(b.name, plan_tiers.get(b.source))
            elif _matches(b.name, resident_prefixes):
                b.tier = _lib.TIER_GPU
            elif _matches(b.name, disk_prefixes):
                b.tier = _lib.TIER_DISK
            if b.tier == _lib.TIER_GPU:
                b.tier = on_dev
        state = _Stream(dev, ck.path)
        state.name = f"model {type(model).__name__}"
        state.load_t0 = t0
        _load(model, state, desc, ck, budgets, vram, lookahead, progress,
              background, shared, group_checked, expert_cache, compression,
              lossless_cache)
    except BaseException:
        ck.close()
        raise
    seconds = time.perf_counter() - t0
    st = state.stats()
    report = LoadReport(state, seconds, st.load_read_bytes,
                        st.load_cached_bytes)
    state.report = report
    log.info("%s", report)
    return report


class CompressReport:
    """What ``laden.compress`` wrote; ``str(report)`` says it in a line
    or two."""

    def __init__(self, checkpoint: str, cache_dir: str, files, st,
                 seconds: float):
        self.checkpoint = checkpoint
        self.cache_dir = cache_dir
        self.files = list(files)  # the cache files written
        self.tensors = st.tensors  # BF16/F16 tensors looked at
        self.coded = st.coded  # of them, kept coded (the others raw)
        self.raw_bytes = st.raw_bytes  # their bytes
        self.coded_raw_bytes = st.coded_raw_bytes  # the coded ones' bytes
        self.coded_bytes = st.coded_bytes  # their blobs'
        self.file_bytes = st.file_bytes  # the cache files'
        self.seconds = seconds

    @property
    def ratio(self) -> float:
        """The coded tensors' blobs over their raw bytes."""
        return self.coded_bytes / self.coded_raw_bytes \
            if self.coded_raw_bytes else 1.0

    def __str__(self) -> str:
        return (f"laden compress: {self.checkpoint} -> {self.cache_dir}: "
                f"{self.coded} of {self.tensors} BF16/F16 tensors coded, "
                f"{fmt_bytes(self.coded_raw_bytes)} in "
                f"{fmt_bytes(self.coded_bytes)} ({self.ratio:.3f}); "
                f"{len(self.files)} cache file(s), "
                f"{fmt_bytes(self.file_bytes)}, in {self.seconds:.1f} s "
                f"({fmt_rate(self.raw_bytes / max(self.seconds, 1e-9))} "
                "of weights)")


def compress(checkpoint: PathLike, cache_dir: PathLike, *,
             progress: Optional[bool] = None) -> CompressReport:
    """Encodes the BF16/F16 weights of ``checkpoint`` (a .safetensors
    file, a sharded checkpoint's index or its directory, a GGUF file)
    once, losslessly, into ``cache_dir`` (made if missing): a cache file
    per checkpoint file, named from its path, written whole under a
    temporary name and then renamed (a cache file there before is
    replaced).  A load with ``compression="lossless"`` and
    ``lossless_cache=cache_dir`` (or ``LADEN_LOSSLESS_CACHE``) then reads
    the coded weights from there, about 0.67 of the bytes for BF16, and
    encodes nothing.  The checkpoint is only read; a cache file names the
    version of the file it was made from and is not used for another.
    ``progress``: a tqdm bar (default: on a terminal for 1 GiB or more).
    Ctrl-C stops it, leaving nothing behind.  The command line: ``laden
    compress CHECKPOINT --cache DIR``."""
    path = os.path.expanduser(os.fspath(checkpoint))
    cache_dir = os.path.expanduser(os.fspath(cache_dir))
    st = _lib.LosslessCacheStats()
    t0 = time.perf_counter()
    with progress_to(None, "laden compress", progress) as pt:  # Ctrl-C
        s = lib.laden_lossless_cache_write(os.fsencode(path),
                                           os.fsencode(cache_dir), pt.fn,
                                           None, ctypes.byref(st))
    check(s)
    ck = Checkpoint(path)
    try:
        files = []
        buf = ctypes.create_string_buffer(8192)  # C's PATH_MAX + 64
        for f in ck.files:
            check(lib.laden_lossless_cache_path(
                os.fsencode(f), os.fsencode(cache_dir), buf, len(buf)))
            files.append(os.fsdecode(buf.value))
    finally:
        ck.close()
    report = CompressReport(path, cache_dir, files, st,
                            time.perf_counter() - t0)
    log.info("%s", report)
    return report


def _load(model, state: _Stream, desc, ck: Checkpoint, budgets, vram,
          lookahead: int, progress=None, background: bool = False,
          shared=False, group_checked: Optional[list] = None,
          expert_cache: Optional[int] = None,
          compression: Optional[str] = None,
          lossless_cache: Optional[str] = None) -> None:
    """Describes the model to a new C schedule, which sizes and plans its
    blocks (laden_sched_plan) and loads them; then binds the model."""
    state.create(ck, lookahead, vram)
    o = state.owner
    try:
        if vram is not None:
            check(lib.laden_sched_use_vram(o.h, vram._h))
        fill(o.h, desc, ck, _lib.TIER_GPU, expand=True)
        named = {b.c_block: b.name for b in desc.blocks}
        # compression: C marks the BF16/F16 tensors of the blocks that may
        # stream before the plan, which counts the RAM tier at their coded
        # sizes (a plan's blocks asked for RAM may fit it only so)
        state.lossless_cache_dir = lossless_cache
        marked = planning.mark_lossless(o.h, lossless_cache) \
            if compression else 0
        planning.plan_schedule(o.h, budgets, named)
        if expert_cache is not None:
            check(lib.laden_sched_set_expert_cache(o.h, expert_cache))
        state.blocks = desc.blocks
        state.tensors = desc.tensors
        state.kept = desc.kept
        state.rest_bytes = lib.laden_sched_block_bytes(o.h, 0)
        for b in state.blocks:
            b.nbytes = lib.laden_sched_block_bytes(o.h, b.c_block)
            b.tier = lib.laden_sched_block_tier(o.h, b.c_block)
        bar = progress_to(o.h, os.path.basename(state.path or "laden load"),
                          progress)
        sharing.ask(o.h, shared, "stream_load")
        if background:  # memory given, addresses known, nothing read yet
            check(lib.laden_sched_load_prepare(o.h))
        else:
            with bar:
                check(lib.laden_sched_load(o.h))
        state.shared = sharing.info(o.h)
        if group_checked is not None:
            group_checked[0] = True
        sharing.check_group(shared, state.shared, "stream_load")
    except BaseException:
        state.destroy()
        raise
    finally:
        sources = [t.source for t in desc.tensors if t.source is not None]
        for t in desc.tensors:
            t.source = None  # copied, failed, or kept for the background
    # What the load decided (C: a VRAM-tier block without room streams;
    # of the tensors marked lossless, those kept compressed expand).
    for t in state.tensors if marked else ():
        if t.c_block is not None and \
                lib.laden_sched_tensor_lossless(o.h, t.c_block, t.c_index):
            t.store = "lossless"
    tier, flags = ctypes.c_int32(), ctypes.c_uint32()
    for b in state.blocks:
        b.nbytes = lib.laden_sched_block_bytes(o.h, b.c_block)
        check(lib.laden_sched_block_state(o.h, b.c_block, ctypes.byref(tier),
                                          None, ctypes.byref(flags)))
        b.tier = tier.value
        if flags.value & _lib.SCHED_BLOCK_OFFLOADED:
            log.info("block %s (%s): the VRAM context has no room, it "
                     "streams from RAM", b.name, fmt_bytes(b.nbytes))
            b.offloaded = True
    state.ckpt = ck
    # Point the model at laden's memory: resident tensors where they run,
    # streamed ones at their home until install_offload.
    for t in state.tensors:
        streamed = lib.laden_sched_is_streamed(o.h, t.c_block)
        state.bind(t, "home" if streamed else "run")
    if background:
        state.awaiting = True
    if model is not None:
        _attach(model, state)
        model._laden_stream = state
    _open_doors(model, state, "laden.offload_blocks" if model is None else
                f"laden.stream_load of {os.path.basename(state.path or '')}")
    if background:
        try:
            bar.__enter__()  # its callback, called on the loader's thread
            state.keep.extend([bar, bar.fn, sources])
            state.loading = [bar]
            check(lib.laden_sched_load_begin(o.h))
        except BaseException:
            if model is not None:
                release(model)
            else:
                state.destroy()
            raise


# ---- hooks on the model ------------------------------------------------------

def _attach(model, state: _Stream) -> None:
    """Hooks on the loaded model.  A forward of the model holds the schedule
    from its first block to its last (laden_sched_begin/end), so that a
    second thread's forward, or release() from another thread, is refused
    at once instead of interleaving with it.  Streamed blocks refuse to run
    outside install_offload: disk blocks have no copy in memory, RAM blocks
    on CUDA none on the device.  So do blocks that keep weights compact
    (lossless, fp8, GGUF; not bf16 storage, whose modules hold its
    values): their weights exist as the model computes with
    them only once their block's enter expanded them; outside, the module
    holds the codes or meta (and PyTorch computes with a meta weight
    without a word: garbage)."""
    _unmark_released(model)
    state.name = f"model {type(model).__name__}"
    _wrap_root(model, state)
    o = state.live("attach")
    for b in state.blocks:
        streamed = lib.laden_sched_is_streamed(o.h, b.c_block)
        # bf16 storage ("c16") is bound to its true values (bf16), which
        # a block whose ops promote computes with as its enter would.
        compact = [t for t in b.tensors if t.store not in ("plain", "c16")]
        if streamed or compact:
            state.hooks.append(b.module.register_forward_pre_hook(
                _needs_offload(state, b, None if streamed else compact)))
        elif state.awaiting:
            state.hooks.append(b.module.register_forward_pre_hook(
                _awaits(state, b.c_block)))


_WAIT_MS = 100  # a long wait in C is a loop of calls this long: Ctrl-C
                # reaches Python between them


def _await(state: _Stream, o: _Owned, c_block: int) -> None:
    """Waits for a background load to bring block c_block (-1: all of
    it; C drives the load on this thread meanwhile), in calls of
    _WAIT_MS, so that Ctrl-C stops the wait; raises the load's error."""
    done = ctypes.c_int(0)
    while True:
        s = lib.laden_sched_await_for(o.h, c_block, _WAIT_MS,
                                      ctypes.byref(done))
        if s:
            err = error_for(s)
            raise type(err)(f"{state.name}: {err}", err.status, err.code)
        if done.value:
            return


def _awaits(state: _Stream, c_block: int):
    """A block that does not stream, while the model loads in the
    background: its forward waits for its bytes."""
    def pre(mod, args):
        if state.awaiting:
            _await(state, state.live("forward"), c_block)
    return pre


def _end_background(state: _Stream, ok: bool = False) -> None:
    """The end of a background load on the Python side: its progress bar
    closed; once it ended well, nothing more to await, and the host
    tensors C copied from let go (after a failure they stay with the
    schedule, which may still hold their addresses)."""
    if state.loading is None:
        return
    bar = state.loading[0]
    state.loading = None
    if ok:
        state.awaiting = False
        state.keep.clear()
    state.load_seconds = time.perf_counter() - state.load_t0
    try:
        bar.__exit__(None, None, None)
    except Exception as e:  # the bar's own failure is not the load's
        log.debug("laden: progress bar: %s", e)


def _finish_load(state: _Stream) -> None:
    """Waits for a background load to end (laden_sched_load_wait) and
    raises its error."""
    if state.loading is None:
        return
    o = state.live("wait")
    try:
        _await(state, o, -1)
    except KeyboardInterrupt:
        # Ctrl-C: the load stops (its read in progress ends first); the
        # model is released or loaded again by the user.
        lib.laden_sched_load_cancel(o.h)
        _end_background(state, ok=False)
        raise
    except BaseException:
        _end_background(state, ok=False)
        raise
    _end_background(state, ok=True)


def _loaded(state: _Stream, what: str) -> None:
    """Before a value of the model is read outside a forward: waits for
    a background load to end, or raises its error (after a failure,
    each time)."""
    if not state.awaiting:
        return
    if state.loading is not None:
        _finish_load(state)
    else:
        _await(state, state.live(what), -1)


def wait(model) -> LoadReport:
    """Waits for the background load of ``model`` (``stream_load`` or
    ``from_pretrained`` with ``background=True``) to end, raising its
    error if it failed; returns its LoadReport (at once when the load has
    ended).  A forward needs no wait (each block waits for its own
    bytes), nor does ``state_dict()`` (it waits by itself); a weight read
    outside a forward (an attribute, ``parameters()``) does."""
    state = getattr(model, "_laden_stream", None)
    if state is None:
        raise InvalidArgumentError(
            f"laden.wait: {type(model).__name__} was not loaded by "
            "laden.stream_load or laden.from_pretrained (or was released)",
            "E_INVAL")
    report = state.report
    if report is None:  # cannot be: set before the model is returned
        raise StateError(f"laden.wait: {state.name} has no load",
                         "E_STATE")
    return report.wait()


def _wrap_root(model, state: _Stream) -> None:
    """Wraps the model's forward in one pass (a wrapper, not hooks: hooks
    after a forward do not run when it ends with KeyboardInterrupt or
    SystemExit, which would leave the schedule held for good)."""
    had = "forward" in model.__dict__
    orig = model.forward

    import torch

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        if compiling() and not torch.is_grad_enabled() and \
                state.loading is None:
            # Traced by torch.compile: each block's enter op holds the
            # schedule while the block runs (laden.compile).  While a
            # background load runs, the eager pass below (a graph break)
            # waits for it and finishes it.
            return orig(*args, **kwargs)
        tl = state.passes
        depth = getattr(tl, "n", 0)
        o = None
        if not depth:
            o = state.live("forward")
            # What an interrupted pass of this thread left held (Ctrl-C
            # right after a call into C) is ended before this one begins.
            _end_interrupted(state, o)
            s = lib.laden_sched_begin(o.h)
            if s:
                err = error_for(s)
                raise type(err)(f"{state.name}: {err}", err.status, err.code)
        tl.n = depth + 1
        try:
            if o is not None and state.awaiting:
                _await(state, o, 0)  # the rest of the model
            return orig(*args, **kwargs)
        finally:
            tl.n = depth
            if o is not None:
                # The pass, and any block an interrupt left entered.
                _end_interrupted(state, o)
                if state.loading is not None and \
                        lib.laden_sched_is_loaded(o.h):
                    _finish_load(state)

    state.root = (model, model.__dict__.get("forward"), had)
    model.forward = forward


def _unwrap_root(state: _Stream) -> None:
    if state.root is None:
        return
    model, prev, had = state.root
    state.root = None
    if had:
        model.forward = prev
    else:
        model.__dict__.pop("forward", None)


def _needs_offload(state: _Stream, b: BlockInfo, compact=None):
    """A streamed block runs only under install_offload: its weights reach
    the device (or, on disk, memory) only through its slot.  A block that
    keeps `compact` tensors (not streamed) likewise: they are expanded by
    its enter."""
    if compact:
        kinds = sorted({t.store for t in compact})
        where = (f"keeping {len(compact)} weight(s) compact "
                 f"('{compact[0].names[0]}', stored as {', '.join(kinds)}): "
                 "they are expanded")
    else:
        where = ("on the disk tier: its weights are read from the "
                 "checkpoint" if b.tier == _lib.TIER_DISK else
                 "streamed from host RAM: its weights are copied to the "
                 "device")

    def pre(mod, args):
        if state.handle is None:
            raise StateError(
                f"block '{b.name}' of {state.name} is {where} while it runs "
                "under laden.install_offload, which is not installed",
                "E_STATE")
    return pre


class _Released:
    """The forward pre-hook of a released model (a class, not a closure,
    so that the released model, on meta, still pickles)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, mod, args):
        raise StateError(
            f"{self.name} was released (laden.release): its weights are "
            "gone; load it again with laden.stream_load", "E_STATE")


def _mark_released(model, state: _Stream) -> None:
    """After release the model and its blocks refuse to run: their weights
    are on meta, where some torch ops would return a result instead of
    failing."""
    refuse = _Released(state.name)
    mods = [model] if hasattr(model, "register_forward_pre_hook") else []
    if mods:
        _unmark_released(model)  # a release interrupted and called again
    mods += [b.module for b in state.blocks if b.module is not None]
    handles = [m.register_forward_pre_hook(refuse) for m in mods]
    if mods and mods[0] is model:
        model._laden_released = handles


def _unmark_released(model) -> None:
    for h in model.__dict__.pop("_laden_released", ()):
        h.remove()


def offload_blocks(blocks: Sequence, *, device, compute_dtype=None,
                   lookahead: int = LOOKAHEAD) -> OffloadHandle:
    """The low-level form: streams the given modules, built with real
    weights, from pinned RAM through ``device``.  Their tensors are copied
    once into laden's pinned RAM tier (converted to ``compute_dtype`` if
    given); the originals are released from the modules.  A tensor shared
    by two blocks stays on the device.  The rest of the model is the
    caller's to place."""
    import torch

    check_lookahead(lookahead)
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.init()
    cdt = _resolve_dtype(compute_dtype)
    blocks = list(blocks)
    if not blocks:
        raise InvalidArgumentError("offload_blocks: no blocks given",
                                   "E_INVAL")
    for b in blocks:
        refuse_owned(b, "offload_blocks")
    desc = describe(torch.nn.ModuleList(blocks), None, [""],
                    label="offload_blocks")
    for b in desc.blocks:
        b.tier = _lib.TIER_RAM
        b.name = f"block {b.name.rstrip('.')} ({type(b.module).__name__})"
    for t in desc.tensors:
        if cdt is not None and t.dtype.is_floating_point:
            t.dtype = cdt
    state = _Stream(dev, None)
    state.name = f"the {len(blocks)} offloaded blocks"
    budgets = planning.load_budgets(dev, None, None, False, lookahead)
    _load(None, state, desc, None, budgets, None, lookahead)
    return _start(state, lookahead)


def release(model, handle: Optional[OffloadHandle] = None) -> None:
    """Removes laden's hooks, frees every byte of RAM and VRAM laden holds
    for the model, and leaves its parameters and buffers read from the
    checkpoint on ``meta`` (the tensor objects themselves: a parameter
    taken from the model before is on meta too); those it was built with
    and the checkpoint lacks go back to the CPU, so the model can be
    loaded again.  Afterwards a forward of the model or of its blocks
    raises StateError, and so do the handle's methods.

    StateError, changing nothing, while another thread runs the model.
    Memory that tensors derived from the model's (views, slices) still use
    is freed when they are, with a warning here."""
    import torch

    state = handle.state if handle is not None else getattr(
        model, "_laden_stream", None)
    if state is None:
        raise StateError("release: laden holds nothing for this model",
                         "E_STATE")
    o = state.live("release")
    if state.root is not None:
        # The module stream_load loaded, also when given a wrapper that
        # forwards attributes to it (a PeftModel made after the load).
        model = state.root[0]
    close_open()  # what a compiled run that raised left entered
    if not getattr(state.passes, "n", 0):
        _end_interrupted(state, o)  # what an interrupted forward left
    s = lib.laden_sched_close(o.h)  # stops a background load
    if s:
        err = error_for(s)
        raise StateError(f"release: {state.name}: {err}", err.status,
                         err.code)
    _end_background(state)
    _close_doors(state)
    # Closed: no thread gets into the schedule any more, and from now on
    # the model and its blocks refuse to run (before their hooks go, so
    # that no forward of another thread runs half on meta weights).
    _mark_released(model, state)
    _unwrap_root(state)
    unguard_moves(model)
    for hk in state.hooks:
        hk.remove()
    state.hooks.clear()
    h = state.handle
    if h is not None:
        h._unwrap()
        h.adapters.host.clear()
    state.gone.clear()
    for t in state.tensors:
        # What the model was built with and the checkpoint lacks goes
        # back to the CPU as it is now, so the model can be loaded again;
        # the checkpoint's weights (and offload_blocks' tensors, taken
        # over) go to meta.
        built = t.ckpt_name is None and state.ckpt is not None and \
            t.param is not None and t.param.device.type != "meta"
        _set_tensor(t, t.param.detach().to("cpu", copy=True) if built
                   else _meta(t))
    if isinstance(model, torch.nn.Module):
        detach_all(model)  # quantized wrappers rebuilt, holders gone
    if state.device.type == "cuda":
        # The model's kernels must be done with its memory before it goes
        # (a VBAR's pages are unmapped without the wait of a device free).
        torch.cuda.synchronize(state.device)
    left = weakref.ref(o)
    del o
    state.destroy()
    for m in (model.modules() if isinstance(model, torch.nn.Module)
              else [model]):
        if getattr(m, "__dict__", {}).get("_laden_stream") is state:
            del m.__dict__["_laden_stream"]
            break
    if left() is not None:
        log.warning("laden.release: tensors taken from %s still use "
                    "laden's memory; it is freed when they are gone",
                    state.name)
    if state.device.type == "cuda":
        torch.cuda.empty_cache()


# ---- stage: plan, load, run, release -------------------------------------------

_remembered: Dict[str, int] = {}


@contextlib.contextmanager
def stage(build_fn, path, *, key: Optional[str] = None, **plan_kwargs):
    """Builds a model with ``build_fn()``, plans it, loads it, installs
    offloading, yields ``(model, plan)``, and releases everything when the
    block ends, also when it raises.  The peak activation memory of the
    block is remembered under ``key`` (default: the checkpoint path) and
    used as ``activation_vram`` the next time that key is planned in this
    process."""
    import torch

    key = key or os.path.realpath(os.fspath(path))
    if "activation_vram" not in plan_kwargs and key in _remembered:
        plan_kwargs["activation_vram"] = _remembered[key]
    model = build_fn()
    p = planning.plan(model, path, **plan_kwargs)
    handle = None
    stream_load(model, path, plan=p, key_map=plan_kwargs.get("key_map"),
                skip_prefixes=plan_kwargs.get("skip_prefixes"))
    try:
        handle = install_offload(model, lookahead=p.lookahead)
        dev = torch.device(p.device)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        yield model, p
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            _remembered[key] = max(
                0, torch.cuda.max_memory_allocated(dev) - base)
    finally:
        release(model, handle)


def remembered_activation_vram(key: str) -> Optional[int]:
    """What ``stage`` measured for ``key`` in this process, if anything."""
    return _remembered.get(key)
