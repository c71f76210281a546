"""A timeline of what laden did, for chrome://tracing or ui.perfetto.dev.

    with laden.trace("trace.json") as t:
        handle = laden.stream_load(model, "model.safetensors")
        model(x)
    print(t.summary())

The events are recorded by the C library (per-thread lock-free rings; the
times of copies and kernels come from events on their streams, read when
the trace stops, so tracing adds no host synchronization) and written by
it when the ``with`` block ends.  Python adds two counters, sampled as
each block is entered and exited: PyTorch's allocated device memory
(``torch_allocated_bytes``) and its peak since the last reset
(``torch_peak_bytes``).

``laden trace show trace.json [-o timeline.png]`` prints the summary and
draws the picture (matplotlib).
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

from . import _lib
from ._lib import check, lib
from .errors import InvalidArgumentError, LadenError, StateError
from .traceview import load, summarize

log = logging.getLogger("laden")

__all__ = ["trace", "Trace"]

# ON[0] is True while a trace started here is on: the block hooks sample
# PyTorch's allocator then (one list lookup per call when off).
ON = [False]


def sample_torch_memory(device) -> None:
    """Records PyTorch's allocated bytes on `device` (a CUDA torch.device)
    and their peak as the counters ``torch_allocated_bytes`` and
    ``torch_peak_bytes`` (host-side counters, no synchronization)."""
    import torch

    if device.type != "cuda":
        return
    idx = device.index if device.index is not None else \
        torch.cuda.current_device()
    lib.laden_trace_counter(b"torch_allocated_bytes", idx,
                            torch.cuda.memory_allocated(idx))
    lib.laden_trace_counter(b"torch_peak_bytes", idx,
                            torch.cuda.max_memory_allocated(idx))


class _Range:
    def __init__(self, name: str):
        self.name = name.encode("utf-8", "replace")

    def __enter__(self):
        lib.laden_trace_range(self.name, 1)
        return self

    def __exit__(self, *exc):
        lib.laden_trace_range(None, 0)
        return False


class Trace:
    """A trace being recorded (the ``with laden.trace(...)`` object), and
    after it ends, what was written: ``path``, ``events``, ``dropped``
    (events past ``max_events``), ``seconds``."""

    def __init__(self, path: Optional[str], max_events: int = 0):
        self.path = os.fspath(path) if path is not None else None
        # as C takes it; a path that cannot be one raises here, not at stop
        self._cpath = os.fsencode(self.path) if path is not None else None
        self.max_events = int(max_events)
        if self.max_events < 0:
            raise InvalidArgumentError(
                f"max_events {max_events}: give 0 (the default bound) or "
                "a positive number", "E_INVAL")
        self.events = self.dropped = 0
        self.seconds = 0.0
        self.unresolved = 0
        self._on = False

    def __enter__(self) -> "Trace":
        if self.path is not None:
            d = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(d):
                raise InvalidArgumentError(
                    f"trace path {os.fsdecode(self.path)}: no directory "
                    f"{os.fsdecode(d)}", "E_INVAL")
        check(lib.laden_trace_start(self.max_events))
        self._on = True
        ON[0] = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.stop()
        except LadenError as e:
            if exc_type is None:
                raise
            # the with block's own error goes on; this one is logged
            log.warning("laden.trace: %s", e)
        return False

    def stop(self) -> "Trace":
        """Ends the trace and writes it (the ``with`` block does this)."""
        if not self._on:
            raise StateError("this trace is not on", "E_STATE")
        res = _lib.TraceResult()
        try:
            check(lib.laden_trace_stop(self._cpath, ctypes.byref(res)))
        finally:  # C ends the trace whatever happens to the file
            ON[0] = False
            self._on = False
        self.events, self.dropped = res.events, res.dropped
        self.seconds, self.unresolved = res.seconds, res.unresolved
        return self

    def range(self, name: str) -> _Range:
        """A named range on this thread's track:
        ``with t.range("step 3"): model(x)``."""
        return _Range(name)

    def summary(self, link_gb_per_s: Optional[float] = None) -> str:
        """The one-screen summary of the written trace (as ``laden trace
        show`` prints it)."""
        if self.path is None:
            raise StateError("this trace was not written (path=None)",
                             "E_STATE")
        if self._on:
            raise StateError("the trace is still on: end the with block "
                             "first", "E_STATE")
        return summarize(load(self.path), link_gb_per_s).text()

    def __repr__(self) -> str:
        state = "on" if self._on else f"{self.events} events"
        return f"laden.Trace({self.path!r}, {state})"


def trace(path: Optional[str] = "trace.json", *, max_events: int = 0) -> Trace:
    """Records what laden does inside the ``with`` block and writes it to
    `path` as a Chrome / Perfetto trace (``None``: recorded, not written).
    One trace at a time per process (StateError otherwise).  `max_events`
    bounds what is kept (0: 1048576 events, 80 bytes each); past it events
    are dropped and counted in ``Trace.dropped``."""
    return Trace(path, max_events)
