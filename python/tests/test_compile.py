"""Compiling the blocks laden runs (install_offload(compile=...)): each
block class is compiled once, laden's enter and exit stay outside the
compiled code, outputs and gradients are the eager model's.  The whole
model under torch.compile: laden's enter and exit are ops in the graph (no
graph break), the blocks' weight reads stay after enter.  On CUDA: a
streamed forward captured into a CUDA graph and replayed."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import laden
from models import Block

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="CUDA graphs need a GPU")


class Uniform(nn.Module):
    """Six blocks of one class and one shape, a head outside them."""

    def __init__(self, d=32, h=64, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Counting:
    """A torch.compile backend that counts the graphs it is given and runs
    them as they are."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def load(tmp_path, cls=Uniform, device="cpu", **kw):
    """The reference on `device` and the same model streamed there: on
    the CPU device blocks stream from disk (ram_budget=0), on CUDA from
    pinned RAM unless the caller says."""
    torch.manual_seed(0)
    ref = cls().eval()
    path = str(tmp_path / "u.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = cls().eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=device,
                      **kw)
    return ref.to(device), m


def streamed(tmp_path, device, cls=Uniform, **kw):
    tiers = dict(ram_budget=0) if device == "cpu" else {}
    tiers.update(kw)
    return load(tmp_path, cls, device, **tiers)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", [dict(ram_budget=0), {}])
def test_each_block_class_compiled_once(tmp_path, tiers, device):
    """Streamed from disk (or RAM) and two blocks kept resident: one graph
    per block layout -- a streamed block's parts carry laden's guard
    against calls from outside it, a resident block's do not, and Dynamo
    guards on hooks -- for all six blocks, none more on later calls or
    other lengths; the outputs are the eager model's; remove() gives the
    blocks their own forward back."""
    ref, m = load(tmp_path, device=device,
                  resident_prefixes=["blocks.2.", "blocks.4."], **tiers)
    be = Counting()
    h = laden.install_offload(m, lookahead=1,
                              compile=laden.BlockCompile(backend=be))
    with torch.no_grad():
        for t in (5, 9, 5):
            x = torch.randn(2, t, 32, device=device)
            torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    layouts = {tuple(len(p._forward_pre_hooks) for p in b.modules())
               for b in m.blocks}
    assert be.graphs == len(layouts) <= 2
    assert all("forward" in b.__dict__ for b in m.blocks)
    h.remove()
    assert not any("forward" in b.__dict__ for b in m.blocks)
    if tiers or device == "cuda":  # streamed blocks refuse to run then
        return
    with torch.no_grad():
        x = torch.randn(2, 7, 32)
        torch.testing.assert_close(m(x), ref(x), atol=1e-6, rtol=1e-5)
    assert be.graphs == len(layouts)  # not compiled any more


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_output_matches_eager(tmp_path, device):
    """The default backend (inductor): the same outputs within float
    tolerance."""
    ref, m = streamed(tmp_path, device)
    h = laden.install_offload(m, lookahead=1, compile=True)
    x = torch.randn(2, 5, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_training_through_compiled_blocks(tmp_path, device):
    """train=True with compiled blocks: the recomputation in backward runs
    the compiled forward; gradients equal the eager model's."""
    ref, m = streamed(tmp_path, device)
    for p in m.blocks.parameters():
        p.requires_grad_(False)
    r = copy.deepcopy(ref)
    for p in r.blocks.parameters():
        p.requires_grad_(False)
    be = Counting()
    h = laden.install_offload(m, train=True, lookahead=1,
                              compile=laden.BlockCompile(backend=be))
    x = torch.randn(2, 5, 32, device=device)
    xm, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    m(xm).pow(2).sum().backward()
    r(xr).pow(2).sum().backward()
    torch.testing.assert_close(xm.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.head.weight.grad, r.head.weight.grad,
                               atol=1e-5, rtol=1e-5)
    assert be.graphs >= 1
    h.remove()


def test_block_compile_arguments_checked(tmp_path):
    with pytest.raises(laden.InvalidArgumentError, match="mode or options"):
        laden.BlockCompile(mode="default", options={"a": 1})
    with pytest.raises(laden.InvalidArgumentError, match="mode"):
        laden.BlockCompile(mode="fastest")
    with pytest.raises(laden.InvalidArgumentError, match="capture"):
        laden.BlockCompile(mode="reduce-overhead")
    with pytest.raises(laden.InvalidArgumentError, match="CUDA graphs"):
        laden.BlockCompile(options={"triton.cudagraphs": True})
    with pytest.raises(laden.InvalidArgumentError, match="dynamic"):
        laden.BlockCompile(dynamic="yes")
    _, m = load(tmp_path, ram_budget=0)
    with pytest.raises(laden.InvalidArgumentError, match="BlockCompile"):
        laden.install_offload(m, compile="inductor")


def test_block_compile_refused_before_torch_2_5(tmp_path, monkeypatch):
    """Before torch 2.5 Dynamo compiled every block apart: refused by
    name, the model left as it was."""
    _, m = load(tmp_path, ram_budget=0)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    with pytest.raises(laden.InvalidArgumentError, match="torch 2.5"):
        laden.install_offload(m, compile=True)
    monkeypatch.undo()
    assert not any("forward" in b.__dict__ for b in m.blocks)
    h = laden.install_offload(m, lookahead=1)
    h.remove()


class WeightOps(nn.Module):
    """A block that computes from its weights alone before touching its
    input: if a compiled graph ran those ops before laden's enter, they
    would read the slot's previous block."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.randn(d))

    def forward(self, x):
        w = (self.lin.weight * 2).t()
        g = self.g.float().exp()
        return torch.tanh(x @ w + self.lin.bias) * g + x


class WeightOpsModel(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(WeightOps() for _ in range(n))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("device", DEVICES)
def test_whole_model_compiles_without_graph_breaks(tmp_path, device):
    """torch.compile of the whole streamed model, without gradients:
    torch._dynamo.explain reports no graph break and one graph; the
    compiled model's outputs equal the resident model's, over lengths,
    the blocks entered and exited through laden's ops."""
    ref, m = streamed(tmp_path, device)
    h = laden.install_offload(m, lookahead=1)
    x = torch.randn(2, 5, 32, device=device)
    with torch.no_grad():
        ex = torch._dynamo.explain(m)(x)
        assert ex.graph_break_count == 0, ex.break_reasons
        assert ex.graph_count == 1
        torch._dynamo.reset()
        cm = torch.compile(m)
        before = h.stats()["enters"]
        for t in (5, 9, 5):
            x = torch.randn(2, t, 32, device=device)
            torch.testing.assert_close(cm(x), ref(x), atol=1e-5, rtol=1e-5)
        assert h.stats()["enters"] - before == 3 * 6
    h.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_weight_reads_stay_after_enter(tmp_path, device):
    """Blocks whose first ops read only their weights, six blocks over
    two slots: inductor's code reads each block's own weights (it would
    read the slot's previous block had it hoisted them above enter)."""
    ref, m = streamed(tmp_path, device, cls=WeightOpsModel)
    h = laden.install_offload(m, lookahead=1)
    assert h.stats()["nslots"] < 6
    cm = torch.compile(m)
    with torch.no_grad():
        for t in (3, 7):
            x = torch.randn(2, t, 32, device=device)
            torch.testing.assert_close(cm(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_whole_model_compile_with_gradients(tmp_path, device):
    """With gradients on (no train=True), laden's wrappers stay eager
    under torch.compile (graph breaks): outputs still equal."""
    ref, m = streamed(tmp_path, device)
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m)
    x = torch.randn(2, 5, 32, device=device)
    torch.testing.assert_close(cm(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()


def test_stale_block_key_refused():
    """A compiled graph that outlived its offload: the op names it."""
    laden.compile.ops()
    with pytest.raises(laden.StateError, match="removed or released"):
        torch.ops.laden.enter([torch.zeros(1)], 10 ** 9)


def test_capture_refused_on_the_cpu(tmp_path):
    _, m = load(tmp_path, ram_budget=0)
    h = laden.install_offload(m, lookahead=1)
    with pytest.raises(laden.DeviceError, match="CUDA device"):
        h.capture(m, torch.randn(2, 5, 32))
    h.remove()


@cuda_only
def test_capture_replays_the_streamed_forward(tmp_path, caplog):
    """A captured streamed forward replays the copies and kernels: its
    outputs equal eager streaming's for new inputs, eager passes between
    replays stay right, each replay copies every streamed block once; a
    new shape runs eagerly with one warning; after set_adapters, remove
    and release it refuses."""
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1)
    x0 = torch.randn(2, 5, 32, device="cuda")
    step = h.capture(m, x0)
    assert isinstance(step, laden.CapturedForward)
    h2d = h.stats()["h2d_bytes"]
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 5, 32, device="cuda")
            torch.testing.assert_close(step(x), ref(x), atol=1e-5,
                                       rtol=1e-5)
            y = torch.randn(2, 3, 32, device="cuda")
            torch.testing.assert_close(m(y), ref(y), atol=1e-5, rtol=1e-5)
        assert step.replays == 3
        # Six streamed blocks over two slots: each replay copies each once.
        from laden._lib import lib
        o = m._laden_stream.live("test")
        streamed_bytes = sum(
            lib.laden_sched_block_bytes(o.h, b.c_block)
            for b in m._laden_stream.blocks
            if lib.laden_sched_is_streamed(o.h, b.c_block))
        assert h.stats()["nslots"] == 2
        assert step.bytes_per_replay == streamed_bytes
        caplog.set_level(logging.WARNING, logger="laden")
        y = torch.randn(2, 7, 32, device="cuda")
        torch.testing.assert_close(step(y), ref(y), atol=1e-5, rtol=1e-5)
        step(y)
        assert sum("unlike the captured" in r.message
                   for r in caplog.records) == 1
        assert h.stats()["h2d_bytes"] > h2d
    h.set_adapters([])
    with pytest.raises(laden.StateError, match="adapters changed"):
        step(x0)
    step = h.capture(m, x0)
    h.remove()
    with pytest.raises(laden.StateError, match="removed"):
        step(x0)
    h = laden.install_offload(m, lookahead=1)
    step = h.capture(m, x0)
    laden.release(m)
    with pytest.raises(laden.StateError):
        step(x0)
    with pytest.raises(laden.StateError):
        h.capture(m, x0)


@cuda_only
def test_capture_refuses_what_it_cannot_replay(tmp_path):
    """Disk-tier blocks (threads read them) and train=True are refused by
    name; a CUDA graph captured around the model without laden is
    refused at the first streamed block instead of replaying stale
    slots."""
    ref, m = load(tmp_path, device="cuda", ram_budget=0)
    h = laden.install_offload(m, lookahead=1)
    x = torch.randn(2, 5, 32, device="cuda")
    with pytest.raises(laden.DeviceError, match="disk tier"):
        h.capture(m, x)
    with torch.no_grad():  # still usable
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()
    laden.release(m)
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1, train=True)
    with pytest.raises(laden.StateError, match="train=True"):
        h.capture(m, x)
    h.remove()
    h = laden.install_offload(m, lookahead=1)
    with torch.no_grad():
        m(x)  # warm
        g = torch.cuda.CUDAGraph()
        with pytest.raises(laden.StateError, match="capturing"):
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                m(x)
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()


@cuda_only
def test_compiled_model_captured(tmp_path):
    """The whole model compiled (laden's ops in the graph), then captured
    with handle.capture: replays equal eager streaming."""
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m)
    x = torch.randn(2, 5, 32, device="cuda")
    step = h.capture(cm, x)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 5, 32, device="cuda")
            torch.testing.assert_close(step(x), ref(x), atol=1e-5,
                                       rtol=1e-5)
    h.remove()


@cuda_only
def test_reduce_overhead_mode_works(tmp_path):
    """torch.compile(mode="reduce-overhead") on a streamed model: laden's
    ops are marked unsafe for inductor's CUDA graphs, so their copies are
    never captured behind laden's back; outputs equal eager streaming's
    over repeated calls."""
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 5, 32, device="cuda")
            torch.testing.assert_close(cm(x).clone(), ref(x), atol=1e-5,
                                       rtol=1e-5)
    h.remove()


@cuda_only
def test_max_autotune_no_cudagraphs(tmp_path):
    """mode="max-autotune-no-cudagraphs", for the whole model and block by
    block: outputs equal eager streaming's."""
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m, mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        x = torch.randn(2, 5, 32, device="cuda")
        torch.testing.assert_close(cm(x), ref(x), atol=1e-4, rtol=1e-4)
    h.remove()
    torch._dynamo.reset()
    h = laden.install_offload(m, lookahead=1, compile=laden.BlockCompile(
        mode="max-autotune-no-cudagraphs"))
    with torch.no_grad():
        x = torch.randn(2, 5, 32, device="cuda")
        torch.testing.assert_close(m(x), ref(x), atol=1e-4, rtol=1e-4)
    h.remove()


@cuda_only
def test_capture_with_merged_adapters(tmp_path):
    """LoRA factors merged into the streamed slots: the capture is
    standalone (the merges are in the graph); replays and the eager passes
    after them equal the plain model with the adapter merged, never merged
    twice."""
    ref, m = streamed(tmp_path, "cuda")
    h = laden.install_offload(m, lookahead=1)
    g = torch.Generator().manual_seed(5)
    sd = {}
    for i in (0, 3, 5):
        sd[f"blocks.{i}.up.lora_A.weight"] = torch.randn(4, 32, generator=g)
        sd[f"blocks.{i}.up.lora_B.weight"] = torch.randn(64, 4, generator=g)
    h.set_adapters([laden.AdapterSpec("lora", lambda: dict(sd))])
    with torch.no_grad():
        for i in (0, 3, 5):
            up = ref.blocks[i].up.weight
            up += sd[f"blocks.{i}.up.lora_B.weight"].cuda() @ \
                sd[f"blocks.{i}.up.lora_A.weight"].cuda()
        x0 = torch.randn(2, 5, 32, device="cuda")
        torch.testing.assert_close(m(x0), ref(x0), atol=1e-4, rtol=1e-4)
        step = h.capture(m, x0)
        for _ in range(3):
            x = torch.randn(2, 5, 32, device="cuda")
            torch.testing.assert_close(step(x), ref(x), atol=1e-4,
                                       rtol=1e-4)
            torch.testing.assert_close(m(x), ref(x), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(m(x), ref(x), atol=1e-4, rtol=1e-4)
    h.remove()


class PartAfter(Uniform):
    """Calls a part of block 3 after the loop, as DiT did with a norm of
    block 0: its weights are in a slot another block has refilled."""

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.blocks[3].down(self.blocks[3].up(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_part_called_outside_its_block_refused(tmp_path, device):
    """Compiled as eager: a streamed block's part called outside the
    block raises StateError instead of reading a refilled slot."""
    _, m = streamed(tmp_path, device, cls=PartAfter)
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m)
    with torch.no_grad(), pytest.raises(laden.StateError,
                                        match="outside the block"):
        cm(torch.randn(2, 5, 32, device=device))
    h.remove()


FAIL = [False]


@torch.library.custom_op("ladentest::maybe_fail", mutates_args=())
def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    if FAIL[0]:
        raise ValueError("told to fail")
    return x.clone()


@maybe_fail.register_fake
def _(x):
    return torch.empty_like(x)


class FailingBlock(Block):
    """Fails at run time, inside the compiled graph (an op the graph
    calls), between laden's enter and exit ops."""

    def forward(self, x):
        return super().forward(maybe_fail(x))


class FailingModel(Uniform):
    def __init__(self, d=32, h=64, n=6):
        super().__init__(d, h, n)
        self.blocks = nn.ModuleList(FailingBlock(d, h) for _ in range(n))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("then", ["compiled", "eager", "block", "thread",
                                  "release"])
def test_compiled_block_that_raises_leaves_the_model_usable(tmp_path,
                                                            device, then):
    """A compiled run that raises inside a streamed block, between its
    enter and exit ops, leaves the block entered; the next compiled or
    eager call, a call of a block alone, release(), or the end of the
    thread that failed, exits it: the model runs right again."""
    import threading

    ref, m = streamed(tmp_path, device, cls=FailingModel)
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m)
    x = torch.randn(2, 5, 32, device=device)

    def fail():
        FAIL[0] = True
        try:
            with torch.no_grad(), pytest.raises(ValueError,
                                                match="told to fail"):
                cm(x)
        finally:
            FAIL[0] = False

    with torch.no_grad():
        cm(x)
        if then == "thread":
            t = threading.Thread(target=fail)
            t.start()
            t.join()
        else:
            fail()
        if then == "release":
            laden.release(m)
            return
        if then == "block":
            y = torch.randn(2, 5, 32, device=device)
            torch.testing.assert_close(m.blocks[1](y), ref.blocks[1](y),
                                       atol=1e-5, rtol=1e-5)
        if then == "eager":
            torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cm(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()



class SideWrite(nn.Module):
    """Writes a value computed from its weights alone into a buffer it is
    given, which its output does not use."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.randn(d))

    def forward(self, x, buf):
        buf.copy_((self.g * 3).cumsum(0))
        return x + self.lin(x)


class SideWriteModel(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(SideWrite() for _ in range(n))

    def forward(self, x, bufs):
        for b, buf in zip(self.blocks, bufs):
            x = b(x, buf)
        return x


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_weight_only_side_writes(tmp_path, device):
    """Work on weights alone that feeds no output of the block, written
    into a buffer it was given: inductor ran it right after the first
    block's enter, reading other blocks' slots, until the ops took the
    weights too (declared mutated: ordered after enter, kept in place)."""
    ref, m = streamed(tmp_path, device, cls=SideWriteModel)
    h = laden.install_offload(m, lookahead=1)
    cm = torch.compile(m)
    x = torch.randn(2, 32, device=device)
    with torch.no_grad():
        got = [torch.zeros(32, device=device) for _ in range(6)]
        want = [torch.zeros(32, device=device) for _ in range(6)]
        cm(x, got)
        ref(x, want)
    h.remove()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
