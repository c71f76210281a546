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

