"""Block streaming on the CPU device (and on CUDA when present): outputs are
bit-identical to the model loaded normally, whatever the tiers and the call
order; errors are clear and leave the model as it was."""

import gc
import os

import pytest
import torch

import laden
from models import PREFIXES, Block, on_meta, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def save(model, path, prefix=""):
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    laden.save_file(sd, path)
    return str(path)


@pytest.fixture
def ckpt(tmp_path):
    ref = reference()
    return ref, save(ref, tmp_path / "tiny.safetensors")


def ids(n=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g)


def expected(ref, device, dtype=None):
    import copy
    r = copy.deepcopy(ref).to(device)
    if dtype is not None:
        r = r.to(dtype)
    with torch.no_grad():
        return r, r(ids().to(device))


TIERS = {
    "ram": dict(),
    "disk": dict(ram_budget=0),
    "mixed": dict(ram_budget="40kB"),
    "prefixes": dict(resident_prefixes=["blocks.1."],
                     disk_prefixes=["blocks.3.", "stages.1.0."]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", list(TIERS))
def test_bit_identical_in_every_tier(ckpt, device, tiers):
    ref, path = ckpt
    _, want = expected(ref, device)
    m = on_meta()
    report = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                               device=device, **TIERS[tiers])
    assert "tiny.safetensors" in str(report)
    names = {b[2] for b in report.blocks}
    if tiers == "ram":
        assert names == {"ram"}
    if tiers == "disk":
        assert names == {"disk"}
    if tiers in ("mixed", "prefixes"):
        assert len(names) >= 2
    h = laden.install_offload(m, lookahead=2)
    with torch.no_grad():
        for _ in range(3):  # repeated forwards
            got = m(ids().to(device))
            assert torch.equal(got, want)
    st = h.stats()
    if device == "cuda" or tiers != "ram":
        assert st["enters"] > 0
    laden.release(m, h)
    assert m.blocks[0].up.weight.device.type == "meta"
    assert not hasattr(m, "_laden_stream")


@pytest.mark.parametrize("device", DEVICES)
def test_any_call_order(ckpt, device):
    ref, path = ckpt
    r, _ = expected(ref, device)
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      ram_budget="30kB")
    h = laden.install_offload(m, lookahead=1)
    x = torch.randn(2, 5, 32, device=device)
    order = [5, 4, 3, 2, 1, 0, 2, 2, 0, 5, 1, 3, 3]
    with torch.no_grad():
        for i in order:
            assert torch.equal(m.blocks[i](x), r.blocks[i](x)), i
        for s, j in [(1, 2), (0, 0), (1, 0), (1, 2), (0, 1)]:
            assert torch.equal(m.stages[s][j](x), r.stages[s][j](x))
    assert h.stats()["misses"] > 0
    laden.release(m, h)


@pytest.mark.parametrize("device", DEVICES)
def test_block_that_raises(ckpt, device):
    ref, path = ckpt
    _, want = expected(ref, device)
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      ram_budget="50kB")
    h = laden.install_offload(m)
    m.blocks[2].fail = True
    with pytest.raises(ValueError, match="told to fail"):
        m(ids().to(device))
    m.blocks[2].fail = False
    with torch.no_grad():
        assert torch.equal(m(ids().to(device)), want)
    laden.release(m, h)


def test_remove_restores_plain_modules(ckpt):
    ref, path = ckpt
    _, want = expected(ref, "cpu")
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    h = laden.install_offload(m)
    h.remove()
    h.remove()  # twice is fine
    assert "forward" not in m.blocks[0].__dict__
    with torch.no_grad():  # weights stay: their RAM copies
        assert torch.equal(m(ids()), want)
    h2 = laden.install_offload(m, lookahead=3)
    with torch.no_grad():
        assert torch.equal(m(ids()), want)
    with pytest.raises(laden.StateError):
        laden.install_offload(m)
    laden.release(m, h2)


def test_disk_blocks_have_no_copy_outside_install_offload(ckpt):
    """Disk-tier weights are on meta outside install_offload (a view of the
    checkpoint's pages would be a SIGBUS once the file is truncated), and
    their blocks refuse to run instead of computing with meta tensors."""
    ref, path = ckpt
    _, want = expected(ref, "cpu")
    m = on_meta()
    report = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                               device="cpu", ram_budget="40kB")
    disk = [name for name, _, tier in report.blocks if tier == "disk"]
    assert disk
    blk = laden._describe._module_at(m, disk[0].rstrip("."))
    assert blk.up.weight.device.type == "meta"
    with pytest.raises(laden.StateError, match=f"'{disk[0]}'.*disk tier"):
        with torch.no_grad():
            m(ids())
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids()), want)
    h.remove()
    assert blk.up.weight.device.type == "meta"
    with pytest.raises(laden.StateError, match="install_offload"):
        with torch.no_grad():
            m(ids())
    laden.release(m)


def test_compute_dtype_and_key_map(tmp_path):
    ref = reference()
    path = save(ref, tmp_path / "p.safetensors", prefix="model.")
    _, want = expected(ref, "cpu", torch.bfloat16)
    m = on_meta()
    rep = laden.stream_load(
        m, path, offload_prefixes=PREFIXES, device="cpu",
        compute_dtype="bf16",
        key_map=lambda n: n[len("model."):] if n.startswith("model.") else n)
    assert rep.total_bytes < sum(
        v.numel() * 4 for v in ref.state_dict().values())
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids()), want)
    laden.release(m, h)


def test_mismatched_names_one_error_before_allocation(tmp_path):
    ref = reference()
    sd = ref.state_dict()
    sd.pop("blocks.2.up.weight")
    sd["blocks.9.extra"] = torch.ones(3)
    sd["stray"] = torch.ones(2)
    path = str(tmp_path / "bad.safetensors")
    laden.save_file(sd, path)
    m = on_meta()
    with pytest.raises(laden.MismatchError) as e:
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    err = e.value
    assert err.missing == ["blocks.2.up.weight"]
    assert sorted(err.unexpected) == ["blocks.9.extra", "stray"]
    assert "blocks.2.up.weight" in str(err) and "stray" in str(err)
    assert isinstance(err, ValueError)
    assert not hasattr(m, "_laden_stream")
    assert m.blocks[0].up.weight.device.type == "meta"
    # skip_prefixes drops the strays; the missing one is still missing
    with pytest.raises(laden.MismatchError) as e:
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          skip_prefixes=["blocks.9.", "stray"])
    assert e.value.unexpected == []


def test_shape_and_dtype_errors_name_the_tensor(tmp_path):
    ref = reference()
    sd = dict(ref.state_dict())
    sd["blocks.1.down.bias"] = torch.zeros(31)
    p1 = str(tmp_path / "shape.safetensors")
    laden.save_file(sd, p1)
    with pytest.raises(laden.MismatchError, match="blocks.1.down.bias"):
        laden.stream_load(on_meta(), p1, offload_prefixes=PREFIXES,
                          device="cpu")
    sd = dict(ref.state_dict())
    sd["blocks.1.down.bias"] = torch.zeros(32, dtype=torch.int64)
    p2 = str(tmp_path / "dtype.safetensors")
    laden.save_file(sd, p2)
    with pytest.raises(laden.MismatchError, match="blocks.1.down.bias.*I64"):
        laden.stream_load(on_meta(), p2, offload_prefixes=PREFIXES,
                          device="cpu")
    with pytest.raises(laden.InvalidArgumentError, match="nothere"):
        laden.stream_load(on_meta(), p1, offload_prefixes=["nothere."],
                          device="cpu")
    with pytest.raises(laden.InvalidArgumentError, match="overlap"):
        laden.stream_load(on_meta(), p1, device="cpu",
                          offload_prefixes=["blocks.", "blocks.1."])


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_truncated_while_streaming(tmp_path, device):
    ref = reference()
    path = save(ref, tmp_path / "t.safetensors")
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      ram_budget=0)  # every block read from disk
    h = laden.install_offload(m, lookahead=1)
    with torch.no_grad():
        m(ids().to(device))
    os.truncate(path, 4096)
    with pytest.raises(laden.FormatError) as e:
        with torch.no_grad():
            m(ids().to(device))
    assert e.value.status == "E_TRUNCATED" and "t.safetensors" in str(e.value)
    with pytest.raises(laden.FormatError):  # again: the same clear error
        with torch.no_grad():
            m(ids().to(device))
    laden.release(m, h)  # still works
    assert m.embed.weight.device.type == "meta"


@pytest.mark.parametrize("device", DEVICES)
def test_offload_blocks_low_level(device):
    ref = reference()
    _, want = expected(ref, device)
    import copy
    m = copy.deepcopy(ref)
    m.embed.to(device)
    m.norm.to(device)
    h = laden.offload_blocks(list(m.blocks) + list(m.stages[0]) +
                             list(m.stages[1]), device=device)
    # Outside its forward a streamed weight is its host copy; inside, the
    # block runs from its slot on the device.
    assert m.blocks[0].up.weight.device.type == "cpu"
    assert torch.equal(m.blocks[0].up.weight, ref.blocks[0].up.weight)
    seen = []
    hk = m.blocks[0].up.register_forward_hook(
        lambda mod, i, o: seen.append(mod.weight.device.type))
    with torch.no_grad():
        assert torch.equal(m(ids().to(device)), want)
    hk.remove()
    assert seen == [device]
    laden.release(m, h)
    assert m.blocks[0].up.weight.device.type == "meta"


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_returns_memory_over_50_cycles(tmp_path):
    ref = reference(d=256, hidden=(1024,) * 6, nested=(2, 2))
    path = save(ref, tmp_path / "big.safetensors")  # about 14 MB
    x = torch.randint(0, 97, (1, 4))

    def cycle():
        m = on_meta(d=256, hidden=(1024,) * 6, nested=(2, 2))
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          ram_budget="6MB")
        h = laden.install_offload(m)
        with torch.no_grad():
            m(x)
        laden.release(m, h)
        del m, h
        gc.collect()

    for _ in range(3):
        cycle()
    before = rss()
    for _ in range(50):
        cycle()
    grown = rss() - before
    assert grown < 8 << 20, f"RSS grew by {grown / 1e6:.1f} MB"


def test_plan_then_load_never_refuses(tmp_path):
    """Every plan the planner makes is one the engine follows: over random
    models, checkpoint dtypes, compute and storage dtypes and budgets,
    laden.plan either refuses (BudgetError) or stream_load(plan=p) loads
    with exactly its tiers, sizes and slots, and on the CPU the prefix
    form with the same budget decides the same (one C path sizes and plans
    both; on CUDA laden.plan also keeps headroom and counts the disk
    staging, stream_load does not)."""
    import random

    rng = random.Random(12)
    ran = {"planned": 0, "refused": 0, "disk": 0, "converted": 0}
    for k in range(40):
        kw = dict(d=rng.choice([16, 32]), nested=(rng.randint(1, 2), 1),
                  hidden=tuple(rng.choice([32, 64, 96, 160])
                               for _ in range(rng.randint(2, 5))))
        ref = reference(k, **kw)
        sd = ref.state_dict()
        ck_dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        path = str(tmp_path / f"m{k}.safetensors")
        laden.save_file({n: t.to(ck_dtype) for n, t in sd.items()}, path)
        opts = dict(compute_dtype=rng.choice([None, "fp32", "bf16"]),
                    storage_dtype=rng.choice([None, None, "bf16"]))
        total = sum(t.numel() for t in sd.values()) * 4
        ram = rng.choice([0, total // 8, total // 3, total])
        res = rng.choice([None, 0, 1])
        la = rng.choice([1, 2, 3, 6])
        try:
            p = laden.plan(on_meta(**kw), path, device="cpu", ram_budget=ram,
                           resident_blocks=res, offload_prefixes=PREFIXES,
                           lookahead=la, **opts)
        except laden.BudgetError as e:
            ran["refused"] += 1
            assert "converted on load" in str(e) or "cannot hold" in str(e) \
                or "resident blocks" in str(e), e
            continue
        ran["planned"] += 1
        ran["disk"] += sum(b.tier == laden.Tier.DISK for b in p.blocks)
        converted = opts["storage_dtype"] or (
            opts["compute_dtype"] not in (None, {torch.float32: "fp32",
                                                 torch.bfloat16: "bf16"}
                                          .get(ck_dtype)))
        ran["converted"] += bool(converted)
        m = on_meta(**kw)
        rep = laden.stream_load(m, path, plan=p)
        assert [(n, t) for n, _, t in rep.blocks] == [
            (b.name, laden.streaming.TIER_NAMES[int(b.tier)])
            for b in p.blocks]
        assert [n for _, n, _ in rep.blocks] == [b.bytes for b in p.blocks]
        assert rep.rest_bytes == p.rest_bytes
        h = laden.install_offload(m, lookahead=la)
        ndisk = sum(b.tier == laden.Tier.DISK for b in p.blocks)
        assert h.stats()["nslots"] == min(ndisk, la + 1)
        assert ndisk == 0 or h.stats()["slot_bytes"] <= p.budgets["slot_bytes"]
        with torch.no_grad():
            got = m(ids())
        assert got.shape == (2, 11, 97) and torch.isfinite(got).all()
        laden.release(m, h)
        if res is None:  # the prefix form, same budget: the same decision
            m = on_meta(**kw)
            rep2 = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                                     device="cpu", ram_budget=ram,
                                     lookahead=la, **opts)
            assert [(n, s, t) for n, s, t in rep2.blocks] == \
                [(n, s, t) for n, s, t in rep.blocks]
            laden.release(m)
    print(ran)
    assert ran["planned"] >= 12 and ran["disk"] and ran["converted"]


def test_tensors_built_but_not_in_the_checkpoint_are_kept(ckpt):
    ref, path = ckpt
    m = on_meta()
    m.register_buffer("extra", torch.arange(3.0))  # built, not in the file
    rep = laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    assert "extra" in rep.kept and "extra" in str(rep)
    assert torch.equal(m.extra, torch.arange(3.0))
    laden.release(m)


def test_non_persistent_buffers(ckpt):
    """Built on the CPU they are kept and moved with the model; left on
    meta they are a clear error, since no checkpoint holds them."""
    ref, path = ckpt
    _, want = expected(ref, "cpu")
    m = on_meta()
    m.blocks[0].register_buffer("cache", torch.zeros(4), persistent=False)
    rep = laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    assert "blocks.0.cache" in rep.kept
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids()), want)
    laden.release(m, h)
    m = on_meta()
    with torch.device("meta"):
        m.blocks[1].register_buffer("rope", torch.zeros(4), persistent=False)
    with pytest.raises(laden.MismatchError, match="blocks.1.rope"):
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")


def test_argument_errors_name_the_problem(ckpt):
    ref, path = ckpt
    m = on_meta()
    with pytest.raises(laden.StateError, match="stream_load"):
        laden.install_offload(m)
    with pytest.raises(laden.StateError, match="nothing"):
        laden.release(m)
    with pytest.raises(laden.InvalidArgumentError, match="compute_dtype"):
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          compute_dtype="int3")
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    with pytest.raises(laden.StateError, match="already loaded"):
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu")
    with pytest.raises(laden.InvalidArgumentError, match="lookahead"):
        laden.install_offload(m, lookahead=0)
    if torch.cuda.is_available():
        with pytest.raises(laden.InvalidArgumentError, match="differs"):
            laden.install_offload(m, device="cuda")
    laden.release(m)
    with pytest.raises(laden.InvalidArgumentError, match="no blocks"):
        laden.offload_blocks([], device="cpu")
    with pytest.raises(laden.InvalidArgumentError, match="on meta"):
        laden.offload_blocks([on_meta().blocks[0]], device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_stream_load_in_a_vram_context(tmp_path, device):
    """With a laden.vbar.VRAM context the resident blocks take its pages in
    order; those it has no room for stream from RAM (named in the report),
    outputs stay identical, and release gives the context back whole."""
    from laden import vbar

    kw = dict(d=256, hidden=(1024,) * 6, nested=(1, 1))  # ~2 MiB blocks
    ref = reference(**kw)
    path = save(ref, tmp_path / "big.safetensors")
    r = ref.to(device)
    with torch.no_grad():
        want = r(ids().to(device))
    mb = 1 << 20
    # Eight 2 MiB pages for the weights; on CUDA room for three slots of
    # the largest block as well (on the CPU device only the disk tier
    # streams, and there is none).
    slots = 3 * (2 * mb + 4 * 4096) if device == "cuda" else 0
    vram = vbar.VRAM(device, budget=8 * mb + slots, page_bytes=2 * mb)
    m = on_meta(**kw)
    report = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                               resident_prefixes=["blocks."], device=device,
                               vram=vram)
    # Chosen for the device: blocks.* by prefix; on CUDA the planner may
    # choose the stages too (against the context's free room).
    chosen = [n for n, _, t in report.blocks
              if t == "resident" or n in report.offloaded]
    assert 0 < len(report.offloaded) < len(chosen)
    # The blocks that got no room are the last ones: lower offsets first.
    assert report.offloaded == chosen[len(chosen) - len(report.offloaded):]
    assert "no room" in str(report)
    info = vram.info()
    assert 0 < info["mapped_bytes"] <= 8 * mb
    with pytest.raises(laden.StateError, match="still use"):
        vram.close()  # refused while the model's VBAR lives
    h = laden.install_offload(m, lookahead=2)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(ids().to(device)), want)
    if device == "cuda":
        assert vram.info()["charged_bytes"] > 0  # the slots
    laden.release(m, h)
    info = vram.info()
    assert info["vbars"] == 0 and info["mapped_bytes"] == 0
    assert info["charged_bytes"] == 0
    vram.close()
    with pytest.raises(laden.InvalidArgumentError, match="vram"):
        laden.stream_load(on_meta(**kw), path, offload_prefixes=PREFIXES,
                          device=device, vram=object())


class _SharedBlock(torch.nn.Module):
    def __init__(self, d, norm=None):
        super().__init__()
        self.norm = norm or torch.nn.LayerNorm(d)
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("inv_freq", torch.zeros(d), persistent=False)

    def forward(self, x):
        return x + self.lin(self.norm(x)) * self.inv_freq


class _Shared(torch.nn.Module):
    """A norm used by block 0 and by the model after the blocks (registered
    first under its outside name, as transformers' tied modules are), and
    in each block a non-persistent buffer no checkpoint holds (as a rotary
    inv_freq)."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.final_norm = torch.nn.LayerNorm(d)
        self.blocks = torch.nn.ModuleList(
            [_SharedBlock(d, self.final_norm)] +
            [_SharedBlock(d) for _ in range(n - 1)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)


def _shared_built(meta: bool):
    if meta:
        with torch.device("meta"):
            m = _Shared()
    else:
        torch.manual_seed(0)
        m = _Shared()
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.uniform_(-1, 1)
    for i, b in enumerate(m.blocks):  # built on the CPU, in no checkpoint
        b.inv_freq = torch.linspace(0.5, 1.5, 16) + i
    return m


@pytest.mark.parametrize("kw", [dict(ram_budget=0),
                                dict(disk_prefixes=["blocks."])],
                         ids=["budget", "prefixes"])
def test_shared_modules_and_built_buffers_with_disk_blocks(tmp_path, kw):
    """Found in review: a module shared by a block and the rest ran from the
    block's slot (overwritten by later blocks: wrong outputs); a buffer
    built on the CPU kept its block off the disk tier; after release it was
    on meta, so the model could not be loaded again."""
    ref = _shared_built(False)
    path = str(tmp_path / "shared.safetensors")
    laden.save_file(ref.state_dict(), path)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = ref(x)
    m = _shared_built(True)
    for _ in range(2):  # loaded, released, loaded again
        rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                                device="cpu", lookahead=1, **kw)
        assert all(t == "disk" for _, _, t in rep.blocks), rep
        assert "blocks.0.inv_freq" in rep.kept
        h = laden.install_offload(m, lookahead=1)
        with torch.no_grad():
            for _ in range(5):
                assert torch.equal(m(x), want)
        laden.release(m, h)
        assert torch.equal(m.blocks[2].inv_freq,
                           torch.linspace(0.5, 1.5, 16) + 2)
        assert m.final_norm.weight.device.type == "meta"


def test_planned_slots_follow_the_lookahead(tmp_path):
    """Found in review: stream_load planned with the slots of lookahead 2
    whatever the lookahead, so a VRAM budget could be exceeded by the
    slots install_offload then allocated."""
    from laden import planning

    path = str(tmp_path / "la.safetensors")
    laden.save_file(reference().state_dict(), path)
    seen = []
    orig = planning.plan_schedule

    def spy(h, budgets, names=None):
        why, res = orig(h, budgets, names)
        seen.append((res.nslots, res.slot_bytes))
        return why, res

    planning.plan_schedule = spy
    try:
        m = on_meta()
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          lookahead=5, ram_budget=0)
    finally:
        planning.plan_schedule = orig
    h = laden.install_offload(m, lookahead=5)
    st = h.stats()
    assert seen == [(6, st["slot_bytes"])] and st["nslots"] == 6
    laden.release(m, h)


def test_load_reports_page_cache_and_progress(tmp_path, monkeypatch):
    """The report says GB/s and how many bytes came from the page cache;
    progress=True drives a bar to the total, block by block (a fake bar
    here: tqdm's own is for terminals); progress=False shows none."""
    from laden import checkpoint as ckmod

    ref = reference()
    path = save(ref, tmp_path / "p.safetensors")
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            self.updates = []
            bars.append(self)

        def update(self, k):
            self.n += k
            self.updates.append(self.n)

        def close(self):
            self.closed = True

    monkeypatch.setattr(ckmod, "_progress_bar", lambda total, desc, p:
                        None if p is False else Bar(total, desc))
    for _ in range(2):
        m = on_meta()
        rep = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                                device="cpu", progress=True)
        b = bars[-1]
        assert b.closed and b.n == b.total == rep.total_bytes
        assert len(b.updates) >= len(rep.blocks)
        assert b.updates == sorted(b.updates)
        assert rep.read_bytes > 0 and rep.gb_per_s > 0
        assert 0 <= rep.cached_bytes <= rep.read_bytes
        assert "from the page cache" in str(rep)
        laden.release(m)
    n = len(bars)
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                      progress=False)
    laden.release(m)
    assert len(bars) == n
    # The cache's first use reports the same way (one load, several blocks
    # in flight).
    cache = laden.ModelCache()
    spec = laden.ModelSpec("p", on_meta, checkpoint=path,
                           block_paths=("blocks", "stages.0", "stages.1"))
    with cache.use(spec, device="cpu") as mm, torch.no_grad():
        assert torch.equal(mm(ids()), expected(ref, "cpu")[1])
    assert bars[-1].closed and bars[-1].n == bars[-1].total > 0


def test_ctrl_c_during_a_load_cancels_it(tmp_path, monkeypatch):
    """Found in review: Ctrl-C while the progress bar ran was swallowed by
    the ctypes callback and the load went on.  Now the callback cancels the
    load in C (the reads in flight end first), stream_load raises the
    KeyboardInterrupt, nothing stays loaded, and a new load works."""
    from laden import checkpoint as ckmod

    ref = reference()
    path = save(ref, tmp_path / "c.safetensors")

    class Bar:
        n = 0

        def update(self, k):
            self.n += k
            raise KeyboardInterrupt

        def close(self):
            pass

    monkeypatch.setattr(ckmod, "_progress_bar",
                        lambda total, desc, p: Bar() if p else None)
    m = on_meta()
    with pytest.raises(KeyboardInterrupt):
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          progress=True)
    assert not hasattr(m, "_laden_stream")
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                      progress=False)
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids()), expected(ref, "cpu")[1])
    laden.release(m, h)


def test_vram_budget_on_the_cpu_is_refused(ckpt):
    """The CPU has no VRAM: a vram_budget for it is an error naming what
    to give instead, not silently ignored; nothing is loaded."""
    ref, path = ckpt
    m = on_meta()
    with pytest.raises(laden.InvalidArgumentError, match="has no VRAM.*"
                       "ram_budget"):
        laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                          vram_budget="1GB")
    assert not hasattr(m, "_laden_stream")
    with pytest.raises(laden.InvalidArgumentError, match="no VRAM"):
        laden.plan(on_meta(), path, device="cpu", max_vram="1GB")


def _slow_bars(monkeypatch, fail=False):
    """Progress bars whose updates take a while (the load is then still
    running when the forward starts), or raise (cancelling the load)."""
    import time
    from laden import checkpoint as ckmod

    bars = []

    class Bar:
        def __init__(self, total):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k
            if fail:
                raise RuntimeError("bar broke")
            time.sleep(0.01)

        def close(self):
            self.closed = True

    monkeypatch.setattr(ckmod, "_progress_bar",
                        lambda total, desc, p: Bar(total) if p else None)
    return bars


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", ["ram", "mixed", "prefixes", "resident"])
def test_background_load_runs_as_blocks_arrive(ckpt, device, tiers,
                                               monkeypatch):
    """stream_load(background=True) returns before the bytes arrive; a
    forward right away waits for each block and is bit-identical;
    report.wait() ends the load and fills in its numbers."""
    ref, path = ckpt
    _, want = expected(ref, device)
    bars = _slow_bars(monkeypatch)
    m = on_meta()
    kw = TIERS.get(tiers, {})
    prefixes = () if tiers == "resident" else PREFIXES
    rep = laden.stream_load(m, path, offload_prefixes=prefixes,
                            device=device, background=True, progress=True,
                            **kw)
    h = laden.install_offload(m, lookahead=2) if prefixes else None
    with torch.no_grad():
        assert torch.equal(m(ids().to(device)), want)
    assert rep.wait() is rep and rep.done
    assert rep.read_bytes > 0 and rep.seconds > 0
    assert bars[-1].closed and bars[-1].n == bars[-1].total
    with torch.no_grad():
        assert torch.equal(m(ids().to(device)), want)
    laden.release(m, h)
    assert m.blocks[0].up.weight.device.type == "meta"


@pytest.mark.parametrize("device", DEVICES)
def test_background_load_released_or_failed(ckpt, device, monkeypatch):
    """release() during a background load stops it; a load that fails
    (here cancelled by its progress callback) raises its error from the
    forward and from report.wait(), and the model can be released and
    loaded again."""
    ref, path = ckpt
    _, want = expected(ref, device)
    _slow_bars(monkeypatch)
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      background=True, progress=True)
    laden.release(m)
    assert not hasattr(m, "_laden_stream")
    _slow_bars(monkeypatch, fail=True)
    rep = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                            device=device, background=True, progress=True)
    h = None
    with pytest.raises(laden.StateError) as e, torch.no_grad():
        # The load may fail before install_offload (which then raises
        # the failure) or after it (the forward raises it).
        h = laden.install_offload(m)
        m(ids().to(device))
    assert "cancelled" in str(e.value)
    with pytest.raises(laden.StateError):
        rep.wait()
    # Found in review: a forward after the failed load read freed memory.
    # The memory stays until release, and every forward raises.
    with pytest.raises(laden.StateError, match="cancelled"), torch.no_grad():
        m(ids().to(device))
    laden.release(m, h)
    rep = laden.stream_load(m, path, offload_prefixes=PREFIXES,
                            device=device, background=True, progress=False)
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids().to(device)), want)
    laden.release(m, h)
    assert rep.wait().done  # after release: nothing to wait for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", ["ram", "mixed", "resident"])
def test_background_load_values_through_the_doors(ckpt, device, tiers,
                                                  monkeypatch):
    """Right after stream_load(background=True), before the bytes have
    arrived: state_dict() of the model and of a block waits for the load
    and gives the checkpoint's values (found when making background loads
    one keyword away in from_pretrained: it read the memory the loader
    was still writing); laden.wait(model) returns the load's report, and
    parameters() after it hold the checkpoint's values."""
    ref, path = ckpt
    want = ref.state_dict()
    m = on_meta()
    kw = TIERS.get(tiers, {})
    prefixes = () if tiers == "resident" else PREFIXES
    for first in ("model", "block", "wait"):
        bars = _slow_bars(monkeypatch)
        rep = laden.stream_load(m, path, offload_prefixes=prefixes,
                                device=device, background=True,
                                progress=True, **kw)
        assert not rep.done  # a slowed load: still arriving
        if first == "model":
            got = m.state_dict()
            assert got.keys() == want.keys()
        elif first == "block":
            got = m.blocks[2].state_dict(prefix="blocks.2.")
            assert got and all(k in want for k in got)
        else:
            assert laden.wait(m) is rep
            got = {k: v for k, v in m.named_parameters()
                   if v.device.type != "meta"}
            assert got
        assert rep.done and bars[-1].n == bars[-1].total, first
        for k, v in got.items():
            assert torch.equal(v.detach().cpu(), want[k]), (first, k)
        assert laden.wait(m) is rep
        laden.release(m)
    with pytest.raises(laden.InvalidArgumentError, match="not loaded"):
        laden.wait(m)


@pytest.mark.parametrize("device", DEVICES)
def test_background_load_failed_raises_at_the_doors(ckpt, device,
                                                    monkeypatch):
    """A background load that failed raises its error from state_dict()
    and laden.wait, each time, instead of handing out what it left."""
    _, path = ckpt
    _slow_bars(monkeypatch, fail=True)
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      background=True, progress=True)
    for _ in range(2):
        with pytest.raises(laden.StateError, match="cancelled"):
            m.state_dict()
        with pytest.raises(laden.StateError, match="cancelled"):
            m.blocks[0].state_dict()
        with pytest.raises(laden.StateError, match="cancelled"):
            laden.wait(m)
    laden.release(m)
    m.state_dict()  # its doors gone with the model


def _move_ctime(path, was):
    """Puts path's modification time back to `was` (an os.stat), waiting
    until its status change time has moved past was's: what a rewrite
    followed by os.utime (or touch -r) leaves."""
    import time
    for _ in range(400):
        os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
        if os.stat(path).st_ctime_ns != was.st_ctime_ns:
            return
        time.sleep(0.005)
    raise AssertionError("the status change time never moved")


def _rewrite_in_place(path, other):
    """Writes the bytes of file `other` (as large) over path, in place,
    and puts its modification time back."""
    was = os.stat(path)
    data = open(other, "rb").read()
    assert len(data) == was.st_size
    with open(path, "r+b") as f:
        f.write(data)
    _move_ctime(path, was)
    assert os.stat(path).st_mtime_ns == was.st_mtime_ns


@pytest.mark.parametrize("when", ["after_a_forward", "before_any_forward"])
def test_rewritten_in_place_with_mtime_put_back(tmp_path, when):
    """A disk-tier model whose file is rewritten in place with other
    weights and its modification time put back (os.utime): the next
    forward raises naming the file, never mixes old and new weights."""
    ref = reference()
    path = save(ref, tmp_path / "t.safetensors")
    other = save(reference(seed=5), tmp_path / "other.safetensors")
    _, want = expected(ref, "cpu")
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                      ram_budget=0)  # every block read from disk
    h = laden.install_offload(m, lookahead=1)
    if when == "after_a_forward":
        with torch.no_grad():
            assert torch.equal(m(ids()), want)
    _rewrite_in_place(path, other)
    for _ in range(2):  # and again: the same clear error
        with pytest.raises(laden.FormatError) as e:
            with torch.no_grad():
                m(ids())
        assert e.value.status == "E_CHANGED"
        assert "t.safetensors" in str(e.value)
        assert "changed while in use" in str(e.value)
    laden.release(m, h)  # still works
    assert m.embed.weight.device.type == "meta"


@pytest.mark.parametrize("when", ["after_a_forward", "before_any_forward"])
def test_chmod_alone_keeps_streaming(tmp_path, when):
    """A chmod moves the status change time and no byte: forwards go on,
    bit-identical."""
    ref = reference()
    path = save(ref, tmp_path / "t.safetensors")
    _, want = expected(ref, "cpu")
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                      ram_budget=0)
    h = laden.install_offload(m, lookahead=1)
    with torch.no_grad():
        if when == "after_a_forward":
            assert torch.equal(m(ids()), want)
        for mode in (0o444, 0o644):
            was = os.stat(path)
            os.chmod(path, mode)
            _move_ctime(path, was)
            for _ in range(2):
                assert torch.equal(m(ids()), want)
    laden.release(m, h)


def _unet_cond(d):
    diffusers = pytest.importorskip("diffusers")
    cls = diffusers.UNet2DConditionModel
    torch.manual_seed(0)
    cls(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64), cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                          "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D",
                        "CrossAttnUpBlock2D"),
        norm_num_groups=8, attention_head_dim=8).save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 4, 16, 16, generator=g), \
        torch.randn(1, 7, 32, generator=g)
    return cls, lambda m: m(x, 3, ctx).sample, 1


def _unet_plain(d):
    diffusers = pytest.importorskip("diffusers")
    cls = diffusers.UNet2DModel
    torch.manual_seed(0)
    cls(sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D",
                          "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8).save_pretrained(d)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return cls, lambda m: m(x, 3).sample, 1


def _t5(d):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16,
                                d_ff=128, num_layers=6, num_heads=4)
    transformers.T5EncoderModel(cfg).save_pretrained(d)
    ids = torch.randint(0, 128, (1, 9),
                        generator=torch.Generator().manual_seed(3))
    return transformers.T5EncoderModel, \
        lambda m: m(input_ids=ids).last_hidden_state, 0  # called in order


@pytest.mark.parametrize("make", [_unet_cond, _unet_plain, _t5],
                         ids=["UNet2DConditionModel", "UNet2DModel", "T5"])
def test_prefetch_in_call_order(tmp_path, make):
    """A UNet registers a level's attentions before its resnets and calls
    them interleaved: blocks prefetched in registration order miss.  C
    learns the order of the first forward: from the second on nothing
    misses and each forward reads the disk tier's bytes once (give or take
    the next forward's first blocks, prefetched at the end), with outputs
    bit-identical to the model with every block in RAM."""
    d = str(tmp_path / "m")
    cls, run, reorders = make(d)
    full = laden.from_pretrained(cls, d, device="cpu")
    with torch.no_grad():
        want = run(full)
    laden.release(full)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors"))
    m = laden.from_pretrained(cls, d, device="cpu",
                              ram_budget=int(size * 0.15))
    h = m._laden_stream.handle
    first = h.stats()
    assert first["disk_bytes"] > 0 and first["nslots"] > 0
    with torch.no_grad():
        assert torch.equal(run(m), want)
        before = h.stats()
        for _ in range(3):
            assert torch.equal(run(m), want)
    st = h.stats()
    assert st["misses"] == before["misses"]  # none after the first forward
    read = st["read_bytes"] - before["read_bytes"]
    assert abs(read - 3 * st["disk_bytes"]) <= 2 * st["slot_bytes"], \
        (read, st["disk_bytes"])
    # Relaid once, at the end of the first forward (the slots' views
    # taken again by the hooks: the outputs above are exact).
    assert st["reorders"] == reorders
    laden.release(m)


def _resident_fraction(path):
    """The share of the file's pages in the page cache (mincore over a
    mapping: reads nothing)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_char_p]
    n = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, n, vec) == 0
        libc.munmap(addr, n)
        return sum(b & 1 for b in vec.raw) / pages
    finally:
        os.close(fd)


def _drop_cache(path):
    import ctypes
    from laden._lib import check, lib
    h = ctypes.c_void_p()
    check(lib.laden_io_file_open(path.encode(), ctypes.byref(h)))
    try:
        check(lib.laden_io_drop_cache(h))
    finally:
        lib.laden_io_file_close(h)


class _Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Linear(1024, 1024) for _ in range(10))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


@pytest.mark.parametrize("way", ["on", "off", "auto"])
def test_cold_load_every_way(tmp_path, monkeypatch, way):
    """A cold load reads the same bytes whichever way the reader takes
    (LADEN_IO_DIRECT), and leaves the page cache without the file: the
    RAM tier is the one copy in host memory."""
    torch.manual_seed(0)
    ref = _Wide().eval()
    path = str(tmp_path / "wide.safetensors")
    laden.save_file(dict(ref.state_dict()), path)  # 40 MiB
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
    monkeypatch.setenv("LADEN_IO_DIRECT", way)
    _drop_cache(path)
    assert _resident_fraction(path) < 0.01
    with torch.device("meta"):
        m = _Wide().eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cpu")
    with torch.no_grad():
        assert torch.equal(m(x), want)
    # O_DIRECT brings nothing in; buffered reads drop what they brought.
    assert _resident_fraction(path) < 0.05, way
    laden.release(m)


def test_bad_io_direct_value_is_refused(tmp_path, monkeypatch):
    torch.manual_seed(0)
    path = str(tmp_path / "wide.safetensors")
    laden.save_file(dict(_Wide().state_dict()), path)
    monkeypatch.setenv("LADEN_IO_DIRECT", "fast")
    with torch.device("meta"):
        m = _Wide()
    with pytest.raises(laden.InvalidArgumentError,
                       match="LADEN_IO_DIRECT=fast"):
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device="cpu")
    assert m.blocks[0].weight.device.type == "meta"  # left as it was


def test_pinned_pool_needs_a_cuda_device(tmp_path):
    """The pinned pool is for CUDA loads (the CPU device pins nothing);
    a bad size names itself.  (Reuse itself: tests/test_stream.c on the
    stand-in driver, and test_gpu.py on a GPU.)"""
    with pytest.raises(laden.InvalidArgumentError, match="CPU device"):
        laden.set_pinned_pool("1GB", device="cpu")
    path = str(tmp_path / "wide.safetensors")
    laden.save_file(dict(_Wide().state_dict()), path)
    with torch.device("meta"):
        m = _Wide()
    with pytest.raises(laden.InvalidArgumentError, match="CPU device"):
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device="cpu", pinned_pool="1GB")
    assert m.blocks[0].weight.device.type == "meta"
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        with pytest.raises(laden.InvalidArgumentError, match="lots"):
            laden.set_pinned_pool("lots", device=dev)
