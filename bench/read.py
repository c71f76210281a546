#!/usr/bin/env python3
"""Cold read of a whole checkpoint into host memory: laden's reader (its
automatic choice, O_DIRECT, buffered) against safetensors (load_file and
safe_open) and the best plain reads a user could pick, `cat` (buffered,
the kernel's readahead) and `dd iflag=direct`, in one run.  Each method
runs in its own process after the file is dropped from the page cache,
and reports its time, peak RSS and how much of the file the page cache
still holds after it (laden drops what it brought in: one copy in RAM).
With --repeat N every method runs N times, interleaved, and the median
counts (virtual disks vary run to run).

    python bench/read.py [--size 4GB] [--dir bench/out] [--repeat 3] [--keep]
                         [--sweep] [--grid]

Prints a table; asserts nothing about timings."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
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


def resident_fraction(path: str) -> float:
    """The share of the file's pages in the page cache (mincore over a
    mapping: reads nothing)."""
    n = os.path.getsize(path)
    if n == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        pages = (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        ok = libc.mincore(addr, n, vec) == 0
        libc.munmap(addr, n)
        return sum(b & 1 for b in vec.raw) / pages if ok else float("nan")
    finally:
        os.close(fd)


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


def child(method: str, path: str, threads: int, chunk: int = 0) -> dict:
    import torch  # noqa: F401  (baseline includes torch, as in real use)

    base = rss_now()
    out = {}
    if method == "laden":
        import laden

        with laden.open(path) as ck:
            buf = torch.empty(ck.total_bytes, dtype=torch.uint8)
            buf.fill_(1)  # fault pages in outside the timing
            base = rss_now()
            items, at = [], 0
            for t in ck.tensors():
                items.append((t.name, buf.narrow(0, at, t.nbytes)))
                at += t.nbytes
            reader = laden.Reader(threads=threads,  # LADEN_IO_DIRECT
                                  chunk_bytes=chunk)
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


def run_child(method: str, path: str, threads: int, io=None,
              chunk: int = 0) -> dict:
    drop_cache(path)
    env = dict(os.environ)
    env.pop("LADEN_IO_DIRECT", None)
    if io:
        env["LADEN_IO_DIRECT"] = io
    r = subprocess.run([sys.executable, __file__, "--child", method,
                        "--path", path, "--threads", str(threads),
                        "--chunk", str(chunk)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["cached_after"] = resident_fraction(path)
    return out


def run_plain(path: str, argv) -> dict:
    """A plain command reading the file cold (cat, dd)."""
    if not shutil.which(argv[0]):
        return {"error": f"{argv[0]} not found"}
    drop_cache(path)
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    sec = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return {"seconds": sec, "bytes": os.path.getsize(path), "peak_rss": 0,
            "base_rss": 0, "cached_after": resident_fraction(path)}


def median_of(runs) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r["seconds"])
    return ok[len(ok) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GB")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--threads", type=int, default=0,
                    help="reader threads (0: laden's default)")
    ap.add_argument("--sweep", action="store_true",
                    help="also run laden with 1, 2, 4, 8, 16 threads")
    ap.add_argument("--grid", action="store_true",
                    help="also run laden buffered (LADEN_IO_DIRECT=off) "
                         "and O_DIRECT with 4, 8, 16 threads of 4, 16, "
                         "64 MiB chunks")
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each method, interleaved; the median "
                         "counts")
    ap.add_argument("--keep", action="store_true",
                    help="keep the generated checkpoint")
    ap.add_argument("--child")
    ap.add_argument("--path")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.threads,
                               args.chunk)))
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

    th = args.threads
    methods = [
        ("cat (buffered, readahead)", lambda: run_plain(path, ["cat", path])),
        ("dd iflag=direct bs=64M", lambda: run_plain(
            path, ["dd", f"if={path}", "of=/dev/null", "bs=64M",
                   "iflag=direct", "status=none"])),
        (f"laden, auto ({th or 'default'} threads)",
         lambda: run_child("laden", path, th)),
        ("laden, O_DIRECT (LADEN_IO_DIRECT=on)",
         lambda: run_child("laden", path, th, "on")),
        ("laden, buffered (LADEN_IO_DIRECT=off)",
         lambda: run_child("laden", path, th, "off")),
        ("laden auto, incl. allocating the buffer",
         lambda: run_child("laden+alloc", path, th)),
    ]
    if args.sweep:
        for n in (1, 2, 4, 8, 16):
            methods.append((f"laden auto, {n} threads",
                            lambda n=n: run_child("laden", path, n)))
    if args.grid:
        for io, name in (("off", "buffered"), ("on", "O_DIRECT")):
            for n in (4, 8, 16):
                for mib in (4, 16, 64):
                    methods.append((
                        f"laden {name}, {n} threads x {mib} MiB",
                        lambda io=io, n=n, mib=mib: run_child(
                            "laden", path, n, io, mib << 20)))
    try:
        import safetensors  # noqa: F401
        methods.append(("safetensors load_file",
                        lambda: run_child("st.load_file", path, 0)))
        methods.append(("safetensors safe_open + get_tensor",
                        lambda: run_child("st.safe_open", path, 0)))
    except ImportError:
        methods.append(("safetensors", lambda: {"error": "not installed"}))
    runs = {name: [] for name, _ in methods}
    for _ in range(max(1, args.repeat)):
        for name, fn in methods:
            runs[name].append(fn())
    rows = [(name, median_of(runs[name])) for name, _ in methods]

    plain = [r["bytes"] / r["seconds"] for _, r in rows[:2]
             if "seconds" in r]
    raw_rate = max(plain) if plain else None
    print(f"\nread.py  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  "
          f"file {fmt_bytes(fsize)} ({fsize} bytes), page cache dropped "
          f"before each, median of {max(1, args.repeat)}\n")
    hdr = ("method", "s", "GB/s", "÷ best plain", "peak RSS", "RSS − base",
           "÷ file", "cached after")
    table = [hdr]
    for name, r in rows:
        if "error" in r:
            table.append((name, "-", "-", "-", "-", "-", r["error"][:60],
                          "-"))
            continue
        rate = r["bytes"] / r["seconds"]
        over = r["peak_rss"] - r["base_rss"]
        table.append((
            name, f"{r['seconds']:.2f}", f"{rate / 1e9:.2f}",
            f"{rate / raw_rate:.2f}" if raw_rate else "-",
            fmt_bytes(r["peak_rss"]) if r["peak_rss"] else "-",
            fmt_bytes(over) if r["peak_rss"] else "-",
            f"{over / fsize:.2f}" if r["peak_rss"] else "-",
            f"{r['cached_after']:.0%}"))
    w = [max(len(str(row[i])) for row in table) for i in range(len(hdr))]
    for j, row in enumerate(table):
        print("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i])
                        for i, c in enumerate(row)))
        if j == 0:
            print("  ".join("-" * x for x in w))
    print("\nRSS − base: peak resident memory above the process's level "
          "before reading (torch imported; for laden, the buffer "
          "allocated).  ÷ best plain: against the faster of cat and dd "
          "in this run.  cached after: the file's pages the page cache "
          "holds once the method is done (a second copy of the file in "
          "RAM, unless reclaimed).")
    import ctypes as _c
    from laden._lib import IoWays, check, lib
    w, h = IoWays(), _c.c_void_p()
    check(lib.laden_io_file_open(path.encode(), _c.byref(h)))
    lib.laden_io_measure_ways(os.path.dirname(path).encode(), 512 << 20,
                              _c.byref(w))
    lib.laden_io_file_close(h)
    print(f"laden probe here: O_DIRECT {w.direct_bps / 1e9:.2f} GB/s, "
          f"buffered {w.buffered_bps / 1e9:.2f} GB/s")
    if not args.keep:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
