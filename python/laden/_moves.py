"""Guarding an offloaded model against moves: ``.to(...)`` and friends on a
model whose weights laden holds.  A move to where it runs, in the dtypes
it has, is a no-op; anything else raises StateError.

Here rather than in ``hf`` (which guards the models it loads and
re-exports these names) because ``streaming.release`` takes the guard
off: the core must not import an integration.
"""

from __future__ import annotations

from ._devices import _device
from .errors import StateError

_MOVES = ("to", "cuda", "cpu", "half", "float", "double", "bfloat16",
          "to_empty", "type")


def _move_target(args, kwargs):
    """(device or None, dtype or None) of a Module.to(...) call."""
    import torch

    dev = kwargs.get("device")
    dt = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dt = a
        elif isinstance(a, (str, torch.device, int)):
            dev = a
        elif isinstance(a, torch.Tensor):
            dev, dt = a.device, a.dtype
    if dev is not None:
        dev = torch.device("cuda", dev) if isinstance(dev, int) else \
            torch.device(dev)
    return dev, dt


def _same_device(d, device) -> bool:
    """Whether a move to `d` stays on `device`; "cuda" without an index is
    the current device, as for every torch move."""
    if d.type != device.type:
        return False
    if d.type != "cuda":
        return True
    return _device(d) == _device(device)


def _guard_moves(model, device, what: str = "the model") -> None:
    """``.to(...)`` and friends on a model whose weights laden holds, and on
    every module inside it: a move to where it runs, in the dtypes it has,
    is a no-op; anything else raises (its weights live in laden's tiers,
    which a move would bypass)."""
    for mod in model.modules():
        _guard_one(mod, model, device, what)


def _guard_one(mod, root, device, what: str) -> None:
    def refuse(call):
        raise StateError(
            f"{type(mod).__name__}.{call}: {what} is offloaded by laden "
            f"(its weights live in laden's memory and run on {device}); "
            "release it first (laden.release(model), or the pipeline "
            "handle's remove()), or load it again with the device and "
            "dtype wanted", "E_STATE")

    def to(*args, **kwargs):
        dev, dt = _move_target(args, kwargs)
        if dt is not None and any(p.dtype != dt for p in mod.parameters()
                                  if p.dtype.is_floating_point):
            refuse(f"to({dt})")
        if dev is not None and not _same_device(dev, device):
            refuse(f"to({dev})")
        return mod

    def moved(call):
        import torch

        as_to = {"half": torch.float16, "float": torch.float32,
                 "double": torch.float64, "bfloat16": torch.bfloat16,
                 "cpu": "cpu", "cuda": "cuda"}

        def f(*args, **kwargs):
            if call in as_to and not args and not kwargs:
                return to(as_to[call])  # a no-op where it already is
            if call == "cuda" and args and not kwargs:
                return to(torch.device("cuda", args[0])
                          if isinstance(args[0], int) else args[0])
            refuse(f"{call}()")
        return f

    mod.to = to
    for call in _MOVES[1:]:
        setattr(mod, call, moved(call))
    mod._laden_guarded = _MOVES


def unguard_moves(model) -> None:
    for mod in model.modules():
        for call in mod.__dict__.pop("_laden_guarded", ()):
            mod.__dict__.pop(call, None)
