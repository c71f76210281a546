#!/usr/bin/env python3
"""One host copy for several processes (issue 19): N processes streaming
the same model, each from its own host copy against all from one shared
copy (stream_load(shared=True)), in one run.

The synthetic bf16 model of bench/stream.py (default 24 blocks of hidden
4096: 9.66 GB) is written once; every block streams from pinned RAM.
Worker processes (torch.distributed with gloo, for barriers only) load it
at once, then run their forwards at the same time, each on GPU
rank % (GPUs).  Per configuration:

  load s        the load's wall time per process (made: read the
                checkpoint; attached: waited for the maker, then pinned)
  ms            median forward per process, all streaming at once
  ÷ link        forward ms against the model's bytes over its GPU's
                pinned H2D rate, measured alone (processes sharing a GPU
                share its link: the ideal is then N_on_gpu times longer)
  host ÷ model  the group's host memory for weights: the growth of every
                process's private memory plus the shared segment once,
                against the model's bytes

    python bench/shared.py [--procs 2] [--tokens 2048] [--blocks 24]

Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

WORKER = r"""
import ctypes, json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import laden
from laden import _lib
from stream import build_meta, timed

def kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0

a = json.loads(sys.argv[1])
rank, world = int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + sys.argv[4],
                        rank=rank, world_size=world)
ngpu = max(torch.cuda.device_count(), 1)
dev = torch.device("cuda", rank % ngpu) if torch.cuda.is_available() \
    else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
    torch.cuda.init()
class A: pass
cfg = A(); cfg.__dict__.update(a)
m = build_meta(cfg)
anon0 = kb("RssAnon")
dist.barrier()
t0 = time.perf_counter()
rep = laden.stream_load(m, a["path"], offload_prefixes=["blocks."],
                        device=dev, shared=a["shared"])
load_s = time.perf_counter() - t0
laden.install_offload(m, lookahead=2)
x = torch.randn(1, a["tokens"], a["hidden"], dtype=torch.bfloat16,
                device=dev, generator=torch.Generator(device=dev)
                .manual_seed(0))
timed(m, x, 1, 1)  # slots made, first pass
dist.barrier()  # all stream at once from here
ms, y = timed(m, x, 1, a["repeats"])
dist.barrier()
out = dict(rank=rank, gpu=str(dev), load_s=load_s, ms=ms,
           how=rep.shared.how if rep.shared else "own",
           seg=rep.shared.nbytes if rep.shared else 0,
           anon=kb("RssAnon") - anon0, read=rep.read_bytes,
           y=float(y.float().sum()))
print("RESULT " + json.dumps(out), flush=True)
dist.barrier()
laden.release(m)
dist.destroy_process_group()
"""


def h2d_rate(gpu: int) -> float:
    import ctypes

    from laden import _lib
    rate = ctypes.c_double()
    _lib.check(_lib.lib.laden_dev_measure_copy(
        gpu, _lib.COPY_H2D_PINNED, 256 << 20, 20, ctypes.byref(rate)))
    return rate.value


def run(a, shared: bool, procs: int, tmp: str):
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER.format(here=HERE))
    init = os.path.join(tmp, f"pg-{time.time_ns()}")
    cfg = dict(vars(a), shared=shared)
    ps = [subprocess.Popen([sys.executable, script, json.dumps(cfg), str(r),
                            str(procs), init], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
          for r in range(procs)]
    outs = []
    for p in ps:
        o, e = p.communicate()
        if p.returncode:
            print(e[-4000:], file=sys.stderr)
            raise SystemExit(f"worker failed ({p.returncode})")
        outs.append(json.loads(
            [ln for ln in o.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None,
                    help="where the checkpoint is written (default: a "
                    "temporary directory)")
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    from stream import build_meta, write_checkpoint

    import laden
    from laden._units import fmt_bytes

    tmp = tempfile.mkdtemp(dir=a.dir)
    a.path = os.path.join(tmp, "synth.safetensors")
    t0 = time.perf_counter()
    write_checkpoint(a, a.path)
    model_bytes = sum(p.numel() * p.element_size()
                      for p in build_meta(a).parameters())
    ngpu = torch.cuda.device_count()
    rates = [h2d_rate(g) for g in range(ngpu)]
    print(f"model {fmt_bytes(model_bytes)} bf16 ({a.blocks} blocks of hidden "
          f"{a.hidden}), written in {time.perf_counter() - t0:.0f} s; "
          f"{a.procs} processes on {max(ngpu, 1)} device(s); pinned H2D "
          + ", ".join(f"GPU {g} {r / 1e9:.2f} GB/s"
                      for g, r in enumerate(rates)) + f"; {a.tokens} tokens\n")
    del laden
    hdr = ("config", "rank", "device", "host copy", "load s", "ms",
           "÷ link", "read GB")
    table = [hdr]
    summary = []
    for shared in (False, True):
        outs = run(a, shared, a.procs, tmp)
        name = "shared copy" if shared else "own copies"
        per_gpu = {}
        for o in outs:
            per_gpu[o["gpu"]] = per_gpu.get(o["gpu"], 0) + 1
        for o in outs:
            g = int(o["gpu"].split(":")[1]) if ":" in o["gpu"] else 0
            ideal = model_bytes * per_gpu[o["gpu"]] / rates[g] * 1e3 \
                if rates else float("nan")
            table.append((name, str(o["rank"]), o["gpu"], o["how"],
                          f"{o['load_s']:.2f}", f"{o['ms']:.1f}",
                          f"{ideal / o['ms']:.3f}",
                          f"{o['read'] / 1e9:.2f}"))
        host = sum(max(o["anon"], 0) for o in outs) + \
            max(o["seg"] for o in outs)
        same = len({round(o["y"], 3) for o in outs}) == 1
        summary.append((name, host / model_bytes, same))
    from stream import print_table
    print_table(table)
    print()
    for name, h, same in summary:
        print(f"{name}: host memory for weights, whole group: {h:.3f} x "
              f"model; outputs of the ranks {'equal' if same else 'DIFFER'}")
    print("\n÷ link: the model's bytes over the GPU's pinned H2D rate "
          "(times the processes on that GPU, which share its link), "
          "against the forward's time: 1.0 is the link's speed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
