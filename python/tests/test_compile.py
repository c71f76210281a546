"""Compiling the blocks laden runs (install_offload(compile=...)): each
block class is compiled once, laden's enter and exit stay outside the
compiled code, outputs and gradients are the eager model's."""

import copy

import pytest
import torch
import torch.nn as nn

import laden
from models import Block


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


def load(tmp_path, **kw):
    torch.manual_seed(0)
    ref = Uniform().eval()
    path = str(tmp_path / "u.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = Uniform().eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], **kw)
    return ref, m


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("tiers", [dict(ram_budget=0), {}])
def test_each_block_class_compiled_once(tmp_path, tiers):
    """Streamed from disk (or RAM) and two blocks kept resident: one graph
    per block layout -- a streamed block's parts carry laden's guard
    against calls from outside it, a resident block's do not, and Dynamo
    guards on hooks -- for all six blocks, none more on later calls or
    other lengths; the outputs are the eager model's; remove() gives the
    blocks their own forward back."""
    ref, m = load(tmp_path, resident_prefixes=["blocks.2.", "blocks.4."],
                  **tiers)
    be = Counting()
    h = laden.install_offload(m, lookahead=1,
                              compile=laden.BlockCompile(backend=be))
    with torch.no_grad():
        for t in (5, 9, 5):
            x = torch.randn(2, t, 32)
            torch.testing.assert_close(m(x), ref(x), atol=1e-6, rtol=1e-5)
    layouts = {tuple(len(p._forward_pre_hooks) for p in b.modules())
               for b in m.blocks}
    assert be.graphs == len(layouts) <= 2
    assert all("forward" in b.__dict__ for b in m.blocks)
    h.remove()
    assert not any("forward" in b.__dict__ for b in m.blocks)
    if tiers:  # disk-tier blocks refuse to run without install_offload
        return
    with torch.no_grad():
        x = torch.randn(2, 7, 32)
        torch.testing.assert_close(m(x), ref(x), atol=1e-6, rtol=1e-5)
    assert be.graphs == len(layouts)  # not compiled any more


def test_inductor_output_matches_eager(tmp_path):
    """The default backend (inductor, on the CPU here): the same outputs
    within float tolerance."""
    ref, m = load(tmp_path, ram_budget=0)
    h = laden.install_offload(m, lookahead=1, compile=True)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)
    h.remove()


def test_training_through_compiled_blocks(tmp_path):
    """train=True with compiled blocks: the recomputation in backward runs
    the compiled forward; gradients equal the eager model's."""
    ref, m = load(tmp_path, ram_budget=0)
    for p in m.blocks.parameters():
        p.requires_grad_(False)
    r = copy.deepcopy(ref)
    for p in r.blocks.parameters():
        p.requires_grad_(False)
    be = Counting()
    h = laden.install_offload(m, train=True, lookahead=1,
                              compile=laden.BlockCompile(backend=be))
    x = torch.randn(2, 5, 32)
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
    with pytest.raises(laden.InvalidArgumentError, match="CUDA graphs"):
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
