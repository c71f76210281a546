"""The models users bring: transformers and diffusers classes, from a
local directory to a model running under a budget, in one call.

``from_pretrained`` reads the directory's config, builds the model with its
parameters on ``meta`` (buffers such as rotary ``inv_freq`` computed on the
CPU, as the class computes them), finds its blocks by structure, and hands
it to ``stream_load`` and ``install_offload``: the planning, reading and
streaming are the C library's, as for any model.  transformers and
diffusers are optional: imported only when a class of theirs is given.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional

from ._model import find_blocks
from .checkpoint import PathLike
from .errors import (InvalidArgumentError, LadenError, MismatchError,
                     StateError)

__all__ = ["from_pretrained", "find_blocks", "empty_weights"]


# ---- building on meta ----------------------------------------------------------

_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_",
          "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
          "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def empty_weights(dtype=None):
    """Builds modules with their parameters on ``meta`` and their buffers
    where the code puts them (the CPU): a parameter is moved to ``meta`` as
    it is registered, and ``torch.nn.init`` does nothing meanwhile (the
    weights come from the checkpoint), so building costs no memory and no
    time.  Buffers computed in ``__init__`` (rotary ``inv_freq``, causal
    masks, position ids) keep their values.  ``dtype``: the default dtype
    while building (floating parameters are made in it; a buffer the code
    computes in float32 explicitly stays float32, as with the library's own
    ``from_pretrained``)."""
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def to_meta(self, name, param):
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            kw = dict(p.__dict__)
            kw["requires_grad"] = p.requires_grad
            self._parameters[name] = type(p)(p.to("meta"), **kw)

    def no_init(tensor, *args, **kwargs):
        return tensor

    saved = {n: getattr(nn.init, n) for n in _INITS if hasattr(nn.init, n)}
    old_dtype = torch.get_default_dtype()
    nn.Module.register_parameter = to_meta
    for n in saved:
        setattr(nn.init, n, no_init)
    try:
        if dtype is not None and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        nn.Module.register_parameter = register
        for n, f in saved.items():
            setattr(nn.init, n, f)


# ---- which library --------------------------------------------------------------

def _library(model_cls) -> str:
    mods = [c.__module__ for c in getattr(model_cls, "__mro__", ())]
    if any(m.startswith("transformers.") for m in mods):
        return "transformers"
    if any(m.startswith("diffusers.") for m in mods):
        return "diffusers"
    raise InvalidArgumentError(
        f"laden.from_pretrained: {getattr(model_cls, '__name__', model_cls)!r}"
        " is not a transformers or diffusers model class (give e.g. "
        "AutoModelForCausalLM, LlamaForCausalLM or UNet2DModel; for any "
        "other module build it on meta and call laden.stream_load)",
        "E_INVAL")


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path}: not a directory (give the "
            "local directory save_pretrained wrote)", "E_INVAL")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path} has no config.json: not a "
            "transformers or diffusers model directory", "E_INVAL")
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") or
               n.endswith(".safetensors.index.json") for n in names):
        other = [n for n in names if n.endswith((".bin", ".pt", ".pth",
                                                 ".ckpt", ".gguf"))]
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path} has no .safetensors weights"
            + (f" (it has {', '.join(sorted(other)[:3])}: laden reads "
               "safetensors; save them with save_pretrained("
               "safe_serialization=True))" if other else ""), "E_INVAL")


def _dtype_of(name):
    import torch

    if name is None or isinstance(name, torch.dtype):
        return name
    if isinstance(name, str):
        d = getattr(torch, name.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    raise InvalidArgumentError(f"laden.from_pretrained: dtype {name!r} is "
                               "not a torch dtype", "E_INVAL")


def _checkpoint_dtype(path: str):
    """The dtype most of the checkpoint's floating bytes are stored in."""
    from .checkpoint import Checkpoint

    by: dict = {}
    with Checkpoint(path) as ck:
        for t in ck.tensors():
            d = t.torch_dtype
            if d is not None and d.is_floating_point:
                by[d] = by.get(d, 0) + t.nbytes
    return max(by, key=by.get) if by else None


def _build(model_cls, lib: str, path: str, dtype, kwargs):
    """The config read, the model built with empty_weights; returns
    (model, dtype)."""
    if lib == "transformers":
        import transformers

        cfg_cls = getattr(model_cls, "config_class", None)
        auto = cfg_cls is None or model_cls.__module__.startswith(
            "transformers.models.auto")
        cfg_kw = {k: kwargs.pop(k) for k in list(kwargs)
                  if k in ("trust_remote_code", "revision")}
        try:
            cfg = (transformers.AutoConfig.from_pretrained(path, **cfg_kw)
                   if auto else cfg_cls.from_pretrained(path, **cfg_kw))
        except (OSError, ValueError, KeyError) as e:
            raise InvalidArgumentError(
                f"laden.from_pretrained: {path}: cannot read its config: "
                f"{str(e).splitlines()[0]}", "E_INVAL") from e
        for k, v in kwargs.items():  # config overrides, as transformers
            setattr(cfg, k, v)
        if dtype is None:
            dtype = _dtype_of(getattr(cfg, "dtype", None) or
                              getattr(cfg, "torch_dtype", None))
        dtype = dtype or _checkpoint_dtype(path)
        for attr in ("dtype", "torch_dtype"):  # the library builds in it
            if hasattr(cfg, attr):
                setattr(cfg, attr, dtype)
        try:
            with empty_weights(dtype):
                model = (model_cls.from_config(cfg) if auto
                         else model_cls._from_config(cfg))
        except ValueError as e:
            raise InvalidArgumentError(
                f"laden.from_pretrained: {model_cls.__name__} cannot build "
                f"the model of {path} (model_type "
                f"{getattr(cfg, 'model_type', '?')!r}): "
                f"{str(e).splitlines()[0]}", "E_INVAL") from e
        return model, dtype
    try:
        cfg = model_cls.load_config(path)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path}: cannot read its config: "
            f"{str(e).splitlines()[0]}", "E_INVAL") from e
    want = cfg.get("_class_name")
    if want and want != model_cls.__name__ and \
            not model_cls.__name__.startswith("AutoModel"):
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path} holds a {want}, not a "
            f"{model_cls.__name__}", "E_INVAL")
    cfg.update(kwargs)
    dtype = dtype or _checkpoint_dtype(path)
    with empty_weights(dtype):
        model = model_cls.from_config(cfg)
    return model, dtype


def _key_map(model, path: str):
    """A checkpoint saved from the model with its head loads into the base
    model and back: the base model's prefix (``model.``, ``transformer.``)
    is taken off or put on when only one side has it."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return None
    from .checkpoint import Checkpoint

    with Checkpoint(path) as ck:
        names = ck.names()
    want = set(model.state_dict().keys())
    p = prefix + "."
    ck_pre = sum(n.startswith(p) for n in names)
    mod_pre = sum(n.startswith(p) for n in want)
    if ck_pre > len(names) // 2 and mod_pre == 0:
        return lambda n: n[len(p):] if n.startswith(p) and \
            n[len(p):] in want else None
    if ck_pre == 0 and mod_pre > len(want) // 2:
        return lambda n: p + n
    return None


# ---- moving an offloaded model ---------------------------------------------------

def _guard_moves(model, device) -> None:
    """``model.to(...)`` and friends on a model whose weights laden holds:
    a move to where it runs is a no-op, anything else raises (its weights
    live in laden's tiers, which a move would bypass)."""
    import torch

    def refuse(what):
        raise StateError(
            f"{type(model).__name__}.{what}: the model is offloaded by laden "
            f"(its weights live in laden's memory and run on {device}); "
            "call laden.release(model) first, or load it again with "
            "laden.from_pretrained(..., device=..., dtype=...)", "E_STATE")

    def to(*args, **kwargs):
        dev = kwargs.get("device")
        dt = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dt = a
            elif isinstance(a, (str, torch.device, int)):
                dev = a
            elif isinstance(a, torch.Tensor):
                dev, dt = a.device, a.dtype
        if dt is not None and dt != model.dtype:
            refuse(f"to({dt})")
        if dev is not None:
            d = torch.device(dev) if not isinstance(dev, int) else \
                torch.device("cuda", dev)
            if d.type != device.type or (d.index is not None and
                                         device.index is not None and
                                         d.index != device.index):
                refuse(f"to({d})")
        return model

    def moved(what):
        def f(*args, **kwargs):
            refuse(f"{what}()")
        return f

    model.to = to
    for what in ("cuda", "cpu", "half", "float", "double", "bfloat16",
                 "to_empty"):
        setattr(model, what, moved(what))
    model._laden_guarded = ("to", "cuda", "cpu", "half", "float", "double",
                            "bfloat16", "to_empty")


def unguard_moves(model) -> None:
    for what in model.__dict__.pop("_laden_guarded", ()):
        model.__dict__.pop(what, None)


# ---- the one call ----------------------------------------------------------------

def from_pretrained(model_cls, path: PathLike, *, device=None,
                    vram_budget=None, ram_budget=None, dtype=None, plan=None,
                    lookahead: int = 2, progress: Optional[bool] = None,
                    subfolder: Optional[str] = None, **kwargs):
    """A transformers or diffusers model from a local directory, running
    under laden within the budgets, in one call.

    ``model_cls``: any transformers model class with a config
    (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ``T5Model``, ...) or
    diffusers model class (``UNet2DModel``, ``FluxTransformer2DModel``,
    ...).  The model is built from the directory's ``config.json`` with
    its parameters on ``meta``, its repeated blocks found by structure
    (``find_blocks``), planned under ``vram_budget`` / ``ram_budget`` (see
    ``laden.stream_load``), loaded from its safetensors (one file, or
    shards with their index) in the checkpoint's dtype or ``dtype``, and
    returned installed: call it, or ``generate()``, as the plain model.
    ``laden.release(model)`` frees everything.  Other keyword arguments
    override the config.  ``model.to(...)`` to another device or dtype
    raises (release first); ``eval()``, ``train()``, ``device``,
    ``dtype`` behave as usual."""
    import torch

    from . import streaming

    path = os.fspath(path)
    if subfolder:
        path = os.path.join(path, subfolder)
    lib = _library(model_cls)
    _check_dir(path)
    dtype = _dtype_of(dtype)
    model, dtype = _build(model_cls, lib, path, dtype, dict(kwargs))
    model.eval()
    blocks = find_blocks(model)
    dev = streaming._device(device)
    try:
        streaming.stream_load(
            model, path, plan=plan,
            offload_prefixes=None if plan is not None else blocks,
            device=dev, vram_budget=vram_budget, ram_budget=ram_budget,
            key_map=_key_map(model, path), lookahead=lookahead,
            progress=progress)
        streaming.install_offload(model, lookahead=lookahead)
    except LadenError as e:
        if getattr(model, "_laden_stream", None) is not None:
            streaming.release(model)
        if isinstance(e, MismatchError):
            raise
        raise type(e)(f"laden.from_pretrained({os.path.basename(path)}): "
                      f"{e}", e.status, e.code) from None
    _guard_moves(model, dev)
    return model


# ---- diffusers pipelines ---------------------------------------------------------

# Methods a pipeline calls on its components besides forward (VAEs).
_ENTRY_POINTS = ("forward", "encode", "decode", "tiled_encode", "tiled_decode")


class PipelineHandle:
    """What ``offload_pipeline`` did; ``remove()`` undoes it (every
    component back to an ordinary CPU module with its weights)."""

    def __init__(self, pipe, cache, keys, device):
        self.pipe = pipe
        self.cache = cache
        self.keys = list(keys)
        self.device = device
        self._wrapped: list = []  # (module, attribute, had its own)
        self._cls = None
        self._offloaders: dict = {}

    def stats(self):
        """The cache's counters (activations, hits, uploads, evictions)."""
        return self.cache.stats()

    def remove(self) -> None:
        if self.pipe is None:
            return
        for mod, name, prev in reversed(self._wrapped):
            if prev is None:
                mod.__dict__.pop(name, None)
            else:
                setattr(mod, name, prev)
        self._wrapped.clear()
        for off in self._offloaders.values():
            off.close()
        if self._cls is not None:
            self.pipe.__class__ = self._cls
        self.pipe.__dict__.pop("_laden_pipeline", None)
        self.pipe = None


def offload_pipeline(pipe, *, device=None, vram_budget=None,
                     ram_budget=None, lookahead: int = 2) -> PipelineHandle:
    """Runs a diffusers pipeline's components (text encoders, denoiser,
    VAE) under one ``ModelCache`` and one budget.  Each component is
    activated when the pipeline calls it (its ``forward``, or a VAE's
    ``encode``/``decode``) and kept on the device after, while the budget
    has room; one that does not fit streams its blocks (found by
    ``find_blocks``).  The components must be on the CPU, as
    ``from_pretrained`` builds them; ``pipe(...)`` is called exactly as
    before and runs on ``device``.  ``ram_budget`` bounds the pinned host
    copies.  Returns a handle; ``handle.remove()`` gives the components back
    as ordinary CPU modules."""
    import functools

    import torch

    from .cache import ModelCache, ModelOffloader
    from .streaming import _device

    if getattr(pipe, "_laden_pipeline", None) is not None:
        raise StateError("offload_pipeline: the pipeline is offloaded "
                         "already; remove() its handle first", "E_STATE")
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, dict):
        raise InvalidArgumentError(
            f"offload_pipeline: {type(pipe).__name__} is not a diffusers "
            "pipeline (it has no .components)", "E_INVAL")
    mods = {k: m for k, m in comps.items() if isinstance(m, torch.nn.Module)}
    if not mods:
        raise InvalidArgumentError("offload_pipeline: the pipeline has no "
                                   "torch modules", "E_INVAL")
    for k, m in mods.items():
        on = {t.device.type for t in m.parameters()}
        if on - {"cpu"}:
            raise InvalidArgumentError(
                f"offload_pipeline: component '{k}' is on "
                f"{', '.join(sorted(on - {'cpu'}))}; laden takes components "
                "on the CPU (load the pipeline without .to(...))", "E_INVAL")
    dev = _device(device)
    cache = ModelCache(vram_budget=vram_budget, pinned_budget=ram_budget)
    h = PipelineHandle(pipe, cache, mods, dev)
    try:
        for k, m in mods.items():
            off = ModelOffloader(m, block_paths=[
                p.rstrip(".") for p in find_blocks(m)], key=k, cache=cache)
            h._offloaders[k] = off
            depth = [0]
            for name in _ENTRY_POINTS:
                fn = getattr(m, name, None)
                if fn is None or not callable(fn):
                    continue

                @functools.wraps(fn)
                def call(*args, _fn=fn, _off=off, _depth=depth, **kwargs):
                    if _depth[0]:  # decode -> forward: one use
                        return _fn(*args, **kwargs)
                    _depth[0] += 1
                    try:
                        _off.activate(dev, lookahead=lookahead)
                        try:
                            return _fn(*args, **kwargs)
                        finally:
                            _off.deactivate(evict=False)
                    finally:
                        _depth[0] -= 1

                h._wrapped.append((m, name, m.__dict__.get(name)))
                setattr(m, name, call)
        # The pipeline puts its inputs where it runs: on `dev`, wherever
        # its idle components' weights are.
        base = type(pipe)
        h._cls = base
        pipe.__class__ = type(base.__name__, (base,), {
            "_execution_device": property(lambda self: dev),
            "device": property(lambda self: dev),
            "__module__": base.__module__})
        pipe._laden_pipeline = h
    except BaseException:
        h.remove()
        raise
    return h
