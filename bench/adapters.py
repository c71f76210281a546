#!/usr/bin/env python3
"""LoRA adapters on a streamed model: the synthetic bf16 transformer of
bench/stream.py (default 24 blocks of hidden 4096: 9.66 GB) streamed from
pinned RAM, a rank-64 LoRA on every linear layer of every block; one
forward of --tokens tokens (transfer-bound at 16), median of --repeats:

  without adapters
  set_adapters([lora], mode="merge")    merged into each slot as it lands
  set_adapters([lora], mode="routed")   x @ A.T @ B.T added to the outputs
  switch: set_adapters([another]) and the first forward after it
  cached: the same model in a ModelCache (resident on the device, then
    streamed under a VRAM budget of a third of it), cache.use with one
    adapter, then another, then none: the use and its first forward

Prints a table; asserts nothing.

    python bench/adapters.py [--blocks 24 --hidden 4096] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
import stream as sb  # noqa: E402


def lora_sd(a, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    shapes = {"qkv": (3 * a.hidden, a.hidden), "out": (a.hidden, a.hidden),
              "up": (a.mlp, a.hidden), "down": (a.hidden, a.mlp)}
    for i in range(a.blocks):
        for name, (o, n) in shapes.items():
            p = f"blocks.{i}.{name}"
            sd[f"{p}.lora_A.weight"] = (torch.randn(rank, n, generator=g)
                                        * 0.01).to(torch.bfloat16)
            sd[f"{p}.lora_B.weight"] = (torch.randn(o, rank, generator=g)
                                        * 0.01).to(torch.bfloat16)
            sd[f"{p}.alpha"] = torch.tensor(float(rank))
    return sd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=None)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("adapters.py needs a CUDA device")
        return 1
    a.mlp = a.mlp or 4 * a.hidden
    dev = torch.device("cuda")
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}"
                        ".safetensors")
    if not os.path.exists(path):
        print(f"writing {path} ...", flush=True)
        a.device = dev
        sb.write_checkpoint(a, path)
    m = sb.build_meta(a)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=dev,
                      progress=False)
    h = laden.install_offload(m)
    x = torch.randn(1, a.tokens, a.hidden, dtype=torch.bfloat16, device=dev)
    A = laden.AdapterSpec("a", lambda: lora_sd(a, a.rank, 1))
    B = laden.AdapterSpec("b", lambda: lora_sd(a, a.rank, 2))
    rows = [["forward", "ms", "x without"]]
    base, _ = sb.timed(m, x, 2, a.repeats)
    rows.append(["without adapters", f"{base:.1f}", "1.000"])
    for mode in ("merge", "routed"):
        h.set_adapters([A], mode=mode)
        t, _ = sb.timed(m, x, 2, a.repeats)
        rows.append([f"rank-{a.rank} LoRA on every linear, {mode}",
                     f"{t:.1f}", f"{t / base:.3f}"])
    h.set_adapters([A], mode="merge")
    sb.timed(m, x, 1, 1)
    switches = []
    for k in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h.set_adapters([B if k % 2 == 0 else A], mode="merge")
        with torch.no_grad():
            m(x)
        torch.cuda.synchronize()
        switches.append((time.perf_counter() - t0) * 1e3)
    st = h.stats()
    h.set_adapters([])
    laden.release(m)
    cached = cached_switch(a, path, x, A, B)
    size = os.path.getsize(path)
    print(f"adapters.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"synthetic model {sb.fmt_bytes(size)} ({a.blocks} blocks, bf16) "
          f"streamed from pinned RAM; one forward of {a.tokens} tokens, "
          f"median of {a.repeats}")
    sb.print_table(rows)
    print(f"switch (set_adapters to another adapter, then the first "
          f"forward): {min(switches):.1f} ms (a forward alone "
          f"{base:.1f} ms); bytes read from the drive while loaded: "
          f"{st['read_bytes']}")
    print(f"goal: merge / without = {float(rows[2][2]):.3f} (goal <= 1.03)")
    print()
    print("cached model: cache.use(spec, adapters=...) and one forward, "
          "min of 3 (the first use loads the model and is not counted)")
    sb.print_table(cached)
    return 0


def cached_switch(a, path, x, A, B):
    """Adapter switches on a model held by a ModelCache; the drive bytes
    read after the first use must stay 0 (the adapters are merged into
    the device copies from the host copies)."""
    size = os.path.getsize(path)
    rows = [["block mode", "same adapter ms", "switch ms", "to none ms",
             "drive bytes after load"]]
    for mode, budget in (("resident", None), ("streaming", size // 3)):
        cache = laden.ModelCache(vram_budget=budget)
        spec = laden.ModelSpec("synth", lambda: sb.build_meta(a),
                               checkpoint=path, block_paths=("blocks",),
                               block_mode=mode)

        def use(adapters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with cache.use(spec, device=x.device, adapters=adapters) as m:
                with torch.no_grad():
                    m(x)
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3

        use([A])
        use([A])
        rt = cache._rt["synth"]
        st0 = rt.stats()
        read0 = st0.load_read_bytes + st0.read_bytes
        same, switch, none = [], [], []
        for _ in range(3):
            same.append(use([A]))
            switch.append(use([B]))
            none.append(use([]))
            use([A])
        st = rt.stats()
        rows.append([mode, f"{min(same):.1f}", f"{min(switch):.1f}",
                     f"{min(none):.1f}",
                     str(st.load_read_bytes + st.read_bytes - read0)])
        cache.clear()
    return rows


if __name__ == "__main__":
    sys.exit(main())
