#!/usr/bin/env python3
"""Streaming a model larger than its VRAM share: laden against the ideal
and against diffusers group offloading and accelerate cpu_offload, in one
run on one GPU.

A synthetic transformer (default 24 blocks, hidden 4096, MLP 16384, bf16,
9.66 GB) is written to a checkpoint, then run:
  resident          every weight on the GPU (laden, no streaming)
  laden la=N        every block streamed from pinned RAM, lookahead N
  laden disk        every block streamed from the checkpoint (O_DIRECT)
  laden disk lossless cache  the same from laden.compress's cache file
                    (--dir/llcache): the blobs read, decoded at enter
  diffusers ...     apply_group_offloading block_level / leaf_level,
                    use_stream=True
  accelerate        cpu_offload
ideal = max(resident time, streamed bytes / pinned H2D rate measured in
this run).  Prints tables; asserts nothing.

    python bench/stream.py [--tokens 2048,16384] [--no-peers] [--no-disk]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import laden
from laden import _lib
from laden._units import fmt_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


class SynthBlock(nn.Module):
    def __init__(self, h, m, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.norm2 = nn.LayerNorm(h)
        self.up = nn.Linear(h, m, bias=False)
        self.down = nn.Linear(m, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads,
                                               h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Synth(nn.Module):
    def __init__(self, blocks, h, m, heads):
        super().__init__()
        self.blocks = nn.ModuleList(SynthBlock(h, m, heads)
                                    for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build_meta(a):
    with torch.device("meta"):
        return Synth(a.blocks, a.hidden, a.mlp, a.heads).to(torch.bfloat16)


def write_checkpoint(a, path):
    """Random bf16 weights generated on the GPU, block by block."""
    m = build_meta(a)
    g = torch.Generator(device=a.device).manual_seed(0)
    tensors = {}
    for name, p in m.state_dict().items():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        elif "norm" in name:
            t = torch.zeros(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=g, device=a.device,
                             dtype=torch.bfloat16) * 0.02).cpu()
        tensors[name] = t
    laden.save_file(tensors, path)
    del tensors
    os.sync()


def synth_checkpoint(a) -> str:
    """The synthetic model's checkpoint in a.dir, written the first time."""
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}"
                        ".safetensors")
    if not os.path.exists(path):
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_checkpoint(a, path)
    return path


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_cache(path):
    h = ctypes.c_void_p()
    _lib.check(_lib.lib.laden_io_file_open(path.encode(), ctypes.byref(h)))
    _lib.lib.laden_io_drop_cache(h)
    _lib.lib.laden_io_file_close(h)


def print_table(rows) -> None:
    """Rows of strings, the first the header; first column left-aligned."""
    w = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                        for i, c in enumerate(row)))
        if j == 0:
            print("  ".join("-" * x for x in w))


def timed(fn, x, warmup, repeats, before=None):
    """Median milliseconds per forward, timed with CUDA events (the host
    clock on the CPU)."""
    cuda = x.device.type == "cuda"
    out = None
    with torch.no_grad():
        for _ in range(warmup):
            if before:
                before()
            out = fn(x)
        if cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            if before:
                before()
            if cuda:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                out = fn(x)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            else:
                t0 = time.perf_counter()
                out = fn(x)
                times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def torch_peak(dev):
    return torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", default="2048,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(a.device)
    tokens = [int(t) for t in a.tokens.split(",")]
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}"
                        ".safetensors")
    if not os.path.exists(path):
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_checkpoint(a, path)
    model_bytes = laden.open(path).total_bytes
    block_bytes = model_bytes // a.blocks
    if dev.type == "cuda":
        torch.cuda.init()
    base_rss = rss()

    rate = ctypes.c_double()
    if dev.type == "cuda":
        _lib.check(_lib.lib.laden_dev_measure_copy(
            dev.index or 0, _lib.COPY_H2D_PINNED, 256 << 20, 20,
            ctypes.byref(rate)))
        h2d = rate.value
    else:
        h2d = float("inf")
    direct = None
    if not a.no_disk:
        drop_cache(path)
        n = min(os.path.getsize(path), 4 << 30) // (16 << 20)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M",
                        f"count={n}", "iflag=direct", "status=none"],
                       check=True)
        direct = n * (16 << 20) / (time.perf_counter() - t0)

    rows = []
    xs = {t: torch.randn(1, t, a.hidden, dtype=torch.bfloat16, device=dev,
                         generator=torch.Generator(device=dev).manual_seed(t))
          for t in tokens}

    setup_rss = [base_rss]

    def record(name, t, ms, vram, host, extra=None):
        rows.append(dict(config=name, tokens=t, ms=ms, vram=vram,
                         rss=host, rss_before=setup_rss[0], **(extra or {})))
        print(f"  {name:<28} {t:>6} tokens  {ms:9.1f} ms", file=sys.stderr,
              flush=True)

    # Resident: every weight on the device (through laden, no streaming).
    ref_out = {}
    resident_ms = {}
    m = build_meta(a)
    laden.stream_load(m, path, device=dev)
    for t in tokens:
        peak_reset(dev)
        ms, out = timed(m, xs[t], 2, a.repeats)
        ref_out[t] = out.float().cpu()
        resident_ms[t] = ms
        record("resident", t, ms, model_bytes + torch_peak(dev), rss())
    laden.release(m)
    del m
    gc.collect()

    def diff(out, t):
        return (out.float().cpu() - ref_out[t]).abs().max().item()

    # laden, every block streamed from pinned RAM.
    for la in (1, 2):
        gc.collect()
        setup_rss[0] = rss()
        m = build_meta(a)
        laden.stream_load(m, path, offload_prefixes=["blocks."], device=dev)
        h = laden.install_offload(m, lookahead=la)
        for t in tokens:
            peak_reset(dev)
            ms, out = timed(m, xs[t], 2, a.repeats)
            st = h.stats()
            same = torch.equal(out.float().cpu(), ref_out[t])
            record(f"laden RAM, lookahead {la}", t, ms,
                   st["device_bytes"] + torch_peak(dev), rss(),
                   dict(equal=same, diff=diff(out, t), slots=st["nslots"],
                        slot_bytes=st["slot_bytes"]))
        laden.release(m, h)
        del m, h
        gc.collect()

    # laden, every block streamed from pinned RAM kept lossless (issue 37):
    # fewer bytes over the link, decoded on the device by each block's
    # enter.
    gc.collect()
    setup_rss[0] = rss()
    m = build_meta(a)
    t0 = time.perf_counter()
    rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                            device=dev, compression="lossless")
    load_s = time.perf_counter() - t0
    coded, raw = rep.lossless
    h = laden.install_offload(m, lookahead=2)
    for t in tokens:
        peak_reset(dev)
        ms, out = timed(m, xs[t], 2, a.repeats)
        st = h.stats()
        record("laden RAM lossless, la 2", t, ms,
               st["device_bytes"] + torch_peak(dev), rss(),
               dict(equal=torch.equal(out.float().cpu(), ref_out[t]),
                    diff=diff(out, t), ratio=coded / raw if raw else 1.0,
                    load_s=load_s))
    print(f"  lossless: {raw / 1e9:.2f} GB of weights kept in "
          f"{coded / 1e9:.2f} GB ({coded / max(raw, 1):.3f}); load "
          f"{load_s:.2f} s", file=sys.stderr, flush=True)
    laden.release(m, h)
    del m, h
    gc.collect()

    # laden, every block streamed from the checkpoint; then the same from a
    # lossless cache file (issue 37): the disk tier reads the blobs, ~0.67
    # of the bytes, and decodes at each enter.
    if not a.no_disk:
        t = tokens[0]
        cache = os.path.join(a.dir, "llcache")
        crep = laden.compress(path, cache, progress=False)
        print(f"  {crep}", file=sys.stderr, flush=True)
        for name, kw, files in (
                ("laden disk, lookahead 2", {}, (path,)),
                ("laden disk lossless cache, la 2",
                 dict(compression="lossless", lossless_cache=cache),
                 (path, *crep.files))):
            gc.collect()
            setup_rss[0] = rss()
            m = build_meta(a)
            laden.stream_load(m, path, offload_prefixes=["blocks."],
                              device=dev, ram_budget=0, **kw)
            h = laden.install_offload(m, lookahead=2)
            before = h.stats()["read_bytes"]
            peak_reset(dev)
            ms, out = timed(m, xs[t], 1, 2, before=lambda files=files: [
                drop_cache(f) for f in files])
            st = h.stats()
            extra = dict(read_per_forward=(st["read_bytes"] - before) / 3) \
                if kw else {}  # warm-up and two timed
            record(name, t, ms, st["device_bytes"] + torch_peak(dev), rss(),
                   dict(equal=torch.equal(out.float().cpu(), ref_out[t]),
                        diff=diff(out, t), disk_rate=model_bytes / (ms / 1e3),
                        **extra))
            laden.release(m, h)
            del m, h
            gc.collect()

    # Peers on the same model, weights in CPU memory.
    if not a.no_peers and dev.type == "cuda":
        def cpu_model():
            m = build_meta(a)
            ck = laden.open(path)
            sd = {n: ck.tensor(n) for n in ck.names()}
            m.load_state_dict(sd, assign=True)
            return m

        peers = []
        try:
            from diffusers.hooks import apply_group_offloading
            for kind in ("block_level", "leaf_level"):
                def setup(kind=kind):
                    m = cpu_model()
                    kw = dict(num_blocks_per_group=1) if kind == "block_level" \
                        else {}
                    apply_group_offloading(m, onload_device=dev,
                                           offload_type=kind, use_stream=True,
                                           **kw)
                    return m
                peers.append((f"diffusers {kind}, stream", setup, tokens))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"diffusers unavailable: {e}", file=sys.stderr)
        try:
            from accelerate import cpu_offload

            def setup_acc():
                m = cpu_model()
                cpu_offload(m, execution_device=dev)
                return m
            peers.append(("accelerate cpu_offload", setup_acc, tokens[:1]))
        except Exception as e:  # noqa: BLE001
            print(f"accelerate unavailable: {e}", file=sys.stderr)
        for name, setup, toks in peers:
            try:
                gc.collect()
                setup_rss[0] = rss()
                m = setup()
                for t in toks:
                    peak_reset(dev)
                    ms, out = timed(m, xs[t], 2, max(3, a.repeats // 2))
                    record(name, t, ms, torch_peak(dev), rss(),
                           dict(equal=torch.equal(out.float().cpu(),
                                                  ref_out[t]),
                                diff=diff(out, t)))
                del m
            except Exception as e:  # noqa: BLE001
                print(f"{name} failed: {e}", file=sys.stderr)
            gc.collect()
            torch.cuda.empty_cache()

    # The table.
    print(f"\nstream.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}"
          f"  torch {torch.__version__}")
    print(f"model {a.blocks} blocks x {fmt_bytes(block_bytes)} = "
          f"{fmt_bytes(model_bytes)} bf16; pinned H2D {h2d / 1e9:.2f} GB/s; "
          + (f"direct read (dd) {direct / 1e9:.2f} GB/s; " if direct else "")
          + f"process RSS before loading {fmt_bytes(base_rss)}\n")
    hdr = ("config", "tokens", "ms", "ideal ms", "÷ ideal", "peak VRAM",
           "RSS ÷ model", "ΔRSS ÷ model", "output vs resident")
    table = [hdr]
    for r in rows:
        t = r["tokens"]
        link = direct if "disk" in r["config"] and direct else h2d
        ideal = max(resident_ms[t], model_bytes / link * 1e3)
        if r["config"] == "resident":
            ideal = resident_ms[t]
        same = "-" if "equal" not in r else "identical" if r["equal"] \
            else f"max diff {r['diff']:.3g}"
        table.append((
            r["config"], str(t), f"{r['ms']:.1f}", f"{ideal:.1f}",
            f"{r['ms'] / ideal:.3f}", fmt_bytes(r["vram"]),
            f"{r['rss'] / model_bytes:.2f}",
            f"{(r['rss'] - r['rss_before']) / model_bytes:.2f}", same))
    print_table(table)
    print("\nideal = max(resident ms, model bytes / link rate); the link is "
          "pinned H2D, or the drive's direct read for the disk tier.  "
          "ΔRSS: resident memory the configuration added (measured before "
          "its setup).")
    for r in rows:
        if "disk_rate" in r and direct:
            read = r.get("read_per_forward")
            print(f"\n{r['config']}: streamed {fmt_bytes(model_bytes)} of "
                  "weights per forward"
                  + (f" (read {fmt_bytes(read)} of blobs)" if read else "")
                  + f" at {r['disk_rate'] / 1e9:.2f} GB/s of weights = "
                  f"{r['disk_rate'] / direct:.2f} x the direct-read rate")
        if "slots" in r and r["tokens"] == tokens[0]:
            print(f"{r['config']}: {r['slots']} slots x "
                  f"{fmt_bytes(r['slot_bytes'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, resident_ms=resident_ms, h2d=h2d,
                           direct=direct, model_bytes=model_bytes,
                           base_rss=base_rss), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
