"""CUDA graphs over streamed blocks (issue 18): ``OffloadHandle.capture``.

A streamed forward whose slots, pinned host copies and event pattern are
fixed is captured once and replayed: the graph holds the copies into the
slots (on laden's copy stream, forked from the capturing stream and joined
back), the event waits and the kernels, so a replay does no host work per
block.  The C side (``laden_sched_capture_begin``/``_end``,
``laden_sched_replay_begin``/``_end``) captures the pass over the slots as
the warm-up left them -- the first blocks already there, as each pass
leaves them for the next -- and before each replay copies in what they
lack of that; with adapters merged into the slots the pass is captured
standalone instead (it fills every slot it reads: the merges are in the
graph).  It orders each replay against the slots' eager use before and
after it.  torch's ``CUDAGraph`` records the kernels and keeps the memory
of the pass's activations in its pool."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Tuple

from ._lib import CAPTURE_STANDALONE as STANDALONE
from ._lib import check, error_for, lib
from ._sched import _pass
from .errors import DeviceError, InvalidArgumentError, StateError

log = logging.getLogger("laden")


def _signature(x) -> Tuple:
    import torch

    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device, x.stride())
    return ("value", x)


class CapturedForward:
    """A streamed forward captured into a CUDA graph
    (``OffloadHandle.capture``).  Calling it with inputs of the captured
    shapes, dtypes and devices (and equal non-tensor arguments) copies
    the tensors into the captured inputs and replays the graph; it
    returns the captured outputs, which the next call overwrites (clone
    what you keep).  Other inputs run ``fn`` eagerly, said once in a
    warning.  After the handle is removed or the model released, or once
    the adapters changed, calling it raises StateError."""

    def __init__(self, handle, fn, static, out, graph, cap: int,
                 adapters: int):
        self._handle = handle
        self._fn = fn
        self._static = static
        self._sig = tuple(_signature(x) for x in static)
        self.outputs = out
        self._graph = graph
        self._cap = cap  # laden_sched_capture_t
        self._free = lib.laden_sched_capture_free
        self.bytes_per_replay = lib.laden_sched_capture_bytes(cap)
        self._adapters = adapters
        self._warned = False
        self.replays = 0

    def __del__(self):
        cap, self._cap = getattr(self, "_cap", None), None
        if cap:
            self._free(cap)

    def _check(self):
        h = self._handle
        o = h.state.live("captured forward")
        if not h.active or h.state.handle is not h:
            raise StateError(
                "captured forward: the OffloadHandle it was captured from "
                "was removed; install_offload and capture again", "E_STATE")
        if h.adapters.version != self._adapters:
            raise StateError(
                "captured forward: the adapters changed since it was "
                "captured (set_adapters); capture again", "E_STATE")
        return o

    def __call__(self, *inputs):
        import torch

        o = self._check()
        if len(inputs) != len(self._static) or \
                tuple(_signature(x) for x in inputs) != self._sig:
            if not self._warned:
                self._warned = True
                log.warning(
                    "laden: a captured forward was called with inputs "
                    "unlike the captured ones (%s); running it without the "
                    "graph (said once)", _difference(self._sig, inputs))
            with torch.no_grad():
                return self._fn(*inputs)
        st = self._handle.state
        stream = torch.cuda.current_stream(st.device).cuda_stream
        # Held from the inputs' copies on: another thread's call is
        # refused, not run over these inputs.
        with _pass(st, o, "captured forward"):
            for s, x in zip(self._static, inputs):
                if isinstance(s, torch.Tensor) and x is not s:
                    s.copy_(x)
            _call(lib.laden_sched_replay_begin(o.h, stream, self._cap),
                  "captured forward")
            try:
                self._graph.replay()
            except BaseException:
                # Ordered as after a replay, but the slots hold what
                # they hold: filled again by the next pass.
                lib.laden_sched_replay_end(o.h, stream, self._cap)
                lib.laden_sched_refill(o.h)
                raise
            _call(lib.laden_sched_replay_end(o.h, stream, self._cap),
                  "captured forward")
        self.replays += 1
        return self.outputs


def _difference(sig, inputs) -> str:
    got = tuple(_signature(x) for x in inputs)
    if len(got) != len(sig):
        return f"{len(inputs)} arguments, captured with {len(sig)}"
    for i, (a, b) in enumerate(zip(sig, got)):
        if a != b:
            return f"argument {i}: {_describe(b)}, captured {_describe(a)}"
    return "?"


def _describe(s) -> str:
    if s[0] == "tensor":
        return f"shape {list(s[1])} {s[2]} on {s[3]}"
    return repr(s[1])


def _call(status: int, what: str) -> None:
    if status:
        err = error_for(status)
        raise type(err)(f"{what}: {err}", err.status, err.code)


def capture(handle, fn: Callable, example_inputs: Tuple[Any, ...],
            warmup: int = 2) -> CapturedForward:
    """OffloadHandle.capture: see there."""
    import torch

    st = handle.state
    what = "OffloadHandle.capture"
    o = st.live(what)
    if not handle.active:
        raise StateError(f"{what}: the handle was removed", "E_STATE")
    if not callable(fn):
        raise InvalidArgumentError(
            f"{what}: fn must be callable, not {type(fn).__name__}",
            "E_INVAL")
    if st.device.type != "cuda":
        raise DeviceError(
            f"{what}: CUDA graphs need a CUDA device; {st.name} runs on "
            f"{st.device}", "E_UNSUPPORTED")
    if handle.trainer is not None:
        raise StateError(
            f"{what}: a captured forward runs without gradients; this "
            "handle was made with train=True (install_offload without it "
            "to capture inference)", "E_STATE")
    if not isinstance(warmup, int) or warmup < 1:
        raise InvalidArgumentError(
            f"{what}: warmup must be a positive int, not {warmup!r}",
            "E_INVAL")
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.device != st.device:
            raise InvalidArgumentError(
                f"{what}: input {i} is on {x.device}, the model on "
                f"{st.device}; a graph reads its inputs where they were "
                "captured", "E_INVAL")
    static = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x
                   for x in example_inputs)
    dev = st.device
    # Warm up on a side stream, as torch asks before a capture (libraries'
    # workspaces, kernels loaded and compiled).
    cur = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn(*static)
    cur.wait_stream(side)
    check(lib.laden_sched_synchronize(o.h))
    graph = torch.cuda.CUDAGraph()
    cap = ctypes.c_void_p()
    flags = STANDALONE if handle.adapters.merges else 0  # into slots
    try:
        with _pass(st, o, what):
            # On a stream of the model's device: torch's default capture
            # stream is made once, on whatever device was current first.
            with torch.no_grad(), torch.cuda.graph(
                    graph, stream=side, capture_error_mode="thread_local"):
                stream = torch.cuda.current_stream(dev).cuda_stream
                _call(lib.laden_sched_capture_begin(o.h, stream, flags),
                      what)
                try:
                    out = fn(*static)
                finally:
                    s = lib.laden_sched_capture_end(o.h, stream,
                                                    ctypes.byref(cap))
                _call(s, what)
    except BaseException:
        if cap.value:  # fn, or torch's end of the capture, failed
            lib.laden_sched_capture_free(cap)
        raise
    return CapturedForward(handle, fn, static, out, graph, cap.value,
                           handle.adapters.version)
