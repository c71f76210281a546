"""Quantized tensor subclasses under laden: torchao, quanto and
bitsandbytes weights held as their inner tensors (packed data, scales),
moved as compact bytes, the wrapper rebuilt where the block runs; the
outputs equal the same quantized model run plainly.  CPU here (each
backend's CPU kernels); the same tests run on CUDA on the GPU machine."""

import pytest
import torch
import torch.nn as nn

import laden

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d=256, n=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def torchao_int8(m):
    ao = pytest.importorskip("torchao.quantization")
    ao.quantize_(m, ao.Int8WeightOnlyConfig())
    return m


def quanto_int4(m):
    q = pytest.importorskip("optimum.quanto")
    q.quantize(m, weights=q.qint4)
    q.freeze(m)
    return m


def quanto_int8(m):
    q = pytest.importorskip("optimum.quanto")
    q.quantize(m, weights=q.qint8)
    q.freeze(m)
    return m


def bnb_nf4(m, device):
    bnb = pytest.importorskip("bitsandbytes")
    for blk in m.blocks:
        for name in ("up", "down"):
            lin = getattr(blk, name)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features,
                                  quant_type="nf4",
                                  compute_dtype=torch.float32)
            q.load_state_dict(lin.state_dict())
            setattr(blk, name, q.to(device))  # quantized when moved
    return m.to(device)


def bnb_int8(m, device):
    bnb = pytest.importorskip("bitsandbytes")
    for blk in m.blocks:
        for name in ("up", "down"):
            lin = getattr(blk, name)
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features,
                                    has_fp16_weights=False)
            q.load_state_dict(lin.state_dict())
            setattr(blk, name, q.to(device))  # quantized when moved
    return m.to(device)


QUANTIZERS = {"torchao-int8": torchao_int8, "quanto-int4": quanto_int4,
              "quanto-int8": quanto_int8, "bnb-nf4": None, "bnb-int8": None}


def build(kind, device):
    torch.manual_seed(0)
    m = Net().eval()
    if kind.startswith("bnb-"):
        make = bnb_nf4 if kind == "bnb-nf4" else bnb_int8
        return make(m, device).to("cpu") if device == "cpu" else \
            make(m, device)
    return QUANTIZERS[kind](m)


def inner_bytes(m):
    from laden import _wrapped

    return sum(p.numel() * p.element_size()
               for h in _wrapped.holders(m) for p in h.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantized_cached_and_streamed(kind, device):
    ref = build(kind, device).to(device)
    x = torch.randn(3, 256, device=device)
    with torch.no_grad():
        want = ref(x)
    for mode in ("resident", "streaming"):
        cache = laden.ModelCache()
        spec = laden.ModelSpec("q", lambda: build(kind, device).to("cpu"),
                               block_paths=("blocks",), block_mode=mode)
        for _ in range(2):  # built, then from the cache
            with cache.use(spec, device=device) as m:
                with torch.no_grad():
                    got = m(x)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                w = m.blocks[1].up.weight
                assert type(w) is type(ref.blocks[1].up.weight)
                assert w.device.type == torch.device(device).type
        # The host copies are the compact inner tensors, not floats.
        st = cache.stats()
        dense = sum(p.numel() * 4 for p in Net().parameters())
        assert st["host_bytes"] < dense * 0.6
        cache.clear()


def test_quantized_offloader_gives_back_wrappers(tmp_path):
    """ModelOffloader over a quantized model: uses run from laden's memory,
    close() hands the model back with plain quantized weights that still
    compute the same."""
    pytest.importorskip("optimum.quanto")
    m = build("quanto-int4", "cpu")
    ref = build("quanto-int4", "cpu")  # the same seed: the same model
    x = torch.randn(2, 256)
    with torch.no_grad():
        want = ref(x)
    from laden import _wrapped

    # A block path that does not exist: refused, the model left as it was
    # (no holders in its modules or its state_dict).
    keys = set(m.state_dict())
    with pytest.raises(laden.InvalidArgumentError):
        laden.ModelOffloader(m, block_paths=("nope",)).activate("cpu")
    assert not _wrapped.holders(m) and set(m.state_dict()) == keys
    # laden.plan neither.
    p = str(tmp_path / "unused.safetensors")
    laden.save_file({"unused": torch.zeros(1)}, p)
    with pytest.raises(laden.MismatchError):
        laden.plan(m, p, device="cpu")
    assert not _wrapped.holders(m)

    off = laden.ModelOffloader(m, block_paths=("blocks",))
    with torch.no_grad():
        got = off.activate("cpu")(x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert inner_bytes(m) > 0
    # A weight taken from the model follows laden's memory as it moves
    # (found in review: it kept the address of the evicted copy).
    w = m.blocks[0].up.weight
    want_w = ref.blocks[0].up.weight.dequantize()
    off.deactivate(evict=True)
    assert torch.equal(w.dequantize(), want_w)
    off.close()
    assert torch.equal(w.dequantize(), want_w)
    assert not _wrapped.holders(m)
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, atol=0, rtol=0)


def test_unknown_subclass_refused():
    class Odd(torch.Tensor):
        pass

    m = Net(n=2)
    m.blocks[0].up.weight = nn.Parameter(
        torch.Tensor._make_subclass(Odd, m.blocks[0].up.weight.data),
        requires_grad=False)
    cache = laden.ModelCache()
    spec = laden.ModelSpec("odd", lambda: m, block_paths=("blocks",))
    with pytest.raises(laden.InvalidArgumentError,
                       match="blocks.0.up.*Odd.*__tensor_flatten__"):
        with cache.use(spec, device="cpu"):
            pass


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_offload_blocks(device):
    """offload_blocks over torchao-quantized blocks: streamed through the
    device with their int8 data and scales, the same outputs; release
    leaves plain wrappers (on meta: offload_blocks takes the tensors
    over)."""
    pytest.importorskip("torchao.quantization")
    ref = build("torchao-int8", "cpu").to(device)
    m = build("torchao-int8", "cpu")
    m.inp.to(device)
    x = torch.randn(3, 256, device=device)
    with torch.no_grad():
        want = ref(x)
    h = laden.offload_blocks(list(m.blocks), device=device)
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    laden.release(m, h)
    from laden import _wrapped
    assert not _wrapped.holders(m)
    assert m.blocks[0].up.weight.device.type == "meta"


def test_bnb_not_quantized_yet_refused():
    """A bitsandbytes Linear4bit never moved (its weight not quantized
    yet) is refused naming the parameter, not held half-made."""
    bnb = pytest.importorskip("bitsandbytes")
    m = Net(n=2)
    m.blocks[0].up = bnb.nn.Linear4bit(256, 512, quant_type="nf4")
    cache = laden.ModelCache()
    spec = laden.ModelSpec("raw", lambda: m, block_paths=("blocks",))
    with pytest.raises(laden.InvalidArgumentError,
                       match="blocks.0.up.weight.*not quantized yet"):
        with cache.use(spec, device="cpu"):
            pass
    from laden import _wrapped
    assert not _wrapped.holders(m)


@pytest.mark.parametrize("device", DEVICES)
def test_bnb_int8_run_before_laden_takes_it(device):
    """A bitsandbytes Linear8bitLt keeps its scales (SCB) in its module's
    state after its first forward: a model run once before laden takes it
    streams with those scales, the same outputs."""
    ref = build("bnb-int8", device).to(device)
    x = torch.randn(3, 256, device=device)
    with torch.no_grad():
        want = ref(x)  # the scales move to each module's state here
    assert ref.blocks[0].up.weight.SCB is None
    cache = laden.ModelCache()
    spec = laden.ModelSpec("q8", lambda: ref.to("cpu"),
                           block_paths=("blocks",), block_mode="streaming")
    with cache.use(spec, device=device) as m:
        with torch.no_grad():
            got = m(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cache.clear()


def test_bnb_int8_lets_go_of_laden_memory_and_fp16_weights_refused():
    """After a forward, bitsandbytes holds an Int8Params' data and scales
    in its module's state: laden's rebuild lets go of them, so nothing of
    laden's memory is kept once the cache lets the model go.  An
    Int8Params kept in 16 bits (has_fp16_weights: bitsandbytes keeps an
    int8 copy of it on the module) is refused by name."""
    bnb = pytest.importorskip("bitsandbytes")
    ref = build("bnb-int8", "cpu")
    x = torch.randn(3, 256)
    with torch.no_grad():
        want = ref(x)
    cache = laden.ModelCache()
    spec = laden.ModelSpec("q8", lambda: ref, block_paths=("blocks",),
                           block_mode="streaming")
    with cache.use(spec, device="cpu") as m:
        with torch.no_grad():
            torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
        # The block's slot is bound only inside its forward: the wrapper
        # rebuilt around the host copy after it lets go of the slot.
        assert m.blocks[0].up.state.CB is None
    cache.clear()
    assert ref.blocks[0].up.state.CB is None
    assert ref.blocks[0].up.state.SCB is None

    m16 = Net().eval()
    lin = m16.blocks[0].up
    q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features,
                            has_fp16_weights=True)
    q.load_state_dict(lin.state_dict())
    m16.blocks[0].up = q
    spec = laden.ModelSpec("q16", lambda: m16, block_paths=("blocks",),
                           block_mode="streaming")
    with pytest.raises(laden.InvalidArgumentError,
                       match="blocks.0.up.weight.*has_fp16_weights"):
        with cache.use(spec, device="cpu"):
            pass
    cache.clear()


def test_bnb_int8_not_quantized_yet_refused():
    """A Linear8bitLt never moved (its weight still floats) is refused
    naming the parameter."""
    bnb = pytest.importorskip("bitsandbytes")
    m = Net(n=2)
    lin = m.blocks[0].up
    q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features,
                            has_fp16_weights=False)
    q.load_state_dict(lin.state_dict())
    m.blocks[0].up = q
    assert q.weight.dtype != torch.int8
    cache = laden.ModelCache()
    spec = laden.ModelSpec("raw8", lambda: m, block_paths=("blocks",))
    with pytest.raises(laden.InvalidArgumentError,
                       match="blocks.0.up.weight.*not quantized yet"):
        with cache.use(spec, device="cpu"):
            pass
    cache.clear()
