#!/usr/bin/env python3
"""A mixture-of-experts model under laden: what crosses per decode token.

A Qwen3-MoE-shaped model from a config (random bf16 weights, written once
with save_pretrained: per-expert tensors, which laden joins on load) runs
greedy decode under laden.from_pretrained with a budget; the table gives
per decode token the bytes laden moved (disk reads on the CPU, host to
device copies on CUDA), the bytes of the experts the router picked (the
floor when only those move), their ratio, and tokens/s.  Logits of the
first step are compared with transformers' own loading (exact or not).

    python bench/moe.py                       # CPU: tiny, disk tier
    python bench/moe.py --device cuda --layers 16 --experts 128 \\
        --hidden 2048 --expert-width 768 --budget 0.25

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def config(a):
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden,
        intermediate_size=4 * a.hidden, moe_intermediate_size=a.expert_width,
        num_hidden_layers=a.layers, num_attention_heads=max(a.hidden // 128,
                                                            1),
        num_key_value_heads=max(a.hidden // 512, 1), head_dim=128 if
        a.hidden >= 128 else a.hidden, num_experts=a.experts,
        num_experts_per_tok=a.top_k, decoder_sparse_step=1,
        max_position_embeddings=4096, tie_word_embeddings=False)


def routed_counter(model, experts_total):
    """Hooks on each layer's router that count the distinct experts it
    picks per call: the floor of what must move."""
    picked = []

    def hook(mod, args, out):
        idx = out[-1] if isinstance(out, tuple) else out
        picked.append(int(torch.unique(idx).numel()))
    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules()
             if n.endswith("mlp.gate")]
    return picked, hooks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--expert-width", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.0,
                    help="VRAM (CUDA) or RAM (CPU) budget as a share of "
                         "the model's bytes")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()

    import transformers

    import laden

    dev = torch.device(a.device)
    cfg = config(a)
    d = a.dir or tempfile.mkdtemp(prefix="laden-moe-")
    if not os.path.exists(os.path.join(d, "config.json")):
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16) \
            .save_pretrained(d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors"))
    expert_bytes = 3 * a.hidden * a.expert_width * 2  # gate, up, down bf16
    budget = int(size * a.budget)
    kw = ({"vram_budget": max(budget, 1)} if dev.type == "cuda"
          else {"ram_budget": budget})
    ids = torch.randint(0, a.vocab, (1, 8),
                        generator=torch.Generator().manual_seed(1)).to(dev)
    plain = transformers.Qwen3MoeForCausalLM.from_pretrained(
        d, dtype=torch.bfloat16).to(dev).eval()
    with torch.no_grad():
        want = plain(ids).logits
    del plain
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    m = laden.from_pretrained(transformers.Qwen3MoeForCausalLM, d,
                              device=dev, progress=False, **kw)
    st = m._laden_stream
    tiers = sorted({b.tier_name for b in st.blocks})
    picked, hooks = routed_counter(m, a.experts)
    with torch.no_grad():
        out = m(ids, use_cache=True)
        exact = torch.equal(out.logits, want)
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        picked.clear()
        s0 = st.stats()
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            out = m(tok, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        s1 = st.stats()
    for h in hooks:
        h.remove()
    moved = ((s1.h2d_bytes - s0.h2d_bytes) if dev.type == "cuda"
             else (s1.read_bytes - s0.read_bytes)) / a.tokens
    floor = sum(picked) * expert_bytes / a.tokens
    laden.release(m)
    print(f"\nmoe.py  {time.strftime('%Y-%m-%d %H:%M')}  {dev}  "
          f"torch {torch.__version__}")
    print(f"Qwen3-MoE-shaped: {a.layers} layers, {a.experts} experts "
          f"(top-{a.top_k}), hidden {a.hidden}, expert width "
          f"{a.expert_width}; {size / 1e6:.1f} MB; budget "
          f"{a.budget:.0%} of it; tiers {', '.join(tiers)}")
    rows = [("per decode token", "value"),
            ("moved by laden (MB)", f"{moved / 1e6:.3f}"),
            ("routed experts (MB)", f"{floor / 1e6:.3f}"),
            ("moved / routed", f"{moved / floor:.1f} x" if floor else "-"),
            ("tokens/s", f"{a.tokens / sec:.1f}"),
            ("first step logits = transformers'", str(exact))]
    w = max(len(r[0]) for r in rows)
    for i, (k, v) in enumerate(rows):
        print(f"  {k.ljust(w)}  {v}")
        if i == 0:
            print(f"  {'-' * w}  -----")
    return 0


if __name__ == "__main__":
    sys.exit(main())
