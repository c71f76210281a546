"""Tiny transformer-like models for the streaming tests, built here (no
weights are fetched): buffers, tied weights, blocks of unequal size, nested
block lists, and a block that can be told to raise."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.register_buffer("scale", torch.ones(d))
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("block told to fail")
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.scale


class Tiny(nn.Module):
    """embed -> blocks[0..n) -> stages[0][..], stages[1][..] -> norm ->
    head (tied to embed)."""

    def __init__(self, vocab=97, d=32, hidden=(64, 96, 48, 128, 64, 80),
                 nested=(2, 3)):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for h in hidden)
        self.stages = nn.ModuleList(
            nn.ModuleList(Block(d, 40 + 8 * i + 16 * s) for i in range(n))
            for s, n in enumerate(nested))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        for stage in self.stages:
            for b in stage:
                x = b(x)
        return self.head(self.norm(x))


def reference(seed=0, **kw):
    torch.manual_seed(seed)
    m = Tiny(**kw).eval()
    with torch.no_grad():  # non-trivial buffers and norms
        for mod in m.modules():
            if isinstance(mod, Block):
                mod.scale.uniform_(0.5, 1.5)
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.1, 0.1)
    return m


def on_meta(**kw):
    with torch.device("meta"):
        return Tiny(**kw).eval()


PREFIXES = ["blocks.", "stages.0.", "stages.1."]
