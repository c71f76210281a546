"""Quantized tensor subclasses (torchao's quantized tensors, quanto's
QTensors, bitsandbytes' Params4bit and Int8Params) held by laden as their
inner tensors: each wrapped parameter's plain inner tensors (packed data,
scales, zero points) become parameters of a small holder module beside
it, so laden moves them as compact bytes like any other tensor; each time
laden points them somewhere (a slot, the device, host RAM) the wrapper is
rebuilt around them, so the backend's own kernels run on it.

Only the Python side of the protocol is here: which tensors a wrapper
holds (``__tensor_flatten__`` / ``__tensor_unflatten__`` for torchao and
quanto; bitsandbytes' data, absmax and SCB by hand) and how to make the
wrapper again.  The bytes move in C like every other tensor's."""

from __future__ import annotations

import copy
import threading
from typing import Callable, Dict, List, Tuple

from .errors import InvalidArgumentError

HOLDER_PREFIX = "_laden_q_"


def _plain(t) -> bool:
    import torch

    return type(t) in (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t) -> bool:
    """A torch.distributed DTensor (tensor parallel): laden holds its local
    shard itself (laden._describe), not as a wrapper's inner tensor."""
    return any(c.__name__ == "DTensor" and
               c.__module__.startswith("torch.distributed")
               for c in type(t).__mro__)


def _flatten(v, where: str, owner=None):
    """(inner tensors by dotted attribute, rebuild(inner) -> wrapper) of a
    wrapper tensor, or None for a plain one.  owner: the module holding it
    (bitsandbytes keeps an Int8Params' scales there after a forward)."""
    import torch

    if _plain(v) or not isinstance(v, torch.Tensor):
        return None
    cls = type(v)
    mod = cls.__module__ or ""
    if mod.startswith("bitsandbytes"):
        return _flatten_bnb(v, where, owner)
    if not hasattr(v, "__tensor_flatten__"):
        raise InvalidArgumentError(
            f"{where}: a {cls.__module__}.{cls.__name__} tensor, which "
            "laden cannot take apart (it has no __tensor_flatten__); "
            "supported: torchao and quanto tensors, bitsandbytes "
            "Params4bit and Int8Params", "E_INVAL")
    attrs, ctx = v.__tensor_flatten__()
    inner: Dict[str, object] = {}
    subs: Dict[str, Tuple[List[str], Callable]] = {}
    for a in attrs:
        t = getattr(v, a)
        f = _flatten(t, f"{where}.{a}")
        if f is None:
            inner[a] = t
        else:
            sub_inner, sub_rebuild = f
            subs[a] = (list(sub_inner), sub_rebuild)
            for k, x in sub_inner.items():
                inner[f"{a}.{k}"] = x
    size, stride = tuple(v.shape), tuple(v.stride())

    def rebuild(vals: Dict[str, object]):
        d = {}
        for a in attrs:
            if a in subs:
                keys, rb = subs[a]
                d[a] = rb({k: vals[f"{a}.{k}"] for k in keys})
            else:
                d[a] = vals[a]
        return cls.__tensor_unflatten__(d, ctx, size, stride)

    return inner, rebuild


def _flatten_bnb(v, where: str, owner=None):
    import torch

    name = type(v).__name__
    if name == "Params4bit":
        qs = v.quant_state
        if qs is None:
            raise InvalidArgumentError(
                f"{where}: a bitsandbytes Params4bit not quantized yet "
                "(move the model to its device once, or quantize it, "
                "before laden takes it)", "E_INVAL")
        inner = {"data": v.data, "absmax": qs.absmax}
        if getattr(qs, "nested", False):
            inner["state2.absmax"] = qs.state2.absmax
            inner["offset"] = qs.offset
        keep = {k: getattr(v, k) for k in ("blocksize", "compress_statistics",
                                           "quant_type", "quant_storage",
                                           "bnb_quantized", "module")
                if hasattr(v, k)}
        cls = type(v)

        def rebuild(vals):
            q = copy.copy(qs)
            q.absmax = vals["absmax"]
            if getattr(qs, "nested", False):
                q.state2 = copy.copy(qs.state2)
                q.state2.absmax = vals["state2.absmax"]
                q.offset = vals["offset"]
            if getattr(q, "code", None) is not None:
                q.code = q.code.to(vals["absmax"].device)
            if getattr(q, "state2", None) is not None and \
                    getattr(q.state2, "code", None) is not None:
                q.state2.code = q.state2.code.to(vals["absmax"].device)
            p = torch.Tensor._make_subclass(cls, vals["data"], False)
            for k, x in keep.items():
                setattr(p, k, x)
            p.quant_state = q
            return p

        return inner, rebuild
    if name == "Int8Params":
        cls = type(v)
        if getattr(v, "has_fp16_weights", False):
            # 16-bit weights that bitsandbytes quantizes on each forward
            # into an int8 copy it keeps on the module: that copy would
            # stay on the device and go stale as the weights move.
            raise InvalidArgumentError(
                f"{where}: a bitsandbytes Int8Params with "
                "has_fp16_weights=True (16-bit weights, an int8 copy kept "
                "by the module) cannot be held by laden; quantize it "
                "(Linear8bitLt(..., has_fp16_weights=False))", "E_INVAL")
        # Quantized: int8 data with a scale per row (SCB), which the first
        # forward moves from the parameter to its module's state.
        scb = getattr(v, "SCB", None)
        if scb is None:
            scb = getattr(getattr(owner, "state", None), "SCB", None)
        if v.dtype != torch.int8 or scb is None:
            raise InvalidArgumentError(
                f"{where}: a bitsandbytes Int8Params not quantized yet "
                "(move the model to its device once before laden takes "
                "it)" if v.dtype != torch.int8 else
                f"{where}: a bitsandbytes Int8Params without its scales "
                "(SCB)", "E_INVAL")

        def rebuild(vals):
            p = torch.Tensor._make_subclass(cls, vals["data"], False)
            p.has_fp16_weights = False
            # As bitsandbytes leaves a quantized one: its next forward
            # takes CB and SCB into the module's state.  What the state
            # holds now (laden memory that moves or goes) is let go.
            p.CB = vals["data"]
            p.SCB = vals["SCB"]
            st = getattr(owner, "state", None)
            if st is not None:
                st.CB = None
                st.SCB = None
            return p

        return {"data": v.data, "SCB": scb}, rebuild
    raise InvalidArgumentError(
        f"{where}: bitsandbytes {name} is not supported (Params4bit and "
        "Int8Params are)", "E_INVAL")


def _holder_cls():
    import torch

    class InnerTensors(torch.nn.Module):
        """The inner tensors of one quantized parameter (laden's)."""

        def __init__(self, owner, attr: str, names: Dict[str, str],
                     rebuild: Callable):
            super().__init__()
            object.__setattr__(self, "_owner", owner)
            object.__setattr__(self, "_attr", attr)
            object.__setattr__(self, "_names", names)  # param -> inner key
            object.__setattr__(self, "_rebuild", rebuild)

        def forward(self, *a, **k):
            raise RuntimeError("holds tensors; not called")

        def refresh(self) -> None:
            """The owner's parameter, rebuilt around the inner tensors as
            they are now (where laden put them, or meta: never around
            memory laden gave back)."""
            vals = {}
            for pname, key in self._names.items():
                vals[key] = self._parameters[pname].detach()
            if len({v.device for v in vals.values()}) > 1:
                return  # half moved (laden sets them one at a time)
            w = self._rebuild(vals)
            new = w if isinstance(w, torch.nn.Parameter) else \
                torch.nn.Parameter(w, requires_grad=False)
            new.requires_grad_(False)
            old = self._owner._parameters.get(self._attr)
            if old is not None and type(old) is type(new):
                try:
                    # The object the user may hold follows, as laden's
                    # plain tensors do: never a wrapper over memory that
                    # was given back.
                    torch.utils.swap_tensors(old, new)
                    return
                except (RuntimeError, TypeError, AttributeError):
                    pass
            self._owner._parameters[self._attr] = new

    return InnerTensors


_HOLDER = None
_HOLDER_LOCK = threading.Lock()


def _holder():
    global _HOLDER
    with _HOLDER_LOCK:  # one class, or refresh() misses another's holders
        if _HOLDER is None:
            _HOLDER = _holder_cls()
        return _HOLDER


def attach(model) -> int:
    """Gives every quantized parameter of `model` a holder of its inner
    tensors (once); returns how many it holds.  The wrapped parameters
    stay on their modules: laden rebuilds them whenever it moves the
    inner tensors."""
    import torch

    n = 0
    for mod_name, mod in list(model.named_modules()):
        for attr, v in list(mod._parameters.items()):
            if v is None or _plain(v) or is_dtensor(v) or \
                    hasattr(mod, HOLDER_PREFIX + attr):
                continue
            where = f"parameter '{mod_name + '.' if mod_name else ''}{attr}'"
            f = _flatten(v, where, mod)
            if f is None:
                continue
            inner, rebuild = f
            names = {k.replace(".", "__"): k for k in inner}
            h = _holder()(mod, attr, names, rebuild)
            for pname, key in names.items():
                t = inner[key]
                if not _plain(t):
                    raise InvalidArgumentError(
                        f"{where}: its inner tensor '{key}' is a "
                        f"{type(t).__name__}, which laden cannot hold",
                        "E_INVAL")
                h._parameters[pname] = torch.nn.Parameter(
                    t.detach(), requires_grad=False)
            mod.add_module(HOLDER_PREFIX + attr, h)
            n += 1
    return n


def is_wrapped(mod, attr: str) -> bool:
    """Whether mod.attr is a quantized parameter laden holds apart."""
    return hasattr(mod, HOLDER_PREFIX + attr)


def refresh(mod) -> None:
    """After laden pointed a holder's tensors somewhere: its owner's
    parameter rebuilt around them (a type check for every other module:
    this runs for each tensor laden points anywhere)."""
    if _HOLDER is not None and type(mod) is _HOLDER:
        mod.refresh()


def detach_all(model) -> None:
    """Removes the holders, leaving each owner's parameter rebuilt around
    the inner tensors as they are now."""
    for mod in list(model.modules()):
        for name, child in list(mod._modules.items()):
            if name.startswith(HOLDER_PREFIX) and type(child) is _HOLDER:
                child.refresh()
                del mod._modules[name]


def holders(model) -> List[object]:
    return [m for m in model.modules()
            if _HOLDER is not None and type(m) is _HOLDER]
