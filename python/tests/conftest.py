import os

import pytest
import torch


@pytest.fixture
def make_tensors():
    """A dict of small tensors covering the dtypes torch and safetensors
    share, with random contents (never zeros)."""
    def make(seed=0):
        g = torch.Generator().manual_seed(seed)
        t = {
            "embed.weight": torch.randn(7, 5, generator=g),
            "blocks.0.w": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "blocks.1.w": torch.randn(4, 3, generator=g).to(torch.float16),
            "blocks.1.idx": torch.randint(-9, 9, (6,), generator=g),
            "mask": torch.rand(5, generator=g) > 0.5,
            "bytes": torch.randint(0, 255, (9,), generator=g,
                                   dtype=torch.uint8),
            "scalar": torch.tensor(3.25, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "i32": torch.randint(-5, 5, (2, 2), generator=g,
                                 dtype=torch.int32),
        }
        if hasattr(torch, "float8_e4m3fn"):
            t["fp8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)
            t["fp8b"] = torch.randn(8, generator=g).to(torch.float8_e5m2)
        return t
    return make


def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.fixture
def data_dir():
    return os.path.join(os.path.dirname(__file__), "..", "..", "tests",
                        "data")
