#!/usr/bin/env python3
"""Quantized formats on the link: the synthetic bf16 transformer of
bench/stream.py (default 24 blocks of hidden 4096: 9.66 GB) run as bf16,
as fp8 (storage_dtype="fp8": e4m3 with a scale per row, expanded on the
device) and as GGUF Q8_0 and Q4_K files (the same names; random blocks
with small scales), one forward of --tokens tokens (transfer-bound at 16),
median of --repeats, in one process:

  streamed   every block streamed from pinned RAM (lookahead 2)
  resident   every block on the device (the expansion's cost alone)

Goals (issue 16): fp8 resident within 1.15x of bf16 resident; streamed
fp8 <= 0.6x and Q4_K <= 0.35x of bf16 streamed.  The ideal of a streamed
format is its bytes over the pinned copy rate measured in this run.
Prints tables; asserts nothing.

    python bench/quant.py [--blocks 24 --hidden 4096] [--tokens 16]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
import stream as sb  # noqa: E402

# Byte offsets of the f16 scale fields of a block, per type.
_F16 = {"Q8_0": (0,), "Q4_K": (0, 2)}


def write_gguf(a, path, qtype):
    """The synthetic model as a GGUF file: 2-D weights in `qtype` (random
    bytes, small finite scales), norms in F32."""
    import gguf

    Q = gguf.GGMLQuantizationType[qtype]
    blk, size = gguf.GGML_QUANT_SIZES[Q]
    m = sb.build_meta(a)
    w = gguf.GGUFWriter(path, "synth")
    small = np.frombuffer(np.float16(0.0004).tobytes(), np.uint8)
    g = torch.Generator(device=a.device).manual_seed(0)
    for name, p in m.state_dict().items():
        if p.dim() == 2:
            rows, cols = p.shape
            q = torch.randint(0, 256, (rows, cols // blk * size),
                              generator=g, device=a.device,
                              dtype=torch.uint8).cpu().numpy()
            v = q.reshape(-1, size)
            for off in _F16[qtype]:
                v[:, off:off + 2] = small
            w.add_tensor(name, q, raw_dtype=Q)
        else:
            val = 1.0 if name.endswith("weight") else 0.0
            w.add_tensor(name, np.full(p.shape, val, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.sync()


def run(a, path, x, resident: bool, **kw):
    m = sb.build_meta(a)
    pref = {"resident_prefixes": ["blocks."]} if resident else {}
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=x.device,
                      lookahead=2, progress=False, **pref, **kw)
    h = laden.install_offload(m)
    t, _ = sb.timed(m, x, 2, a.repeats)
    st = m._laden_stream
    streamed = sum(b.nbytes for b in st.blocks)
    laden.release(m, h)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return t, streamed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=None)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant.py needs a CUDA device")
        return 1
    a.mlp = a.mlp or 4 * a.hidden
    a.device = torch.device("cuda")
    os.makedirs(a.dir, exist_ok=True)
    stem = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}")
    paths = {"bf16": stem + ".safetensors", "Q8_0": stem + "-q8_0.gguf",
             "Q4_K": stem + "-q4_k.gguf"}
    if not os.path.exists(paths["bf16"]):
        print(f"writing {paths['bf16']} ...", flush=True)
        sb.write_checkpoint(a, paths["bf16"])
    for q in ("Q8_0", "Q4_K"):
        if not os.path.exists(paths[q]):
            print(f"writing {paths[q]} ...", flush=True)
            write_gguf(a, paths[q], q)
    from laden._expand import expand_unavailable
    why = expand_unavailable(a.device)
    x = torch.randn(1, a.tokens, a.hidden, dtype=torch.bfloat16,
                    device=a.device)
    buf = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=a.device)
    for _ in range(2):
        dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(5):
        dev.copy_(buf, non_blocking=True)
    e1.record()
    torch.cuda.synchronize()
    rate = 5 * (1 << 30) / (e0.elapsed_time(e1) / 1e3)  # pinned H2D B/s
    del buf, dev
    formats = [("bf16", paths["bf16"], {}),
               ("fp8 (e4m3, row scales)", paths["bf16"],
                {"storage_dtype": "fp8"}),
               ("GGUF Q8_0", paths["Q8_0"], {}),
               ("GGUF Q4_K", paths["Q4_K"], {})]
    rows = [["format", "streamed bytes", "streamed ms", "ideal ms",
             "x ideal", "x bf16 streamed", "resident ms",
             "x bf16 resident"]]
    base_s = base_r = None
    for label, path, kw in formats:
        ts, nbytes = run(a, path, x, False, **kw)
        tr, _ = run(a, path, x, True, **kw)
        base_s = base_s or ts
        base_r = base_r or tr
        ideal = max(tr, nbytes / rate * 1e3)
        rows.append([label, sb.fmt_bytes(nbytes), f"{ts:.1f}",
                     f"{ideal:.1f}", f"{ts / ideal:.3f}",
                     f"{ts / base_s:.3f}", f"{tr:.1f}",
                     f"{tr / base_r:.3f}"])
    print(f"quant.py  {torch.cuda.get_device_name()}  torch "
          f"{torch.__version__}; pinned host-to-device "
          f"{rate / 1e9:.1f} GB/s; one forward of {a.tokens} tokens, median "
          f"of {a.repeats}")
    print(f"GGUF blocks expanded on the device: "
          f"{'yes' if why is None else 'no (' + why + ')'}")
    sb.print_table(rows)
    print("goals: fp8 resident x bf16 <= 1.15; streamed fp8 <= 0.6x and "
          "Q4_K <= 0.35x of bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
