"""Holding a model's schedule for this thread: the pass that streaming,
adapters and graphs open around work that rebinds a model.

It sits below all three (they import it at the top) so that none of them
has to import ``streaming`` from inside a function to reach it.
"""

from __future__ import annotations

import ctypes

from ._lib import error_for, lib
from ._bind import _Owned, bind_out
from .compile import close_open


def _end_interrupted(state, o: _Owned) -> None:
    """Ends every pass and block this thread holds on the schedule (C:
    laden_sched_end_all): at the end of a forward, its own pass; after an
    interrupt, also what it left.  Blocks an interrupt left entered had
    their slots bound into their modules: their own values go back."""
    n = ctypes.c_uint32(0)
    lib.laden_sched_end_all(o.h, ctypes.byref(n))
    if n.value:
        bind_out(state.tensors)


class _pass:
    """Holds the schedule for this thread (laden_sched_begin/end) around
    work that rebinds a model, so that no other thread runs it meanwhile;
    StateError at once if another thread holds it."""

    def __init__(self, state, owner: _Owned, what: str):
        self.state, self.owner, self.what = state, owner, what

    def __enter__(self):
        close_open()  # what a compiled run that raised left entered
        tl = self.state.passes
        self.depth = getattr(tl, "n", 0)
        if not self.depth:
            _end_interrupted(self.state, self.owner)
        s = lib.laden_sched_begin(self.owner.h)
        if s:
            err = error_for(s)
            raise type(err)(f"{self.what}: {self.state.name}: {err}",
                            err.status, err.code)
        # A forward inside it (a capture's) is not this thread's
        # outermost: it leaves this hold alone.
        tl.n = self.depth + 1
        return self

    def __exit__(self, *exc):
        self.state.passes.n = self.depth
        if self.depth:
            lib.laden_sched_end(self.owner.h)
        else:
            _end_interrupted(self.state, self.owner)
