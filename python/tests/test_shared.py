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


# ---- what dead users leave, and names held by something else (issue 33) --------

USER = r"""
import os, signal, sys, time
sys.path.insert(0, {here!r})
import torch, laden
from test_shared import Net
with torch.device("meta"):
    m = Net().eval()
laden.stream_load(m, {path!r}, offload_prefixes=["blocks."], device="cpu",
                  shared=True)
print("loaded", flush=True)
how = {how!r}
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "term":
    os.kill(os.getpid(), signal.SIGTERM)
else:
    os._exit(0)
"""


@pytest.mark.parametrize("how", ["kill", "term", "exit"])
def test_a_dead_users_segment_is_reclaimed_by_a_private_load(tmp_path,
                                                             shm_dir, how):
    """The last user of a shared copy dies without releasing it (SIGKILL,
    SIGTERM, os._exit): its full-size segment used to stay until that
    checkpoint's next *shared* load.  Any load now reclaims it, a private
    one of another checkpoint too; `laden shm list` showed it dead
    before."""
    _, path = saved(tmp_path)
    r = subprocess.run([sys.executable, "-c",
                        USER.format(here=HERE, path=path, how=how)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, LADEN_SHM_DIR=str(shm_dir)))
    assert "loaded" in r.stdout, r.stderr
    left = segments(shm_dir)
    assert len(left) == 1
    listed = laden.sharing.list_segments()
    assert [(s.name, s.alive, s.kind) for s in listed] == \
        [(left[0], False, "segment")]
    assert listed[0].checkpoint.endswith("m.safetensors")
    out = subprocess.run([sys.executable, "-m", "laden", "shm", "list"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, LADEN_SHM_DIR=str(shm_dir)))
    assert out.returncode == 0 and left[0] in out.stdout and \
        "none (dead)" in out.stdout and "laden shm clean" in out.stdout
    _, other = saved(tmp_path, name="other.safetensors", seed=4)
    with torch.device("meta"):
        m = Net().eval()
    laden.stream_load(m, other, offload_prefixes=["blocks."], device="cpu")
    assert segments(shm_dir) == []  # reclaimed by a private load
    laden.release(m)


def test_shm_clean_removes_only_the_dead(tmp_path, shm_dir):
    """`laden shm clean` removes a dead user's segment and says so; a
    segment in use stays, and so do files laden did not make."""
    _, path = saved(tmp_path)
    _, path2 = saved(tmp_path, name="b.safetensors", seed=2)
    live, _ = streamed(path2)  # in use by this process (a load reclaims:
    before = segments(shm_dir)  # so it comes before the death)
    r = subprocess.run([sys.executable, "-c",
                        USER.format(here=HERE, path=path, how="kill")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, LADEN_SHM_DIR=str(shm_dir)))
    assert "loaded" in r.stdout, r.stderr
    dead = [n for n in segments(shm_dir) if n not in before]
    planted = shm_dir / "laden-planted"
    planted.write_bytes(b"not a segment of laden's" * 100)
    in_use = [n for n in segments(shm_dir) if n not in dead and
              n != "laden-planted"]
    assert len(dead) == 1 and len(in_use) == 1
    out = subprocess.run([sys.executable, "-m", "laden", "shm", "clean"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, LADEN_SHM_DIR=str(shm_dir)))
    assert out.returncode == 0, out.stderr
    assert f"removed {dead[0]}" in out.stdout and "removed 1 file(s)" in \
        out.stdout
    assert sorted(segments(shm_dir)) == sorted(in_use + ["laden-planted"])
    laden.release(live)
    assert segments(shm_dir) == ["laden-planted"]


@pytest.mark.parametrize("what", ["file", "fifo", "symlink", "dir",
                                  "foreign-segment"])
def test_a_name_held_by_something_else_falls_back_to_a_private_copy(
        tmp_path, shm_dir, what, caplog):
    """The segment's name is predictable: whatever another user or
    process put there (a file, a FIFO, a symlink, a directory, another
    model's segment hard-linked under the name) is never used, waited on
    or removed; the load keeps a private copy with one warning, and its
    outputs are its own model's."""
    import logging

    ref, path = saved(tmp_path)
    ref2, path2 = saved(tmp_path, name="b.safetensors", seed=2)
    x = torch.randn(3, 32)
    a, ra = streamed(path)  # learn the name the segment gets
    name = ra.shared.name
    laden.release(a)
    target = shm_dir / f"laden-{name}"
    assert not target.exists()
    keep = None
    if what == "file":
        target.write_bytes(b"\0" * 4096)
    elif what == "fifo":
        os.mkfifo(target)
    elif what == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"x")
        os.symlink(tmp_path / "elsewhere", target)
    elif what == "dir":
        target.mkdir()
    else:  # another model's live segment, same size, linked under the name
        keep, rb = streamed(path2)
        os.link(shm_dir / f"laden-{rb.shared.name}", target)
    with caplog.at_level(logging.WARNING, logger="laden"):
        m, rep = streamed(path)
    warned = [r for r in caplog.records if "not shared" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert rep.shared is None
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    laden.release(m)
    assert target.exists() or target.is_symlink()  # left as it was
    if keep is not None:
        laden.release(keep)


def test_relative_shm_dir_and_chdir(tmp_path, monkeypatch):
    """A relative LADEN_SHM_DIR is made absolute at its first use: a chdir
    after the load neither leaks the segment nor makes another."""
    base = tmp_path / "work"
    (base / "segs").mkdir(parents=True)
    monkeypatch.chdir(base)
    monkeypatch.setenv("LADEN_SHM_DIR", "segs")
    _, path = saved(tmp_path)
    m, rep = streamed(path)
    assert rep.shared is not None and len(segments(base / "segs")) == 1
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "segs").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    m2, rep2 = streamed(path)  # the same directory: attaches
    assert rep2.shared.how == "attached"
    assert not any((elsewhere / "segs").iterdir())
    laden.release(m)
    laden.release(m2)
    assert segments(base / "segs") == []  # the last user removed it


def test_lossless_blocks_stay_private(tmp_path, shm_dir):
    """shared=True with compression="lossless": the blocks encoded at load
    are this process's (their encoders put them into its own memory), so
    they stay out of the segment, and every output is the model's."""
    torch.manual_seed(0)
    ref = Net(d=64, h=256).to(torch.bfloat16).eval()
    path = str(tmp_path / "bf16.safetensors")
    laden.save_file(ref.state_dict(), path)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(x)
    with torch.device("meta"):
        m = Net(d=64, h=256).to(torch.bfloat16).eval()
    rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                            device="cpu", shared=True,
                            compression="lossless")
    coded, raw = rep.lossless
    assert raw > 0 and coded < raw, rep.lossless
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(x), want)
    laden.release(m, h)
