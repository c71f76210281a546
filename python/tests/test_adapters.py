"""Adapters on streamed and resident weights (laden.AdapterSpec,
OffloadHandle.set_adapters, laden.merge_adapter) against peft's merged
models: tiny transformers and diffusers models, LoRA adapters peft writes
(random factors, no hub), blocks resident, in RAM and on disk."""

import copy
import os

import pytest
import torch

import laden

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def tiny_llama():
    c = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(c).eval()


def lora(ref, tmp_path, name, alpha=8, seed=1, targets=TARGETS):
    """peft LoRA on a copy of ref, saved; returns (dir, merged model)."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        r=4, lora_alpha=alpha, target_modules=targets,
        init_lora_weights=False))
    d = str(tmp_path / name)
    pm.save_pretrained(d)
    return d, pm.merge_and_unload().eval()


def tiers(device):
    """(name, from_pretrained budgets): resident, RAM and disk blocks."""
    if device == "cuda":
        return [("resident", {}), ("ram", {"vram_budget": 700_000}),
                ("disk", {"vram_budget": 700_000, "ram_budget": 0})]
    return [("ram", {}), ("mixed", {"ram_budget": 250_000}),
            ("disk", {"ram_budget": 0})]


def logits(m, device):
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return m(ids.to(device)).logits.float().cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_lora_matches_peft_in_every_tier(tmp_path, device):
    """Merged and routed outputs equal peft's merged model; strengths 0,
    0.5 and 1 (0.5 = peft with half the alpha); two adapters at once; the
    base restored bit for bit once they are removed; repeated forwards
    do not merge twice."""
    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    _, a_half = lora(ref, tmp_path, "a-half", alpha=4)
    b_dir, _ = lora(ref, tmp_path, "b", seed=2, targets=["k_proj", "o_proj",
                                                         "q_proj"])
    # Both at once: peft's two adapters merged one after the other.
    torch.manual_seed(1)
    both = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    both = both.merge_and_unload()
    torch.manual_seed(2)
    both = peft.get_peft_model(both, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "q_proj"],
        init_lora_weights=False)).merge_and_unload().eval()
    base = logits(ref.to(device), device)
    want = logits(a_merged.to(device), device)
    half = logits(a_half.to(device), device)
    want2 = logits(both.to(device), device)
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)
    tol = dict(atol=2e-5, rtol=1e-4)
    for name, kw in tiers(device):
        m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device=device, **kw)
        got_tiers = {b.tier_name for b in m._laden_stream.blocks}
        if name == "mixed":
            assert len(got_tiers) == 2, got_tiers
        h = m._laden_stream.handle
        for mode in ("merge", "routed"):
            h.set_adapters([A], mode=mode)
            for _ in range(3):  # a block still in its slot: not twice
                torch.testing.assert_close(logits(m, device), want, **tol)
            h.set_adapters([A], strengths=[0.5], mode=mode)
            torch.testing.assert_close(logits(m, device), half, **tol)
            h.set_adapters([A], strengths=[0.0], mode=mode)
            torch.testing.assert_close(logits(m, device), base, **tol)
            h.set_adapters([A, B], mode=mode)
            torch.testing.assert_close(logits(m, device), want2, **tol)
        h.set_adapters([])
        assert torch.equal(logits(m, device), base), name  # bit for bit
        laden.release(m)


def test_kohya_names_deltas_and_values(tmp_path):
    """kohya's lora_down/lora_up/alpha under lora_te_ names, a full-rank
    delta and a replacement value give the update they describe."""
    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    g = torch.Generator().manual_seed(5)
    down = torch.randn(4, 64, generator=g) * 0.1
    up = torch.randn(64, 4, generator=g) * 0.1
    delta = torch.randn(160, 64, generator=g) * 0.01
    value = torch.randn(64, generator=g)
    sd = {"lora_te_model_layers_2_self_attn_q_proj.lora_down.weight": down,
          "lora_te_model_layers_2_self_attn_q_proj.lora_up.weight": up,
          "lora_te_model_layers_2_self_attn_q_proj.alpha":
              torch.tensor(2.0),
          "model.layers.4.mlp.up_proj.delta.weight": delta,
          "model.norm.weight": value}
    path = str(tmp_path / "k.safetensors")
    laden.save_file(sd, path)
    plain = copy.deepcopy(ref)
    with torch.no_grad():
        plain.model.layers[2].self_attn.q_proj.weight += \
            0.7 * (2.0 / 4) * up @ down
        plain.model.layers[4].mlp.up_proj.weight += 0.7 * delta
        plain.model.norm.weight.copy_(value)
    want = logits(plain, "cpu")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    m._laden_stream.handle.set_adapters([laden.AdapterSpec("k", path)],
                                        strengths=[0.7])
    torch.testing.assert_close(logits(m, "cpu"), want, atol=2e-5, rtol=1e-4)
    # From a function returning the state dict: the same.
    m._laden_stream.handle.set_adapters(
        [laden.AdapterSpec("k2", lambda: dict(sd))], strengths=[0.7])
    torch.testing.assert_close(logits(m, "cpu"), want, atol=2e-5, rtol=1e-4)
    laden.release(m)


def test_errors_change_nothing(tmp_path):
    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    h = m._laden_stream.handle
    A = laden.AdapterSpec("a", a_dir)
    h.set_adapters([A])
    want = logits(m, "cpu")
    bad = str(tmp_path / "bad.safetensors")
    laden.save_file({"model.layers.0.self_attn.q_proj.lora_A.weight":
                     torch.zeros(4, 64),
                     "model.layers.0.self_attn.q_proj.lora_B.weight":
                     torch.zeros(64, 4),
                     "model.layers.0.nope.lora_A.weight": torch.zeros(4, 64),
                     "model.layers.0.nope.lora_B.weight": torch.zeros(64, 4)},
                    bad)
    with pytest.raises(laden.AdapterError, match="nope"):
        h.set_adapters([laden.AdapterSpec("bad", bad)])
    h.set_adapters([laden.AdapterSpec("part", bad,
                                      allow_partial_targets=True), A])
    shape = str(tmp_path / "shape.safetensors")
    laden.save_file({"model.layers.0.self_attn.q_proj.lora_A.weight":
                     torch.zeros(4, 63),
                     "model.layers.0.self_attn.q_proj.lora_B.weight":
                     torch.zeros(64, 4)}, shape)
    with pytest.raises(laden.AdapterError) as e:
        h.set_adapters([laden.AdapterSpec("shape", shape)])
    assert "q_proj.weight" in str(e.value) and "(4, 63)" in str(e.value) \
        and "(64, 64)" in str(e.value)
    with pytest.raises(laden.InvalidArgumentError, match="mode"):
        h.set_adapters([A], mode="fused")
    with pytest.raises(laden.InvalidArgumentError, match="strengths"):
        h.set_adapters([A], strengths=[1.0, 2.0])
    h.set_adapters([A])
    torch.testing.assert_close(logits(m, "cpu"), want)  # as it was
    laden.release(m)


def test_merge_adapter_for_good(tmp_path):
    """merge_adapter changes the RAM-tier host copies and resident weights
    for good; a disk-tier target is refused, naming why."""
    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    want = logits(a_merged, "cpu")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu")
    laden.merge_adapter(m, laden.AdapterSpec("a", a_dir))
    torch.testing.assert_close(logits(m, "cpu"), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(laden.AdapterError, match="for good"):
        m._laden_stream.handle.set_adapters([laden.AdapterSpec("a", a_dir)])
    laden.release(m)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=0)
    with pytest.raises(laden.AdapterError, match="disk tier"):
        laden.merge_adapter(m, laden.AdapterSpec("a", a_dir))
    laden.release(m)


def test_diffusers_unet_lora(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(6)
    unet = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8).eval()
    d = str(tmp_path / "unet")
    unet.save_pretrained(d)
    a_dir, merged = lora(unet, tmp_path, "a", targets=["to_q", "to_v",
                                                      "conv1"])
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = merged(x, 3).sample
    m = laden.from_pretrained(diffusers.UNet2DModel, d, device="cpu",
                              ram_budget=0)
    m._laden_stream.handle.set_adapters([laden.AdapterSpec("a", a_dir)])
    with torch.no_grad():
        torch.testing.assert_close(m(x, 3).sample, want, atol=5e-5,
                                   rtol=1e-4)
    with pytest.raises(laden.AdapterError, match="routed"):
        m._laden_stream.handle.set_adapters(
            [laden.AdapterSpec("a", a_dir)], mode="routed")  # convs
    laden.release(m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_mode", ["resident", "streaming"])
def test_cache_use_with_adapters(tmp_path, device, block_mode):
    """cache.use(..., adapters=...): peft's merged outputs in merge and
    routed mode; switching adapters across uses reads no bytes from the
    drive (the device copies are written again from the host copies, the
    slots filled again); a use without adapters is the base bit for bit;
    the same adapters twice merge once."""
    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    b_dir, b_merged = lora(ref, tmp_path, "b", seed=3)
    base = logits(ref.to(device), device)
    want_a = logits(a_merged.to(device), device)
    want_b = logits(b_merged.to(device), device)

    def build():
        with laden.hf.empty_weights():
            return transformers.LlamaForCausalLM(ref.config).eval()

    cache = laden.ModelCache()
    spec = laden.ModelSpec("llama", build, checkpoint=d,
                           block_paths=("model.layers",),
                           block_mode=block_mode)
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)
    tol = dict(atol=2e-5, rtol=1e-4)

    def run(**kw):
        with cache.use(spec, device=device, **kw) as m:
            return logits(m, device)

    assert torch.equal(run(), base)
    rt = cache._rt["llama"]
    read0 = rt.stats().load_read_bytes + rt.stats().read_bytes
    for mode in ("merge", "routed"):
        torch.testing.assert_close(run(adapters=[A], mode=mode), want_a,
                                   **tol)
        torch.testing.assert_close(run(adapters=[A], mode=mode), want_a,
                                   **tol)
        torch.testing.assert_close(run(adapters=[B], mode=mode), want_b,
                                   **tol)
        assert torch.equal(run(), base)  # bit for bit
    st = rt.stats()
    if device == "cuda":  # the CPU device's slots are read from the file
        assert st.load_read_bytes + st.read_bytes == read0
    with pytest.raises(laden.AdapterError, match="nope"):
        bad = laden.AdapterSpec("bad", lambda: {
            "model.layers.0.nope.lora_A.weight": torch.zeros(4, 64),
            "model.layers.0.nope.lora_B.weight": torch.zeros(64, 4)})
        run(adapters=[bad])
    assert torch.equal(run(), base)  # the failed use changed nothing
    cache.clear()


def test_found_in_review(tmp_path, monkeypatch):
    """A cache model evicted between uses kept a stale merge count and
    skipped its merge; GPT-2's Conv1D weights ([in, out]) were merged
    transposed; DoRA and embedding LoRA keys were skipped silently; a
    function source's tensors were reused after its id was; set_adapters
    during a background load lost the merge; a merge that failed half way
    was repeated over its first targets; ModelOffloader.activate after an
    adapted use kept the adapters."""
    from laden import adapters as admod

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    want = logits(a_merged, "cpu")
    base = logits(ref, "cpu")
    A = laden.AdapterSpec("a", a_dir)
    tol = dict(atol=2e-5, rtol=1e-4)

    def build():
        with laden.hf.empty_weights():
            return transformers.LlamaForCausalLM(ref.config).eval()

    cache = laden.ModelCache()
    spec = laden.ModelSpec("llama", build, checkpoint=d,
                           block_paths=("model.layers",),
                           block_mode="streaming")
    for la in (1, 2, 1):
        with cache.use(spec, device="cpu", lookahead=la, adapters=[A]) as m:
            torch.testing.assert_close(logits(m, "cpu"), want, **tol)
        cache.evict("llama")
    cache.clear()
    # ModelOffloader.activate after an adapted use of the same model: the
    # base again.
    shared = laden.ModelCache()
    mod = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    off = laden.ModelOffloader(mod, block_paths=("model.layers",),
                               cache=shared, key="x")
    with shared.use("x", device="cpu", adapters=[A]) as m:
        torch.testing.assert_close(logits(m, "cpu"), want, **tol)
    assert torch.equal(logits(off.activate("cpu"), "cpu"), base)
    off.deactivate()
    off.close()

    # GPT-2: Conv1D targets, square (c_proj) and not (c_attn).
    c = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3,
                                n_head=4, n_positions=64)
    torch.manual_seed(1)
    g = transformers.GPT2LMHeadModel(c).eval()
    gd = str(tmp_path / "gpt2")
    g.save_pretrained(gd)
    g_dir, g_merged = lora(g, tmp_path, "g", targets=["c_attn", "c_proj"])
    m = laden.from_pretrained(transformers.GPT2LMHeadModel, gd, device="cpu",
                              ram_budget=0)
    m._laden_stream.handle.set_adapters([laden.AdapterSpec("g", g_dir)])
    torch.testing.assert_close(logits(m, "cpu"), logits(g_merged, "cpu"),
                               **tol)
    laden.release(m)

    # Kinds laden does not apply are refused by name, also when partial.
    for bad in ({"model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                 torch.ones(64)},
                {"model.embed_tokens.lora_embedding_A": torch.ones(4, 128)}):
        with pytest.raises(laden.AdapterError, match="cannot apply"):
            admod.resolve(laden.AdapterSpec("x", lambda b=bad: b,
                                            allow_partial_targets=True), ref)

    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    h = m._laden_stream.handle
    # A function source's state dict, as the merge's input.
    zero = {"model.layers.0.self_attn.q_proj.delta.weight":
            torch.zeros(64, 64)}
    h.set_adapters([laden.AdapterSpec("z", lambda: dict(zero))])
    assert torch.equal(logits(m, "cpu"), base)
    # A merge failing half way: the next forward refuses, set_adapters
    # mends it.
    calls = {"n": 0}
    real = admod._add

    def flaky(W, tg, s):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory (simulated)")
        real(W, tg, s)

    h.set_adapters([])
    monkeypatch.setattr(admod, "_add", flaky)
    with pytest.raises(RuntimeError):
        h.set_adapters([A])
    monkeypatch.setattr(admod, "_add", real)
    h.set_adapters([A])
    torch.testing.assert_close(logits(m, "cpu"), want, **tol)
    h.set_adapters([])
    assert torch.equal(logits(m, "cpu"), base)
    laden.release(m)
    # During a background load: refused until it ends.
    m = on_meta_llama(ref)
    rep = laden.stream_load(m, d, offload_prefixes=["model.layers."],
                            device="cpu", background=True)
    h = laden.install_offload(m)
    if not rep.done:
        try:
            h.set_adapters([A])
        except laden.StateError as e:
            assert "loading" in str(e)
    rep.wait()
    h.set_adapters([A])
    torch.testing.assert_close(logits(m, "cpu"), want, **tol)
    laden.release(m, h)


def on_meta_llama(ref):
    with laden.hf.empty_weights():
        return transformers.LlamaForCausalLM(ref.config).eval()


def test_adapters_read_once(tmp_path):
    """Adapters are read once and kept: switching back to one calls no
    function and reads no file; two functions under one key are two
    adapters; a cache's idle adapters count in its ram_budget and give
    way, least recently used first, before models do."""
    from laden import adapters as admod

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, a_merged = lora(ref, tmp_path, "a")
    b_dir, b_merged = lora(ref, tmp_path, "b", seed=3)
    want_a, want_b = logits(a_merged, "cpu"), logits(b_merged, "cpu")
    tol = dict(atol=2e-5, rtol=1e-4)
    calls = []

    def sd_of(path, tag):
        def f():
            calls.append(tag)
            with laden.Checkpoint(path + "/adapter_model.safetensors") as c:
                return {n: c.tensor(n) for n in c.names()}
        return f

    # peft's scale (alpha / r) comes from its config, which a function
    # source lacks: compare with the files' own adapters' results instead.
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    h = m._laden_stream.handle
    Fa = laden.AdapterSpec("x", sd_of(a_dir, "a"))
    Fb = laden.AdapterSpec("x", sd_of(b_dir, "b"))  # same key, other source
    h.set_adapters([Fa])
    out_fa = logits(m, "cpu")
    h.set_adapters([Fb])
    out_fb = logits(m, "cpu")
    assert not torch.equal(out_fa, out_fb)
    for _ in range(2):
        h.set_adapters([Fa])
        assert torch.equal(logits(m, "cpu"), out_fa)
        h.set_adapters([Fb])
        assert torch.equal(logits(m, "cpu"), out_fb)
    assert calls == ["a", "b"]
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)
    reads = h.adapters.host.reads
    for _ in range(2):
        h.set_adapters([A])
        torch.testing.assert_close(logits(m, "cpu"), want_a, **tol)
        h.set_adapters([B])
        torch.testing.assert_close(logits(m, "cpu"), want_b, **tol)
    assert h.adapters.host.reads == reads + 2
    # A file written again is read again.
    import os
    f = os.path.join(a_dir, "adapter_model.safetensors")
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 10**9))
    h.set_adapters([A])
    assert h.adapters.host.reads == reads + 3
    laden.release(m)

    # A cache: both adapters kept without a RAM budget; with a budget
    # that holds the model and one adapter, the idle one gives way (and
    # is read again when asked), the model stays.
    def build():
        with laden.hf.empty_weights():
            return transformers.LlamaForCausalLM(ref.config).eval()

    spec = laden.ModelSpec("llama", build, checkpoint=d,
                           block_paths=("model.layers",))
    cache = laden.ModelCache()
    for ad, want in ((A, want_a), (B, want_b), (A, want_a)):
        with cache.use(spec, device="cpu", adapters=[ad]) as mm:
            torch.testing.assert_close(logits(mm, "cpu"), want, **tol)
    store = cache._adapter_host
    assert store.reads == 2 and len(store.items) == 2
    one = store.held([A])
    assert cache.stats()["adapter_host_bytes"] == store.bytes == 2 * one
    size = cache.stats()["host_bytes"]
    cache.clear()
    assert store.bytes == 0
    tight = laden.ModelCache(ram_budget=size + one + one // 2)
    store = tight._adapter_host
    for ad, want in ((A, want_a), (B, want_b), (A, want_a)):
        with tight.use(spec, device="cpu", adapters=[ad]) as mm:
            torch.testing.assert_close(logits(mm, "cpu"), want, **tol)
        assert len(store.items) == 1 and store.bytes == one
    assert store.reads == 3 and tight.stats()["builds"] == 1
    tight.clear()


# ---- a switch either completes or changes nothing ---------------------------------

def _rewrite(path):
    """Rewrites the checkpoint in place with other bytes of the same size
    (the header kept, its tensors' bytes zeros) and a later time, as a
    writer would while laden uses it; returns what puts the original
    bytes and times back (laden then takes it as unchanged again)."""
    st = os.stat(path)
    with open(path, "rb") as f:
        orig = f.read()
    n = int.from_bytes(orig[:8], "little")
    with open(path, "r+b") as f:
        f.seek(8 + n)
        f.write(bytes(len(orig) - 8 - n))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def restore():
        with open(path, "r+b") as f:
            f.write(orig)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return restore


@pytest.mark.parametrize("budget", [{}, {"ram_budget": 250_000}],
                         ids=["ram", "mixed"])
def test_failed_switch_keeps_the_adapters(tmp_path, monkeypatch, budget):
    """A switch whose re-read of resident tensors fails (the checkpoint
    rewritten under the model: E_CHANGED), before the first tensor or
    after some, leaves the adapters before it in force bit for bit, with
    an error naming the adapter, the tensor and the file.  A file refused
    once stays refused for that load (laden.io: the bytes read from it
    can no longer be trusted), so each case loads the model afresh; once
    the file is back, a new load switches as before."""
    from laden import adapters as admod

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    base = logits(ref, "cpu")
    a_dir, _ = lora(ref, tmp_path, "a")
    b_dir, b_merged = lora(ref, tmp_path, "b", seed=3)
    ck = os.path.join(d, "model.safetensors")
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)
    in_ram = not budget  # the forward reads nothing from the file

    def loaded():
        m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device="cpu", **budget)
        h = m._laden_stream.handle
        h.set_adapters([A])
        return m, h

    def in_memory(m):
        return {n: p.detach().clone() for n, p in m.named_parameters()
                if not p.is_meta}

    m, _ = loaded()
    want = logits(m, "cpu")
    assert not torch.equal(want, base)
    laden.release(m)
    for nxt, kw in (([], {}), ([B], {}), ([A], {"mode": "routed"})):
        m, h = loaded()
        before = in_memory(m)
        restore = _rewrite(ck)
        with pytest.raises(laden.FormatError) as e:
            h.set_adapters(nxt, **kw)
        msg = str(e.value)
        assert "'a'" in msg and "model.safetensors" in msg and \
            "changed" in msg and ".weight'" in msg and "still are" in msg
        restore()
        after = in_memory(m)
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[n], before[n]) for n in before), \
            (nxt, kw)
        if in_ram:
            assert torch.equal(logits(m, "cpu"), want), (nxt, kw)
        laden.release(m)
    # The file rewritten after some tensors were read back: those get
    # the adapter again.
    real = admod._reread
    calls = {"n": 0, "restore": None}

    def late(*a):
        calls["n"] += 1
        if calls["n"] == 4:
            calls["restore"] = _rewrite(ck)
        return real(*a)

    m, h = loaded()
    before = in_memory(m)
    monkeypatch.setattr(admod, "_reread", late)
    with pytest.raises(laden.FormatError):
        h.set_adapters([B])
    assert calls["n"] == 4
    monkeypatch.setattr(admod, "_reread", real)
    calls["restore"]()
    after = in_memory(m)
    assert all(torch.equal(after[n], before[n]) for n in before)
    if in_ram:
        assert torch.equal(logits(m, "cpu"), want)
    laden.release(m)
    m, h = loaded()  # the file as it was: a new load switches as before
    assert torch.equal(logits(m, "cpu"), want)
    h.set_adapters([])
    assert torch.equal(logits(m, "cpu"), base)
    h.set_adapters([B])
    torch.testing.assert_close(logits(m, "cpu"), logits(b_merged, "cpu"),
                               atol=2e-5, rtol=1e-4)
    h.set_adapters([A])
    assert torch.equal(logits(m, "cpu"), want)
    laden.release(m)


@pytest.mark.parametrize("step", ["_reread", "_merge_all", "signal"])
def test_interrupted_switch_keeps_the_adapters(tmp_path, monkeypatch, step):
    """KeyboardInterrupt in the middle of set_adapters (raised by the
    re-read of a tensor, by the merge of one, or a real SIGINT arriving
    during a merge, which waits for the step's end): the adapters before
    the call in force bit for bit, and the next switch works."""
    import signal

    from laden import adapters as admod

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    base = logits(ref, "cpu")
    a_dir, _ = lora(ref, tmp_path, "a")
    b_dir, b_merged = lora(ref, tmp_path, "b", seed=3)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    h = m._laden_stream.handle
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)
    h.set_adapters([A])
    want = logits(m, "cpu")
    name = "_merge_all" if step == "signal" else step
    real = getattr(admod, name)
    calls = {"n": 0}

    def cut(*a):
        calls["n"] += 1
        if calls["n"] == 3:
            if step != "signal":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a)

    monkeypatch.setattr(admod, name, cut)
    # SIGINT raises KeyboardInterrupt, also where pytest runs with it
    # ignored (a shell's background job inherits SIG_IGN).
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            h.set_adapters([B])
    finally:
        signal.signal(signal.SIGINT, was)
    monkeypatch.setattr(admod, name, real)
    assert calls["n"] >= 3  # the rollback merges again
    assert torch.equal(logits(m, "cpu"), want)
    h.set_adapters([B])
    torch.testing.assert_close(logits(m, "cpu"), logits(b_merged, "cpu"),
                               atol=2e-5, rtol=1e-4)
    h.set_adapters([])
    assert torch.equal(logits(m, "cpu"), base)
    laden.release(m)


@pytest.mark.parametrize("block_mode", ["resident", "streaming"])
def test_interrupted_cache_use(tmp_path, monkeypatch, block_mode):
    """A use whose adapters' merge is interrupted fails; the next uses get
    what they ask for (the adapters, or the base bit for bit)."""
    from laden import adapters as admod

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    base = logits(ref, "cpu")
    a_dir, a_merged = lora(ref, tmp_path, "a")
    b_dir, _ = lora(ref, tmp_path, "b", seed=3)
    want_a = logits(a_merged, "cpu")

    def build():
        with laden.hf.empty_weights():
            return transformers.LlamaForCausalLM(ref.config).eval()

    cache = laden.ModelCache()
    spec = laden.ModelSpec("llama", build, checkpoint=d,
                           block_paths=("model.layers",),
                           block_mode=block_mode)
    A, B = laden.AdapterSpec("a", a_dir), laden.AdapterSpec("b", b_dir)

    def run(**kw):
        with cache.use(spec, device="cpu", **kw) as mm:
            return logits(mm, "cpu")

    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(run(adapters=[A]), want_a, **tol)
    real = admod._add
    calls = {"n": 0}

    def cut(*a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(admod, "_add", cut)
    with pytest.raises(KeyboardInterrupt):
        run(adapters=[B])
        run(adapters=[B])  # streamed: the merge runs in the forward
    monkeypatch.setattr(admod, "_add", real)
    torch.testing.assert_close(run(adapters=[A]), want_a, **tol)
    assert torch.equal(run(), base)
    cache.clear()


def test_hostile_adapter_configs(tmp_path):
    """adapter_config.json that is not JSON, of wrong types, missing
    lora_alpha, ranks that do not fit, odd keys in the tensors: each an
    AdapterError naming the adapter, the file and the field or key (not
    a JSONDecodeError, AttributeError, IndexError or ZeroDivisionError),
    and the adapters in force stay."""
    import json
    import shutil

    ref = tiny_llama()
    d = str(tmp_path / "base")
    ref.save_pretrained(d)
    a_dir, _ = lora(ref, tmp_path, "a")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    h = m._laden_stream.handle
    h.set_adapters([laden.AdapterSpec("a", a_dir)])
    want = logits(m, "cpu")
    with open(os.path.join(a_dir, "adapter_config.json")) as f:
        cfg0 = json.load(f)

    def variant(name, text=None, **edit):
        dd = str(tmp_path / name)
        shutil.copytree(a_dir, dd)
        if text is None:
            c = dict(cfg0)
            c.update(edit)
            c = {k: v for k, v in c.items() if v is not None}
            text = json.dumps(c)
        with open(os.path.join(dd, "adapter_config.json"), "w") as f:
            f.write(text)
        return dd

    cases = [("badjson", {"text": '{"r": 4,,}'}, "line 1 column 9"),
             ("list", {"text": "[1]"}, "JSON list"),
             ("nested", {"text": "[" * 100000 + "]" * 100000},
              "nested too deeply"),
             ("nan", {"text": '{"lora_alpha": NaN}'}, "NaN"),
             ("alpha_str", {"lora_alpha": "8"}, "'lora_alpha'"),
             ("pattern_list", {"alpha_pattern": [1]}, "'alpha_pattern'"),
             ("pattern_re", {"alpha_pattern": {"(": 3}}, "'alpha_pattern'"),
             ("no_alpha", {"lora_alpha": None}, "'lora_alpha'"),
             ("r8", {"r": 8}, "'r'"),
             ("r0", {"r": 0}, "'r'"),
             ("rank_pattern", {"rank_pattern": {"q_proj": 2}},
              "'rank_pattern'"),
             ("dora_str", {"use_dora": "false"}, "'use_dora'"),
             ("loha", {"peft_type": "LOHA"}, "'peft_type'")]
    for name, kw, field in cases:
        with pytest.raises(laden.AdapterError) as e:
            h.set_adapters([laden.AdapterSpec(name, variant(name, **kw))])
        msg = str(e.value)
        assert f"'{name}'" in msg and "adapter_config.json" in msg and \
            field in msg, msg
    q = "model.layers.0.self_attn.q_proj."
    z = torch.zeros
    odd = [("zero_dim", {q + "lora_A.weight": torch.tensor(1.0),
                         q + "lora_B.weight": z(64, 4)}, "rank"),
           ("alpha_empty", {q + "lora_A.weight": z(4, 64),
                            q + "lora_B.weight": z(64, 4),
                            q + "alpha": z(0)}, q + "alpha"),
           ("rank0", {q + "lora_A.weight": z(0, 64),
                      q + "lora_B.weight": z(64, 0)}, "rank"),
           ("twice", {q + "delta.weight": z(64, 64),
                      "base_model.model." + q + "delta.weight": z(64, 64)},
            "both give")]
    for name, sd, key in odd:
        path = str(tmp_path / f"{name}.safetensors")
        laden.save_file(sd, path)
        with pytest.raises(laden.AdapterError) as e:
            h.set_adapters([laden.AdapterSpec(name, path)])
        msg = str(e.value)
        assert f"'{name}'" in msg and path in msg and key in msg, msg
    for sd, what in (({3: z(1)}, "key 3"),
                     ({"model.norm.weight": object()}, "not a tensor"),
                     ({"model.norm.weight": z(64, dtype=torch.complex64)},
                      "real")):
        with pytest.raises(laden.AdapterError, match=what):
            h.set_adapters([laden.AdapterSpec("f", lambda sd=sd: sd)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(laden.AdapterError,
                       match="no adapter_model.safetensors"):
        h.set_adapters([laden.AdapterSpec("e", str(tmp_path / "empty"))])
    assert torch.equal(logits(m, "cpu"), want)  # as it was
    laden.release(m)
