"""Compact tensors (fp8 with scales, GGUF blocks, bf16 storage) are
expanded into the dtype their block runs in by C, at the block's enter
(laden_sched_enter runs laden_expand; on CUDA, a kernel compiled by
NVRTC).  Here: where NVRTC is (torch's CUDA wheels bring it), whether a
device expands, and expand_fp8, torch's form of the same values (the
reference the tests hold C's against)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

from ._devices import _dev_index, _device
from ._lib import error_for, lib

log = logging.getLogger("laden")


def expand_fp8(out, q, scale, kind: Optional[str]) -> None:
    """out = q x scale in out's dtype, rounded once (the product is formed
    in float32): the dequantized form laden runs with."""
    out.copy_(q)
    if scale is None:
        return
    if kind == "row" or kind is None:
        out.mul_(scale.reshape(-1, 1))
    elif kind == "tensor":
        out.mul_(scale.reshape(()))
    else:
        r, c = out.shape
        full = scale.repeat_interleave(128, 0)[:r].repeat_interleave(
            128, 1)[:, :c]
        out.mul_(full)


_NVRTC_SET = False
_NVRTC_LOCK = threading.Lock()


def _nvrtc_path() -> Optional[str]:
    """The NVRTC library that torch's CUDA wheels bring, if any: in
    nvidia/*/lib beside torch (CUDA 12: cuda_nvrtc, 13: cu13) or in
    torch/lib; the one of torch's CUDA major version first."""
    import glob
    import sys

    import torch

    major = (torch.version.cuda or "").split(".")[0]
    found = []
    for root in sys.path:
        found += glob.glob(os.path.join(root, "nvidia", "*", "lib",
                                        "libnvrtc.so*"))
    found += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib",
                                    "libnvrtc*.so*"))
    found = [f for f in found if "builtins" not in os.path.basename(f)]
    found.sort(key=lambda f: (f".so.{major}" not in f, len(f)))
    return found[0] if found else None


def expand_unavailable(device) -> Optional[str]:
    """None if compact tensors (GGUF block types) can be expanded where
    `device` runs blocks, else why not (they are then expanded on load)."""
    global _NVRTC_SET
    device = _device(device)  # "cuda" means the current one
    if device.type != "cuda":
        return None
    if not hasattr(lib, "laden_expand_ready"):
        return "this libladen has no device expansion"
    with _NVRTC_LOCK:  # the path set before any thread's first compile
        if not _NVRTC_SET:
            path = _nvrtc_path()
            if path:
                s = lib.laden_expand_set_nvrtc(path.encode())
                if s:
                    log.warning("laden: NVRTC %s: %s", path, error_for(s))
            _NVRTC_SET = True
    s = lib.laden_expand_ready(_dev_index(device))
    return str(error_for(s)) if s else None
