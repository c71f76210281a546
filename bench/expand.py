#!/usr/bin/env python3
"""Device expansion of compact weights (laden_expand, include/laden/expand.h)
on one CUDA device: for each format, a tensor of --mib MiB of output
(random valid bytes made on the device: GGUF f16 scale fields finite, fp8
from randn), expanded --repeats times on torch's current stream, timed with
CUDA events (median).  Prints per format: bytes read + written per second,
that over a device-to-device copy measured by torch in the same run
(dst.copy_(src), same bytes read and written), and over the device's peak
(--peak-tbs, 4.8 TB/s for an H200); the time torch takes to only write
the output's bytes (dst.fill_) over the kernel's time (the low-bit formats
read a fraction of what they write, so their bound is the write, and
"/copy" understates them); and whether the device result equals
laden's CPU result for the same bytes (a prefix and a suffix of the tensor,
compared with torch.equal).  Prints; asserts nothing.  Exits 1 without CUDA
or when the device cannot expand (saying why).

    python bench/expand.py [--mib 256] [--repeats 20] [--device 0]
                           [--peak-tbs 4.8] [--check-mib 16]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

import laden  # noqa: F401  (loads libladen)
from laden._lib import lib, error_for

# (name, laden dtype name, scale kind, cols) in the order printed.
FORMATS = [
    ("fp8 e4m3, row scale", "F8_E4M3", 2, 7168),
    ("fp8 e4m3, 128x128 tile scale", "F8_E4M3", 3, 7168),
    ("fp8 e5m2, row scale", "F8_E5M2", 2, 7168),
    ("Q8_0", "Q8_0", 0, 0),
    ("Q4_0", "Q4_0", 0, 0),
    ("Q4_1", "Q4_1", 0, 0),
    ("Q5_0", "Q5_0", 0, 0),
    ("Q5_1", "Q5_1", 0, 0),
    ("Q2_K", "Q2_K", 0, 0),
    ("Q3_K", "Q3_K", 0, 0),
    ("Q4_K", "Q4_K", 0, 0),
    ("Q5_K", "Q5_K", 0, 0),
    ("Q6_K", "Q6_K", 0, 0),
]
# The byte offsets of each block type's f16 scale fields.
SCALE_FIELDS = {"Q4_0": [0], "Q8_0": [0], "Q5_0": [0], "Q4_1": [0, 2],
                "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
                "Q2_K": [80, 82], "Q3_K": [108], "Q6_K": [208]}
SCALE_NONE, SCALE_TENSOR, SCALE_ROW, SCALE_TILE128 = 0, 1, 2, 3


def dtype_codes() -> dict:
    from laden._describe import _DTYPE_CODE

    return dict(_DTYPE_CODE)


def nvrtc_path():
    """The NVRTC that torch's CUDA wheels bring, as laden finds it."""
    from laden._expand import _nvrtc_path

    return _nvrtc_path()


def block(code: int):
    e, b = ctypes.c_uint32(), ctypes.c_uint32()
    s = lib.laden_dtype_block(code, ctypes.byref(e), ctypes.byref(b))
    if s:
        raise error_for(s)
    return e.value, b.value


def expand(dev, code, src, n, cols, scale, kind, dcode, dst, stream=0):
    s = lib.laden_expand(dev, stream, code, src.data_ptr(), src.numel(), n,
                         cols, scale.data_ptr() if scale is not None else 0,
                         kind, dcode, dst.data_ptr())
    if s:
        raise error_for(s)


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() on the current stream, by CUDA events."""
    fn()
    fn()
    ts = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def make_case(fmt, codes, out_elems: int, dev):
    """(src uint8 on the device, n, cols, scale or None, rows)."""
    name, dname, kind, cols = fmt
    g = torch.Generator(device=dev).manual_seed(1234)
    if dname.startswith("F8"):
        rows = out_elems // cols
        n = rows * cols
        dt = torch.float8_e5m2 if dname == "F8_E5M2" else torch.float8_e4m3fn
        q = (torch.randn(rows, cols, device=dev, generator=g) * 64).to(dt)
        if kind == SCALE_ROW:
            scale = torch.rand(rows, device=dev, generator=g) * 1e-3 + 1e-4
        else:
            scale = (torch.rand((rows + 127) // 128, (cols + 127) // 128,
                                device=dev, generator=g) * 1e-3 + 1e-4)
        return q.view(torch.uint8).reshape(-1), n, cols, scale, rows
    be, bb = block(codes[dname])
    nblocks = out_elems // be
    src = torch.randint(0, 256, (nblocks, bb), dtype=torch.uint8, device=dev,
                        generator=g)
    for off in SCALE_FIELDS[dname]:
        hi = src[:, off + 1]
        src[:, off + 1] = torch.where((hi & 0x7c) == 0x7c, hi & 0xbf, hi)
    return src.reshape(-1), nblocks * be, 0, None, 0


def spot_check(fmt, codes, src, n, cols, scale, rows, dcode, dst, tdt,
               check_elems: int) -> str:
    """Whether a prefix and a suffix of the device result equal laden's CPU
    result for the same bytes."""
    name, dname, kind, _ = fmt
    code = codes[dname]
    if dname.startswith("F8"):
        unit = cols * (128 if kind == SCALE_TILE128 else 1)  # whole rows/tiles
        k = max(unit, check_elems // unit * unit)
        k = min(k, n // unit * unit)
        parts = [(0, k), ((n - k) // unit * unit, n)]
    else:
        be, bb = block(code)
        k = max(be, min(n, check_elems) // be * be)
        parts = [(0, k), (n - k, n)]
    checked = sum(b - a for a, b in parts)
    for a, b in parts:
        if dname.startswith("F8"):
            q = src[a:b].cpu()
            if kind == SCALE_ROW:
                sc = scale[a // cols:b // cols].cpu().contiguous()
            else:
                sc = scale[a // cols // 128:(b // cols + 127) // 128].cpu()
                sc = sc.contiguous()
        else:
            be, bb = block(code)
            q = src[a // be * bb:b // be * bb].cpu()
            sc = None
        want = torch.empty(b - a, dtype=tdt)
        expand(-1, code, q, b - a, cols, sc, kind, dcode, want)
        if not torch.equal(dst[a:b].cpu().view(torch.int16),
                           want.view(torch.int16)):
            diff = (dst[a:b].cpu().view(torch.int16) !=
                    want.view(torch.int16)).nonzero()
            return (f"DIFFERS from the CPU at element {a + int(diff[0])} "
                    f"({len(diff)} of {b - a} in [{a}, {b}))")
    return f"equal to the CPU ({checked} elements checked)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256,
                    help="MiB of output per tensor (default 256)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--peak-tbs", type=float, default=4.8,
                    help="the device's peak memory bandwidth, TB/s")
    ap.add_argument("--check-mib", type=int, default=16,
                    help="MiB of output compared with the CPU, at each end")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/expand.py needs a CUDA device: torch sees none")
        return 1
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    codes = dtype_codes()
    path = nvrtc_path()
    if path:
        lib.laden_expand_set_nvrtc(path.encode())
    t0 = time.perf_counter()
    s = lib.laden_expand_ready(a.device)
    ready_s = time.perf_counter() - t0
    text = ctypes.create_string_buffer(2048)
    lib.laden_expand_describe(a.device, text, len(text))
    if s:
        print(f"cuda:{a.device} cannot expand: {text.value.decode()}")
        return 1
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); NVRTC given: {path or 'none found'}")
    print(f"kernels: {text.value.decode()}")
    print(f"laden_expand_ready: {ready_s * 1e3:.0f} ms (first use: load "
          "NVRTC, compile, load the module)")

    # The reference: a device-to-device copy of the output's size.
    nbytes = a.mib << 20
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    x.random_(0, 256)
    t = timed(lambda: y.copy_(x), a.repeats)
    copy_bps = 2 * nbytes / t
    t_fill = timed(lambda: y.fill_(1), a.repeats)
    del x, y
    peak = a.peak_tbs * 1e12
    print(f"torch copy_ of {a.mib} MiB device to device: "
          f"{copy_bps / 1e9:.0f} GB/s read+written "
          f"({copy_bps / peak:.0%} of {a.peak_tbs} TB/s)")
    print(f"torch fill_ of {a.mib} MiB (only written): {t_fill * 1e3:.3f} ms, "
          f"{nbytes / t_fill / 1e9:.0f} GB/s")
    print(f"laden_expand, {a.mib} MiB of output each, median of "
          f"{a.repeats}:")
    print(f"{'format':<30} {'to':<5} {'read MiB':>9} {'time ms':>8} "
          f"{'GB/s':>6} {'/copy':>6} {'/peak':>6} {'fill/t':>6}  check")
    rows = [(f, "BF16") for f in FORMATS]
    rows.append((FORMATS[10], "F16"))  # Q4_K to F16
    rows.append((FORMATS[0], "F16"))   # fp8 row to F16
    stream = torch.cuda.current_stream(dev).cuda_stream
    for fmt, dname in rows:
        tdt = torch.bfloat16 if dname == "BF16" else torch.float16
        dcode = codes[dname]
        out_elems = nbytes // 2
        src, n, cols, scale, nrows = make_case(fmt, codes, out_elems, dev)
        dst = torch.empty(n, dtype=tdt, device=dev)
        code = codes[fmt[1]]
        t = timed(lambda: expand(a.device, code, src, n, cols, scale, fmt[2],
                                 dcode, dst, stream), a.repeats)
        read = src.numel() + (scale.numel() * 4 if scale is not None else 0)
        moved = read + dst.numel() * dst.element_size()
        bps = moved / t
        check = spot_check(fmt, codes, src, n, cols, scale, nrows, dcode, dst,
                           tdt, (a.check_mib << 20) // 2)
        print(f"{fmt[0]:<30} {dname:<5} {read / 2**20:>9.1f} {t * 1e3:>8.3f} "
              f"{bps / 1e9:>6.0f} {bps / copy_bps:>6.0%} {bps / peak:>6.0%}"
              f" {t_fill * dst.numel() * dst.element_size() / nbytes / t:>6.0%}"
              f"  {check}")
        del src, dst, scale
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
