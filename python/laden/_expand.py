"""Compact tensors (fp8 with scales, GGUF blocks, bf16 storage) expanded
into the dtype their block runs in: by torch's kernels, or by C in one
pass (laden_expand; on CUDA, a kernel compiled by NVRTC)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

from ._devices import _compute_stream, _dev_index
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


_SCALE_KIND = {None: 0, "tensor": 1, "row": 2, "block": 3}


def expand_fused(out, q, scale, kind: Optional[str], code: int, dcode: int,
                 device) -> Callable[[], None]:
    """What fills out (the block's workspace) with the compact tensor q
    expanded by C in one pass on the device's current stream
    (laden_expand): GGUF blocks, fp8 times its scale (a scale without a
    kind is one per row: laden's own fp8 storage), bf16 widened.  On the
    CPU device the same C code runs in the calling thread.  The arguments
    are worked out once here; each call reads only the current stream."""
    expand, stream = lib.laden_expand, _compute_stream
    dev = _dev_index(device)
    args = (code, q.data_ptr(), q.numel() * q.element_size(), out.numel(),
            out.shape[-1] if out.dim() else 1,
            scale.data_ptr() if scale is not None else 0,
            _SCALE_KIND[kind or "row"] if scale is not None else 0, dcode,
            out.data_ptr())

    def run() -> None:
        s = expand(dev, stream(device), *args)
        if s:
            raise error_for(s) from None

    run.keep = (out, q, scale)  # the memory the pointers are in
    return run
