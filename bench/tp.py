#!/usr/bin/env python3
"""Tensor parallel over streamed blocks (issue 19): a transformer of the
size of bench/stream.py's (default 24 blocks of hidden 4096, MLP 16384,
bf16: 9.66 GB) split over the GPUs of one host with PyTorch's
parallelize_module (q, k, v, up ColwiseParallel; o, down RowwiseParallel),
each rank's shard loaded by laden (only its bytes read) and streamed from
pinned RAM under a per-GPU budget, against the same split resident.

    python bench/tp.py [--procs 2] [--tokens 2048] [--vram-budget 2GB]

One process per GPU (NCCL; on the CPU gloo, for a small check).  Prints
a table per rank; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

WORKER = r"""
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               RowwiseParallel,
                                               parallelize_module)
sys.path.insert(0, {here!r})
import laden
from tp import TPModel, plan_of
from stream import timed

a = json.loads(sys.argv[1])
rank, world = int(sys.argv[2]), int(sys.argv[3])
cuda = torch.cuda.is_available()
dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
dist.init_process_group("nccl" if cuda else "gloo",
                        init_method="file://" + sys.argv[4], rank=rank,
                        world_size=world)
mesh = init_device_mesh(dev.type, (world,))
rate = 0.0
if cuda:
    import ctypes
    from laden import _lib
    r = ctypes.c_double()
    _lib.check(_lib.lib.laden_dev_measure_copy(
        rank, _lib.COPY_H2D_PINNED, 256 << 20, 20, ctypes.byref(r)))
    rate = r.value
x = torch.randn(1, a["tokens"], a["hidden"], dtype=torch.bfloat16,
                generator=torch.Generator().manual_seed(0)).to(dev)
rows = []
for mode in ("resident", "streamed"):
    with torch.device("meta"):
        m = TPModel(a["blocks"], a["hidden"], a["mlp"], a["heads"]) \
            .to(torch.bfloat16).eval()
    parallelize_module(m, mesh, plan_of(a["blocks"]))
    dist.barrier()
    t0 = time.perf_counter()
    kw = {{}}
    if mode == "streamed":
        kw = dict(offload_prefixes=["blocks."], vram_budget=a["vram_budget"]) \
            if cuda else dict(offload_prefixes=["blocks."])
    rep = laden.stream_load(m, a["path"], device=dev, **kw)
    load_s = time.perf_counter() - t0
    h = laden.install_offload(m) if mode == "streamed" else None
    local = sum(p.to_local().numel() * p.element_size()
                if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in m.parameters())
    timed(m, x, 1, 1)
    dist.barrier()
    ms, y = timed(m, x, 1, a["repeats"])
    peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
    rows.append(dict(mode=mode, rank=rank, load_s=load_s, ms=ms,
                     read=rep.read_bytes, local=local,
                     ram=rep.tier_bytes["ram"], y=float(y.float().sum()),
                     rate=rate))
    laden.release(m)
    del m
    if cuda:
        torch.cuda.empty_cache()
print("RESULT " + json.dumps(rows), flush=True)
dist.destroy_process_group()
"""


def _nn():
    import torch.nn as nn
    import torch.nn.functional as F
    return nn, F


class _Defs:
    """Built on first use: the module imports torch lazily so that the
    parent process does not initialize CUDA before its workers."""


def _define():
    nn, F = _nn()

    class TPBlock(nn.Module):
        """Attention and MLP with separate q, k, v (so that a column shard
        is whole heads) and local head counts from the weights."""

        def __init__(self, h, m, heads):
            super().__init__()
            self.hd = h // heads
            self.norm1 = nn.LayerNorm(h)
            self.q = nn.Linear(h, h, bias=False)
            self.k = nn.Linear(h, h, bias=False)
            self.v = nn.Linear(h, h, bias=False)
            self.o = nn.Linear(h, h, bias=False)
            self.norm2 = nn.LayerNorm(h)
            self.up = nn.Linear(h, m, bias=False)
            self.down = nn.Linear(m, h, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            n = self.norm1(x)
            q, k, v = (f(n).view(b, t, -1, self.hd).transpose(1, 2)
                       for f in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class TPModel(nn.Module):
        def __init__(self, blocks, h, m, heads):
            super().__init__()
            self.blocks = nn.ModuleList(TPBlock(h, m, heads)
                                        for _ in range(blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return TPBlock, TPModel


def __getattr__(name):  # TPModel, TPBlock: made on first use
    if name in ("TPModel", "TPBlock"):
        blk, model = _define()
        globals().update(TPBlock=blk, TPModel=model)
        return globals()[name]
    raise AttributeError(name)


def plan_of(blocks: int) -> dict:
    from torch.distributed.tensor.parallel import (ColwiseParallel,
                                                   RowwiseParallel)
    plan = {}
    for i in range(blocks):
        for n in ("q", "k", "v", "up"):
            plan[f"blocks.{i}.{n}"] = ColwiseParallel()
        for n in ("o", "down"):
            plan[f"blocks.{i}.{n}"] = RowwiseParallel()
    return plan


def write_checkpoint(a, path):
    import torch

    import laden
    with torch.device("meta"):
        m = __getattr__("TPModel")(a.blocks, a.hidden, a.mlp, a.heads)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, p in m.state_dict().items():
        if "norm" in name:
            sd[name] = (torch.ones if name.endswith("weight") else
                        torch.zeros)(p.shape, dtype=torch.bfloat16)
        else:
            sd[name] = (torch.randn(p.shape, generator=g) * 0.02) \
                .to(torch.bfloat16)
    laden.save_file(sd, path)
    return sum(t.numel() * t.element_size() for t in sd.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vram-budget", default="2GB",
                    help="per GPU, for the streamed run")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(dir=a.dir)
    a.path = os.path.join(tmp, "tp.safetensors")
    t0 = time.perf_counter()
    total = write_checkpoint(a, a.path)
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER.format(here=HERE))
    cfg = json.dumps(vars(a))
    init = os.path.join(tmp, "pg")
    ps = [subprocess.Popen([sys.executable, script, cfg, str(r),
                            str(a.procs), init], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
          for r in range(a.procs)]
    rows = []
    for p in ps:
        o, e = p.communicate()
        if p.returncode:
            print(e[-4000:], file=sys.stderr)
            return 1
        rows += json.loads([ln for ln in o.splitlines()
                            if ln.startswith("RESULT ")][-1][7:])
    print(f"model {total / 1e9:.2f} GB bf16 ({a.blocks} blocks of hidden "
          f"{a.hidden}, MLP {a.mlp}) over {a.procs} ranks, written in "
          f"{time.perf_counter() - t0:.0f} s; {a.tokens} tokens; streamed "
          f"under vram_budget {a.vram_budget} per GPU\n")
    sys.path.insert(0, HERE)
    from stream import print_table
    table = [("config", "rank", "load s", "ms", "read GB", "shard GB",
              "streamed GB", "÷ ideal")]
    for r in sorted(rows, key=lambda r: (r["mode"], r["rank"])):
        # ideal: the rank's resident time, or its streamed bytes over its
        # GPU's link, whichever is longer
        res = next(x["ms"] for x in rows if x["mode"] == "resident" and
                   x["rank"] == r["rank"])
        link = r["ram"] / r["rate"] * 1e3 if r["rate"] else 0.0
        ideal = max(res, link)
        table.append((r["mode"], str(r["rank"]), f"{r['load_s']:.2f}",
                      f"{r['ms']:.1f}", f"{r['read'] / 1e9:.2f}",
                      f"{r['local'] / 1e9:.2f}", f"{r['ram'] / 1e9:.2f}",
                      f"{r['ms'] / ideal:.3f}"))
    print_table(table)
    outs = {r["mode"]: r["y"] for r in rows if r["rank"] == 0}
    print("\n÷ ideal: ms against max(the rank's resident ms, its streamed "
          "bytes over its GPU's pinned H2D rate)")
    print(f"outputs (sum), rank 0: resident {outs.get('resident'):.4f}, "
          f"streamed {outs.get('streamed'):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
