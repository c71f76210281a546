"""A Llama-family model loaded from a GGUF file, as llama.cpp's converter
writes one (its names, its q/k row order, its block types), with the
gguf package (PyPI): laden's logits equal those of the same model built
with the gguf package's dequantized, un-permuted weights.  Blocks stream
with their tensors in their quantized bytes (expanded where the block
runs: C on the CPU, laden_expand on CUDA); the rest is expanded on load."""

import numpy as np
import pytest
import torch

import laden

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Byte offsets of the f16 scale fields in each K-quant block: random bytes
# there would make values up to 65504 x 63; small scales keep logits finite.
_F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def tiny_llama(layers=3):
    c = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(c).eval()


def _to_gguf_name(hf: str) -> str:
    inv = {v: k for k, v in laden.gguf.LLAMA_NAMES.items()}
    if hf in inv:
        return inv[hf]
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        return inv["model.layers.{}." + ".".join(parts[3:])].format(parts[2])
    raise KeyError(hf)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """As llama.cpp's converter reorders q/k rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _quantize(w: np.ndarray, qt, rng):
    """(GGUF bytes, the values they stand for)."""
    try:
        q = gguf.quants.quantize(w, qt)
    except NotImplementedError:  # the package writes no K-quants: bytes
        blk, size = gguf.GGML_QUANT_SIZES[qt]
        q = rng.integers(0, 256, (w.shape[0], w.shape[1] // blk * size),
                         dtype=np.uint8)
        small = np.frombuffer(np.float16(0.0004).tobytes(), np.uint8)
        for off in _F16_FIELDS[qt]:
            q.reshape(-1, size)[:, off:off + 2] = small
    return q, gguf.quants.dequantize(q, qt).astype(np.float32)


def write_gguf(model, path, qt, seed=0, arch="llama", heads=True):
    """The model as llama.cpp writes it; returns the state dict of the
    values laden should load (dequantized, rows in transformers' order)."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    if heads:
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    want = {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        heads = cfg.num_attention_heads if name.endswith("q_proj.weight") \
            else cfg.num_key_value_heads if name.endswith("k_proj.weight") \
            else 0
        if arch != "llama":
            heads = 0  # llama.cpp reorders q/k rows of Llama files only
        if heads:
            a = _permute(a, heads)
        if a.ndim == 2:
            q, vals = _quantize(a, qt, rng)
            w.add_tensor(_to_gguf_name(name), q, raw_dtype=qt)
        else:
            vals = a
            w.add_tensor(_to_gguf_name(name), a)
        if heads:  # back in transformers' order
            d = vals.shape[0] // heads
            vals = vals.reshape(heads, d // 2, 2, -1).swapaxes(1, 2) \
                .reshape(vals.shape)
        want[name] = torch.from_numpy(np.ascontiguousarray(vals))
    w.add_tensor("rope_freqs.weight", np.ones(16, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def logits(m, device):
    ids = torch.arange(12, device=device).reshape(1, 12) * 7 % 256
    with torch.no_grad():
        return m(ids).logits.float().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_llama_from_gguf(tmp_path, device, qt):
    ref = tiny_llama()
    p = tmp_path / "m.gguf"
    want = write_gguf(ref, p, Q[qt])
    ref.load_state_dict(want)
    base = logits(ref.to(device), device)

    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    rep = laden.stream_load(m, p, offload_prefixes=["model.layers."],
                            device=device, key_map=laden.gguf.llama_key_map)
    h = laden.install_offload(m)
    st = m._laden_stream
    gq = [t for t in st.tensors if t.store == "gq"]
    # Every 2-D block weight stays quantized; outside the blocks
    # (embeddings, lm_head) they are expanded on load.
    assert len(gq) == 7 * ref.config.num_hidden_layers
    assert all(t.block >= 0 for t in gq)
    assert rep.read_bytes < sum(x.numel() * 4 for x in want.values())
    out = logits(m, device)
    if device == "cpu":
        assert torch.equal(out, base)
    else:  # the same values; cuBLAS may order sums differently
        torch.testing.assert_close(out, base, atol=1e-4, rtol=1e-4)
    laden.release(m, h)

    # bf16: the same values rounded once.
    ref16 = tiny_llama().to(torch.bfloat16)
    ref16.load_state_dict({k: v.to(torch.bfloat16) for k, v in want.items()})
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval().to(
            torch.bfloat16)
    laden.stream_load(m, p, offload_prefixes=["model.layers."],
                      device=device, key_map=laden.gguf.llama_key_map)
    h = laden.install_offload(m)
    got, exp = logits(m, device), logits(ref16.to(device), device)
    if device == "cpu":
        assert torch.equal(got, exp)
    else:
        torch.testing.assert_close(got, exp, atol=2e-2, rtol=2e-2)
    laden.release(m, h)


def test_gguf_errors_name_the_problem(tmp_path):
    ref = tiny_llama(layers=2)
    p = tmp_path / "m.gguf"
    write_gguf(ref, p, Q.Q8_0)
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    # Without the key map: llama.cpp's names are listed as unexpected.
    with pytest.raises(laden.MismatchError, match="blk.0.attn_q.weight"):
        laden.stream_load(m, p, offload_prefixes=["model.layers."],
                          device="cpu")
    # Reordered rows cannot stream from the file as it is.
    with pytest.raises(laden.LadenError, match="reordered"):
        laden.stream_load(m, p, offload_prefixes=["model.layers."],
                          disk_prefixes=["model.layers."], device="cpu",
                          key_map=laden.gguf.llama_key_map)
    # An integer model tensor cannot take a quantized one.
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        torch.empty(512, 256, dtype=torch.int8, device="meta"),
        requires_grad=False)
    with pytest.raises(laden.MismatchError, match="GGUF block"):
        laden.stream_load(m, p, offload_prefixes=["model.layers."],
                          device="cpu", key_map=laden.gguf.llama_key_map)
    # The model is unchanged by the failed loads: it loads now.
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    laden.stream_load(m, p, offload_prefixes=["model.layers."],
                      device="cpu", key_map=laden.gguf.llama_key_map)
    laden.release(m)


def test_checkpoint_reads_gguf_tables(tmp_path):
    ref = tiny_llama(layers=1)
    p = tmp_path / "m.gguf"
    write_gguf(ref, p, Q.Q4_K)
    with laden.Checkpoint(p) as ck:
        assert ck.format == "gguf"
        i = ck.info("blk.0.ffn_down.weight")
        assert i.dtype == "Q4_K" and i.shape == (256, 512)
        assert i.nbytes == 256 * 512 // 256 * 144 and i.torch_dtype is None
        assert ck.metadata["general.architecture"] == "llama"
        assert ck.metadata["llama.attention.head_count"] == "4"
        with pytest.raises(laden.InvalidArgumentError, match="Q4_K"):
            ck.tensor("blk.0.ffn_down.weight")


def test_cache_and_plan_from_gguf(tmp_path, capsys):
    """ModelSpec(checkpoint=<gguf>): the cache expands the blocks on load
    (its models run from plain weights) with the same values; laden plan
    reads a GGUF file."""
    ref = tiny_llama(layers=2)
    p = tmp_path / "m.gguf"
    want = write_gguf(ref, p, Q.Q4_K)
    ref.load_state_dict(want)
    base = logits(ref, "cpu")

    def build():
        with laden.hf.empty_weights():
            return transformers.LlamaForCausalLM(ref.config).eval()

    cache = laden.ModelCache()
    spec = laden.ModelSpec("g", build, checkpoint=p,
                           block_paths=("model.layers",),
                           key_map=laden.gguf.llama_key_map)
    with cache.use(spec, device="cpu") as m:
        assert torch.equal(logits(m, "cpu"), base)
    cache.clear()
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    pl = laden.plan(m, p, device="cpu", key_map=laden.gguf.llama_key_map)
    assert len(pl.blocks) == 2


def test_adapters_on_gguf_blocks(tmp_path):
    """A LoRA on a GGUF model's quantized weights: merged into the
    weights as each call expands them (anew every time the block runs),
    or routed on the expanded weights; both give the merged model's
    outputs, and removing it the base model's again."""
    ref = tiny_llama(layers=2)
    p = tmp_path / "m.gguf"
    want = write_gguf(ref, p, Q.Q8_0)
    torch.manual_seed(5)
    A, B = torch.randn(4, 256) * 0.05, torch.randn(256, 4) * 0.05
    want["model.layers.1.self_attn.q_proj.weight"] += B @ A
    ref.load_state_dict(want)
    base = logits(ref, "cpu")
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    laden.stream_load(m, p, offload_prefixes=["model.layers."],
                      device="cpu", key_map=laden.gguf.llama_key_map)
    h = laden.install_offload(m)
    lora = laden.AdapterSpec("l", lambda: {
        "model.layers.1.self_attn.q_proj.lora_A.weight": A,
        "model.layers.1.self_attn.q_proj.lora_B.weight": B})
    plain = logits(m, "cpu")
    assert not torch.allclose(plain, base, atol=1e-3)  # the LoRA shows
    for mode in ("merge", "routed"):
        h.set_adapters([lora], mode=mode)
        for _ in range(2):  # merged once a call, never twice
            torch.testing.assert_close(logits(m, "cpu"), base, atol=1e-4,
                                       rtol=1e-4)
    h.set_adapters([])
    assert torch.equal(logits(m, "cpu"), plain)
    laden.release(m, h)


def test_from_pretrained_gguf(tmp_path):
    """laden.from_pretrained(LlamaForCausalLM, "m.gguf"): the config from
    the file's metadata (as transformers reads it), the same logits."""
    ref = tiny_llama(layers=2)
    p = tmp_path / "m.gguf"
    want = write_gguf(ref, p, Q.Q5_K)
    ref.load_state_dict(want)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, p,
                              device="cpu")
    assert m.config.hidden_size == 256 and m.config.vocab_size == 256
    assert any(t.store == "gq" for t in m._laden_stream.tensors)
    assert torch.equal(logits(m, "cpu"), logits(ref, "cpu"))
    laden.release(m)


def test_qwen2_and_missing_heads(tmp_path):
    """A Qwen2 GGUF (q/k/v biases, rows as transformers has them) through
    from_pretrained; a Llama file without its head counts is refused
    naming the key (its q/k rows could not be put back)."""
    c = transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(c).eval()
    p = tmp_path / "q.gguf"
    want = write_gguf(ref, p, Q.Q8_0, arch="qwen2")
    ref.load_state_dict(want)
    m = laden.from_pretrained(transformers.Qwen2ForCausalLM, p,
                              device="cpu")
    assert torch.equal(logits(m, "cpu"), logits(ref, "cpu"))
    laden.release(m)

    ref = tiny_llama(layers=1)
    p = tmp_path / "nohead.gguf"
    write_gguf(ref, p, Q.Q8_0, heads=False)
    with laden.hf.empty_weights():
        m = transformers.LlamaForCausalLM(ref.config).eval()
    with pytest.raises(laden.FormatError,
                       match="llama.attention.head_count"):
        laden.stream_load(m, p, offload_prefixes=["model.layers."],
                          device="cpu", key_map=laden.gguf.llama_key_map)


def test_unmapped_architecture_refused():
    """from_pretrained on a GGUF file of an architecture whose llama.cpp
    names laden does not map: refused naming it and the mapped ones."""
    g = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(laden.InvalidArgumentError,
                       match="'gpt2'.*llama, mistral, qwen2"):
        laden.hf._gguf_key_map(g, "m.gguf")
