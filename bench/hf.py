#!/usr/bin/env python3
"""transformers and diffusers models under a VRAM budget, one process:

  causal LM (Llama family, from a config, random bf16 weights, written
  once with save_pretrained): greedy generate() tokens/s of
    resident               from_pretrained(...).to("cuda")
    laden                  laden.from_pretrained(..., vram_budget=B)
    laden lossless         the same with compression="lossless"
    device_map="auto"      from_pretrained(..., device_map="auto",
                           max_memory={0: B, "cpu": ...})
  with B a third of the model, the tokens compared with the resident
  model's, and laden's time per token against the link's floor (bytes
  streamed per token / measured pinned host-to-device rate).

  diffusers DDPMPipeline with a large UNet2DModel (from a config): seconds
  per image of the resident pipeline, laden.offload_pipeline under a
  budget of half the denoiser, enable_model_cpu_offload() and
  enable_group_offload(block_level, use_stream=True).

Prints tables; asserts nothing.

    python bench/hf.py [--layers 16 --hidden 2048] [--tokens 32]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time

import torch

import laden
from laden import _lib

HERE = os.path.dirname(os.path.abspath(__file__))


def fmt(n: float) -> str:
    return laden._units.fmt_bytes(int(n)) if hasattr(laden, "_units") \
        else f"{n / 1e9:.2f} GB"


def table(rows) -> None:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            print("  ".join("-" * x for x in w))


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def h2d_rate() -> float:
    rate = ctypes.c_double()
    _lib.check(_lib.lib.laden_dev_measure_copy(
        torch.cuda.current_device(), _lib.COPY_H2D_PINNED, 256 << 20, 10,
        ctypes.byref(rate)))
    return rate.value


def write_lm(a, d: str, device: str = "cuda") -> None:
    """A Llama of a.layers x a.hidden (MLP a.inter, vocabulary a.vocab),
    random bf16 weights made on `device`, written with save_pretrained."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden,
        intermediate_size=a.inter, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 128,
        num_key_value_heads=max(a.hidden // 512, 1),
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(d)
    del m
    if device.startswith("cuda"):
        free_gpu()


def gen_time(model, ids, n: int):
    """(seconds for n new tokens, the tokens), after a short warm-up."""
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out.cpu()


def bench_lm(a) -> None:
    import transformers

    d = os.path.join(a.dir, f"hf-llama-{a.layers}x{a.hidden}")
    if not os.path.isdir(d):
        print(f"writing {d} ...", flush=True)
        write_lm(a, d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors"))
    budget = int(size * a.budget)
    params = size // 2
    ids = torch.randint(0, a.vocab, (1, a.prompt),
                        generator=torch.Generator().manual_seed(1)).cuda()
    rows = [["model", "load s", "s for tokens", "tokens/s", "ms/token",
             "same tokens", "peak VRAM"]]
    ref = None
    res = {}

    def run(name, load):
        nonlocal ref
        free_gpu()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m, done = load()
        t_load = time.perf_counter() - t0
        t, out = gen_time(m, ids, a.tokens)
        peak = torch.cuda.max_memory_allocated()
        if ref is None:
            ref = out
        same = "yes" if torch.equal(out, ref) else "NO"
        res[name] = t / a.tokens
        rows.append([name, f"{t_load:.1f}", f"{t:.2f}",
                     f"{a.tokens / t:.1f}", f"{t / a.tokens * 1e3:.1f}",
                     same, fmt(peak)])
        print(f"  {name}: {a.tokens / t:.2f} tokens/s", flush=True)
        extra = done(m)
        del m
        free_gpu()
        return extra

    cls = transformers.AutoModelForCausalLM
    run("resident (transformers, all on the GPU)", lambda: (
        cls.from_pretrained(d, dtype=torch.bfloat16).cuda().eval(),
        lambda m: None))

    def laden_load():
        m = laden.from_pretrained(cls, d, device="cuda", vram_budget=budget)
        return m, laden_done

    def laden_done(m):
        st = m._laden_stream
        streamed = sum(b.nbytes for b in st.blocks
                       if b.tier_name != "resident")
        laden.release(m)
        return streamed

    streamed = run(f"laden.from_pretrained, vram_budget={fmt(budget)}",
                   laden_load)

    def lossless_load():  # issue 37: the streamed blocks kept coded
        m = laden.from_pretrained(cls, d, device="cuda", vram_budget=budget,
                                  compression="lossless")
        return m, laden_done  # the blocks' bytes: their coded sizes

    coded_streamed = None
    ll_name = f'laden, compression="lossless", vram_budget={fmt(budget)}'
    if not a.no_lossless:
        coded_streamed = run(ll_name, lossless_load)
    if not a.laden_only:
        run(f'transformers device_map="auto", max_memory {fmt(budget)}',
            lambda: (cls.from_pretrained(
                d, dtype=torch.bfloat16, device_map="auto",
                max_memory={0: budget, "cpu": 100 << 30}).eval(),
                lambda m: None))
    # Once more at the end: the first model of a process also warms the
    # GPU's clocks and libraries.
    run("resident, again", lambda: (
        cls.from_pretrained(d, dtype=torch.bfloat16).cuda().eval(),
        lambda m: None))
    rate = h2d_rate()
    floor = streamed / rate
    lname = [k for k in res if k.startswith("laden.from")][0]
    print()
    print(f"hf.py  {time.strftime('%Y-%m-%d %H:%M')}  "
          f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}")
    print(f"causal LM: Llama, {a.layers} layers, hidden {a.hidden}, "
          f"{params / 1e9:.2f} B parameters, {fmt(size)} bf16; prompt "
          f"{a.prompt} tokens, {a.tokens} new tokens, greedy")
    table(rows)
    print(f"laden streams {fmt(streamed)} a token; pinned host-to-device "
          f"{rate / 1e9:.1f} GB/s; the link's floor {floor * 1e3:.1f} ms a "
          f"token")
    print(f"goals: laden floor / time a token = "
          f"{floor / res[lname]:.3f} (goal >= 0.95)")
    if coded_streamed is not None:
        ll_floor = coded_streamed / rate
        print(f"lossless: streams {fmt(coded_streamed)} a token (floor "
              f"{ll_floor * 1e3:.1f} ms); tokens/s {res[lname] / res[ll_name]:.2f}"
              f" x laden's as stored; its floor / time a token = "
              f"{ll_floor / res[ll_name]:.3f}")
    dm = [k for k in res if "device_map" in k]
    if dm:
        print(f"       laden tokens/s / device_map=\"auto\" = "
              f"{res[dm[0]] / res[lname]:.1f} (goal >= 5)")


def bench_pipe(a) -> None:
    import diffusers
    import numpy as np

    d = os.path.join(a.dir, "hf-ddpm-unet-fp16")
    if not os.path.isdir(d):
        print(f"writing {d} ...", flush=True)
        torch.manual_seed(0)
        unet = diffusers.UNet2DModel(
            sample_size=64, in_channels=3, out_channels=3,
            layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("DownBlock2D", "AttnDownBlock2D",
                              "AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D",
                            "UpBlock2D")).to(torch.float16)
        diffusers.DDPMPipeline(
            unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(d)
        del unet
    steps = a.steps

    def load():
        return diffusers.DDPMPipeline.from_pretrained(
            d, torch_dtype=torch.float16)

    def image(pipe):
        return pipe(batch_size=1, num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(2),
                    output_type="np").images

    rows = [["pipeline", "s / image", "same image", "peak VRAM"]]
    ref = None
    unet_bytes = None
    out = {}

    def run(name, prepare, undo=None):
        nonlocal ref
        free_gpu()
        pipe = load()
        pipe.set_progress_bar_config(disable=True)
        extra = prepare(pipe)
        image(pipe)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        img = image(pipe)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated()
        if ref is None:
            ref = img
        same = "yes" if np.array_equal(img, ref) else \
            f"max diff {np.abs(img - ref).max():.3g}"
        out[name] = t
        rows.append([name, f"{t:.2f}", same, fmt(peak)])
        print(f"  {name}: {t:.2f} s/image", flush=True)
        if undo:
            undo(extra)
        del pipe
        free_gpu()

    p0 = load()
    unet_bytes = sum(p.numel() * p.element_size()
                     for p in p0.unet.parameters())
    del p0
    budget = unet_bytes // 2
    run("resident (pipe.to('cuda'))", lambda p: p.to("cuda"))
    run(f"laden.offload_pipeline, vram_budget={fmt(budget)}",
        lambda p: laden.offload_pipeline(p, device="cuda",
                                         vram_budget=budget),
        lambda h: h.remove())
    if not a.laden_only:
        run("enable_model_cpu_offload()",
            lambda p: p.enable_model_cpu_offload())
        run("unet.enable_group_offload(block_level, use_stream=True)",
            lambda p: p.unet.enable_group_offload(
                onload_device=torch.device("cuda"),
                offload_device=torch.device("cpu"),
                offload_type="block_level", num_blocks_per_group=1,
                use_stream=True))
    print()
    print(f"diffusers {diffusers.__version__}: DDPMPipeline, UNet2DModel "
          f"{fmt(unet_bytes)} fp16, 64x64, {steps} steps; laden's budget "
          f"is half the denoiser")
    table(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budget", type=float, default=1 / 3,
                    help="VRAM budget as a share of the model")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--laden-only", action="store_true")
    ap.add_argument("--no-lossless", action="store_true",
                    help="without the compression=\"lossless\" row")
    ap.add_argument("--skip", default="", help="lm, pipe")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf.py needs a CUDA device")
        return 1
    os.makedirs(a.dir, exist_ok=True)
    if "lm" not in a.skip:
        bench_lm(a)
    if "pipe" not in a.skip:
        print()
        bench_pipe(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
