#!/usr/bin/env python3
"""Training through streamed blocks (issue 17): one forward + backward of
the synthetic bf16 transformer of bench/stream.py (default 24 blocks of
hidden 4096: 9.66 GB) at --tokens tokens, every block streamed from pinned
RAM (install_offload(train=True), lookahead 2), all weights trainable:
gradients leave the device block by block into the host copies' .grad
(bf16).  Against the same model all resident on the device (plain
autograd) in the same process, and the ideal: max(the resident forward x 2
+ backward (the recomputation), the bytes over the link: the weights go up
twice (forward, then backward in reverse), their gradients come down once,
at the copy rates measured here).  Also the LoRA-style case: streamed
weights frozen, gradients only for the input.  Prints; asserts nothing.

    python bench/train.py [--blocks 24 --hidden 4096] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
import stream as sb  # noqa: E402


def step_ms(fn, repeats):
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[1:])
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    a.device = torch.device("cuda", 0)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}.safetensors")
    if not os.path.exists(path):
        sb.write_checkpoint(a, path)
    h2d = d2h = None
    from laden._lib import lib, COPY_H2D_PINNED, COPY_D2H_PINNED
    import ctypes
    for kind in (COPY_H2D_PINNED, COPY_D2H_PINNED):
        r = ctypes.c_double()
        lib.laden_dev_measure_copy(0, kind, 256 << 20, 8, ctypes.byref(r))
        if kind == COPY_H2D_PINNED:
            h2d = r.value
        else:
            d2h = r.value
    x = torch.randn(1, a.tokens, a.hidden, device=a.device,
                    dtype=torch.bfloat16)
    print(f"model: {a.blocks} blocks of hidden {a.hidden}, {a.tokens} "
          f"tokens, bf16; pinned H2D {h2d / 1e9:.1f} GB/s, D2H "
          f"{d2h / 1e9:.1f} GB/s")

    # Resident: plain autograd.
    m = sb.build_meta(a)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=a.device,
                      resident_prefixes=["blocks."], progress=False)
    xr = x.clone().requires_grad_(True)

    def fwd_bwd_plain():
        for p in m.parameters():
            p.grad = None
        m(xr).float().pow(2).mean().backward()

    for p in m.parameters():
        p.requires_grad_(True)
    t_res = step_ms(fwd_bwd_plain, a.repeats)
    with torch.no_grad():
        t_fwd = step_ms(lambda: m(x), a.repeats)
    wbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    laden.release(m)
    del m
    gc.collect()
    torch.cuda.empty_cache()

    rows = []
    for frozen in (False, True):
        m = sb.build_meta(a)
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device=a.device, lookahead=2, progress=False)
        for p in m.parameters():
            p.requires_grad_(not frozen)
        h = laden.install_offload(m, train=True)
        params = list(h.parameters())

        def fwd_bwd():
            for p in params:
                p.grad = None
            xr.grad = None
            m(xr).float().pow(2).mean().backward()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        s0 = h.stats()
        t = step_ms(fwd_bwd, a.repeats)
        s1 = h.stats()
        peak = torch.cuda.max_memory_allocated() - base
        n = a.repeats + 1
        up = (s1["h2d_bytes"] - s0["h2d_bytes"]) / n
        down = 0 if frozen else wbytes
        ideal = max(2 * t_fwd + (t_res - t_fwd),
                    1e3 * max(up / h2d, down / d2h))
        rows.append(("frozen weights (LoRA-style)" if frozen
                     else "all weights train", t, ideal, up, down, peak,
                     s1["device_bytes"], s1["misses"] - s0["misses"]))
        laden.release(m, h)
        del m, h, params
        gc.collect()
        torch.cuda.empty_cache()

    print(f"resident forward {t_fwd:.1f} ms, forward+backward "
          f"{t_res:.1f} ms; weights {wbytes / 1e9:.2f} GB")
    print(f"{'streamed, train=True':<30} {'ms':>8} {'ideal':>8} {'x':>6} "
          f"{'up GB':>7} {'down GB':>8} {'torch peak GB':>14} "
          f"{'laden dev GB':>13} {'misses':>7}")
    for name, t, ideal, up, down, peak, dev, miss in rows:
        print(f"{name:<30} {t:>8.1f} {ideal:>8.1f} {t / ideal:>6.2f} "
              f"{up / 1e9:>7.2f} {down / 1e9:>8.2f} {peak / 1e9:>14.2f} "
              f"{dev / 1e9:>13.2f} {miss / (a.repeats + 1):>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
