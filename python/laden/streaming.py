"""Block streaming: run a model whose weights do not fit the device.

Python's part is attachment only: it finds the blocks of a module tree,
matches the model's tensors to the checkpoint's, asks libladen's ``stream``
layer to load every tensor into its tier, points the parameters at the
memory laden owns, and wraps each streamed block's forward with one C call
before and one after.  Deciding, reading, copying and waiting happen in C.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import (Callable, Dict, Iterable, List, Mapping, Optional,
                    Sequence, Tuple, Union)

from . import _lib
from ._dtypes import checkpoint_dtype, torch_dtype
from ._lib import check, error_for, lib
from ._units import fmt_bytes, parse_size
from .checkpoint import Checkpoint, PathLike
from .errors import InvalidArgumentError, MismatchError, StateError

log = logging.getLogger("laden")

TIER_NAMES = {_lib.TIER_GPU: "resident", _lib.TIER_RAM: "ram",
              _lib.TIER_DISK: "disk"}

_DTYPE_CODE = {}
for _i in range(64):
    _n = lib.laden_dtype_name(_i)
    if _n is None:
        break
    _DTYPE_CODE[_n.decode()] = _i


# ---- small helpers ---------------------------------------------------------

def _device(device) -> "torch.device":
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(
            f"device {device}: laden streams to CUDA devices and the CPU",
            "E_INVAL")
    return device


def _dev_index(device) -> int:
    return device.index if device.type == "cuda" else _lib.DEVICE_CPU


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


_RAW_STREAM = None


def _compute_stream(device) -> int:
    """The handle of the current CUDA stream of `device` (0 on the CPU).
    On every block call: torch's raw getter when it has one (a fraction of
    a microsecond; torch.cuda.current_stream builds a Python object)."""
    global _RAW_STREAM
    if device.type != "cuda":
        return 0
    if _RAW_STREAM is None:
        import torch

        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", False)
    if _RAW_STREAM:
        return _RAW_STREAM(device.index)
    import torch

    return torch.cuda.current_stream(device).cuda_stream


# ---- model description -----------------------------------------------------

@dataclass
class _Tensor:
    """One unique tensor of the model (aliases share it: tied weights)."""

    aliases: List[Tuple[object, str]]  # (module, attribute name)
    names: List[str]                    # dotted names of the aliases
    is_param: bool
    shape: Tuple[int, ...]
    dtype: "torch.dtype"               # what it is stored and runs as
    requires_grad: bool = False
    ckpt_name: Optional[str] = None
    block: int = -1                    # index into _Stream.blocks; -1: rest
    c_block: int = 0
    c_index: int = 0
    param: Optional[object] = None     # the Parameter laden made
    # Compact storage expanded on the device when the block runs:
    # "q8": quantized by laden to e4m3 with a float32 scale per row;
    # "ck8": fp8 as in the checkpoint, with its scale tensor (scale_name)
    # of kind "tensor", "row" or "block" (128 x 128 tiles), or none;
    # "c16": stored in bf16, run in another compute dtype.
    store: str = "plain"
    store_dtype: Optional[str] = None  # checkpoint dtype name stored
    scale_name: Optional[str] = None
    scale_kind: Optional[str] = None
    scale_index: int = -1
    persistent: bool = True            # False: a buffer no checkpoint holds


@dataclass
class BlockInfo:
    name: str
    module: object = field(repr=False)
    tier: int
    nbytes: int = 0
    c_block: int = 0
    tensors: List[_Tensor] = field(default_factory=list, repr=False)
    offloaded: bool = False  # chosen for the device, got no room: streams

    @property
    def tier_name(self) -> str:
        return TIER_NAMES[self.tier]


class LoadReport:
    """What ``stream_load`` did; ``str(report)`` is a table."""

    def __init__(self, state: "_Stream", seconds: float, read_bytes: int):
        self.path = state.path
        self.device = str(state.device)
        self.blocks = [(b.name, b.nbytes, b.tier_name) for b in state.blocks]
        self.rest_bytes = state.rest_bytes
        self.kept = list(state.kept)
        self.seconds = seconds
        self.read_bytes = read_bytes
        self.tier_bytes = {"resident": state.rest_bytes, "ram": 0, "disk": 0}
        for _, n, t in self.blocks:
            self.tier_bytes[t] += n
        # Blocks chosen for the device that the VRAM context had no room
        # for: they stream from RAM.
        self.offloaded = [b.name for b in state.blocks if b.offloaded]

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
        if self.offloaded:
            lines.append(f"  the VRAM context had no room for "
                         f"{len(self.offloaded)} block(s) chosen for the "
                         f"device; they stream from RAM")
        rate = self.read_bytes / self.seconds if self.seconds > 0 else 0.0
        lines.append(f"  read {fmt_bytes(self.read_bytes)} in "
                     f"{self.seconds:.2f} s ({rate / 1e9:.2f} GB/s)")
        if self.kept:
            lines.append(f"  kept as built (not in the checkpoint): "
                         f"{', '.join(self.kept[:8])}"
                         + (" ..." if len(self.kept) > 8 else ""))
        return "\n".join(lines)

    __repr__ = __str__


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


def _destroy_schedule(sched, *keep) -> None:
    lib.laden_stream_destroy(sched)


class _Stream:
    """laden's state for one model: the C schedule and what is bound."""

    def __init__(self, device, path: Optional[str]):
        self.device = device
        self.path = path
        self.owner: Optional[_Owned] = None  # the schedule, until release
        self.blocks: List[BlockInfo] = []
        self.tensors: List[_Tensor] = []
        self.rest_bytes = 0
        self.kept: List[str] = []
        self.kept_tensors: List[_Tensor] = []  # built, not in the checkpoint
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

    def create(self, st_handle, lookahead: int, vram=None) -> None:
        """Creates the C schedule, destroyed when the last tensor over its
        memory (or this state) lets go of it; `vram` (the context its
        memory comes from) outlives it."""
        cfg = _lib.SchedConfig(_dev_index(self.device),
                               max(1, min(63, lookahead)), 0, None)
        h = ctypes.c_void_p()
        check(lib.laden_stream_create(ctypes.byref(cfg), st_handle,
                                      ctypes.byref(h)))
        self.vram = vram
        self.owner = _Owned(h, _destroy_schedule, vram)

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
        check(lib.laden_stream_stats(o.h, ctypes.byref(st)))
        return st

    # -- binding parameters to laden memory --------------------------------
    def _set(self, t: _Tensor, value, streamed_in: Optional[str] = None
             ) -> None:
        _set_tensor(t, value, streamed_in)

    def bind(self, t: _Tensor, where: str) -> None:
        """Points t at laden memory: 'run' (where the block runs from) or
        'home' (its RAM copy).  Disk-tier tensors have no home: they are
        on meta outside install_offload (a view of the checkpoint's pages
        would raise SIGBUS once the file is truncated)."""
        import torch

        o = self.live("bind")
        nbytes = _nbytes(t)
        if t.store != "plain":
            q, _ = _compact_views(self, t, "home")
            self._set(t, q if q is not None else _meta(t))
            return
        if where == "run":
            ptr = ctypes.c_uint64()
            check(lib.laden_stream_tensor_ptr(o.h, t.c_block, t.c_index,
                                              ctypes.byref(ptr)))
            streamed = lib.laden_stream_is_streamed(o.h, t.c_block)
            value = _view(ptr.value, nbytes, t.dtype, t.shape, self.device,
                          o, self.slot_views if streamed else None)
            block = self.blocks[t.block].name if t.block >= 0 else ""
            if streamed:
                self.gone[value.untyped_storage().data_ptr()] = block
            self._set(t, value, block if streamed else None)
            return
        hp = ctypes.c_void_p()
        check(lib.laden_stream_host_ptr(o.h, t.c_block, t.c_index,
                                        ctypes.byref(hp)))
        value = _view(hp.value, nbytes, t.dtype, t.shape,
                      torch.device("cpu"), o) if hp.value else _meta(t)
        self._set(t, value)


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


def _set_tensor(t: _Tensor, value, streamed_in: Optional[str] = None
                ) -> None:
    """Points every alias of t at `value`.  The tensor object laden made
    for t keeps its identity (its contents are swapped); `streamed_in`
    names the block whose slot or workspace `value` is in: a gradient for
    it would be wrong, so computing one raises."""
    import torch

    if t.is_param:
        # The user may have frozen or unfrozen it since it was loaded.
        rg = t.param.requires_grad if t.param is not None else \
            t.requires_grad
        new = torch.nn.Parameter(
            value, requires_grad=rg and value.dtype.is_floating_point)
        if streamed_in is not None and new.requires_grad:
            new.register_hook(_refuse_grad(t.names[0], streamed_in))
        if t.param is not None and t.param.__class__ is new.__class__ and \
                _swap(t.param, new):
            new = t.param
        t.param = new
        for mod, attr in t.aliases:
            mod._parameters[attr] = new
    else:
        # A fresh alias to swap, not `value`: callers keep using theirs.
        if t.param is not None and _swap(t.param, value.detach()):
            value = t.param
        t.param = value
        for mod, attr in t.aliases:
            mod._buffers[attr] = value


class _Gone:
    """A tensor saved for backward that lived in streamed memory."""

    __slots__ = ("block",)

    def __init__(self, block: str):
        self.block = block


def _training_error(what: str) -> StateError:
    return StateError(
        f"backward through {what}: laden streamed its weights through "
        "device memory that later blocks have overwritten, so its gradient "
        "would be wrong; training through streamed blocks is not supported "
        "yet: run the forward under torch.no_grad() or "
        "torch.inference_mode(), or keep the blocks that need gradients "
        "resident (resident_prefixes)", "E_STATE")


def _refuse_grad(name: str, block: str):
    def hook(grad):
        raise _training_error(f"parameter '{name}' of streamed block "
                              f"'{block}'")
    return hook


def _saved_hooks(gone: Dict[int, str]):
    """saved_tensors_hooks that let a streamed block's forward save what
    backward needs, except tensors in streamed memory: those become a
    marker whose unpacking raises."""
    def pack(x):
        try:
            block = gone.get(x.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError, AttributeError):
            return x
        return x if block is None else _Gone(block)

    def unpack(x):
        if isinstance(x, _Gone):
            raise _training_error(f"streamed block '{x.block}'")
        return x

    return pack, unpack


def _numel(t: _Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _fp8_dtype(name: Optional[str]):
    import torch

    return torch.float8_e5m2 if name == "F8_E5M2" else torch.float8_e4m3fn


def _compact_views(state, t: _Tensor, where: str):
    """Views of a compact tensor's bytes: the fp8 data and its scale (or
    None), where the block runs ('run') or in its RAM home ('home')."""
    import torch

    fetch = lib.laden_stream_tensor_ptr if where == "run" else \
        lib.laden_stream_host_ptr
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
    n = _numel(t)
    if t.store == "c16":
        return _view(base, 2 * n, torch.bfloat16, t.shape, dev, o, track), None
    q = _view(base, n, _fp8_dtype(t.store_dtype if t.store == "ck8" else
                                  "F8_E4M3"), t.shape, dev, o, track)
    if t.store == "q8":
        scale = _view(base + (n + 15) // 16 * 16, 4 * t.shape[0],
                      torch.float32, (t.shape[0],), dev, o, track)
    elif t.scale_name:
        info = state.ckpt.info(t.scale_name)
        scale = _view(ptr(t.scale_index), info.nbytes, info.torch_dtype,
                      info.shape, dev, o, track)
    else:
        scale = None
    return q, scale


def expand_fp8(out, q, scale, kind: Optional[str]) -> None:
    """out = q x scale in out's dtype, rounded once (the product is formed
    in float32): the dequantized form laden runs with."""
    out.copy_(q)
    if scale is None:
        return
    if kind == "row" or kind is None:
        out.mul_(scale.reshape(-1, 1))
    elif kind == "tensor":
        out.mul_(scale.reshape(()))
    else:
        r, c = out.shape
        full = scale.repeat_interleave(128, 0)[:r].repeat_interleave(
            128, 1)[:, :c]
        out.mul_(full)


def _nbytes(t: _Tensor) -> int:
    """Bytes as expanded for compute."""
    import torch

    return _numel(t) * torch.empty((), dtype=t.dtype).element_size()


def _stored_bytes(t: _Tensor, ck=None) -> int:
    """Bytes as laden keeps them (compact for fp8)."""
    if t.store == "q8":
        return (_numel(t) + 15) // 16 * 16 + 4 * t.shape[0]
    if t.store == "ck8":
        extra = ck.info(t.scale_name).nbytes if (ck and t.scale_name) else 0
        return _numel(t) + extra
    if t.store == "c16":
        return 2 * _numel(t)
    return _nbytes(t)


_SCALE_SUFFIXES = ("_scale_inv", "_scale")
FP8_MIN_ELEMENTS = 1 << 16  # smaller tensors (norms, biases) stay as they are


# ---- finding blocks ----------------------------------------------------------

def _module_at(model, path: str):
    mod = model
    for part in [p for p in path.split(".") if p]:
        if not hasattr(mod, "_modules") or part not in mod._modules:
            return None
        mod = mod._modules[part]
    return mod


def _find_blocks(model, prefixes: Sequence[str]
                 ) -> List[Tuple[str, object, str]]:
    """Module paths for the given prefixes: a prefix naming a container
    (ModuleList, Sequential, ModuleDict) stands for each of its children; a
    prefix naming another module is one block.  Each entry is (block path,
    module, the prefix it came from)."""
    import torch.nn as nn

    blocks: List[Tuple[str, object, str]] = []
    for prefix in prefixes:
        path = prefix.rstrip(".")
        mod = _module_at(model, path)
        if mod is None:
            from .planning import find_blocks
            raise InvalidArgumentError(
                f"block '{prefix}' names no module of the model (its block "
                f"containers: {', '.join(find_blocks(model)) or 'none'})",
                "E_INVAL")
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            for name, child in mod.named_children():
                blocks.append((f"{path}.{name}." if path else f"{name}.",
                               child, prefix))
        else:
            blocks.append((path + "." if path else "", mod, prefix))
    names = [b[0] for b in blocks]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a.startswith(b) or b.startswith(a):
                raise InvalidArgumentError(
                    f"blocks '{a}' and '{b}' overlap; give prefixes whose "
                    "modules do not contain each other", "E_INVAL")
    return blocks


def _matches(name: str, prefixes: Optional[Iterable[str]]) -> bool:
    return any(name.startswith(p if p.endswith(".") else p + ".")
               or name == p.rstrip(".") for p in (prefixes or ()))


def _collect(model) -> List[_Tensor]:
    """Unique tensors of the model (parameters and persistent buffers),
    aliases grouped."""
    by_id: Dict[int, _Tensor] = {}
    out: List[_Tensor] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = mod_name + "." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            t = by_id.get(id(p))
            if t is None:
                t = _Tensor([], [], True, tuple(p.shape), p.dtype,
                            p.requires_grad)
                by_id[id(p)] = t
                out.append(t)
            if (mod, attr) not in t.aliases:
                t.aliases.append((mod, attr))
                t.names.append(prefix + attr)
        for attr, b in mod._buffers.items():
            if b is None:
                continue
            t = by_id.get(id(b))
            if t is None:
                t = _Tensor([], [], False, tuple(b.shape), b.dtype)
                t.persistent = attr not in mod._non_persistent_buffers_set
                by_id[id(b)] = t
                out.append(t)
            if (mod, attr) not in t.aliases:
                t.aliases.append((mod, attr))
                t.names.append(prefix + attr)
    return out


def _resolve_storage(x) -> Optional[str]:
    if x is None:
        return None
    v = str(x).lower()
    if v in ("bf16", "bfloat16", "torch.bfloat16"):
        return "bf16"
    if v in ("fp8", "f8", "float8", "float8_e4m3", "float8_e4m3fn"):
        return "fp8"
    raise InvalidArgumentError(
        f"storage_dtype {x!r}: use None (as stored), 'bf16' or 'fp8'",
        "E_INVAL")


def _scale_kind(t: _Tensor, ck) -> Optional[str]:
    """How an fp8 checkpoint tensor's scale applies: 'tensor', 'row',
    'block' (128 x 128 tiles) or None (no scale tensor)."""
    if not t.scale_name:
        return None
    shape = ck.info(t.scale_name).shape
    n = 1
    for d in shape:
        n *= d
    rows = t.shape[0] if t.shape else 1
    cols = _numel(t) // rows if rows else 0
    if n == 1:
        return "tensor"
    if len(t.shape) == 2 and n == rows and shape[0] == rows:
        return "row"
    if len(t.shape) == 2 and len(shape) == 2 and \
            shape[0] == -(-rows // 128) and shape[1] == -(-cols // 128):
        return "block"
    raise MismatchError(
        f"tensor '{t.names[0]}': its scale '{t.scale_name}' has shape "
        f"{list(shape)}, which is neither one value, one per row, nor one "
        f"per 128 x 128 tile of {list(t.shape)}", mismatched=[t.names[0]])


def _resolve_dtype(x):
    import torch

    if x is None or isinstance(x, torch.dtype):
        return x
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "f16": torch.float16,
             "float16": torch.float16, "half": torch.float16,
             "fp32": torch.float32, "f32": torch.float32,
             "float32": torch.float32, "float": torch.float32}
    if str(x).lower() not in names:
        raise InvalidArgumentError(
            f"compute_dtype {x!r}: use a torch dtype or 'bf16', 'fp16', "
            "'fp32'", "E_INVAL")
    return names[str(x).lower()]


# ---- the public API ------------------------------------------------------------

def stream_load(model, path: PathLike, *, plan=None,
                offload_prefixes: Optional[Sequence[str]] = None,
                resident_prefixes: Optional[Sequence[str]] = None,
                disk_prefixes: Optional[Sequence[str]] = None,
                compute_dtype=None,
                key_map: Union[None, Mapping[str, str],
                               Callable[[str], Optional[str]]] = None,
                skip_prefixes: Optional[Sequence[str]] = None,
                device=None, vram_budget=None, ram_budget=None,
                lookahead: int = 2, storage_dtype=None,
                vram=None) -> LoadReport:
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
    - ``lookahead``: the lookahead install_offload will use, so that
      ``vram_budget`` reserves room for its ``lookahead + 1`` slots.
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

    Names that do not match raise one MismatchError listing the missing and
    unexpected names, before anything is allocated; a shape or dtype that
    cannot be loaded raises naming the tensor.  Then call install_offload.
    """
    import torch

    plan_tiers = None
    if plan is not None:
        if offload_prefixes or resident_prefixes or disk_prefixes or \
                vram_budget is not None or ram_budget is not None:
            raise InvalidArgumentError(
                "stream_load: give a plan or prefixes and budgets, not both",
                "E_INVAL")
        offload_prefixes = [b.name for b in plan.blocks]
        plan_tiers = {b.name: int(b.tier) for b in plan.blocks}
        device = device if device is not None else plan.device
        if compute_dtype is None:
            compute_dtype = plan.compute_dtype
        if storage_dtype is None:
            storage_dtype = plan.storage_dtype
        lookahead = plan.lookahead
    if getattr(model, "_laden_stream", None) is not None:
        raise StateError("the model is already loaded by laden; release() it "
                         "first", "E_STATE")
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.init()
    storage = _resolve_storage(storage_dtype)
    cdt = _resolve_dtype(compute_dtype)
    if storage == "bf16" and cdt is None:
        cdt = torch.bfloat16  # cast down and run in bf16
    vram_ctx = vram
    vram = parse_size(vram_budget) if vram_budget is not None else None
    if vram_ctx is not None:
        if getattr(vram_ctx, "device", None) != dev:
            raise InvalidArgumentError(
                f"stream_load: vram is a context for "
                f"{getattr(vram_ctx, 'device', type(vram_ctx).__name__)}, "
                f"the model goes to {dev}", "E_INVAL")
        if vram is None:
            vi = vram_ctx.info()
            if vi["budget_bytes"]:
                vram = max(0, vi["budget_bytes"] - vi["pinned_bytes"] -
                           vi["charged_bytes"])
    ram = parse_size(ram_budget) if ram_budget is not None else None
    t0 = time.perf_counter()
    ck = Checkpoint(path)
    try:
        state = _prepare(model, ck, dev, cdt, key_map, skip_prefixes,
                         offload_prefixes or (), resident_prefixes,
                         disk_prefixes, vram, ram, lookahead, plan_tiers,
                         storage)
        _load(model, state, ck, vram_ctx, lookahead)
    except BaseException:
        ck.close()
        raise
    seconds = time.perf_counter() - t0
    st = state.stats()
    report = LoadReport(state, seconds, st.load_read_bytes)
    log.info("%s", report)
    return report


def _prepare(model, ck: Checkpoint, dev, cdt, key_map, skip_prefixes,
             offload_prefixes, resident_prefixes, disk_prefixes, vram,
             ram, lookahead=2, plan_tiers=None, storage=None) -> _Stream:
    import torch

    found = _find_blocks(model, list(offload_prefixes))  # arguments first
    tensors = _collect(model)
    owner: Dict[str, _Tensor] = {}
    for t in tensors:
        for n in t.names:
            owner[n] = t
    # Checkpoint names -> model names.
    unexpected: List[str] = []
    for cname in ck.names():
        if skip_prefixes and any(cname.startswith(p) for p in skip_prefixes):
            continue
        mname = cname
        if key_map is not None:
            mname = key_map(cname) if callable(key_map) else key_map.get(
                cname, cname)
            if mname is None:
                continue
        t = owner.get(mname)
        if t is None:
            unexpected.append(cname)
        elif t.ckpt_name is None:
            t.ckpt_name = cname
    # Scale tensors of fp8 checkpoint tensors are companions, not strays.
    fp8_names = {"F8_E4M3", "F8_E5M2"}
    by_ckpt = {t.ckpt_name: t for t in tensors if t.ckpt_name}
    still = []
    for cname in unexpected:
        base = next((cname[:-len(sfx)] for sfx in _SCALE_SUFFIXES
                     if cname.endswith(sfx)), None)
        t = by_ckpt.get(base) if base else None
        if t is not None and ck.info(base).dtype in fp8_names:
            t.scale_name = cname
        else:
            still.append(cname)
    unexpected = still
    missing = []
    unbuilt = []
    kept = []
    for t in tensors:
        if t.ckpt_name is not None:
            continue
        cur = getattr(t.aliases[0][0], t.aliases[0][1])
        if cur.device.type != "meta":
            kept.append(t)
        elif t.persistent:
            missing.append(t.names[0])
        else:
            unbuilt.append(t.names[0])
    if unbuilt and not (missing or unexpected):
        raise MismatchError(
            f"non-persistent buffers are on meta and no checkpoint holds "
            f"them: {', '.join(unbuilt[:20])}; build them on the CPU (create "
            "them outside the meta device context)", missing=unbuilt)
    if missing or unexpected:
        msg = [f"{ck.path} does not match the model:"]
        if missing:
            msg.append(f"missing from the checkpoint ({len(missing)}): "
                       + ", ".join(missing[:20])
                       + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            msg.append(f"unexpected in the checkpoint ({len(unexpected)}): "
                       + ", ".join(unexpected[:20])
                       + (" ..." if len(unexpected) > 20 else ""))
        msg.append("(key_map renames checkpoint names, skip_prefixes drops "
                   "them)")
        raise MismatchError(" ".join(msg), missing, unexpected)
    # Shapes and dtypes.
    for t in tensors:
        if t.ckpt_name is None:
            continue
        info = ck.info(t.ckpt_name)
        if info.shape != t.shape:
            raise MismatchError(
                f"tensor '{t.names[0]}': the checkpoint's '{t.ckpt_name}' has "
                f"shape {list(info.shape)}, the model {list(t.shape)}",
                mismatched=[t.names[0]])
        want = t.dtype
        if cdt is not None and want.is_floating_point and \
                info.torch_dtype is not None and \
                info.torch_dtype.is_floating_point:
            want = cdt
        if info.dtype in fp8_names and want.is_floating_point and \
                want.itemsize > 1:
            t.store, t.store_dtype = "ck8", info.dtype
        elif info.torch_dtype != want:
            ok = {info.dtype, checkpoint_dtype(want)} <= {"F32", "F16",
                                                          "BF16"}
            if not ok:
                raise MismatchError(
                    f"tensor '{t.names[0]}': the checkpoint's "
                    f"'{t.ckpt_name}' is {info.dtype}, the model wants "
                    f"{want}; laden converts only between F32, F16 and BF16",
                    mismatched=[t.names[0]])
        t.dtype = want
    state = _Stream(dev, ck.path)
    state.kept = [t.names[0] for t in kept]
    state.kept_tensors = kept
    state.tensors = [t for t in tensors if t.ckpt_name is not None]
    # Blocks and their tensors: a tensor belongs to a block when every alias
    # is inside it; tied tensors that span blocks stay resident.
    for name, mod, source in found:
        tier = _lib.TIER_RAM
        if plan_tiers is not None:
            tier = int(plan_tiers[source])
        elif _matches(name, resident_prefixes):
            tier = _lib.TIER_GPU
        elif _matches(name, disk_prefixes):
            tier = _lib.TIER_DISK
        state.blocks.append(BlockInfo(name, mod, tier))
    for t in state.tensors:
        homes = set()
        for n in t.names:
            bi = next((i for i, b in enumerate(state.blocks)
                       if n.startswith(b.name)), -1)
            homes.add(bi)
        t.block = homes.pop() if len(homes) == 1 else -1
        if t.store == "ck8":
            t.scale_kind = _scale_kind(t, ck)
            if t.block < 0:  # no hook runs outside blocks: decode on load
                if t.scale_name:
                    raise MismatchError(
                        f"tensor '{t.names[0]}': fp8 with a scale tensor "
                        "outside the streamed blocks is not supported; "
                        "offload the module that holds it",
                        mismatched=[t.names[0]])
                t.store = "plain"
        elif storage == "fp8" and t.block >= 0 and t.is_param and \
                t.dtype.is_floating_point and len(t.shape) == 2 and \
                _numel(t) >= FP8_MIN_ELEMENTS:
            t.store = "q8"
        elif storage == "bf16" and t.block >= 0 and \
                t.dtype.is_floating_point and t.dtype != torch.bfloat16:
            t.store = "c16"  # compact in bf16, expanded when it runs
        nb = _stored_bytes(t, ck)
        if t.block >= 0:
            state.blocks[t.block].tensors.append(t)
            state.blocks[t.block].nbytes += nb
        else:
            state.rest_bytes += nb
    if plan_tiers is None:
        _assign_tiers(state, vram, ram, lookahead + 1)
    for b in state.blocks:
        if b.tier == _lib.TIER_DISK:
            for t in b.tensors:
                if t.store == "ck8":
                    continue  # read as stored, expanded on the device
                if t.store in ("q8", "c16") or \
                        ck.info(t.ckpt_name).torch_dtype != t.dtype:
                    as_ = {"q8": "fp8", "c16": "bf16"}.get(t.store, t.dtype)
                    raise MismatchError(
                        f"tensor '{t.names[0]}' would be converted to "
                        f"{as_}, but its block {b.name} is on the disk "
                        "tier, which is read as stored; give it RAM "
                        "(ram_budget) or keep the checkpoint's dtype",
                        mismatched=[t.names[0]])
    return state


def _assign_tiers(state: _Stream, vram: Optional[int], ram: Optional[int],
                  nslots: int = 3) -> None:
    """Tiers for the prefix-and-budget form of stream_load, decided by the
    C planner: blocks named by resident/disk prefixes keep their tier;
    with a VRAM budget the others are kept resident while the rest, the
    resident blocks and the slots fit it; streamed blocks go to RAM while
    ``ram`` (bytes of RAM tier, staging not counted) allows, else disk."""
    n = len(state.blocks)
    if n == 0:
        return
    big = 1 << 62
    use_vram = vram is not None and state.device.type == "cuda"
    inp = _lib.PlanInput()
    sizes = (ctypes.c_uint64 * n)(*[b.nbytes for b in state.blocks])
    asked = (ctypes.c_int32 * n)(*[
        b.tier if b.tier in (_lib.TIER_GPU, _lib.TIER_DISK) else -1
        for b in state.blocks])
    inp.nblocks = n
    inp.block_bytes = sizes
    inp.asked = asked
    inp.rest_bytes = state.rest_bytes
    inp.vram_free_bytes = vram if use_vram else big
    inp.ram_total_bytes = big
    inp.ram_free_bytes = big
    inp.ram_budget_bytes = big if ram is None else max(1, ram)
    inp.min_free_ram_bytes = 0
    inp.resident_blocks = -1 if use_vram else 0
    inp.lookahead = max(1, nslots - 1)
    inp.disk_staging = 0
    tiers = (ctypes.c_int32 * n)()
    why = (ctypes.c_int32 * n)()
    res = _lib.PlanResult()
    st = lib.laden_plan_compute(ctypes.byref(inp), tiers, why,
                                ctypes.byref(res))
    if st:
        err = error_for(st)
        raise type(err)(f"vram_budget {fmt_bytes(vram or 0)}: {err}",
                        err.status, err.code)
    for b, t in zip(state.blocks, tiers):
        b.tier = int(t)


def _load(model, state: _Stream, ck: Checkpoint, vram=None,
          lookahead: int = 2) -> None:
    state.create(ck._h, lookahead, vram)
    o = state.owner
    try:
        if vram is not None:
            check(lib.laden_stream_use_vram(o.h, vram._h))
        groups = [(-1, _lib.TIER_GPU, [t for t in state.tensors
                                       if t.block < 0])]
        # In a VRAM context the blocks chosen for the device get it if the
        # context has room at load, else they stream.
        groups += [(i, _lib.TIER_VRAM if vram is not None and
                    b.tier == _lib.TIER_GPU else b.tier, b.tensors)
                   for i, b in enumerate(state.blocks)]
        cb = ctypes.c_uint32()
        ci = ctypes.c_uint32()
        for i, tier, ts in groups:
            check(lib.laden_stream_add_block(o.h, tier, ctypes.byref(cb)))
            if i >= 0:
                state.blocks[i].c_block = cb.value
            for t in ts:
                idx = ck._index[t.ckpt_name]
                code = _DTYPE_CODE[checkpoint_dtype(t.dtype)]
                if t.store == "q8":
                    code = _DTYPE_CODE["F8_E4M3"]
                elif t.store == "c16":
                    code = _DTYPE_CODE["BF16"]
                elif t.store == "ck8":
                    code = _DTYPE_CODE[t.store_dtype]
                check(lib.laden_stream_add_tensor(
                    o.h, cb.value, ck._h, idx, code, ctypes.byref(ci)))
                t.c_block, t.c_index = cb.value, ci.value
                if t.store == "ck8" and t.scale_name:
                    sinfo = ck.info(t.scale_name)
                    check(lib.laden_stream_add_tensor(
                        o.h, cb.value, ck._h, ck._index[t.scale_name],
                        _DTYPE_CODE[sinfo.dtype], ctypes.byref(ci)))
                    t.scale_index = ci.value
        check(lib.laden_stream_load(o.h))
    except BaseException:
        state.destroy()
        raise
    for b in state.blocks:
        got = lib.laden_stream_block_tier(o.h, b.c_block)
        if got != b.tier:
            log.info("block %s (%s): the VRAM context has no room, it "
                     "streams from RAM", b.name, fmt_bytes(b.nbytes))
            b.offloaded = True
            b.tier = got
    state.ckpt = ck
    # Point the model at laden's memory: resident tensors where they run,
    # streamed ones at their home until install_offload.
    for t in state.tensors:
        streamed = lib.laden_stream_is_streamed(o.h, t.c_block)
        state.bind(t, "home" if streamed else "run")
    # Tensors the model was built with and the checkpoint lacks go to the
    # device as they are (they are not laden's).
    for t in state.kept_tensors:
        mod, attr = t.aliases[0]
        cur = getattr(mod, attr)
        if cur.device != state.device:
            if t.is_param:
                cur.data = cur.data.to(state.device)
            else:
                moved = cur.to(state.device)
                for m2, a2 in t.aliases:
                    m2._buffers[a2] = moved
    _attach(model, state)
    model._laden_stream = state


# ---- hooks on the model ------------------------------------------------------

def _attach(model, state: _Stream) -> None:
    """Hooks on the loaded model.  A forward of the model holds the schedule
    from its first block to its last (laden_stream_begin/end), so that a
    second thread's forward, or release() from another thread, is refused
    at once instead of interleaving with it.  Disk-tier blocks refuse to run
    outside install_offload: they have no copy in memory."""
    _unmark_released(model)
    state.name = f"model {type(model).__name__}"
    _wrap_root(model, state)
    for b in state.blocks:
        if b.tier == _lib.TIER_DISK:
            state.hooks.append(b.module.register_forward_pre_hook(
                _needs_offload(state, b.name)))


def _wrap_root(model, state: _Stream) -> None:
    """Wraps the model's forward in one pass (a wrapper, not hooks: hooks
    after a forward do not run when it ends with KeyboardInterrupt or
    SystemExit, which would leave the schedule held for good)."""
    had = "forward" in model.__dict__
    orig = model.forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        tl = state.passes
        depth = getattr(tl, "n", 0)
        o = None
        if not depth:
            o = state.live("forward")
            s = lib.laden_stream_begin(o.h)
            if s:
                err = error_for(s)
                raise type(err)(f"{state.name}: {err}", err.status, err.code)
        tl.n = depth + 1
        try:
            return orig(*args, **kwargs)
        finally:
            tl.n = depth
            if o is not None:
                lib.laden_stream_end(o.h)

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


def _needs_offload(state: _Stream, block: str):
    def pre(mod, args):
        if state.handle is None:
            raise StateError(
                f"block '{block}' of {state.name} is on the disk tier: its "
                "weights are read from the checkpoint while it runs under "
                "laden.install_offload, which is not installed", "E_STATE")
    return pre


def _mark_released(model, state: _Stream) -> None:
    """After release the model and its blocks refuse to run: their weights
    are on meta, where some torch ops would return a result instead of
    failing."""
    def refuse(mod, args):
        raise StateError(
            f"{state.name} was released (laden.release): its weights are "
            "gone; load it again with laden.stream_load", "E_STATE")

    mods = [model] if hasattr(model, "register_forward_pre_hook") else []
    mods += [b.module for b in state.blocks if b.module is not None]
    handles = [m.register_forward_pre_hook(refuse) for m in mods]
    if mods and mods[0] is model:
        model._laden_released = handles


def _unmark_released(model) -> None:
    for h in model.__dict__.pop("_laden_released", ()):
        h.remove()


class OffloadHandle:
    """Returned by install_offload / offload_blocks.  ``remove()`` restores
    plain modules; their weights stay where laden keeps them (resident
    blocks on the device, streamed blocks in RAM; disk-tier blocks have no
    copy in memory and refuse to run until install_offload again)."""

    def __init__(self, state: _Stream, lookahead: int):
        self.state = state
        self.lookahead = lookahead
        self._wrapped: List[Tuple[object, object, bool]] = []
        self.active = False
        self.workspace: Optional[_Owned] = None  # expanded fp8 tensors

    def stats(self) -> Dict[str, int]:
        """Counters of the schedule: enters, misses, bytes copied and
        read, device and pinned bytes held.  StateError after release."""
        st = self.state.stats("OffloadHandle.stats")
        return {f: getattr(st, f) for f, _ in st._fields_}

    def remove(self) -> None:
        """Unwraps the blocks, points their weights at their RAM copies and
        frees the slots.  StateError after release, or while another
        thread runs the model (nothing changes then).  While tensors
        derived from streamed weights (views, ``state_dict()`` entries)
        are alive, the slots under them stay allocated (a warning says so);
        they are freed by a later remove() or release()."""
        st = self.state
        o = st.live("OffloadHandle.remove")
        if not self.active:
            return
        with _pass(st, o, "OffloadHandle.remove"):
            st.gone.clear()
            # Weights first, while the blocks are still wrapped: another
            # thread calling a block meanwhile is refused, not run on
            # half-moved weights.
            for b in st.blocks:
                streamed = lib.laden_stream_is_streamed(o.h, b.c_block)
                for t in b.tensors:
                    if streamed or t.store != "plain":
                        st.bind(t, "home")
            self._unwrap()
            self._drop_workspace()
            if not _free_slots(st, o):
                st.kept_lookahead = self.lookahead

    def _unwrap(self) -> None:
        for mod, prev, had in self._wrapped:
            if had:
                mod.forward = prev
            else:
                mod.__dict__.pop("forward", None)
        self._wrapped.clear()
        self.active = False
        if self.state.handle is self:
            self.state.handle = None

    def _drop_workspace(self) -> None:
        ws, self.workspace = self.workspace, None
        if ws is not None and self.state.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.state.device)
        del ws  # freed now unless a tensor taken from the model holds it


def _free_device_memory(ptr: int, device: int) -> None:
    lib.laden_dev_mem_free(device, ptr)


class _pass:
    """Holds the schedule for this thread (laden_stream_begin/end) around
    work that rebinds a model, so that no other thread runs it meanwhile;
    StateError at once if another thread holds it."""

    def __init__(self, state: "_Stream", owner: _Owned, what: str):
        self.state, self.owner, self.what = state, owner, what

    def __enter__(self):
        s = lib.laden_stream_begin(self.owner.h)
        if s:
            err = error_for(s)
            raise type(err)(f"{self.what}: {self.state.name}: {err}",
                            err.status, err.code)
        return self

    def __exit__(self, *exc):
        lib.laden_stream_end(self.owner.h)


def _free_slots(state: "_Stream", o: _Owned, quiet: bool = False) -> bool:
    """Stops the schedule (frees its slots) unless a tensor still uses a
    slot: one derived from a streamed weight (a view, a state_dict entry)
    would point at freed memory.  True if stopped."""
    state.slot_views = [r for r in state.slot_views if r() is not None]
    if state.slot_views:
        if quiet:
            return False
        log.warning("laden: %d tensor(s) derived from the streamed weights "
                    "of %s are alive; its slots stay allocated until they "
                    "are gone (freed by a later remove() or release())",
                    len(state.slot_views), state.name)
        return False
    check(lib.laden_stream_stop(o.h))
    return True


def _wrap_forward(mod, owner: _Owned, c_block: int, device, wrapped: list,
                  expansions=(), guard=None, gone=None):
    """Wraps mod.forward with one C call before (enter) and one after
    (exit); records (module, previous forward, had own) in `wrapped` so it
    can be undone.  `guard()`, if given, runs first (it may raise).  With
    `gone` (storage address -> block, for memory that later blocks
    overwrite), what the forward saves for backward from that memory
    raises when backward unpacks it, instead of giving a wrong gradient."""
    import torch

    enter, leave = lib.laden_stream_enter, lib.laden_stream_exit
    had = "forward" in mod.__dict__
    orig = mod.forward
    grad_on = torch.is_grad_enabled
    hooks = _saved_hooks(gone) if gone is not None else None
    saved = torch.autograd.graph.saved_tensors_hooks

    def forward(*args, **kwargs):
        if guard is not None:
            guard()
        stream = _compute_stream(device)  # once: enter and exit share it
        s = enter(owner.h, c_block, stream)
        if s:
            raise error_for(s)
        try:
            for buf, q, sc, kind in expansions:
                expand_fp8(buf, q, sc, kind)
            if hooks is not None and grad_on():
                with saved(*hooks):
                    out = orig(*args, **kwargs)
            else:
                out = orig(*args, **kwargs)
        except BaseException:
            leave(owner.h, c_block, stream)
            raise
        s = leave(owner.h, c_block, stream)
        if s:
            raise error_for(s)
        return out

    wrapped.append((mod, mod.__dict__.get("forward"), had))
    mod.forward = forward


def install_offload(model, *, device=None, lookahead: int = 2) -> OffloadHandle:
    """Makes the streamed blocks of a model loaded with ``stream_load`` run
    from device slots: allocates ``lookahead + 1`` slots, points the
    blocks' parameters at them (for good: a block always runs from the
    same slot) and wraps each streamed block's forward with one C call
    before and one after.  Returns a handle; ``handle.remove()`` undoes
    it."""
    state = getattr(model, "_laden_stream", None)
    if state is None:
        why = ("was released (laden.release); load it again with "
               "laden.stream_load" if "_laden_released" in
               getattr(model, "__dict__", {}) else
               "was not loaded with laden.stream_load")
        raise StateError(f"install_offload: the model {why}", "E_STATE")
    state.live("install_offload")
    if device is not None and _device(device) != state.device:
        raise InvalidArgumentError(
            f"install_offload: device {device} differs from {state.device}, "
            "where stream_load put the model", "E_INVAL")
    if state.handle is not None:
        raise StateError("install_offload: already installed; remove() the "
                         "handle first", "E_STATE")
    if not 1 <= lookahead <= 63:
        raise InvalidArgumentError(
            f"lookahead {lookahead}: give 1 to 63", "E_INVAL")
    return _start(state, lookahead)


def _start(state: _Stream, lookahead: int) -> OffloadHandle:
    o = state.live("install_offload")
    with _pass(state, o, "install_offload"):
        kept = state.kept_lookahead
        if kept is not None and _free_slots(state, o, quiet=True):
            kept = None
        if kept is None:
            check(lib.laden_stream_start(o.h, lookahead))
        elif kept != lookahead:
            # Slots kept by remove() for tensors still alive are reused
            # as they are laid out.
            raise StateError(
                f"install_offload: tensors derived from the streamed "
                f"weights of {state.name} still use its slots, laid out for "
                f"lookahead={kept}; drop them or install with that "
                "lookahead", "E_STATE")
        state.kept_lookahead = None
        handle = OffloadHandle(state, lookahead)
        state.handle = handle
        handle.active = True
        try:
            _bind_slots(state, o, handle)
        except BaseException:
            try:
                handle.remove()
            finally:
                handle._unwrap()
            raise
    return handle


def _bind_slots(state: _Stream, o: _Owned, handle: OffloadHandle) -> None:
    """Wraps the blocks that stream or expand compact tensors, then points
    their tensors where they run (wrapped first: another thread calling a
    block meanwhile is refused, not run on half-bound weights)."""
    # One workspace, the size of the largest block's expanded compact
    # tensors: blocks run one after another on one stream.
    ws = 0
    for b in state.blocks:
        need = sum((_nbytes(t) + 255) // 256 * 256 for t in b.tensors
                   if t.store != "plain")
        ws = max(ws, need)
    if ws:
        p = ctypes.c_uint64()
        dev = _dev_index(state.device)
        check(lib.laden_dev_mem_alloc(dev, ws, ctypes.byref(p)))
        handle.workspace = _Owned(p.value, _free_device_memory, dev)
    for b in state.blocks:
        streamed = lib.laden_stream_is_streamed(o.h, b.c_block)
        compact = any(t.store != "plain" for t in b.tensors)
        expansions: list = []
        if streamed or compact:
            _wrap_forward(b.module, o, b.c_block, state.device,
                          handle._wrapped, expansions, gone=state.gone)
        off = 0
        for t in b.tensors:
            if t.store == "plain":
                if streamed:
                    state.bind(t, "run")
                continue
            q, sc = _compact_views(state, t, "run")
            ws_owner = handle.workspace
            out = _view(ws_owner.h + off, _nbytes(t), t.dtype, t.shape,
                        state.device, ws_owner)
            off += (_nbytes(t) + 255) // 256 * 256
            # The workspace is the next block's too.
            state.gone[out.untyped_storage().data_ptr()] = b.name
            state._set(t, out, b.name)
            expansions.append((out, q, sc, t.scale_kind))


def offload_blocks(blocks: Sequence, *, device, compute_dtype=None,
                   lookahead: int = 2) -> OffloadHandle:
    """The low-level form: streams the given modules, built with real
    weights on the CPU, from pinned RAM through ``device``.  Their tensors
    are copied once into laden's pinned RAM tier (converted to
    ``compute_dtype`` if given); the originals are released from the
    modules.  The rest of the model is the caller's to place."""
    import torch

    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.init()
    cdt = _resolve_dtype(compute_dtype)
    blocks = list(blocks)
    if not blocks:
        raise InvalidArgumentError("offload_blocks: no blocks given",
                                   "E_INVAL")
    state = _Stream(dev, None)
    state.name = f"the {len(blocks)} offloaded blocks"
    keep = []  # host tensors must live until load copied them
    state.create(None, lookahead)
    o = state.owner
    cb, ci = ctypes.c_uint32(), ctypes.c_uint32()
    for i, mod in enumerate(blocks):
        info = BlockInfo(f"block {i} ({type(mod).__name__})", mod,
                         _lib.TIER_RAM)
        check(lib.laden_stream_add_block(o.h, _lib.TIER_RAM,
                                         ctypes.byref(cb)))
        info.c_block = cb.value
        for t in _collect(mod):
            cur = getattr(t.aliases[0][0], t.aliases[0][1])
            if cur.device.type != "cpu":
                state.destroy()
                raise InvalidArgumentError(
                    f"offload_blocks: {t.names[0]} of block {i} is on "
                    f"{cur.device}; build the blocks on the CPU", "E_INVAL")
            src = cur.detach().contiguous()
            keep.append(src)
            if cdt is not None and t.dtype.is_floating_point:
                t.dtype = cdt
            try:
                sdt = _DTYPE_CODE[checkpoint_dtype(src.dtype)]
                ddt = _DTYPE_CODE[checkpoint_dtype(t.dtype)]
            except ValueError as e:
                state.destroy()
                raise InvalidArgumentError(f"offload_blocks: {e}", "E_INVAL")
            st = lib.laden_stream_add_host_tensor(
                o.h, cb.value, ctypes.c_void_p(src.data_ptr()), sdt,
                src.numel(), ddt, ctypes.byref(ci))
            if st:
                err = error_for(st)
                state.destroy()
                raise err
            t.c_block, t.c_index = cb.value, ci.value
            info.tensors.append(t)
            info.nbytes += _nbytes(t)
            state.tensors.append(t)
        state.blocks.append(info)
    try:
        check(lib.laden_stream_load(o.h))
    except BaseException:
        state.destroy()
        raise
    del keep
    for t in state.tensors:
        state.bind(t, "home")
    return _start(state, lookahead)


def release(model, handle: Optional[OffloadHandle] = None) -> None:
    """Removes laden's hooks, frees every byte of RAM and VRAM laden holds
    for the model, and leaves its laden-loaded parameters and buffers on
    ``meta`` (the tensor objects themselves: a parameter taken from the
    model before is on meta too).  Afterwards a forward of the model or of
    its blocks raises StateError, and so do the handle's methods.

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
    s = lib.laden_stream_close(o.h)
    if s:
        err = error_for(s)
        raise StateError(f"release: {state.name}: {err}", err.status,
                         err.code)
    # Closed: no thread gets into the schedule any more, and from now on
    # the model and its blocks refuse to run (before their hooks go, so
    # that no forward of another thread runs half on meta weights).
    _mark_released(model, state)
    _unwrap_root(state)
    for hk in state.hooks:
        hk.remove()
    state.hooks.clear()
    h = state.handle
    if h is not None:
        h._unwrap()
    state.gone.clear()
    for t in state.tensors:
        state._set(t, _meta(t))
    if state.device.type == "cuda":
        # The model's kernels must be done with its memory before it goes
        # (a VBAR's pages are unmapped without the wait of a device free).
        torch.cuda.synchronize(state.device)
    if h is not None:
        h._drop_workspace()
    left = weakref.ref(o)
    del o
    state.destroy()
    if getattr(model, "_laden_stream", None) is state:
        del model._laden_stream
    if left() is not None:
        log.warning("laden.release: tensors taken from %s still use "
                    "laden's memory; it is freed when they are gone",
                    state.name)
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
