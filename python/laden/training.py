"""Training through streamed blocks (``install_offload(..., train=True)``).

What Python does here is what only PyTorch can: an autograd node per block
call and hooks on parameters.  Moving gradients off the device (the copy,
its ordering after the compute stream, the staging ring, conversion and
accumulation into the optimizer's ``.grad``) is C (``laden/grads.h``);
which block is where is the schedule's.

- **Each wrapped block is checkpointed**: its forward runs without keeping
  anything for backward (its weights are in a slot or the workspace that
  later blocks reuse); in backward the block is entered again (the
  prefetch window turns with the reverse order), run again under the RNG
  and autocast state of the forward, its backward run inside that same
  enter/exit, and only then exited.  So the slot is never marked free
  before the kernels that read it are enqueued, and enter and exit happen
  on one thread (autograd's device thread on CUDA).
- **Gradients of streamed parameters** are handed to the C sink as soon as
  autograd accumulates them (a post-accumulate hook) and the device copy
  is let go; they land in the ``.grad`` of the parameter's host copy
  (``handle.parameters()``), in its dtype or fp32 (``grad_dtype``), added
  to what is there as torch adds micro-batches.  The sink is flushed when
  the backward pass ends.  On CUDA the ``.grad`` buffers are page-locked
  and reused from step to step (after ``zero_grad()`` the next backward
  writes into the same buffer), so the copy goes straight into them.
- **Optimizers step the host copies**; a block whose host copy changed is
  filled again before it next runs (``_version`` counters, checked at
  every block call).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Dict, Iterator, List, Optional, Tuple

from ._dtypes import checkpoint_dtype
from ._lib import GRADS_ADD, GRADS_PINNED, check, lib
from ._bind import _tensor_view, run_of
from ._describe import _DTYPE_CODE
from ._devices import _compute_stream, _dev_index
from .errors import InvalidArgumentError, LadenError, StateError



def grad_code(dtype) -> Optional[int]:
    """laden's code for a dtype gradients may have (float32, float16,
    bfloat16: what the C sink converts), or None."""
    import torch

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return _DTYPE_CODE[checkpoint_dtype(dtype)]


def post_accumulate_hook(p, fn):
    """p.register_post_accumulate_grad_hook(fn), also for a parameter
    whose contents laden swapped (torch.utils.swap_tensors) since a hook
    was first registered on it: torch registers its hook table with the
    tensor of that moment and, the table existing, not again -- the hook
    would never run (found on the H200: after remove() and a second
    install_offload(train=True), no gradient left the device and no
    weight was updated).  Assigning the table again registers it with the
    tensor p holds now."""
    if getattr(p, "_post_accumulate_grad_hooks", None) is not None:
        p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
    return p.register_post_accumulate_grad_hook(fn)


def _is_kv_cache(x) -> bool:
    """A transformers key/value cache (updated in place by each call)."""
    return type(x).__module__.startswith("transformers") and \
        any(c.__name__ == "Cache" for c in type(x).__mro__)


class _Trainer:
    """One handle's training state: host copies of the streamed trainable
    parameters, the C gradient sink, the hooks.  A wrapped block calls
    `call` (train_call) through it: _hooks.py, below this module, imports
    nothing of it."""

    def call(self, mod, c_block: int, enter, leave, orig, plain, args,
             kwargs):
        return train_call(self, mod, c_block, enter, leave, orig, plain,
                          args, kwargs)

    def __init__(self, state, grad_dtype):
        import torch

        self.state = state
        self.grad_dtype = grad_dtype
        self.device = state.device
        self.cuda = state.device.type == "cuda"
        self.host: Dict[int, object] = {}   # id(_Tensor) -> host Parameter
        self.by_block: Dict[int, List[object]] = {}  # c_block -> host params
        self.tracked: list = []  # the _Tensors with a host Parameter
        # id(host Parameter) -> its _version when last written where the
        # model runs from (a slot, a device copy)
        self.seen: Dict[int, int] = {}
        self.hooks: list = []
        self.keep: list = []   # host .grad tensors written by pending pushes
        self.bufs: Dict[int, object] = {}  # id(_Tensor) -> reused .grad
        self.armed = False     # a flush is queued for this backward
        self.sink = None
        self.copy_stream = None
        self.closed = False  # the handle was removed
        self.fused = None      # _Fused: an optimizer stepping in backward
        self._up = None        # the sink's upload stream (torch's view)
        self.sent: set = set()  # id(.grad) with a copy pending (till flush)
        self.stepped = False   # it stepped weights of the block running
        # An input that requires grad, so every block call is a node of
        # the graph even when only its parameters train.
        self.anchor = torch.zeros((), requires_grad=True)

    # -- set up ----------------------------------------------------------------
    def attach(self, o) -> None:
        """After the blocks are bound where they run: checks what trains,
        makes the host copies and the hooks."""
        largest = 0
        st = self.state
        for b in st.blocks:
            streamed = lib.laden_sched_is_streamed(o.h, b.c_block)
            for t in b.tensors:
                p = t.param
                if not t.is_param or p is None or not p.requires_grad:
                    continue
                where = f"parameter '{t.names[0]}' of block '{b.name}'"
                if t.store != "plain":
                    raise InvalidArgumentError(
                        f"install_offload(train=True): {where} is kept "
                        f"compact ({t.store_dtype or t.store}) and expanded "
                        "where it runs; it cannot be trained: freeze it "
                        "(requires_grad_(False)) and train adapters, or load "
                        "it without storage_dtype", "E_INVAL")
                if not streamed:
                    continue  # runs from memory of its own: ordinary .grad
                hp = self._host_param(o, t, where,
                                      "install_offload(train=True)",
                                      "streamed")
                largest = max(largest, hp.numel() * hp.element_size())
                # On the tensor the block computes with (bound into the
                # module only inside the block): its gradient lands there.
                self.hooks.append(post_accumulate_hook(run_of(t),
                                                       self._pusher(t)))
        if self.host:
            self._make_sink(largest)

    def _host_param(self, o, t, where: str, who: str, kind: str):
        """t's host copy as the Parameter an optimizer steps (checked: it
        has one, in a dtype gradients can take), tracked from now on."""
        import torch

        p = t.param
        home = _tensor_view(o, t, "home", None)
        if home is None:
            raise InvalidArgumentError(
                f"{who}: {where} streams from the disk tier, which has no "
                "copy in memory for an optimizer to update: freeze it "
                "(requires_grad_(False)), or give the model a RAM budget "
                "that holds it", "E_INVAL")
        if grad_code(p.dtype) is None:
            raise InvalidArgumentError(
                f"{who}: {where} is {p.dtype}; {kind} parameters train in "
                "float32, float16 or bfloat16", "E_INVAL")
        hp = torch.nn.Parameter(home, requires_grad=True)
        want = self.grad_dtype or p.dtype
        if want != p.dtype:
            if not hasattr(hp, "grad_dtype"):
                raise InvalidArgumentError(
                    f"install_offload(train=True, grad_dtype={want}): "
                    f"{where} is {p.dtype}, and this torch "
                    f"({torch.__version__}) cannot hold a gradient of "
                    "another dtype than its parameter (Tensor.grad_dtype "
                    "came later); leave grad_dtype out", "E_INVAL")
            hp.grad_dtype = want
        self.host[id(t)] = hp
        self.by_block.setdefault(t.c_block, []).append(hp)
        self.tracked.append(t)
        self.seen[id(hp)] = hp._version
        return hp

    def _make_sink(self, largest: int) -> None:
        """The C gradient sink, its staging sized for the largest tensor
        (bytes), and its copy stream as torch's."""
        import torch

        staging = lib.laden_grads_staging_bytes(largest)
        h = ctypes.c_void_p()
        check(lib.laden_grads_create(_dev_index(self.device), staging,
                                     ctypes.byref(h)))
        self.sink = h.value
        if self.cuda:
            self.copy_stream = torch.cuda.ExternalStream(
                lib.laden_grads_stream(self.sink), device=self.device)

    def close(self) -> None:
        """Flushes what is pending (the .grad values are kept) and frees
        the sink; the host parameters stay valid while referenced."""
        self.closed = True
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.fused = None
        if self.sink is not None:
            sink, self.sink = self.sink, None
            try:
                check(lib.laden_grads_flush(sink))
            finally:
                o = self.state.owner
                if o is not None and self.cuda and \
                        lib.laden_sched_forget_stream(
                            o.h, lib.laden_grads_stream(sink)):
                    # Blocks left on the sink's stream and the schedule
                    # still holds it: its stream must outlive the
                    # schedule, so the sink is kept (a leak, not a crash).
                    import logging

                    logging.getLogger("laden").warning(
                        "laden: the gradient sink is kept: the schedule "
                        "could not let go of its stream: %s",
                        (lib.laden_last_error() or b"").decode(
                            "utf-8", "replace"))
                    self.leaked_sink = sink
                else:
                    lib.laden_grads_destroy(sink)
        self.keep.clear()
        self.bufs.clear()  # the host parameters' .grad keep theirs

    # -- gradients ---------------------------------------------------------------
    def _pusher(self, t):
        def hook(p) -> None:
            g = p.grad
            p.grad = None  # the device copy goes as soon as it is copied
            if g is None:
                return
            f = self.fused
            if f is not None and id(self.host[id(t)]) in f.groups:
                f.step(t, p, g)
            else:
                self._push(t, g)
        return hook

    def leave_stream(self, stream: int):
        """The stream a block leaves on after its backward: the sink's,
        after it waited for `stream`, when an optimizer stepped weights in
        the block's slot (the slot is refilled only once they are copied
        home, also when the block's backward failed half-way); else
        `stream`.  If the sink cannot be ordered after `stream`, its
        copies are waited for here, and the error returned to be raised
        once the block has left: (stream, error or None)."""
        if not self.stepped:
            return stream, None
        self.stepped = False
        try:
            check(lib.laden_grads_wait(self.sink, stream))
        except LadenError as e:
            import torch

            try:  # the slot waits for nothing: the copies done
                if self.cuda:
                    torch.cuda.synchronize(self.device)
            except RuntimeError as e2:  # a sticky CUDA error
                return stream, e2
            return stream, e
        return lib.laden_grads_stream(self.sink), None

    # A .grad buffer is reused only while nothing but laden holds it: not
    # the tensor object (sys.getrefcount, against what it was when laden
    # stored it) and not its memory (a .detach() or .data the user kept:
    # the storage's use count), so a gradient kept from an earlier step
    # never changes under the user.
    def _new_buffer(self, key: int, shape, dtype):
        import torch

        buf = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        # As _reusable counts: this frame's name, getrefcount's argument,
        # and (+1) the entry that is about to hold it.
        rc = sys.getrefcount(buf) + 1
        uses = _storage_uses(buf)
        self.bufs[key] = (buf, rc, uses)
        return buf

    def _reusable(self, key: int):
        ent = self.bufs.get(key)
        if ent is None:
            return None
        buf = ent[0]
        if sys.getrefcount(buf) > ent[1] or _storage_uses(buf) > ent[2]:
            return None
        return buf

    def _push(self, t, g) -> None:
        hp = self.host[id(t)]
        acc = hp.grad
        flags = 0
        if acc is None:
            # The buffer of the last step, reused: page-locked on CUDA, so
            # the copy goes straight into it (allocating and first-touching
            # the model's size of new host memory every step cost seconds).
            acc = self._reusable(id(t))
            if acc is None:
                acc = self._new_buffer(id(t), hp.shape,
                                       self.grad_dtype or hp.dtype)
            hp.grad = acc
            if acc.dtype != g.dtype:
                # Converted on the device: the host then does nothing.
                g = g.to(acc.dtype)
        elif self.cuda and id(acc) not in self.sent and \
                self.bufs.get(id(t), (None,))[0] is acc:
            # A later micro-batch, into laden's page-locked buffer: the sum
            # so far comes up on the sink's upload stream, is added on the
            # device, and goes down into the same buffer.  9.66 GB added
            # on the host took the backward from 0.38 to 1.9 s on the H200;
            # the link carries it in a fraction of that.
            g = self._sum_on_device(acc, g)
        else:
            flags |= GRADS_ADD
        dst = grad_code(acc.dtype)
        if dst is None:
            raise InvalidArgumentError(
                f"the .grad of '{t.names[0]}' is {acc.dtype}; laden adds "
                "gradients into float32, float16 or bfloat16", "E_INVAL")
        ent = self.bufs.get(id(t))
        if self.cuda and ent is not None and acc is ent[0]:
            flags |= GRADS_PINNED
        # Its copy is pending until the flush: a second gradient for it in
        # this backward is added on the host, after that copy.
        self.sent.add(id(acc))
        self.send(g.contiguous(), acc, dst, flags,
                  _compute_stream(self.device))

    def send(self, d, h, dst: int, flags: int, stream: int,
             owned: bool = True) -> None:
        """d (on the device) into host tensor h through the sink, as dtype
        code dst, after `stream`'s work; h kept alive until the flush, d
        (when torch's memory: owned) until the copy stream read it."""
        self.keep.append(h)
        check(lib.laden_grads_push(
            self.sink, d.data_ptr(), grad_code(d.dtype), d.numel(),
            h.data_ptr(), dst, flags, stream))
        if self.cuda and owned:
            d.record_stream(self.copy_stream)

    def up_stream(self):
        """The sink's upload stream, as a torch stream (CUDA)."""
        import torch

        if self._up is None:
            self._up = torch.cuda.ExternalStream(
                lib.laden_grads_upload_stream(self.sink), device=self.device)
        return self._up

    def fetch(self, v):
        """A device copy of host tensor v (page-locked on CUDA), in memory
        of the sink's upload stream, copied there by the sink; the compute
        stream waits for it at laden_grads_fetched."""
        import contextlib

        import torch

        with torch.cuda.stream(self.up_stream()) if self.cuda else \
                contextlib.nullcontext():
            d = torch.empty(v.shape, dtype=v.dtype, device=self.device)
        check(lib.laden_grads_fetch(self.sink, d.data_ptr(), v.data_ptr(),
                                    v.numel() * v.element_size()))
        return d

    def _sum_on_device(self, acc, g):
        """acc (page-locked host) + g, on the device in acc's dtype (as the
        host adds: in float32, rounded once)."""
        import torch

        d = self.fetch(acc)
        check(lib.laden_grads_fetched(self.sink,
                                      _compute_stream(self.device)))
        d.record_stream(torch.cuda.current_stream(self.device))
        if d.dtype == torch.float32 or d.dtype == g.dtype:
            return d.add_(g)
        return d.float().add_(g.float()).to(d.dtype)

    def arm(self) -> None:
        """Inside a backward pass: the sink is flushed when it ends."""
        import torch

        if self.sink is None or self.armed:
            return
        self.armed = True
        if self.fused is not None:
            self.fused.begin()
        torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        self.armed = False
        if self.fused is not None:
            self.fused.ready = {}  # fetched for a block that did not step
        if self.sink is not None:
            try:
                check(lib.laden_grads_flush(self.sink))
            finally:
                self.keep.clear()
                self.sent.clear()

    # -- host copies that an optimizer changed --------------------------------
    def refresh(self, c_block: int) -> None:
        """Before block c_block runs: if an optimizer changed one of its
        host copies, what changed goes where the model runs from (sync)."""
        if self.armed:
            # A backward that failed never ran its callback.
            self.flush()
        if any(hp._version != self.seen[id(hp)]
               for hp in self.by_block.get(c_block, ())):
            self.sync()

    def sync(self) -> None:
        """Every host copy changed since it was last written where the
        model runs from goes there: the slots filled again (once) for a
        streamed block, the tensor written into a cached model's device
        copy (laden_sched_reupload_tensor, ordered on the compute
        stream)."""
        if self.armed:
            self.flush()
        o = self.state.live("training")
        refill = []  # counted as written once the refill has been
        stream = None
        for t in self.tracked:
            hp = self.host[id(t)]
            if hp._version == self.seen[id(hp)]:
                continue
            if lib.laden_sched_is_streamed(o.h, t.c_block):
                refill.append(hp)
                continue
            if lib.laden_sched_is_resident(o.h, t.c_block):
                if stream is None:
                    stream = _compute_stream(self.device)
                check(lib.laden_sched_reupload_tensor(
                    o.h, t.c_block, t.c_index, stream))
            self.seen[id(hp)] = hp._version  # written (or read from host)
        if refill:
            check(lib.laden_sched_refill(o.h))
            for hp in refill:
                self.seen[id(hp)] = hp._version

    def block_name(self, c_block: int) -> str:
        return next((b.name for b in self.state.blocks
                     if b.c_block == c_block), "?")

    def may_backward(self, c_block: int) -> None:
        """Before a block's backward: StateError where it cannot run."""
        if self.closed:
            raise StateError(
                f"backward through streamed block "
                f"'{self.block_name(c_block)}' after its "
                "install_offload handle was removed (or the model "
                "released): its weights are no longer streamed for "
                "it; run backward before remove()", "E_STATE")

    # -- the parameters an optimizer steps ---------------------------------------
    def named_parameters(self) -> Iterator[Tuple[str, object]]:
        """The model's parameters in its order and with its names (peft's
        adapters included), a streamed one as its host copy."""
        host = {id(t.param): self.host[id(t)] for t in self.state.tensors
                if id(t) in self.host}
        root = self.state.root[0] if self.state.root is not None else None
        if root is None:
            items = [(t.names[0], t.param) for t in self.state.tensors
                     if t.is_param and t.param is not None]
        else:
            items = list(root.named_parameters())
        for n, p in items:
            hp = host.get(id(p))
            if hp is not None:
                yield n, hp
            elif p.requires_grad:
                yield n, p


class _CacheState:
    """What _Trainer reads of a stream_load model, for a ModelCache
    runtime (cache._Runtime)."""

    def __init__(self, rt):
        self.rt = rt
        self.device = rt.device
        self.blocks = ()

    @property
    def owner(self):
        return self.rt.owner

    @property
    def tensors(self):
        return self.rt.tensors

    @property
    def root(self):
        return (self.rt.model,) if self.rt.model is not None else None

    def live(self, what: str):
        o = self.rt.owner
        if o is None:
            raise StateError(
                f"{what}: model '{self.rt.spec.key}' was dropped from the "
                "cache", "E_STATE")
        return o


class _CacheTrainer(_Trainer):
    """A trainable ModelCache model (``ModelSpec(trainable=True)``).

    Its host copy is the only copy of its weights: C's host policy never
    drops it (laden_cache_keep_host), and every trainable parameter --
    in a block or outside, resident or streamed this use -- trains
    through it.  Gradients leave the device through the sink wherever the
    block ran (``cache.parameters(key)`` are the host copies, with their
    ``.grad``); an optimizer steps them; what it changed reaches the
    device before it is read again: tensor by tensor into the device
    copies (laden_sched_reupload_tensor, ordered on the compute stream),
    by a refill into the slots.  Device copies therefore never hold
    anything the host copy lacks, and evicting them loses nothing."""

    def __init__(self, rt):
        super().__init__(_CacheState(rt), None)
        self.rt = rt
        self.start: Dict[int, int] = {}  # id(host Parameter) -> at attach

    def block_name(self, c_block: int) -> str:
        return self.rt.block_names.get(c_block, f"part {c_block} of the rest")

    def may_backward(self, c_block: int) -> None:
        if self.closed or not self.rt.in_use:
            raise StateError(
                f"backward through block '{self.block_name(c_block)}' of "
                f"model '{self.rt.spec.key}' outside cache.use(): its "
                "weights may have left the device; run backward inside "
                "the use that ran the forward", "E_STATE")

    def attach(self, o) -> None:
        """After the build: a host Parameter per trainable tensor, the
        sink, the hooks."""
        largest = 0
        key = self.rt.spec.key
        who = "ModelSpec(trainable=True)"
        for t in self.rt.tensors:
            p = t.param
            if not t.is_param or p is None or not p.requires_grad:
                continue
            # The cache keeps every tensor plain (fp8 and GGUF decoded at
            # load): nothing compact to refuse.
            where = f"parameter '{t.names[0]}' of model '{key}'"
            hp = self._host_param(o, t, where, who, "cached")
            self.start[id(hp)] = hp._version
            largest = max(largest, hp.numel() * hp.element_size())
        if not self.tracked:
            return
        self._make_sink(largest)
        self.rehook()

    def rehook(self) -> None:
        """On the tensors the model computes with now (they change as
        blocks move between a device copy and a slot)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        if self.closed:
            return
        for t in self.tracked:
            self.hooks.append(post_accumulate_hook(run_of(t),
                                                   self._pusher(t)))

    def _pusher(self, t):
        push = super()._pusher(t)

        def hook(p) -> None:
            self.arm()  # also for parameters outside blocks
            push(p)
        return hook

    def changed(self) -> bool:
        """Whether an optimizer changed a host copy since the build."""
        return any(hp._version != self.start[id(hp)]
                   for hp in self.host.values())


class _Fused:
    """An optimizer stepping the streamed parameters in backward
    (``handle.step_in_backward``): as a streamed parameter's gradient is
    accumulated, its optimizer state (page-locked, in ``optimizer.state``
    of its host copy) comes up, a one-parameter optimizer of the same
    class and hyperparameters steps it in its slot, and the weights and
    the state go home; the block leaves on the sink's stream so its slot
    is refilled only after that.  The gradient never leaves the device."""

    def __init__(self, trainer: _Trainer, opt):
        self.tr = trainer
        self.opt = opt
        self.groups: Dict[int, dict] = {}
        self.shadow: Dict[int, object] = {}  # id(_Tensor) -> optimizer
        self.ready: Dict[int, dict] = {}  # id(host param) -> fetched state
        self.done: set = set()  # id(host param) stepped in this backward
        import inspect

        try:
            sig = inspect.signature(type(opt).__init__).parameters
        except (TypeError, ValueError):
            sig = {}
        self.kwargs = set(sig) - {"self", "params"}
        self.regroup()
        if not self.groups:
            raise InvalidArgumentError(
                f"step_in_backward: the {type(opt).__name__} holds none of "
                "the host copies of streamed parameters (build it over "
                "handle.parameters())", "E_INVAL")

    def begin(self) -> None:
        """At the start of a backward."""
        self.regroup()
        self.ready = {}
        self.done = set()

    def regroup(self) -> None:
        ours = {id(hp) for hp in self.tr.host.values()}
        self.groups = {id(p): g for g in self.opt.param_groups
                       for p in g["params"] if id(p) in ours}

    def _shadow(self, t, p, group):
        sh = self.shadow.get(id(t))
        hyper = {k: v for k, v in group.items() if k != "params"}
        if sh is None:
            try:
                sh = type(self.opt)(
                    [p], **{k: v for k, v in hyper.items()
                            if k in self.kwargs})
            except Exception as e:
                raise InvalidArgumentError(
                    "step_in_backward: cannot make a "
                    f"{type(self.opt).__name__} for one parameter with the "
                    f"group's settings: {e}",
                    "E_INVAL") from e
            self.shadow[id(t)] = sh
        sh.param_groups[0].update(hyper)  # a scheduler's lr, each step
        return sh

    def prefetch(self, c_block: int) -> None:
        """As block c_block is entered in backward: the optimizer state of
        its parameters starts up on the sink's upload stream, in memory of
        that stream, while the block is recomputed."""
        self.ready.clear()  # what an earlier block did not use
        for hp in self.tr.by_block.get(c_block, ()):
            if id(hp) in self.groups and self.opt.state.get(hp):
                self.ready[id(hp)] = self._fetch(hp, self.opt.state[hp])

    def _fetch(self, hp, hs) -> dict:
        """hp's per-element state, fetched into memory of the upload
        stream."""
        tr = self.tr
        got = {}
        for k, v in list(hs.items()):
            if k == "step" or not _per_element(v, hp):
                continue
            if tr.cuda and not v.is_pinned():
                v = hs[k] = v.pin_memory()  # e.g. after load_state_dict
            got[k] = tr.fetch(v)
        return got

    def step(self, t, p, g) -> None:
        import torch

        tr = self.tr
        hp = tr.host[id(t)]
        if id(hp) in self.done:
            raise InvalidArgumentError(
                f"step_in_backward: '{t.names[0]}' got a second gradient in "
                "one backward (its block ran twice in the forward): each "
                "weight steps once per backward; turn step_in_backward off "
                "(None) for this model", "E_INVAL")
        sh = self._shadow(t, p, self.groups[id(hp)])
        stream = _compute_stream(tr.device)
        hs = self.opt.state[hp]
        got = self.ready.pop(id(hp), None)
        if got is None:  # not prefetched: fetched now
            got = self._fetch(hp, hs) if hs else {}
        check(lib.laden_grads_fetched(tr.sink, stream))
        cur = torch.cuda.current_stream(tr.device) if tr.cuda else None
        ds = {}
        for k, v in hs.items():
            d = got.get(k)
            if d is None:
                ds[k] = v  # a step count: shared, updated in place
            else:
                if cur is not None:
                    d.record_stream(cur)  # from the upload stream's memory
                ds[k] = d
        sh.state[p] = ds
        p.grad = g
        try:
            sh.step()
        finally:
            p.grad = None
            ds = sh.state.pop(p, {})
        home, kept = {}, {}
        for k, d in ds.items():
            on_dev = k != "step" and isinstance(d, torch.Tensor) and \
                d.device == tr.device
            if on_dev and _per_element(d, hp) and grad_code(d.dtype):
                home[k] = d
            elif on_dev and d.numel() > 1:
                # State that cannot go home (e.g. 8-bit): the weights in
                # the slot go back to their host copy, and it is refused.
                p.detach().copy_(hp.detach(), non_blocking=True)
                raise InvalidArgumentError(
                    f"step_in_backward: the {type(self.opt).__name__}'s "
                    f"state '{k}' of '{t.names[0]}' is {d.dtype} "
                    f"{tuple(d.shape)}; only float32, float16 or bfloat16 "
                    "state with one value per weight is kept on the host",
                    "E_INVAL")
            else:
                kept[k] = d
        hs.update(kept)
        for k, d in home.items():
            h = hs.get(k)
            if h is None or not _per_element(h, hp) or h.dtype != d.dtype \
                    or (tr.cuda and not h.is_pinned()):
                h = hs[k] = torch.empty(d.shape, dtype=d.dtype,
                                        pin_memory=tr.cuda)
            self._home(d, h, stream)
        # The weights, from the slot (not torch's memory: nothing to keep)
        self._home(p.detach(), hp.detach(), stream, owned=False)
        self.done.add(id(hp))
        tr.stepped = True

    def _home(self, d, h, stream, owned=True) -> None:
        """d (on the device) to h (page-locked, the same dtype: step
        checked it can go)."""
        tr = self.tr
        tr.send(d, h, grad_code(d.dtype), GRADS_PINNED if tr.cuda else 0,
                stream, owned)


def optimizer_step(tr: _Trainer, opt, max_norm=None):
    """OffloadHandle.optimizer_step's work (its docstring says what)."""
    import math

    import torch

    if max_norm is not None and (
            isinstance(max_norm, bool) or
            not isinstance(max_norm, (int, float)) or
            not math.isfinite(max_norm) or max_norm <= 0):
        raise InvalidArgumentError(
            f"optimizer_step: max_norm={max_norm!r}; give a positive "
            "number, or None not to clip", "E_INVAL")
    if tr.armed:
        raise StateError("optimizer_step: called inside a backward pass; "
                         "step once the backward returned", "E_STATE")
    f = tr.fused
    if f is not None and f.opt is opt:
        raise StateError(
            "optimizer_step: step_in_backward steps this optimizer inside "
            "backward already (its streamed gradients never reach the "
            "host); turn it off with step_in_backward(None) to accumulate "
            "and step here", "E_STATE")
    ours = {id(hp): hp for hp in tr.host.values()}
    held = [p for g in opt.param_groups for p in g["params"]]
    of_t = {id(hp): t_id for t_id, hp in tr.host.items()}
    tensors = {id(t): t for t in tr.state.tensors}
    stream = _compute_stream(tr.device)
    # The streamed parameters with a gradient, block by block in the
    # schedule's order; the others are optimizer.step()'s.
    held_ids = {id(p) for p in held}
    blocks = []
    for c_block, hps in tr.by_block.items():
        mine = [hp for hp in hps if id(hp) in held_ids
                and hp.grad is not None]
        if mine:
            blocks.append((c_block, mine))
    others = [p for p in held if id(p) not in ours and p.grad is not None]

    def up(hp):
        """hp's weights and gradient on the device (issued, not waited)."""
        d_p = tr.fetch(hp.detach())
        d_g = tr.fetch(hp.grad)
        return hp, d_p, d_g

    total = coef = None
    if max_norm is not None:
        norms = []
        for _, hps in blocks:  # a pass of the gradients over the link
            ds = [tr.fetch(hp.grad) for hp in hps]
            check(lib.laden_grads_fetched(tr.sink, stream))
            for d in ds:
                if tr.cuda:
                    d.record_stream(torch.cuda.current_stream(tr.device))
                norms.append(torch.linalg.vector_norm(d, dtype=torch.float32))
        norms += [torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                  .to(tr.device) for p in others]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else \
            torch.zeros((), device=tr.device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in others:
            p.grad.detach().mul_(coef.to(p.grad.device))
    # The others: the optimizer itself, the streamed ones hidden from it
    # (an optimizer steps no parameter without a gradient).
    kept = {id(hp): hp.grad for _, hps in blocks for hp in hps}
    try:
        for _, hps in blocks:
            for hp in hps:
                hp.grad = None
        opt.step()  # its hooks and a scheduler's bookkeeping run as ever
    finally:
        for _, hps in blocks:
            for hp in hps:
                hp.grad = kept[id(hp)]
    if not blocks:
        return total
    fu = _Fused(tr, opt)
    fu.begin()
    cur = torch.cuda.current_stream(tr.device) if tr.cuda else None
    fu.prefetch(blocks[0][0])
    pending = [up(hp) for hp in blocks[0][1]]
    try:
        for i, (c_block, hps) in enumerate(blocks):
            ready = pending
            check(lib.laden_grads_fetched(tr.sink, stream))
            for hp, d_p, d_g in ready:
                if cur is not None:
                    for d in (d_p, d_g):
                        d.record_stream(cur)
                    d_p.record_stream(tr.copy_stream)  # sent home
                if coef is not None:  # clipped in its own dtype first
                    d_g.mul_(coef)
                if d_g.dtype != d_p.dtype:  # grad_dtype: as the weights
                    d_g = d_g.to(d_p.dtype)
                fu.step(tensors[of_t[id(hp)]], d_p, d_g)
            if i + 1 < len(blocks):  # up while this block's kernels run
                fu.prefetch(blocks[i + 1][0])
                pending = [up(hp) for hp in blocks[i + 1][1]]
    finally:
        tr.stepped = False
        try:
            tr.flush()  # every copy home done
        finally:
            # The slots hold the weights of before: filled again, also when
            # a copy home failed (the host copies' versions do not show
            # what the sink wrote).
            o = tr.state.live("optimizer_step")
            check(lib.laden_sched_refill(o.h))
    return total


def _storage_uses(t) -> int:
    """How many tensors share t's memory (0 where torch cannot say)."""
    import torch

    f = getattr(torch._C, "_storage_Use_Count", None)
    if f is None:
        return 0
    return f(t.untyped_storage()._cdata)


def _per_element(v, hp) -> bool:
    """A state tensor with one value per element of the parameter."""
    import torch

    return isinstance(v, torch.Tensor) and v.is_floating_point() and \
        v.shape == hp.shape


def materialize_adapters(state, configs=None) -> None:
    """Parameters made after stream_load inside streamed blocks: peft
    places a LoRA layer's new factors on its base weight's device, which
    for a streamed weight outside its block's call is ``meta`` (the disk
    tier: no values) or the CPU (the RAM tier's host copy: moved to the
    model's device here).  They are made on the model's device here and
    initialized by peft's own ``reset_lora_parameters`` with the
    adapter's ``init_lora_weights`` (``configs``: a PeftModel's
    ``peft_config``; True when not given).  Anything else on ``meta`` in a
    streamed block that laden does not load is refused by name."""
    import torch

    managed = {id(t.param) for t in state.tensors if t.param is not None}
    dev = state.device
    for b in state.blocks:
        pre = b.name.rstrip(".")
        for mname, mod in b.module.named_modules():
            if not (hasattr(mod, "reset_lora_parameters") and
                    isinstance(getattr(mod, "lora_A", None),
                               torch.nn.ModuleDict)):
                continue
            _materialize_lora(mod, f"{pre}.{mname}" if mname else pre,
                              dev, configs)
        for n, p in b.module.named_parameters():
            if p.is_meta and id(p) not in managed:
                raise InvalidArgumentError(
                    f"parameter '{pre}.{n}' of streamed block "
                    f"'{pre}' is on meta and laden does not load it: "
                    "made after stream_load on the device of a streamed "
                    "weight (meta outside its block's call), it has no "
                    "values; make it on the model's device, or before "
                    "stream_load and in the checkpoint", "E_INVAL")


def materialize_peft(model, dev) -> None:
    """A peft model built on ``meta`` over a base its checkpoint holds
    (a ModelSpec factory): the LoRA factors, which no checkpoint holds,
    made on `dev` and initialized by peft as ``materialize_adapters``
    does.  Nothing for other models."""
    import torch

    configs = getattr(model, "peft_config", None)
    if configs is None:
        return
    for mname, mod in model.named_modules():
        if hasattr(mod, "reset_lora_parameters") and \
                isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
            _materialize_lora(mod, mname, dev, configs)


def _materialize_lora(mod, where: str, dev, configs) -> None:
    import torch

    # Embedding LoRA (factors as parameters): moved, or refused on meta.
    for dname in ("lora_embedding_A", "lora_embedding_B"):
        pd = getattr(mod, dname, None) or {}
        for name in list(pd.keys()):
            q = pd[name]
            if q.is_meta:
                raise InvalidArgumentError(
                    f"peft adapter '{name}' of '{where}' is an embedding "
                    "LoRA made after stream_load on the disk tier (no "
                    "values); apply it before laden loads the model, or "
                    "keep the embedding resident", "E_INVAL")
            if q.device != dev:
                pd[name] = torch.nn.Parameter(q.detach().to(dev),
                                              requires_grad=q.requires_grad)
    for name in list(mod.lora_A.keys()):
        parts = [mod.lora_A[name], mod.lora_B[name]]
        if not any(p.is_meta for m in parts for p in m.parameters()):
            # On the RAM tier peft saw the host copy's device (the CPU):
            # the factors, with their values, go where the model runs.
            for m in parts:
                if any(p.device != dev for p in m.parameters()):
                    m.to(dev)
            continue
        mag = getattr(mod, "lora_magnitude_vector", None)
        if mag is not None and name in mag:
            raise InvalidArgumentError(
                f"peft adapter '{name}' of '{where}' is DoRA, made after "
                "stream_load: its magnitude is computed from the base "
                "weight, which is not in memory there; apply it to the "
                "model before laden loads it", "E_INVAL")
        cfg = configs.get(name) if configs is not None else None
        init = getattr(cfg, "init_lora_weights", True)
        if not (init is True or init is False or
                (isinstance(init, str) and init.lower() == "gaussian")):
            raise InvalidArgumentError(
                f"peft adapter '{name}' of '{where}' was made after "
                f"stream_load with init_lora_weights={init!r}, which is "
                "computed from the base weight; laden makes such adapters "
                "on the device only with True, False or 'gaussian'",
                "E_INVAL")
        for m in parts:
            m.to_empty(device=dev)
        if init is False:  # what peft leaves: nn.Linear's own init
            for m in parts:
                m.reset_parameters()
        else:
            mod.reset_lora_parameters(name, init)


def _rng_state(device):
    import torch

    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, gpu


def _autocast_state(device):
    import torch

    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _block_function():
    import torch
    from torch.utils._pytree import tree_flatten

    class _StreamedBlock(torch.autograd.Function):
        """One call of a wrapped block: forward without keeping
        activations; backward enters the block again, recomputes it and
        runs its backward before it exits."""

        @staticmethod
        def forward(ctx, call, anchor, *tensors):
            ctx.call = call
            ctx.rng = _rng_state(call.device)
            ctx.autocast = _autocast_state(call.device)
            ctx.save_for_backward(*tensors)
            with torch.no_grad():
                out = call.run(tensors)
            leaves, spec = tree_flatten(out)
            call.out_spec = spec
            call.out_leaves = leaves
            outs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
            ctx.mark_non_differentiable(
                *[x for x in outs if not x.is_floating_point()])
            return outs

        @staticmethod
        def backward(ctx, *grads):
            call = ctx.call
            tr = call.trainer
            tr.may_backward(call.block)
            tr.arm()
            saved = ctx.saved_tensors
            inputs = [x.detach().requires_grad_(x.requires_grad)
                      if x.is_floating_point() else x.detach()
                      for x in saved]
            cpu, gpu = ctx.rng
            dev = call.device
            devices = [dev] if dev.type == "cuda" else []
            on, dtype = ctx.autocast
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu)
                if gpu is not None:
                    torch.cuda.set_rng_state(gpu, dev)
                with torch.enable_grad(), torch.autocast(
                        dev.type, dtype=dtype, enabled=on):
                    call.recompute_and_backward(inputs, grads)
            return (None, None) + tuple(
                x.grad if isinstance(x, torch.Tensor) and x.requires_grad
                else None for x in inputs)

    return _StreamedBlock


_FUNCTION = None


class _Call:
    """What one call of a wrapped block needs in both passes."""

    __slots__ = ("trainer", "device", "block", "enter", "leave", "orig",
                 "flat", "spec", "index", "out_spec", "out_leaves")

    def args(self, tensors):
        """The call's (args, kwargs) with `tensors` in the tensors' places."""
        from torch.utils._pytree import tree_unflatten

        flat = list(self.flat)
        for i, t in zip(self.index, tensors):
            flat[i] = t
        return tree_unflatten(flat, self.spec)

    def run(self, tensors, then=None):
        """Enter, the block's forward on `tensors`, then(output) if given,
        exit.  An error inside exits quietly: the block's own error is the
        one raised."""
        args, kwargs = self.args(tensors)
        stream = self.enter()
        try:
            f = self.trainer.fused
            if then is not None and f is not None:
                f.prefetch(self.block)
            out = self.orig(*args, **kwargs)
            if then is not None:
                then(out)
        except BaseException:
            try:
                self.leave(self.trainer.leave_stream(stream)[0])
            except LadenError:
                pass
            raise
        s, err = self.trainer.leave_stream(stream)
        self.leave(s)
        if err is not None:
            raise err
        return out

    def recompute_and_backward(self, inputs, grads) -> None:
        """The block entered again, run on `inputs` and its backward run
        for `grads`, before it exits: the backward's kernels that read the
        block's weights are enqueued on the stream before "free" is."""
        import torch
        from torch.utils._pytree import tree_flatten

        def backward(out) -> None:
            leaves = [x for x in tree_flatten(out)[0]
                      if isinstance(x, torch.Tensor)]
            pairs = [(x, g) for x, g in zip(leaves, grads)
                     if g is not None and x.requires_grad]
            if pairs:
                torch.autograd.backward([x for x, _ in pairs],
                                        [g for _, g in pairs])

        self.run(inputs, backward)


def train_call(trainer: _Trainer, mod, c_block: int, enter, leave, orig,
               plain, args, kwargs):
    """A wrapped block called with gradients enabled in training: a node
    of the graph, or plain(args, kwargs) when nothing in the call needs a
    gradient (no input requires one, no parameter of the block trains)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _block_function()
    trainer.refresh(c_block)
    flat, spec = tree_flatten((args, kwargs))
    index = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if not any(flat[i].requires_grad for i in index) and \
            not any(p.requires_grad for p in mod.parameters()):
        return plain(args, kwargs)
    for x in flat:
        if _is_kv_cache(x):
            raise InvalidArgumentError(
                f"block '{trainer.block_name(c_block)}' was called with a "
                f"{type(x).__name__} (a key/value cache): in training each "
                "block runs twice (forward, then again in backward), which "
                "would add to the cache twice; call the model with "
                "use_cache=False", "E_INVAL")
    call = _Call()
    call.trainer, call.device, call.block = trainer, trainer.device, c_block
    call.enter, call.leave, call.orig = enter, leave, orig
    call.flat, call.spec, call.index = flat, spec, index
    outs = _FUNCTION.apply(call, trainer.anchor, *[flat[i] for i in index])
    for i in index:  # saved by the node; not held a second time
        flat[i] = None
    it = iter(outs)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x
              for x in call.out_leaves]
    call.out_leaves = None  # the forward's outputs are not kept twice
    return tree_unflatten(leaves, call.out_spec)
