#!/usr/bin/env python3
"""Cold read of a whole checkpoint into host memory: laden's reader against
safetensors (load_file and safe_open) and dd iflag=direct, the drive's raw
rate, in one run.  Each method runs in its own process after the file is
dropped from the page cache, and reports its time and peak RSS.

    python bench/read.py [--size 4GB] [--dir bench/out] [--keep]

Prints a table; asserts nothing about timings."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drop_cache(path: str) -> None:
    import ctypes

    from laden._lib import check, lib

    h = ctypes.c_void_p()
    check(lib.laden_io_file_open(path.encode(), ctypes.byref(h)))
    try:
        check(lib.laden_io_drop_cache(h))
    finally:
        lib.laden_io_file_close(h)


def make_checkpoint(path: str, size: int) -> None:
    import torch

    import laden

    per = 64 << 20  # 64 MiB tensors, bf16, like large linear weights
    n = max(1, size // per)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(n):
        tensors[f"blocks.{i // 4}.w{i % 4}"] = torch.randn(
            per // 2, generator=g).to(torch.bfloat16).reshape(4096, -1)
    laden.save_file(tensors, path)
    os.sync()


# ---- one method per child process -------------------------------------

def touch(tensors) -> None:
    """Reads one byte of every page: safetensors maps the file lazily, so
    without this nothing would have been read from the drive."""
    import torch

    for t in tensors:
        if t.numel():
            int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def child(method: str, path: str, threads: int) -> dict:
    import torch  # noqa: F401  (baseline includes torch, as in real use)

    base = rss_now()
    out = {}
    if method in ("laden", "laden-buffered"):
        import laden

        with laden.open(path) as ck:
            buf = torch.empty(ck.total_bytes, dtype=torch.uint8)
            buf.fill_(1)  # fault pages in outside the timing
            base = rss_now()
            items, at = [], 0
            for t in ck.tensors():
                items.append((t.name, buf.narrow(0, at, t.nbytes)))
                at += t.nbytes
            reader = laden.Reader(threads=threads,
                                  direct=method == "laden")
            t0 = time.perf_counter()
            ck.read_into_many(items, reader)
            out["seconds"] = time.perf_counter() - t0
            out["bytes"] = ck.total_bytes
            reader.close()
    elif method == "laden+alloc":
        import laden

        t0 = time.perf_counter()
        with laden.open(path) as ck:
            buf = torch.empty(ck.total_bytes, dtype=torch.uint8)
            items, at = [], 0
            for t in ck.tensors():
                items.append((t.name, buf.narrow(0, at, t.nbytes)))
                at += t.nbytes
            ck.read_into_many(items, laden.Reader(threads=threads))
            out["bytes"] = ck.total_bytes
        out["seconds"] = time.perf_counter() - t0
    elif method == "st.load_file":
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        d = load_file(path)
        touch(d.values())
        out["bytes"] = sum(t.numel() * t.element_size() for t in d.values())
        out["seconds"] = time.perf_counter() - t0
    elif method == "st.safe_open":
        from safetensors import safe_open

        t0 = time.perf_counter()
        d = {}
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                d[k] = f.get_tensor(k)
        touch(d.values())
        out["bytes"] = sum(t.numel() * t.element_size() for t in d.values())
        out["seconds"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown method {method}")
    out["peak_rss"] = peak_rss()
    out["base_rss"] = base
    return out


def run_child(method: str, path: str, threads: int) -> dict:
    drop_cache(path)
    r = subprocess.run([sys.executable, __file__, "--child", method,
                        "--path", path, "--threads", str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_dd(path: str) -> dict:
    if not shutil.which("dd"):
        return {"error": "dd not found"}
    drop_cache(path)
    t0 = time.perf_counter()
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M",
                        "iflag=direct", "status=none"], capture_output=True,
                       text=True)
    sec = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return {"seconds": sec, "bytes": os.path.getsize(path), "peak_rss": 0,
            "base_rss": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GB")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--threads", type=int, default=0,
                    help="reader threads (0: laden's default)")
    ap.add_argument("--sweep", action="store_true",
                    help="also run laden with 1, 2, 4, 8, 16 threads")
    ap.add_argument("--keep", action="store_true",
                    help="keep the generated checkpoint")
    ap.add_argument("--child")
    ap.add_argument("--path")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.threads)))
        return 0

    from laden._units import fmt_bytes, parse_size

    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "read-bench.safetensors")
    if not os.path.exists(path) or abs(os.path.getsize(path) - size) > (
            128 << 20):
        print(f"writing {fmt_bytes(size)} checkpoint to {path} ...",
              file=sys.stderr, flush=True)
        make_checkpoint(path, size)
    fsize = os.path.getsize(path)

    rows = [("dd iflag=direct bs=16M", run_dd(path))]
    rows.append((f"laden read_into_many ({args.threads or 'default'} thr)",
                 run_child("laden", path, args.threads)))
    rows.append(("laden incl. allocating the buffer",
                 run_child("laden+alloc", path, args.threads)))
    rows.append(("laden, buffered reads (no O_DIRECT)",
                 run_child("laden-buffered", path, args.threads)))
    if args.sweep:
        for th in (1, 2, 4, 8, 16):
            rows.append((f"laden, {th} threads",
                         run_child("laden", path, th)))
    try:
        import safetensors  # noqa: F401
        rows.append(("safetensors load_file",
                     run_child("st.load_file", path, 0)))
        rows.append(("safetensors safe_open + get_tensor",
                     run_child("st.safe_open", path, 0)))
    except ImportError:
        rows.append(("safetensors", {"error": "not installed"}))

    raw = rows[0][1]
    raw_rate = raw["bytes"] / raw["seconds"] if "seconds" in raw else None
    print(f"\nread.py  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  "
          f"file {fmt_bytes(fsize)} ({fsize} bytes), page cache dropped "
          "before each\n")
    hdr = ("method", "s", "GB/s", "÷ dd", "peak RSS", "RSS − base",
           "÷ file")
    table = [hdr]
    for name, r in rows:
        if "error" in r:
            table.append((name, "-", "-", "-", "-", "-", r["error"][:60]))
            continue
        rate = r["bytes"] / r["seconds"]
        over = r["peak_rss"] - r["base_rss"]
        table.append((
            name, f"{r['seconds']:.2f}", f"{rate / 1e9:.2f}",
            f"{rate / raw_rate:.2f}" if raw_rate else "-",
            fmt_bytes(r["peak_rss"]) if r["peak_rss"] else "-",
            fmt_bytes(over) if r["peak_rss"] else "-",
            f"{over / fsize:.2f}" if r["peak_rss"] else "-"))
    w = [max(len(str(row[i])) for row in table) for i in range(len(hdr))]
    for j, row in enumerate(table):
        print("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i])
                        for i, c in enumerate(row)))
        if j == 0:
            print("  ".join("-" * x for x in w))
    print("\nRSS − base: peak resident memory above the process's level "
          "before reading (torch imported; for laden, the buffer "
          "allocated).")
    if not args.keep:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
