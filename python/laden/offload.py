"""Running a loaded model's streamed blocks from device slots:
``install_offload`` and its ``OffloadHandle`` (remove, training, adapters,
capture).  Loading is ``streaming``'s, which re-exports these names."""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

from . import sharing
from ._lib import LOOKAHEAD_DEFAULT as LOOKAHEAD
from ._lib import check, lib
from ._bind import _meta, _Owned, _set_run, expanded_view
from ._describe import check_lookahead
from ._devices import _device
from ._hooks import _unwrap_all, _wrap_forward, relaid_check
from ._sched import _pass
from ._state import _Stream
from .adapters import _Adapters, set_adapters
from .compile import BlockCompiler
from .compile import check as check_compile
from .errors import InvalidArgumentError, StateError
from .graphs import capture
from .training import (_Fused, _Trainer, grad_code, materialize_adapters,
                       optimizer_step)

log = logging.getLogger("laden")


class OffloadHandle:
    """Returned by install_offload / offload_blocks.  ``remove()`` restores
    plain modules; their weights stay where laden keeps them (resident
    blocks on the device, streamed blocks in RAM; disk-tier blocks have no
    copy in memory and refuse to run until install_offload again)."""

    def __init__(self, state: _Stream, lookahead: int):
        self.state = state
        self.lookahead = lookahead
        self._wrapped: List[Tuple[object, object, bool]] = []
        self.active = False
        self.trainer = None  # laden.training._Trainer with train=True
        self.compiler = None  # laden.compile.BlockCompiler with compile=
        self.adapters = _Adapters(self)

    def named_parameters(self):
        """(name, parameter) for what an optimizer steps after
        ``install_offload(train=True)``: for a streamed parameter its host
        copy (whose ``.grad`` backward fills; the next forward streams
        what the optimizer wrote), for any other its parameter as it is;
        only those with ``requires_grad``."""
        return self._trainer("named_parameters").named_parameters()

    def _trainer(self, what: str):
        """The training state, for OffloadHandle.<what>; StateError unless
        made with train=True and not removed."""
        self.state.live(f"OffloadHandle.{what}")
        if self.trainer is None or not self.active:
            raise StateError(
                f"OffloadHandle.{what}: only for a handle made by "
                "install_offload(..., train=True) and not removed",
                "E_STATE")
        return self.trainer

    def parameters(self):
        """The parameters of ``named_parameters()``, for an optimizer."""
        return (p for _, p in self.named_parameters())

    def step_in_backward(self, optimizer) -> None:
        """From the next backward on, ``optimizer`` (built over
        ``parameters()``) steps the streamed parameters it holds on the
        device, inside backward, as each one's gradient is ready: its
        state comes up from ``optimizer.state`` (kept in page-locked host
        memory), a one-parameter optimizer of its class and group settings
        steps the weights in their slot, and weights and state go home.
        Their gradients never leave the device (no ``.grad`` on the host
        copies), so ``optimizer.step()`` after backward steps only the
        other parameters.  Each backward is then one step: no accumulation
        over micro-batches, no clipping by the global norm, and no
        ``torch.amp.GradScaler`` (the gradients would step scaled and
        unchecked); a weight that gets two gradients in one backward (its
        block ran twice) and optimizer state that is not one float per
        weight (8-bit optimizers) are refused by name: the refused
        weight is put back, but other weights of its block may have
        stepped already, and a step count kept as a tensor may have
        advanced.  ``None`` turns it off."""
        tr = self._trainer("step_in_backward")
        tr.fused = None if optimizer is None else _Fused(tr, optimizer)

    def optimizer_step(self, optimizer, *, max_norm=None):
        """After one or more backwards (their gradients added up in the
        ``.grad`` of ``parameters()``), steps every parameter ``optimizer``
        holds, as ``optimizer.step()`` would, with the streamed ones
        stepped on the device block by block: each one's weights,
        gradient and state (``optimizer.state``, page-locked host memory)
        come up on the sink's upload stream, the next block's while this
        one steps; a one-parameter optimizer of its class and group
        settings steps it there; weights and state go home.  The others
        (resident) are stepped by ``optimizer`` itself.  ``max_norm``:
        first every gradient is clipped by their global 2-norm, as
        ``torch.nn.utils.clip_grad_norm_`` does (the norms taken on the
        device in one pass; the host ``.grad`` keep their unclipped
        values); the total norm is returned (a tensor), else None.  Zero
        the gradients after, as with any optimizer.  Refused inside a
        backward, with ``step_in_backward`` on for this optimizer, and for
        a ``max_norm`` that is not a positive number."""
        tr = self._trainer("optimizer_step")
        return optimizer_step(tr, optimizer, max_norm)

    def capture(self, fn, *example_inputs, warmup: int = 2):
        """Captures ``fn(*example_inputs)`` -- a forward of the streamed
        model, run without gradients -- into a CUDA graph and returns a
        ``laden.CapturedForward``: calling it with inputs of the same
        shapes, dtypes and devices replays the whole streamed forward
        (the copies into the slots, the event waits and the kernels) with
        no host work per block, and returns the captured outputs, which
        the next call overwrites.  Inputs that differ run ``fn`` eagerly
        (a warning says so once).  ``fn`` runs ``warmup`` times first, on
        a side stream.  The captured forward copies every streamed block
        it reads, from pinned RAM: blocks on the disk tier (read by
        threads) cannot be captured, nor a handle made with train=True;
        after remove(), release() or set_adapters() the captured forward
        raises StateError (capture again).  CUDA only."""
        return capture(self, fn, example_inputs, warmup)

    def set_adapters(self, adapters, strengths=None, mode: str = "merge"):
        """Applies adapters (``laden.AdapterSpec``: LoRA factors, deltas,
        replacement values) with their ``strengths`` (default 1.0 each),
        replacing the ones set before; ``[]`` removes them and restores
        the exact base weights.  ``mode="merge"`` adds each update where
        its weight runs, never to the host copy: into a streamed block's
        slot right after it lands (once per fill), into resident tensors
        in place (read again from the checkpoint when the adapters
        change), into weights kept compact (lossless, fp8 or bf16
        storage, GGUF) as each call expands them (every call).
        ``mode="routed"`` leaves the weights and adds the
        low-rank residual to ``nn.Linear`` outputs.  Everything is checked
        before anything changes: a key naming no parameter, a shape that
        does not fit, an fp8 or integer target raise AdapterError."""
        set_adapters(self, adapters, strengths, mode)

    def stats(self) -> Dict[str, int]:
        """Counters of the schedule: enters, misses, bytes copied and
        read, device and pinned bytes held.  StateError after release."""
        st = self.state.stats("OffloadHandle.stats")
        return {f: getattr(st, f) for f, _ in st._fields_}

    def remove(self) -> None:
        """Unwraps the blocks, points their weights at their RAM copies and
        frees the slots.  StateError after release, or while another
        thread runs the model (nothing changes then).  While tensors
        derived from streamed weights (views, ``state_dict()`` entries)
        are alive, the slots under them stay allocated (a warning says so);
        they are freed by a later remove() or release()."""
        st = self.state
        o = st.live("OffloadHandle.remove")
        if not self.active:
            return
        with _pass(st, o, "OffloadHandle.remove"):
            self.adapters.clear()  # the base weights back first
            self.adapters.host.clear()  # and the adapters read for it
            st.gone.clear()
            # Weights first, while the blocks are still wrapped: another
            # thread calling a block meanwhile is refused, not run on
            # half-moved weights.
            for b in st.blocks:
                streamed = lib.laden_sched_is_streamed(o.h, b.c_block)
                for t in b.tensors:
                    if streamed or t.store != "plain":
                        st.bind(t, "home")
            self._unwrap()
            if not _free_slots(st, o):
                st.kept_lookahead = self.lookahead

    def _unwrap(self) -> None:
        _unwrap_all(self._wrapped)
        if self.trainer is not None:
            self.trainer.close()
        self.state.training = False
        self.active = False
        if self.state.handle is self:
            self.state.handle = None


def _free_slots(state: "_Stream", o: _Owned, quiet: bool = False) -> bool:
    """Stops the schedule (frees its slots) unless a tensor still uses a
    slot: one derived from a streamed weight (a view, a state_dict entry)
    would point at freed memory.  True if stopped."""
    state.slot_views = [r for r in state.slot_views if r() is not None]
    if state.slot_views:
        if quiet:
            return False
        log.warning("laden: %d tensor(s) derived from the streamed weights "
                    "of %s are alive; its slots stay allocated until they "
                    "are gone (freed by a later remove() or release())",
                    len(state.slot_views), state.name)
        return False
    check(lib.laden_sched_stop(o.h))
    return True


def install_offload(model, *, device=None, lookahead: int = LOOKAHEAD,
                    train: bool = False, grad_dtype=None,
                    compile=None) -> OffloadHandle:
    """Makes the streamed blocks of a model loaded with ``stream_load`` run
    from device slots: allocates ``lookahead + 1`` slots, points the
    blocks' parameters at them (for good: a block always runs from the
    same slot) and wraps each streamed block's forward with one C call
    before and one after.  Returns a handle; ``handle.remove()`` undoes
    it.

    ``train=True``: backward through streamed blocks works (without it, it
    raises).  Each wrapped block is checkpointed: backward streams the
    blocks again, last to first, recomputes each and runs its backward
    before its slot is reused.  Gradients of streamed parameters go to the
    host as each block's backward ends, into the ``.grad`` of their host
    copies (``grad_dtype``: ``torch.float32``, or None for the parameter's
    dtype); ``handle.parameters()`` is what an optimizer steps, and the
    next forward streams what it wrote.  Streamed parameters that train
    need a copy in RAM (not the disk tier) and plain storage (not fp8 or
    GGUF): others must be frozen (``requires_grad_(False)``).

    peft adapters added after ``stream_load`` (``get_peft_model``) inside
    streamed blocks are made here on the model's device (peft put them on
    the streamed weights' ``meta``) and initialized by peft; pass the
    ``PeftModel`` so its ``init_lora_weights`` is used.  They stay
    resident and train as ordinary parameters: LoRA over a streamed,
    frozen base.

    ``compile=laden.BlockCompile(...)`` (or True for its defaults)
    compiles each block's forward with ``torch.compile``, once per block
    class and shape, laden's enter and exit staying outside the compiled
    code."""
    block_compile = check_compile(compile)
    state = getattr(model, "_laden_stream", None)
    if state is None:
        why = ("was released (laden.release); load it again with "
               "laden.stream_load" if "_laden_released" in
               getattr(model, "__dict__", {}) else
               "was not loaded with laden.stream_load")
        raise StateError(f"install_offload: the model {why}", "E_STATE")
    state.live("install_offload")
    if device is not None and _device(device) != state.device:
        raise InvalidArgumentError(
            f"install_offload: device {device} differs from {state.device}, "
            "where stream_load put the model", "E_INVAL")
    if state.handle is not None:
        raise StateError("install_offload: already installed; remove() the "
                         "handle first", "E_STATE")
    check_lookahead(lookahead)
    if not isinstance(train, bool):
        raise InvalidArgumentError(
            f"install_offload: train must be True or False, not {train!r}",
            "E_INVAL")
    if train:
        sharing.refuse_writes(state, "install_offload(train=True)")
    if grad_dtype is not None:
        if not train:
            raise InvalidArgumentError(
                "install_offload: grad_dtype is for train=True", "E_INVAL")
        if grad_code(grad_dtype) is None:
            raise InvalidArgumentError(
                f"install_offload: grad_dtype must be torch.float32, "
                f"float16 or bfloat16, not {grad_dtype}", "E_INVAL")
    materialize_adapters(state, getattr(model, "peft_config", None))
    return _start(state, lookahead, train, grad_dtype, block_compile)


def _start(state: _Stream, lookahead: int, train: bool = False,
           grad_dtype=None, block_compile=None) -> OffloadHandle:
    o = state.live("install_offload")
    with _pass(state, o, "install_offload"):
        kept = state.kept_lookahead
        if kept is not None and _free_slots(state, o, quiet=True):
            kept = None
        if kept is None:
            check(lib.laden_sched_start(o.h, lookahead))
        elif kept != lookahead:
            # Slots kept by remove() for tensors still alive are reused
            # as they are laid out.
            raise StateError(
                f"install_offload: tensors derived from the streamed "
                f"weights of {state.name} still use its slots, laid out for "
                f"lookahead={kept}; drop them or install with that "
                "lookahead", "E_STATE")
        state.kept_lookahead = None
        handle = OffloadHandle(state, lookahead)
        if block_compile is not None:
            handle.compiler = BlockCompiler(block_compile)
        state.handle = handle
        handle.active = True
        try:
            if train:
                handle.trainer = _Trainer(state, grad_dtype)
                state.training = True
            _bind_slots(state, o, handle)
            if train:
                handle.trainer.attach(o)
        except BaseException:
            try:
                handle.remove()
            finally:
                handle._unwrap()
            raise
    return handle


def _bind_slots(state: _Stream, o: _Owned, handle: OffloadHandle) -> None:
    """Wraps the blocks that stream or expand compact tensors, then points
    their tensors where they run (wrapped first: another thread calling a
    block meanwhile is refused, not run on half-bound weights)."""
    relaid = relaid_check(o, state.rebind_slots)
    if handle.trainer is not None or handle.compiler is not None:
        # The trainer hooks the slot views' Parameters, a BlockCompiler's
        # graphs may keep their addresses: the blocks stay where they are.
        check(lib.laden_sched_learn_order(o.h, 0))
    for b in state.blocks:
        streamed = lib.laden_sched_is_streamed(o.h, b.c_block)
        if streamed and b.experts and (handle.trainer is not None or
                                       handle.compiler is not None):
            raise InvalidArgumentError(
                f"install_offload: block '{b.name}' streams the rows of the "
                "experts its router picks, which "
                + ("training (its backward would enter it without them)"
                   if handle.trainer is not None else
                   "a compiled block cannot take (they change every call)")
                + " does not support yet; load with expert_rows=False "
                "(whole layers stream)", "E_INVAL")
        compact = any(t.store != "plain" for t in b.tensors)
        if streamed or compact:  # C's enter fills slots, expands compacts
            _wrap_forward(b.module, o, b.c_block, state.device,
                          handle._wrapped, gone=state.gone,
                          after_enter=handle.adapters.after_enter,
                          slot_tensors=b.tensors if streamed else (),
                          trainer=handle.trainer, compiler=handle.compiler,
                          binds=b.tensors, relaid=relaid if streamed else None,
                          experts=b.experts if streamed else 0)
        elif handle.compiler is not None:
            handle.compiler.install(b.module, handle._wrapped)
        for t in b.tensors:
            if t.store == "plain":
                if streamed:
                    state.bind(t, "run")
                continue
            # C's expansion workspace, made with the slots: the next
            # block's too, so bound only inside the block; outside, meta
            # (state_dict() expands the stored bytes).  Tracked with the
            # slots' views.
            out = expanded_view(o, t, state.device, state.slot_views)
            state.gone[out.untyped_storage().data_ptr()] = b.name
            _set_run(t, out, _meta(t), b.name)
