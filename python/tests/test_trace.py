"""laden.trace: the timeline C records of a streamed forward, checked from
the file it writes (valid Trace Event Format JSON): one enter/exit pair
per block call, one copy per streamed block call, each copy before its
block runs, counters as handle.stats() counts them; tracing changes no
output and no counter; ``laden trace show`` summarizes and draws it."""

import gc
import json
import os

import pytest
import torch

import laden
from laden import ModelCache, ModelSpec, cli
from laden.errors import InvalidArgumentError, StateError
from models import PREFIXES, on_meta, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCKS = ("blocks", "stages.0", "stages.1")
NBLOCKS = 11  # blocks of models.Tiny under PREFIXES


def ids(n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g)


@pytest.fixture
def ckpt(tmp_path):
    ref = reference()
    path = str(tmp_path / "tiny.safetensors")
    laden.save_file(ref.state_dict(), path)
    return ref, path


def read(path):
    with open(path) as f:
        doc = json.load(f)  # valid JSON, or this raises
    assert isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert e["ph"] in ("B", "E", "X", "i", "C", "M"), e
        assert isinstance(e["pid"], int)
        if e["ph"] != "M":
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    return doc["traceEvents"]


def pairs(events):
    """(B, E) of each block call, matched per thread as a viewer does."""
    open_, out = {}, []
    for e in events:
        if e.get("cat") != "block":
            continue
        if e["ph"] == "B":
            open_.setdefault(e["tid"], []).append(e)
        else:
            out.append((open_[e["tid"]].pop(), e))
    assert all(not v for v in open_.values())  # every B closed
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_forward_from_disk(ckpt, tmp_path, device):
    ref, path = ckpt
    with torch.no_grad():
        want = ref.to(device)(ids().to(device))
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      ram_budget=0)
    h = laden.install_offload(m, lookahead=2)
    x = ids().to(device)
    with torch.no_grad():
        m(x)  # the first pass: reads begin
        s0 = h.stats()
        assert torch.equal(m(x), want)  # untraced
        s1 = h.stats()
        out = str(tmp_path / "t.json")
        with laden.trace(out) as t:
            got = m(x)
        if device == "cuda":
            torch.cuda.synchronize()
        s2 = h.stats()
    assert torch.equal(got, want)  # tracing changes no output ...
    # ... and no counter (read_bytes and h2d_bytes count a disk block's
    # reads and copy as its reads are found done, which timing decides)
    for k in ("enters", "misses"):
        assert s2[k] - s1[k] == s1[k] - s0[k], k
    assert t.dropped == 0 and t.unresolved == 0 and t.events > 0
    ev = read(out)
    calls = pairs(ev)
    assert len(calls) == NBLOCKS  # one pair per block call
    assert sum(b["args"]["streamed"] for b, _ in calls) == \
        s2["enters"] - s1["enters"]
    assert sum(b["args"]["miss"] for b, _ in calls) == \
        s2["misses"] - s1["misses"]
    assert {b["args"]["model"] for b, _ in calls} == {"model Tiny"}
    reads = [e for e in ev if e.get("cat") == "read"]
    # The reads of this pass, and the prefetch's of the next one's
    # first blocks: bytes as the counters have them, give or take those.
    assert reads and all(e["args"]["file"] == path for e in reads)
    h2d = [e for e in ev if e.get("cat") == "h2d"]
    assert sum(e["args"]["bytes"] for e in h2d) == \
        s2["h2d_bytes"] - s1["h2d_bytes"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and
             e["name"] == "thread_name"}
    assert "laden-io" in names
    laden.release(m, h)


@pytest.mark.parametrize("device", DEVICES)
def test_one_copy_per_streamed_block_call(tmp_path, device):
    """RAM-tier blocks streamed through fewer slots than blocks: every
    streamed call is one host-to-device copy (the cache's streaming mode
    on the CPU, stream_load's RAM tier on CUDA), each copy ends before its
    block runs, and on CUDA the steady state has no host synchronization."""
    x = ids().to(device)
    passes = 3
    if device == "cpu":
        sp = ModelSpec("m0", lambda: reference(0), block_paths=BLOCKS)
        probe = ModelCache()
        with probe.use(sp, device="cpu"):
            pass
        cache = ModelCache(vram_budget=probe.info("m0").size_bytes * 2 // 3)
        with cache.use(sp, device="cpu") as m, torch.no_grad():
            want = m(x)
            m(x)
        out = str(tmp_path / "t.json")
        with laden.trace(out):
            with cache.use(sp, device="cpu") as m, torch.no_grad():
                for _ in range(passes):
                    assert torch.equal(m(x), want)
    else:
        ref = reference(0)
        path = str(tmp_path / "m.safetensors")
        laden.save_file(ref.state_dict(), path)
        m = on_meta()
        laden.stream_load(m, path, offload_prefixes=PREFIXES,
                          device=device)  # the blocks stream from RAM
        h = laden.install_offload(m, lookahead=2)
        with torch.no_grad():
            want = ref.to(device)(x)
            m(x)
            m(x)
            # What earlier tests left for the garbage collector (their
            # schedules' frees wait on events) goes before the trace,
            # which records the whole process.
            gc.collect()
            torch.cuda.synchronize()
            out = str(tmp_path / "t.json")
            with laden.trace(out):
                for _ in range(passes):
                    assert torch.equal(m(x), want)
            torch.cuda.synchronize()
    ev = read(out)
    if device == "cpu":  # the activation, in the cache's words
        act = [e for e in ev if e.get("cat") == "cache"]
        assert len(act) == 1 and act[0]["name"] == "cache activate"
        assert "upload_bytes" in act[0]["args"]
    calls = pairs(ev)
    streamed = [(b, e) for b, e in calls if b["args"]["streamed"]]
    assert streamed
    h2d = sorted((e for e in ev if e.get("cat") == "h2d"),
                 key=lambda e: e["ts"])
    assert len(h2d) == len(streamed)
    if device == "cuda":
        # Each compute span on the stream starts after the latest copy of
        # its block ended; none of the steady state waits on the host.
        comp = [e for e in ev if e.get("cat") == "compute"]
        assert len(comp) == len(streamed)
        checked = 0
        for c in comp:
            prior = [e for e in h2d if e["args"]["block"] == c["args"]["block"]
                     and e["ts"] <= c["ts"]]
            if prior:
                last = prior[-1]
                assert last["ts"] + last["dur"] <= c["ts"] + 1.0
                checked += 1
        assert checked >= len(comp) - 2 * NBLOCKS // 3
        syncs = [e for e in ev if e.get("cat") == "sync"]
        assert not syncs, [(e["name"], e.get("tid"), e.get("args")) for e in
                           syncs[:8]]
    else:
        # The CPU device's copy worker: the block's call waits for it
        # (the first blocks' copies may precede the trace).
        checked = 0
        for b, e in streamed:
            prior = [c for c in h2d if c["args"]["block"] == b["args"]["block"]
                     and c["ts"] <= e["ts"]]
            if prior:
                assert prior[-1]["ts"] + prior[-1]["dur"] <= e["ts"] + 1.0
                checked += 1
        assert checked >= len(streamed) - 2 * NBLOCKS // 3


def test_show_prints_and_draws(ckpt, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _, path = ckpt
    m = on_meta()
    out = str(tmp_path / "t.json")
    with laden.trace(out) as t:
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          ram_budget=0)
        laden.install_offload(m, lookahead=2)
        with t.range("forwards"), torch.no_grad():
            m(ids())
            m(ids())
    text = t.summary()
    assert "block calls" in text and "stalls:" in text
    png = str(tmp_path / "timeline.png")
    assert cli.main(["trace", "show", out, "-o", png]) == 0
    printed = capsys.readouterr().out
    assert "laden trace:" in printed and png in printed
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # read by a pager that stops at the first line, long before the
    # picture's line is printed: no error, no traceback
    import subprocess
    import sys
    p = subprocess.run(f"{sys.executable} -m laden trace show {out} -o "
                       f"{png} | head -1", shell=True, capture_output=True,
                       text=True, env=dict(os.environ))
    assert p.stdout.startswith("laden trace:") and p.stderr == ""
    ev = read(out)
    assert [e for e in ev if e.get("cat") == "load"]
    assert [e for e in ev if e.get("cat") == "range" and e["ph"] == "B"]
    laden.release(m)


def test_refusals(tmp_path, capsys):
    with laden.trace(None) as t:
        with pytest.raises(StateError):
            laden.trace(None).__enter__()  # one at a time
        with pytest.raises(StateError):
            t.summary()
    with pytest.raises(StateError):
        t.stop()  # ended already
    with pytest.raises(InvalidArgumentError, match="no directory"):
        laden.trace(str(tmp_path / "missing" / "t.json")).__enter__()
    assert not laden._lib.lib.laden_trace_active()
    with pytest.raises(InvalidArgumentError):
        laden.trace(max_events=-1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["trace", "show", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    for doc in ('{"traceEvents":[1]}', '{"traceEvents":[{"ph":"X"}]}',
                '{"traceEvents":[{"ph":"X","ts":0,"cat":"h2d","args":null}]}',
                '{"traceEvents":[{"ph":"X","ts":0,"cat":"stall",'
                '"args":{"cause":[1]}}]}',
                '{"traceEvents":[{"ph":"B","ts":0,"cat":"block",'
                '"args":{"streamed":[]}},{"ph":"E","ts":1}]}',
                '{"traceEvents":[{"ph":"C","name":"x","ts":0,'
                '"args":{"b":"many"}}]}', '[]'):
        bad.write_text(doc)
        assert cli.main(["trace", "show", str(bad)]) == 2
        assert "not a trace" in capsys.readouterr().err
    # a bytes path works; an error inside the with block is not masked
    with laden.trace(os.fsencode(str(tmp_path / "b.json"))) as t:
        pass
    assert t.events >= 1 and os.path.exists(tmp_path / "b.json")
    with pytest.raises(ZeroDivisionError):
        with laden.trace(str(tmp_path / "c.json")):
            1 / 0
    assert not laden._lib.lib.laden_trace_active()
    # ... also when writing the trace fails too: the block's error is the
    # one raised, and the trace is off
    gone = tmp_path / "gone"
    gone.mkdir()
    with pytest.raises(ZeroDivisionError):
        with laden.trace(str(gone / "t.json")):
            gone.rmdir()
            1 / 0
    assert not laden._lib.lib.laden_trace_active()
    # without an error in the block, the failure to write is raised
    gone.mkdir()
    with pytest.raises(laden.LadenError, match="t.json"):
        with laden.trace(str(gone / "t.json")):
            gone.rmdir()
    assert not laden._lib.lib.laden_trace_active()
    assert cli.main(["trace"]) == 2


def rounded(n):
    """Bytes as PyTorch's caching allocator counts a block of n."""
    return (n + 511) // 512 * 512


def counter(ev, name):
    return [(e["ts"], e["args"]["bytes"]) for e in ev
            if e["ph"] == "C" and e["name"].endswith(" " + name)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_activation_measures_match_the_trace(ckpt, tmp_path):
    """measure_activation_vram and stage's remembered peak equal what the
    trace's counters of PyTorch's allocator show: the peak at the last
    block's exit over the allocation at the first block's entry."""
    from laden.streaming import remembered_activation_vram
    _, path = ckpt
    x = ids(n=257).cuda()
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cuda")
    laden.install_offload(m, lookahead=2)
    out = str(tmp_path / "a.json")

    def blocks_only():
        with torch.no_grad():
            h = m.embed(x)
            for b in m.blocks:
                h = b(h)
            return h

    with laden.trace(out):
        act = laden.measure_activation_vram(blocks_only)
    ev = read(out)
    alloc, peak = counter(ev, "torch_allocated_bytes"), \
        counter(ev, "torch_peak_bytes")
    assert alloc and peak
    # The embedding's output is allocated before the first block: the
    # base is the first entry's allocation less it.
    first_in = alloc[0][1] - rounded(x.numel() * m.embed.weight.shape[1] * 4)
    assert act == peak[-1][1] - first_in
    assert act > 0
    laden.release(m)

    key = "trace-stage"
    with laden.trace(out):
        with laden.stage(on_meta, path, key=key, device="cuda",
                         offload_prefixes=PREFIXES,
                         resident_blocks=0) as (sm, _):  # all stream
            with torch.no_grad():
                h = sm.embed(x)
                for b in sm.blocks:
                    h = b(h)
    got = remembered_activation_vram(key)
    ev = read(out)
    alloc, peak = counter(ev, "torch_allocated_bytes"), \
        counter(ev, "torch_peak_bytes")
    base = alloc[0][1] - rounded(x.numel() * sm.embed.weight.shape[1] * 4)
    assert got >= peak[-1][1] - base > 0


def test_show_refuses_hostile_numbers_and_nesting(tmp_path, capsys):
    """A trace file nested deeper than Python's JSON reader goes, or with
    NaN, infinities or numbers no trace holds (times of 1e300, byte
    counts beyond 2**63): one line of error and status 2, with and
    without -o, never a traceback (RecursionError, OverflowError)."""
    x = '{"ph":"X","ts":%s,"dur":%s,"cat":"h2d","args":{"bytes":%s}}'
    docs = {
        "nested": '{"traceEvents":' + "[" * 100000 + "]" * 100000 + "}",
        "nested args": '{"traceEvents":[{"ph":"X","ts":0,"args":'
                       + '{"a":' * 50000 + "1" + "}" * 50000 + "}]}",
        "inf ts": '{"traceEvents":[%s]}' % (x % ("1e999", "1", "1")),
        "inf bytes": '{"traceEvents":[%s]}' % (x % ("0", "1", "1e999")),
        "nan": '{"traceEvents":[%s]}' % (x % ("NaN", "1", "1")),
        "huge": '{"traceEvents":[%s]}' % (x % ("1e300", "1e300", "1e300")),
        "huge int": '{"traceEvents":[%s]}' % (x % ("0", "1", "9" * 30)),
        "digits": '{"traceEvents":[%s]}' % (x % ("0", "1", "9" * 5000)),
        "counter": '{"traceEvents":[{"ph":"C","name":"m","ts":0,'
                   '"args":{"b":1e999}}]}',
        "seconds": '{"traceEvents":[],"otherData":{"seconds":1e308,'
                   '"dropped_events":1e300}}',
        "other": '{"traceEvents":[],"otherData":[1]}',
    }
    bad = tmp_path / "bad.json"
    for name, doc in docs.items():
        bad.write_text(doc)
        for extra in ([], ["-o", str(tmp_path / "t.png")]):
            assert cli.main(["trace", "show", str(bad)] + extra) == 2, name
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1, (name, err)
            assert "laden trace: error:" in err and "bad.json" in err, err
            assert "Traceback" not in err
