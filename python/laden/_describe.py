"""How laden sees a model: its unique tensors (tied aliases grouped), its
blocks, which checkpoint tensor fills each (``key_map``, ``skip_prefixes``,
fp8 scale companions), how each is stored, and the C schedule that holds
them.  The one description that streaming, the cache, planning and the
VBAR surface share: sizes and tiers are decided in C
(``laden_sched_plan``), never here.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass, field
from typing import (Callable, Dict, Iterable, List, Mapping, Optional,
                    Sequence, Tuple, Union)

from . import _lib
from . import checkpoint as _checkpoint  # its _progress_bar: tests swap it
from .gguf import rope_heads, rope_heads_of
from ._devices import _dev_index
from ._dtypes import checkpoint_dtype
from ._expand import expand_unavailable
from ._hfnames import key_map_for, peft_key_map
from ._moe import expert_modules
from ._wrapped import attach, detach_all, holders, is_dtensor, is_wrapped
from ._lib import check, error_for, lib
from .errors import InvalidArgumentError, MismatchError


log = logging.getLogger("laden")

TIER_NAMES = {_lib.TIER_GPU: "resident", _lib.TIER_RAM: "ram",
              _lib.TIER_DISK: "disk"}

_DTYPE_CODE = {}
for _i in range(64):
    _n = lib.laden_dtype_name(_i)
    if _n is None:
        break
    _DTYPE_CODE[_n.decode()] = _i


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
    # Several checkpoint tensors laid end to end make this one, in order
    # (ckpt_name is the first): transformers' fused MoE experts.
    pieces: Optional[List[str]] = None
    block: int = -1                    # index into _Stream.blocks; -1: rest
    c_block: int = 0
    c_index: int = 0
    param: Optional[object] = None     # the Parameter laden made
    # Compact storage expanded on the device when the block runs:
    # "q8": quantized by laden to e4m3 with a float32 scale per row;
    # "ck8": fp8 as in the checkpoint, with its scale tensor (scale_name)
    # of kind "tensor", "row" or "block" (128 x 128 tiles), or none;
    # "c16": stored in bf16, run in another compute dtype;
    # "gq": a GGUF block type (store_dtype) as stored, expanded in C.
    store: str = "plain"
    store_dtype: Optional[str] = None  # checkpoint dtype name stored
    scale_name: Optional[str] = None
    scale_kind: Optional[str] = None
    scale_index: int = -1
    persistent: bool = True            # False: a buffer no checkpoint holds
    rope_heads: int = 0                # GGUF Llama q/k: rows put back on load
    source: Optional[object] = None    # built, not in the checkpoint: the
                                       # host copy laden copies at load
    # A DTensor (tensor parallel): laden holds this rank's local shard
    # (shape is the local one) and rebuilds the DTensor around it.
    dist: Optional["_Dist"] = None
    # What the block runs with, when that is memory other blocks reuse (a
    # slot, the expansion workspace): bound into the module only between
    # the block's enter and exit (bind_in / bind_out); outside it the
    # module holds `param`, the tensor's own value (its host copy, or
    # meta where it has none in memory).  None: `param` is used always.
    run: Optional[object] = None
    run_block: Optional[str] = None    # a gradient of `run` would be wrong


@dataclass
class _Dist:
    """How a DTensor's local shard sits in the whole tensor: on `mesh` with
    `placements`, the global shape and stride; the shard is indices
    [start, start + count) of dimension `dim` (None: the whole tensor, a
    replica)."""

    mesh: object
    placements: tuple
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dim: Optional[int]
    start: int
    count: int


def _dist_of(v, name: str) -> _Dist:
    """The _Dist of DTensor `v` (parameter or buffer `name`).  One sharded
    dimension at most (Shard on a 1-D mesh, or shards of one dimension);
    Partial placements are refused."""
    try:
        from torch.distributed.tensor._utils import \
            compute_local_shape_and_global_offset as local_of
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import \
            compute_local_shape_and_global_offset as local_of
    placements = tuple(v.placements)
    for p in placements:
        if type(p).__name__ not in ("Shard", "Replicate"):
            # _StridedShard (FSDP2 with TP) and others: the local data is
            # not one slice of the whole tensor.
            raise InvalidArgumentError(
                f"'{name}': a DTensor placed {p!r}: laden loads Shard and "
                "Replicate placements (a checkpoint holds whole tensors)",
                "E_INVAL")
    shape = tuple(v.shape)
    local, offset = local_of(v.shape, v.device_mesh, placements)
    local, offset = tuple(local), tuple(offset)
    dims = [d for d in range(len(shape)) if local[d] != shape[d]]
    if len(dims) > 1:
        raise InvalidArgumentError(
            f"'{name}': a DTensor sharded along {len(dims)} dimensions "
            f"(local {list(local)} of {list(shape)}); laden reads a shard "
            "along one dimension", "E_INVAL")
    d = dims[0] if dims else None
    return _Dist(v.device_mesh, placements, shape, tuple(v.stride()), d,
                 offset[d] if d is not None else 0,
                 local[d] if d is not None else 0)


@dataclass
class BlockInfo:
    name: str
    module: object = field(repr=False)
    tier: int
    nbytes: int = 0                    # as laid out, from C
    c_block: int = 0
    tensors: List[_Tensor] = field(default_factory=list, repr=False)
    offloaded: bool = False  # chosen for the device, got no room: streams
    source: str = ""         # the prefix that named it
    # A mixture-of-experts layer's experts module, a block inside its
    # layer's block: its tensors are `experts` rows each, of which a call
    # moves those it is routed to (laden_sched_set_experts).
    experts: int = 0

    @property
    def tier_name(self) -> str:
        return TIER_NAMES[self.tier]


def new_schedule(device, ck, lookahead: int = 0, flags: int = 0,
                 name: str = ""):
    """A C schedule for `device` over checkpoint `ck` (a Checkpoint, or
    None: every tensor from host memory), called `name` in traces; the
    caller owns the handle."""
    cfg = _lib.SchedConfig(_dev_index(device), lookahead, 0, None, flags)
    h = ctypes.c_void_p()
    check(lib.laden_sched_create(ctypes.byref(cfg),
                                 ck._h if ck is not None else None,
                                 ctypes.byref(h)))
    if name:
        lib.laden_sched_set_name(h, name.encode("utf-8", "replace"))
    return h


def _destroy_schedule(sched, binding=None, *keep) -> None:
    """A schedule's destructor.  `binding` ([(cache, id)] or [None]) is a
    cached model's place in its C cache: unbound first (when the model was
    dropped with the cache, not by it), so the cache never holds a freed
    schedule.  `keep` must outlive the schedule (a VRAM context)."""
    if binding is not None and binding[0] is not None:
        cache, cid = binding[0]
        binding[0] = None
        lib.laden_cache_deactivate(cache.h, cid, 0)  # if still in use
        lib.laden_cache_unbind(cache.h, cid)
        lib.laden_cache_remove(cache.h, cid)
    lib.laden_sched_destroy(sched)


def _numel(t: _Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


_SCALE_KIND = {"tensor": _lib.SCALE_TENSOR, "row": _lib.SCALE_ROW,
               "block": _lib.SCALE_TILE128}


def _nbytes(t: _Tensor) -> int:
    """Bytes as expanded for compute."""
    import torch

    return _numel(t) * torch.empty((), dtype=t.dtype).element_size()



_SCALE_SUFFIXES = ("_scale_inv", "_scale")


# ---- finding blocks ----------------------------------------------------------

def _module_at(model, path: str):
    mod = model
    for part in [p for p in path.split(".") if p]:
        if not hasattr(mod, "_modules") or part not in mod._modules:
            return None
        mod = mod._modules[part]
    return mod


def _find_blocks(model, prefixes: Sequence[str]) -> List[BlockInfo]:
    """Module paths for the given prefixes: a prefix naming a container
    (ModuleList, Sequential, ModuleDict) stands for each of its children; a
    prefix naming another module is one block."""
    import torch.nn as nn

    blocks: List[BlockInfo] = []
    for prefix in prefixes:
        path = prefix.rstrip(".")
        mod = _module_at(model, path)
        if mod is None:
            raise InvalidArgumentError(
                f"block '{prefix}' names no module of the model (its block "
                f"containers: {', '.join(find_blocks(model)) or 'none'})",
                "E_INVAL")
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            for name, child in mod.named_children():
                blocks.append(BlockInfo(f"{path}.{name}." if path else
                                    f"{name}.", child, _lib.TIER_AUTO,
                                    source=prefix))
        else:
            blocks.append(BlockInfo(path + "." if path else "", mod,
                                    _lib.TIER_AUTO, source=prefix))
    names = [b.name for b in blocks]
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
    """Unique tensors of the model (parameters and buffers): aliases (the
    (module, attribute) pairs holding one tensor, as tied weights) and the
    names of every path to each, as a state_dict names them."""
    by_id: Dict[int, _Tensor] = {}
    out: List[_Tensor] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = mod_name + "." if mod_name else ""
        for is_param, table in ((True, mod._parameters),
                                (False, mod._buffers)):
            for attr, v in table.items():
                if v is None or (is_param and is_wrapped(mod, attr)):
                    continue  # a quantized wrapper: its holder's tensors
                t = by_id.get(id(v))
                if t is None:
                    dist = _dist_of(v, prefix + attr) if is_dtensor(v) \
                        else None
                    shape = tuple(v.shape) if dist is None else \
                        tuple(v._local_tensor.shape)
                    t = _Tensor([], [], is_param, shape, v.dtype,
                                is_param and v.requires_grad)
                    t.dist = dist
                    t.persistent = is_param or \
                        attr not in mod._non_persistent_buffers_set
                    by_id[id(v)] = t
                    out.append(t)
                if (mod, attr) not in t.aliases:
                    t.aliases.append((mod, attr))
                if prefix + attr not in t.names:
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


def check_lookahead(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or \
            not 1 <= n <= _lib.LOOKAHEAD_MAX:
        raise InvalidArgumentError(
            f"lookahead {n!r}: give 1 to {_lib.LOOKAHEAD_MAX}", "E_INVAL")


def find_blocks(model, min_share: float = 0.05,
                max_share: float = 0.125) -> List[str]:
    """The module paths of a model's repeated blocks, found by structure:
    every ModuleList or Sequential of two or more modules that each hold
    parameters (not all of them lists), outermost first, holding at least
    ``min_share`` of the model's parameters; a path ending in ``.`` that
    names a list stands for each of its children.  Finds ``model.layers``,
    ``transformer.h``, ``encoder.layer``, ``encoder.block`` and
    ``decoder.block``, ``transformer_blocks`` without a table of names.
    Where a list's largest child holds more than ``max_share`` of the
    model (a UNet's four ``down_blocks``), each child is split into the
    lists found inside it (its ``resnets``, ``attentions``), or is a
    block of its own when it has none: the slots streaming needs are the
    size of the largest block."""
    import torch.nn as nn

    lists = (nn.ModuleList, nn.Sequential)

    def count(m) -> int:
        return sum(p.numel() for p in m.parameters())

    total = count(model) or 1

    def has_params(m) -> bool:
        return any(True for _ in m.parameters())

    def qualifies(mod, floor: float) -> bool:
        kids = list(mod.children())
        return isinstance(mod, lists) and len(kids) >= 2 and \
            all(has_params(c) for c in kids) and \
            not all(isinstance(c, lists) for c in kids) and \
            count(mod) >= floor

    def visit(prefix: str, mod, out: List[str], floor: float) -> None:
        for name, child in mod.named_children():
            path = prefix + name
            if not qualifies(child, floor):
                visit(path + ".", child, out, floor)
                continue
            kids = list(child.named_children())
            inner = {}
            if max(count(c) for _, c in kids) > max_share * total:
                for k, c in kids:  # too coarse: the lists inside each child
                    inner[k] = []
                    visit(f"{path}.{k}.", c, inner[k], 0)
            if not any(inner.values()):
                out.append(path + ".")
                continue
            for k, _ in kids:
                out.extend(inner[k] or [f"{path}.{k}."])

    found: List[str] = []
    visit("", model, found, min_share * total)
    return found


# ---- the description -----------------------------------------------------------

_FP8 = {"F8_E4M3", "F8_E5M2"}
# A checkpoint name -> the model's name (None: dropped), or (the model's
# name, k): the k-th of several checkpoint tensors laid end to end as that
# one tensor (transformers' fused MoE experts; C joins them on load).
KeyTarget = Union[None, str, Tuple[str, int]]
KeyMap = Union[None, Mapping[str, KeyTarget], Callable[[str], KeyTarget]]


@dataclass
class Description:
    """A model as laden will hold it.  ``tensors``: every unique tensor,
    each filled from the checkpoint (``ckpt_name``) or copied as built
    (``built``, names in ``kept``); ``blocks``: the blocks, each with the
    tensors all of whose aliases are inside it (the rest -- tied across
    blocks, or outside every block -- is resident)."""

    tensors: List[_Tensor]
    blocks: List[BlockInfo]

    @property
    def kept(self) -> List[str]:
        return [t.names[0] for t in self.tensors if t.ckpt_name is None]

    def rest(self) -> List[_Tensor]:
        return [t for t in self.tensors if t.block < 0]


def _assign_blocks(model, blocks: List[BlockInfo], tensors: List[_Tensor],
                   built_in_rest: bool) -> None:
    """t.block: the one block that every path to every alias of t is
    inside, else -1 (the rest).  By module identity over every path: a
    module reachable from two blocks, or from a block and from outside
    every block, belongs to none (it would run from a slot that other
    blocks overwrite).  With `built_in_rest`, tensors the checkpoint lacks
    are in the rest: they are copied from host memory, which a disk block
    cannot be."""
    roots = {id(b.module): bi for bi, b in enumerate(blocks)}
    owners: Dict[int, set] = {}

    def walk(mod, home: int, seen: tuple) -> None:
        home = roots.get(id(mod), home)
        owners.setdefault(id(mod), set()).add(home)
        for child in mod._modules.values():
            if child is not None and id(child) not in seen:
                walk(child, home, seen + (id(child),))

    walk(model, -1, (id(model),))
    for t in tensors:
        homes = set().union(*(owners.get(id(m), {-1}) for m, _ in t.aliases))
        t.block = homes.pop() if len(homes) == 1 else -1
        if built_in_rest and t.ckpt_name is None:
            t.block = -1
        if t.block >= 0:
            blocks[t.block].tensors.append(t)


def _current(t: _Tensor):
    return getattr(t.aliases[0][0], t.aliases[0][1])


def _mismatch_text(where: str, label: str, groups) -> str:
    msg = [f"{where} does not match {label}:"]
    for what, items in groups:
        if items:
            msg.append(f"{what} ({len(items)}): " + ", ".join(items[:20])
                       + (" ..." if len(items) > 20 else ""))
    return " ".join(msg)


def _match_names(ck, tensors: List[_Tensor], key_map: KeyMap,
                 skip_prefixes, label: str, scales: bool) -> None:
    """Sets t.ckpt_name (and t.scale_name for fp8 tensors with a scale);
    MismatchError listing every missing, unexpected and unbuilt name."""
    owner: Dict[str, _Tensor] = {n: t for t in tensors for n in t.names}
    unexpected: List[str] = []
    pieces: Dict[int, Tuple[_Tensor, List[Tuple[int, str]]]] = {}
    for cname in ck.names():
        if skip_prefixes and any(cname.startswith(p) for p in skip_prefixes):
            continue
        mname = cname
        if key_map is not None:
            mname = key_map(cname) if callable(key_map) else key_map.get(
                cname, cname)
            if mname is None:
                continue
        k = None
        if isinstance(mname, tuple):  # a piece of a joined tensor
            mname, k = mname
        t = owner.get(mname)
        if t is None:
            unexpected.append(cname)
        elif k is not None:
            pieces.setdefault(id(t), (t, []))[1].append((k, cname))
        elif t.ckpt_name is None:
            t.ckpt_name = cname  # a tied alias's second name is the same
    for t, parts in pieces.values():
        parts.sort()
        ks = [k for k, _ in parts]
        if t.ckpt_name is not None or len(set(ks)) != len(ks):
            raise MismatchError(
                f"{ck.path}: the key map gives '{t.names[0]}' "
                + (f"both '{t.ckpt_name}' and pieces" if t.ckpt_name
                   else f"two pieces numbered alike ({ks})"),
                mismatched=[t.names[0]])
        t.pieces = [c for _, c in parts]
        t.ckpt_name = t.pieces[0]
    # Scale tensors of fp8 checkpoint tensors are companions, not strays.
    by_ckpt = {t.ckpt_name: t for t in tensors if t.ckpt_name}
    still = []
    for cname in unexpected:
        base = next((cname[:-len(sfx)] for sfx in _SCALE_SUFFIXES
                     if cname.endswith(sfx)), None)
        t = by_ckpt.get(base) if base and scales else None
        if t is not None and ck.info(base).dtype in _FP8:
            t.scale_name = cname
        else:
            still.append(cname)
    unexpected = still
    missing, unbuilt = [], []
    for t in tensors:
        if t.ckpt_name is None and _current(t).device.type == "meta":
            (missing if t.persistent else unbuilt).append(t.names[0])
    if unbuilt and not (missing or unexpected):
        raise MismatchError(
            f"non-persistent buffers are on meta and no checkpoint holds "
            f"them: {', '.join(unbuilt[:20])}; build them on the CPU (create "
            "them outside the meta device context)", missing=unbuilt)
    if missing or unexpected:
        text = _mismatch_text(ck.path, label, (
            ("missing from the checkpoint", missing),
            ("unexpected in the checkpoint", unexpected)))
        raise MismatchError(text + " (key_map renames checkpoint names, "
                            "skip_prefixes drops them)", missing, unexpected)


def _check_dtypes(ck, tensors: List[_Tensor], cdt, label: str,
                  compact: bool, expand_blocks: bool = True) -> None:
    """Shapes (every difference in one MismatchError) and the dtype each
    tensor is kept in: the model's, or cdt for floating tensors."""
    bad = []
    for t in tensors:
        if t.ckpt_name is None:
            continue
        if t.pieces is not None:
            why = _pieces_mismatch(ck, t)
            if why:
                bad.append(f"'{t.names[0]}' ({why})")
            continue
        info = ck.info(t.ckpt_name)
        whole = t.dist.shape if t.dist is not None else t.shape
        if tuple(info.shape) != tuple(whole):
            bad.append(f"'{t.names[0]}' (checkpoint '{t.ckpt_name}' "
                       f"{list(info.shape)}, model {list(whole)})")
    if bad:
        raise MismatchError(_mismatch_text(ck.path, label, (
            ("shapes differ", bad),)), mismatched=[b.split("'")[1]
                                                   for b in bad])
    flags = _lib.STORE_IN_BLOCK  # its block is not known yet: what
    # refuses a dtype does not depend on it (laden_sched_storage_for)
    if compact:
        flags |= _lib.STORE_COMPACT
    if expand_blocks:
        flags |= _lib.STORE_EXPANDS_BLOCKS
    for t in tensors:
        if t.ckpt_name is None:
            continue  # copied as built, in its own dtype
        want = t.dtype
        info = ck.info(t.ckpt_name)
        if cdt is not None and want.is_floating_point and \
                info.torch_dtype is not None and \
                info.torch_dtype.is_floating_point:
            want = cdt
        s, _ = _storage_for(t, info, want, flags)
        if s:
            raise MismatchError(
                f"tensor '{t.names[0]}': the checkpoint's "
                f"'{t.ckpt_name}' is {info.dtype}, {label} wants "
                f"{want}; {error_for(s)}", mismatched=[t.names[0]])
        t.dtype = want


def _pieces_mismatch(ck, t: _Tensor) -> Optional[str]:
    """Why t's pieces cannot be laid end to end as t (None: they can):
    one dtype, rows as wide as t's, as many elements as t."""
    infos = [ck.info(n) for n in t.pieces]
    if t.dist is not None:
        return "a DTensor shard cannot be made of several checkpoint " \
            "tensors"
    dts = {i.dtype for i in infos}
    if len(dts) > 1:
        return f"its pieces {t.pieces[0]} ... are of dtypes " \
            f"{', '.join(sorted(dts))}"
    for i in infos:
        shape = tuple(i.shape)
        k = len(shape) - 1
        if k < 0 or k > len(t.shape) or (k and shape[1:] != t.shape[-k:]):
            return f"piece '{i.name}' {list(shape)} is not rows of " \
                f"{list(t.shape)}"
    n = sum(math.prod(i.shape) for i in infos)
    if n != _numel(t):
        return f"its {len(infos)} pieces ({t.pieces[0]} ...) hold {n} " \
            f"elements, the model's {list(t.shape)} {_numel(t)}"
    return None


# laden_sched_storage_for's kinds (LADEN_STORE_*, from C's table) by the
# names the rest of the package uses.
_STORES = {_lib.STORE_PLAIN: "plain", _lib.STORE_CHECKPOINT_FP8: "ck8",
           _lib.STORE_BLOCKS: "gq", _lib.STORE_FP8: "q8",
           _lib.STORE_BF16: "c16"}


def _storage_for(t: _Tensor, info, want, flags: int):
    """C's storage rule for t (laden_sched_storage_for): (status, kind)."""
    try:
        code = _DTYPE_CODE[checkpoint_dtype(want)]
    except (KeyError, ValueError):
        code = -1  # a dtype laden has no name for: C refuses it
    kind = ctypes.c_uint32()
    s = lib.laden_sched_storage_for(_DTYPE_CODE[info.dtype], code,
                                    len(t.shape), _numel(t), flags,
                                    ctypes.byref(kind))
    return s, kind.value


def _choose_storage(ck, desc: Description, storage: Optional[str],
                    compact: bool, expand_blocks: bool) -> None:
    """The form each checkpoint tensor is kept in, as C decides it
    (laden_sched_storage_for): compact forms are expanded on the device
    when their block runs (fp8 checkpoint tensors, GGUF blocks, storage
    "fp8" or "bf16")."""
    base = (_lib.STORE_COMPACT if compact else 0) | \
        (_lib.STORE_EXPANDS_BLOCKS if expand_blocks else 0) | \
        (_lib.STORE_ASK_FP8 if storage == "fp8" else 0) | \
        (_lib.STORE_ASK_BF16 if storage == "bf16" else 0)
    for t in desc.tensors:
        if t.ckpt_name is None:
            continue
        info = ck.info(t.ckpt_name)
        flags = base | (_lib.STORE_IN_BLOCK if t.block >= 0 else 0) | \
            (_lib.STORE_PARAM if t.is_param else 0) | \
            (_lib.STORE_SCALED if t.scale_name else 0)
        if t.pieces is not None:  # joined in C: kept as read, never compact
            flags &= ~(_lib.STORE_ASK_FP8 | _lib.STORE_ASK_BF16)
        s, kind = _storage_for(t, info, t.dtype, flags)
        if t.pieces is not None and not s and _STORES[kind] != "plain":
            raise InvalidArgumentError(
                f"tensor '{t.names[0]}': its checkpoint pieces "
                f"({t.pieces[0]} ...) are {info.dtype}, kept compact, and "
                "laden joins only plain tensors (F32, F16, BF16 and other "
                "whole-byte dtypes)", "E_INVAL")
        if t.scale_name and (s or _STORES[kind] == "ck8"):
            t.scale_kind = _scale_kind(t, ck)  # its own error first
        if s:
            raise MismatchError(f"tensor '{t.names[0]}': {error_for(s)}",
                                mismatched=[t.names[0]])
        t.store = _STORES[kind]
        if t.store in ("ck8", "gq"):
            t.store_dtype = info.dtype


def describe(model, ck, prefixes: Sequence[str], *, key_map: KeyMap = None,
             skip_prefixes: Optional[Sequence[str]] = None, cdt=None,
             storage: Optional[str] = None, compact: bool = True,
             device=None, transient: bool = False,
             label: str = "the model",
             expert_rows: bool = False) -> Description:
    """The description of `model` (built on meta or not) for checkpoint
    `ck` (a Checkpoint, or None: every tensor as built).  Tensors the
    checkpoint lacks that were built (not on meta) are copied into laden's
    memory as they are, with the rest of the model.  `compact`: the caller
    expands compact forms when a block runs (streaming); without it fp8
    checkpoint tensors are decoded on load and a scale tensor is a
    mismatch.  GGUF block-quantized tensors stay compact when `compact`
    and `device` can expand them (else they are expanded on load, with a
    warning); a Llama GGUF file's q/k rows are put back in transformers'
    order on load.  Raises before anything is allocated: MismatchError naming
    every name or shape that does not match, InvalidArgumentError for a bad
    prefix or a tensor with nothing to fill it.  Quantized tensor
    subclasses get holders of their inner tensors (laden._wrapped); a
    description that fails, or a `transient` one (a plan), takes them off
    again.  `expert_rows`: each mixture-of-experts layer's experts module
    inside a block is a block of its own, right after it, whose calls move
    only the rows of the experts they are routed to."""
    had = bool(holders(model))
    attach(model)  # quantized wrappers: their inner tensors, held apart
    try:
        desc = _describe(model, ck, prefixes, key_map, skip_prefixes, cdt,
                         storage, compact, device, label, expert_rows)
    except BaseException:
        if not had:
            detach_all(model)
        raise
    if transient and not had:
        detach_all(model)
    return desc


def _describe(model, ck, prefixes, key_map, skip_prefixes, cdt, storage,
              compact, device, label, expert_rows=False) -> Description:
    expand_blocks = True
    if compact and ck is not None and ck.format == "gguf" and \
            device is not None:
        why = expand_unavailable(device)
        if why:
            log.warning("laden: %s: GGUF blocks expanded on load, not where "
                        "they run (%s): they take their expanded size in "
                        "RAM and on the link", ck.path, why)
            expand_blocks = False
    blocks = _find_blocks(model, list(prefixes))
    if expert_rows:
        blocks = _with_expert_blocks(blocks)
    tensors = _collect(model)
    if ck is not None and key_map is None and ck.format != "gguf":
        # A transformers model: its checkpoint's names as transformers
        # loads them (renames, fused experts).
        key_map = peft_key_map(model, ck.names()) or \
            key_map_for(model, ck.names())
    if ck is not None:
        _match_names(ck, tensors, key_map, skip_prefixes, label, compact)
    else:
        bad = [t.names[0] for t in tensors
               if _current(t).device.type == "meta"]
        if bad:
            raise InvalidArgumentError(
                f"{label}: tensors on meta and no checkpoint: "
                f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}; "
                "build the model on the CPU, or on meta with a checkpoint",
                "E_INVAL")
    if ck is not None:
        _check_dtypes(ck, tensors, cdt, label, compact, expand_blocks)
        if ck.format == "gguf":

            heads = rope_heads(ck.metadata, ck.path)
            for t in tensors:
                if t.ckpt_name is not None:
                    t.rope_heads = rope_heads_of(t.ckpt_name, heads)
    _assign_blocks(model, blocks, tensors, built_in_rest=ck is not None)
    desc = Description(tensors, blocks)
    if ck is not None:
        _choose_storage(ck, desc, storage, compact, expand_blocks)
    for b in blocks:
        odd = [t.names[0] for t in b.tensors if t.store != "plain"] \
            if b.experts else []
        if odd:
            raise InvalidArgumentError(
                f"{b.name}: the experts' tensors {', '.join(odd[:3])} are "
                "kept compact, and a call moves an expert's rows as they "
                "are stored; load with expert_rows=False (whole layers "
                "stream) or keep them in a plain dtype", "E_INVAL")
    return desc


def _with_expert_blocks(blocks: List[BlockInfo]) -> List[BlockInfo]:
    """blocks, each followed by a block for every experts module inside it
    (laden._moe): the order they are entered in."""
    out: List[BlockInfo] = []
    for b in blocks:
        out.append(b)
        for path, mod, n in expert_modules(b.module):
            out.append(BlockInfo(b.name + path, mod, b.tier,
                                 source=b.source, experts=n))
    return out


class progress_to:
    """Context manager: while it is open the C schedule `h` reports load
    progress into a tqdm bar (see checkpoint._progress_bar: on a terminal
    for loads of 1 GiB or more, or when `progress` is True; never when it
    is False), made at C's first report with the total C counts.  The
    callback runs on the loading thread.  An exception in it
    (KeyboardInterrupt: Ctrl-C during the load) cancels the load in C and
    is raised when the block ends; `check()` raises it earlier, between
    calls into C."""

    def __init__(self, h, desc: str, progress):
        self.h, self.desc, self.progress = h, desc, progress
        self.bar = None
        self.fn = None
        self.raised: Optional[BaseException] = None

    def __enter__(self):
        # Installed with or without a bar: a load on this thread calls it
        # between pieces, which is where Ctrl-C reaches Python (a call
        # into C is not interrupted): it stops the load there.
        def update(arg, done, total):
            try:
                if self.bar is None and self.progress is not False:
                    self.bar = _checkpoint._progress_bar(
                        total, self.desc, self.progress) or False
                if self.bar and hasattr(self.bar, "reset") and \
                        total != getattr(self.bar, "total", total):
                    # a load in two parts (compression="lossless": the
                    # weights read and encoded, then the blocks loaded)
                    self.bar.reset(total=total)
                if self.bar:
                    self.bar.update(done - self.bar.n)
                return 0
            except BaseException as e:  # Ctrl-C lands here too
                self.raised = e
                return 1  # stop the load

        self.fn = _lib.PROGRESS_FN(update)
        if self.h is not None:  # else the caller passes fn to C itself
            check(lib.laden_sched_set_progress(self.h, self.fn, None))
        return self

    def check(self) -> None:
        if self.raised is not None:
            raise self.raised

    def __exit__(self, *exc):
        if self.fn is not None:
            if self.h is not None:
                lib.laden_sched_set_progress(self.h, _lib.PROGRESS_FN(),
                                             None)
            if self.bar:
                self.bar.close()
        self.check()


def _store_code(t: _Tensor) -> int:
    if t.store == "q8":
        return _DTYPE_CODE["F8_E4M3"]
    if t.store == "c16":
        return _DTYPE_CODE["BF16"]
    if t.store in ("ck8", "gq"):
        return _DTYPE_CODE[t.store_dtype]
    return _dtype_code(t.dtype, t)


def _dtype_code(dtype, t: _Tensor) -> int:
    try:
        return _DTYPE_CODE[checkpoint_dtype(dtype)]
    except ValueError as e:
        raise InvalidArgumentError(f"tensor '{t.names[0]}': {e}",
                                   "E_INVAL") from None


def fill(h, desc: Description, ck, rest_tier: int,
         rest_in_pieces: bool = False,
         expand: bool = False) -> List[List[_Tensor]]:
    """Adds the description to the C schedule `h`: the rest first (one
    block on `rest_tier`, or with `rest_in_pieces` the pieces C splits it
    into, laden_sched_pieces), then
    one block per block on its tier (b.tier: asked, or TIER_AUTO for the
    planner).  With `expand`, each block's compact tensors are marked
    for C's expansion workspace (laden_sched_set_expanded).  Sets every
    tensor's (c_block, c_index) and every block's
    c_block.  Returns the groups in C block order; tensors copied as built
    hold their host source in t.source until the caller drops it after
    load."""
    rest = list(desc.rest())
    groups: List[List[_Tensor]] = [rest]
    if rest_in_pieces:
        n = len(rest)
        sizes = (ctypes.c_uint64 * max(n, 1))(*[_nbytes(t) for t in rest])
        piece_of = (ctypes.c_uint32 * max(n, 1))()
        npieces = ctypes.c_uint32()
        check(lib.laden_sched_pieces(sizes, n, 0, piece_of,
                                     ctypes.byref(npieces)))
        groups = [[] for _ in range(npieces.value)]
        for k, t in enumerate(rest):
            groups[piece_of[k]].append(t)
    tiers = [rest_tier] * len(groups) + [b.tier for b in desc.blocks]
    groups += [b.tensors for b in desc.blocks]
    cb = ctypes.c_uint32()
    nrest = len(groups) - len(desc.blocks)
    for gi, (tier, ts) in enumerate(zip(tiers, groups)):
        check(lib.laden_sched_add_block(h, tier, ctypes.byref(cb)))
        if gi >= nrest:
            blk = desc.blocks[gi - nrest]
            blk.c_block = cb.value
            if blk.name:  # for traces
                check(lib.laden_sched_set_block_name(
                    h, cb.value, blk.name.rstrip(".").encode("utf-8",
                                                             "replace")))
        for t in ts:
            _add_tensor(h, cb.value, t, ck)
        if gi >= nrest and desc.blocks[gi - nrest].experts and ts:
            check(lib.laden_sched_set_experts(
                h, cb.value, desc.blocks[gi - nrest].experts))
        for t in ts if expand and gi >= nrest else ():
            if t.store != "plain":  # expanded by C's enter (its scale added)
                scaled = t.store == "ck8" and t.scale_name
                check(lib.laden_sched_set_expanded(
                    h, cb.value, t.c_index, _dtype_code(t.dtype, t),
                    t.shape[-1] if t.shape else 1,
                    t.scale_index if scaled else _lib.SCHED_NO_SCALE,
                    _SCALE_KIND[t.scale_kind] if scaled else 0))
    return groups


def _add_tensor(h, block: int, t: _Tensor, ck) -> None:
    ci = ctypes.c_uint32()

    if t.dist is not None and t.dist.dim is not None and \
            t.ckpt_name is not None:  # this rank's shard alone
        if t.store not in ("plain", "c16"):
            raise InvalidArgumentError(
                f"'{t.names[0]}': a DTensor shard stored as {t.store}; "
                "tensor-parallel tensors load in plain dtypes (no fp8 or "
                "GGUF storage)", "E_INVAL")
        d = t.dist
        check(lib.laden_sched_add_tensor_part(
            h, block, ck._h, ck._index[t.ckpt_name], _store_code(t), d.dim,
            d.start, d.count, ctypes.byref(ci)))
        t.c_block, t.c_index = block, ci.value
        return
    if t.pieces is not None:  # laid end to end by C
        code = _store_code(t)
        for k, n in enumerate(t.pieces):
            check(lib.laden_sched_add_tensor(h, block, ck._h, ck._index[n],
                                             code, ctypes.byref(ci)))
            if k == 0:
                t.c_block, t.c_index = block, ci.value
            else:
                check(lib.laden_sched_join_tensor(h, block, ci.value))
        return
    if t.ckpt_name is not None:  # C names the checkpoint tensor
        check(lib.laden_sched_add_tensor(h, block, ck._h,
                                         ck._index[t.ckpt_name],
                                         _store_code(t), ctypes.byref(ci)))
        t.c_block, t.c_index = block, ci.value
        if t.rope_heads:
            check(lib.laden_sched_set_rope_rows(h, block, ci.value,
                                                t.rope_heads))
        if t.store == "ck8" and t.scale_name:
            sinfo = ck.info(t.scale_name)
            check(lib.laden_sched_add_tensor(
                h, block, ck._h, ck._index[t.scale_name],
                _DTYPE_CODE[sinfo.dtype], ctypes.byref(ci)))
            t.scale_index = ci.value
        return
    src = _current(t).detach()
    if is_dtensor(src):
        src = src.to_local()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    code, scode = _store_code(t), _dtype_code(src.dtype, t)
    t.source = src
    s = lib.laden_sched_add_host_tensor(h, block,
                                        ctypes.c_void_p(src.data_ptr()),
                                        scode, src.numel(), code,
                                        ctypes.byref(ci))
    if s:  # a host tensor has no name in C: name it here
        err = error_for(s)
        raise type(err)(f"tensor '{t.names[0]}' (built, not in the "
                        f"checkpoint): {err}", err.status, err.code)
    t.c_block, t.c_index = block, ci.value
