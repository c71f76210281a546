"""Several devices in one process: a ModelCache per device (budgets per
device, device="auto" placing a model where there is room, reports per
device), and models on two GPUs streaming from one shared host copy.  The
GPU cases need two GPUs (nvidia-h200-x2); the CPU ones run everywhere."""

import os
import tempfile

import pytest
import torch
import torch.nn as nn

import laden
from models import Block

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs two GPUs")


class Net(nn.Module):
    def __init__(self, d=64, h=256, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    ref = Net().eval()
    path = str(tmp_path / "n.safetensors")
    laden.save_file(ref.state_dict(), path)
    return ref, path


def meta_net():
    with torch.device("meta"):
        return Net().eval()


def spec(key, path, **kw):
    return laden.ModelSpec(key, meta_net, checkpoint=path,
                           block_paths=["blocks"], **kw)


def test_cache_budget_per_device_and_auto_on_cpu(ckpt):
    ref, path = ckpt
    x = torch.randn(2, 64)
    cache = laden.ModelCache(vram_budget={"cpu": "64MB"})
    with cache.use(spec("a", path), device="auto") as m, torch.no_grad():
        assert torch.equal(m(x), ref(x))
    assert cache.info("a").device == "cpu"
    st = cache.stats("cpu")
    assert st["built"] == 1 and st["vram_budget_bytes"] == 64 * 10**6
    assert cache.stats()["built"] == 1
    cache.clear()


def test_cache_budget_dict_names_its_devices(ckpt):
    _, path = ckpt
    with pytest.raises(laden.InvalidArgumentError, match="vram_budget"):
        laden.ModelCache(vram_budget={"cpu": "lots"})


@two_gpus
def test_cache_places_models_on_the_device_with_room(ckpt):
    ref, path = ckpt
    budget = 3 * sum(t.numel() * t.element_size()
                     for t in ref.state_dict().values()) // 2
    cache = laden.ModelCache(vram_budget={"cuda:0": budget,
                                          "cuda:1": budget})
    devs = []
    for key in ("a", "b"):
        with cache.use(spec(key, path), device="auto") as m, torch.no_grad():
            dev = next(m.parameters()).device
            x = torch.randn(2, 64, device=dev)
            assert torch.equal(m(x).cpu(), ref.to("cpu")(x.cpu()))
        devs.append(cache.info(key).device)
    assert sorted(devs) == ["cuda:0", "cuda:1"]  # b went where a was not
    for d in ("cuda:0", "cuda:1"):
        st = cache.stats(d)
        assert st["built"] == 1 and 0 < st["vram_bytes"] <= budget
    # Used again: it stays where it is.
    with cache.use("a", device="auto"):
        pass
    assert cache.info("a").device == devs[0]
    cache.clear()


@two_gpus
def test_two_gpus_stream_from_one_host_copy(ckpt, monkeypatch):
    ref, path = ckpt
    d = tempfile.mkdtemp(prefix="laden-test-", dir="/dev/shm")
    monkeypatch.setenv("LADEN_SHM_DIR", d)
    models, reps = [], []
    for i in range(2):
        m = meta_net()
        reps.append(laden.stream_load(m, path, offload_prefixes=["blocks."],
                                      device=f"cuda:{i}", shared=True))
        laden.install_offload(m)
        models.append(m)
    assert [r.shared.how for r in reps] == ["made", "attached"]
    assert len(os.listdir(d)) == 1
    x = torch.randn(2, 64)
    with torch.no_grad():
        want = ref(x)
        for i, m in enumerate(models):
            got = m(x.to(f"cuda:{i}")).cpu()
            assert torch.allclose(got, want, atol=1e-5)
            assert m._laden_stream.handle.stats()["h2d_bytes"] > 0
    for m in models:
        laden.release(m)
    assert os.listdir(d) == []
    os.rmdir(d)


@two_gpus
def test_a_model_on_another_gpu_leaves_the_current_device(ckpt):
    """laden's driver calls run in the model's device's context and put the
    caller's back: torch's current device (which the CUDA runtime reads
    from the driver's current context) stays what the user set, so
    tensors made on "cuda" go where they did before."""
    ref, path = ckpt
    x = torch.randn(2, 64)
    want = ref(x)
    for cur, dev in ((0, 1), (1, 0)):
        with torch.cuda.device(cur):
            m = meta_net()
            laden.stream_load(m, path, offload_prefixes=["blocks."],
                              device=f"cuda:{dev}")
            assert torch.cuda.current_device() == cur
            laden.install_offload(m)
            assert torch.cuda.current_device() == cur
            with torch.no_grad():
                got = m(x.to(f"cuda:{dev}"))
            assert torch.cuda.current_device() == cur
            assert got.device == torch.device("cuda", dev)
            assert torch.allclose(got.cpu(), want, atol=1e-5)
            assert torch.empty(1, device="cuda").device.index == cur
            laden.release(m)
            assert torch.cuda.current_device() == cur



def test_a_plan_is_for_its_device(ckpt):
    """A plan sized by one device's free memory is refused for another
    (its tiers would not be that device's), before anything is loaded."""
    _, path = ckpt
    p = laden.plan(meta_net(), path, offload_prefixes=["blocks."],
                   device="cpu")
    m = meta_net()
    with pytest.raises(laden.InvalidArgumentError, match="plan is for cpu"):
        laden.stream_load(m, path, plan=p, device="cuda:1")
    assert getattr(m, "_laden_stream", None) is None
    with pytest.raises(laden.InvalidArgumentError, match="plan is for cpu"):
        laden.measure_activation_vram(lambda: None, p, device="cuda:0")


@two_gpus
def test_cache_host_budgets_are_the_hosts(ckpt):
    """pinned_budget and ram_budget count every device's models: a model
    pinned for cuda:1 unpins an idle one of cuda:0 rather than pinning
    the budget twice; the RAM budget drops the least recently used idle
    model of either device; use(key) without a device stays where the
    model is."""
    ref, path = ckpt
    size = sum(t.numel() * t.element_size()
               for t in ref.state_dict().values())
    cache = laden.ModelCache(vram_budget={"cuda:0": 4 * size,
                                          "cuda:1": 4 * size},
                             pinned_budget=3 * size // 2)
    x = torch.randn(2, 64)
    want = ref(x)
    for key, dev in (("a", "cuda:0"), ("b", "cuda:1")):
        with cache.use(spec(key, path), device=dev) as m, torch.no_grad():
            assert torch.allclose(m(x.to(dev)).cpu(), want, atol=1e-5)
        st = cache.stats()
        assert st["pinned_bytes"] <= 3 * size // 2
    assert cache.stats("cuda:1")["pinned_bytes"] >= size * 9 // 10
    with torch.cuda.device(0):
        with cache.use("b") as m:  # where it is, not the current device
            assert next(m.parameters()).device == torch.device("cuda", 1)
    assert cache.builds == 2
    cache.clear()
    # One RAM budget: room for two models, three used on two devices.
    cache = laden.ModelCache(vram_budget={"cuda:0": 4 * size,
                                          "cuda:1": 4 * size},
                             ram_budget=5 * size // 2)
    for key, dev in (("a", "cuda:0"), ("b", "cuda:1"), ("c", "cuda:1")):
        with cache.use(spec(key, path), device=dev):
            pass
    assert sum(cache.stats(d)["host_bytes"]
               for d in ("cuda:0", "cuda:1")) <= 5 * size // 2
    assert cache.drops >= 1 and cache.info("b").device == "cuda:1"
    cache.clear()


@two_gpus
def test_capture_on_the_second_gpu(ckpt):
    """A captured streamed forward of a model on cuda:1 from a thread whose
    current device is cuda:0 (torch's own capture stream would be made on
    cuda:0): it captures on the model's device and replays right."""
    ref, path = ckpt
    with torch.cuda.device(0):
        m = meta_net()
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device="cuda:1")
        h = laden.install_offload(m, lookahead=1)
        x0 = torch.randn(2, 64, device="cuda:1")
        step = h.capture(m, x0)
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(2, 64)
                got = step(x.to("cuda:1"))
                assert got.device == torch.device("cuda", 1)
                assert torch.allclose(got.cpu(), ref(x), atol=1e-5)
        assert torch.cuda.current_device() == 0
        h.remove()
        laden.release(m)


@two_gpus
def test_elastic_serves_its_contexts_device(ckpt):
    """elastic(VRAM("cuda:1")) from a thread on cuda:0 routes cuda:1's
    allocations to laden within that context's budget, and leaves cuda:0's
    to PyTorch's allocator."""
    from laden import vbar

    vram = vbar.VRAM("cuda:1", budget=256 << 20)
    before = vbar.elastic_stats("cuda:1")["allocs"]
    before0 = vbar.elastic_stats("cuda:0")["allocs"]
    with torch.cuda.device(0):
        with vbar.elastic(vram):
            a = torch.ones(1 << 20, device="cuda:1")
            b = torch.ones(1 << 20, device="cuda:0")
            assert float(a.sum()) == float(b.sum()) == float(1 << 20)
            del a, b
    assert vbar.elastic_stats("cuda:1")["allocs"] > before
    assert vbar.elastic_stats("cuda:0")["allocs"] == before0
    vram.close()


def test_evict_bytes_on_one_device(ckpt):
    """evict_bytes(n, device) frees on that device only."""
    ref, path = ckpt
    cache = laden.ModelCache(vram_budget={"cpu": "64MB"})
    with cache.use(spec("a", path), device="cpu"):
        pass
    held = cache.stats("cpu")["vram_bytes"]
    assert held > 0
    assert cache.evict_bytes(held, device="cuda:0") == 0  # not its device
    assert cache.stats("cpu")["vram_bytes"] == held
    assert cache.evict_bytes(held, device="cpu") == held
    assert cache.stats("cpu")["vram_bytes"] == 0
    # Named: the default device is CUDA where there is one, which this
    # cache's budget does not name.
    with cache.use("a", device="cpu") as m, torch.no_grad():  # again
        x = torch.randn(2, 64)
        assert torch.equal(m(x), ref(x))
    cache.clear()


def test_a_move_to_cuda_means_the_current_device():
    """The move guard of a model laden holds reads "cuda" as torch does,
    the current device, not any device."""
    from laden.hf import _same_device

    cur = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    other = torch.device("cuda", cur + 1)
    assert _same_device(torch.device("cuda"), torch.device("cuda", cur))
    assert not _same_device(torch.device("cuda"), other)
    assert _same_device(other, other)
    assert not _same_device(torch.device("cpu"), other)
    assert _same_device(torch.device("cpu"), torch.device("cpu"))


@two_gpus
def test_install_elastic_once_per_device():
    """install_elastic for each GPU's context, in a fresh process (it must
    come before torch allocates): the second call attaches its context to
    the allocator the first installed, and each device's allocations are
    served within its own context."""
    import subprocess
    import sys

    code = """
import torch
from laden import vbar
v0 = vbar.VRAM("cuda:0", budget=256 << 20)
v1 = vbar.VRAM("cuda:1", budget=256 << 20)
vbar.install_elastic(v0)
vbar.install_elastic(v1)
a = torch.ones(1 << 20, device="cuda:0")
b = torch.ones(1 << 20, device="cuda:1")
assert float(a.sum()) == float(b.sum()) == float(1 << 20)
for d in (0, 1):
    assert vbar.elastic_stats(f"cuda:{d}")["in_use_bytes"] >= 4 << 20, d
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr
