#!/usr/bin/env python3
"""The planner under VRAM budgets: the synthetic 9.66 GB model of
bench/stream.py planned and run with budgets of 2, 4, 6 and 8 GB, against
the ideal max(resident time, streamed bytes / pinned H2D), and trash-panda
(the dumpsterpanda wheel) planning and streaming the same model with the
same budgets, in one run.  Activations are measured once with
measure_activation_vram and given to the planner, as a user would.

    python bench/plan.py [--budgets 2,4,6,8] [--tokens 2048] [--no-peers]

Prints a table; asserts nothing."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import laden  # noqa: E402
from laden import _lib  # noqa: E402
from laden._units import fmt_bytes  # noqa: E402
from stream import (build_meta, print_table, timed,  # noqa: E402
                    write_checkpoint)

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--budgets", default="2,4,6,8")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--storage", default="",
                    help="also plan with these storage dtypes, e.g. fp8")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--no-peers", action="store_true")
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device != "cuda":
        print("bench/plan.py needs a GPU", file=sys.stderr)
        return 0
    dev = torch.device("cuda", 0)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}x{a.mlp}"
                        ".safetensors")
    if not os.path.exists(path):
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_checkpoint(a, path)
    model_bytes = laden.open(path).total_bytes
    r = ctypes.c_double()
    _lib.check(_lib.lib.laden_dev_measure_copy(0, _lib.COPY_H2D_PINNED,
                                               256 << 20, 20, ctypes.byref(r)))
    h2d = r.value
    x = torch.randn(1, a.tokens, a.hidden, dtype=torch.bfloat16, device=dev,
                    generator=torch.Generator(device=dev).manual_seed(1))

    # Resident time and the activations of one forward.
    m = build_meta(a)
    laden.stream_load(m, path, device=dev)
    resident_ms, ref = timed(m, x, 2, a.repeats)
    ref = ref.float().cpu()
    def forward():
        with torch.no_grad():
            m(x)
    act = laden.measure_activation_vram(forward)
    laden.release(m)
    del m
    gc.collect()
    print(f"resident {resident_ms:.1f} ms; activations {fmt_bytes(act)}",
          file=sys.stderr, flush=True)

    rows = []
    budgets = [float(b) for b in a.budgets.split(",")]
    storages = [None] + [s for s in a.storage.split(",") if s]
    for storage in storages:
        for gb in budgets:
            m = build_meta(a)
            try:
                p = laden.plan(m, path, device=dev, max_vram=f"{gb}GB",
                               activation_vram=act, lookahead=1,
                               storage_dtype=storage)
            except laden.LadenError as e:
                rows.append(dict(cfg=f"laden{' ' + storage if storage else ''}",
                                 gb=gb, error=str(e)[:70]))
                continue
            laden.stream_load(m, path, plan=p)
            h = laden.install_offload(m, lookahead=p.lookahead)
            torch.cuda.reset_peak_memory_stats()
            ms, out = timed(m, x, 2, a.repeats)
            st = h.stats()
            streamed = sum(b.bytes for b in p.blocks
                           if b.tier != laden.Tier.GPU)
            resident_n = sum(b.tier == laden.Tier.GPU for b in p.blocks)
            rows.append(dict(
                cfg=f"laden{' ' + storage if storage else ''}", gb=gb, ms=ms,
                streamed=streamed, resident=resident_n,
                vram=st["device_bytes"] + torch.cuda.max_memory_allocated(),
                predicted=p.predicted_ms,
                diff=(out.float().cpu() - ref).abs().max().item()))
            print(f"  laden {storage or ''} {gb} GB: {ms:.1f} ms, "
                  f"{resident_n} resident", file=sys.stderr, flush=True)
            laden.release(m, h)
            del m, h
            gc.collect()

    if not a.no_peers:
        try:
            import trash_panda as tp
            for gb in budgets:
                t0 = time.time()
                try:
                    m = build_meta(a)
                    p = tp.plan(m, path, max_vram=f"{gb}GB",
                                activation_vram=act)
                    tp.stream_load(m, path, plan=p)
                    h = tp.install_offload(m)
                    torch.cuda.reset_peak_memory_stats()
                    ms, out = timed(m, x, 2, a.repeats)
                    res = [getattr(b, "tier", None) for b in getattr(
                        p, "blocks", [])]
                    res = [getattr(t, "value", t) for t in res]
                    rows.append(dict(
                        cfg="trash-panda", gb=gb, ms=ms,
                        vram=torch.cuda.max_memory_allocated(),
                        resident=sum(str(t).lower() == "gpu" for t in res),
                        streamed=None, predicted=None,
                        diff=(out.float().cpu() - ref).abs().max().item()))
                    h.remove()  # this trash-panda has no release()
                    del m, h, p
                except Exception as e:  # noqa: BLE001 - report, go on
                    rows.append(dict(cfg="trash-panda", gb=gb,
                                     error=f"{type(e).__name__}: "
                                           f"{str(e)[:60]}"))
                print(f"  trash-panda {gb} GB done in {time.time() - t0:.0f}"
                      " s", file=sys.stderr, flush=True)
                gc.collect()
                torch.cuda.empty_cache()
        except ImportError as e:
            print(f"trash-panda unavailable: {e}", file=sys.stderr)

    print(f"\nplan.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"model {fmt_bytes(model_bytes)} bf16 in {a.blocks} blocks; "
          f"{a.tokens} tokens; resident {resident_ms:.1f} ms; pinned H2D "
          f"{h2d / 1e9:.2f} GB/s; activations measured {fmt_bytes(act)}\n")
    hdr = ("config", "VRAM budget", "resident blocks", "streamed", "ms",
           "ideal ms", "÷ ideal", "predicted ms", "peak VRAM", "max |diff|")
    table = [hdr]
    for r in rows:
        if "error" in r:
            table.append((r["cfg"], f"{r['gb']:.0f} GB", "-", "-", "-", "-",
                          "-", "-", "-", r["error"]))
            continue
        streamed = r["streamed"]
        ideal = max(resident_ms, streamed / h2d * 1e3) if streamed is not None \
            else None
        table.append((
            r["cfg"], f"{r['gb']:.0f} GB", str(r["resident"]),
            fmt_bytes(streamed) if streamed is not None else "?",
            f"{r['ms']:.1f}", f"{ideal:.1f}" if ideal else "-",
            f"{r['ms'] / ideal:.3f}" if ideal else "-",
            f"{r['predicted']:.1f}" if r.get("predicted") else "-",
            fmt_bytes(r["vram"]), f"{r['diff']:.3g}"))
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
