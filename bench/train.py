#!/usr/bin/env python3
"""Training through streamed blocks (issue 17): one forward + backward of
the synthetic bf16 transformer of bench/stream.py (default 24 blocks of
hidden 4096: 9.66 GB) at --tokens tokens, every block streamed from pinned
RAM (install_offload(train=True), lookahead 2), all weights trainable:
gradients leave the device block by block into the host copies' .grad
(bf16).  Against the same model all resident on the device (plain
autograd) in the same process, and the ideal: max(the resident forward x 2
+ backward (the recomputation), the bytes over the link: the weights go up
twice (forward, then backward in reverse), their gradients come down once,
at the copy rates measured here).  Also the LoRA-style case: streamed
weights frozen, gradients only for the input.

Every weight training over two micro-batches of half the tokens (the
second's gradients added into the host .grad).

Whole steps (forward + backward + optimizer): every weight training with
torch's CPU AdamW over handle.parameters() (the host copies; foreach and
fused); a peft LoRA (r 16 on qkv, out, up, down) over the streamed frozen
base with AdamW on the device; and, side by side in the same process,
PyTorch FSDP2 with CPUOffloadPolicy on this one GPU (fully_shard per block,
its CPU AdamW).  Prints; asserts nothing.

Accumulated steps (issue 38): --accumulate N forward + backward passes
(gradients added up in the host .grad), clipping by the global norm and
handle.optimizer_step(AdamW) on the device, against N passes + one pass
of weights, gradients and state over the link, beside FSDP2 with the same
accumulation and clip_grad_norm_.

    python bench/train.py [--blocks 24 --hidden 4096] [--tokens 2048]
                          [--no-fsdp] [--no-lora] [--accumulate 4] [--only-38]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import laden  # noqa: E402
import stream as sb  # noqa: E402


def step_ms(fn, repeats):
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[1:])
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--no-fsdp", action="store_true")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--accumulate", type=int, default=4, metavar="N",
                    help="issue 38's step: N micro-batches of --tokens "
                    "each, clipping by the global norm and "
                    "handle.optimizer_step on the device (FSDP2 with the "
                    "same accumulation beside it); 0: skip")
    ap.add_argument("--only-38", action="store_true",
                    help="only issue 38's rows: every weight training "
                    "(for the ideal), --accumulate with optimizer_step, "
                    "the LoRA steps (streamed and cached) and FSDP2 with "
                    "the same accumulation")
    ap.add_argument("--micro-only", action="store_true",
                    help="only every weight training, one batch and two "
                    "micro-batches")
    a = ap.parse_args()
    if a.micro_only:
        a.no_lora = a.no_fsdp = True
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    a.device = torch.device("cuda", 0)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"synth-{a.blocks}x{a.hidden}.safetensors")
    if not os.path.exists(path):
        sb.write_checkpoint(a, path)
    h2d = d2h = None
    from laden._lib import lib, COPY_H2D_PINNED, COPY_D2H_PINNED
    import ctypes
    for kind in (COPY_H2D_PINNED, COPY_D2H_PINNED):
        r = ctypes.c_double()
        lib.laden_dev_measure_copy(0, kind, 256 << 20, 8, ctypes.byref(r))
        if kind == COPY_H2D_PINNED:
            h2d = r.value
        else:
            d2h = r.value
    x = torch.randn(1, a.tokens, a.hidden, device=a.device,
                    dtype=torch.bfloat16)
    print(f"model: {a.blocks} blocks of hidden {a.hidden}, {a.tokens} "
          f"tokens, bf16; pinned H2D {h2d / 1e9:.1f} GB/s, D2H "
          f"{d2h / 1e9:.1f} GB/s")

    # Resident: plain autograd.
    m = sb.build_meta(a)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=a.device,
                      resident_prefixes=["blocks."], progress=False)
    xr = x.clone().requires_grad_(True)

    def fwd_bwd_plain():
        for p in m.parameters():
            p.grad = None
        m(xr).float().pow(2).mean().backward()

    for p in m.parameters():
        p.requires_grad_(True)
    t_res = step_ms(fwd_bwd_plain, a.repeats)
    with torch.no_grad():
        t_fwd = step_ms(lambda: m(x), a.repeats)
    wbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    laden.release(m)
    del m
    gc.collect()
    torch.cuda.empty_cache()

    rows, steps = [], []
    for frozen in (False,) if a.micro_only or a.only_38 else (False, True):
        m = sb.build_meta(a)
        laden.stream_load(m, path, offload_prefixes=["blocks."],
                          device=a.device, lookahead=2, progress=False)
        for p in m.parameters():
            p.requires_grad_(not frozen)
        h = laden.install_offload(m, train=True)
        params = list(h.parameters())

        def fwd_bwd():
            for p in params:
                p.grad = None
            xr.grad = None
            m(xr).float().pow(2).mean().backward()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        s0 = h.stats()
        t = step_ms(fwd_bwd, a.repeats)
        s1 = h.stats()
        peak = torch.cuda.max_memory_allocated() - base
        n = a.repeats + 1
        up = (s1["h2d_bytes"] - s0["h2d_bytes"]) / n
        down = 0 if frozen else wbytes
        ideal = max(2 * t_fwd + (t_res - t_fwd),
                    1e3 * max(up / h2d, down / d2h))
        rows.append(("frozen weights (LoRA-style)" if frozen
                     else "all weights train", t, ideal, up, down, peak,
                     s1["device_bytes"], s1["misses"] - s0["misses"]))
        if not frozen and not a.only_38:
            # Two micro-batches of half the tokens: the second adds its
            # gradients to the first's on the device (the sum so far comes
            # up: one more model's size over the up link).
            half = xr[:, : a.tokens // 2].detach().requires_grad_(True)

            def two_micro():
                for p in params:
                    p.grad = None
                for _ in range(2):
                    m(half).float().pow(2).mean().backward()

            tm = step_ms(two_micro, a.repeats)
            link = 1e3 * max((2 * up + wbytes) / h2d, 2 * wbytes / d2h)
            print(f"every weight, 2 micro-batches of {a.tokens // 2} tokens "
                  f"(the second added on the device): {tm:.1f} ms, against "
                  f"{t:.1f} ms for one batch of {a.tokens}; link ideal "
                  f"{link:.1f} ms ({tm / link:.2f}x)")
            if a.micro_only:
                laden.release(m, h)
                break
            for kind in ("foreach", "fused"):
                opt = torch.optim.AdamW(params, lr=1e-5, **{kind: True})
                try:
                    tw, f, o, pk = _whole_step(fwd_bwd, opt.step, a.repeats)
                except Exception as e:  # e.g. fused not on this build
                    print(f"AdamW({kind}=True) on the host: {e}")
                    continue
                steps.append((f"laden, all train, CPU AdamW {kind}", tw, f,
                              o, pk, sb.rss()))
                del opt
                gc.collect()
            # AdamW on the device inside backward: the state goes up and
            # comes home with the weights; no gradient leaves the device.
            for look in (2, 4):
                if look != 2:
                    h.remove()
                    h = laden.install_offload(m, train=True, lookahead=look)
                    params = list(h.parameters())
                opt = torch.optim.AdamW(params, lr=1e-5)
                h.step_in_backward(opt)
                g0 = _sink_bytes(h)
                s0 = h.stats()
                tw, f, o, pk = _whole_step(fwd_bwd, opt.step, a.repeats)
                n = a.repeats + 1
                up = (h.stats()["h2d_bytes"] - s0["h2d_bytes"]) / n
                state = 2 * wbytes  # exp_avg, exp_avg_sq in bf16
                down = (_sink_bytes(h) - g0) / n
                ideal_f = max(2 * t_fwd + (t_res - t_fwd),
                              1e3 * (wbytes / h2d +
                                     max((wbytes + state) / h2d,
                                         down / d2h)))
                steps.append((f"laden, all train, AdamW on GPU in backward"
                               f" (lookahead {look})", tw, f, o, pk,
                               sb.rss()))
                print(f"step_in_backward, lookahead {look}: weights up "
                      f"{up / 1e9:.2f} GB + state up {state / 1e9:.2f} GB, "
                      f"home {down / 1e9:.2f} GB per step; ideal "
                      f"{ideal_f:.1f} ms, measured {tw:.1f} ms "
                      f"({tw / ideal_f:.2f}x)")
                h.step_in_backward(None)
                del opt
                gc.collect()
        if not frozen:
            if a.accumulate:
                steps.append(accumulate_step(a, m, h, params, xr, wbytes,
                                             t, h2d, d2h))
                gc.collect()
        laden.release(m, h)
        del m, h, params
        gc.collect()
        torch.cuda.empty_cache()

    if not a.no_lora:
        try:
            steps.append(lora_step(a, path, xr))
        except Exception as e:
            print(f"LoRA step: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()
        try:
            steps.append(cache_lora_step(a, path, xr))
        except Exception as e:
            print(f"cached LoRA step: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()
    if not a.no_fsdp:
        try:
            steps += fsdp2_step(a, xr)
        except Exception as e:
            print(f"FSDP2 CPUOffloadPolicy: {type(e).__name__}: {e}")

    print(f"resident forward {t_fwd:.1f} ms, forward+backward "
          f"{t_res:.1f} ms; weights {wbytes / 1e9:.2f} GB")
    print(f"{'streamed, train=True':<30} {'ms':>8} {'ideal':>8} {'x':>6} "
          f"{'up GB':>7} {'down GB':>8} {'torch peak GB':>14} "
          f"{'laden dev GB':>13} {'misses':>7}")
    for name, t, ideal, up, down, peak, dev, miss in rows:
        print(f"{name:<30} {t:>8.1f} {ideal:>8.1f} {t / ideal:>6.2f} "
              f"{up / 1e9:>7.2f} {down / 1e9:>8.2f} {peak / 1e9:>14.2f} "
              f"{dev / 1e9:>13.2f} {miss / (a.repeats + 1):>7.1f}")
    print()
    print(f"{'whole step':<56} {'ms':>8} {'fwd+bwd':>8} {'optim':>8} "
          f"{'torch peak GB':>14} {'host RSS GB':>12}")
    for name, t, fb, st, peak, rss in steps:
        print(f"{name:<56} {t:>8.1f} {fb:>8.1f} {st:>8.1f} "
              f"{peak / 1e9:>14.2f} {rss / 1e9:>12.2f}")
    fs = [x for x in steps if x[0].startswith("FSDP2")]
    for x in steps:
        if x in fs or not fs:
            continue
        acc = "micro-batches" in x[0]  # against FSDP2's same accumulation
        ref = next((f for f in fs if ("micro-batches" in f[0]) == acc),
                   None)
        if ref is not None:
            print(f"  {x[0]}: {ref[0]} / this = {ref[1] / x[1]:.2f}x")
    return 0


def _sink_bytes(h) -> int:
    import ctypes
    from laden._lib import lib

    b, n = ctypes.c_uint64(), ctypes.c_uint64()
    lib.laden_grads_stats(h.trainer.sink, ctypes.byref(b), ctypes.byref(n))
    return b.value


def _whole_step(fb, step, repeats):
    """Median ms of fb() + step(), of fb() and of step() alone, and torch's
    device peak over what was allocated when it began."""
    fbs, steps = [], []

    def whole():
        t0 = time.perf_counter()
        fb()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        fbs.append((t1 - t0) * 1e3)
        steps.append((time.perf_counter() - t1) * 1e3)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = step_ms(whole, repeats)
    med = lambda v: sorted(v[1:])[len(v[1:]) // 2]  # noqa: E731
    return t, med(fbs), med(steps), torch.cuda.max_memory_allocated() - base


def lora_step(a, path, xr):
    """peft LoRA r 16 on every linear of the streamed, frozen base; AdamW
    on the device over the adapters."""
    from peft import LoraConfig, get_peft_model

    m = sb.build_meta(a)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=a.device,
                      lookahead=2, progress=False)
    pm = get_peft_model(m, LoraConfig(
        r=16, lora_alpha=16, target_modules=["qkv", "out", "up", "down"]))
    h = laden.install_offload(pm, train=True)
    opt = torch.optim.AdamW(h.parameters(), lr=1e-4)
    x = xr.detach()

    def fb():
        opt.zero_grad()
        pm(x).float().pow(2).mean().backward()

    t, f, s, peak = _whole_step(fb, opt.step, a.repeats)
    n = sum(p.numel() for p in h.parameters())
    laden.release(m, h)
    return (f"laden, peft LoRA ({n / 1e6:.0f}M), AdamW on GPU", t, f, s,
            peak, sb.rss())


def cache_lora_step(a, path, xr):
    """Issue 38: the same LoRA on a cached base (ModelSpec(trainable=True),
    built on meta over the base's checkpoint): the base streams within the
    cache's VRAM budget (a third of the checkpoint), the factors train
    through their host copies and AdamW steps them there; each step is a
    whole cache.use (activation included)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=16, lora_alpha=16,
                     target_modules=["qkv", "out", "up", "down"])
    cache = laden.ModelCache(vram_budget=os.path.getsize(path) // 3)
    spec = laden.ModelSpec(
        "base", lambda: get_peft_model(sb.build_meta(a), cfg),
        checkpoint=path, block_paths=["base_model.model.blocks"],
        trainable=True)
    t0 = time.perf_counter()
    try:
        with cache.use(spec, device=a.device):
            opt = torch.optim.AdamW(cache.parameters("base"), lr=1e-4)
        print(f"cached LoRA base built and first used in "
              f"{time.perf_counter() - t0:.1f} s")
        x = xr.detach()

        def fb():
            with cache.use("base", device=a.device) as pm:
                opt.zero_grad()
                pm(x).float().pow(2).mean().backward()

        t, f, s, peak = _whole_step(fb, opt.step, a.repeats)
        n = sum(p.numel() for p in cache.parameters("base"))
        mode = cache.info("base").mode
    finally:  # its memory back, also when the step failed
        cache.unregister("base")
    return (f"laden cache ({mode}), peft LoRA ({n / 1e6:.0f}M), host AdamW",
            t, f, s, peak, sb.rss())


def accumulate_step(a, m, h, params, xr, wbytes, t_fb, h2d, d2h):
    """Issue 38: a.accumulate forward + backward passes of xr, their
    gradients added up in the host .grad, then optimizer_step(AdamW,
    max_norm=1.0): weights, gradients and state (bf16 weights and
    gradients, exp_avg and exp_avg_sq in bf16: 4 x the weights) up,
    weights and state home.  Ideal: N x one measured forward + backward
    (at its link ideal or better) + that pass over the link."""
    opt = torch.optim.AdamW(params, lr=1e-5)
    n = a.accumulate

    def fb():
        for _ in range(n):
            m(xr).float().pow(2).mean().backward()

    def step():
        h.optimizer_step(opt, max_norm=1.0)
        opt.zero_grad()

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    tw, f, o, pk = _whole_step(fb, step, a.repeats)
    state = 2 * wbytes
    link = 1e3 * max((2 * wbytes + state) / h2d, (wbytes + state) / d2h)
    ideal = n * t_fb + link
    print(f"{n} micro-batches + clip + optimizer_step: {tw:.1f} ms "
          f"(passes {f:.1f}, step {o:.1f}); ideal {ideal:.1f} ms "
          f"({n} x {t_fb:.1f} + {link:.1f} over the link): "
          f"{tw / ideal:.2f}x; torch's peak during it {pk / 1e9:.2f} GB "
          f"above the {base / 1e9:.2f} GB held before; laden's device "
          f"memory {h.stats()['device_bytes'] / 1e9:.2f} GB")
    del opt
    return (f"laden, {n} micro-batches + clip + optimizer_step on GPU", tw,
            f, o, pk, sb.rss())


def fsdp2_step(a, xr):
    """PyTorch FSDP2 on this one GPU with CPUOffloadPolicy: parameters,
    gradients and AdamW on the host, each block's all-gather a copy up."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=a.device)
    try:
        m = sb.build_meta(a)
        for b in m.blocks:
            fully_shard(b, offload_policy=CPUOffloadPolicy())
        fully_shard(m, offload_policy=CPUOffloadPolicy())
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.to_local().normal_(0, 0.02)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
        x = xr.detach().requires_grad_(True)

        def fb():
            opt.zero_grad()
            m(x).float().pow(2).mean().backward()

        out = []
        if not a.only_38:
            t, f, s, peak = _whole_step(fb, opt.step, a.repeats)
            out.append(("FSDP2 CPUOffloadPolicy (CPU AdamW)", t, f, s, peak,
                        sb.rss()))
        if a.accumulate:
            def fbn():
                opt.zero_grad()
                for _ in range(a.accumulate):
                    m(x).float().pow(2).mean().backward()

            def clip_step():
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()

            t, f, s, peak = _whole_step(fbn, clip_step, a.repeats)
            out.append((f"FSDP2 CPUOffloadPolicy, {a.accumulate} "
                        "micro-batches + clip", t, f, s, peak, sb.rss()))
        del m, opt
    finally:
        dist.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    sys.exit(main())
