"""PyTorch's ordinary doors on a model laden holds: ``state_dict()``,
``load_state_dict()``, pickling and ``copy.deepcopy``, and laden itself
handed the model a second time.

What the model's modules hold outside a block's forward is each tensor's
own value (laden._bind.bind_in / bind_out put a slot there only inside
the block), so ``parameters()`` and attribute reads never see another
block's bytes.  Where a module holds ``meta`` instead (a disk-tier weight,
which has no copy in memory; a compact weight, expanded only where it
runs), ``state_dict()`` gets the value from the owner (read from the
checkpoint, expanded by C).  Writing through ``load_state_dict``,
pickling and copying are refused with a StateError that says what to do
instead.  Nothing here decides anything about memory: it only attaches.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterable, List, Optional

from .errors import StateError

__all__ = ["Doors", "claim", "unclaim", "owner_of", "refuse_owned"]


# ---- one owner per model ---------------------------------------------------------

# Every module laden manages (a model's root and its blocks) -> a short
# description of who holds it ("laden.from_pretrained", "ModelCache
# 'unet'").  Weak: a dropped model leaves by itself.
_OWNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def claim(modules: Iterable[object], who: str) -> None:
    for m in modules:
        if m is not None:
            _OWNED[m] = who


def unclaim(modules: Iterable[object]) -> None:
    for m in modules:
        if m is not None:
            _OWNED.pop(m, None)


def owner_of(model) -> Optional[str]:
    """Who in laden manages `model` or a module inside it, or None."""
    if not _OWNED:
        return None
    mods = model.modules() if hasattr(model, "modules") else [model]
    for m in mods:
        who = _OWNED.get(m)
        if who is not None:
            return who
    return None


def refuse_owned(model, what: str) -> None:
    """StateError, before anything changes, when laden already manages
    `model` (or a module inside it): two owners would point its
    parameters at two schedules' memory, and whichever bound last would
    run the other's slots."""
    who = owner_of(model)
    if who is not None:
        name = type(model).__name__
        raise StateError(
            f"{what}: the {name} given is already managed by laden ({who}); "
            "a model has one owner: use it as it is, or laden.release() it "
            "first (or, for a cached model, drop it from its cache)",
            "E_STATE")


# ---- the doors ----------------------------------------------------------------------

def _refuse_copy(name: str):
    def refuse(*args, **kwargs):
        raise StateError(
            f"{name} is managed by laden: its weights live in laden's memory "
            "(slots, host copies, the checkpoint on disk), which a pickle or "
            "a copy cannot carry.  For a plain copy, build the model again "
            "and load_state_dict(model.state_dict()) (laden's state_dict() "
            "holds every tensor's true value), or save_pretrained / "
            "torch.save(model.state_dict()) and load that", "E_STATE")
    return refuse


class Doors:
    """The doors of one model: hooks on the modules that hold laden's
    tensors, removed by ``close()``.

    ``tensors``: laden's _Tensor objects; ``value_of(t)``: t's true value
    as a CPU or device tensor, for one whose module holds meta;
    ``modules``: (module, its path from the root with a trailing dot) for
    the root and the blocks, which refuse copies and check a whole
    load_state_dict before anything in them is written.

    ``loaded``: while the model's bytes are still arriving (a background
    load), called before ``state_dict()`` of those modules reads a value:
    it waits for the load to end, or raises its error (None: the values
    are there).  ``parameters()`` does not wait: libraries read a
    parameter's dtype and device through it while the model runs (a
    transformers model's ``dtype``), which must not wait for the whole
    load."""

    def __init__(self, name: str, tensors: List[object],
                 value_of: Callable[[object], object],
                 modules: List[tuple],
                 loaded: Optional[Callable[[], None]] = None):
        self.name = name
        self.handles: list = []
        self.patched: list = []  # modules with our __reduce_ex__
        owned: Dict[int, list] = {}
        by_id: Dict[int, object] = {}
        for t in tensors:
            for mod, attr in t.aliases:
                owned.setdefault(id(mod), []).append((attr, t))
                by_id[id(mod)] = mod
        names = [n for t in tensors for n in t.names]
        for i, own in owned.items():
            mod = by_id[i]
            self.handles.append(mod._register_state_dict_hook(
                _true_values(own, value_of)))
            self.handles.append(mod._register_load_state_dict_pre_hook(
                _refuse_load(name, [a for a, _ in own])))
            self._patch(mod)
        for mod, path in modules:
            if mod is None:
                continue
            rel = [n[len(path):] for n in names if n.startswith(path)]
            if rel:
                self.handles.append(mod._register_load_state_dict_pre_hook(
                    _refuse_load(name, rel)))
            self._patch(mod)
        if loaded is not None:  # every module a state_dict may start at
            waits = {id(m): m for m, _ in modules if m is not None}
            waits.update(by_id)
            for mod in waits.values():
                self.handles.append(mod.register_state_dict_pre_hook(
                    lambda m, prefix, keep_vars: loaded()))

    def _patch(self, mod) -> None:
        if "__reduce_ex__" in mod.__dict__:
            return
        refuse = _refuse_copy(self.name)
        mod.__dict__["__reduce_ex__"] = refuse
        mod.__dict__["__deepcopy__"] = refuse
        self.patched.append(weakref.ref(mod))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for r in self.patched:
            mod = r()
            if mod is not None:
                mod.__dict__.pop("__reduce_ex__", None)
                mod.__dict__.pop("__deepcopy__", None)
        self.patched.clear()


def _is_meta(v) -> bool:
    local = getattr(v, "_local_tensor", None)
    return (local if local is not None else v).is_meta


def _true_values(own: list, value_of):
    """A state_dict hook: entries of laden's tensors that are meta in
    the module get their true value."""
    def hook(module, state_dict, prefix, local_metadata):
        for attr, t in own:
            key = prefix + attr
            v = state_dict.get(key)
            if v is not None and _is_meta(v):
                state_dict[key] = value_of(t)
        return state_dict
    return hook


def _refuse_load(name: str, keys: List[str]):
    """A load_state_dict pre-hook: refused when the state dict writes any
    of laden's tensors under this module (checked at the outermost module
    laden hooked before anything below it is written)."""
    def hook(state_dict, prefix, local_metadata, strict, missing, unexpected,
             errors):
        hit = next((prefix + k for k in keys if prefix + k in state_dict),
                   None)
        if hit is not None:
            raise StateError(
                f"load_state_dict into {name}: '{hit}' is in laden's memory "
                "(a slot other blocks reuse, the host copy the slots are "
                "filled from, or the checkpoint laden reads again), where a "
                "copy would be lost or wrong.  Change weights with "
                "set_adapters / laden.merge_adapter, or release() the model "
                "and load a checkpoint that holds the new weights; nothing "
                "was written", "E_STATE")
    return hook
