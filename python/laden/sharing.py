"""One host copy of a model for the processes of a host (issue 19).

``stream_load(..., shared=True)``, ``from_pretrained(..., shared=True)``
and ``ModelSpec(..., shared=True)`` ask laden's C layer
(``laden_sched_share``) to put the model's host copy -- the blocks that
live in host memory: the RAM tier, and on the CPU device the resident part
too -- in shared memory named from what determines its bytes (the
checkpoint files' identities, every tensor's place, dtype and conversion).
The first process loads it; the others that load the same checkpoint the
same way attach and read nothing; each pins it with its own CUDA context;
the last to release removes it.  A name held by something else (a segment
of another model, a file laden did not make, a FIFO, a symlink, another
user's file) is never used: the load keeps a private copy and warns once.
Here: the call, what it did, the check across a process group, and the
segments in the directory (``laden shm list`` / ``laden shm clean``).
"""

from __future__ import annotations

import ctypes
import logging
import socket
from dataclasses import dataclass
from typing import List, Optional, Tuple

from . import _lib
from ._lib import check, lib
from .errors import InvalidArgumentError, MismatchError, StateError

log = logging.getLogger("laden")

STATES = {_lib.SHARE_NONE: None, _lib.SHARE_MADE: "made",
          _lib.SHARE_ATTACHED: "attached"}
FELL_BACK = _lib.SHARE_FELL_BACK  # asked, but the name was held by something else


@dataclass(frozen=True)
class Shared:
    """A model's shared host copy: ``how`` is ``"made"`` (this process read
    the checkpoint into it) or ``"attached"`` (another process had); its
    segment's ``name`` (a file in ``LADEN_SHM_DIR``, default ``/dev/shm``,
    as ``laden-<name>``) and ``nbytes``."""

    how: str
    name: str
    nbytes: int


def group_of(shared, where: str):
    """`shared` checked: False/None (not shared), True, or a
    torch.distributed process group whose ranks on one host must load the
    same checkpoint the same way.  Returns the group, or None."""
    if shared is None or shared is False or shared is True:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        dist = None
    if dist is not None and isinstance(shared, dist.ProcessGroup):
        return shared
    raise InvalidArgumentError(
        f"{where}: shared={shared!r}; give True, False or a "
        "torch.distributed process group", "E_INVAL")


def ask(h, shared, where: str) -> None:
    """Asks schedule `h` for a shared host copy if `shared` says so
    (before its load)."""
    group_of(shared, where)
    if shared:
        check(lib.laden_sched_share(h, b"laden-v1"))


def info(h, where: str = "stream_load") -> Optional[Shared]:
    """What the load of schedule `h` did about sharing (None: nothing).  A
    load asked to share whose segment's name was held by something else
    kept a private copy: one warning naming why, and None (its copy is its
    own, so nothing refuses writes to it)."""
    name = ctypes.create_string_buffer(64)
    n = ctypes.c_uint64()
    state = ctypes.c_int32()
    check(lib.laden_sched_share_info(h, name, 64, ctypes.byref(n),
                                     ctypes.byref(state)))
    if state.value == FELL_BACK:
        why = ctypes.create_string_buffer(512)
        check(lib.laden_sched_share_note(h, why, 512))
        log.warning("laden: %s: shared=True, but the host copy is not "
                    "shared: %s; loaded a private copy instead ('laden shm "
                    "list' shows the directory)", where,
                    why.value.decode(errors="replace"))
        return None
    how = STATES.get(state.value)
    return Shared(how, name.value.decode(), n.value) if how else None


def check_group(shared, got: Optional[Shared], where: str,
                failed: Optional[BaseException] = None) -> None:
    """With a process group: every rank of one host must have the same
    segment (the same checkpoint, loaded the same way); a rank that loaded
    another checkpoint, or the same one otherwise, is refused, on every
    rank, naming the ranks.  A collective call: every rank of the group
    calls it -- also one whose load failed (`failed`: it takes part, then
    raises its own error; the others raise naming it), so that no rank
    waits for it forever."""
    group = group_of(shared, where)
    if group is None:
        return
    import torch.distributed as dist

    mine = (socket.gethostname(), got.name if got else "",
            f"{type(failed).__name__}: {failed}" if failed else "")
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if failed is not None:
        return
    bad = [(r, e[2]) for r, e in enumerate(everyone) if e[2]]
    if bad:
        raise StateError(
            f"{where}: rank(s) of the group failed to load: "
            + "; ".join(f"rank {r}: {msg[:300]}" for r, msg in bad),
            "E_STATE")
    by_host = {}
    for rank, (host, name, _) in enumerate(everyone):
        by_host.setdefault(host, {}).setdefault(name, []).append(rank)
    for host, names in by_host.items():
        if len(names) > 1:
            parts = "; ".join(
                f"ranks {r}: " + (f"segment {n}" if n else "nothing shared")
                for n, r in names.items())
            raise MismatchError(
                f"{where}: the ranks on host {host} did not load the same "
                f"checkpoint the same way, so they cannot share one host "
                f"copy ({parts}); give every rank the same checkpoint, "
                "dtypes and budgets")


def segments_bytes(ck) -> int:
    """Bytes of this user's laden segments in LADEN_SHM_DIR (default
    /dev/shm) made from checkpoint `ck`'s files (laden_sched_shared_bytes:
    other models' segments are not counted): a shared load's reading,
    which C credits as free RAM (laden_plan_load_input says why)."""
    n = ctypes.c_uint64()
    check(lib.laden_sched_shared_bytes(ck._h, ctypes.byref(n)))
    return n.value


def refuse_writes(state, what: str) -> None:
    """StateError if `state`'s model has a shared host copy: `what` would
    write it, under the other processes' feet."""
    got = getattr(state, "shared", None)
    if got is not None:
        raise StateError(
            f"{what}: the model's host copy is shared with other processes "
            f"(shared=True, segment {got.name}), and laden never writes it "
            "after the load; load the model without shared=True to change "
            "its weights", "E_STATE")


# ---- the segments' directory (laden shm list / clean) -----------------------

KINDS = {0: "segment", 1: "being made", 2: "not laden's"}
SEG_STATES = {0: "filling", 1: "ready", 2: "failed"}


@dataclass(frozen=True)
class Segment:
    """A file at a laden name in the segments' directory
    (laden_shm_entry): ``kind`` "segment", "being made" (a maker's
    temporary file) or "not laden's" (``what`` says why; laden never opens
    or removes it); ``alive`` True if a live process holds it, False if
    none does (``laden shm clean`` removes it), None if unknown; the
    ``checkpoint`` it holds ("" if not known); ``age_s``."""

    name: str
    file_bytes: int
    data_bytes: int
    age_s: float
    kind: str
    alive: Optional[bool]
    state: Optional[str]
    creator_pid: int
    what: str
    checkpoint: str


def _segment(e) -> Segment:
    return Segment(
        e.name.decode(errors="replace"), e.file_bytes, e.data_bytes,
        e.age_ms / 1000.0, KINDS.get(e.kind, "?"),
        None if e.users < 0 else bool(e.users),
        SEG_STATES.get(e.state), e.creator_pid,
        e.what.decode(errors="replace"), e.label.decode(errors="replace"))


def directory() -> str:
    """The segments' directory as laden uses it (LADEN_SHM_DIR made
    absolute, default /dev/shm)."""
    buf = ctypes.create_string_buffer(4096)
    check(lib.laden_shm_dir(buf, 4096))
    return buf.value.decode(errors="replace")


def list_segments() -> List[Segment]:
    """The files at laden names in the directory (laden_shm_list)."""
    cap = 64
    while True:
        arr = (_lib.ShmEntry * cap)()
        n = ctypes.c_uint32()
        check(lib.laden_shm_list(arr, cap, ctypes.byref(n)))
        if n.value <= cap:
            return sorted((_segment(arr[i]) for i in range(n.value)),
                          key=lambda s: s.name)
        cap = n.value + 16  # more appeared meanwhile: again, with room


def reclaim() -> Tuple[List[Segment], int]:
    """Removes the segments no live process holds and the temporary files
    of makers that died (laden_shm_reclaim): what it removed, and the
    bytes.  (Every load of a checkpoint does the same.)"""
    cap = 1024
    arr = (_lib.ShmEntry * cap)()
    n = ctypes.c_uint32()
    nbytes = ctypes.c_uint64()
    check(lib.laden_shm_reclaim(arr, cap, ctypes.byref(n),
                                ctypes.byref(nbytes)))
    got = [_segment(arr[i]) for i in range(min(n.value, cap))]
    return sorted(got, key=lambda s: s.name), nbytes.value
