"""Mixture-of-experts layers as PyTorch shows them: which modules hold a
layer's experts, and which experts a call of one is routed to.

A transformers experts module (``MixtralExperts``, ``Qwen3MoeExperts``,
``DeepseekV3Experts``, ``GptOssExperts`` ...) holds every expert of its
layer in fused tensors whose first dimension is the expert, and is called
as ``experts(hidden_states, expert_indices, weights)`` after the router
picked.  laden makes such a module a block of its own whose rows move per
call (C: laden_sched_set_experts, laden_sched_enter_experts); here it is
only found and its call read.  Nothing here decides or moves memory.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

from .errors import StateError

__all__ = ["expert_modules", "routed"]


def _experts_of(mod) -> int:
    """The number of experts `mod` holds fused (0: not an experts
    module): a module named ``*Experts`` with an integer ``num_experts``
    whose own parameters all have that many rows."""
    n = getattr(mod, "num_experts", None)
    if not type(mod).__name__.endswith("Experts") or \
            not isinstance(n, int) or n < 1:
        return 0
    params = list(mod.named_parameters(recurse=False))
    if not params or any(p.dim() < 1 or p.shape[0] != n for _, p in params):
        return 0
    if any(True for c in mod.children() for _ in c.parameters()):
        return 0  # weights in submodules (not rows alone); an activation
                  # module holds none
    return n


def expert_modules(block) -> Iterator[Tuple[str, object, int]]:
    """(path inside `block` with a trailing dot, module, experts) of every
    experts module in `block`."""
    for name, mod in block.named_modules():
        if name:
            n = _experts_of(mod)
            if n:
                yield name + ".", mod, n


def routed(args, kwargs, experts: int, where: str):
    """The experts a call of an experts module is routed to, as C takes
    them (laden_sched_enter_experts: any order, repeats allowed): its
    index tensor (the first integer tensor after the hidden states) on
    the host as int32, without the values outside [0, experts) (an index
    of `experts` or more is a padding slot some layers use).  Reading it
    waits for the router on a GPU: the copies depend on it.  One copy to
    the host and no kernel on the device (torch.unique sorted there first:
    its kernels and second wait cost ~0.1 ms a layer on the H200)."""
    import torch

    rest = list(args[1:]) + list(kwargs.values())
    idx = next((a for a in rest if isinstance(a, torch.Tensor)
                and not a.is_floating_point() and not a.is_complex()),
               None)
    if idx is None:
        raise StateError(
            f"{where}: called without the experts' indices (an integer "
            "tensor after the hidden states): laden moves the rows of "
            "the experts it is routed to and cannot tell which",
            "E_STATE")
    host = idx.detach().reshape(-1).to("cpu")
    host = host[(host >= 0) & (host < experts)]
    return host.to(torch.int32).contiguous()
