"""Adapters on streamed and resident weights: LoRA factors (as peft and as
kohya/diffusers write them), full-rank deltas and replacement values.

Per target parameter the update is ``strength * (scale * B @ A + delta)``;
a replacement value replaces.  Two modes (``OffloadHandle.set_adapters``):

- ``"merge"``: the update is added on the device where the weight runs,
  never to its host copy: a streamed block's slot right after it lands
  (C counts the slot's fills, so a block still in its slot is not merged
  twice, and ``laden_sched_refill`` brings the original bytes back), a
  resident tensor in place (``laden_sched_reread`` reads it from the
  checkpoint again when the adapters change).
- ``"routed"``: the weights stay; ``nn.Linear`` targets add
  ``x @ (scale * B @ A + delta).T * strength`` to their output.

``merge_adapter`` makes an update permanent (the RAM-tier host copy
included).  The reading is laden's (``Checkpoint``); this module maps
names and shapes and runs the arithmetic where the weights are.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from . import _lib
from ._lib import check, error_for, lib
from ._bind import _tensor_view, run_of
from ._describe import _dist_of, _Tensor
from ._sched import _pass
from ._wrapped import is_dtensor
from .checkpoint import Checkpoint, PathLike, read_text
from .errors import InvalidArgumentError, LadenError, StateError
from .sharing import refuse_writes

__all__ = ["AdapterSpec", "merge_adapter", "set_adapters"]

log = logging.getLogger("laden")

_LORA = {"lora_A.weight": "A", "lora_B.weight": "B",
         "lora_down.weight": "A", "lora_up.weight": "B",
         "lora.down.weight": "A", "lora.up.weight": "B"}
_DELTA = {"delta.weight": "weight", "delta.bias": "bias"}
# Wrappers around module names in adapter files (peft's, diffusers').
_WRAPPERS = ("base_model.model.", "unet.", "transformer.", "text_encoder.",
             "text_encoder_2.", "model.")
_KOHYA = ("lora_unet_", "lora_te1_", "lora_te2_", "lora_te_",
          "lora_transformer_")
# peft keys of adapter kinds laden does not apply: refused, never skipped.
_UNSUPPORTED = ("lora_magnitude_vector", "lora_embedding_A",
                "lora_embedding_B", "lora_B.bias", "base_layer.",
                "modules_to_save.")


class AdapterError(InvalidArgumentError):
    """An adapter that does not fit the model: the message names the
    targets, shapes or formats."""


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter: ``source`` is a safetensors file, a directory peft wrote
    (``adapter_model.safetensors`` and ``adapter_config.json``, whose
    ``lora_alpha``, ``alpha_pattern`` and ``use_rslora`` give the scales),
    or a function returning a state dict (called once: its result is kept
    with the spec, as a file's tensors are until the file changes; an
    equal spec -- same key, the same function object -- is the same
    adapter: pass a new function to read again).  Keys: LoRA factors
    (``X.lora_A.weight``/``X.lora_B.weight`` as peft writes them,
    ``lora_down``/``lora_up`` with ``X.alpha`` as kohya and diffusers do,
    ``lora_unet_``/``lora_te_`` names mapped to modules), full-rank deltas
    (``X.delta.weight``, ``X.delta.bias``) and any other exact parameter
    name as a replacement value.  ``dtype``: the adapter's tensors are
    converted to it (default: the target's dtype).  A key that names no
    parameter raises, listing them, unless ``allow_partial_targets``."""

    key: str
    source: Union[PathLike, Callable[[], Dict[str, Any]]]
    dtype: Any = field(default=None, kw_only=True)
    allow_partial_targets: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            raise InvalidArgumentError(
                f"AdapterSpec key {self.key!r}: give a non-empty string",
                "E_INVAL")
        if not callable(self.source) and not isinstance(
                self.source, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"AdapterSpec '{self.key}': source {self.source!r} is "
                "neither a path nor a function returning a state dict",
                "E_INVAL")


def _read(spec: AdapterSpec):
    """(state dict of CPU tensors, peft config or {}, the files read):
    AdapterError naming the adapter, the file and the field or key for
    anything that is not an adapter laden can apply."""
    if callable(spec.source):
        sd = spec.source()
        if not isinstance(sd, dict):
            raise AdapterError(f"adapter '{spec.key}': its source returned "
                               f"{type(sd).__name__}, not a state dict",
                               "E_INVAL")
        return _tensors_of(spec, dict(sd), "its source's state dict"), {}, \
            _Files(None, "its source's state dict")
    path = os.fspath(spec.source)
    cfg, cp = {}, None
    if os.path.isdir(path):
        cp = os.path.join(path, "adapter_config.json")
        cfg = _peft_config(spec, cp) if os.path.exists(cp) else {}
        if not os.path.exists(cp):
            cp = None
        f = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(f):
            other = sorted(n for n in os.listdir(path)
                           if n.endswith((".bin", ".pt", ".safetensors")))
            raise AdapterError(
                f"adapter '{spec.key}': {path} has no "
                "adapter_model.safetensors"
                + (f" (it has {', '.join(other[:3])})" if other else "")
                + "; give the directory peft wrote or a .safetensors file",
                "E_INVAL")
        path = f
    try:
        with Checkpoint(path) as ck:
            sd = {n: ck.tensor(n) for n in ck.names()}
    except LadenError as e:
        raise type(e)(f"adapter '{spec.key}': {e}", e.status,
                      e.code) from None
    return _tensors_of(spec, sd, path), cfg, _Files(cp, path)


@dataclass(frozen=True)
class _Files:
    """Where an adapter came from, for messages: its peft config (or
    None) and its tensors (a file, or a description of a source)."""
    config: Optional[str]
    weights: str


def _tensors_of(spec: AdapterSpec, sd: dict, where: str) -> dict:
    """The state dict with string keys and real-valued tensors (what
    torch.as_tensor takes is made one)."""
    import torch

    out = {}
    for k, t in sd.items():
        if not isinstance(k, str) or not k:
            raise AdapterError(f"adapter '{spec.key}', {where}: key {k!r} "
                               "is not a tensor name", "E_INVAL")
        if not isinstance(t, torch.Tensor):
            try:  # numbers, lists, arrays
                t = torch.as_tensor(t)
            except Exception:
                raise AdapterError(
                    f"adapter '{spec.key}', {where}: '{k}' is "
                    f"{type(t).__name__}, not a tensor", "E_INVAL") from None
        if t.is_complex() or t.dtype == torch.bool or t.is_quantized or \
                t.layout != torch.strided:
            raise AdapterError(f"adapter '{spec.key}', {where}: '{k}' is a "
                               f"{t.dtype} {str(t.layout).split('.')[-1]} "
                               "tensor; adapters are real numbers",
                               "E_INVAL")
        if t.device.type == "meta":
            raise AdapterError(f"adapter '{spec.key}', {where}: '{k}' is on "
                               "meta (no values)", "E_INVAL")
        out[k] = t
    return out


# peft config fields laden reads, with the types it accepts.
_CFG_BOOLS = ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias")


def _peft_config(spec: AdapterSpec, path: str) -> dict:
    """adapter_config.json, read and checked: the fields laden uses have
    the types peft writes, or AdapterError names the adapter, the file and
    the field."""
    import re

    where = f"adapter '{spec.key}': {path}"
    try:  # 16 MiB: far beyond any peft config
        cfg = read_text(path, 1 << 24, is_json=True)
    except LadenError as e:
        raise AdapterError(f"adapter '{spec.key}': {e}", "E_INVAL") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: a JSON {type(cfg).__name__}, not an "
                           "object of peft's fields", "E_INVAL")

    def bad(field, v, want):
        raise AdapterError(f"{where}: field '{field}' is {_short(v)}; "
                           f"{want}", "E_INVAL")

    kind = cfg.get("peft_type")
    if kind is not None and (not isinstance(kind, str) or
                             kind.upper() != "LORA"):
        bad("peft_type", kind, "laden applies LoRA adapters ('LORA')")
    for k in _CFG_BOOLS:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            bad(k, cfg[k], "peft writes true or false")
    if cfg.get("lora_bias"):
        pass  # refused by resolve, naming it
    a = cfg.get("lora_alpha")
    if a is not None and not _finite_number(a):
        bad("lora_alpha", a, "give a finite number")
    r = cfg.get("r")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or
                          r < 1):
        bad("r", r, "give the rank, a whole number of 1 or more")
    for field, ok, want in (
            ("alpha_pattern", _finite_number, "a finite number"),
            ("rank_pattern", lambda v: isinstance(v, int) and
             not isinstance(v, bool) and v >= 1, "a whole number >= 1")):
        pats = cfg.get(field)
        if pats is None:
            continue
        if not isinstance(pats, dict):
            bad(field, pats, "peft writes an object of module name "
                "patterns")
        for p, v in pats.items():
            if not ok(v):
                bad(f"{field}.{p}", v, f"give {want}")
            try:
                re.compile(p)
            except (re.error, RecursionError, OverflowError) as e:
                raise AdapterError(
                    f"{where}: field '{field}': pattern {p!r} is not a "
                    f"regular expression ({e})", "E_INVAL") from None
    return cfg


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and \
        math.isfinite(v)


def _short(v) -> str:
    s = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) \
        else f"a JSON {'array' if isinstance(v, list) else 'object'}"
    return s if len(s) <= 60 else s[:57] + "..."


@dataclass
class _Target:
    name: str                  # the model's parameter name
    A: Any = None              # LoRA factors
    B: Any = None
    scale: float = 1.0
    delta: Any = None          # full-rank delta
    value: Any = None          # replacement
    transposed: bool = False   # W is [in, out] (transformers' Conv1D)
    sharded: bool = False      # W is a DTensor: the factors, delta and
                               # value are this rank's slice of them
    adapter: str = ""          # the adapter's key (for messages)

    def update(self, W, strength: float):
        """The update of W (in W's shape, float32)."""
        import torch

        d = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
        if self.A is not None:
            a = self.A.to(W.device, torch.float32).flatten(1)
            b = self.B.to(W.device, torch.float32).flatten(1)
            ba = (b @ a).t() if self.transposed else b @ a
            d += ba.reshape(W.shape) * (self.scale * strength)
        if self.delta is not None:
            d += self.delta.to(W.device, torch.float32) * strength
        return d


def _split(key: str):
    """(base, kind, part) of an adapter key: kind 'lora' (part 'A'/'B'),
    'alpha', 'delta' (part 'weight'/'bias') or 'value'."""
    for suffix, part in _LORA.items():
        if key.endswith("." + suffix):
            return key[:-len(suffix) - 1], "lora", part
    if key.endswith(".alpha"):
        return key[:-6], "alpha", None
    for suffix, part in _DELTA.items():
        if key.endswith("." + suffix):
            return key[:-len(suffix) - 1], "delta", part
    return key, "value", None


def _module_name(base: str, modules: set, underscored: Dict[str, str]):
    cands = [base]
    i = 0
    while i < len(cands):  # peel wrappers one at a time
        for w in _WRAPPERS:
            if cands[i].startswith(w):
                cands.append(cands[i][len(w):])
        i += 1
    for c in cands:
        if c in modules:
            return c
    for k in _KOHYA:
        if base.startswith(k) and base[len(k):] in underscored:
            return underscored[base[len(k):]]
    return None


def _pattern(cfg: dict, field: str, module: str):
    """The value of the first pattern of cfg[field] matching module, as
    peft matches them, or None."""
    import re

    for pat, v in (cfg.get(field) or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):  # as peft, first wins
            return v
    return None


def _alpha_from(cfg: dict, module: str, r: int) -> Optional[float]:
    if not cfg:
        return None
    alpha = _pattern(cfg, "alpha_pattern", module)
    if alpha is None:
        alpha = cfg.get("lora_alpha")
    if alpha is None:
        return None
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


# Idle adapters' host copies kept without a RAM budget: C's host policy
# applies it (include/laden/cache.h); named here for the docs.
IDLE_HOST_BYTES = _lib.CACHE_IDLE_HOST_BYTES


def _nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values()
               if hasattr(t, "element_size"))


class _HostAdapters:
    """Adapters as read (CPU tensors and peft config), kept between uses:
    switching back to an adapter reads no file and calls no function.
    Each is an entry of C's host policy, which decides which give way
    beside the models' host copies (laden_cache_plan_host); this holds the
    tensors and drops those it names.  Entries are keyed by `_source_key`,
    which holds the spec (so a function source, held with it, is never
    confused with another)."""

    def __init__(self, pinned_budget: int = 0):
        import weakref

        # A C cache of no models holds the entries; a ModelCache's device
        # caches join its group (the host's RAM is one).
        self.c = ctypes.c_void_p()
        check(lib.laden_cache_create(0, pinned_budget, ctypes.byref(self.c)))
        weakref.finalize(self, lib.laden_cache_destroy, self.c)
        # _source_key -> (state dict, config, files, bytes, C entry)
        self.items: Dict[tuple, tuple] = {}
        self.reads = 0  # adapters read from their source (tests count)

    @property
    def bytes(self) -> int:
        n = ctypes.c_uint64()
        check(lib.laden_cache_host_held(self.c, ctypes.byref(n), None))
        return n.value

    def get(self, a: "AdapterSpec"):
        k = _source_key(a)
        hit = self.items.get(k)
        if hit is not None:
            check(lib.laden_cache_host_touch(self.c, hit[4]))
            return hit[:3]
        sd, cfg, files = _read(a)
        self.reads += 1
        n, e = _nbytes(sd), ctypes.c_uint32()
        check(lib.laden_cache_host_add(self.c, n, ctypes.byref(e)))
        self.items[k] = (sd, cfg, files, n, e.value)
        return sd, cfg, files

    def held(self, keep) -> int:
        """Bytes of the entries of adapters `keep`."""
        ks = {_source_key(a) for a in keep}
        return sum(v[3] for k, v in self.items.items() if k in ks)

    def fit(self, keep, on=None, model=0xFFFFFFFF,
            ram_budget=_lib.CACHE_RAM_UNLIMITED, need=0, cap=0):
        """C's host policy decides, adapters `keep` kept: the idle adapters
        it names are dropped; returns its status and the idle models it
        chose (CacheHostEvict array, count) for the caller to drop.  `on`:
        the C cache of `model`, in this one's group."""
        ids = [self.items[k][4] for k in {_source_key(a) for a in keep}
               if k in self.items]
        drop = (ctypes.c_uint32 * max(1, len(self.items)))()
        ev = (_lib.CacheHostEvict * max(1, cap))()
        nd, n = ctypes.c_uint32(), ctypes.c_uint32()
        s = lib.laden_cache_plan_host(
            on or self.c, model, ram_budget, need,
            (ctypes.c_uint32 * max(1, len(ids)))(*ids), len(ids), drop,
            len(self.items), ctypes.byref(nd), ev, cap, ctypes.byref(n))
        by_entry = {v[4]: k for k, v in self.items.items()}
        for i in range(nd.value):
            self._remove(by_entry[drop[i]])
        if s and on is None:  # a handle's: no caller to tell
            log.warning("laden: adapters in host memory: %s", error_for(s))
        return s, ev, n.value

    def _remove(self, k) -> None:
        check(lib.laden_cache_host_remove(self.c, self.items.pop(k)[4]))

    def clear(self) -> None:
        for k in list(self.items):
            self._remove(k)


def resolve(spec: AdapterSpec, model, store: Optional[_HostAdapters] = None
            ) -> List[_Target]:
    """The adapter's targets in `model` (parameter names), checked; its
    tensors read through `store` when given."""
    import torch

    sd, cfg, files = store.get(spec) if store is not None else _read(spec)
    if cfg.get("use_dora") or cfg.get("lora_bias"):
        raise AdapterError(
            f"adapter '{spec.key}': {files.config}: "
            f"{'use_dora' if cfg.get('use_dora') else 'lora_bias'} is true: "
            f"{'DoRA' if cfg.get('use_dora') else 'LoRA with bias'}"
            " adapters are not supported (only plain LoRA, deltas and "
            "values)", "E_INVAL")
    odd = sorted(k for k in sd if any(x in k for x in _UNSUPPORTED))
    if odd:
        raise AdapterError(
            f"adapter '{spec.key}': {files.weights}: keys laden cannot apply: "
            f"{', '.join(odd[:6])}{' ...' if len(odd) > 6 else ''} (DoRA "
            "magnitudes, embedding LoRA, LoRA biases and saved base "
            "layers are not supported)", "E_INVAL")
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = {n for n, _ in model.named_modules()}
    underscored = {n.replace(".", "_"): n for n in modules if n}
    targets: Dict[str, _Target] = {}
    alphas: Dict[str, float] = {}
    unmatched: List[str] = []
    given: Dict[tuple, str] = {}  # (target, part) -> the key that gave it

    def once(name, part, key):
        had = given.setdefault((name, part), key)
        if had != key:
            raise AdapterError(
                f"adapter '{spec.key}', {files.weights}: keys '{had}' and "
                f"'{key}' both give {part} of '{name}'", "E_INVAL")

    for key, t in sd.items():
        base, kind, part = _split(key)
        if kind == "value":
            name = None
            mod, _, attr = key.rpartition(".")
            m = _module_name(mod, modules, underscored) if mod else None
            if m is not None and f"{m}.{attr}" in params:
                name = f"{m}.{attr}"
            elif key in params:
                name = key
            if name is None:
                unmatched.append(key)
                continue
            once(name, "the value", key)
            targets.setdefault(name, _Target(name)).value = t
            continue
        m = _module_name(base, modules, underscored)
        if m is None:
            unmatched.append(key)
            continue
        if kind == "alpha":
            if t.numel() != 1 or not math.isfinite(float(t.float().reshape(
                    -1)[0])):
                raise AdapterError(
                    f"adapter '{spec.key}', {files.weights}: '{key}' is "
                    f"{'a ' + str(tuple(t.shape)) + ' tensor' if t.numel() != 1 else float(t)}"
                    "; an alpha is one finite number", "E_INVAL")
            once(m, "alpha", key)
            alphas[m] = float(t.float().reshape(-1)[0])
            continue
        name = f"{m}.{part if kind == 'delta' else 'weight'}"
        if name not in params:
            unmatched.append(key)
            continue
        once(name, "the delta" if kind == "delta" else f"LoRA {part}", key)
        tg = targets.setdefault(name, _Target(name))
        if kind == "delta":
            tg.delta = t
        elif part == "A":
            tg.A = t
        else:
            tg.B = t
    if unmatched and not spec.allow_partial_targets:
        raise AdapterError(
            f"adapter '{spec.key}': {len(unmatched)} key(s) name no "
            f"parameter of {type(model).__name__}: "
            f"{', '.join(sorted(unmatched)[:12])}"
            + (" ..." if len(unmatched) > 12 else "")
            + " (allow_partial_targets=True skips the names of modules "
            "the model lacks)", "E_INVAL")
    if unmatched:
        log.warning("laden: adapter '%s': skipped %d key(s) naming no "
                    "parameter: %s", spec.key, len(unmatched),
                    ", ".join(sorted(unmatched)[:12]))
    out = []
    for name, tg in targets.items():
        W = params[name]
        tg.adapter = spec.key
        where = f"adapter '{spec.key}' ({files.weights}), target '{name}'"
        dist = None
        # A DTensor: checked against the whole (global) weight, then
        # sliced for this rank.
        if is_dtensor(W):
            try:
                dist = _dist_of(W, name)
            except InvalidArgumentError as e:
                raise AdapterError(f"{where}: {e}", "E_INVAL") from None
        if not W.dtype.is_floating_point or W.element_size() < 2:
            raise AdapterError(
                f"{where}: the weight is {W.dtype}; adapters merge into "
                "float32, float16 and bfloat16 weights (not fp8 or "
                "integer storage: load it with storage_dtype=None)",
                "E_INVAL")
        if (tg.A is None) != (tg.B is None):
            raise AdapterError(f"{where}: has one LoRA factor of two",
                               "E_INVAL")
        if tg.A is not None:
            A, B = tg.A, tg.B
            if A.dim() < 2 or B.dim() < 2 or A.shape[0] == 0:
                raise AdapterError(
                    f"{where}: LoRA factors A {tuple(A.shape)} and B "
                    f"{tuple(B.shape)}: B must be [out, r], A [r, in...] "
                    "with a rank r of 1 or more", "E_INVAL")
            r = A.shape[0]
            owner = _owner(model, name)
            tg.transposed = type(owner).__name__ == "Conv1D" or \
                bool(cfg.get("fan_in_fan_out"))
            shape = tuple(W.shape[::-1]) if tg.transposed else \
                tuple(W.shape)
            want_b = (shape[0], r)
            if B.dim() < 2 or tuple(B.shape[:2]) != want_b or \
                    math.prod(B.shape[2:]) != 1 or A.dim() < 2 or \
                    A[0].numel() != math.prod(shape[1:]):
                raise AdapterError(
                    f"{where}: LoRA factors A {tuple(A.shape)} and B "
                    f"{tuple(B.shape)} do not fit the weight "
                    f"{tuple(W.shape)} (B must be [out, r], A [r, in...]"
                    + (", the weight being [in, out] (Conv1D)"
                       if tg.transposed else "") + ")", "E_INVAL")
            m = name.rsplit(".", 1)[0]
            want_r = _pattern(cfg, "rank_pattern", m) if cfg else None
            field_r = "rank_pattern" if want_r is not None else "r"
            want_r = want_r if want_r is not None else cfg.get("r")
            if want_r is not None and want_r != r:
                raise AdapterError(
                    f"{where}: {files.config} gives rank {want_r} (field "
                    f"'{field_r}'), its LoRA factors have rank {r} (A "
                    f"{tuple(A.shape)}, B {tuple(B.shape)})", "E_INVAL")
            if m in alphas:
                tg.scale = alphas[m] / r
            else:
                a = _alpha_from(cfg, m, r)
                if a is None and cfg:
                    raise AdapterError(
                        f"{where}: {files.config} has no 'lora_alpha' "
                        "(nor an alpha_pattern for it) and the adapter "
                        "no alpha key: its scale, lora_alpha / r, is "
                        "unknown", "E_INVAL")
                tg.scale = a if a is not None else 1.0
        for what, t in (("delta", tg.delta), ("value", tg.value)):
            if t is not None and tuple(t.shape) != tuple(W.shape):
                raise AdapterError(
                    f"{where}: its {what} is {tuple(t.shape)}, the weight "
                    f"{tuple(W.shape)}", "E_INVAL")
        dt = spec.dtype or W.dtype
        for f in ("A", "B", "delta", "value"):
            t = getattr(tg, f)
            if t is not None:
                setattr(tg, f, t.to(dt) if isinstance(t, torch.Tensor)
                        else torch.as_tensor(t, dtype=dt))
        if dist is not None:
            _slice_for_rank(tg, dist, where)
        out.append(tg)
    return out


def _slice_for_rank(tg: _Target, dist, where: str) -> None:
    """Makes tg this rank's part of the update of a DTensor weight whose
    local shard is [start, start + count) of dimension dist.dim: rows of
    B where the weight's output dimension is split (ColwiseParallel),
    columns of A where its input dimension is (RowwiseParallel); the
    delta and value as the weight.  Replicated: the whole update."""
    tg.sharded = True
    d = dist.dim
    if d is None:
        return

    def part(t, dim):
        return t.narrow(dim, dist.start, dist.count).contiguous()

    for f in ("delta", "value"):
        if getattr(tg, f) is not None:
            setattr(tg, f, part(getattr(tg, f), d))
    if tg.A is None:
        return
    out_dim = 1 if tg.transposed else 0  # the weight's output features
    in_dim = 1 - out_dim
    if d == out_dim:
        tg.B = part(tg.B, 0)
    elif d == in_dim:
        tg.A = part(tg.A, 1)
    else:
        raise AdapterError(
            f"{where}: the weight is sharded along dimension {d} (not its "
            "input or output features); its LoRA factors cannot be split "
            "along it", "E_INVAL")


def _local(W):
    """The tensor an update is added to: a DTensor's local shard (laden's
    memory), else W."""
    return W.to_local() if is_dtensor(W) else W


# ---- on a streamed model ---------------------------------------------------------

class _Adapters:
    """The adapters active on one OffloadHandle."""

    def __init__(self, handle):
        self.handle = handle
        self.mode: Optional[str] = None
        # c_block -> [(tensor, target, s)]: merges into plain weights in
        # the block's slot (once per fill), and into compact weights as
        # the block's enter expands them (every enter).
        self.merges: Dict[int, list] = {}
        self.expand_merges: Dict[int, list] = {}
        self.merged_at: Dict[int, int] = {}  # c_block -> slot fills merged
        # Resident tensors merged in place, in the order merged:
        # (c_block, c_index) -> [(W, target, s)].
        self.resident: Dict[tuple, list] = {}
        # Resident tensors whose bytes are neither the base nor a merge (a
        # switch failed, and so did undoing it): (c_block, c_index) ->
        # (W, name); the next switch reads them again first.
        self.unknown: Dict[tuple, tuple] = {}
        self.hooks: list = []
        self.resolved: Dict[tuple, List[_Target]] = {}
        self.host = _HostAdapters()
        self.version = 0  # grows whenever the adapters change

    def after_enter(self, c_block: int) -> None:
        """A block that streams or expands compact tensors just entered:
        its adapters merged into its slot unless they are already (the
        slot was not filled since), and into its compact tensors as C
        expanded them into the workspace (at every enter: the workspace
        is the next block's too)."""
        todo = self.merges.get(c_block)
        if todo:
            _merge_slot(self.handle.state.live("forward").h, c_block,
                        todo, self.merged_at, f"block {c_block}",
                        "call set_adapters again")
        for t, tg, s in self.expand_merges.get(c_block, ()):
            _add(t, tg, s)

    def clear(self) -> None:
        """Every update undone: hooks removed, slots to be filled again,
        resident tensors read from the checkpoint again; or, with the
        error raised, the adapters in force as they were."""
        self.switch(None, {}, {}, [])

    def switch(self, mode, merges: dict, resident: dict, routes: list
               ) -> None:
        """Puts in force streamed merges `merges`, resident merges
        `resident` and routed hooks `routes` ([(module, hook)]), all
        checked by the caller: all of them, or (the error raised) none,
        the adapters before the call in force exactly as they were.

        The steps, each undone if a later one fails: the new hooks are
        registered (removed again); the slots are forgotten, so the old
        streamed merges are made again from the original bytes when their
        blocks next enter (nothing the model computes changes); the
        resident tensors the old adapters changed are read from the
        checkpoint again, each whole or not at all (if one fails, the old
        updates are added again to those read back: the same steps on the
        same bytes, so the same bytes as before); the new updates are
        added (if that fails, the tensors changed are read again and the
        old updates added).  Then the records change, which cannot fail.
        Ctrl-C waits for the end of the step under way, then undoes it
        as any failure."""
        import torch

        st = self.handle.state
        o = st.live("set_adapters")
        new_hooks: list = []
        touched = False
        try:
            with _interrupts_held():
                for mod, fn in routes:
                    new_hooks.append(mod.register_forward_hook(fn))
            if st.device.type == "cuda":
                torch.cuda.synchronize(st.device)
            if self.merges or self.merged_at:
                touched = True  # the slots hold merges: filled again
                s = lib.laden_sched_refill(o.h)
                if s:
                    err = error_for(s)
                    raise type(err)(f"set_adapters: filling the slots "
                                    f"again: {err}", err.status, err.code)
                self.merged_at.clear()
            self._undo_resident(o, st)
            self._apply_resident(o, st, resident)
        except BaseException:
            with _interrupts_held():
                for hk in new_hooks:
                    hk.remove()
                if touched or self.resident or resident:
                    self.version += 1  # captured work is captured again
            raise
        with _interrupts_held():
            for hk in self.hooks:
                hk.remove()
            self.hooks = new_hooks
            self.merges = {c: p for c, p in (
                (c, [x for x in todo if x[0].store == "plain"])
                for c, todo in merges.items()) if p}
            self.expand_merges = {c: e for c, e in (
                (c, [x for x in todo if x[0].store != "plain"])
                for c, todo in merges.items()) if e}
            self.resident = resident
            self.mode = mode if (merges or resident or routes) else None
            self.version += 1

    def _undo_resident(self, o, st) -> None:
        """The resident tensors the adapters in force changed (and any of
        unknown bytes) read from the checkpoint again; if one fails, the
        adapters in force again (see switch)."""
        keys = list(self.resident) + [k for k in self.unknown
                                      if k not in self.resident]
        done: list = []
        try:
            for k in keys:
                with _interrupts_held():
                    W, name = self._where(k)
                    _reread(o, st, k, W, name, self._by(k))
                    done.append(k)
        except BaseException as e:
            with _interrupts_held():
                lost = []
                for k in done:
                    self.unknown.pop(k, None)
                    if k in self.resident:
                        try:
                            _merge_all(self.resident[k])
                        except BaseException:
                            lost.append(k)
                            self.unknown[k] = self._where(k)
            if lost:
                raise _neither(e, [self._where(k)[1] for k in lost]) from e
            raise
        self.unknown.clear()

    def _apply_resident(self, o, st, resident: dict) -> None:
        """The new resident merges added (every tensor they change is the
        base now); if one fails, the adapters before the call again."""
        applied: list = []
        try:
            for k, todo in resident.items():
                with _interrupts_held():
                    applied.append(k)  # its bytes change from here on
                    _merge_all(todo)
        except BaseException as e:
            with _interrupts_held():
                lost = []
                for k in applied:
                    W, name = _todo_where(resident[k])
                    try:
                        _reread(o, st, k, W, name, "")
                    except BaseException:
                        lost.append(k)
                        self.unknown[k] = (W, name)
                for k, todo in self.resident.items():
                    if k in self.unknown:
                        continue
                    try:
                        _merge_all(todo)
                    except BaseException:
                        lost.append(k)
                        self.unknown[k] = self._where(k)
            if lost:
                raise _neither(e, [self.unknown[k][1] for k in lost]) from e
            raise

    def _where(self, k: tuple) -> tuple:
        """(W, name) of resident tensor k."""
        todo = self.resident.get(k)
        return _todo_where(todo) if todo else self.unknown[k]

    def _by(self, k: tuple) -> str:
        todo = self.resident.get(k) or ()
        keys = sorted({tg.adapter for _, tg, _ in todo if tg.adapter})
        return ", ".join(f"'{a}'" for a in keys)


def _todo_where(todo: list) -> tuple:
    """(W, name) of the tensor a resident merge list changes."""
    W, tg, _ = todo[0]
    return W, tg.name


def _merge_all(todo: list) -> None:
    for W, tg, s in todo:
        _add(W, tg, s)


def _reread(o, st, k: tuple, W, name: str, by: str) -> None:
    """Resident tensor k read from the checkpoint into its place again,
    whole or not at all: on the CUDA device C reads it into host memory
    and copies it only once it is read whole; on the CPU it reads into
    the place itself, so what is there is kept aside first and put back
    if the read fails.  The error names the tensor and the adapters."""
    import torch

    keep = None
    if st.device.type != "cuda":
        keep = _local(W).detach().clone()
    s = lib.laden_sched_reread(o.h, k[0], k[1])
    if not s:
        return
    err = error_for(s)
    if keep is not None:
        with torch.no_grad():
            _local(W).copy_(keep)
    raise type(err)(
        f"set_adapters: undoing adapter{'s' if ',' in by else ''} "
        f"{by or '(none)'} on '{name}' needs it read from the checkpoint "
        f"again, which failed: {err}; the adapters in force before the "
        "call still are", err.status, err.code)


def _neither(e: BaseException, names: List[str]) -> StateError:
    return StateError(
        f"set_adapters failed ({type(e).__name__}: {e}) and undoing it "
        f"failed too: the weights of {', '.join(names[:6])}"
        f"{' ...' if len(names) > 6 else ''} are neither the base nor the "
        "adapters'; call set_adapters again once the cause is gone",
        "E_STATE")


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C (SIGINT) waits until the block ends, then raises: a step
    that changes weights and records that it did is not cut between the
    two.  Only on the main thread (where Python runs signal handlers)
    while Python's own handler is installed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    got: list = []
    prev = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
        if got:
            raise KeyboardInterrupt


def _merge_slot(h, c_block: int, todo: list, merged_at: dict, what: str,
                mend: str) -> None:
    """Merges `todo` into a streamed block's slot, unless this fill of the
    slot has them already (C's fill number); a merge that failed half way
    is refused until the slot is filled again."""
    fills = ctypes.c_uint64()
    check(lib.laden_sched_slot_fills(h, c_block, ctypes.byref(fills)))
    have = merged_at.get(c_block)
    if have == fills.value:
        return
    if have is _HALF:
        raise StateError(f"{what}: merging an adapter into it failed half "
                         f"way and it has not been filled again since; "
                         f"{mend}", "E_STATE")
    merged_at[c_block] = _HALF
    for W, tg, s in todo:
        _add(W, tg, s)
    merged_at[c_block] = fills.value


def _add(W, tg: _Target, s: float) -> None:
    """W += update, in place, where W is (one fused multiply-add for a 2-D
    LoRA target); a DTensor's local shard += this rank's part of it."""
    if isinstance(W, _Tensor):  # looked up now: a rebind makes it anew
        W = run_of(W)
    import torch

    W = _local(W)
    with torch.no_grad():
        if tg.value is not None:
            W.copy_(tg.value.to(W.device, W.dtype))
            return
        if tg.A is not None and tg.delta is None and W.dim() == 2 and \
                tg.A.dtype == W.dtype:
            A = tg.A.to(W.device)
            B = tg.B.to(W.device)
            if tg.transposed:  # W [in, out] += A.T @ B.T
                W.addmm_(A.t(), B.t(), alpha=s * tg.scale)
            else:
                W.addmm_(B, A, alpha=s * tg.scale)
            return
        W.add_(tg.update(W, s).to(W.dtype))


def _by_name(tensors) -> Dict[str, Any]:
    """Each of laden's tensors under every name it has (tied aliases)."""
    return {n: t for t in tensors for n in t.names}


def set_adapters(handle, adapters: Sequence[AdapterSpec],
                 strengths: Optional[Sequence[float]] = None,
                 mode: str = "merge") -> None:
    """See OffloadHandle.set_adapters."""
    adapters, strengths = _args(adapters, strengths, mode, "set_adapters")
    st = handle.state
    o = st.live("set_adapters")
    if not handle.active:
        raise StateError("set_adapters: the handle was removed", "E_STATE")
    model = st.root[0] if st.root is not None else None
    if model is None:
        raise StateError("set_adapters: the model is not attached",
                         "E_STATE")
    if st.awaiting:
        raise StateError("set_adapters: the model is still loading in the "
                         "background; wait for it (report.wait()) first",
                         "E_STATE")
    if mode == "merge" and adapters and st.device.type != "cuda":
        # On the CPU the weights run from their host copy, in place.
        refuse_writes(st, "set_adapters(mode='merge') on the CPU (use "
                      "mode='routed')")
    with _pass(st, o, "set_adapters"):
        _set(handle, st, o, model, adapters, strengths, mode)


def _set(handle, st, o, model, adapters, strengths, mode) -> None:
    ad = handle.adapters
    # All checked before anything changes.
    resolved = _resolved(ad.resolved, adapters, model, st.device, ad.host)
    by_name = _by_name(st.tensors)
    params = dict(model.named_parameters(remove_duplicate=False))
    _check_targets(resolved, mode, model, by_name, expanded_ok=True)
    merges: Dict[int, list] = {}
    resident: Dict[tuple, list] = {}
    routes: list = []
    for tg_list, s in zip(resolved, strengths):
        for tg in tg_list:
            t = by_name[tg.name]
            if mode == "routed":
                routes.append((_owner(model, tg.name), _route(tg, s)))
                continue
            W = params[tg.name]
            if t.store != "plain" or \
                    lib.laden_sched_is_streamed(o.h, t.c_block):
                # The tensor, not its parameter: the slot its block runs
                # from is bound into the module only inside the block.
                merges.setdefault(t.c_block, []).append((t, tg, s))
                continue
            if id(t) in st.merged_for_good:
                raise AdapterError(
                    f"target '{tg.name}' has an adapter merged for good "
                    "(merge_adapter, perhaps through a tied name) in "
                    "resident memory, which set_adapters would undo; use "
                    "mode='routed' or load the model again", "E_INVAL")
            if t.ckpt_name is None or t.source is not None:
                raise AdapterError(
                    f"adapter '{tg.adapter}', target '{tg.name}': the "
                    "weight is resident and not read from a checkpoint "
                    "(built by the model, or given in memory), so a merge "
                    "into it could not be undone; use mode='routed'",
                    "E_INVAL")
            resident.setdefault((t.c_block, t.c_index), []).append(
                (W, tg, s))
    for tg_list in resolved:
        for tg in tg_list:
            if mode == "merge":
                _warn_tied(by_name[tg.name], tg)
    ad.switch(mode, merges, resident, routes)
    ad.host.fit(adapters)  # idle ones within C's limit


def _warn_tied(t, tg: _Target) -> None:
    mods = {id(m) for m, _ in t.aliases}
    if len(mods) > 1:
        log.warning("laden: adapter target '%s' is tied to %s: a merge "
                    "changes all of them (as peft's merge does); "
                    "mode='routed' changes only this module's output",
                    tg.name, ", ".join(n for n in t.names if n != tg.name))


def _source_key(a: AdapterSpec):
    """What an adapter's resolved targets depend on: the spec itself (its
    dtype and allow_partial_targets too) and, for a path, the file's size
    and time (a file written again is read again).  A function source is
    called once while its result is kept (the key holds the spec, and the
    spec the function)."""
    if callable(a.source):
        return (a,)
    path = os.fspath(a.source)
    f = os.path.join(path, "adapter_model.safetensors") \
        if os.path.isdir(path) else path
    try:
        st = os.stat(f)
        return (a, st.st_size, st.st_mtime_ns)
    except OSError:
        return (a, None, None)


def _resolved(cache: dict, adapters, model, device, store):
    """Each adapter's targets, on the device; the cache keeps only these
    adapters' (switching adapters does not pile them up on the device);
    their tensors as read are kept in `store` (host memory)."""
    out, keep = [], {}
    for a in adapters:
        k = _source_key(a)
        tg = cache.get(k)
        if tg is None:
            tg = [_placed(t, device) for t in resolve(a, model, store)]
        keep[k] = tg
        out.append(tg)
    cache.clear()
    cache.update(keep)
    return out


def _merge_key(adapters, strengths, mode):
    """Names the merge the adapters make: equal keys, equal bytes."""
    if not adapters:
        return None
    return (mode, tuple((_source_key(a), s)
                        for a, s in zip(adapters, strengths)))


# A merge that was started and did not finish: never equal to a fill
# count, so the bytes are taken as changed in an unknown way.
_HALF = object()


def _placed(tg: _Target, device) -> _Target:
    for f in ("A", "B", "delta", "value"):
        t = getattr(tg, f)
        if t is not None:
            setattr(tg, f, t.to(device))
    return tg


def _owner(model, name: str):
    mod = model
    for part in name.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def _route(tg: _Target, s: float):
    import torch.nn.functional as F

    cache = {}

    def hook(mod, args, out):
        x = args[0]
        dev = (x.device, x.dtype)
        if cache.get("dev") != dev:
            cache["dev"] = dev
            cache["A"] = tg.A.to(*dev) if tg.A is not None else None
            cache["B"] = tg.B.to(*dev) if tg.B is not None else None
            cache["D"] = tg.delta.to(*dev) if tg.delta is not None else None
        y = out
        if cache["A"] is not None:
            y = y + F.linear(F.linear(x, cache["A"]), cache["B"]) * \
                (s * tg.scale)
        if cache["D"] is not None:
            y = y + F.linear(x, cache["D"]) * s
        return y
    return hook


def merge_adapter(model, adapter: AdapterSpec, strength: float = 1.0) -> None:
    """Makes an adapter's update permanent in a model loaded by laden:
    resident weights in place, streamed blocks' RAM-tier host copies (a
    block on the disk tier cannot be changed: it is read from the
    checkpoint each time).  Refused while set_adapters is active."""
    st = getattr(model, "_laden_stream", None)
    if st is None:
        raise StateError("merge_adapter: the model was not loaded by laden",
                         "E_STATE")
    o = st.live("merge_adapter")
    refuse_writes(st, "merge_adapter")
    h = st.handle
    if h is not None and h.adapters.mode is not None:
        raise StateError("merge_adapter: adapters are active "
                         "(set_adapters([]) first)", "E_STATE")
    if st.awaiting:
        raise StateError("merge_adapter: the model is still loading in the "
                         "background; wait for it (report.wait()) first",
                         "E_STATE")
    with _pass(st, o, "merge_adapter"):
        _merge_for_good(model, st, o, h, adapter, strength)


def _merge_for_good(model, st, o, h, adapter, strength) -> None:
    import torch

    targets = resolve(adapter, model)
    by_name = _by_name(st.tensors)
    plan = []
    for tg in targets:
        t = by_name.get(tg.name)
        if t is None or t.store != "plain":
            raise AdapterError(f"merge_adapter: target '{tg.name}' cannot "
                               "be merged (not held by laden as stored)",
                               "E_INVAL")
        if lib.laden_sched_is_streamed(o.h, t.c_block):
            tier = lib.laden_sched_block_tier(o.h, t.c_block)
            if tier != _lib.TIER_RAM:
                raise AdapterError(
                    f"merge_adapter: target '{tg.name}' is in a block on "
                    "the disk tier (read from the checkpoint each time); "
                    "load it with a RAM budget that holds it, or use "
                    "set_adapters", "E_INVAL")
            W = _tensor_view(o, t, "home", None)
        else:
            W = dict(model.named_parameters(remove_duplicate=False))[
                tg.name]
        plan.append((W, tg))
    if st.device.type == "cuda":
        torch.cuda.synchronize(st.device)
    for W, tg in plan:
        _add(W, tg, strength)
        st.merged_for_good.add(id(by_name[tg.name]))
    if h is not None and h.active:
        check(lib.laden_sched_refill(o.h))


# ---- on a cached model ----------------------------------------------------------

class _CacheAdapters:
    """The adapters of one ModelCache model: merged into its device copies
    (kept with them between uses while the copies stay: C's upload count
    says when a copy was written again) and its slots, or routed."""

    def __init__(self, rt, host: _HostAdapters):
        self.rt = rt
        self.host = host  # the cache's, shared by its models
        self.current: tuple = ()  # the adapters applied now
        self.key = None
        self.merges: Dict[int, list] = {}
        self.merged_at: Dict[int, int] = {}
        self.copies: Dict[int, tuple] = {}  # c_block -> (key, uploads)
        self.hooks: list = []
        self.resolved: Dict[tuple, List[_Target]] = {}

    def after_enter(self, c_block: int) -> None:
        if self.merges.get(c_block):
            _merge_slot(self.rt.sched, c_block, self.merges[c_block],
                        self.merged_at,
                        f"model '{self.rt.spec.key}', block {c_block}",
                        "use the model again")

    def apply(self, adapters, strengths, mode: str) -> None:
        """Makes the model, active now, run with exactly these adapters.
        Everything is checked before anything changes; a failure after
        that (the use then fails: the cache deactivates the model) leaves
        records from which the next use's apply restores what it asks for:
        a device copy being changed is marked half done before its bytes
        change (the next apply writes it again from the host copy), and
        the key, the hooks and the streamed merges change last."""
        import torch

        rt = self.rt
        h = rt.sched
        adapters, strengths = _args(adapters, strengths, mode,
                                    f"use('{rt.spec.key}')")
        key = _merge_key(adapters, strengths, mode)
        model = rt.model
        resolved = _resolved(self.resolved, adapters, model, rt.device,
                             self.host)
        by_name = _by_name(rt.tensors)
        _check_targets(resolved, mode, model, by_name)
        by_block: Dict[int, list] = {}
        routes: list = []
        for tg_list, s in zip(resolved, strengths):
            for tg in tg_list:
                if mode == "merge":
                    t = by_name[tg.name]
                    by_block.setdefault(t.c_block, []).append((t, tg, s))
                else:
                    routes.append((_owner(model, tg.name), _route(tg, s)))
        for b in by_block:
            if not lib.laden_sched_is_streamed(h, b) and \
                    not lib.laden_sched_is_resident(h, b):
                raise AdapterError(
                    f"model '{rt.spec.key}': block {b} has no device copy "
                    "of its own here (its weights are its host copy, which "
                    "adapters never change); use mode='routed'", "E_INVAL")
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        if key != self.key or _HALF in self.merged_at.values():
            check(lib.laden_sched_refill(h))  # slots: filled again
            self.merged_at.clear()
        # On the CPU device a resident block runs from its host copy,
        # which adapters never change: a block merged into gets a copy of
        # its own first (C), and the tensors are pointed at it.
        made, made_any = ctypes.c_int(0), False
        for b in by_block:
            if lib.laden_sched_is_resident(h, b):
                check(lib.laden_sched_own_copy(h, b, ctypes.byref(made)))
                made_any |= bool(made.value)
        if made_any:
            rt.rebind()
        fills = ctypes.c_uint64()
        for b in set(self.copies) | set(by_block):
            if lib.laden_sched_is_streamed(h, b):
                self.copies.pop(b, None)
                continue
            want = key if b in by_block else None
            check(lib.laden_sched_copy_fills(h, b, ctypes.byref(fills)))
            have = self.copies.get(b)
            if have is not None and have[1] == fills.value:
                if have[0] == want:
                    continue  # this copy holds this merge already
                self.copies[b] = (_HALF, fills.value)  # until it is done
                check(lib.laden_sched_reupload(h, b))  # the base again
                check(lib.laden_sched_copy_fills(h, b, ctypes.byref(fills)))
            self.copies.pop(b, None)
            if want is None:
                continue
            self.copies[b] = (_HALF, fills.value)  # until it is done
            _merge_all(by_block[b])
            self.copies[b] = (want, fills.value)
        with _interrupts_held():
            for hk in self.hooks:
                hk.remove()
            self.hooks = [mod.register_forward_hook(fn)
                          for mod, fn in routes]
            self.merges = {b: v for b, v in by_block.items()
                           if lib.laden_sched_is_streamed(h, b)}
            self.key = key
            self.current = tuple(adapters)


def _args(adapters, strengths, mode, call):
    if mode not in ("merge", "routed"):
        raise InvalidArgumentError(f"{call}: mode {mode!r}; use 'merge' or "
                                   "'routed'", "E_INVAL")
    adapters = list(adapters or ())
    strengths = [1.0] * len(adapters) if strengths is None \
        else [float(s) for s in strengths]
    if len(strengths) != len(adapters):
        raise InvalidArgumentError(
            f"{call}: {len(adapters)} adapters, {len(strengths)} strengths",
            "E_INVAL")
    for a in adapters:
        if not isinstance(a, AdapterSpec):
            raise InvalidArgumentError(
                f"{call}: give AdapterSpecs, not {type(a).__name__}",
                "E_INVAL")
    return adapters, strengths


def _check_targets(resolved, mode, model, by_name,
                   expanded_ok: bool = False) -> None:
    """Every target checked before anything changes.  `expanded_ok`: a
    merge into a compact target (expanded into the workspace at each
    enter) is made after each expansion."""
    import torch

    for tg_list in resolved:
        for tg in tg_list:
            t = by_name.get(tg.name)
            if t is None:
                raise AdapterError(f"target '{tg.name}' is not held by "
                                   "laden", "E_INVAL")
            if t.store != "plain" and mode == "merge" and not (
                    expanded_ok and t.run is not None):
                raise AdapterError(
                    f"target '{tg.name}' is stored compact ({t.store}"
                    + (": kept lossless-coded in the host copy"
                       if t.store == "lossless" else
                       ": fp8 or bf16 storage, or GGUF blocks, expanded when "
                       "its block runs")
                    + "); merge adapters into weights stored as they run "
                    "(load without storage_dtype or compression), or use "
                    "mode='routed'", "E_INVAL")
            if mode == "routed" and not isinstance(
                    _owner(model, tg.name), torch.nn.Linear):
                raise AdapterError(
                    f"target '{tg.name}': routed mode adds to nn.Linear "
                    "outputs; use mode='merge' for it", "E_INVAL")
            if mode == "routed" and tg.sharded:
                raise AdapterError(
                    f"target '{tg.name}' is a DTensor (tensor parallel): "
                    "its rank's slice of the update is merged where the "
                    "weight runs; use mode='merge'", "E_INVAL")
            if mode == "routed" and (tg.value is not None or
                                     tg.name.endswith(".bias")):
                raise AdapterError(
                    f"target '{tg.name}': a replacement or bias delta "
                    "needs mode='merge'", "E_INVAL")
