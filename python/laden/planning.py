"""Plans: which tier each block lives in, decided by libladen's planner (a
pure C function) from block sizes, budgets, free-memory readings and
measured bandwidths; explained, editable, and saved as JSON.  Also
``measure_activation_vram`` and ``stage``."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import _lib
from ._lib import LOOKAHEAD_DEFAULT as LOOKAHEAD
from ._lib import check, error_for, lib
from ._describe import (_DTYPE_CODE, _resolve_dtype, _resolve_storage,
                        check_lookahead, describe, fill, find_blocks,
                        new_schedule)
from ._devices import _dev_index, _device
from ._units import fmt_bytes, parse_size
from .checkpoint import Checkpoint
from .errors import InvalidArgumentError
from .sharing import segments_bytes

log = logging.getLogger("laden")

# LADEN_PLAN_AUTO: "decide from the readings".  C takes and rounds the
# readings (laden_plan_read), keeps the default headroom (reserve AUTO)
# and builds stream_load's budgets (laden_plan_load_input).
AUTO = _lib.PLAN_AUTO


class Tier(enum.IntEnum):
    GPU = _lib.TIER_GPU
    RAM = _lib.TIER_RAM
    DISK = _lib.TIER_DISK


@dataclass
class PlanBlock:
    name: str
    bytes: int
    tier: Tier
    why: str
    # On the RAM tier when kept smaller there (compression="lossless": its
    # coded size as estimated from samples of the file); None: ``bytes``.
    ram_bytes: Optional[int] = None


@dataclass
class Plan:
    """A tier per block, with the reasons and the numbers they came from.
    ``str(plan)`` is a table; ``to_json`` / ``from_json`` round-trip it;
    ``assign`` and ``manual`` edit or write one by hand.  ``stream_load(...,
    plan=p)`` follows it exactly."""

    blocks: List[PlanBlock]
    rest_bytes: int = 0
    device: str = "cpu"
    lookahead: int = LOOKAHEAD
    compute_dtype: Optional[str] = None
    storage_dtype: Optional[str] = None
    path: Optional[str] = None
    budgets: Dict[str, int] = field(default_factory=dict)
    readings: Dict[str, int] = field(default_factory=dict)
    bandwidths: Dict[str, float] = field(default_factory=dict)
    predicted_ms: float = 0.0
    warnings: List[str] = field(default_factory=list)
    manual_prefixes: bool = False
    compression: Optional[str] = None  # "lossless": stream_load keeps it

    # -- editing ---------------------------------------------------------------
    def assign(self, tier: Tier, indices: Iterable[int]) -> "Plan":
        """Puts the blocks at ``indices`` on ``tier``; returns the plan."""
        tier = Tier(tier)
        idx = list(indices)
        bad = [i for i in idx if not (isinstance(i, int) and
                                      -len(self.blocks) <= i < len(self.blocks))]
        if bad:
            raise InvalidArgumentError(
                f"Plan.assign: no block {bad[0]}; the plan has "
                f"{len(self.blocks)} blocks (0..{len(self.blocks) - 1})",
                "E_INVAL")
        for i in idx:
            self.blocks[i].tier = tier
            self.blocks[i].why = f"{tier.name}: assigned"
        self.predicted_ms = 0.0  # no longer what the planner predicted
        return self

    @classmethod
    def manual(cls, resident: Sequence[str] = (), streamed: Sequence[str] = (),
               disk: Sequence[str] = (), *, device=None,
               lookahead: int = LOOKAHEAD) -> "Plan":
        """A plan written by hand: block paths (``"blocks.3."``) resident,
        streamed from RAM, or streamed from disk.  Paths naming a container
        stand for each of its children.  Checked against the model by
        stream_load."""
        blocks = [PlanBlock(n, 0, t, f"{t.name}: manual")
                  for names, t in ((resident, Tier.GPU), (streamed, Tier.RAM),
                                   (disk, Tier.DISK)) for n in names]
        seen = set()
        for b in blocks:
            if b.name in seen:
                raise InvalidArgumentError(
                    f"Plan.manual: block '{b.name}' given twice", "E_INVAL")
            seen.add(b.name)
        return cls(blocks=blocks, device=str(device) if device else "cpu",
                   lookahead=lookahead, manual_prefixes=True)

    # -- JSON ------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        for b in d["blocks"]:
            b["tier"] = Tier(b["tier"]).name
            if b["ram_bytes"] is None:  # as a plan without compression
                del b["ram_bytes"]      # was written before it existed
        if d["compression"] is None:
            del d["compression"]
        return json.dumps({"laden_plan": 1, **d}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise InvalidArgumentError(f"Plan.from_json: not JSON: {e}",
                                       "E_INVAL") from None
        if not isinstance(d, dict) or d.pop("laden_plan", None) != 1:
            raise InvalidArgumentError("Plan.from_json: not a laden plan",
                                       "E_INVAL")
        try:
            blocks = [PlanBlock(b["name"], int(b["bytes"]), Tier[b["tier"]],
                                b["why"], None if b.get("ram_bytes") is None
                                else int(b["ram_bytes"]))
                      for b in d.pop("blocks")]
            return cls(blocks=blocks, **d)
        except (KeyError, TypeError) as e:
            raise InvalidArgumentError(
                f"Plan.from_json: malformed plan ({e})", "E_INVAL") from None

    # -- printing ----------------------------------------------------------------
    def totals(self) -> Dict[str, int]:
        t = {"GPU": self.rest_bytes, "RAM": 0, "DISK": 0}
        for b in self.blocks:
            t[b.tier.name] += b.ram_bytes if b.tier == Tier.RAM and \
                b.ram_bytes is not None else b.bytes
        return t

    def _on_cpu(self) -> bool:
        return str(self.device).split(":")[0] == "cpu"

    def __str__(self) -> str:
        cpu = self._on_cpu()
        # On the CPU the "device" is host memory: the GPU tier is what stays
        # resident there, and nothing is copied host to device.
        label = {Tier.GPU: "resident" if cpu else "GPU", Tier.RAM: "RAM",
                 Tier.DISK: "DISK"}
        lw = max(len(v) for v in label.values())
        lines = [f"laden plan for {self.path or '(manual)'} on {self.device}"
                 + (f", compression {self.compression}"
                    if self.compression else "")]
        w = max([len(b.name) for b in self.blocks] + [20])
        coded = any(b.ram_bytes is not None for b in self.blocks)
        col = f" {'in RAM':>9}" if coded else ""
        lines.append(f"  {'#':>3}  {'block':<{w}} {'bytes':>9}{col}  "
                     f"{'tier':<{lw}}  why")
        for i, b in enumerate(self.blocks):
            ram = (f" {fmt_bytes(b.ram_bytes) if b.ram_bytes is not None else '':>9}"
                   if coded else "")
            lines.append(f"  {i:>3}  {b.name:<{w}} {fmt_bytes(b.bytes):>9}"
                         f"{ram}  {label[b.tier]:<{lw}}  {b.why}")
        if coded:
            lines.append("  in RAM: the block's bytes on the RAM tier, its "
                         "BF16/F16 weights kept lossless (coded sizes "
                         "estimated from samples of each tensor; the load "
                         "checks them)")
        lines.append(f"       {'(rest of the model)':<{w}} "
                     f"{fmt_bytes(self.rest_bytes):>9}  "
                     f"{label[Tier.GPU]:<{lw}}  always "
                     + ("in host memory" if cpu else "resident"))
        t = self.totals()
        lines.append(f"  totals: {label[Tier.GPU]} {fmt_bytes(t['GPU'])}, RAM "
                     f"{fmt_bytes(t['RAM'])}, disk {fmt_bytes(t['DISK'])}")
        r = self.readings
        if r:
            seen = []
            if not cpu and "vram_free" in r:
                seen.append(f"VRAM {fmt_bytes(r['vram_free'])}")
            if "ram_free" in r:
                seen.append(f"RAM {fmt_bytes(r['ram_free'])} of "
                            f"{fmt_bytes(r.get('ram_total', 0))}")
            if seen:
                lines.append("  free memory read (rounded down to "
                             f"{_lib.PLAN_READING_STEP >> 20} MiB): "
                             + ", ".join(seen))
        b = self.budgets
        if b:
            ram = (f"RAM tier {fmt_bytes(b.get('ram_avail', 0))} ("
                   + ("the RAM budget given" if b.get("ram_budget") else
                      f"free RAM, keeping {fmt_bytes(b.get('min_free_ram', 0))}"
                      " free" + (", less the rest of the model and the slots"
                                 if cpu else ""))
                   + f"); slots {b.get('nslots', 0)} x "
                   f"{fmt_bytes(b.get('slot_bytes', 0))}")
            if not cpu:
                ram = (f"VRAM for weights {fmt_bytes(b.get('vram_avail', 0))}"
                       f" (after {fmt_bytes(b.get('reserve', 0))} kept for "
                       f"{'measured activations' if b.get('measured') else 'headroom'}"
                       f"), {ram}")
            lines.append(f"  budgets: {ram}")
        # Only numbers that were measured are shown as measurements.
        bw = self.bandwidths
        rates = [] if cpu else [("host-to-device", bw.get("h2d", 0.0))]
        rates.append(("disk read", bw.get("disk", 0.0)))
        got = [f"{what} {v / 1e9:.2f} GB/s" for what, v in rates if v > 0]
        lacking = [what for what, v in rates if not v > 0]
        text = "  measured: " + (", ".join(got) if got else "nothing")
        if lacking:
            text += f" (not measured: {', '.join(lacking)})"
        if cpu:
            text += "; on the CPU blocks in RAM run in place, nothing is " \
                    "copied host to device"
        lines.append(text)
        if cpu:
            if not t["DISK"]:
                lines.append("  predicted: nothing is read per forward "
                             "(no block is on disk)")
            elif bw.get("disk", 0.0) > 0 and self.predicted_ms:
                lines.append(f"  predicted disk read time per forward: "
                             f"{self.predicted_ms:.1f} ms (compute runs "
                             "alongside; the forward takes at least the "
                             "larger of the two)")
            else:
                lines.append("  predicted: no time, the disk read rate was "
                             "not measured")
        elif self.predicted_ms:
            lines.append(f"  predicted transfer time per forward: "
                         f"{self.predicted_ms:.1f} ms (compute runs alongside;"
                         " the forward takes at least the larger of the two)")
        for wmsg in self.warnings:
            lines.append(f"  warning: {wmsg}")
        return "\n".join(lines)

    __repr__ = __str__


# ---- measuring ------------------------------------------------------------------

def _h2d_rate(device) -> float:
    """The link's rate in bytes/s (C's one probe, laden_plan_probe_h2d,
    measured once per device and process); 0 on the CPU."""
    r = ctypes.c_double()
    check(lib.laden_plan_probe_h2d(_dev_index(device), ctypes.byref(r)))
    return r.value


def _disk_rate(path: str) -> float:
    """The drive's rate under `path` (laden_plan_probe_disk, once per file
    and process); 0 where it cannot be measured."""
    r = ctypes.c_double()
    check(lib.laden_plan_probe_disk(os.fsencode(path), ctypes.byref(r)))
    return r.value


def _readings(device) -> Dict[str, int]:
    """C's readings (laden_plan_read: taken and rounded) as the plan
    shows them."""
    r = _lib.PlanReadings()
    check(lib.laden_plan_read(_dev_index(device), ctypes.byref(r)))
    vram = ("vram_free", "vram_total") if device.type == "cuda" else ()
    return {k: getattr(r, k + "_bytes")
            for k in (*vram, "ram_free", "ram_free_exact", "ram_total")}


def no_cuda_reason() -> Optional[str]:
    """Why laden cannot use a CUDA device here, or None when it can: the
    driver's answer when libladen found no device, else PyTorch's."""
    import torch

    n = ctypes.c_int32()
    check(lib.laden_dev_count(ctypes.byref(n)))
    if n.value == 0:
        why = (lib.laden_dev_cuda_error() or b"").decode(errors="replace")
        return why or "the CUDA driver reports no device"
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def device_problem(device) -> Optional[str]:
    """Why ``device`` (a string, an index or a torch.device) cannot be
    used by laden on this machine, as a sentence; None when it can."""
    import torch

    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return "not a device; give cpu, cuda or cuda:N"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return (f"laden runs on CUDA devices and the CPU, not on "
                f"{dev.type}; give cpu, cuda or cuda:N")
    why = no_cuda_reason()
    if why:
        return f"no CUDA device: {why}"
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        return (f"no such device; this machine has {n} CUDA device"
                f"{'s' if n != 1 else ''} (cuda:0"
                f"{f'..cuda:{n - 1}' if n > 1 else ''})")
    return None


def _plan_input(dev, *, max_vram=None, headroom_vram=None,
                activation_vram=None, min_free_ram="auto", ram_budget=None,
                resident_blocks: Optional[int] = None, lookahead: int = LOOKAHEAD,
                readings: Dict[str, int], bandwidths: Dict[str, float],
                disk_staging: bool = True) -> "_lib.PlanInput":
    """The planner's budgets, readings and rates (block fields empty).
    On the CPU device the VRAM options do not apply: giving one is an
    error (the C planner names it), not a silent no-op.  Without
    activation_vram or headroom_vram the reserve is C's default (AUTO)."""
    cpu = dev.type == "cpu"
    inp = _lib.PlanInput()
    inp.vram_free_bytes = 0 if cpu else readings.get("vram_free", 0)
    inp.max_vram_bytes = parse_size(max_vram) if max_vram is not None else 0
    kept = activation_vram if activation_vram is not None else headroom_vram
    inp.reserve_bytes = AUTO if kept is None else parse_size(kept)
    inp.ram_total_bytes = readings.get("ram_total", 0)
    inp.ram_free_bytes = readings.get("ram_free", 0)
    inp.ram_budget_bytes = AUTO if ram_budget is None else \
        parse_size(ram_budget)
    inp.min_free_ram_bytes = AUTO if min_free_ram == "auto" else \
        parse_size(min_free_ram)
    inp.resident_blocks = -1 if resident_blocks is None else \
        int(resident_blocks)
    inp.lookahead = lookahead
    inp.disk_staging = int(disk_staging and not cpu)
    inp.host_device = int(cpu)
    inp.h2d_bytes_per_s = bandwidths.get("h2d", 0.0)
    inp.disk_bytes_per_s = bandwidths.get("disk", 0.0)
    return inp


def load_budgets(dev, vram_budget, ram_budget, vram_has_budget: bool,
                 lookahead: int, shared=None) -> "_lib.PlanInput":
    """stream_load's budgets, in the user's words (a size, or None), made
    into the planner's input by C (laden_plan_load_input: the policy, the
    readings, and for ``shared``, the Checkpoint of a shared load, the
    credit for the segments already made from its files)."""
    opt = _lib.PlanLoadOptions()
    opt.device = _dev_index(dev)
    opt.lookahead = lookahead
    opt.vram_budget_bytes = AUTO if vram_budget is None else \
        parse_size(vram_budget)
    opt.ram_budget_bytes = AUTO if ram_budget is None else \
        parse_size(ram_budget)
    if shared is not None and ram_budget is None:
        opt.shared_bytes = segments_bytes(shared)
    opt.vram_context_budget = int(vram_has_budget)
    inp = _lib.PlanInput()
    check(lib.laden_plan_load_input(ctypes.byref(opt), None,
                                    ctypes.byref(inp)))
    return inp


def plan_schedule(h, budgets: "_lib.PlanInput", names=None):
    """Runs laden_sched_plan on the described schedule `h`: C sizes the
    blocks and sets their tiers.  Returns (reasons, result).  `names`
    (C block index -> name) turn "block N" in an error into the name."""
    n = lib.laden_sched_block_count(h)
    why = (ctypes.c_int32 * max(n, 1))()
    res = _lib.PlanResult()
    s = lib.laden_sched_plan(h, ctypes.byref(budgets), why,
                             ctypes.byref(res))
    if s:
        err = error_for(s)
        msg = re.sub(r"\bblock (\d+)\b", lambda m: "block '" + names[
            int(m.group(1))] + "'" if names and int(m.group(1)) in names
            else m.group(0), err.message)
        raise type(err)(msg, err.status, err.code) from None
    return list(why)[:n], res


def _plan(names, sizes, tiers, why, res, inp, rest_bytes, dev, path,
          readings, bandwidths, lookahead, activation_measured=False,
          ram_sizes=None, compression=None) -> Plan:
    cpu = dev.type == "cpu"
    blocks = [PlanBlock(names[i], sizes[i], Tier(tiers[i]),
                        lib.laden_plan_why_text(why[i]).decode(),
                        ram_sizes[i] if ram_sizes is not None
                        and ram_sizes[i] != sizes[i] else None)
              for i in range(len(names))]
    texts = [lib.laden_plan_warning_text(1 << k) for k in range(32)
             if res.warnings >> k & 1]  # C's words for its bits
    warnings = [t.decode() for t in texts if t]
    budgets = dict(ram_avail=res.ram_avail_bytes,
                   ram_limit=res.ram_limit_bytes,
                   min_free_ram=res.min_free_ram_bytes,
                   ram_budget=int(inp.ram_budget_bytes != AUTO),
                   measured=int(activation_measured),
                   nslots=res.nslots, slot_bytes=res.slot_bytes)
    if cpu:
        readings = {k: v for k, v in readings.items()
                    if not k.startswith("vram")}
        bandwidths = {k: v for k, v in bandwidths.items() if k != "h2d"}
    else:
        budgets.update(vram_avail=res.vram_avail_bytes,
                       reserve=res.reserve_bytes,
                       max_vram=inp.max_vram_bytes)
    return Plan(blocks=blocks, rest_bytes=rest_bytes, device=str(dev),
                lookahead=lookahead, path=path, budgets=budgets,
                readings=dict(readings), bandwidths=dict(bandwidths),
                predicted_ms=res.predicted_ms, warnings=warnings,
                compression=compression)


def _measured(dev, path, readings, bandwidths):
    readings = readings if readings is not None else _readings(dev)
    if bandwidths is None:
        bandwidths = {"h2d": _h2d_rate(dev),
                      "disk": _disk_rate(path) if path else 0.0}
    return readings, bandwidths


def compute(names: Sequence[str], sizes: Sequence[int], rest_bytes: int, *,
            device, path: Optional[str] = None, max_vram=None,
            headroom_vram=None, activation_vram=None, min_free_ram="auto",
            ram_budget=None, resident_blocks: Optional[int] = None,
            asked: Optional[Sequence[int]] = None, lookahead: int = LOOKAHEAD,
            readings: Optional[Dict[str, int]] = None,
            bandwidths: Optional[Dict[str, float]] = None) -> Plan:
    """The planner on explicit sizes (``laden.plan`` measures a model
    instead).  ``readings`` and ``bandwidths`` default to this machine's."""
    dev = _device(device)
    readings, bandwidths = _measured(dev, path, readings, bandwidths)
    inp = _plan_input(dev, max_vram=max_vram, headroom_vram=headroom_vram,
                      activation_vram=activation_vram,
                      min_free_ram=min_free_ram, ram_budget=ram_budget,
                      resident_blocks=resident_blocks, lookahead=lookahead,
                      readings=readings, bandwidths=bandwidths)
    n = len(sizes)
    arr = (ctypes.c_uint64 * max(n, 1))(*sizes)
    inp.nblocks = n
    inp.block_bytes = arr
    if asked is not None:
        asked_arr = (ctypes.c_int32 * max(n, 1))(*asked)
        inp.asked = asked_arr
    inp.rest_bytes = rest_bytes
    tiers = (ctypes.c_int32 * max(n, 1))()
    why = (ctypes.c_int32 * max(n, 1))()
    res = _lib.PlanResult()
    check(lib.laden_plan_compute(ctypes.byref(inp), tiers, why,
                                 ctypes.byref(res)))
    return _plan(list(names), list(sizes), list(tiers), list(why), res, inp,
                 rest_bytes, dev, path, readings, bandwidths, lookahead,
                 activation_vram is not None)


def plan(model, path, *, max_vram=None, headroom_vram=None,
         activation_vram=None, min_free_ram="auto", resident_blocks=None,
         compute_dtype=None, storage_dtype=None, key_map=None,
         skip_prefixes=None, device=None, ram_budget=None,
         offload_prefixes: Optional[Sequence[str]] = None,
         lookahead: int = LOOKAHEAD, expert_rows: bool = True,
         compression: Optional[str] = None, lossless_cache=None) -> Plan:
    """Plans where each block of ``model`` (built on meta or not) lives for
    the checkpoint at ``path``, on ``device`` (default: CUDA if present).
    Blocks are the children of the model's top-level ModuleLists unless
    ``offload_prefixes`` names them.  Sizes accept bytes or strings.  The
    blocks are described to libladen, which sizes them as it will lay them
    out and plans them (``headroom_vram`` defaults to 1.5 GB on CUDA; the
    VRAM options are refused on the CPU).  ``expert_rows``: as
    ``stream_load``'s (mixture-of-experts layers' experts as blocks of
    their own).  ``compression="lossless"``: as ``stream_load``'s; the RAM
    tier counts the streamed blocks' BF16/F16 weights at their coded sizes
    (estimated from samples of each tensor in the file: a few reads), so
    more blocks fit it; ``stream_load(plan=p)`` then loads with it.  With
    ``lossless_cache`` (a directory ``laden.compress`` wrote) the sizes
    are exact and nothing is sampled."""
    import torch

    check_lookahead(lookahead)
    check_compression(compression, "plan")
    storage = _resolve_storage(storage_dtype)
    dev = _device(device)
    cdt = _resolve_dtype(compute_dtype)
    if storage == "bf16" and cdt is None:
        cdt = torch.bfloat16
    prefixes = list(offload_prefixes) if offload_prefixes is not None \
        else find_blocks(model)
    with Checkpoint(path) as ck:
        desc = describe(model, ck, prefixes, key_map=key_map,
                        skip_prefixes=skip_prefixes, cdt=cdt,
                        storage=storage, device=dev, transient=True,
                        expert_rows=expert_rows)
        p = plan_description(desc, ck, dev, max_vram=max_vram,
                             headroom_vram=headroom_vram,
                             activation_vram=activation_vram,
                             min_free_ram=min_free_ram,
                             ram_budget=ram_budget,
                             resident_blocks=resident_blocks,
                             lookahead=lookahead, compression=compression,
                             lossless_cache=lossless_cache)
    p.path = os.fspath(path)
    p.compute_dtype = str(compute_dtype).replace("torch.", "") \
        if compute_dtype else None
    p.storage_dtype = storage
    return p


def plan_description(desc, ck, dev, **kw) -> Plan:
    """Describes `desc` (a model's description) to a C schedule that is
    never loaded, and returns the plan C makes for it: the same sizes and
    decisions stream_load gets."""
    try:
        return _plan_described(
            dev, ck, lambda h: fill(h, desc, ck, _lib.TIER_GPU, expand=True) and
            [(b.name, b.c_block) for b in desc.blocks], **kw)
    finally:
        for t in desc.tensors:
            t.source = None


def plan_checkpoint(ck, blocks: Sequence[Tuple[str, Sequence[str]]], dev,
                    **kw) -> Plan:
    """The plan for a checkpoint without a model (``laden plan``): each
    block is (name, its tensor names), stored as in the file; every other
    tensor is the rest of the model."""
    def add(h):
        inblock = {n for _, names in blocks for n in names}
        cb, ci = ctypes.c_uint32(), ctypes.c_uint32()
        check(lib.laden_sched_add_block(h, _lib.TIER_GPU, ctypes.byref(cb)))
        out = []
        groups = [(None, [n for n in ck.names() if n not in inblock])]
        for name, names in [*groups, *blocks]:
            if name is not None:
                check(lib.laden_sched_add_block(h, _lib.TIER_AUTO,
                                                ctypes.byref(cb)))
                out.append((name, cb.value))
            for n in names:
                check(lib.laden_sched_add_tensor(
                    h, cb.value, ck._h, ck._index[n],
                    _DTYPE_CODE[ck.info(n).dtype], ctypes.byref(ci)))
        return out
    return _plan_described(dev, ck, add, **kw)


@contextlib.contextmanager
def _schedule(dev, ck, lookahead: int):
    """A C schedule to describe a model to, never loaded."""
    h = new_schedule(dev, ck, lookahead)
    try:
        yield h
    finally:
        lib.laden_sched_destroy(h)


def mark_lossless(h, cache_dir: Optional[str] = None) -> int:
    """compression="lossless" on schedule `h`, before its plan: C takes
    the lossless cache files in `cache_dir` (laden_sched_use_lossless_cache:
    exact sizes, blobs read at load instead of encoded), marks the
    BF16/F16 tensors of the blocks that may stream and estimates their
    coded sizes (laden_sched_mark_lossless); how many it marked.  Cache
    files made from another version of their file are not taken (a
    warning says so)."""
    if cache_dir is not None:
        check(lib.laden_sched_use_lossless_cache(h, os.fsencode(cache_dir)))
        found, stale = ctypes.c_uint32(), ctypes.c_uint32()
        check(lib.laden_sched_lossless_cache_info(h, ctypes.byref(found),
                                                  ctypes.byref(stale)))
        if stale.value:
            log.warning("laden: %d lossless cache file(s) in %s were made "
                        "from another version of the checkpoint: not used "
                        "(run laden compress again)", stale.value, cache_dir)
    marked = ctypes.c_uint32()
    check(lib.laden_sched_mark_lossless(h, ctypes.byref(marked)))
    return marked.value


def lossless_cache_dir(compression, cache_dir, where: str) -> Optional[str]:
    """The lossless cache directory a load takes: `cache_dir`, else
    LADEN_LOSSLESS_CACHE when compression is asked; None without.  The
    compression is checked first."""
    check_compression(compression, where)
    if cache_dir is None and compression:
        cache_dir = os.environ.get("LADEN_LOSSLESS_CACHE") or None
    if cache_dir is None:
        return None
    cache_dir = os.path.expanduser(os.fspath(cache_dir))
    if not compression:
        raise InvalidArgumentError(
            f"{where}: lossless_cache={cache_dir!r} is read only with "
            "compression=\"lossless\"", "E_INVAL")
    return cache_dir


def check_compression(compression, where: str) -> None:
    if compression not in (None, "lossless"):
        raise InvalidArgumentError(
            f"{where}: compression={compression!r}: None or 'lossless'",
            "E_INVAL")


def _plan_described(dev, ck, add, *, lookahead: int = LOOKAHEAD, readings=None,
                    bandwidths=None, compression=None, lossless_cache=None,
                    **budgets) -> Plan:
    path = ck.files[0] if ck is not None else None
    readings, bandwidths = _measured(dev, path, readings, bandwidths)
    inp = _plan_input(dev, lookahead=lookahead, readings=readings,
                      bandwidths=bandwidths, **budgets)
    lossless_cache = lossless_cache_dir(compression, lossless_cache, "plan")
    with _schedule(dev, ck, lookahead) as h:
        named = add(h)
        names = {i: n for n, i in named}
        if compression:
            mark_lossless(h, lossless_cache)
        why, res = plan_schedule(h, inp, names)
        sizes = [lib.laden_sched_block_bytes(h, i) for _, i in named]
        ram = [lib.laden_sched_block_ram_bytes(h, i) for _, i in named]
        tiers = [lib.laden_sched_block_tier(h, i) for _, i in named]
        return _plan([n for n, _ in named], sizes, tiers,
                     [why[i] for _, i in named], res, inp,
                     lib.laden_sched_block_bytes(h, 0), dev, path, readings,
                     bandwidths, lookahead,
                     budgets.get("activation_vram") is not None,
                     ram_sizes=ram if compression else None,
                     compression=compression)


def measure_activation_vram(fn, plan: Optional[Plan] = None,
                            device=None) -> int:
    """Runs ``fn()`` once and returns the peak device memory it used beyond
    the weights (laden's weights are not in PyTorch's allocator, so this is
    PyTorch's peak above its level before the call) on ``device`` (default:
    the plan's, else the current CUDA device).  0 on the CPU."""
    import torch

    if plan is not None and device is not None and \
            _device(device) != _device(plan.device):
        raise InvalidArgumentError(
            f"measure_activation_vram: the plan is for {plan.device}, not "
            f"{_device(device)}", "E_INVAL")
    dev = _device(device if device is not None else
                  plan.device if plan is not None else None)
    if dev.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.max_memory_allocated(dev) - base)
