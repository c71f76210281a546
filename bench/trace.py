#!/usr/bin/env python3
"""What tracing costs and what a trace shows, on one streamed model.

The synthetic transformer of bench/stream.py (default 24 blocks, 9.66 GB
bf16) streams every block from pinned RAM (lookahead 2).  Measured in one
run:
  off / on      ms per forward without and with laden.trace around the
                forwards (interleaved repeats, medians)
  copy lane     from the trace: the share of the time from the first copy
                to the last that the copy stream was busy, the copy rate
                while busy against the pinned H2D rate measured here
  activations   laden.measure_activation_vram against the trace's counters
                of PyTorch's allocator
It writes the trace and its timeline picture (laden trace show -o).
Prints tables; asserts nothing.

    python bench/trace.py [--tokens 2048] [--out bench/out/trace]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
from laden import _lib, traceview  # noqa: E402
from stream import build_meta, print_table, synth_checkpoint  # noqa: E402


def forwards(m, x, n):
    with torch.no_grad():
        for _ in range(n):
            out = m(x)
    return out


def timed(m, x, n, dev):
    """Milliseconds per forward over n forwards back to back."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        forwards(m, x, n)
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / n
    t0 = time.perf_counter()
    forwards(m, x, n)
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--forwards", type=int, default=4,
                    help="forwards per timed run")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "trace"),
                    help="where the trace and the picture go")
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(a.device)
    os.makedirs(a.out, exist_ok=True)
    path = synth_checkpoint(a)
    model_bytes = laden.open(path).total_bytes
    link = None
    if dev.type == "cuda":
        rate = ctypes.c_double()
        _lib.check(_lib.lib.laden_dev_measure_copy(
            dev.index or 0, _lib.COPY_H2D_PINNED, 256 << 20, 20,
            ctypes.byref(rate)))
        link = rate.value

    m = build_meta(a)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=dev)
    h = laden.install_offload(m, lookahead=2)
    x = torch.randn(1, a.tokens, a.hidden, dtype=torch.bfloat16, device=dev,
                    generator=torch.Generator(device=dev).manual_seed(0))
    forwards(m, x, 2)  # warm
    s0 = h.stats()
    off, on = [], []
    scratch = os.path.join(a.out, "repeat.json")
    for _ in range(a.repeats):
        off.append(timed(m, x, a.forwards, dev))
        with laden.trace(scratch):
            on.append(timed(m, x, a.forwards, dev))
    off.sort()
    on.sort()
    ms_off, ms_on = off[len(off) // 2], on[len(on) // 2]
    os.remove(scratch)

    # The trace kept: forwards back to back, then the activations.
    tpath = os.path.join(a.out, "trace.json")
    with laden.trace(tpath) as t:
        with t.range("forwards"):
            timed(m, x, a.forwards, dev)
    st = h.stats()
    data = traceview.load(tpath)
    summ = traceview.summarize(data, link / 1e9 if link else None)
    apath = os.path.join(a.out, "activations.json")
    with laden.trace(apath):
        act = laden.measure_activation_vram(lambda: forwards(m, x, 1))
    counters = traceview.load(apath).counters
    alloc = [v for _, v in counters.get(
        f"cuda:{dev.index or 0} torch_allocated_bytes", [])]
    peak = [v for _, v in counters.get(
        f"cuda:{dev.index or 0} torch_peak_bytes", [])]
    png = os.path.join(a.out, "timeline.png")
    # the picture: one forward, as a reader would look at it
    one = os.path.join(a.out, "one_forward.json")
    with laden.trace(one):
        timed(m, x, 1, dev)
    try:
        traceview.plot(traceview.load(one), png,
                       link / 1e9 if link else None,
                       title=f"one streamed forward: {a.blocks} blocks, "
                       f"{model_bytes / 1e9:.2f} GB from pinned RAM, "
                       f"{a.tokens} tokens")
    except laden.InvalidArgumentError as e:
        png = f"(not drawn: {e})"
    laden.release(m, h)

    streamed = model_bytes  # every block streams
    ideal = streamed / link * 1e3 if link else 0.0
    print(f"\ntracing cost: {a.blocks} blocks, {model_bytes / 1e9:.2f} GB, "
          f"{a.tokens} tokens, {a.forwards} forwards x {a.repeats} repeats "
          f"on {dev}")
    rows = [["", "ms/forward", "vs off", "vs link ideal"]]
    for name, ms in (("tracing off", ms_off), ("tracing on", ms_on)):
        rows.append([name, f"{ms:.1f}", f"{ms / ms_off:.3f}",
                     f"{ms / ideal:.3f}" if ideal else "-"])
    print_table(rows)
    print(f"\ntracing on costs {100 * (ms_on / ms_off - 1):+.2f}% "
          f"(median of {a.repeats})")
    print(f"\nfrom the trace ({tpath}):")
    print(summ.text())
    print(f"\ncopy lane busy: {100 * summ.copy_busy:.1f}% of the time from "
          f"the first copy to the last")
    if alloc and peak:
        base = alloc[0]
        print(f"activations: measure_activation_vram {act / 1e6:.2f} MB; "
              f"trace: peak {peak[-1] / 1e6:.2f} MB over {base / 1e6:.2f} MB "
              f"at the first entry = {(peak[-1] - base) / 1e6:.2f} MB")
    print(f"counters: enters {st['enters'] - s0['enters']}, h2d "
          f"{(st['h2d_bytes'] - s0['h2d_bytes']) / 1e9:.2f} GB over the run")
    print(f"timeline: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
