"""Compiling the blocks laden runs (issue 18, first step):
``install_offload(..., compile=laden.BlockCompile())`` compiles each
distinct block forward once with ``torch.compile`` -- blocks of one class
share the compiled code (Dynamo guards on their parameters' shapes, not on
which module it is, so blocks of one shape share one graph) -- and laden's
enter and exit stay outside it, in eager Python around the compiled call.
Streamed weights are graph inputs like any parameter: their slot addresses
change nothing in the guards.

What this does not do yet: ``torch.compile(model)`` of the whole model
still breaks the graph at every block laden wraps (its enter and exit are
C calls Dynamo cannot trace)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .errors import InvalidArgumentError

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
            why = " (it captures CUDA graphs, which laden does not support " \
                "over streamed blocks yet)" if self.mode in (
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
                "graphs, which laden does not support over streamed blocks "
                "yet", "E_INVAL")
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
