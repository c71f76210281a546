"""laden.vbar on the CPU device (and CUDA when present): faults,
signatures, priorities, the aimdo usage pattern on a small model with a
budget smaller than its weights, and the elastic allocator on CUDA."""

import pytest
import torch
import torch.nn as nn

import laden
from laden import vbar

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PG = 2 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_fault_signature_unpin(device):
    vram = vbar.VRAM(device, budget=4 * PG, page_bytes=PG)
    v = vbar.ModelVBAR(8 * PG, device, vram=vram)
    w = v.alloc((PG // 4,), torch.float32)          # one page
    sig = v.fault(w)
    assert sig is not None
    t = v.tensor(w)
    assert t.device.type == torch.device(device).type
    t.fill_(3.0)
    w.signature = sig
    v.unpin(w)
    assert v.fault(w) == w.signature                # still what was written
    assert torch.all(v.tensor(w) == 3.0)
    v.unpin(w)
    assert v.loaded_size == PG and v.residency()[0] == 1
    assert vram.free_memory(PG) == PG and v.loaded_size == 0
    assert v.fault(w) is None                        # watermark: fail fast
    v.prioritize()
    sig2 = v.fault(w)
    assert sig2 is not None and sig2 != w.signature  # replaced: copy again
    v.unpin(w)
    with pytest.raises(laden.StateError, match="not pinned"):
        v.unpin(w)
    with pytest.raises(laden.InvalidArgumentError, match="outside"):
        v.fault((8 * PG, 1))
    with pytest.raises(laden.BudgetError):
        v.alloc((9 * PG,), torch.uint8)
    info = vram.info()
    assert info["vbars"] == 1 and info["fail_fast"] == 1
    v.close()
    vram.close()


class Net(nn.Module):
    def __init__(self, n=6, d=512):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for l in self.layers:
            x = torch.tanh(l(x))
        return x


def run_with_vbar(model, x, v, weights, device):
    """The aimdo pattern: fault each layer's weight before it runs, copy
    it in when its signature changed, stream it when offloaded, unpin
    after."""
    offloaded = 0
    for layer, (w, host) in zip(model.layers, weights):
        sig = v.fault(w)
        if sig is None:
            t = host.to(device)
            offloaded += 1
        else:
            t = v.tensor(w)
            if sig != w.signature:
                t.copy_(host)
                w.signature = sig
        x = torch.tanh(torch.nn.functional.linear(x, t, layer.bias))
        if sig is not None:
            v.unpin(w)
    return x, offloaded


@pytest.mark.parametrize("device", DEVICES)
def test_model_larger_than_budget_runs_identical(device):
    torch.manual_seed(0)
    model = Net().to(device)
    x = torch.randn(8, 512, device=device)
    with torch.no_grad():
        want = model(x)
        # 6 weights of 1 MiB in pages of 2 MiB; budget 2 pages: a prefix
        # stays resident, the rest streams; outputs identical.
        vram = vbar.VRAM(device, budget=2 * PG, page_bytes=PG)
        v = vbar.ModelVBAR(6 * (1 << 20), device, vram=vram)
        weights = [(v.alloc(l.weight.shape, l.weight.dtype), l.weight)
                   for l in model.layers]
        for it in range(4):
            got, off = run_with_vbar(model, x, v, weights, device)
            assert torch.equal(got, want)
            assert off == 2                         # settled, no thrashing
        assert vram.info()["mapped_bytes"] <= 2 * PG
        v.close()
        vram.close()


class ElasticCase:
    """8 x 32 MiB fp16 weights in a VBAR of a 320 MiB context: weights
    (256 MiB) and an 8192-token forward's activations (~3 x 64 MiB) do not
    fit together.  close() checks that the device's free memory is back
    to where it was."""

    def __init__(self):
        self.dev = torch.device("cuda")
        torch.manual_seed(0)
        d = 4096
        self.model = Net(n=8, d=d).half().to(self.dev)
        self.big = torch.randn(8192, d, device=self.dev, dtype=torch.half)
        self.small = torch.randn(64, d, device=self.dev, dtype=torch.half)
        with torch.no_grad():
            self.want_big = self.model(self.big)
            self.want_small = self.model(self.small)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.free0, _ = torch.cuda.mem_get_info()
        self.vram = vbar.VRAM(self.dev, budget=320 << 20)
        self.v = vbar.ModelVBAR(8 * (32 << 20) + 8 * 4096, self.dev,
                                vram=self.vram)
        self.weights = [(self.v.alloc(l.weight.shape, l.weight.dtype),
                         l.weight) for l in self.model.layers]

    def run(self, x):
        return run_with_vbar(self.model, x, self.v, self.weights, self.dev)

    def close(self):
        st = vbar.elastic_stats(self.dev)
        assert st["failures"] == 0 and st["evicted_bytes"] > 0
        self.v.close()
        self.vram.close()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        vbar.elastic_trim(self.dev)
        free1, _ = torch.cuda.mem_get_info()
        assert abs(free1 - self.free0) < 64 << 20, (self.free0, free1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_elastic_pool_weights_give_way_no_oom():
    case = ElasticCase()
    pool = vbar.elastic_pool(case.vram)
    with torch.no_grad():
        for _ in range(3):
            case.v.prioritize()
            with torch.cuda.use_mem_pool(pool):
                got, _ = case.run(case.big)
                got = got.clone()
            assert torch.equal(got, case.want_big)
    info = case.vram.info()
    assert info["mapped_bytes"] + info["charged_bytes"] <= 320 << 20
    del got, pool
    case.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_elastic_scope_gives_memory_back_to_the_weights():
    case = ElasticCase()
    with torch.no_grad():
        for _ in range(3):
            case.v.prioritize()
            with vbar.elastic(case.vram):           # activations evict
                got, _ = case.run(case.big)
                assert torch.equal(got, case.want_big)
                del got
            # The scope's memory went back: the small forward runs with
            # every weight resident again.
            case.v.prioritize()
            with vbar.elastic(case.vram):
                got, offloaded = case.run(case.small)
                assert torch.equal(got, case.want_small) and offloaded == 0
                del got
    assert case.v.loaded_size == 8 * (32 << 20)
    case.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_elastic_over_budget_is_an_out_of_memory_error():
    dev = torch.device("cuda")
    vram = vbar.VRAM(dev, budget=64 << 20)
    with pytest.raises(torch.OutOfMemoryError):
        with vbar.elastic(vram):
            torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    with vbar.elastic(vram):  # usable afterwards
        x = torch.ones(1 << 20, device=dev)
        assert float(x.sum()) == float(1 << 20)
        del x
    assert vbar.elastic_stats(dev)["failures"] >= 1
    vram.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_install_elastic_refuses_a_context_serving_a_pool():
    vram = vbar.VRAM(torch.device("cuda"), budget=64 << 20)
    vbar.elastic_pool(vram)
    with pytest.raises(laden.StateError, match="MemPool"):
        vbar.install_elastic(vram)  # refused before PyTorch is touched
    vram.close()


def test_bad_inputs_are_named():
    vram = vbar.VRAM("cpu", page_bytes=PG)
    with pytest.raises(laden.InvalidArgumentError, match="CUDA"):
        vbar.elastic_pool(vram)
    with pytest.raises(laden.InvalidArgumentError, match="CUDA"):
        with vbar.elastic(vram):
            pass
    with pytest.raises(laden.InvalidArgumentError, match="CUDA"):
        vbar.install_elastic(vram)
    with pytest.raises(laden.InvalidArgumentError, match="budget"):
        vbar.VRAM("cpu", budget="lots")
    v = vbar.ModelVBAR(PG, "cpu", vram=vram)
    with pytest.raises(laden.InvalidArgumentError, match="Weight"):
        v.fault("w")
    v.close()
    vram.close()
