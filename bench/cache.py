"""ModelCache benchmark: three models used in rotation with a VRAM budget
that holds two, and the same rotation with piper-offload's ModelCache.

Per switch it prints the time until the model is ready on the device (the
upload waited for), the bytes laden moved, and the time those bytes take
at the pinned H2D rate measured in the same run (the link): "link" is
ideal / measured, 1.00 = the copy engine's full speed.  Then the time to
re-use a model still on the device (enter + exit of ``cache.use``).
"laden-vbar" is the same cache with its models' device copies in VBARs of
a laden.vbar.VRAM context of the same budget (pages mapped on demand;
an evicted model's pages stay until the context needs them).
"laden-lossless" keeps the models' bf16 weights coded in host memory
(``ModelSpec(compression="lossless")``): each upload moves the coded
bytes and decodes them into the device copy; its rows add "plain ms",
the same models' decoded bytes at the link rate, and "÷ plain", the
switch's time over that (below 1: faster than any upload of the weights
as stored can be).
Outputs are checked against each model run plainly on the GPU.  Prints,
never asserts timings.

    python3 bench/cache.py [--model-gb 4] [--budget-gb 9] [--rounds 3]
                           [--peers vbar,piper,lossless]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream import print_table  # noqa: E402

import laden  # noqa: E402
from laden import _lib  # noqa: E402

D = 8192
DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, D, bias=False)
        self.down = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self, nblocks):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(nblocks))
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


_BASE = None


def factory(seed, nblocks):
    """A bf16 model on the CPU, filled fast from one random buffer."""
    def build():
        global _BASE
        if _BASE is None:
            g = torch.Generator().manual_seed(0)
            _BASE = (torch.randn(D * D, generator=g) * 0.02).to(torch.bfloat16)
        with torch.device("meta"):
            net = Net(nblocks)
        net = net.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p.copy_(_BASE.view(D, D).roll(seed * 131 + i, 0))
        return net.eval().requires_grad_(False)
    return build


def rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def h2d_rate():
    out = ctypes.c_double()
    _lib.check(_lib.lib.laden_dev_measure_copy(
        0 if DEV == "cuda" else _lib.DEVICE_CPU, _lib.COPY_H2D_PINNED,
        1 << 30, 5, ctypes.byref(out)))
    return out.value


def rotation(name, use, upload_bytes, keys, refs, x, rounds, rate, rows,
             raw_per_moved=None):
    """Uses the models in turn; one row per switch.  raw_per_moved: the
    weights' bytes per byte moved (coded weights), for "÷ plain"."""
    for r in range(rounds * len(keys)):
        k = keys[r % len(keys)]
        before = upload_bytes()
        sync()
        t0 = time.perf_counter()
        with use(k) as m:
            sync()
            ready = time.perf_counter() - t0
            with torch.no_grad():
                y = m(x)
            sync()
        moved = upload_bytes() - before
        ok = torch.equal(y, refs[k])
        ideal = moved / rate if moved else 0.0
        plain = moved * raw_per_moved / rate if raw_per_moved else 0.0
        rows.append([name, f"{r + 1}", k, f"{moved / 1e9:.2f}",
                     f"{ready * 1e3:.1f}", f"{ideal * 1e3:.1f}",
                     f"{ideal / ready:.2f}" if moved else "-",
                     f"{plain * 1e3:.1f}" if plain else "-",
                     f"{ready / plain:.2f}" if plain else "-",
                     "yes" if ok else "NO"])


def reuse_times(use, key, n=200):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        with use(key):
            pass
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return statistics.median(ts), ts[int(0.99 * (len(ts) - 1))]


def install_piper_shims():
    """piper-offload 0.9 asks for Python 3.14 and torch 2.14.  Three shims
    let it run on older ones: its modules are compiled with deferred
    annotations (3.14 defers them; 3.12 would evaluate forward references
    at import), ctypes.util.dllist (3.14) lists the loaded shared objects
    from /proc/self/maps, and its optional kernel package piper_kernels,
    whose import fails with a TypeError on an older Triton (piper-offload
    only catches ImportError), is made to raise ImportError; dense bf16
    models do not use it.  Its rolling-compile module imports torch 2.14
    names at import time; where this torch lacks them they are stubbed
    (that block mode is not used here)."""
    import __future__
    import ctypes.util
    import importlib.abc
    import importlib.machinery

    class Loader(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):
            path = self.get_filename(fullname)
            return compile(self.get_data(path), path, "exec",
                           flags=__future__.annotations.compiler_flag,
                           dont_inherit=True)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] != "piper_offload":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and isinstance(
                    spec.loader, importlib.machinery.SourceFileLoader):
                spec.loader = Loader(spec.loader.name, spec.loader.path)
            return spec

    if sys.version_info < (3, 14):
        sys.meta_path.insert(0, Finder())
    sys.modules.setdefault("piper_kernels", None)
    import enum
    import types

    import torch._inductor.custom_graph_pass as cgp
    for name in ("CustomInferenceAwareGraphPass", "CustomSchedulerPass"):
        if not hasattr(cgp, name):
            setattr(cgp, name, type(name, (cgp.CustomGraphPass,), {}))
    try:
        import torch._library.effects as eff
    except ImportError:
        eff = types.ModuleType("torch._library.effects")
        sys.modules["torch._library.effects"] = eff
    if not hasattr(eff, "EffectType"):
        eff.EffectType = enum.Enum("EffectType", "ORDERED")
    if not hasattr(torch.library, "_register_effectful_op"):
        torch.library._register_effectful_op = lambda *a, **k: None

    if hasattr(ctypes.util, "dllist"):
        return

    def dllist():
        seen = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and ".so" in parts[5] and \
                        parts[5] not in seen:
                    seen.append(parts[5])
        return seen

    ctypes.util.dllist = dllist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-gb", type=float, default=4.0)
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="VRAM budget (default: 2.25 models)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default="vbar,piper")
    ap.add_argument("--page-mb", type=int, default=32,
                    help="VBAR page size of the laden-vbar variant")
    ap.add_argument("--device", default="cuda",
                    help="cuda, or cpu for a dry run of the harness")
    ap.add_argument("--dim", type=int, default=8192)
    args = ap.parse_args()
    global DEV, D
    DEV, D = args.device, args.dim
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/cache.py needs a CUDA device (or --device cpu)")
    block_bytes = 2 * D * D * 2
    nblocks = max(1, round(args.model_gb * 1e9 / block_bytes) - 1)
    size = (nblocks * 2 + 1) * D * D * 2
    budget = int((args.budget_gb or 2.25 * size / 1e9) * 1e9)
    if DEV == "cuda":
        torch.cuda.init()
    rate = h2d_rate()
    keys = ["text-encoder", "unet", "vae"]
    facts = {k: factory(i, nblocks) for i, k in enumerate(keys)}
    x = torch.randn(4, D, device=DEV, dtype=torch.bfloat16)
    refs = {}
    for k in keys:
        m = facts[k]().to(DEV)
        with torch.no_grad():
            refs[k] = m(x)
        del m
    gc.collect()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU device"
    print(f"laden {laden.__version__}, torch {torch.__version__}, {name}")
    print(f"3 models of {size / 1e9:.2f} GB ({nblocks} blocks of "
          f"{block_bytes / 1e6:.0f} MB + a head), bf16; VRAM budget "
          f"{budget / 1e9:.2f} GB; pinned H2D {rate / 1e9:.2f} GB/s")
    rows = []

    # -- laden, then laden with the models' device copies in VBARs -----------
    reuse = []
    for variant in ["laden"] + (["laden-vbar"] if "vbar" in args.peers
                                else []) + (["laden-lossless"]
                                            if "lossless" in args.peers
                                            else []):
        vram = None
        if variant == "laden-vbar":
            from laden import vbar
            vram = vbar.VRAM(DEV, budget=budget,
                             page_bytes=int(args.page_mb) << 20)
        cache = laden.ModelCache(vram_budget=budget, vram=vram)
        comp = "lossless" if variant == "laden-lossless" else None
        specs = {k: laden.ModelSpec(k, facts[k], block_paths=("blocks",),
                                    compression=comp)
                 for k in keys}

        def lused(k, cache=cache, specs=specs):
            return cache.use(specs[k], device=DEV)

        t0 = time.perf_counter()
        for k in keys:  # first uses: build, pack, pin, upload
            s0 = time.perf_counter()
            with lused(k):
                sync()
            print(f"{variant} first use of {k}: "
                  f"{time.perf_counter() - s0:.2f} s (build, pack into laden "
                  f"memory, pin in place, upload)")
        print(f"{variant} first uses: {time.perf_counter() - t0:.2f} s; RSS "
              f"{rss_gb():.1f} GB")
        per = None
        if comp:
            coded = sum(cache.info(k).lossless[0] for k in keys)
            raw = sum(cache.info(k).lossless[1] for k in keys)
            per = raw / coded
            print(f"{variant}: host copies {coded / 1e9:.2f} GB coded for "
                  f"{raw / 1e9:.2f} GB of weights ({coded / raw:.3f})")
        rotation(variant, lused, lambda c=cache: c.stats()["upload_bytes"],
                 keys, refs, x, args.rounds, rate, rows, per)
        med, p99 = reuse_times(lused, keys[(args.rounds * 3 - 1) % 3])
        st = cache.stats()
        reuse.append([variant, f"{med * 1e6:.0f}", f"{p99 * 1e6:.0f}"])
        print(f"{variant} stats: {st}")
        if vram is not None:
            print(f"{variant} VRAM context: {vram.info()}")
        cache.clear()
        del cache
        gc.collect()
        if vram is not None:
            vram.close()
        if DEV == "cuda":
            torch.cuda.empty_cache()

    # -- piper-offload ------------------------------------------------------------
    if "piper" in args.peers:
        try:
            install_piper_shims()
            import piper_offload as po

            pc = po.ModelCache()
            pspecs = {k: po.ModelSpec(key=k, factory=facts[k],
                                      block_paths=("blocks",),
                                      block_mode="resident")
                      for k in keys}

            def pused(k):
                return pc.use(pspecs[k], device=torch.device(DEV))

            t0 = time.perf_counter()
            for k in keys:
                with pused(k):
                    sync()
            print(f"piper first uses: {time.perf_counter() - t0:.2f} s")
            with pused(keys[0]):
                inside = torch.cuda.memory_allocated() if DEV == "cuda" \
                    else 0
            after = torch.cuda.memory_allocated() if DEV == "cuda" else 0
            print(f"piper: allocated during a use {inside / 1e9:.2f} GB, "
                  f"after it {after / 1e9:.2f} GB")
            # piper keeps no model on the GPU between uses: every use
            # uploads the whole model.
            moved = {"n": 0}

            def pbytes():
                return moved["n"]

            def pused_count(k):
                moved["n"] += size
                return pused(k)

            rotation(f"piper {po.__version__ if hasattr(po, '__version__') else ''}".strip(),
                     pused_count, pbytes, keys, refs, x, args.rounds, rate,
                     rows)
            med, p99 = reuse_times(pused, keys[-1], n=20)
            reuse.append(["piper-offload", f"{med * 1e6:.0f}",
                          f"{p99 * 1e6:.0f}"])
        except Exception as e:  # record why the peer did not run
            print(f"piper-offload did not run: {type(e).__name__}: {e}")
    print()
    print_table([["cache", "switch", "model", "GB moved", "ready ms",
                  "ideal ms", "link", "plain ms", "÷ plain", "output ok"]]
                + rows)
    print()
    print_table([["cache", "re-use median us", "p99 us"]] + reuse)


if __name__ == "__main__":
    main()
