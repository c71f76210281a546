"""Reading a trace that laden wrote: the summary and the picture of
``laden trace show``.  The events and their times are C's (laden.trace);
this only adds them up and draws them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ._units import fmt_bytes
from .checkpoint import read_text
from .errors import InvalidArgumentError, LadenError

Span = Tuple[float, float]  # start, end in microseconds


@dataclass
class TraceData:
    path: str
    seconds: float
    dropped: int
    events: List[dict]
    tracks: Dict[int, str]  # tid -> name
    spans: List[dict]  # complete events (X and closed B/E), with "end"
    counters: Dict[str, List[Tuple[float, int]]]


def load(path: str) -> TraceData:
    """Reads a trace file written by laden.trace; InvalidArgumentError
    naming the file when it is not one (not JSON, nested deeper than a
    trace is, numbers no trace holds: NaN, infinities, times or byte
    counts out of range)."""
    try:  # read and checked by C: NaN, infinities, nesting refused there
        doc = read_text(path, 1 << 36, is_json=True)
    except LadenError as e:
        raise InvalidArgumentError(f"trace {e}", "E_INVAL") from None
    if not isinstance(doc, dict) or not isinstance(
            doc.get("traceEvents"), list):
        raise InvalidArgumentError(
            f"trace {path}: no traceEvents list (not a trace laden wrote)",
            "E_INVAL")
    other = doc.get("otherData") or {}
    events = doc["traceEvents"]
    try:
        if not isinstance(other, dict):
            raise TypeError(f"otherData {type(other).__name__} is not an "
                            "object")
        tracks, spans, counters = _parse(events)
        seconds = _time(other.get("seconds", 0.0), "otherData.seconds",
                        _MAX_S)
        dropped = _count(other.get("dropped_events", 0),
                         "otherData.dropped_events")
    except (KeyError, TypeError, AttributeError, ValueError,
            OverflowError) as e:
        raise InvalidArgumentError(
            f"trace {path}: an event laden does not write ({e!r}): not a "
            "trace of laden.trace", "E_INVAL") from None
    return TraceData(path, seconds, dropped, events, tracks, spans, counters)


# Bounds no trace laden writes comes near: times in microseconds (a
# year), counts and bytes below 2**63.
_MAX_US = 3.2e13
_MAX_S = _MAX_US / 1e6
_MAX_COUNT = 2**63 - 1


def _time(v, what: str, bound: float = _MAX_US) -> float:
    """A time (or duration) of the trace: a number from 0 to `bound`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} {v!r} is not a number")
    v = float(v)
    if not 0 <= v <= bound:
        raise ValueError(f"{what} {v!r} is out of range")
    return v


def _count(v, what: str) -> int:
    """A count or a byte number: a whole number from 0 below 2**63."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} {v!r} is not a whole number")
    if not 0 <= v <= _MAX_COUNT:
        raise ValueError(f"{what} {_short(v)} is out of range")
    return v


def _short(v: int) -> str:
    return str(v) if abs(v) < 10**15 else f"{float(v):.3g}"


_INTS = ("bytes", "streamed", "miss", "block", "schedule", "read_bytes",
         "cached_bytes", "offset", "upload_bytes", "evicted_bytes",
         "mapped_bytes")
_STRS = ("cause", "on", "model", "file", "name", "device")


def _checked(e: dict) -> dict:
    """The event with its args as summarize and plot read them: numbers
    as numbers, names as strings (TypeError / ValueError otherwise)."""
    args = e.get("args", {})
    if not isinstance(args, dict):
        raise TypeError(f"args {args!r} is not an object")
    a = dict(args)
    for k in _INTS:
        if k in a and not isinstance(a[k], bool):
            v = a[k]
            if isinstance(v, str):
                v = int(v, 10)
            if isinstance(v, float):
                v = int(v)  # finite: parse_float refuses the rest
            a[k] = _count(v, f"args.{k}") if k != "offset" else \
                _signed(v, f"args.{k}")
    for k in _STRS:
        if k in a and not isinstance(a[k], str):
            raise TypeError(f"args.{k} {a[k]!r} is not a string")
    if "tid" in e and not isinstance(e["tid"], int):
        raise TypeError(f"tid {e['tid']!r} is not a number")
    for k in ("ts", "dur"):
        if k in e:
            e = dict(e)
            e[k] = _time(e[k], k)
    e = dict(e)
    e["args"] = a
    return e


def _signed(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} {v!r} is not a whole number")
    if not -_MAX_COUNT <= v <= _MAX_COUNT:
        raise ValueError(f"{what} {_short(v)} is out of range")
    return v


def _parse(events):
    tracks: Dict[int, str] = {}
    spans: List[dict] = []
    counters: Dict[str, List[Tuple[float, int]]] = {}
    open_: Dict[int, List[dict]] = {}
    for e in events:
        if not isinstance(e, dict):
            raise TypeError(f"{e!r} is not an object")
        e = _checked(e)
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            tracks[e.get("tid", 0)] = e.get("args", {}).get("name", "")
        elif ph == "X":
            s = dict(e)
            s["ts"] = float(e["ts"])
            s["dur"] = float(e.get("dur", 0.0))
            s["end"] = s["ts"] + s["dur"]
            spans.append(s)
        elif ph == "B":
            open_.setdefault(e.get("tid", 0), []).append(e)
        elif ph == "E":
            stack = open_.get(e.get("tid", 0))
            if stack:
                b = dict(stack.pop())
                b["ts"] = float(b["ts"])
                b["end"] = float(e["ts"])
                b["dur"] = b["end"] - b["ts"]
                spans.append(b)
        elif ph == "C":
            v = next(iter(e.get("args", {}).values()), 0)
            if isinstance(v, float):
                v = int(v)
            counters.setdefault(str(e["name"]), []).append(
                (float(e["ts"]), _signed(v, "counter value")))
    for c in counters.values():
        c.sort()
    spans.sort(key=lambda s: s["ts"])
    return tracks, spans, counters


def union_us(intervals: List[Span]) -> float:
    """Microseconds covered by the union of the intervals."""
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


@dataclass
class Summary:
    seconds: float
    blocks: int = 0
    streamed: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    h2d_busy_us: float = 0.0
    h2d_window_us: float = 0.0
    h2d_copies: int = 0
    read_bytes: int = 0
    read_busy_us: float = 0.0
    stall_us: Dict[str, float] = field(default_factory=dict)
    top_stalls: List[dict] = field(default_factory=list)
    syncs: int = 0
    sync_us: float = 0.0
    expands: int = 0  # blocks' compact tensors expanded (or decoded)
    expand_us: float = 0.0
    decodes: int = 0  # of those, with lossless tensors
    peaks: Dict[str, int] = field(default_factory=dict)
    link_gb_per_s: Optional[float] = None
    dropped: int = 0

    @property
    def copy_busy(self) -> float:
        """The share of the window from the first copy to the last that
        the copy lane was busy."""
        return self.h2d_busy_us / self.h2d_window_us \
            if self.h2d_window_us > 0 else 0.0

    @property
    def h2d_gb_per_s(self) -> float:
        """Bytes copied per second of copying."""
        return self.h2d_bytes / self.h2d_busy_us / 1e3 \
            if self.h2d_busy_us > 0 else 0.0

    def text(self) -> str:
        ms = 1e-3
        out = [f"laden trace: {self.seconds:.3f} s, {self.blocks} block "
               f"calls ({self.streamed} streamed, {self.misses} misses)"]
        if self.h2d_copies:
            line = (f"  h2d: {self.h2d_copies} copies, "
                    f"{fmt_bytes(self.h2d_bytes)} in "
                    f"{self.h2d_busy_us * ms:.1f} ms of copying "
                    f"({self.h2d_gb_per_s:.1f} GB/s); copy lane busy "
                    f"{100 * self.copy_busy:.1f}% from the first copy to "
                    "the last")
            if self.link_gb_per_s:
                line += (f"; {100 * self.h2d_gb_per_s / self.link_gb_per_s:.0f}"
                         f"% of the link ({self.link_gb_per_s:.1f} GB/s)")
            out.append(line)
        if self.read_bytes:
            out.append(f"  read: {fmt_bytes(self.read_bytes)}, readers "
                       f"busy {self.read_busy_us * ms:.1f} ms")
        lost = sum(self.stall_us.values())
        out.append(f"  stalls: {lost * ms:.2f} ms waited"
                   + ("" if not self.stall_us else " (" + ", ".join(
                       f"{k} {v * ms:.2f} ms" for k, v in
                       sorted(self.stall_us.items())) + ")"))
        for s in self.top_stalls:
            a = s.get("args", {})
            what = s.get("name", "").replace("stall: ", "", 1)
            out.append(f"    {s['dur'] * ms:8.3f} ms at {s['ts'] * ms:9.3f} ms"
                       f": {what} (schedule {a.get('schedule')}, waited "
                       f"on the {a.get('on', '?')})")
        if self.h2d_copies and self.copy_busy >= 0.95 and \
                self.stall_us.get("copy", 0) > 0:
            out.append("  bound by the copies: the copy lane was busy from "
                       "the first copy to the last, and compute waited "
                       "for it (more of the model resident, or a faster "
                       "link, is what would help)")
        elif self.h2d_copies and self.copy_busy < 0.95:
            out.append(f"  the copy lane idled "
                       f"{100 * (1 - self.copy_busy):.1f}% of the time "
                       "between copies: compute, reads or the host set the "
                       "pace (see the stalls)")
        if self.expands:
            out.append(f"  expansions before blocks ran: {self.expands} "
                       f"({self.decodes} with lossless tensors decoded), "
                       f"{self.expand_us * ms:.2f} ms")
        out.append(f"  host synchronizations: {self.syncs} "
                   f"({self.sync_us * ms:.2f} ms)")
        for name, v in sorted(self.peaks.items()):
            out.append(f"  peak {name}: {fmt_bytes(v)}")
        if self.dropped:
            out.append(f"  {self.dropped} events dropped (max_events)")
        return "\n".join(out)


def summarize(t: TraceData, link_gb_per_s: Optional[float] = None,
              top: int = 5) -> Summary:
    """Adds up the trace: time lost to stalls by cause and the longest
    stalls, copy lane use, bytes read, host synchronizations, peaks of the
    memory counters."""
    s = Summary(seconds=t.seconds, link_gb_per_s=link_gb_per_s,
                dropped=t.dropped)
    copies: List[Span] = []
    reads: List[Span] = []
    stalls = []
    for e in t.spans:
        cat = e.get("cat")
        if cat == "block":
            s.blocks += 1
            a = e.get("args", {})
            s.streamed += int(a.get("streamed", 0))
            s.misses += int(a.get("miss", 0))
        elif cat == "h2d":
            s.h2d_copies += 1
            s.h2d_bytes += int(e.get("args", {}).get("bytes", 0))
            copies.append((e["ts"], e["end"]))
        elif cat == "read":
            s.read_bytes += int(e.get("args", {}).get("bytes", 0))
            reads.append((e["ts"], e["end"]))
        elif cat == "stall":
            cause = e.get("args", {}).get("cause", "?")
            s.stall_us[cause] = s.stall_us.get(cause, 0.0) + e["dur"]
            stalls.append(e)
        elif cat == "sync":
            s.syncs += 1
            s.sync_us += e["dur"]
        elif cat == "expand":
            s.expands += 1
            s.expand_us += e["dur"]
            s.decodes += e.get("name", "").startswith("decode ")
    if copies:
        s.h2d_busy_us = union_us(copies)
        s.h2d_window_us = max(b for _, b in copies) - min(a for a, _ in copies)
    s.read_busy_us = union_us(reads)
    s.top_stalls = sorted(stalls, key=lambda e: -e["dur"])[:top]
    for name, pts in t.counters.items():
        s.peaks[name] = max(v for _, v in pts)
    return s


_COLORS = {"h2d": "#1f77b4", "compute": "#2ca02c", "stall": "#d62728",
           "read": "#ff7f0e", "sync": "#9467bd", "block": "#7f7f7f",
           "load": "#bcbd22", "cache": "#17becf", "range": "#c7c7c7",
           "expand": "#8c564b"}


def plot(t: TraceData, out: str, link_gb_per_s: Optional[float] = None,
         title: Optional[str] = None) -> str:
    """Draws the timeline to `out` (PNG): one lane per thread and stream,
    stalls in red; the copy rate against the link; the memory counters."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError(
            "laden trace show -o needs matplotlib: pip install matplotlib",
            "E_INVAL") from None
    ms = 1e-3
    lanes: Dict[int, List[dict]] = {}
    for e in t.spans:
        if e.get("cat") in ("range",):
            continue
        lanes.setdefault(e.get("tid", 0), []).append(e)

    def order(tid):
        name = t.tracks.get(tid, "")
        return (0 if "stream" in name else 1, name, tid)

    tids = sorted(lanes, key=order)
    fig, axes = plt.subplots(3, 1, figsize=(14, 2.2 + 0.45 * len(tids) + 5),
                             sharex=True, gridspec_kw={
                                 "height_ratios": [max(2, len(tids)), 2, 2]})
    ax = axes[0]
    for row, tid in enumerate(tids):
        by: Dict[str, List[Tuple[float, float]]] = {}
        for e in lanes[tid]:
            # a block's host span under the stream lanes' finer work
            by.setdefault(e.get("cat", ""), []).append(
                (e["ts"] * ms, max(e.get("dur", 0.0) * ms, 1e-3)))
        for cat, bars in by.items():
            h = 0.35 if cat in ("block", "load") else 0.7
            ax.broken_barh(bars, (row - h / 2, h),
                           facecolors=_COLORS.get(cat, "#333333"),
                           edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([t.tracks.get(tid, str(tid)) for tid in tids],
                       fontsize=8)
    ax.invert_yaxis()
    from matplotlib.patches import Patch
    used = {e.get("cat") for e in t.spans}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()
                       if k in used], loc="upper right", fontsize=7,
              ncol=4)
    ax.set_title(title or os.path.basename(t.path))
    # the copy rate, per bin
    ax = axes[1]
    copies = [e for e in t.spans if e.get("cat") == "h2d"]
    if copies:
        t0 = min(e["ts"] for e in copies)
        t1 = max(e["end"] for e in copies)
        nbins = 200
        w = max((t1 - t0) / nbins, 1.0)
        bins = [0.0] * nbins
        for e in copies:
            n = e.get("args", {}).get("bytes", 0)
            dur = max(e["end"] - e["ts"], 1e-3)
            a, b = e["ts"], e["end"]
            k = int((a - t0) // w)
            while a < b and k < nbins:
                edge = t0 + (k + 1) * w
                part = min(b, edge) - a
                bins[k] += n * part / dur
                a = edge
                k += 1
        xs = [(t0 + (i + 0.5) * w) * ms for i in range(nbins)]
        ax.plot(xs, [v / w / 1e3 for v in bins], color=_COLORS["h2d"],
                label="h2d GB/s")
        if link_gb_per_s:
            ax.axhline(link_gb_per_s, color="k", ls="--", lw=0.8,
                       label=f"link {link_gb_per_s:.1f} GB/s")
        ax.legend(loc="lower right", fontsize=7)
        top = max([v / w / 1e3 for v in bins] + [link_gb_per_s or 0])
        ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_ylabel("GB/s")
    ax = axes[2]
    for name, pts in sorted(t.counters.items()):
        xs = [p[0] * ms for p in pts]
        ys = [p[1] / 1e9 for p in pts]
        if xs:
            xs.append(t.seconds * 1e3)
            ys.append(ys[-1])
            ax.step(xs, ys, where="post", label=name, lw=1)
    if t.counters:
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.set_ylabel("GB")
    ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
