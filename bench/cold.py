#!/usr/bin/env python3
"""Cold and warm starts, every method in a fresh process: how long until a
model is loaded, and until its first output, against the best plain reads
a user could pick and the ecosystem's own loaders, in one run.

Two models, written once into --dir:
  synth   bench/stream.py's synthetic bf16 transformer (24 blocks of
          hidden 4096 = 9.66 GB with CUDA; 16 of hidden 2048 = 1.61 GB on
          the CPU), a single safetensors file
  llama   a Llama from a config with random bf16 weights, save_pretrained
          (16 layers of hidden 2048 = 2.4 GB with CUDA; smaller on the CPU)

Methods (each its own process; "first" is the time from the start of the
load to the end of a first forward of 16 tokens, synchronized):
  cat, dd iflag=direct bs=64M        the plain reads of the files
  load_file + pin_memory()           safetensors, then pinned (CUDA) or
  load_file + copy                   copied into memory (CPU: load_file
                                     only maps the file)
  load_file(device=cuda)             safetensors straight to the GPU
  laden stream_load, RAM tier        blocks in pinned RAM, streamed
  laden stream_load, resident        every weight on the device
  laden stream_load, RAM, background the forward starts as blocks arrive
  laden stream_load, RAM, lossless   compression="lossless": read and
                                     encoded on the host's cores
  ... lossless cache                 the same from the cache files
                                     laden.compress wrote once into
                                     --dir/llcache (timed once, printed)
  transformers from_pretrained       device_map=<device> (llama)
  laden.from_pretrained              (llama), and with background=True

Cold: before each run the files' pages are dropped (posix_fadvise
DONTNEED; with --drop-all as root `echo 3 > /proc/sys/vm/drop_caches`,
which also drops Python's and torch's own pages: a cold machine).  Warm:
the files read once before.  With --repeat N the methods run N times,
interleaved, and the median counts.  Prints tables; asserts nothing.

With --read-limit RATE (root) this process and every method's run in a
cgroup that holds reads from the drive of --dir to RATE bytes/s (e.g.
600M): on a machine whose cores are few for its drive, the ratio of
drive to cores of a larger one (the H200's 1.9 GB/s drive against 16
encoding threads at 5 GB/s is about 0.4; two cores encode at 1.5 GB/s).

    python bench/cold.py [--device cuda|cpu] [--repeat 3] [--drop-all]
                          [--skip llama] [--methods "NAME|NAME"]
                          [--read-limit 600M]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = 16


# ---- in the child: one method, one load ------------------------------------

def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def child(a) -> dict:
    import torch

    import laden

    dev = torch.device(a.device)
    out = {}
    if a.model == "synth":
        sys.path.insert(0, HERE)
        import stream as sb

        x = torch.randn(1, TOKENS, a.hidden, dtype=torch.bfloat16,
                        device=dev)
        t0 = time.perf_counter()
        if a.method.startswith("load_file"):
            from safetensors.torch import load_file
            if a.method == "load_file(cuda)":
                d = load_file(a.path, device=str(dev))
            elif dev.type == "cuda":
                d = {k: v.pin_memory() for k, v in load_file(a.path).items()}
            else:
                d = {k: v.clone() for k, v in load_file(a.path).items()}
            _sync(dev)
            out["load_s"] = time.perf_counter() - t0
            return out
        m = sb.build_meta(a)
        kw = {"offload_prefixes": ["blocks."]} if "RAM" in a.method else {}
        bg = "background" in a.method
        if "lossless" in a.method:
            kw["compression"] = "lossless"
        if "lossless cache" in a.method:
            kw["lossless_cache"] = os.path.join(a.dir, "llcache")
        rep = laden.stream_load(m, a.path, device=dev, progress=False,
                                background=bg, **kw)
        h = laden.install_offload(m) if kw else None
        if not bg:
            _sync(dev)
            out["load_s"] = time.perf_counter() - t0
        with torch.no_grad():
            m(x)
        _sync(dev)
        out["first_s"] = time.perf_counter() - t0
        rep.wait()
        if bg:
            out["load_s"] = rep.seconds
        out["read_bytes"] = rep.read_bytes
        out["cached_bytes"] = rep.cached_bytes
        laden.release(m, h)
        return out
    import transformers

    ids = torch.randint(0, a.vocab, (1, TOKENS),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    t0 = time.perf_counter()
    if a.method == "transformers from_pretrained":
        m = transformers.AutoModelForCausalLM.from_pretrained(
            a.path, device_map=str(dev), dtype=torch.bfloat16)
    else:
        m = laden.from_pretrained(transformers.AutoModelForCausalLM, a.path,
                                  device=dev, progress=False,
                                  background="background" in a.method)
    _sync(dev)
    out["load_s"] = time.perf_counter() - t0
    with torch.no_grad():
        m(ids)
    _sync(dev)
    out["first_s"] = time.perf_counter() - t0
    if "background" in a.method:
        out["load_s"] = laden.wait(m).seconds
    return out


# ---- in the parent ----------------------------------------------------------

def files_of(path: str) -> list:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path)
                      if f.endswith(".safetensors"))
    return [path]


def drop(files, everything: bool) -> None:
    if everything:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    from stream import drop_cache  # bench/stream.py's
    for p in files:
        drop_cache(p)


def warm(files) -> None:
    for p in files:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run(a, model: str, method: str, path: str) -> dict:
    if method in ("cat", "dd iflag=direct"):
        files = files_of(path)
        argv = (["cat", *files] if method == "cat" else
                None)
        t0 = time.perf_counter()
        if argv:
            r = subprocess.run(argv, stdout=subprocess.DEVNULL)
            ok = r.returncode == 0
        else:
            ok = all(subprocess.run(
                ["dd", f"if={p}", "of=/dev/null", "bs=64M", "iflag=direct",
                 "status=none"]).returncode == 0 for p in files)
        sec = time.perf_counter() - t0
        return {"load_s": sec, "proc_s": sec} if ok else {"error": method}
    argv = [sys.executable, __file__, "--child", method, "--model", model,
            "--path", path, "--device", a.device, "--blocks", str(a.blocks),
            "--hidden", str(a.hidden), "--mlp", str(a.mlp),
            "--heads", str(a.heads), "--vocab", str(a.vocab),
            "--dir", os.path.abspath(a.dir)]
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    proc = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["proc_s"] = proc
    return out


def median(runs) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r.get("first_s", r["load_s"]))
    return ok[len(ok) // 2]


def table(rows) -> None:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i])
                        for i, c in enumerate(r)).rstrip())
        if j == 0:
            print("  ".join("-" * x for x in w))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--drop-all", action="store_true",
                    help="cold = echo 3 > /proc/sys/vm/drop_caches (root)")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--mlp", type=int, default=None)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lhidden", type=int, default=None)
    ap.add_argument("--inter", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--skip", default="", help="synth, llama")
    ap.add_argument("--read-limit", default=None,
                    help="hold reads from the drive to this rate (root): "
                         "e.g. 600M")
    ap.add_argument("--methods", default="",
                    help="only these methods (exact names separated by "
                         "'|'; cat and dd always run)")
    ap.add_argument("--child")
    ap.add_argument("--model")
    ap.add_argument("--path")
    a = ap.parse_args()
    if a.child:
        a.method = a.child
        print(json.dumps(child(a)))
        return 0

    import torch

    gpu = torch.cuda.is_available() if a.device is None else \
        a.device.startswith("cuda")
    a.device = a.device or ("cuda" if gpu else "cpu")
    big = gpu
    a.blocks = a.blocks or (24 if big else 16)
    a.hidden = a.hidden or (4096 if big else 2048)
    a.mlp = a.mlp or 4 * a.hidden
    a.layers = a.layers or (16 if big else 8)
    a.lhidden = a.lhidden or 2048
    a.inter = a.inter or (8192 if big else 5632)
    os.makedirs(a.dir, exist_ok=True)

    sys.path.insert(0, HERE)
    models = {}
    if "synth" not in a.skip:
        import stream as sb
        models["synth"] = sb.synth_checkpoint(a)
    if "llama" not in a.skip:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers not installed: the llama rows are skipped",
                  file=sys.stderr)
        else:
            d = os.path.join(a.dir, f"llama-{a.layers}x{a.lhidden}x"
                             f"{a.inter}")
            if not os.path.isdir(d):
                print(f"writing {d} ...", file=sys.stderr, flush=True)
                import hf  # bench/hf.py's Llama writer
                hf.write_lm(argparse.Namespace(
                    vocab=a.vocab, hidden=a.lhidden, inter=a.inter,
                    layers=a.layers), d, a.device)
            models["llama"] = d
    methods = {
        "synth": ["cat", "dd iflag=direct",
                  "load_file + pin_memory()" if gpu else "load_file + copy"]
        + (["load_file(cuda)"] if gpu else [])
        + ["laden stream_load, RAM tier", "laden stream_load, resident",
           "laden stream_load, RAM tier, background",
           "laden stream_load, RAM tier, lossless",
           "laden stream_load, RAM tier, lossless cache"],
        "llama": ["cat", "dd iflag=direct", "transformers from_pretrained",
                  "laden.from_pretrained",
                  "laden.from_pretrained, background"],
    }
    if a.methods:
        keep = set(a.methods.split("|")) | {"cat", "dd iflag=direct"}
        methods = {k: [m for m in v if m in keep]
                   for k, v in methods.items()}
    if (a.drop_all or a.read_limit) and os.geteuid() != 0:
        print("--drop-all and --read-limit need root", file=sys.stderr)
        return 2
    if a.read_limit:
        d = limit_reads(a.dir, _rate(a.read_limit))
        print(f"reads from the drive of {a.dir} held to "
              f"{_rate(a.read_limit) / 1e9:.2f} GB/s ({d})", flush=True)
    cache_files = {}
    for model, path in models.items():  # laden compress, once
        if any("lossless cache" in m for m in methods[model]):
            import laden
            rep = laden.compress(path, os.path.join(a.dir, "llcache"),
                                 progress=False)
            print(f"{model}: {rep} (page cache as it was)", flush=True)
            cache_files[model] = rep.files
    runs = {}
    for done in range(1, max(1, a.repeat) + 1):
        for model, path in models.items():
            plain = files_of(path)
            coded = plain + cache_files.get(model, [])
            for state in ("cold", "warm"):
                for m in methods[model]:
                    if state == "warm" and m == "dd iflag=direct":
                        continue  # it never reads the page cache
                    files = coded if "lossless cache" in m else plain
                    if state == "cold":
                        drop(files, a.drop_all)
                    else:
                        warm(files)
                    runs.setdefault((model, state, m), []).append(
                        run(a, model, m, path))
                    print(".", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        report(a, models, methods, runs, gpu, done)
    return 0



def _rate(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    t = text.strip().upper().rstrip("B")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1:] in units else int(t)


def limit_reads(path: str, bps: int) -> str:
    """This process (and the methods' processes after it) in a cgroup
    holding reads from path's drive to bps bytes/s: cgroup v1's blkio
    throttle, or v2's io.max.  Returns the cgroup's directory."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysdev = os.path.realpath(f"/sys/dev/block/{dev}")
    if os.path.exists(os.path.join(sysdev, "partition")):  # its disk
        with open(os.path.join(os.path.dirname(sysdev), "dev")) as f:
            dev = f.read().strip()

    def put(p: str, text: str) -> None:
        with open(p, "w") as f:
            f.write(text)

    if os.path.isdir("/sys/fs/cgroup/blkio"):
        d = "/sys/fs/cgroup/blkio/laden-cold"
        os.makedirs(d, exist_ok=True)
        put(os.path.join(d, "blkio.throttle.read_bps_device"), f"{dev} {bps}")
    else:
        put("/sys/fs/cgroup/cgroup.subtree_control", "+io")
        d = "/sys/fs/cgroup/laden-cold"
        os.makedirs(d, exist_ok=True)
        put(os.path.join(d, "io.max"), f"{dev} rbps={bps}")
    put(os.path.join(d, "cgroup.procs"), str(os.getpid()))
    return d


def report(a, models, methods, runs, gpu, done: int) -> None:
    """The tables, medians of the `done` repeats so far (printed after
    each, so a run cut short still leaves its last tables)."""
    import torch

    print(f"\ncold.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{platform.node()}  "
          f"{torch.cuda.get_device_name() if gpu else 'CPU'}  "
          f"torch {torch.__version__}  {os.cpu_count()} cores  "
          f"median of {done} of {max(1, a.repeat)}; cold = "
          f"{'drop_caches' if a.drop_all else 'the files dropped'}"
          + (f"; drive held to {_rate(a.read_limit) / 1e9:.2f} GB/s"
             if a.read_limit else ""))
    for model, path in models.items():
        size = sum(os.path.getsize(p) for p in files_of(path))
        print(f"\n{model}: {path} ({size / 1e9:.2f} GB)")
        best = {}
        for state in ("cold", "warm"):
            plain = [size / median(runs[(model, state, m)])["load_s"]
                     for m in ("cat", "dd iflag=direct")
                     if (model, state, m) in runs
                     and "error" not in median(runs[(model, state, m)])]
            best[state] = max(plain) if plain else 0
        rows = [["method", "state", "load s", "GB/s", "÷ best plain",
                 "first output s", "process s", "from page cache"]]
        for state in ("cold", "warm"):
            for m in methods[model]:
                if (model, state, m) not in runs:
                    continue
                r = median(runs[(model, state, m)])
                if "error" in r:
                    rows.append([m, state, "-", "-", "-", "-", "-",
                                 r["error"][:50]])
                    continue
                rate = size / r["load_s"]
                cached = (f"{r['cached_bytes'] / max(r['read_bytes'], 1):.0%}"
                          if "read_bytes" in r else "-")
                rows.append([
                    m, state, f"{r['load_s']:.2f}", f"{rate / 1e9:.2f}",
                    f"{rate / best[state]:.2f}" if best[state] else "-",
                    f"{r['first_s']:.2f}" if "first_s" in r else "-",
                    f"{r['proc_s']:.2f}", cached])
        table(rows)
    print("\n÷ best plain: the method's rate over the faster of cat and dd "
          "in the same state of this run.  first output: from the start "
          "of the load to the end of a first forward of "
          f"{TOKENS} tokens.  process s: the whole process, imports "
          "included.")


if __name__ == "__main__":
    sys.exit(main())
