#!/usr/bin/env python3
"""Loading a checkpoint into host memory or the GPU: laden against
safetensors and the drive, cold (page cache dropped) and warm (file in the
page cache), in one run on one machine.

A synthetic bf16 transformer checkpoint (bench/stream.py's; default 24
blocks, hidden 4096, MLP 16384 = 9.66 GB with --device cuda, 16 blocks of
hidden 2048 = 1.61 GB on the CPU) is written once, then loaded by:
  laden RAM tier      stream_load(offload_prefixes=["blocks."]): pinned RAM
  laden resident      stream_load(): every weight on the device
  laden cache         ModelCache first use of the model built on meta
  load_file           safetensors.torch.load_file (CPU tensors)
  load_file + copy    ... then a copy of every tensor (CPU)
  load_file + pin     ... then pin_memory() of every tensor (CUDA)
  load_file(cuda)     load_file(device="cuda")
  dd / laden read     the drive: one O_DIRECT stream, and laden's reader
                      pool (O_DIRECT, several reads in flight)
Cold: the file's pages dropped before each load (as root also every clean
page: `echo 3 > /proc/sys/vm/drop_caches`).  Prints tables; asserts
nothing.

    python bench/load.py [--device cuda|cpu] [--repeats 2]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
from laden import _lib  # noqa: E402
import stream as sb  # noqa: E402  bench/stream.py: the synthetic model


def drop(path: str) -> None:
    """The file's pages out of the page cache (written out, then
    posix_fadvise DONTNEED).  Not `echo 3 > drop_caches`: that drops the
    code pages of Python and torch too, whose re-reading would be charged
    to whichever load came first."""
    sb.drop_cache(path)


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev):
    """Seconds fn() takes until its data is in place (its release, the
    callable it returns second, is not timed), and its first result."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    out, release = fn()
    sync(dev)
    t = time.perf_counter() - t0
    release()
    gc.collect()
    return t, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available()
                    else "cpu")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--mlp", type=int, default=None)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2,
                    help="loads per configuration and state (best kept)")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--laden-only", action="store_true",
                    help="skip the safetensors loads (peers measured "
                    "before, in the same session)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    a.blocks = a.blocks or (24 if gpu else 16)
    a.hidden = a.hidden or (4096 if gpu else 2048)
    a.mlp = a.mlp or 4 * a.hidden
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}"
                        ".safetensors")
    if not os.path.exists(path):
        print(f"writing {path} ...", flush=True)
        a.device = dev
        sb.write_checkpoint(a, path)
    size = os.path.getsize(path)
    from safetensors.torch import load_file

    def laden_ram():
        m = sb.build_meta(a)
        rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                                device=dev, progress=False)
        return rep, lambda: laden.release(m)

    def laden_resident():
        m = sb.build_meta(a)
        rep = laden.stream_load(m, path, device=dev, progress=False)
        return rep, lambda: laden.release(m)

    def laden_cache():
        c = laden.ModelCache()
        spec = laden.ModelSpec("m", lambda: sb.build_meta(a),
                               checkpoint=path, block_paths=("blocks",))
        with c.use(spec, device=dev):
            sync(dev)
        return None, c.clear

    def kept(d):
        return None, d.clear

    def lf():
        return kept(load_file(path))

    def lf_copy():
        return kept({k: v.clone() for k, v in load_file(path).items()})

    def lf_pin():
        return kept({k: v.pin_memory() for k, v in load_file(path).items()})

    def lf_cuda():
        return kept(load_file(path, device=str(dev)))

    configs = [("laden stream_load, RAM tier" + (" (pinned)" if gpu else ""),
                laden_ram),
               (f"laden stream_load, all resident on {dev.type}",
                laden_resident),
               ("laden ModelCache first use", laden_cache),
               ("safetensors load_file (lazy: mapped, not read)", lf)]
    configs += [("load_file + pin_memory()", lf_pin),
                ("load_file(device='cuda')", lf_cuda)] if gpu else \
        [("load_file + copy of every tensor", lf_copy)]
    if a.laden_only:
        configs = [c for c in configs if c[0].startswith("laden")]

    reports = {}
    results = {}
    for name, fn in configs:
        for state in ("cold", "warm"):
            best = None
            for _ in range(a.repeats):
                (drop if state == "cold" else warm)(path)
                t, rep = timed(fn, dev)
                best = t if best is None else min(best, t)
                if isinstance(rep, laden.LoadReport):
                    reports[(name, state)] = rep
            results[(name, state)] = best
            print(f"  {name:<44} {state}  {best:7.2f} s  "
                  f"{size / best / 1e9:6.2f} GB/s", flush=True)

    # Time to first output of the streamed model (RAM tier): from the
    # start of the load to the end of its first forward, cold; the load
    # ended first, or background=True (the forward runs as blocks arrive).
    x = torch.randn(1, 16, a.hidden, dtype=torch.bfloat16, device=dev)

    def first_output(background):
        drop(path)
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        m = sb.build_meta(a)
        t0 = time.perf_counter()
        rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                                device=dev, progress=False,
                                background=background)
        h = laden.install_offload(m)
        with torch.no_grad():
            m(x)
        sync(dev)
        t = time.perf_counter() - t0
        rep.wait()
        with torch.no_grad():  # one streamed forward, loaded: per block
            m(x)
            sync(dev)
            t1 = time.perf_counter()
            m(x)
            sync(dev)
        per_block = (time.perf_counter() - t1) / a.blocks
        laden.release(m, h)
        return t, per_block

    ttfo = {}
    for background in (False, True):
        runs = [first_output(background) for _ in range(a.repeats)]
        ttfo[background] = min(runs)
        print(f"  first output, {'background' if background else 'load, then forward'}"
              f"  {ttfo[background][0]:7.2f} s", flush=True)

    # The drive: one O_DIRECT stream, and laden's reader pool.
    dd = None
    drop(path)
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M",
                        "iflag=direct"], capture_output=True, text=True)
    for line in r.stderr.splitlines():
        if "copied" in line:
            dd = size / float(line.split(",")[-2].split()[0])
    pool = ctypes.c_double()
    _lib.check(_lib.lib.laden_io_measure_file(path.encode(), size,
                                              ctypes.byref(pool)))
    warm(path)
    t0 = time.perf_counter()
    warm(path)
    cat = size / (time.perf_counter() - t0)
    print()
    print(f"load.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{torch.cuda.get_device_name(dev) if gpu else 'CPU'}  "
          f"torch {torch.__version__}  {os.cpu_count()} cores")
    print(f"checkpoint {sb.fmt_bytes(size)} ({a.blocks} blocks, bf16); the "
          f"drive: dd iflag=direct {dd / 1e9 if dd else 0:.2f} GB/s, laden's "
          f"reader pool (O_DIRECT, parallel) {pool.value / 1e9:.2f} GB/s; "
          f"page cache read (64 MiB reads) {cat / 1e9:.2f} GB/s")
    rows = [["load", "cold s", "cold GB/s", "warm s", "warm GB/s",
             "laden: from page cache (warm)"]]
    for name, _ in configs:
        c, w = results[(name, "cold")], results[(name, "warm")]
        rep = reports.get((name, "warm"))
        src = (f"{rep.cached_bytes / max(rep.read_bytes, 1):.0%}"
               if rep else "-")
        rows.append([name, f"{c:.2f}", f"{size / c / 1e9:.2f}", f"{w:.2f}",
                     f"{size / w / 1e9:.2f}", src])
    sb.print_table(rows)
    ram = configs[0][0]
    ref_warm = "load_file + pin_memory()" if gpu else \
        "load_file + copy of every tensor"
    best_drive = max(pool.value, dd or 0)
    print()
    print(f"goals: laden RAM tier cold / the drive's best rate "
          f"({best_drive / 1e9:.2f} GB/s) = "
          f"{size / results[(ram, 'cold')] / best_drive:.2f} (goal >= 0.9)")
    if (ref_warm, "warm") in results:
        print(f"       laden RAM tier warm / {ref_warm} warm = "
              f"{results[(ref_warm, 'warm')] / results[(ram, 'warm')]:.2f} "
              "(goal >= 1.0)")
    print(f"       laden cache first use cold / the cold file read "
          f"({size / best_drive:.2f} s) = "
          f"{results[('laden ModelCache first use', 'cold')] / (size / best_drive):.2f}"
          " (goal <= 1.2)")
    cold_read = size / best_drive
    block = ttfo[True][1]
    print()
    print(f"time to first output (RAM tier, cold; one forward of 16 tokens; "
          f"one streamed block {block * 1e3:.1f} ms):")
    print(f"  load, then forward:             {ttfo[False][0]:.2f} s")
    print(f"  stream_load(background=True):   {ttfo[True][0]:.2f} s")
    print(f"goal: background / (cold file read {cold_read:.2f} s + one block) "
          f"= {ttfo[True][0] / (cold_read + block):.2f} (goal <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
