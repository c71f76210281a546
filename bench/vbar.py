"""VBARs and the elastic allocator.

1. The C costs (build/laden_bench_vbar): fault + unpin of a resident
   range, page map and evict costs per page size.
2. fault + unpin per call from Python, laden and comfy-aimdo.
3. A workload of 2048- and 16384-token forwards through a stack of
   linear layers whose weights live in a VBAR, with a VRAM budget too
   small for all weights plus the larger activations:
     fixed:   weights get budget - reserve (the larger forward's
              activations), activations come from PyTorch's allocator;
     elastic: weights and activations share the whole budget
              (laden.vbar.elastic around each forward): the larger
              forward's activations evict weights, the smaller forward
              faults them back;
     elastic-pool: the same with one MemPool for the whole run
              (laden.vbar.elastic_pool): PyTorch keeps its segments;
     elastic-global: laden allocates all of PyTorch's device memory
              (laden.vbar.install_elastic);
     aimdo:   comfy-aimdo's ModelVBAR on the same weights (its own
              allocator is marked experimental by its authors; activations
              from PyTorch's allocator, as in "fixed").
   Time per forward (CUDA events), weight bytes evicted, offloaded
   weights, OOMs.  Outputs are compared with the plain model.  Two
   patterns: "alternate" (2048, 16384, 2048, ...: the worst case for
   elastic mode, every large forward evicts what the small one needs) and
   "mostly-small" (three 2048-token forwards per 16384-token one).

    python3 bench/vbar.py [--layers 16] [--budget-gb 2.5] [--rounds 4]
                          [--patterns alternate,mostly-small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream import print_table  # noqa: E402

from laden import vbar  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 8192


def c_costs():
    exe = os.path.join(ROOT, "build", "laden_bench_vbar")
    if not os.path.exists(exe):
        print("(build/laden_bench_vbar not built: cmake --build build)")
        return
    print(subprocess.run([exe], capture_output=True, text=True).stdout)


def python_costs(rows, n=20000):
    dev = torch.device("cuda")
    v = vbar.ModelVBAR(1 << 30, dev, vram=vbar.VRAM(dev))
    w = v.alloc((1 << 20,), torch.uint8)
    v.fault(w)
    v.unpin(w)
    t0 = time.perf_counter()
    for _ in range(n):
        v.fault(w)
        v.unpin(w)
    rows.append(["laden ModelVBAR.fault + unpin",
                 f"{(time.perf_counter() - t0) / n * 1e6:.2f}"])
    v.close()
    try:
        ModelVBAR = aimdo()
        av = ModelVBAR(1 << 30, 0)
        a = av.alloc(1 << 20)
        av.fault(a[1], a[2])
        av.unpin(a[1], a[2])
        t0 = time.perf_counter()
        for _ in range(n):
            av.fault(a[1], a[2])
            av.unpin(a[1], a[2])
        rows.append(["comfy-aimdo ModelVBAR.fault + unpin",
                     f"{(time.perf_counter() - t0) / n * 1e6:.2f}"])
        av.close()
    except Exception as e:
        rows.append(["comfy-aimdo", f"did not run: {type(e).__name__}: {e}"])


def aimdo():
    """comfy-aimdo's ModelVBAR, its library initialized first (its
    model_vbar module binds the library when imported)."""
    from comfy_aimdo import control
    if not control.init():
        raise RuntimeError("comfy_aimdo.control.init() returned False")
    control.init_device(0)
    from comfy_aimdo.model_vbar import ModelVBAR
    return ModelVBAR


class Weights:
    """The model: host copies of L weights (pinned), run layer by layer
    with each weight faulted in (laden or aimdo) or streamed."""

    def __init__(self, layers):
        g = torch.Generator().manual_seed(0)
        self.host = [(torch.randn(D, D, generator=g) * (1.0 / D ** 0.5))
                     .to(torch.bfloat16).pin_memory() for _ in range(layers)]

    def reference(self, x):
        for h in self.host:
            x = torch.tanh(x @ h.to(x.device).t())
        return x


def forward_laden(model, v, ws, x, counts):
    for w, h in zip(ws, model.host):
        sig = v.fault(w)
        if sig is None:
            t = h.to(x.device, non_blocking=True)
            counts["offloaded"] += 1
        else:
            t = v.tensor(w)
            if sig != w.signature:
                t.copy_(h, non_blocking=True)
                w.signature = sig
                counts["copied"] += 1
        x = torch.tanh(x @ t.t())
        if sig is not None:
            v.unpin(w)
    return x


def forward_aimdo(model, av, allocs, sigs, x, counts):
    from comfy_aimdo.model_vbar import vbar_signature_compare
    from comfy_aimdo.torch import aimdo_to_tensor
    for i, (a, h) in enumerate(zip(allocs, model.host)):
        sig = av.fault(a[1], a[2])
        if sig is None:
            t = h.to(x.device, non_blocking=True)
            counts["offloaded"] += 1
        else:
            t = aimdo_to_tensor(a, x.device).view(torch.bfloat16).view(D, D)
            if not vbar_signature_compare(sig, sigs[i]):
                t.copy_(h, non_blocking=True)
                sigs[i] = sig
                counts["copied"] += 1
        x = torch.tanh(x @ t.t())
        if sig is not None:
            av.unpin(a[1], a[2])
    return x


def timed(fn):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    s.record()
    out = fn()
    e.record()
    e.synchronize()
    return out, s.elapsed_time(e)


def workload(args, rows):
    dev = torch.device("cuda", 0)  # explicit: no lazy CUDA init
    budget = int(args.budget_gb * 2 ** 30)
    gvram = None
    if args.modes == "elastic-global":
        # laden allocates everything PyTorch does in this process: the
        # inputs and reference outputs (4 x 2048/16384 x 8192 bf16) are
        # added to the budget so weights and activations get the same.
        extra = 2 * (2048 + 16384) * D * 2
        gvram = vbar.VRAM(dev, budget=budget + extra)
        vbar.install_elastic(gvram)
    model = Weights(args.layers)
    xs = {n: torch.randn(n, D, device=dev, dtype=torch.bfloat16) * 0.5
          for n in (2048, 16384)}
    with torch.no_grad():
        refs = {n: model.reference(x) for n, x in xs.items()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    wbytes = args.layers * D * D * 2
    reserve = int(args.reserve_gb * 2 ** 30)
    print(f"weights {wbytes / 2**30:.2f} GiB in {args.layers} layers; budget "
          f"{budget / 2**30:.2f} GiB; fixed mode reserves "
          f"{reserve / 2**30:.2f} GiB for activations")
    # The device itself has only the budget free (plus 256 MiB for the
    # CUDA context's needs), so a peer without a budget argument sees the
    # same pressure.
    free, _ = torch.cuda.mem_get_info()
    squeeze = free - budget - (256 << 20)
    blocker = None if gvram else torch.empty(max(squeeze, 0),
                                             dtype=torch.uint8, device=dev)
    if blocker is not None:
        print(f"device squeezed to {torch.cuda.mem_get_info()[0] / 2**30:.2f}"
              " GiB free")
    else:
        print("device not squeezed: laden allocates everything PyTorch does, "
              "within the budget")
    for mode in args.modes.split(","):
        counts = {"offloaded": 0, "copied": 0}
        times = {2048: [], 16384: []}
        ooms = 0
        ok = True
        try:
            if mode == "aimdo":
                ModelVBAR = aimdo()
                av = ModelVBAR(wbytes + args.layers * 512, 0)
                allocs = [av.alloc(D * D * 2) for _ in range(args.layers)]
                sigs = [None] * args.layers

                def run(x):
                    return forward_aimdo(model, av, allocs, sigs, x, counts)
                before = 0
            else:
                vram = gvram or vbar.VRAM(dev, budget=budget - reserve
                                          if mode == "fixed" else budget)
                v = vbar.ModelVBAR(wbytes + args.layers * 256, dev, vram=vram)
                ws = [v.alloc((D, D), torch.bfloat16)
                      for _ in range(args.layers)]
                pool = vbar.elastic_pool(vram) if mode == "elastic-pool" \
                    else None

                def run(x):
                    v.prioritize()
                    if mode == "elastic-global":
                        y = forward_laden(model, v, ws, x, counts)
                        torch.cuda.empty_cache()  # segments back to laden
                        return y
                    if mode == "elastic":
                        # A fresh pool per forward, given back at the end:
                        # the weights can return to its room.
                        with vbar.elastic(vram):
                            return forward_laden(model, v, ws, x, counts)
                    if pool is None:
                        return forward_laden(model, v, ws, x, counts)
                    with torch.cuda.use_mem_pool(pool):
                        y = forward_laden(model, v, ws, x, counts)
                    # PyTorch keeps a live pool's segments, emptied or
                    # not: this mode shows what that costs.
                    torch.cuda.empty_cache()
                    return y
                before = vram.info()["evicted_bytes"]
            seq = (2048, 16384) if args.pattern == "alternate" else \
                (2048, 2048, 2048, 16384)
            for r in range(args.rounds + 1):
                for n in seq:
                    try:
                        with torch.no_grad():
                            y, ms = timed(lambda: run(xs[n]))
                        ok &= bool(torch.equal(y, refs[n]))
                        if r:
                            times[n].append(ms)
                        del y
                    except torch.OutOfMemoryError:
                        ooms += 1
            evicted = (vram.info()["evicted_bytes"] - before
                       if mode != "aimdo" else 0)
            es = vbar.elastic_stats(dev) if mode.startswith("elastic") \
                else None
            rows.append([
                f"{mode} ({args.pattern})",
                f"{sum(times[2048]) / max(len(times[2048]), 1):.1f}",
                f"{sum(times[16384]) / max(len(times[16384]), 1):.1f}",
                f"{evicted / 2**30:.2f}" if mode != "aimdo" else "-",
                str(counts["offloaded"]), str(counts["copied"]), str(ooms),
                "yes" if ok else "NO"])
            if es:
                print(f"elastic allocator: {es}")
            if mode != "aimdo":
                pool = None
                v.close()
                if vram is not gvram:
                    vram.close()
            else:
                av.close()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:
            import traceback
            traceback.print_exc()
            if mode.startswith("elastic"):
                print(f"elastic allocator: {vbar.elastic_stats(dev)}",
                      file=sys.stderr)
            rows.append([f"{mode} ({args.pattern})",
                         f"did not run: {type(e).__name__}: "
                         f"{str(e)[:120]}", "", "", "", "", "", ""])
    del blocker


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget-gb", type=float, default=2.5)
    ap.add_argument("--reserve-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes",
                    default="fixed,elastic,elastic-pool,elastic-global,aimdo")
    ap.add_argument("--patterns", default="alternate,mostly-small")
    ap.add_argument("--pattern", default="alternate", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one part, in its own process; rows as JSON
        rows = []
        if args.child == "python":
            python_costs(rows)
        else:
            args.modes = args.child
            workload(args, rows)
        print("ROWS " + json.dumps(rows))
        return
    c_costs()
    if not torch.cuda.is_available():
        return
    # Each part in its own process: a peer that breaks the CUDA context
    # (or patches the driver) cannot take the others with it.
    def child(part, header, pattern="alternate"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", part,
               "--layers", str(args.layers), "--budget-gb",
               str(args.budget_gb), "--reserve-gb", str(args.reserve_gb),
               "--rounds", str(args.rounds), "--pattern", pattern]
        p = subprocess.run(cmd, capture_output=True, text=True)
        rows = []
        for line in p.stdout.splitlines():
            if line.startswith("ROWS "):
                rows = json.loads(line[5:])
            else:
                print(line)
        if not rows:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            rows = [[f"{part} ({pattern})",
                     f"crashed (exit {p.returncode}): {tail[:150]}"]
                    + [""] * (len(header) - 2)]
        return rows
    ph = ["call from Python", "us"]
    print_table([ph] + child("python", ph))
    print()
    wh = ["mode", "ms / 2048 tok", "ms / 16384 tok", "evicted GiB",
          "offloaded", "copied in", "OOM", "output ok"]
    rows = []
    for pattern in args.patterns.split(","):
        for mode in args.modes.split(","):
            rows += child(mode, wh, pattern)
    print_table([wh] + rows)


if __name__ == "__main__":
    main()
