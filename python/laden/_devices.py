"""Devices as laden names them: a torch.device from the user's word, C's
device index, the handle of the current CUDA stream."""

from __future__ import annotations

from . import _lib
from .errors import InvalidArgumentError


def _device(device) -> "torch.device":
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # The current device; before CUDA is initialized that is 0 (asking
        # torch would initialize it, which install_elastic must come before).
        device = torch.device("cuda", torch.cuda.current_device()
                              if torch.cuda.is_initialized() else 0)
    if device.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(
            f"device {device}: laden streams to CUDA devices and the CPU",
            "E_INVAL")
    return device


def _dev_index(device) -> int:
    return device.index if device.type == "cuda" else _lib.DEVICE_CPU


_RAW_STREAM = None


def _compute_stream(device) -> int:
    """The handle of the current CUDA stream of `device` (0 on the CPU).
    On every block call: torch's raw getter when it has one (a fraction of
    a microsecond; torch.cuda.current_stream builds a Python object)."""
    global _RAW_STREAM
    if device.type != "cuda":
        return 0
    if _RAW_STREAM is None:
        import torch

        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", False)
    if _RAW_STREAM:
        return _RAW_STREAM(device.index)
    import torch

    return torch.cuda.current_stream(device).cuda_stream
