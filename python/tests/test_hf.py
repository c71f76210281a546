"""transformers and diffusers models end to end in one call
(laden.from_pretrained, laden.offload_pipeline): tiny models built from
configs with random weights, saved with save_pretrained (no hub), run
under budgets smaller than the model; greedy tokens, outputs and images
identical to the plain model's."""

import os

import pytest
import torch

import laden

transformers = pytest.importorskip("transformers")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def budget(device, total_bytes):
    """A budget smaller than the model: on CUDA a VRAM budget of 90 % of
    it (these models are mostly slots and embeddings: the rest of the
    model and three slots take half of them); on the CPU a RAM budget of a
    third (the rest stays on disk)."""
    if device == "cuda":
        return {"vram_budget": total_bytes * 9 // 10}
    return {"ram_budget": max(total_bytes // 3, 1)}


def nbytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def save(model, tmp_path, name, **kw):
    d = tmp_path / name
    model.save_pretrained(d, **kw)
    return str(d)


def tiny_llama(tie=True):
    c = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(c).eval()


def tiny_gpt2():
    c = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=5,
                                n_head=4, n_positions=128)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(c).eval()


def greedy(model, device, n=12):
    ids = torch.randint(0, 128, (2, 7),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.generate(ids.to(device), max_new_tokens=n,
                              do_sample=False, pad_token_id=0).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["llama-tied", "llama-sharded-disk",
                                  "gpt2", "auto"])
def test_causal_lm_generates_the_same_tokens(tmp_path, device, case):
    ref = tiny_gpt2() if case == "gpt2" else tiny_llama(tie=case != "auto")
    kw = {"max_shard_size": "60KB"} if "sharded" in case else {}
    d = save(ref, tmp_path, case, **kw)
    if "sharded" in case:
        assert any(n.endswith(".index.json") for n in os.listdir(d))
    want = greedy(ref.to(device), device)
    cls = transformers.AutoModelForCausalLM if case == "auto" else type(ref)
    b = budget(device, nbytes(ref))
    if "disk" in case and device == "cpu":
        b = {"ram_budget": 0}
    m = laden.from_pretrained(cls, d, device=device, **b)
    st = m._laden_stream
    tiers = {blk.tier_name for blk in st.blocks}
    assert all(f.startswith(("model.layers.", "transformer.h."))
               for f in laden.find_blocks(m))
    assert len(st.blocks) >= 5
    assert tiers != {"resident"}, tiers  # something streams
    if "disk" in case and device == "cpu":
        assert tiers == {"disk"}
    assert m.device.type == device and m.dtype == torch.float32
    assert torch.equal(greedy(m, device), want)
    assert torch.equal(greedy(m, device), want)  # again, warm
    laden.release(m)
    assert not hasattr(m, "_laden_stream")
    assert "to" not in m.__dict__  # .to is the module's again


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_background_load_generates_before_it_ends(tmp_path, device, tier,
                                                  monkeypatch):
    """from_pretrained(background=True) returns while the bytes are still
    arriving (a slowed progress callback); generate() at once gives the
    plain model's tokens, state_dict() the checkpoint's values, and
    laden.wait(model) the load's report."""
    import laden.checkpoint as ckmod

    class Slow:
        def __init__(self, total):
            self.n = 0

        def update(self, k):
            import time
            self.n += k
            time.sleep(0.02)

        def close(self):
            pass

    monkeypatch.setattr(ckmod, "_progress_bar",
                        lambda total, desc, p: Slow(total) if p else None)
    ref = tiny_llama()
    d = save(ref, tmp_path, "bg")
    want = greedy(ref.to(device), device)
    b = budget(device, nbytes(ref))
    if tier == "disk":  # on CUDA with the VRAM budget of the RAM tier's
        b = dict(b, ram_budget=0)
    m = laden.from_pretrained(type(ref), d, device=device, background=True,
                              progress=True, **b)
    rep = m._laden_stream.report
    assert not rep.done
    assert torch.equal(greedy(m, device), want)
    sd = m.state_dict()
    assert rep.done
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k].cpu(), v.cpu()), k
    assert laden.wait(m) is rep and rep.read_bytes > 0
    laden.release(m)


@pytest.mark.parametrize("device", DEVICES)
def test_encoder_decoder_and_encoder(tmp_path, device):
    """T5 (encoder.block and decoder.block, a shared embedding) generates
    the same tokens; a BERT checkpoint saved with its head loads into the
    base model (the base prefix taken off) with identical outputs."""
    c = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, d_kv=16,
                              num_layers=3, num_decoder_layers=3,
                              num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(2)
    ref = transformers.T5ForConditionalGeneration(c).eval()
    d = save(ref, tmp_path, "t5")
    want = greedy(ref.to(device), device)
    m = laden.from_pretrained(transformers.T5ForConditionalGeneration, d,
                              device=device, **budget(device, nbytes(ref)))
    found = laden.find_blocks(m)  # this tiny T5's blocks are split finer
    assert {f.split(".")[0] for f in found} == {"encoder", "decoder"}
    assert all(f.split(".")[1] == "block" for f in found)
    assert torch.equal(greedy(m, device), want)
    laden.release(m)

    bc = transformers.BertConfig(vocab_size=128, hidden_size=64,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=128)
    torch.manual_seed(4)
    mlm = transformers.BertForSequenceClassification(bc).eval()
    d = save(mlm, tmp_path, "bert")
    base = transformers.BertModel.from_pretrained(d).eval().to(device)
    ids = torch.randint(0, 128, (2, 9),
                        generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        want = base(ids).last_hidden_state
    m = laden.from_pretrained(transformers.AutoModel, d, device=device,
                              **budget(device, nbytes(base)))
    assert type(m).__name__ == "BertModel"
    with torch.no_grad():
        assert torch.equal(m(ids).last_hidden_state, want)
    laden.release(m)


def test_dtype_and_moves(tmp_path):
    """The checkpoint's dtype is honoured (bf16 in, bf16 model, float32
    rotary buffers as transformers makes them); moving the offloaded model
    elsewhere raises naming what to do; a move to where it is does
    nothing."""
    ref = tiny_llama().to(torch.bfloat16)
    d = save(ref, tmp_path, "bf16")
    plain = transformers.LlamaForCausalLM.from_pretrained(
        d, dtype=torch.bfloat16).eval()
    want = greedy(plain, "cpu")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget="40kB")
    assert m.dtype == torch.bfloat16
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(greedy(m, "cpu"), want)
    assert m.to("cpu") is m and m.to(torch.bfloat16) is m
    with pytest.raises(laden.StateError, match="release"):
        m.to(torch.float32)
    with pytest.raises(laden.StateError, match="offloaded by laden"):
        m.cuda()
    with pytest.raises(laden.StateError):
        m.to("meta")
    m.train()
    assert m.training
    m.eval()
    laden.release(m)
    # Loaded again with another dtype: converted on load.
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", dtype=torch.float32)
    assert m.dtype == torch.float32
    laden.release(m)


def test_errors_name_the_problem(tmp_path):
    cls = transformers.LlamaForCausalLM
    with pytest.raises(laden.InvalidArgumentError, match="not a directory"):
        laden.from_pretrained(cls, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(laden.InvalidArgumentError, match="no config.json"):
        laden.from_pretrained(cls, tmp_path / "empty")
    d = save(tiny_llama(), tmp_path, "bin", safe_serialization=False) \
        if _can_save_bin() else None
    if d is not None:
        with pytest.raises(laden.InvalidArgumentError,
                           match="no .safetensors"):
            laden.from_pretrained(cls, d)
    with pytest.raises(laden.InvalidArgumentError,
                       match="not a transformers or diffusers"):
        laden.from_pretrained(torch.nn.Linear, tmp_path)
    d = save(tiny_gpt2(), tmp_path, "gpt2")
    with pytest.raises(laden.LadenError) as e:
        laden.from_pretrained(cls, d)  # a GPT-2 directory as Llama
    assert "\n" not in str(e.value).split(":", 1)[0]
    with pytest.raises(laden.InvalidArgumentError, match="cannot build"):
        laden.from_pretrained(transformers.AutoModelForSeq2SeqLM, d)
    with pytest.raises(laden.InvalidArgumentError, match="dtype"):
        laden.from_pretrained(transformers.AutoModelForCausalLM, d,
                              dtype="float77")


def _can_save_bin():
    import inspect
    sig = inspect.signature(transformers.PreTrainedModel.save_pretrained)
    return "safe_serialization" in sig.parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_budget_too_small_says_so(tmp_path):
    d = save(tiny_llama(), tmp_path, "small")
    with pytest.raises(laden.LadenError) as e:
        laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cuda", vram_budget="4kB")
    assert "budget" in str(e.value).lower()


# ---- diffusers ------------------------------------------------------------------

def _tiny_ddpm(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(6)
    unet = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    pipe = diffusers.DDPMPipeline(
        unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=20))
    d = str(tmp_path / "ddpm")
    pipe.save_pretrained(d)
    return diffusers, d


def _images(pipe):
    return pipe(generator=torch.Generator().manual_seed(1),
                num_inference_steps=4, output_type="np").images


@pytest.mark.parametrize("device", DEVICES)
def test_diffusers_model_and_pipeline(tmp_path, device):
    """A UNet2DModel from its subfolder streams its down/up blocks with
    identical outputs; a DDPMPipeline under offload_pipeline gives the
    same images as the plain pipeline on the same device, keeps the
    denoiser on the device across steps, and remove() gives it back."""
    diffusers, d = _tiny_ddpm(tmp_path)
    ref = diffusers.DDPMPipeline.from_pretrained(d).to(device)
    want = _images(ref)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want_unet = ref.unet(x.to(device), 3).sample
    m = laden.from_pretrained(diffusers.UNet2DModel, d, subfolder="unet",
                              device=device,
                              **budget(device, nbytes(ref.unet)))
    found = laden.find_blocks(m)  # coarse lists split into their lists
    assert "up_blocks.0.attentions." in found and \
        "up_blocks.1.resnets." in found
    with torch.no_grad():
        got = m(x.to(device), 3).sample
    # On some CPUs torch's kernels round differently with the weights at
    # another address (measured 2026-12-01: the plain UNet with its
    # weights copied to fresh memory differs by 1e-6), so the CPU result is
    # close, not equal; elsewhere it is equal.
    torch.testing.assert_close(got, want_unet, atol=1e-5, rtol=1e-5)
    laden.release(m)

    pipe = diffusers.DDPMPipeline.from_pretrained(d)
    h = laden.offload_pipeline(pipe, device=device)
    with pytest.raises(laden.StateError, match="already"):
        laden.offload_pipeline(pipe, device=device)
    import numpy as np
    assert np.abs(_images(pipe) - want).max() <= 1e-5  # see above
    st = h.stats()
    assert st["activations"] == 4 and st["hits"] == 3  # stayed on device
    h.remove()
    assert type(pipe) is diffusers.DDPMPipeline
    assert next(pipe.unet.parameters()).device.type == "cpu"
    assert np.abs(_images(pipe.to(device)) - want).max() <= 1e-5
    with pytest.raises(laden.InvalidArgumentError, match="on the CPU") \
            if device == "cuda" else _nothing():
        h2 = laden.offload_pipeline(pipe, device=device)
        h2.remove()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_diffusers_wrong_class(tmp_path):
    diffusers, d = _tiny_ddpm(tmp_path)
    with pytest.raises(laden.InvalidArgumentError, match="holds a UNet2DModel"):
        laden.from_pretrained(diffusers.AutoencoderKL, d, subfolder="unet")
    with pytest.raises(laden.InvalidArgumentError, match="not a diffusers"):
        laden.offload_pipeline(object())


# ---- laden generate --------------------------------------------------------------

def _tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(120)}
    vocab["[UNK]"] = 120
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]")
    fast.save_pretrained(d)
    return fast


def test_cli_generate(tmp_path, capsys):
    """`laden generate DIR --prompt ...` prints the plain model's greedy
    text and tokens/s; a directory without a config is one line of
    error."""
    from laden import cli

    ref = tiny_llama()
    d = save(ref, tmp_path, "lm")
    tok = _tokenizer(d)
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=6, do_sample=False,
                           pad_token_id=tok.pad_token_id)
    want = tok.decode(out[0], skip_special_tokens=True)
    rc = cli.main(["generate", d, "--prompt", "w1 w2 w3",
                   "--max-new-tokens", "6", "--device", "cpu",
                   "--ram", "20kB"])
    got = capsys.readouterr().out
    assert rc == 0
    assert got.splitlines()[0] == want
    assert "tokens/s" in got
    # On the CPU only the disk tier moves (the RAM tier runs in place):
    # the line says what C counted read, a token: at most the disk-tier
    # blocks' bytes, not every block's (as it said before).
    import re

    from laden._units import parse_size
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", ram_budget=250_000)
    tiers = [(b.tier_name, b.nbytes) for b in m._laden_stream.blocks]
    laden.release(m)
    disk = sum(n for t, n in tiers if t == "disk")
    assert 0 < disk < sum(n for _, n in tiers)
    rc = cli.main(["generate", d, "--prompt", "w1 w2 w3",
                   "--max-new-tokens", "6", "--device", "cpu",
                   "--ram", "250000"])
    got = capsys.readouterr().out
    assert rc == 0 and got.splitlines()[0] == want
    hit = re.search(r"read (\S+ \S+) a token from the checkpoint", got)
    assert hit, got
    assert 0 < parse_size(hit.group(1).replace(" ", "")) <= disk * 1.01, \
        (got, tiers)
    rc = cli.main(["generate", d, "--prompt", "w1 w2 w3",
                   "--max-new-tokens", "2", "--device", "cpu"])
    got = capsys.readouterr().out
    assert rc == 0 and "nothing streamed" in got and "read " not in got
    (tmp_path / "bare").mkdir()
    _tokenizer(str(tmp_path / "bare"))
    rc = cli.main(["generate", str(tmp_path / "bare"), "--prompt", "w1",
                   "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "no config.json" in err and len(err.splitlines()) == 1
    rc = cli.main(["generate", str(tmp_path / "none"), "--prompt", "w1"])
    err = capsys.readouterr().err
    assert rc == 2 and "no such directory" in err


# ---- found in review ---------------------------------------------------------------

def _greedy_cpu(m, n=16):
    ids = torch.randint(0, 128, (1, 7),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return m.generate(ids, max_new_tokens=n, do_sample=False,
                          pad_token_id=0)


def test_buffers_and_fp32_modules_as_the_library_builds_them(tmp_path):
    """GPT-J's sinusoidal positions were computed under a bf16 default
    dtype (other tokens than the library's); T5's `wo`, kept in float32 by
    transformers from an fp16 checkpoint, was fp16; unknown keyword
    arguments were dropped silently."""
    torch.manual_seed(0)
    ref = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=128, n_embd=64, n_layer=4, n_head=4, rotary_dim=8,
        n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
    d = save(ref.to(torch.bfloat16), tmp_path, "gptj")
    plain = transformers.GPTJForCausalLM.from_pretrained(d).eval()
    m = laden.from_pretrained(transformers.GPTJForCausalLM, d, device="cpu")
    assert torch.equal(_greedy_cpu(m), _greedy_cpu(plain))
    laden.release(m)
    c = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, d_kv=16,
                              num_layers=2, num_decoder_layers=2,
                              num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(2)
    d = save(transformers.T5ForConditionalGeneration(c).eval().half(),
             tmp_path, "t5h")
    plain = transformers.T5ForConditionalGeneration.from_pretrained(
        d, attn_implementation="eager")
    m = laden.from_pretrained(transformers.T5ForConditionalGeneration, d,
                              device="cpu", attn_implementation="eager")
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert dict(m.named_parameters())[wo].dtype == \
        dict(plain.named_parameters())[wo].dtype == torch.float32
    assert m.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids, decoder_input_ids=ids).logits,
                           plain(input_ids=ids,
                                 decoder_input_ids=ids).logits)
    laden.release(m)
    with pytest.raises(laden.InvalidArgumentError, match="dtyp"):
        laden.from_pretrained(transformers.T5ForConditionalGeneration, d,
                              dtyp=torch.float16)
    m = laden.from_pretrained(transformers.T5ForConditionalGeneration, d,
                              device="cpu", torch_dtype=torch.float32)
    assert m.dtype == torch.float32
    laden.release(m)


def test_parts_called_outside_their_block(tmp_path):
    """DiT calls transformer_blocks[0].norm1.emb after its block loop: run
    from a slot, that read another block's weights (outputs changed from
    call to call).  A part of a streamed block now refuses to run outside
    it, and from_pretrained keeps such a block resident."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.DiTTransformer2DModel(
        sample_size=8, num_layers=3, patch_size=2, attention_head_dim=8,
        num_attention_heads=2, in_channels=4, out_channels=8,
        num_embeds_ada_norm=10, norm_num_groups=8).eval()
    d = str(tmp_path / "dit")
    ref.save_pretrained(d)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))

    def run(m):
        with torch.no_grad():
            return m(x, timestep=torch.tensor([3]),
                     class_labels=torch.tensor([1])).sample
    want = run(ref)
    m = laden.from_pretrained(diffusers.DiTTransformer2DModel, d,
                              device="cpu", ram_budget=0, lookahead=1)
    for _ in range(6):
        assert torch.equal(run(m), want)
    laden.release(m)
    with laden.hf.empty_weights():
        meta = diffusers.DiTTransformer2DModel(**ref.config)
    laden.stream_load(meta, d, offload_prefixes=["transformer_blocks."],
                      device="cpu", ram_budget=0)
    h = laden.install_offload(meta, lookahead=1)
    with pytest.raises(laden.StateError, match="outside the block"):
        run(meta)
    laden.release(meta, h)


def test_moves_and_shared_components_refused(tmp_path):
    """A submodule moved to another dtype replaced laden's tensors; a
    pipeline moved as a whole, or one sharing components with an
    offloaded one, broke the other silently."""
    ref = tiny_llama()
    d = save(ref, tmp_path, "lm")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu")
    with pytest.raises(laden.StateError, match="offloaded by laden"):
        m.model.to(torch.float16)
    with pytest.raises(laden.StateError):
        m.model.layers[0].half()
    assert m.model.float() is m.model  # already float32: nothing to do
    laden.release(m)
    assert m.model.to(torch.float16) is m.model  # plain again (on meta)
    diffusers, pd = _tiny_ddpm(tmp_path)
    pipe = diffusers.DDPMPipeline.from_pretrained(pd)
    h = laden.offload_pipeline(pipe, device="cpu")
    with pytest.raises(laden.StateError, match="remove"):
        pipe.to(torch.float64)
    assert pipe.to("cpu") is pipe
    with pytest.raises(laden.StateError, match="offloaded by laden"):
        pipe.unet.to(torch.float64)
    twin = diffusers.DDPMPipeline(**pipe.components)
    with pytest.raises(laden.StateError, match="another pipeline"):
        laden.offload_pipeline(twin, device="cpu")
    h.remove()
    pipe.unet.to(torch.float64)  # ordinary again
    h2 = laden.offload_pipeline(twin.to(torch.float32), device="cpu")
    h2.remove()


def test_empty_weights_threads_and_parameter_attributes():
    """Parameters carrying attributes, and another thread building a
    module meanwhile, were broken by the global patch."""
    import threading

    class Tagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            p = torch.nn.Parameter(torch.ones(3))
            p.no_decay = True
            self.p = p
            self.register_buffer("b", torch.nn.init.ones_(torch.empty(2)),
                                 persistent=False)

    built = {}

    def other():
        built["lin"] = torch.nn.Linear(2, 2)

    with laden.hf.empty_weights():
        t = Tagged()
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert t.p.device.type == "meta" and t.p.no_decay
    assert torch.equal(t.b, torch.ones(2))  # a buffer is filled
    assert built["lin"].weight.device.type == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_renamed_by_transformers(tmp_path):
    """transformers 5 renames some classes' checkpoint names on load
    (GPT-NeoX's embed_out is lm_head): laden applies the same renames."""
    torch.manual_seed(0)
    ref = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=128, bos_token_id=0,
        eos_token_id=0)).eval()
    d = save(ref, tmp_path, "neox")
    plain = transformers.GPTNeoXForCausalLM.from_pretrained(d).eval()
    m = laden.from_pretrained(transformers.GPTNeoXForCausalLM, d,
                              device="cpu", ram_budget=0)
    assert torch.equal(_greedy_cpu(m), _greedy_cpu(plain))
    laden.release(m)


def test_variants(tmp_path):
    """A directory holding the weights and their fp16 variant (as the
    libraries write them): the plain file by default, the variant when
    asked for, an unknown variant named with what there is."""
    import copy

    ref = tiny_llama()
    d = save(ref, tmp_path, "v")
    rounded = copy.deepcopy(ref).half().float()
    copy.deepcopy(ref).half().save_pretrained(d, variant="fp16")
    assert sorted(n for n in os.listdir(d) if n.endswith(".safetensors")) \
        == ["model.fp16.safetensors", "model.safetensors"]
    ids = torch.randint(0, 128, (1, 6))

    def out(m):
        with torch.no_grad():
            return m(ids).logits
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d, device="cpu",
                              dtype=torch.float32)
    assert torch.equal(out(m), out(ref))  # the float32 file
    laden.release(m)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d, device="cpu",
                              variant="fp16", dtype=torch.float32)
    assert not torch.equal(out(m), out(ref))  # the fp16 one: rounded
    torch.testing.assert_close(out(m), out(rounded), atol=1e-4, rtol=1e-3)
    laden.release(m)
    with pytest.raises(laden.InvalidArgumentError, match="no variant 'bf16'"):
        laden.from_pretrained(transformers.LlamaForCausalLM, d, variant="bf16")


def test_more_errors_name_the_problem(tmp_path, capsys):
    """Two dtypes at once, an empty prompt: one clear error each (fused
    experts, refused here before, load: test_moe.py)."""
    from laden import cli

    d = save(tiny_llama(), tmp_path, "lm")
    capsys.readouterr()  # save_pretrained's own progress
    with pytest.raises(laden.InvalidArgumentError, match="differ"):
        laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              dtype=torch.float32, torch_dtype=torch.float16)
    assert cli.main(["generate", d, "--prompt", "  "]) == 2
    err = capsys.readouterr().err
    assert "--prompt is empty" in err and len(err.strip().splitlines()) == 1


# ---- hostile configs --------------------------------------------------------------

def _with_config(tmp_path, name, src, text=None, **edit):
    """A copy of model directory src whose config.json is `text`, or
    src's with the fields in `edit` changed."""
    import json
    import shutil

    d = tmp_path / name
    shutil.copytree(src, d)
    if text is None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(edit)
        text = json.dumps(cfg)
    (d / "config.json").write_text(text)
    return str(d)


def test_hostile_config_is_refused_before_building(tmp_path):
    """config.json that the checkpoint contradicts (20,000 layers for 2, a
    vocabulary of 10**12, a hidden size wider than the embedding, an
    intermediate size of 10**12) or that cannot be built (0 heads, a
    string for a count) or read (malformed or deeply nested JSON, not an
    object): a FormatError or MismatchError naming config.json and the
    field, at once (nothing built or allocated), never a TypeError,
    ZeroDivisionError, RecursionError or a 256 TB allocation."""
    import time

    c = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    src = save(transformers.LlamaForCausalLM(c), tmp_path, "src")
    cls = transformers.LlamaForCausalLM
    cases = [
        ("layers", {"num_hidden_layers": 20000}, laden.MismatchError,
         ["num_hidden_layers", "20000", "longest has 2"]),
        ("layers3", {"num_hidden_layers": 3}, laden.MismatchError,
         ["num_hidden_layers"]),
        ("neg", {"num_hidden_layers": -1}, laden.FormatError,
         ["num_hidden_layers"]),
        ("vocab", {"vocab_size": 10**12}, laden.MismatchError,
         ["vocab_size", "embed_tokens", "128 rows"]),
        ("hidden", {"hidden_size": 4096}, laden.MismatchError,
         ["hidden_size", "64 columns"]),
        ("inter", {"intermediate_size": 10**12}, laden.FormatError,
         ["intermediate_size=1000000000000", "would allocate"]),
        ("heads0", {"num_attention_heads": 0}, laden.FormatError,
         ["num_attention_heads"]),
        ("str", {"num_attention_heads": "4"}, laden.FormatError,
         ["num_attention_heads"]),
        ("negvocab", {"vocab_size": -1}, laden.FormatError,
         ["vocab_size", "-1"]),
        ("neginter", {"intermediate_size": -5}, laden.FormatError,
         ["intermediate_size=-5"]),
    ]
    for name, edit, err, words in cases:
        d = _with_config(tmp_path, name, src, **edit)
        t0 = time.perf_counter()
        with pytest.raises(err) as e:
            laden.from_pretrained(cls, d, device="cpu")
        assert time.perf_counter() - t0 < 10, name
        msg = str(e.value)
        assert "config.json" in msg and all(w in msg for w in words), msg
    for name, text, words in (
            ("json", '{"vocab_size": 12,,}', ["not JSON", "line 1 column 19"]),
            ("nested", '{"a":' * 100000 + "1" + "}" * 100000,
             ["nested too deeply"]),
            ("list", "[1, 2]", ["not an object"])):
        d = _with_config(tmp_path, name, src, text=text)
        with pytest.raises(laden.FormatError) as e:
            laden.from_pretrained(cls, d, device="cpu")
        msg = str(e.value)
        assert "config.json" in msg and all(w in msg for w in words), msg


def test_hostile_diffusers_config(tmp_path):
    diffusers, d = _tiny_ddpm(tmp_path)
    unet = os.path.join(d, "unet")
    for edit, field in (({"layers_per_block": 5000}, "layers_per_block"),
                        ({"block_out_channels": [16, 10**9]}, "10**9")):
        bad = _with_config(tmp_path, field.replace("*", ""), unet, **edit)
        with pytest.raises((laden.MismatchError, laden.FormatError)) as e:
            laden.from_pretrained(diffusers.UNet2DModel, bad, device="cpu")
        assert "config.json" in str(e.value), str(e.value)
        if field == "layers_per_block":
            assert field in str(e.value)


def test_cli_generate_hostile_config(tmp_path, capsys):
    """laden generate on a directory whose config.json is hostile: one
    line of error, status 2, no traceback."""
    from laden import cli

    src = save(tiny_llama(), tmp_path, "lm")
    _tokenizer(src)
    capsys.readouterr()
    for name, kw in (("layers", {"num_hidden_layers": 20000}),
                     ("vocab", {"vocab_size": 10**12}),
                     ("heads", {"num_attention_heads": 0}),
                     ("nested", {"text": "[" * 100000 + "]" * 100000}),
                     ("json", {"text": "{nope"})):
        d = _with_config(tmp_path, name, src, **kw)
        rc = cli.main(["generate", d, "--prompt", "w1", "--device", "cpu"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1, (name, err)
        assert "config.json" in err and "Traceback" not in err, err


def test_dtype_field_as_transformers_names_it():
    """laden sets the config's dtype under the name this transformers
    uses: ``dtype`` where ``torch_dtype`` is the deprecated property
    (reading or setting it warns), ``torch_dtype`` on versions before."""
    from laden.hf import _dtype_field

    class Old:  # transformers < 4.56: an attribute set in __init__
        def __init__(self):
            self.torch_dtype = None

    class New:
        dtype = None

        @property
        def torch_dtype(self):
            raise AssertionError("the deprecated name was used")

        @torch_dtype.setter
        def torch_dtype(self, v):
            raise AssertionError("the deprecated name was used")

    class Later:  # the deprecated name gone: only dtype, set in __init__
        def __init__(self):
            self.dtype = None

    assert _dtype_field(Old()) == "torch_dtype"
    assert _dtype_field(New()) == "dtype"
    assert _dtype_field(Later()) == "dtype"
    assert _dtype_field(transformers.LlamaConfig()) == (
        "dtype" if "dtype" in vars(transformers.LlamaConfig()) else
        "torch_dtype")


def test_from_pretrained_never_uses_torch_dtype(tmp_path, monkeypatch):
    """On a transformers whose configs renamed torch_dtype, from_pretrained
    never touches the old name (which logs a deprecation warning)."""
    import inspect

    base = transformers.PretrainedConfig
    if not isinstance(inspect.getattr_static(base, "torch_dtype", None),
                      property):
        pytest.skip("this transformers predates dtype")

    def refuse(*a):
        raise AssertionError("laden used config.torch_dtype")

    monkeypatch.setattr(base, "torch_dtype", property(refuse, refuse))
    d = save(tiny_llama(), tmp_path, "lm")
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu", dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    laden.release(m)
    m = laden.from_pretrained(transformers.LlamaForCausalLM, d,
                              device="cpu")
    laden.release(m)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_pipeline_lossless(tmp_path, device):
    """offload_pipeline(compression="lossless") on a bf16 pipeline: the
    denoiser's weights are kept coded in host memory and decoded on the
    device, and the images are those of the same pipeline offloaded
    with its weights as stored, exactly."""
    diffusers, d = _tiny_ddpm(tmp_path)

    def images(**kw):
        pipe = diffusers.DDPMPipeline.from_pretrained(
            d, torch_dtype=torch.bfloat16)
        h = laden.offload_pipeline(pipe, device=device, **kw)
        out = pipe(generator=torch.Generator().manual_seed(1),
                   num_inference_steps=4, output_type="pt").images
        info = h.cache.info("unet")
        h.remove()
        return out, info

    want, plain = images()
    got, coded = images(compression="lossless")
    assert torch.equal(got, want)
    assert plain.lossless is None
    c, raw = coded.lossless
    assert 0 < c < raw
    assert coded.size_bytes < plain.size_bytes
    with pytest.raises(laden.InvalidArgumentError, match="compression"):
        images(compression="gzip")
