"""laden: run PyTorch models larger than GPU memory by moving weights
between disk, host RAM and VRAM at the speed of the hardware.

The engine is the C library libladen; this package attaches it to PyTorch.
"""

from __future__ import annotations

from ._lib import lib as _clib
from . import gguf, vbar
from ._writer import save_file
from .cache import (CacheInfo, ModelCache, ModelNotFoundError, ModelOffloader,
                    ModelSpec)
from .checkpoint import Checkpoint, Reader, TensorInfo, default_reader, open
from .compile import BlockCompile
from .graphs import CapturedForward
from .errors import (BudgetError, CheckpointNotFoundError, DeviceError,
                     FormatError, InvalidArgumentError, LadenError,
                     MismatchError, OutOfMemoryError, ReadError, StateError,
                     TensorNotFoundError)
from .adapters import AdapterError, AdapterSpec, merge_adapter
from .hf import (PipelineHandle, find_blocks, from_pretrained,
                 offload_pipeline)
from .planning import Plan, PlanBlock, Tier, measure_activation_vram, plan
from .streaming import (CompressReport, LoadReport, OffloadHandle, compress,
                        install_offload,
                        offload_blocks, release, set_pinned_pool, stage,
                        stream_load, wait)
from .trace import Trace, trace

__version__ = _clib.laden_version().decode()

__all__ = [
    "BlockCompile", "CapturedForward",
    "Checkpoint", "Reader", "TensorInfo", "default_reader", "open",
    "save_file", "from_pretrained", "find_blocks",
    "AdapterSpec", "AdapterError", "merge_adapter",
    "offload_pipeline", "PipelineHandle", "plan", "Plan", "PlanBlock", "Tier", "stage",
    "measure_activation_vram", "stream_load", "compress", "CompressReport", "install_offload", "offload_blocks",
    "release", "wait", "set_pinned_pool", "LoadReport", "ModelCache", "ModelSpec", "ModelOffloader",
    "CacheInfo", "ModelNotFoundError", "vbar", "OffloadHandle", "MismatchError", "LadenError", "FormatError", "CheckpointNotFoundError",
    "ReadError", "TensorNotFoundError", "OutOfMemoryError", "BudgetError",
    "DeviceError", "InvalidArgumentError", "StateError", "trace", "Trace",
    "__version__",
]
