"""One host copy of a model for the processes of a host (shared=True):
the first load reads the checkpoint into shared memory, the others attach
and read nothing, the last release removes it; processes of a group
(gloo) share one copy and host RAM grows by about one model, not one per
process; mismatched checkpoints between ranks are refused; the shared
copy is never written."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import laden
from models import Block

HERE = os.path.dirname(os.path.abspath(__file__))


class Net(nn.Module):
    def __init__(self, d=32, h=64, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A directory for the segments in /dev/shm (tmpfs, which CUDA can
    pin; a regular file system's pages it cannot), else under tmp_path."""
    import pathlib
    import shutil
    import tempfile
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = pathlib.Path(tempfile.mkdtemp(prefix="laden-test-",
                                          dir="/dev/shm"))
    else:
        d = tmp_path / "shm"
        d.mkdir()
    monkeypatch.setenv("LADEN_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def segments(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("laden-"))


def saved(tmp_path, name="m.safetensors", seed=0, **kw):
    torch.manual_seed(seed)
    ref = Net(**kw).eval()
    path = str(tmp_path / name)
    laden.save_file(ref.state_dict(), path)
    return ref, path


def streamed(path, **kw):
    with torch.device("meta"):
        m = Net().eval()
    rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                            device="cpu", shared=True, **kw)
    return m, rep


def test_second_load_attaches_and_reads_nothing(tmp_path, shm_dir):
    ref, path = saved(tmp_path)
    x = torch.randn(3, 32)
    want = ref(x)
    a, ra = streamed(path)
    assert ra.shared is not None and ra.shared.how == "made"
    assert ra.read_bytes > 0
    assert segments(shm_dir) == ["laden-" + ra.shared.name]
    b, rb = streamed(path)
    assert rb.shared.how == "attached"
    assert rb.shared.name == ra.shared.name
    assert rb.shared.nbytes == ra.shared.nbytes
    assert rb.read_bytes == 0  # everything is in the shared copy
    assert "attached to another process's" in str(rb)
    ha = laden.install_offload(a)
    hb = laden.install_offload(b)
    with torch.no_grad():
        assert torch.equal(a(x), want)
        assert torch.equal(b(x), want)
    # The weights of both are the same memory pages (two mappings of
    # one segment): not two copies.
    pa = a.head.weight.data_ptr()
    pb = b.head.weight.data_ptr()
    assert pa != pb

    def inode_of(ptr):  # of the file mapped there
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return int(line.split()[4])
    seg = os.stat(shm_dir / ("laden-" + ra.shared.name))
    assert inode_of(pa) == inode_of(pb) == seg.st_ino
    ha.remove()
    hb.remove()
    laden.release(a)
    assert segments(shm_dir)  # b still uses it
    with torch.no_grad():
        assert torch.equal(b(x), want)
    laden.release(b)
    assert segments(shm_dir) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streams_from_one_pinned_copy(tmp_path, shm_dir):
    """Two models on one GPU (two devices or processes would be the
    same): the streamed blocks' host copy is one segment, pinned by each;
    the rest is each model's own on the device."""
    ref, path = saved(tmp_path)
    ref = ref.cuda()
    x = torch.randn(3, 32, device="cuda")
    want = ref(x)
    models, reps = [], []
    for _ in range(2):
        with torch.device("meta"):
            m = Net().eval()
        reps.append(laden.stream_load(m, path, offload_prefixes=["blocks."],
                                      device="cuda", shared=True))
        models.append(m)
    assert [r.shared.how for r in reps] == ["made", "attached"]
    assert reps[1].read_bytes == reps[0].read_bytes - sum(
        t.numel() * t.element_size() for n, t in ref.state_dict().items()
        if n.startswith("blocks."))
    hs = [laden.install_offload(m) for m in models]
    with torch.no_grad():
        for m, h in zip(models, hs):
            assert torch.equal(m(x), want)
            assert h.stats()["h2d_bytes"] > 0  # streamed from the copy
    for m in models:
        laden.release(m)
    assert segments(shm_dir) == []


def test_another_checkpoint_or_layout_is_another_copy(tmp_path, shm_dir):
    _, p1 = saved(tmp_path, "a.safetensors", seed=0)
    _, p2 = saved(tmp_path, "b.safetensors", seed=1)
    a, ra = streamed(p1)
    b, rb = streamed(p2)
    c, rc = streamed(p1, compute_dtype=torch.bfloat16)
    assert {ra.shared.how, rb.shared.how, rc.shared.how} == {"made"}
    assert len({ra.shared.name, rb.shared.name, rc.shared.name}) == 3
    assert len(segments(shm_dir)) == 3
    for m in (a, b, c):
        laden.release(m)
    assert segments(shm_dir) == []


def test_shared_copy_is_never_written(tmp_path, shm_dir):
    _, path = saved(tmp_path)
    m, _ = streamed(path)
    with pytest.raises(laden.StateError, match="shared with other"):
        laden.install_offload(m, train=True)
    h = laden.install_offload(m)
    sd = {"blocks.0.up.lora_A.weight": torch.randn(2, 32),
          "blocks.0.up.lora_B.weight": torch.randn(64, 2)}
    spec = laden.AdapterSpec("lora", lambda: dict(sd))
    with pytest.raises(laden.StateError, match="shared with other"):
        h.set_adapters([spec])
    h.set_adapters([spec], mode="routed")  # the weights stay
    h.set_adapters([])
    with pytest.raises(laden.StateError, match="shared with other"):
        laden.merge_adapter(m, spec)
    h.remove()
    laden.release(m)


def test_bad_shared_argument(tmp_path, shm_dir):
    _, path = saved(tmp_path)
    with torch.device("meta"):
        m = Net()
    with pytest.raises(laden.InvalidArgumentError, match="shared="):
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device="cpu", shared="yes")
    with pytest.raises(laden.InvalidArgumentError, match="shared must"):
        laden.ModelSpec("k", Net, checkpoint=path, shared=1)


def test_model_cache_shared(tmp_path, shm_dir):
    ref, path = saved(tmp_path)
    x = torch.randn(2, 32)
    want = ref(x)

    def meta_net():
        with torch.device("meta"):
            return Net().eval()

    caches = [laden.ModelCache() for _ in range(2)]
    for c in caches:
        c.register(laden.ModelSpec("net", meta_net, checkpoint=path,
                                   block_paths=["blocks"], shared=True))
    got = []
    for c in caches:
        with c.use("net", device="cpu") as m, torch.no_grad():
            assert torch.equal(m(x), want)
        got.append(c.info("net").shared)
    assert [g.how for g in got] == ["made", "attached"]
    assert got[0].name == got[1].name
    for c in caches:
        c.clear()
    assert segments(shm_dir) == []


# ---- several processes (torch.distributed, gloo) -----------------------------

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    import laden
    from test_shared import Net

    def kb(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def rss_of_inode(ino):
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                    inside = int(head[4]) == ino
                elif inside and head[0] == "Rss:":
                    total += int(head[1]) * 1024
        return total

    rank = int(sys.argv[1]); world = int(sys.argv[2])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[3],
                            rank=rank, world_size=world)
    if sys.argv[4] == "missing":  # rank 1 fails to load, rank 0 not
        path = sys.argv[5] if rank == 0 else "/nonexistent/x.safetensors"
    else:
        path = sys.argv[4 + (rank if len(sys.argv) > 5 else 0)]
    with torch.device("meta"):
        m = Net(d=512, h=2048, n=6).eval()
    dist.barrier()
    anon0 = kb("RssAnon")
    out = {{"rank": rank}}
    try:
        rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                                device="cpu", shared=dist.group.WORLD)
    except (laden.MismatchError, laden.StateError,
            laden.CheckpointNotFoundError) as e:
        out["error"] = f"{{type(e).__name__}}: {{e}}"
    else:
        laden.install_offload(m)
        torch.manual_seed(0)
        with torch.no_grad():
            y = m(torch.randn(4, 512))
        out.update(how=rep.shared.how, name=rep.shared.name,
                   nbytes=rep.shared.nbytes, read=rep.read_bytes,
                   y=y.sum().item(), anon=kb("RssAnon") - anon0,
                   mapped=rss_of_inode(os.stat(os.path.join(
                       os.environ["LADEN_SHM_DIR"],
                       "laden-" + rep.shared.name)).st_ino))
    dist.barrier()  # all hold their model here
    print(json.dumps(out), flush=True)
    dist.barrier()
    if "error" not in out:
        laden.release(m)
    dist.destroy_process_group()
""")


def run_group(tmp_path, paths, world):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(here=HERE))
    init = tmp_path / "pg"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + os.environ.get("PYTHONPATH", "").split(os.pathsep)),
        OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r),
                               str(world), str(init)] + paths,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(world)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, e[-3000:]
        outs.append(json.loads(o.strip().splitlines()[-1]))
    return outs


def test_group_shares_one_host_copy(tmp_path, shm_dir):
    torch.manual_seed(0)
    ref = Net(d=512, h=2048, n=6).eval()
    path = str(tmp_path / "big.safetensors")
    laden.save_file(ref.state_dict(), path)
    model_bytes = sum(t.numel() * t.element_size()
                      for t in ref.state_dict().values())
    torch.manual_seed(0)
    with torch.no_grad():
        want = ref(torch.randn(4, 512)).sum().item()
    world = 3
    outs = run_group(tmp_path, [path], world)
    print("model", model_bytes, "per process:",
          [{k: o[k] for k in ("how", "read", "anon", "mapped", "nbytes")}
           for o in outs])
    assert sorted(o["how"] for o in outs) == ["attached"] * (world - 1) + \
        ["made"]
    assert len({o["name"] for o in outs}) == 1
    for o in outs:
        assert o["y"] == pytest.approx(want, rel=1e-5, abs=1e-4)
        # Every process maps the one copy; none holds the weights in
        # private memory (the model is 50 MB; torch's own allocations
        # while loading and running stay far below it).
        assert o["mapped"] >= 0.9 * model_bytes, o
        assert o["anon"] < 0.5 * model_bytes, o
        if o["how"] == "attached":
            assert o["read"] == 0
    # The group's host copy: one segment of about one model.
    assert model_bytes <= outs[0]["nbytes"] <= 1.05 * model_bytes + (1 << 20)
    assert segments(shm_dir) == []  # the last to release removed it


def test_group_refuses_mismatched_checkpoints(tmp_path, shm_dir):
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        ref = Net(d=512, h=2048, n=6).eval()
        paths.append(str(tmp_path / f"c{seed}.safetensors"))
        laden.save_file(ref.state_dict(), paths[-1])
    outs = run_group(tmp_path, paths, 2)
    for o in outs:
        assert "did not load the same checkpoint" in o["error"]
        assert "ranks [0]" in o["error"] and "ranks [1]" in o["error"]
    assert segments(shm_dir) == []


def test_group_rank_that_fails_does_not_hang_the_others(tmp_path, shm_dir):
    torch.manual_seed(0)
    ref = Net(d=512, h=2048, n=6).eval()
    path = str(tmp_path / "ok.safetensors")
    laden.save_file(ref.state_dict(), path)
    outs = run_group(tmp_path, ["missing", path], 2)
    assert outs[1]["error"].startswith("CheckpointNotFoundError")
    assert outs[0]["error"].startswith("StateError")
    assert "rank 1" in outs[0]["error"]
    assert segments(shm_dir) == []


def test_group_with_background_is_refused(tmp_path, shm_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg1",
                            rank=0, world_size=1)
    try:
        _, path = saved(tmp_path)
        with torch.device("meta"):
            m = Net()
        with pytest.raises(laden.InvalidArgumentError, match="background"):
            laden.stream_load(m, path, offload_prefixes=["blocks."],
                              device="cpu", shared=dist.group.WORLD,
                              background=True)
    finally:
        dist.destroy_process_group()
