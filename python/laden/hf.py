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
import math
import os
import threading
from typing import Dict, List, Optional

from . import doors, planning, streaming
from ._describe import find_blocks
from ._devices import _device
# The move guard lives below streaming (release takes it off); the names
# stay importable from here, where they were.
from ._moves import (_MOVES, _guard_moves, _guard_one, _move_target,
                     _same_device, unguard_moves)
from .cache import ModelCache, ModelOffloader
from .checkpoint import Checkpoint, PathLike, read_text
from .errors import (FormatError, InvalidArgumentError, LadenError,
                     MismatchError, StateError)
from .gguf import check_config as _gguf_check_config
from .gguf import llama_key_map

__all__ = ["from_pretrained", "find_blocks", "empty_weights"]


# ---- building on meta ----------------------------------------------------------

_building = threading.local()   # this thread is inside empty_weights
_build_lock = threading.RLock()  # one build at a time: the default dtype
                                 # is the process's
_patched = False


def _patch_once() -> None:
    """Wraps nn.Module.register_parameter once for the process: it
    changes behaviour only on a thread inside empty_weights, so another
    thread building a module meanwhile gets ordinary parameters, and no
    order of exits can leave torch patched.  torch.nn.init is left alone:
    a registered parameter is on meta already, where initialising costs
    nothing."""
    global _patched
    if _patched:
        return
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def register_parameter(self, name, param):
        register(self, name, param)
        if not getattr(_building, "on", False):
            return
        p = self._parameters.get(name)
        if p is None or p.device.type == "meta" or \
                isinstance(p, nn.parameter.UninitializedParameter):
            return
        meta = torch.empty_like(p, device="meta")
        q = torch.Tensor._make_subclass(type(p), meta, p.requires_grad)
        for k, v in p.__dict__.items():  # attributes set before
            setattr(q, k, v)
        self._parameters[name] = q

    nn.Module.register_parameter = register_parameter
    _patched = True


@contextlib.contextmanager
def empty_weights(dtype=None):
    """Builds modules with their parameters on ``meta`` and their buffers
    where the code puts them (the CPU): a parameter is moved to ``meta`` as
    it is registered (the weights come from the checkpoint), so building
    costs no memory and initialising it no time.  Buffers computed in ``__init__`` (rotary
    ``inv_freq``, causal masks, position ids) keep their values, and a
    buffer filled with ``nn.init`` is filled.  ``dtype``: the default
    dtype while building.  Only the calling thread is affected, and one
    build runs at a time (the default dtype is the process's)."""
    import torch

    _patch_once()
    with _build_lock:
        was = getattr(_building, "on", False)
        old_dtype = torch.get_default_dtype()
        _building.on = True
        try:
            if dtype is not None and dtype.is_floating_point:
                torch.set_default_dtype(dtype)
            yield
        finally:
            torch.set_default_dtype(old_dtype)
            _building.on = was


# ---- the config, checked against the checkpoint before anything is built ----------

# config.json is read by laden first (the libraries' own readers raise
# what JSON's does, or recurse without bound); far beyond any real config.
_CONFIG_BYTES = 64 << 20


def read_config_json(path: str) -> dict:
    """The JSON object in config.json file `path` (read and checked by C:
    checkpoint.read_text): FormatError naming the file (and the line and
    column where the JSON goes wrong) for what is not one; ReadError when
    it cannot be read."""
    doc = read_text(path, _CONFIG_BYTES, is_json=True)
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: a JSON {type(doc).__name__}, not an "
                          "object of config fields", "E_SCHEMA")
    return doc


# Fields that count a model's repeated layers (transformers' and
# diffusers' names); each list needs that many distinct indices under one
# prefix of the checkpoint's names (``model.layers.N.``, ``h.N.``,
# ``down_blocks.N.resnets.M.``).
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers",
                 "num_decoder_layers", "num_encoder_layers",
                 "encoder_layers", "decoder_layers", "num_single_layers",
                 "layers_per_block")
# Fields saying the layers share weights (ALBERT): fewer in the checkpoint.
_SHARED_LAYERS = ("num_hidden_groups", "inner_group_num")
# The token embedding, by the last part of its name.
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings",
               "embed_in", "shared", "token_embedding", "embeddings",
               "token_embd")
_HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
# Fields saying the embedding is narrower than the hidden size.
_OWN_EMBED_WIDTH = ("embedding_size", "word_embed_proj_dim", "embed_dim",
                    "embedding_dim", "d_embed", "project_in")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _subconfigs(cfg: dict, depth: int = 0):
    """cfg and the configs nested in it (text_config, encoder, ...)."""
    yield "", cfg
    if depth >= 3:
        return
    for k, v in cfg.items():
        if isinstance(v, dict):
            for p, sub in _subconfigs(v, depth + 1):
                yield f"{k}.{p}", sub


def _block_counts(table) -> Dict[str, int]:
    """prefix -> distinct indices under it, for every numeric part of the
    checkpoint's names (``a.0.b.3.w`` counts under ``a.`` and ``a.0.b.``)."""
    seen: Dict[str, set] = {}
    for t in table:
        parts = t.name.split(".")
        for i, p in enumerate(parts[:-1]):
            if p.isdigit() and i > 0:
                seen.setdefault(".".join(parts[:i]) + ".", set()).add(p)
    return {k: len(v) for k, v in seen.items()}


def check_config(cfg: dict, table, where: str) -> None:
    """The config's sizes against the checkpoint's tensor table (names
    and shapes, no data), before anything is built: a layer count no
    block list of the checkpoint has, a vocabulary or hidden size larger
    than its token embedding.  MismatchError naming the field, its value
    and what the checkpoint holds; FormatError for a count that is not a
    whole number."""
    counts = _block_counts(table)
    most = max(counts.values()) if counts else None
    widest = max(counts, key=counts.get) if counts else None
    for pre, sub in _subconfigs(cfg):
        shared = any(k in sub for k in _SHARED_LAYERS)
        for f in _LAYER_FIELDS:
            v = sub.get(f)
            vs = v if isinstance(v, (list, tuple)) else [v]
            for x in vs:
                if x is None or not _is_int(x) and not isinstance(x, float):
                    continue  # the library's to judge
                if not _is_int(x) or x < 0:
                    raise FormatError(
                        f"{where}: field '{pre}{f}' is {x!r}; a layer count "
                        "is a whole number of 0 or more", "E_SCHEMA")
                if most is not None and not shared and x > most:
                    raise MismatchError(
                        f"{where}: field '{pre}{f}' is {x}, and no list of "
                        f"blocks in the checkpoint has that many: the "
                        f"longest has {most} ('{widest}N'); the config does "
                        "not describe this checkpoint")
    embeds = [t for t in table if len(t.shape) == 2 and
              _embedding_name(t.name)]
    if not embeds:
        return
    rows = max(embeds, key=lambda t: t.shape[0])
    cols = max(embeds, key=lambda t: t.shape[1])
    for pre, sub in _subconfigs(cfg):
        if pre not in ("", "text_config."):
            continue
        for f in ("vocab_size",) + _HIDDEN_FIELDS:
            v = sub.get(f)
            if _is_int(v) and v < 0:
                raise FormatError(
                    f"{where}: field '{pre}{f}' is {v}; a size is a whole "
                    "number of 0 or more", "E_SCHEMA")
        v = sub.get("vocab_size")
        if _is_int(v) and v > rows.shape[0]:
            raise MismatchError(
                f"{where}: field '{pre}vocab_size' is {v}, larger than the "
                f"checkpoint's token embedding '{rows.name}' "
                f"{list(rows.shape)} ({rows.shape[0]} rows)")
        if any(k in sub for k in _OWN_EMBED_WIDTH):
            continue
        for f in _HIDDEN_FIELDS:
            v = sub.get(f)
            if _is_int(v) and v > cols.shape[1]:
                raise MismatchError(
                    f"{where}: field '{pre}{f}' is {v}, wider than the "
                    f"checkpoint's token embedding '{cols.name}' "
                    f"{list(cols.shape)} ({cols.shape[1]} columns)")


def _embedding_name(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and \
        parts[-2] in _EMBEDDINGS


def _fields_like(cfg: dict, dims, limit: int = 4) -> List[str]:
    """Names of the config's whole-number fields equal to one of `dims`
    (the sizes of a tensor the build asked for)."""
    want = {d for d in dims if d > 1}
    out = []
    for pre, sub in _subconfigs(cfg):
        for k, v in sub.items():
            if _is_int(v) and v in want:
                out.append(f"{pre}{k}={v}")
    return out[:limit]


def _negative_fields(cfg: dict) -> List[str]:
    return [f"{pre}{k}={v}" for pre, sub in _subconfigs(cfg)
            for k, v in sub.items() if _is_int(v) and v < 0 and
            not k.endswith("_id") and not k.endswith("_index")][:4]


def _zero_fields(cfg: dict) -> List[str]:
    return [f"{pre}{k}" for pre, sub in _subconfigs(cfg)
            for k, v in sub.items() if _is_int(v) and v == 0 and
            ("head" in k or "size" in k or "dim" in k or "group" in k)][:4]


class _TooLarge(Exception):
    def __init__(self, shape, numel, what):
        super().__init__(what)
        self.shape, self.numel, self.what = shape, numel, what


# A build may ask for more than the checkpoint's largest tensor (a buffer
# such as a causal mask, a parameter kept in float32, a mixture-of-experts
# parameter transformers fuses from one tensor per expert), never for this
# much more: elements in one tensor beyond twice the checkpoint's largest
# or its whole total, and in all tensors beyond four times its total.
_ALLOC_SLACK = 1 << 28


def _numel_asked(func, args, kwargs):
    """(shape, elements) a factory call asks for, or None."""
    import torch

    def dims(a):
        if len(a) == 1 and isinstance(a[0], (tuple, list, torch.Size)):
            a = tuple(a[0])
        return tuple(int(x) for x in a)

    name = getattr(func, "__name__", "")
    try:
        if name in ("empty", "zeros", "ones", "rand", "randn", "new_empty",
                    "new_zeros", "new_ones"):
            size = kwargs.get("size")
            a = args[1:] if name.startswith("new_") else args
            shape = dims((size,) if size is not None else a)
        elif name in ("full", "new_full", "empty_strided"):
            a = args[1:] if name == "new_full" else args
            shape = dims((kwargs.get("size", a[0] if a else ()),))
        elif name == "randint":
            shape = dims((kwargs.get("size", args[-1] if args else ()),))
        elif name == "eye":
            n = int(args[0])
            shape = (n, int(args[1]) if len(args) > 1 and
                     not isinstance(args[1], torch.dtype) else n)
        elif name in ("linspace", "logspace"):
            shape = (int(kwargs.get("steps", args[2] if len(args) > 2
                                    else 0)),)
        elif name == "arange":
            nums = [a for a in args if isinstance(a, (int, float))]
            start, end, step = (0, nums[0], 1) if len(nums) == 1 else \
                (nums + [1])[:3] if nums else (0, 0, 1)
            shape = (max(0, math.ceil((end - start) / step)) if step
                     else 0,)
        else:
            return None
    except (TypeError, ValueError, IndexError, OverflowError,
            ZeroDivisionError):
        return None
    return shape, math.prod(shape)


@contextlib.contextmanager
def _allocation_guard(table):
    """While the model is built: a factory call (torch.empty, zeros, ...)
    asking for more elements than the checkpoint's largest tensor
    justifies, or all of them for more than its total, raises _TooLarge
    before anything is allocated (a config with a vocabulary of 10**12
    would otherwise have torch allocate 256 TB on the CPU before the
    parameter moves to meta)."""
    import torch
    from torch.overrides import TorchFunctionMode

    largest = max((math.prod(t.shape) for t in table), default=0)
    total = sum(math.prod(t.shape) for t in table)
    one = max(2 * largest, total) + _ALLOC_SLACK
    every = 4 * total + _ALLOC_SLACK
    get_default = getattr(torch, "get_default_device", None)

    class Guard(TorchFunctionMode):
        asked = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            got = _numel_asked(func, args, kwargs)
            if got is not None:
                dev = kwargs.get("device")
                if dev is None and getattr(func, "__name__", "").startswith(
                        "new_") and args and hasattr(args[0], "device"):
                    dev = args[0].device
                if dev is None and get_default is not None:
                    dev = get_default()
                if dev is None or torch.device(dev).type != "meta":
                    shape, n = got
                    self.asked += n
                    if n > one:
                        raise _TooLarge(shape, n, "one tensor")
                    if self.asked > every:
                        raise _TooLarge(shape, self.asked, "all tensors")
            return func(*args, **kwargs)

    with Guard():
        yield


def _cannot_build(e: BaseException, cls, where: str, cfg: dict,
                  attn) -> LadenError:
    """The error for an exception raised while building the model from
    its config: InvalidArgumentError naming attn_implementation when that
    was given and the library refused it; else FormatError naming the
    config file and the fields it points at."""
    name = getattr(cls, "__name__", str(cls))
    if isinstance(e, _TooLarge):
        fields = _fields_like(cfg, e.shape)
        return FormatError(
            f"{where}: building {name} would allocate "
            + (f"a tensor of shape {list(e.shape)}" if e.what == "one tensor"
               else f"{e.numel} elements in all (the last a tensor of shape "
                    f"{list(e.shape)})")
            + ", far more than the checkpoint's tensors hold"
            + (f" (config fields {', '.join(fields)})" if fields else "")
            + ": the config does not describe this checkpoint", "E_LIMIT")
    msg = " ".join(str(e).split()) or type(e).__name__
    if len(msg) > 300:
        msg = msg[:297] + "..."
    if attn is not None and isinstance(e, (ValueError, ImportError)) and \
            "attn" in msg.lower():
        return InvalidArgumentError(
            f"laden.from_pretrained: attn_implementation={attn!r}: {name} "
            f"cannot be built with it: {msg}", "E_INVAL")
    return FormatError(f"{where}: {name} cannot build the model it "
                       f"describes: {type(e).__name__}: {msg}"
                       + _hint(e, cfg), "E_SCHEMA")


def _hint(e: BaseException, cfg: dict) -> str:
    import re

    if re.search(r"field '([^']+)'", str(e)):
        return ""  # named already
    if isinstance(e, ZeroDivisionError):
        zs = _zero_fields(cfg)
        if zs:
            return f" (fields that are 0: {', '.join(zs)})"
    if isinstance(e, RecursionError):
        return " (nested too deeply)"
    neg = _negative_fields(cfg)  # torch: "negative dimension -5"
    if neg:
        return f" (fields below 0: {', '.join(neg)})"
    return ""


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


def _weights(path: str, variant: Optional[str]) -> str:
    """The checkpoint in a model directory: the file of the `variant`
    (``model.fp16.safetensors``, ``diffusion_pytorch_model.fp16.safetensors``)
    when one is asked for; else the index, or the one file without a
    variant, beside variant files the libraries also write."""
    names = os.listdir(path)
    files = sorted(n for n in names if n.endswith(".safetensors"))
    indexes = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    if variant:
        want = [n for n in files if n.endswith(f".{variant}.safetensors")]
        if len(want) == 1:
            return os.path.join(path, want[0])
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path} has "
            + (f"{len(want)} files of variant '{variant}' (sharded variants "
               "are not supported)" if want else
               f"no variant '{variant}' (*.{variant}.safetensors); its "
               f"weights: {', '.join(files) or 'none'}"), "E_INVAL")
    if len(indexes) == 1:
        return os.path.join(path, indexes[0])
    plain = [n for n in files if n.count(".") == 1]
    if not indexes and len(plain) == 1:
        return os.path.join(path, plain[0])
    return path  # laden_st_open says what it finds there


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


def _checkpoint_dtype(table):
    """The dtype most of the checkpoint's floating bytes are stored in
    (`table`: its TensorInfos)."""
    by: dict = {}
    for t in table:
        d = t.torch_dtype
        if d is not None and d.is_floating_point:
            by[d] = by.get(d, 0) + t.nbytes
    return max(by, key=by.get) if by else None


def _dtype_field(cfg) -> str:
    """The config's name for the dtype: ``dtype`` on transformers that
    renamed it (4.56 on: ``torch_dtype`` is a property kept for old code,
    warning whenever it is used, or gone), ``torch_dtype`` on those
    before (an attribute set in the config's __init__).  Read from the
    class and the instance without calling either name."""
    import inspect

    alias = inspect.getattr_static(type(cfg), "torch_dtype", None)
    if isinstance(alias, property):
        return "dtype"
    own = getattr(cfg, "__dict__", {})
    if "torch_dtype" in own:
        return "torch_dtype"
    if "dtype" in own or \
            inspect.getattr_static(type(cfg), "dtype", None) is not None:
        return "dtype"
    return "torch_dtype"


def _config_dict(cfg) -> dict:
    """A transformers config as a dict of its fields (sub-configs nested),
    for check_config; {} if the config cannot say (left to the build)."""
    try:
        d = cfg.to_dict()
    except Exception:
        return {}
    return d if isinstance(d, dict) else {}


def _builds(model_cls, cfg) -> bool:
    """Whether auto class model_cls has a model for cfg's class (or the
    config names remote code); True when it cannot tell."""
    try:
        return type(cfg) in model_cls._model_mapping or \
            bool(getattr(cfg, "auto_map", None))
    except Exception:
        return True


def _build(model_cls, lib: str, path: str, dtype, kwargs, table):
    """The config read and checked against the checkpoint's tensor table
    (`table`), then the model built with empty_weights; returns (model,
    dtype).  What the config holds that cannot be built raises FormatError
    (MismatchError where the checkpoint contradicts it) naming the config
    file and the field, before anything large is allocated."""
    gguf = kwargs.get("gguf_file")
    where = os.path.join(path, gguf) if gguf else \
        os.path.join(path, "config.json")
    # Its JSON, read before the library's reader (which raises what
    # json's does, or recurses without bound).
    raw = {} if gguf else read_config_json(where)
    name = getattr(model_cls, "__name__", str(model_cls))
    if lib == "transformers":
        import transformers

        cfg_cls = getattr(model_cls, "config_class", None)
        auto = cfg_cls is None or model_cls.__module__.startswith(
            "transformers.models.auto")
        cfg_kw = {k: kwargs.pop(k) for k in list(kwargs)
                  if k in ("trust_remote_code", "revision", "gguf_file")}
        try:
            cfg = (transformers.AutoConfig.from_pretrained(path, **cfg_kw)
                   if auto else cfg_cls.from_pretrained(path, **cfg_kw))
        except LadenError:
            raise
        except OSError as e:
            raise InvalidArgumentError(
                f"laden.from_pretrained: {path}: cannot read its config: "
                f"{str(e).splitlines()[0] if str(e) else e!r}",
                "E_INVAL") from e
        except Exception as e:  # the library's checks, or its failures
            msg = " ".join(str(e).split()) or type(e).__name__
            raise FormatError(
                f"{where}: cannot read the config: {type(e).__name__}: "
                f"{msg[:300]}" + _hint(e, raw), "E_SCHEMA") from e
        attn = kwargs.pop("attn_implementation", None)
        unknown = [k for k in kwargs if not hasattr(cfg, k)]
        if unknown:
            raise InvalidArgumentError(
                f"laden.from_pretrained: {', '.join(sorted(unknown))}: not "
                f"a field of {type(cfg).__name__} nor an argument of "
                "from_pretrained (device, vram_budget, ram_budget, dtype, "
                "plan, lookahead, progress, subfolder, attn_implementation)",
                "E_INVAL")
        for k, v in kwargs.items():  # config overrides, as transformers
            setattr(cfg, k, v)
        if attn is not None:
            cfg._attn_implementation = attn
        if auto and not _builds(model_cls, cfg):
            raise InvalidArgumentError(
                f"laden.from_pretrained: {name} cannot build the model of "
                f"{path}: its config is a {type(cfg).__name__} (model_type "
                f"{getattr(cfg, 'model_type', '?')!r}), which {name} has "
                "no model for", "E_INVAL")
        fields = _config_dict(cfg)
        check_config(fields, table, where)
        field = _dtype_field(cfg)
        if dtype is None:
            dtype = _dtype_of(getattr(cfg, field, None))
        dtype = dtype or _checkpoint_dtype(table)
        setattr(cfg, field, dtype)  # the library builds in it
        try:
            with _allocation_guard(table), empty_weights(dtype):
                model = (model_cls.from_config(cfg) if auto
                         else model_cls._from_config(cfg))
                _buffers_in_float32(model)
        except LadenError:
            raise
        except Exception as e:
            raise _cannot_build(e, model_cls, where, fields, attn) from e
        _keep_in_fp32(model, dtype)
        return model, dtype
    try:
        cfg = model_cls.load_config(path)
    except OSError as e:
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path}: cannot read its config: "
            f"{str(e).splitlines()[0] if str(e) else e!r}", "E_INVAL") from e
    except Exception as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise FormatError(f"{where}: cannot read the config: "
                          f"{type(e).__name__}: {msg[:300]}"
                          + _hint(e, raw), "E_SCHEMA") from e
    if not isinstance(cfg, dict):
        raise FormatError(f"{where}: not an object of config fields",
                          "E_SCHEMA")
    want = cfg.get("_class_name")
    if want and want != model_cls.__name__ and \
            not model_cls.__name__.startswith("AutoModel"):
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path} holds a {want}, not a "
            f"{model_cls.__name__}", "E_INVAL")
    unknown = [k for k in kwargs if k not in cfg]
    if unknown:
        raise InvalidArgumentError(
            f"laden.from_pretrained: {', '.join(sorted(unknown))}: not in "
            f"{model_cls.__name__}'s config nor an argument of "
            "from_pretrained", "E_INVAL")
    cfg.update(kwargs)
    check_config(cfg, table, where)
    dtype = dtype or _checkpoint_dtype(table)
    try:
        with _allocation_guard(table), empty_weights(dtype):
            model = model_cls.from_config(cfg)
    except LadenError:
        raise
    except Exception as e:
        raise _cannot_build(e, model_cls, where, cfg, None) from e
    _keep_in_fp32(model, dtype)
    return model, dtype


def _buffers_in_float32(model) -> None:
    """Non-persistent buffers made again by the library's own init, in
    float32, as transformers' from_pretrained does after loading: built
    under a bf16 default dtype, some (GPT-J's sinusoidal positions) would
    be rounded."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    with empty_weights():  # float32 default; parameters are on meta
        for mod in model.modules():
            names = getattr(mod, "_non_persistent_buffers_set", ())
            if not names:
                continue
            for n in names:
                b = mod._buffers.get(n)
                if b is not None and hasattr(b, "_is_hf_initialized"):
                    try:
                        del b._is_hf_initialized
                    except AttributeError:
                        pass
            try:
                init(mod)
            except Exception:  # a module its init does not know: as built
                pass


def _keep_in_fp32(model, dtype) -> None:
    """Parameters of the modules the class keeps in float32
    (``_keep_in_fp32_modules``: T5's ``wo``) are made float32, as the
    library's own from_pretrained makes them; laden converts them on
    load."""
    import torch

    if dtype is None or dtype == torch.float32:
        return
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | \
        set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not keep:
        return
    for name, mod in model.named_modules():
        if not any(k in name.split(".") for k in keep):
            continue
        for pn, p in list(mod._parameters.items()):
            if p is not None and p.dtype.is_floating_point and \
                    p.dtype != torch.float32:
                q = torch.nn.Parameter(
                    torch.empty_like(p, device="meta", dtype=torch.float32),
                    requires_grad=p.requires_grad)
                mod._parameters[pn] = q


def _called_from_outside(model) -> Optional[List[str]]:
    """Blocks whose parts the model's forward calls outside the block: they
    stay resident (a streamed block's parts refuse to run outside it).
    diffusers' DiT and ada_norm_zero Transformer2DModel call
    ``transformer_blocks[0].norm1.emb`` after the block loop."""
    cfg = getattr(model, "config", None)
    norm = cfg.get("norm_type") if isinstance(cfg, dict) else \
        getattr(cfg, "norm_type", None)
    if norm == "ada_norm_zero" and hasattr(model, "transformer_blocks"):
        return ["transformer_blocks.0."]
    return None


# ---- the one call ----------------------------------------------------------------

def from_pretrained(model_cls, path: PathLike, *, device=None,
                    vram_budget=None, ram_budget=None, dtype=None, plan=None,
                    lookahead: int = 2, progress: Optional[bool] = None,
                    subfolder: Optional[str] = None,
                    variant: Optional[str] = None, shared=False,
                    pinned_pool=None, background: bool = False,
                    expert_rows: bool = True, expert_cache=None,
                    compression=None, lossless_cache=None, **kwargs):
    """A transformers or diffusers model from a local directory, running
    under laden within the budgets, in one call.

    ``model_cls``: any transformers model class with a config
    (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ``T5Model``, ...) or
    diffusers model class (``UNet2DModel``, ``FluxTransformer2DModel``,
    ...).  The model is built from the directory's ``config.json`` with
    its parameters on ``meta``, its repeated blocks found by structure
    (``find_blocks``), planned under ``vram_budget`` / ``ram_budget`` (see
    ``laden.stream_load``), loaded from its safetensors (one file, or
    shards with their index; ``variant="fp16"`` picks
    ``*.fp16.safetensors``) in the checkpoint's dtype or ``dtype``, and
    returned installed.  ``path`` may also be a GGUF file (llama.cpp's
    format: the config from its metadata as transformers reads it, its
    Llama-family names mapped, its quantized blocks kept compact and
    expanded where they run; float32 unless ``dtype``).  Returned
    installed: call it, or ``generate()``, as the plain model.
    ``laden.release(model)`` frees everything.  Other keyword arguments
    override the config; ``shared=True`` shares the host copy with the
    host's other processes that load the same directory the same way (see
    ``laden.stream_load``).  ``model.to(...)`` to another device or dtype
    raises (release first); ``eval()``, ``train()``, ``device``,
    ``dtype`` behave as usual.  ``pinned_pool``: see
    ``laden.set_pinned_pool`` (a model released and loaded again pins
    nothing anew).  ``background=True`` returns as soon as the model's
    memory is given, its bytes still arriving (see ``laden.stream_load``):
    a first forward or ``generate()`` starts at once, each block waiting
    for its own bytes, so a cold start's first output comes about one
    block after the last byte instead of after the load and a whole
    forward; ``laden.wait(model)`` waits for the load and raises its
    error.  A mixture-of-experts model moves only the experts its router
    picks (``expert_rows``, see ``laden.stream_load``), and keeps those
    that crossed in device memory the plan leaves free
    (``expert_cache``).  ``compression="lossless"`` and
    ``lossless_cache`` (a directory ``laden.compress`` wrote): see
    ``laden.stream_load``."""
    path = os.fspath(path)
    if subfolder:
        path = os.path.join(path, subfolder)
    lib = _library(model_cls)
    if "torch_dtype" in kwargs:  # the libraries' older name
        td = kwargs.pop("torch_dtype")
        if dtype is not None and td is not None and dtype != td:
            raise InvalidArgumentError(
                "laden.from_pretrained: dtype and torch_dtype differ; give "
                "one", "E_INVAL")
        dtype = dtype if dtype is not None else td
    gguf = path.endswith(".gguf") and os.path.isfile(path)
    if gguf:
        weights, kwargs = path, dict(kwargs, gguf_file=os.path.basename(path))
        path = os.path.dirname(path) or "."
        if lib != "transformers":
            raise InvalidArgumentError(
                f"laden.from_pretrained: {weights}: GGUF files load into "
                "transformers models", "E_INVAL")
        _gguf_check_config(weights)  # before transformers builds a config of it
        dtype = dtype if dtype is not None else "float32"  # as transformers
    else:
        _check_dir(path)
        weights = _weights(path, variant)
    with Checkpoint(weights) as ck:  # its table, read once here
        table = ck.tensors()
    dtype = _dtype_of(dtype)
    model, dtype = _build(model_cls, lib, path, dtype, dict(kwargs), table)
    # A safetensors checkpoint's names are mapped as transformers loads
    # them where the model is described (stream_load), once.
    key_map = _gguf_key_map(model, weights) if gguf else None
    model.eval()
    blocks = find_blocks(model)
    resident = _called_from_outside(model)
    dev = streaming._device(device)
    try:
        streaming.stream_load(
            model, weights, plan=plan,
            offload_prefixes=None if plan is not None else blocks,
            resident_prefixes=None if plan is not None else resident,
            device=dev, vram_budget=vram_budget, ram_budget=ram_budget,
            key_map=key_map, lookahead=lookahead,
            progress=progress, shared=shared, pinned_pool=pinned_pool,
            background=background, expert_rows=expert_rows,
            expert_cache=expert_cache, compression=compression,
            lossless_cache=lossless_cache)
        streaming.install_offload(model, lookahead=lookahead)
    except BaseException as e:
        if getattr(model, "_laden_stream", None) is not None:
            streaming.release(model)
        if isinstance(e, MismatchError) or not isinstance(e, LadenError):
            raise
        raise type(e)(f"laden.from_pretrained({os.path.basename(path)}): "
                      f"{e}", e.status, e.code) from None
    _guard_moves(model, dev)
    return model


# Architectures whose llama.cpp names laden.gguf.llama_key_map maps.
_GGUF_ARCHS = ("llama", "mistral", "qwen2")


def _gguf_key_map(model, path: str):
    mt = getattr(model.config, "model_type", "?")
    if mt not in _GGUF_ARCHS:
        raise InvalidArgumentError(
            f"laden.from_pretrained: {path}: GGUF tensor names of "
            f"architecture '{mt}' are not mapped yet (mapped: "
            f"{', '.join(_GGUF_ARCHS)}); load it with laden.stream_load "
            "and a key_map", "E_INVAL")
    return llama_key_map


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
        for mod, name, prev, ours in reversed(self._wrapped):
            if mod.__dict__.get(name) is not ours:
                continue  # changed since: not ours to restore
            if prev is None:
                mod.__dict__.pop(name, None)
            else:
                setattr(mod, name, prev)
        self._wrapped.clear()
        for off in self._offloaders.values():
            unguard_moves(off.model)
            if off.model.__dict__.get("_laden_pipeline_handle") is self:
                del off.model._laden_pipeline_handle
            off.close()
        if self._cls is not None:
            self.pipe.__class__ = self._cls
        self.pipe.__dict__.pop("_laden_pipeline", None)
        self.pipe = None


def offload_pipeline(pipe, *, device=None, vram_budget=None,
                     ram_budget=None, lookahead: int = 2,
                     compression: Optional[str] = None) -> PipelineHandle:
    """Runs a diffusers pipeline's components (text encoders, denoiser,
    VAE) under one ``ModelCache`` and one budget.  Each component is
    activated when the pipeline calls it (its ``forward``, or a VAE's
    ``encode``/``decode``) and kept on the device after, while the budget
    has room; one that does not fit streams its blocks (found by
    ``find_blocks``).  The components must be on the CPU, as
    ``from_pretrained`` builds them; ``pipe(...)`` is called exactly as
    before and runs on ``device``.  ``ram_budget`` bounds the pinned host
    copies.  ``compression="lossless"``: every component's BF16/F16
    weights are kept entropy-coded in host memory, cross the link coded
    and are decoded on the device (see ``ModelSpec``).  Returns a handle;
    ``handle.remove()`` gives the components back as ordinary CPU
    modules."""
    import functools

    import torch


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
    for k, m in list(mods.items()):
        # A component laden streams already (laden.from_pretrained) is
        # adopted as it is: it keeps its own plan and budget, and the
        # cache leaves it alone (a second owner would run it wrong).
        st = getattr(m, "_laden_stream", None)
        if st is None or doors.owner_of(m) is None:
            continue
        want = _device(device)
        if st.device != want:
            raise InvalidArgumentError(
                f"offload_pipeline: component '{k}' is streamed by laden to "
                f"{st.device}, the pipeline runs on {want}; load it for "
                f"{want}, or release() it and let the pipeline's cache take "
                "it", "E_INVAL")
        del mods[k]
    for k, m in mods.items():
        other = m.__dict__.get("_laden_pipeline_handle")
        if other is not None and other.pipe is not None:
            raise StateError(
                f"offload_pipeline: component '{k}' is offloaded already, "
                "by another pipeline that shares it (pipelines made from "
                "one another's components): offload one of them, or "
                "remove() the other's handle first", "E_STATE")
        on = {t.device.type for t in m.parameters()}
        if on - {"cpu"}:
            raise InvalidArgumentError(
                f"offload_pipeline: component '{k}' is on "
                f"{', '.join(sorted(on - {'cpu'}))}; laden takes components "
                "on the CPU (load the pipeline without .to(...))", "E_INVAL")
    planning.check_compression(compression, "offload_pipeline")
    dev = _device(device)
    cache = ModelCache(vram_budget=vram_budget, pinned_budget=ram_budget)
    h = PipelineHandle(pipe, cache, mods, dev)
    try:
        for k, m in mods.items():
            off = ModelOffloader(m, block_paths=[
                p.rstrip(".") for p in find_blocks(m)], key=k, cache=cache,
                compression=compression)
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

                h._wrapped.append((m, name, m.__dict__.get(name), call))
                setattr(m, name, call)
            m._laden_pipeline_handle = h
            _guard_moves(m, dev, f"component '{k}'")
        # The pipeline puts its inputs where it runs: on `dev`, wherever
        # its idle components' weights are.
        base = type(pipe)
        h._cls = base

        def to(self, *args, **kwargs):
            d, dt = _move_target(args, kwargs)
            if (d is not None and not _same_device(d, dev)) or (
                    dt is not None and any(
                        p.dtype != dt for m in mods.values()
                        for p in m.parameters()
                        if p.dtype.is_floating_point)):
                raise StateError(
                    f"{base.__name__}.to({d or dt}): its components are "
                    f"offloaded by laden and run on {dev}; remove() the "
                    "handle of laden.offload_pipeline first", "E_STATE")
            return self

        pipe.__class__ = type(base.__name__, (base,), {
            "_execution_device": property(lambda self: dev),
            "device": property(lambda self: dev),
            "to": to,
            "__module__": base.__module__})
        pipe._laden_pipeline = h
    except BaseException:
        h.remove()
        raise
    return h
