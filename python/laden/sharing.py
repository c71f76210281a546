"""One host copy of a model for the processes of a host (issue 19).

``stream_load(..., shared=True)``, ``from_pretrained(..., shared=True)``
and ``ModelSpec(..., shared=True)`` ask laden's C layer
(``laden_sched_share``) to put the model's host copy -- the blocks that
live in host memory: the RAM tier, and on the CPU device the resident part
too -- in shared memory named from what determines its bytes (the
checkpoint files' identities, every tensor's place, dtype and conversion).
The first process loads it; the others that load the same checkpoint the
same way attach and read nothing; each pins it with its own CUDA context;
the last to release removes it.  Here: the call, what it did, and the
check across a process group.
"""

from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass
from typing import Optional

from . import _lib
from ._lib import check, lib
from .errors import InvalidArgumentError, MismatchError, StateError

STATES = {0: None, 1: "made", 2: "attached"}


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


def info(h) -> Optional[Shared]:
    """What the load of schedule `h` did about sharing (None: nothing)."""
    name = ctypes.create_string_buffer(64)
    n = ctypes.c_uint64()
    state = ctypes.c_int32()
    check(lib.laden_sched_share_info(h, name, 64, ctypes.byref(n),
                                     ctypes.byref(state)))
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
    other models' segments are not counted).  A later process plans its
    RAM tier with these counted as free: the free-memory reading drops by
    a segment's size once the first process made it, and without that
    credit a later process would plan fewer RAM-tier blocks, get another
    layout and share nothing.  (An explicit ram_budget gives every process
    the same plan anyway.)"""
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
