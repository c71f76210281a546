"""GPU tests: laden's device layer works in PyTorch's primary context and
on PyTorch's streams.  Skipped without CUDA."""

import ctypes

import pytest
import torch

import laden
from laden._lib import check, lib

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA")


def test_copy_into_torch_memory_on_torch_stream():
    n = 1 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    s = ctypes.c_void_p()
    handle = torch.cuda.current_stream().cuda_stream
    check(lib.laden_dev_stream_wrap(0, handle, ctypes.byref(s)))
    try:
        check(lib.laden_dev_copy_h2d(s, dst.data_ptr(),
                                     ctypes.c_void_p(src.data_ptr()), n))
        # Ordered on torch's stream: no synchronize needed before torch
        # reads it on the same stream.
        assert torch.equal(dst.cpu(), src)
    finally:
        lib.laden_dev_stream_destroy(s)


def test_laden_memory_is_visible_to_torch():
    n = 4096
    ptr = ctypes.c_uint64()
    check(lib.laden_dev_mem_alloc(0, n, ctypes.byref(ptr)))
    s = ctypes.c_void_p()
    check(lib.laden_dev_stream_create(0, ctypes.byref(s)))
    try:
        src = torch.arange(n, dtype=torch.int32).to(torch.uint8)
        check(lib.laden_dev_copy_h2d(s, ptr.value,
                                     ctypes.c_void_p(src.data_ptr()), n))
        check(lib.laden_dev_stream_synchronize(s))

        class View:  # the device memory as torch sees it, no copy
            __cuda_array_interface__ = {
                "shape": (n,), "typestr": "|u1",
                "data": (ptr.value, False), "version": 3}
        t = torch.as_tensor(View(), device="cuda")
        assert t.data_ptr() == ptr.value
        assert torch.equal(t.cpu(), src)
    finally:
        lib.laden_dev_stream_destroy(s)
        check(lib.laden_dev_mem_free(0, ptr.value))


def test_read_into_pinned_then_upload(tmp_path):
    x = torch.randn(512, 1024)
    p = str(tmp_path / "m.safetensors")
    laden.save_file({"x": x}, p)
    with laden.open(p) as ck:
        pinned = torch.empty_like(x).pin_memory()
        ck.read_into("x", pinned)
        assert torch.equal(pinned.to("cuda", non_blocking=True).cpu(), x)


def test_pinned_pool_reload_pins_nothing_anew(tmp_path):
    """Released and loaded again in one process with a pinned pool: the
    RAM-tier blocks take back the pinned memory the first load left, and
    the second load computes the same outputs."""
    import laden
    from test_streaming import _Wide

    torch.manual_seed(0)
    ref = _Wide().eval()
    path = str(tmp_path / "wide.safetensors")
    laden.save_file(dict(ref.state_dict()), path)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.cuda()(x.cuda())
    before = laden.set_pinned_pool("1GB", device="cuda")
    try:
        outs = []
        for _ in range(2):
            with torch.device("meta"):
                m = _Wide().eval()
            laden.stream_load(m, path, offload_prefixes=["blocks."],
                              device="cuda")  # streamed from pinned RAM
            laden.install_offload(m)
            with torch.no_grad():
                outs.append(m(x.cuda()))
            laden.release(m)
        after = laden.set_pinned_pool("1GB", device="cuda")
        assert after["kept_bytes"] - before["kept_bytes"] >= 40 << 20
        assert after["reused_bytes"] - before["reused_bytes"] >= 40 << 20
        for o in outs:
            torch.testing.assert_close(o, want)
    finally:
        laden.set_pinned_pool(0, device="cuda")
