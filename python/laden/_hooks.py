"""The per-block hook: a block's forward wrapped with one C call before
(enter) and one after (exit), and its guards (parts of a block called
outside it, tensors saved for backward from streamed memory)."""

from __future__ import annotations

import ctypes
from typing import Dict

from . import compile as _compile
from .trace import ON as tracing_on, sample_torch_memory
from ._bind import _Owned, _training_error, bind_in, bind_out
from ._devices import _compute_stream
from ._lib import check as check_ok, error_for, lib
from ._moe import routed
from .errors import StateError


class _Gone:
    """A tensor saved for backward that lived in streamed memory."""

    __slots__ = ("block",)

    def __init__(self, block: str):
        self.block = block


def _saved_hooks(gone: Dict[int, str]):
    """saved_tensors_hooks that let a streamed block's forward save what
    backward needs, except tensors in streamed memory: those become a
    marker whose unpacking raises."""
    def pack(x):
        try:
            block = gone.get(x.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError, AttributeError):
            return x
        return x if block is None else _Gone(block)

    def unpack(x):
        if isinstance(x, _Gone):
            raise _training_error(f"streamed block '{x.block}'")
        return x

    return pack, unpack


def relaid_check(owner: _Owned, rebind):
    """What a block's enter runs after C's: `rebind()` once C has laid the
    streamed blocks out again (laden_sched_learn_order: they now run from
    other slots), found by the schedule's generation, read from its
    address (no call)."""
    word = lib.laden_sched_generation_word(owner.h).contents
    seen = [word.value]

    def check() -> None:
        g = word.value
        if g != seen[0]:
            rebind()
            seen[0] = g

    return check


def _wrap_forward(mod, owner: _Owned, c_block: int, device, wrapped: list,
                  guard=None, gone=None, after_enter=None,
                  slot_tensors=(), trainer=None, compiler=None, binds=(),
                  relaid=None, experts=0):
    """Wraps mod.forward with one C call before (enter) and one after
    (exit: C's enter also expands the block's compact tensors); records
    (module, previous forward, had own) in `wrapped` so it can be undone.
    The optional parts, each off when left at its default
    (callers: offload._bind_slots, cache's blocks):

    - `binds` (a list the caller may refill): the block's tensors whose
      ``run`` is bound into the modules between enter and exit only
      (bind_in, bind_out);
    - `after_enter(c_block)`: runs once the block's bytes are in place
      (an adapter merged into its slot);
    - `guard()` (the cache): runs first (it may raise);
    - `gone` (storage address -> block, for memory that later blocks
      overwrite): what the forward saves for backward from that memory
      raises when backward unpacks it, instead of giving a wrong gradient;
    - `slot_tensors` (the block's tensors in its slot): the parts of mod
      that hold them refuse to run outside its forward;
    - `trainer` (install_offload(train=True)): a call with gradients
      enabled is a checkpointed node (laden.training) that enters the
      block again in backward;
    - `compiler` (laden.compile.BlockCompiler): the block's own forward
      runs compiled between enter and exit;
    - `relaid` (relaid_check): runs right after C's enter and exit, to
      take the slots again where C moved the blocks (taught their call
      order, at the exit that ends a pass: before anything binds them).
    - `experts` (a mixture-of-experts layer's experts module with that
      many experts): each call enters with the experts it is routed to
      (laden_sched_enter_experts), whose rows alone C puts in the slot.

    Without `guard` and `trainer`, under torch.compile without gradients,
    enter and exit are ops in the traced graph (laden.compile)."""
    import torch

    enter, leave = lib.laden_sched_enter, lib.laden_sched_exit
    had = "forward" in mod.__dict__
    orig = raw = mod.forward
    if compiler is not None:
        orig = compiler.forward_of(mod, orig, had)
    compiling = _compile.compiling
    traced_ops = _compile.ops() if guard is None and trainer is None \
        else None
    grad_on = torch.is_grad_enabled
    hooks = _saved_hooks(gone) if gone is not None else None
    saved = torch.autograd.graph.saved_tensors_hooks

    inside = [0]

    def do_enter(rows=None) -> int:
        _compile.close_open()  # what a compiled run that raised left
        stream = _compute_stream(device)  # once: enter and exit share it
        if tracing_on[0]:
            sample_torch_memory(device)
        if rows is None:
            s = enter(owner.h, c_block, stream)
        else:
            # rows: an int32 host tensor (routed), alive for the call
            arr = ctypes.cast(rows.data_ptr(),
                              ctypes.POINTER(ctypes.c_uint32))
            s = lib.laden_sched_enter_experts(owner.h, c_block, arr,
                                              rows.numel(), stream)
        if s:
            raise error_for(s)
        # Set, not counted: laden's blocks never nest, and a count an
        # interrupt left off (Ctrl-C between C's enter and here) is
        # mended by the block's next enter.
        inside[0] = 1
        try:
            if relaid is not None:
                relaid()
            bind_in(binds, grad_on())
            if after_enter is not None:
                after_enter(c_block)
        except BaseException:
            inside[0] = 0
            bind_out(binds)
            leave(owner.h, c_block, stream)
            raise
        return stream

    def do_leave(stream: int) -> None:
        inside[0] = 0
        bind_out(binds)
        s = leave(owner.h, c_block, stream)
        if tracing_on[0]:
            sample_torch_memory(device)
        if s:
            raise error_for(s)
        if relaid is not None:  # C relays out at the exit that ends a pass
            relaid()

    def plain(args, kwargs):
        stream = do_enter(routed(args, kwargs, experts,
                                 f"streamed block {c_block} "
                                 f"({type(mod).__name__})")
                          if experts else None)
        try:
            if hooks is not None and grad_on():
                with saved(*hooks):
                    out = orig(*args, **kwargs)
            else:
                out = orig(*args, **kwargs)
        except BaseException:
            inside[0] = 0
            bind_out(binds)
            leave(owner.h, c_block, stream)
            raise
        do_leave(stream)
        return out

    def do_enter_compiled() -> int:
        # The enter op of a compiled graph, which keeps the slots it was
        # traced with: C stops moving blocks (laden_sched_learn_order).
        if not learning_stopped[0]:
            check_ok(lib.laden_sched_learn_order(owner.h, 0))
            learning_stopped[0] = True
        return do_enter()

    key = _compile.register(do_enter_compiled, do_leave) if traced_ops \
        else 0

    tracing = [0]  # inside traced(), as Dynamo traces it
    learning_stopped = [False]

    def traced(xs, args, kwargs):
        # Under torch.compile, without gradients: enter and exit are ops
        # in the graph (laden.compile); the block's own forward is traced
        # between them.  Both take the block's weights, declared mutated:
        # every read of them is ordered after enter and before exit, also
        # work on weights alone that feeds no output.  Exit takes the
        # inputs too: a block that returns nothing still has its exit
        # ordered after its in-place writes (and not dropped as dead
        # code).
        # The module holds what the block runs from while it is traced,
        # as it does between an eager enter and exit.
        bind_in(binds, False)
        ws = _compile.weights_of(mod)
        traced_ops[0](xs + ws, key)
        tracing[0] += 1
        try:
            out = raw(*args, **kwargs)
        finally:
            tracing[0] -= 1
        traced_ops[1](_compile.tensors_of((args, kwargs, out)) + ws, key)
        bind_out(binds)
        return out

    def forward(*args, **kwargs):
        if traced_ops and compiling() and not grad_on():
            xs = _compile.tensors_of((args, kwargs))
            if xs:
                return traced(xs, args, kwargs)
        if guard is not None:
            guard()
        if trainer is not None:
            if grad_on():
                return trainer.call(mod, c_block, do_enter, do_leave, orig,
                                    plain, args, kwargs)
            # An optimizer may have changed the host copies: a forward
            # without gradients must not run the slots' old bytes.
            trainer.refresh(c_block)
        return plain(args, kwargs)

    def outside(part, args):
        # Inside: between the block's enter and exit (eager, or around a
        # BlockCompile call), or traced between its enter and exit ops.
        if not inside[0] and not tracing[0]:
            _compile.refuse(StateError(
                f"a {type(part).__name__} inside streamed block {c_block} "
                f"({type(mod).__name__}) was called outside the block's "
                "forward: its weights live in a slot that other blocks "
                "reuse, so they may be another block's by now; keep that "
                "block resident (resident_prefixes) or call it through "
                "the block", "E_STATE"))

    if key:
        wrapped.append(("key", key, None))
    wrapped.append((mod, mod.__dict__.get("forward"), had))
    mod.forward = forward
    forward._laden_compiled_enter = do_enter_compiled  # the ops' weakref
    # Parts of the block with weights of their own run only inside it
    # (found in review: DiT calls transformer_blocks[0].norm1.emb after
    # the loop, reading block 0's slot after later blocks refilled it).
    owners = {id(m) for t in slot_tensors for m, _ in t.aliases}
    for part in mod.modules():
        if part is not mod and id(part) in owners:
            wrapped.append(("hook", part.register_forward_pre_hook(outside),
                            None))


def _unwrap_all(wrapped: list) -> None:
    """Undoes _wrap_forward: forwards restored, guards removed."""

    for mod, prev, had in reversed(wrapped):
        if isinstance(mod, str) and mod == "hook":
            prev.remove()
        elif isinstance(mod, str) and mod == "key":
            _compile.forget(prev)
        elif had:
            mod.forward = prev
        else:
            mod.__dict__.pop("forward", None)
    wrapped.clear()
