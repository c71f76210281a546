"""ModelCache, ModelSpec and ModelOffloader: three models larger together
than the budgets, used in rotation, on the CPU device (and CUDA when
present).  Outputs are compared bit for bit with the models loaded
normally."""

import copy
import logging
import os

import pytest
import torch

import laden
from laden import ModelCache, ModelOffloader, ModelSpec
from models import reference, on_meta

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

BLOCKS = ("blocks", "stages.0", "stages.1")


def ids(n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g)


def expected(seed, device):
    r = copy.deepcopy(reference(seed)).to(device)
    with torch.no_grad():
        return r(ids().to(device))


def spec(seed, **kw):
    kw.setdefault("block_paths", BLOCKS)
    return ModelSpec(f"model{seed}", lambda: reference(seed), **kw)


def size_of(seed):
    cache = ModelCache()
    with cache.use(spec(seed), device="cpu"):
        pass
    return cache.info(f"model{seed}").size_bytes


def run(cache, sp, device):
    with cache.use(sp, device=device) as m, torch.no_grad():
        return m(ids().to(device))


def held(cache, key):
    return cache.info(key).vram_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_rotation_lru_reuse_and_budgets(device):
    size = size_of(0)
    budget = 2 * size + size // 2  # two whole models, not three
    cache = ModelCache(vram_budget=budget, pinned_budget=2 * size)
    specs = [spec(s) for s in range(3)]
    refs = [expected(s, device) for s in range(3)]
    for r in range(9):
        i = r % 3
        before = cache.stats()
        had = held(cache, specs[i].key) if specs[i].key in cache._rt else 0
        out = run(cache, specs[i], device)
        assert torch.equal(out, refs[i])
        st = cache.stats()
        assert st["vram_bytes"] <= budget
        assert st["pinned_bytes"] <= 2 * size
        info = cache.info(specs[i].key)
        assert info.mode == "resident" and info.vram_bytes == info.size_bytes
        # Only what was missing moved (the budget leaves a half model
        # to the least recently used one); on the CPU nothing does: a
        # resident block runs from its host copy (no second copy in RAM).
        assert st["upload_bytes"] - before["upload_bytes"] == \
            (size - had if device != "cpu" else 0)
        assert r < 3 or 0 < had < size
        if r >= 2:  # the model used two turns ago was the LRU idle one
            assert held(cache, specs[(i + 1) % 3].key) < size
            assert held(cache, specs[(i + 2) % 3].key) == size
        # Re-use of a model still on the device copies nothing.
        again = run(cache, specs[i], device)
        assert torch.equal(again, refs[i])
        assert cache.stats()["upload_bytes"] == st["upload_bytes"]
    st = cache.stats()
    assert st["hits"] == 9 and st["builds"] == 3 and st["activations"] == 18
    info = cache.info("model1")
    assert info.uses == 6 and not info.in_use and info.last_use is not None
    assert info.pinned_bytes + info.pageable_bytes == info.size_bytes
    cache.clear()
    assert cache.stats()["vram_bytes"] == 0 and cache.stats()["built"] == 0
    assert torch.equal(run(cache, specs[0], device), refs[0])  # rebuilt


@pytest.mark.parametrize("device", DEVICES)
def test_partial_eviction_and_streaming(device):
    size = size_of(0)
    # Room for one whole model and part of another.
    budget = size + size // 2
    cache = ModelCache(vram_budget=budget)
    specs = [spec(s) for s in range(3)]
    refs = [expected(s, device) for s in range(3)]
    for r in range(6):
        i = r % 3
        assert torch.equal(run(cache, specs[i], device), refs[i])
        assert cache.stats()["vram_bytes"] <= budget
    # A partly evicted model keeps its first blocks and uploads the rest.
    last = specs[1].key  # used two turns ago
    part = held(cache, last)
    assert 0 < part < size
    up = cache.stats()["upload_bytes"]
    assert torch.equal(run(cache, specs[1], device), refs[1])
    assert cache.stats()["upload_bytes"] - up == \
        (size - part if device != "cpu" else 0)
    # Too big for the budget: streamed, outputs the same.
    small = ModelCache(vram_budget=size * 6 // 10)
    big = spec(2)
    for _ in range(3):
        assert torch.equal(run(small, big, device), refs[2])
        assert small.info("model2").mode == "streaming"
        assert small.stats()["vram_bytes"] <= size * 6 // 10
    forced = ModelCache()
    assert torch.equal(run(forced, spec(2, block_mode="streaming"), device),
                       refs[2])
    assert forced.info("model2").mode == "streaming"
    assert forced.info("model2").vram_bytes < size


def test_in_use_errors():
    cache = ModelCache()
    sp = spec(0)
    with cache.use(sp, device="cpu") as m:
        with pytest.raises(laden.StateError, match="in use"):
            with cache.use(sp, device="cpu"):
                pass
        for call in (cache.clear, lambda: cache.evict("model0"),
                     lambda: cache.unregister("model0")):
            with pytest.raises(laden.StateError, match="in use"):
                call()
        with torch.no_grad():
            m(ids())  # still usable
    with pytest.raises(laden.StateError, match="inside cache.use"):
        with torch.no_grad():
            m(ids())
    cache.unregister("model0")
    assert "model0" not in cache


def test_bad_inputs_are_named():
    with pytest.raises(laden.InvalidArgumentError, match="block_mode"):
        ModelSpec("k", reference, block_mode="fast")
    with pytest.raises(laden.InvalidArgumentError, match="not callable"):
        ModelSpec("k", 3)
    with pytest.raises(laden.InvalidArgumentError, match="non-empty"):
        ModelSpec("", reference)
    cache = ModelCache()
    with pytest.raises(laden.ModelNotFoundError, match="no model 'nope'"):
        cache.info("nope")
    with pytest.raises(KeyError):
        cache.evict("nope")
    first = cache.register(spec(0))
    assert cache.register(spec(0)) is first  # same key, same layout
    with pytest.raises(laden.StateError, match="block_mode"):
        cache.register(spec(0, block_mode="streaming"))
    with pytest.raises(laden.InvalidArgumentError, match="not a torch.nn"):
        with cache.use(ModelSpec("bad", lambda: 42), device="cpu"):
            pass
    with pytest.raises(laden.InvalidArgumentError, match="names no module"):
        with cache.use(ModelSpec("b2", reference, block_paths=("nope",)),
                       device="cpu"):
            pass
    with pytest.raises(laden.InvalidArgumentError, match="on meta with"):
        with cache.use(ModelSpec("b3", on_meta), device="cpu"):
            pass
    with pytest.raises(laden.InvalidArgumentError, match="vram_budget"):
        ModelCache(vram_budget="lots")
    with pytest.raises(laden.BudgetError, match="model0"):
        with ModelCache(vram_budget=1000).use(spec(0), device="cpu"):
            pass
    with pytest.raises(laden.BudgetError, match="model0"):
        with ModelCache(vram_budget=size_of(0) - 1).use(
                spec(0, block_mode="resident"), device="cpu"):
            pass
    # A failed use leaves the model idle and whole.
    c2 = ModelCache(vram_budget=size_of(0) - 1)
    with pytest.raises(laden.BudgetError):
        with c2.use(spec(0, block_mode="resident"), device="cpu"):
            pass
    info = c2.info("model0")
    assert not info.in_use and info.vram_bytes == 0
    with c2.use(spec(1), device="cpu") as m, torch.no_grad():
        assert torch.equal(m(ids()), expected(1, "cpu"))


def test_checkpoint_on_meta(tmp_path):
    ref = reference(3)
    path = tmp_path / "m.safetensors"
    laden.save_file(ref.state_dict(), path)
    cache = ModelCache()
    sp = ModelSpec("meta", on_meta, checkpoint=path, block_paths=BLOCKS)
    assert torch.equal(run(cache, sp, "cpu"), expected(3, "cpu"))
    assert cache.info("meta").disk_bytes == 0
    cache.clear()
    assert cache.info("meta").disk_bytes > 0  # re-read on its next use
    sd = ref.state_dict()
    sd["extra.weight"] = sd.pop("norm.weight")
    bad = tmp_path / "bad.safetensors"
    laden.save_file(sd, bad)
    with pytest.raises(laden.MismatchError) as e:
        with cache.use(ModelSpec("bad", on_meta, checkpoint=bad), "cpu"):
            pass
    assert e.value.missing == ["norm.weight"]
    assert e.value.unexpected == ["extra.weight"]


def test_key_map_and_skip_prefixes_match_as_stream_load_does(tmp_path):
    """ModelSpec takes key_map and skip_prefixes, matched by the one
    description stream_load uses; a spec that differs in them under the
    same key is refused."""
    ref = reference(3)
    sd = {"model." + k: v for k, v in ref.state_dict().items()}
    sd["lm_extra.weight"] = torch.zeros(3)
    path = tmp_path / "renamed.safetensors"
    laden.save_file(sd, path)
    cache = ModelCache()
    km = lambda n: n[len("model."):] if n.startswith("model.") else n
    sp = ModelSpec("renamed", on_meta, checkpoint=path, block_paths=BLOCKS,
                   key_map=km, skip_prefixes=["lm_extra."])
    assert torch.equal(run(cache, sp, "cpu"), expected(3, "cpu"))
    with pytest.raises(laden.StateError, match="skip_prefixes"):
        cache.register(ModelSpec("renamed", on_meta, checkpoint=path,
                                 block_paths=BLOCKS, key_map=km))
    # Without them, every name is reported at once.
    with pytest.raises(laden.MismatchError) as e:
        with cache.use(ModelSpec("plain", on_meta, checkpoint=path,
                                 block_paths=BLOCKS), "cpu"):
            pass
    assert "lm_extra.weight" in e.value.unexpected
    assert "norm.weight" in e.value.missing
    # A dict key_map is frozen and compared by content.
    d = {f"model.{k}": k for k in ref.state_dict()}
    a = ModelSpec("d", on_meta, checkpoint=path, key_map=d,
                  skip_prefixes="lm_extra.")
    b = ModelSpec("d", on_meta, checkpoint=path, key_map=dict(d),
                  skip_prefixes=("lm_extra.",))
    assert cache.register(a) is a and cache.register(b) is a
    with pytest.raises(TypeError):
        a.key_map["x"] = "y"
    with pytest.raises(laden.InvalidArgumentError, match="key_map"):
        ModelSpec("bad", on_meta, key_map=42)


def test_fp8_checkpoint_is_decoded_not_misread(tmp_path):
    """Found in review: the cache kept fp8 checkpoint tensors compact (as
    streaming does, expanding them when a block runs) but never expanded
    them, and read 4 bytes per element over 1.  The cache decodes fp8 on
    load; an fp8 tensor with a scale is a mismatch naming the scale."""
    ref = reference(3)
    sd = dict(ref.state_dict())
    w = sd["blocks.0.up.weight"]
    q = w.to(torch.float8_e4m3fn)
    sd["blocks.0.up.weight"] = q
    path = tmp_path / "fp8.safetensors"
    laden.save_file(sd, path)
    cache = ModelCache()
    sp = ModelSpec("fp8", on_meta, checkpoint=path, block_paths=BLOCKS)
    with cache.use(sp, "cpu") as m:
        assert torch.equal(m.blocks[0].up.weight.detach(), q.float())
        assert torch.equal(m.blocks[1].up.weight.detach(),
                           sd["blocks.1.up.weight"])
    sd["blocks.0.up.weight_scale"] = torch.ones(w.shape[0])
    laden.save_file(sd, tmp_path / "fp8s.safetensors")
    with pytest.raises(laden.MismatchError, match="weight_scale"):
        with cache.use(ModelSpec("fp8s", on_meta,
                                 checkpoint=tmp_path / "fp8s.safetensors",
                                 block_paths=BLOCKS), "cpu"):
            pass


def test_ram_budget_drops_idle_models_and_rebuilds():
    size = size_of(0)
    cache = ModelCache(ram_budget=2 * size + size // 2)
    refs = [expected(s, "cpu") for s in range(3)]
    for r in range(6):
        assert torch.equal(run(cache, spec(r % 3), "cpu"), refs[r % 3])
        assert cache.stats()["host_bytes"] <= 2 * size + size // 2
    assert cache.stats()["builds"] == 6 and cache.stats()["drops"] == 4


def test_model_offloader_round_trip():
    model = reference(4)
    want = expected(4, "cpu")
    off = ModelOffloader.from_module(model, block_paths=BLOCKS)
    for _ in range(3):
        m = off.activate("cpu")
        assert m is model and off.active
        with torch.no_grad():
            assert torch.equal(m(ids()), want)
        off.deactivate()
        assert off.info().vram_bytes == 0
    with pytest.raises(laden.StateError, match="not active"):
        off.deactivate()
    off.close()
    with torch.no_grad():  # an ordinary CPU module again
        assert torch.equal(model(ids()), want)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_decisions_are_logged(caplog):
    size = size_of(0)
    cache = ModelCache(vram_budget=size + size // 2)
    with caplog.at_level(logging.DEBUG, logger="laden"):
        for s in (0, 1, 0):
            run(cache, spec(s), "cpu")
    text = caplog.text
    assert "use 'model1'" in text and "evicted" in text
    assert "'model0' -" in text  # which model gave way, and how much


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_rss_growth_over_100_rotations():
    import torch.nn as nn

    class Wide(nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(nn.Linear(256, 256)
                                        for _ in range(8))

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    specs = [ModelSpec(f"w{s}", lambda s=s: Wide(s), block_paths=("blocks",))
             for s in range(3)]
    size = 8 * (256 * 256 + 256) * 4
    cache = ModelCache(vram_budget=size + size // 2, pinned_budget=size * 2)
    x = torch.randn(4, 256)
    refs = [Wide(s)(x).detach() for s in range(3)]

    def rotate(n):
        for r in range(n):
            with cache.use(specs[r % 3], device="cpu") as m, torch.no_grad():
                assert torch.equal(m(x), refs[r % 3])

    rotate(15)
    before = rss()
    rotate(100)
    grown = rss() - before
    assert grown < 8 << 20, f"RSS grew by {grown / 1e6:.1f} MB"


PEAK_SCRIPT = r"""
import resource, sys, torch, torch.nn as nn
import laden
MB = 1 << 20
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2048, 2048, bias=False)
                                    for _ in range(8))   # 16 MiB each
model = Net()
for p in model.parameters():
    p.data.normal_()          # touch every page
base = peak()
cache = laden.ModelCache()
box = [model]
del model                     # the cache holds the only reference
spec = laden.ModelSpec("m", box.pop, block_paths=("blocks",),
                       block_mode="streaming")
with cache.use(spec, device="cpu", lookahead=1):
    pass                      # on the CPU device: 2 slots of 16 MiB
print((peak() - base) / MB)
"""


def test_adopting_a_cpu_model_does_not_double_host_memory(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, check=True)
    grown = float(out.stdout.strip().splitlines()[-1])
    # The model is 128 MiB, the CPU device's two slots 32 MiB; packing
    # the model block by block frees each block's original as its copy is
    # made.  (A copy of the whole model first would add 128 MiB more.)
    assert grown < 80, f"peak host memory grew by {grown:.0f} MiB"


@pytest.mark.parametrize("device", DEVICES)
def test_models_in_vbars_come_back_without_copies(device):
    from laden import vbar

    size = size_of(0)
    vram = vbar.VRAM(device, budget="64MB", page_bytes=2 << 20)
    cache = ModelCache(vram_budget=2 * size + size // 2, vram=vram)
    specs = [spec(s) for s in range(3)]
    refs = [expected(s, device) for s in range(3)]
    for r in range(6):
        i = r % 3
        up = cache.stats()["upload_bytes"]
        assert torch.equal(run(cache, specs[i], device), refs[i])
        if r >= 3:
            # Evicted by the cache (two whole models fit its budget), but
            # the VRAM context had room: the pages stayed, nothing copied.
            assert cache.stats()["upload_bytes"] == up
    cache.clear()
    assert vram.info()["vbars"] == 0


def test_cpu_models_run_from_their_host_copies():
    """On the CPU device a resident block runs from its host copy in place:
    before, its "device copy" was a second copy in RAM (offload_pipeline
    on the CPU held every component twice).  A merged adapter gets a copy
    of its own for the blocks it changes, and the host copy stays the
    base: removing the adapter gives the exact base back."""
    cache = ModelCache()
    sp = spec(0)
    want = expected(0, "cpu")
    with cache.use(sp, device="cpu") as m, torch.no_grad():
        assert torch.equal(m(ids()), want)
        rt = cache._rt[sp.key]
        for t in rt.tensors:
            v = m.get_parameter(t.names[0]) if t.is_param else \
                m.get_buffer(t.names[0])
            assert v.data_ptr() == rt._host_view(t).data_ptr(), t.names[0]
    assert cache.stats()["upload_bytes"] == 0
    w = {k: v.clone() for k, v in reference(seed=7).state_dict().items()
         if k == "blocks.1.up.weight"}
    delta = laden.AdapterSpec("d", lambda: {"blocks.1.up.delta.weight":
                                            w["blocks.1.up.weight"]})
    with cache.use(sp, device="cpu", adapters=[delta]) as m, torch.no_grad():
        assert not torch.equal(m(ids()), want)
        rt = cache._rt[sp.key]
        t = next(t for t in rt.tensors if t.names[0] == "blocks.1.up.weight")
        assert m.blocks[1].up.weight.data_ptr() != \
            rt._host_view(t).data_ptr()  # its own copy, merged
        assert torch.equal(rt._host_view(t),
                           reference(seed=0).blocks[1].up.weight)
    with cache.use(sp, device="cpu") as m, torch.no_grad():
        assert torch.equal(m(ids()), want)
    cache.clear()
