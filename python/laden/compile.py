"""Compiling the blocks laden runs (issue 18).

``install_offload(..., compile=laden.BlockCompile())`` compiles each
distinct block forward once with ``torch.compile`` -- blocks of one class
share the compiled code (Dynamo guards on their parameters' shapes, not on
which module it is, so blocks of one shape share one graph) -- and laden's
enter and exit stay outside it, in eager Python around the compiled call.
Streamed weights are graph inputs like any parameter: their slot addresses
change nothing in the guards.

``torch.compile(model)`` of the whole model: without gradients, a wrapped
block's enter and exit are the custom ops ``laden::enter`` and
``laden::exit`` (below), so Dynamo traces through laden's wrappers without
a graph break.  Each op declares the tensors it is given as mutated -- the
block's tensor inputs for enter, its tensor outputs for exit -- which
orders the block's work on its inputs after enter and exit after the
work that made its outputs.  With gradients the wrappers stay eager (a
graph break each), as training needs them."""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from .errors import InvalidArgumentError, StateError

# Modes without CUDA graphs: one captured graph replayed over streamed
# weights whose slots change is not supported yet ("reduce-overhead" and
# "max-autotune" capture).
MODES = (None, "default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class BlockCompile:
    """How ``install_offload(..., compile=...)`` compiles each block's
    forward: the arguments of ``torch.compile`` (``dynamic=True`` by
    default: one graph for every sequence length; ``mode`` and
    ``options`` exclude each other, as in torch)."""

    dynamic: Optional[bool] = True
    fullgraph: bool = False
    mode: Optional[str] = None
    options: Optional[Dict[str, Any]] = None
    backend: Any = field(default="inductor")

    def __post_init__(self):
        if self.dynamic not in (None, True, False):
            raise InvalidArgumentError(
                f"BlockCompile: dynamic must be None, True or False, not "
                f"{self.dynamic!r}", "E_INVAL")
        if not isinstance(self.fullgraph, bool):
            raise InvalidArgumentError(
                f"BlockCompile: fullgraph must be True or False, not "
                f"{self.fullgraph!r}", "E_INVAL")
        if self.mode not in MODES:
            why = " (it captures CUDA graphs of each block apart, without " \
                "the copies into its slot: capture the whole streamed " \
                "forward with OffloadHandle.capture)" if self.mode in (
                    "reduce-overhead", "max-autotune") else ""
            raise InvalidArgumentError(
                f"BlockCompile: mode {self.mode!r}{why}; use one of "
                f"{', '.join(repr(m) for m in MODES)}", "E_INVAL")
        if self.mode is not None and self.options is not None:
            raise InvalidArgumentError(
                "BlockCompile: give mode or options, not both (torch.compile "
                "takes one of them)", "E_INVAL")
        if self.options is not None and not isinstance(self.options, dict):
            raise InvalidArgumentError(
                f"BlockCompile: options must be a dict, not "
                f"{type(self.options).__name__}", "E_INVAL")
        if self.options and self.options.get("triton.cudagraphs"):
            raise InvalidArgumentError(
                "BlockCompile: options['triton.cudagraphs'] captures CUDA "
                "graphs of each block apart, without the copies into its "
                "slot: capture the whole streamed forward with "
                "OffloadHandle.capture", "E_INVAL")
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise InvalidArgumentError(
                f"BlockCompile: backend must be a name or a callable, not "
                f"{self.backend!r}", "E_INVAL")


def check(compile) -> Optional[BlockCompile]:
    """install_offload's ``compile=``: None/False, True (the defaults) or
    a BlockCompile."""
    if compile is None or compile is False:
        return None
    if compile is True:
        compile = BlockCompile()
    if not isinstance(compile, BlockCompile):
        raise InvalidArgumentError(
            f"install_offload: compile must be a laden.BlockCompile, True or "
            f"None, not {type(compile).__name__}", "E_INVAL")
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 5):
        # Before 2.5 Dynamo guarded on each module's identity: every block
        # compiled again, and past its cache limit ran uncompiled.
        raise InvalidArgumentError(
            f"install_offload(compile=...) needs torch 2.5 or later (this "
            f"is {torch.__version__}): before it every block compiled "
            "apart", "E_INVAL")
    return compile


class BlockCompiler:
    """One handle's compiled block forwards, by function: a class's
    forward is compiled once and called with each block of the class."""

    def __init__(self, cfg: BlockCompile):
        self.cfg = cfg
        self.compiled: Dict[object, object] = {}

    def _compile(self, fn):
        import torch

        c = self.compiled.get(fn)
        if c is None:
            cfg = self.cfg
            kw = dict(dynamic=cfg.dynamic, fullgraph=cfg.fullgraph,
                      backend=cfg.backend)
            if cfg.mode is not None:
                kw["mode"] = cfg.mode
            if cfg.options is not None:
                kw["options"] = cfg.options
            c = self.compiled[fn] = torch.compile(fn, **kw)
        return c

    def forward_of(self, mod, orig, had: bool):
        """The compiled stand-in for mod's forward `orig`: the class's
        forward compiled once (bound to mod here), or, when the module has
        a forward of its own (set on the instance), that one alone."""
        if had:
            return self._compile(orig)
        return functools.partial(self._compile(type(mod).forward), mod)

    def install(self, mod, wrapped: list) -> None:
        """A block laden does not wrap (resident): its forward becomes the
        compiled one; recorded in `wrapped` to be undone as laden's
        wrappers are."""
        had = "forward" in mod.__dict__
        f = self.forward_of(mod, mod.forward, had)
        wrapped.append((mod, mod.__dict__.get("forward"), had))
        mod.forward = f


# ---- enter and exit as operators torch.compile traces --------------------

# key -> the wrapped block's [enter, exit, stream]: the ops find the block
# by a number (Dynamo keeps it in the graph as a constant).  Weak: the
# block's wrapper holds its enter and exit, and a model dropped without
# remove() must free its schedule (descriptors, threads, memory).
_BLOCKS: Dict[int, list] = {}
_keys = itertools.count(1)
_ops = None


def register(enter: Callable[[], int], leave: Callable[[int], None]) -> int:
    """A wrapped block's enter (returns the stream) and exit, under a new
    key for the ops; forget(key) when the block is unwrapped."""
    import weakref

    for k in [k for k, b in _BLOCKS.items() if b[0]() is None]:
        del _BLOCKS[k]
    key = next(_keys)
    _BLOCKS[key] = [weakref.ref(enter), weakref.ref(leave), None]
    return key


def forget(key: int) -> None:
    _BLOCKS.pop(key, None)


# The blocks this thread entered through the ops and has not exited: a
# compiled graph that raised between a block's enter and exit (an
# out-of-memory error, KeyboardInterrupt) leaves one here, and its hold
# on the schedule with it.  laden's blocks never nest, so one still open
# at the next enter is such a leftover: it is exited first.
_open = threading.local()


class _Open(list):
    """A thread's open blocks.  When the thread ends, torch's and Python's
    thread state go on that thread, and so does this: what a failed
    compiled run left entered is exited there (the schedule's hold is the
    thread's own), not left to lock the model for every other thread."""

    def __del__(self):
        try:
            _close(self)
        except Exception:
            pass


def _stack() -> list:
    st = getattr(_open, "keys", None)
    if st is None:
        st = _open.keys = _Open()
    return st


def close_open() -> None:
    """Exits what a failed compiled run left entered on this thread (at
    once when nothing is)."""
    st = getattr(_open, "keys", None)
    if st:
        _close(st)


def refuse(exc: BaseException) -> None:
    """Raises `exc`, also from code Dynamo traces: some torch versions
    (2.11) cannot trace raising laden's own errors and stop the compile
    with Unsupported instead, so the raise runs eagerly (a graph break
    on the error path only)."""
    _refuse()(exc)


@functools.lru_cache(maxsize=None)
def _refuse():
    import torch

    def do_raise(exc):
        raise exc

    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(do_raise) if disable else do_raise


_IS_COMPILING = None  # torch.compiler.is_compiling, looked up once


def compiling() -> bool:
    """True while torch.compile traces (torch.compiler.is_compiling).
    Called on every wrapped block's call: the lookup is done once."""
    global _IS_COMPILING
    f = _IS_COMPILING
    if f is None:
        import torch

        f = getattr(getattr(torch, "compiler", None), "is_compiling",
                    None) or False
        _IS_COMPILING = f
    return bool(f and f())


def _close(st) -> None:
    while st:
        b = _BLOCKS.get(st.pop())
        if b is None:
            continue
        stream, b[2] = b[2], None
        leave = b[1]()
        if leave is not None and stream is not None:
            try:
                leave(stream)
            except Exception:  # the block's schedule may be gone
                pass


def _block(key: int, what: str) -> list:
    b = _BLOCKS.get(key)
    if b is None or b[0]() is None or b[1]() is None:
        raise StateError(
            f"laden::{what}: a compiled graph ran a streamed block whose "
            "offload was removed or released; compile the model again "
            "(torch._dynamo.reset()) after install_offload", "E_STATE")
    return b


def ops():
    """torch.ops.laden.enter / exit, defined once (torch 2.4's
    torch.library.custom_op); None where torch lacks it."""
    global _ops
    if _ops is not None:
        return _ops or None
    import torch

    if not hasattr(torch, "library") or \
            not hasattr(torch.library, "custom_op"):
        _ops = False
        return None
    import inspect

    kw = {}
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is not None and \
            "tags" in inspect.signature(torch.library.custom_op).parameters:
        # Inductor's CUDA graphs (mode="reduce-overhead") must not capture
        # them: their copies are captured only through handle.capture.
        kw["tags"] = (tag,)

    # The schema is given: this module's annotations are strings.
    kw["schema"] = "(Tensor(a!)[] xs, int key) -> ()"

    @torch.library.custom_op("laden::enter", mutates_args=("xs",), **kw)
    def enter(xs, key):
        close_open()
        b = _block(key, "enter")
        b[2] = b[0]()()
        _stack().append(key)

    @enter.register_fake
    def _(xs, key):
        return None

    @torch.library.custom_op("laden::exit", mutates_args=("xs",), **kw)
    def leave(xs, key):
        b = _block(key, "exit")
        st = _stack()
        if st and st[-1] == key:
            st.pop()
        stream, b[2] = b[2], None
        b[1]()(stream)

    @leave.register_fake
    def _(xs, key):
        return None

    _ops = (enter, leave)
    return _ops


def weights_of(mod) -> list:
    """The block's own parameters and buffers that are plain tensors (a
    quantized wrapper is left out: the ops take plain tensors), for the
    ops to mark."""
    import torch

    plain = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) \
        if hasattr(torch.nn, "Buffer") else (torch.Tensor, torch.nn.Parameter)
    return _distinct([t for t in list(mod.parameters()) +
                      list(mod.buffers()) if type(t) in plain])


def _distinct(tensors) -> list:
    """The tensors once each, by identity, without id(): Dynamo traces
    this (torch 2.11 breaks the graph at id() of a tensor made in it)."""
    out = []
    for t in tensors:
        for u in out:
            if u is t:
                break
        else:
            out.append(t)
    return out


def tensors_of(tree) -> list:
    """The distinct tensors in a (nested) structure of arguments or
    outputs, for the ops to mark."""
    import torch
    from torch.utils import _pytree

    # An expanded tensor (a stride 0) cannot be declared written to.
    out = []
    for t in _pytree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        for st, n in zip(t.stride(), t.shape):
            if st == 0 and n > 1:
                break
        else:
            out.append(t)
    return _distinct(out)
