"""Mixture-of-experts checkpoints (issue 36): transformers 5 fuses each
MoE layer's per-expert tensors into one parameter when it loads a
checkpoint; laden lays them end to end in C while reading
(laden_sched_join_tensor) from transformers' own conversion rules.  Tiny
models of six families from configs, random weights, saved with
save_pretrained: logits and greedy tokens identical to transformers' own
loading, through from_pretrained, stream_load and the cache, on every
tier; a conversion laden cannot apply is refused naming it.  A streamed
layer's experts move only the rows of the experts its router picks
(expert blocks: laden_sched_enter_experts)."""

import math
import os

import pytest
import torch

import laden

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.core_model_loading")  # transformers 5

T = transformers
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)


def _config(family):
    if family == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(
            intermediate_size=48, num_local_experts=4,
            num_experts_per_tok=2, **COMMON)
    if family == "qwen3_moe":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, head_dim=16,
            **COMMON)
    if family == "olmoe":
        return T.OlmoeForCausalLM, T.OlmoeConfig(
            intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            eos_token_id=None, **COMMON)
    if family == "deepseek_v3":
        return T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
            intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, **COMMON)
    if family == "glm4_moe":
        return T.Glm4MoeForCausalLM, T.Glm4MoeConfig(
            intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16,
            **COMMON)
    if family == "gpt_oss":  # stores its experts fused already
        return T.GptOssForCausalLM, T.GptOssConfig(
            intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, head_dim=16, sliding_window=32,
            layer_types=["sliding_attention", "full_attention",
                         "sliding_attention"], **COMMON)
    raise AssertionError(family)


FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe",
            "gpt_oss"]


def _saved(tmp_path, family):
    cls, cfg = _config(family)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    d = str(tmp_path / family)
    ref.save_pretrained(d)
    return cls, d


def _ids():
    return torch.randint(0, 128, (2, 9),
                         generator=torch.Generator().manual_seed(1))


def _plain(cls, d, device):
    """transformers' own loading: what laden must equal."""
    return cls.from_pretrained(d).eval().to(device)


def _logits(m, device):
    with torch.no_grad():
        return m(_ids().to(device)).logits.cpu()


def _greedy(m, device):
    with torch.no_grad():
        return m.generate(_ids().to(device), max_new_tokens=6,
                          do_sample=False, pad_token_id=0).cpu()


def _stored_per_expert(d):
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return any(".experts.0." in k for k in f.keys())


def _budget(cls, d, device, tier):
    """from_pretrained's arguments that stream every layer from `tier`.
    On the CPU the RAM budget.  On CUDA these models are smaller than any
    VRAM budget that holds their slots beside the rest, so the least
    budget that loads them (found by halving) keeps no block resident."""
    disk = {"ram_budget": 0} if tier == "disk" else {}
    if device == "cpu":
        return disk

    def fits(b):
        try:
            m = laden.from_pretrained(cls, d, device=device, vram_budget=b,
                                      **disk)
        except laden.BudgetError:
            return False
        laden.release(m)
        return True

    lo, hi = 0, 64 << 20
    assert fits(hi)
    while hi - lo > 1024:  # every block is larger than this
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return dict(disk, vram_budget=hi)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_equals_transformers(tmp_path, family, tier, device):
    cls, d = _saved(tmp_path, family)
    if family != "gpt_oss":
        assert _stored_per_expert(d)  # what transformers fuses on load
    plain = _plain(cls, d, device)
    want, want_tokens = _logits(plain, device), _greedy(plain, device)
    m = laden.from_pretrained(cls, d, device=device,
                              **_budget(cls, d, device, tier))
    tiers = {b.tier_name for b in m._laden_stream.blocks}
    assert tiers == {"disk" if tier == "disk" else "ram"}, tiers
    assert torch.equal(_logits(m, device), want)
    assert torch.equal(_greedy(m, device), want_tokens)
    # The fused parameters' true values through state_dict (the disk
    # tier's read from the checkpoint's pieces by C).
    sd = m.state_dict()
    for k, v in plain.state_dict().items():
        assert torch.equal(sd[k].cpu(), v.cpu()), k
    laden.release(m)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_stream_load_and_cache(tmp_path, family):
    """The same rules apply to a model built on meta by the user
    (stream_load) and to a ModelSpec of the cache."""
    cls, d = _saved(tmp_path, family)
    path = os.path.join(d, "model.safetensors")
    plain = _plain(cls, d, "cpu")
    want = _logits(plain, "cpu")

    def build():
        with laden.hf.empty_weights():
            return cls(plain.config).eval()
    m = build()
    laden.stream_load(m, path, offload_prefixes=laden.find_blocks(m),
                      device="cpu", ram_budget=0)
    laden.install_offload(m)
    assert torch.equal(_logits(m, "cpu"), want)
    laden.release(m)
    cache = laden.ModelCache()
    spec = laden.ModelSpec("moe", build, checkpoint=path,
                           block_paths=("model.layers",))
    with cache.use(spec, device="cpu") as mm:
        assert torch.equal(_logits(mm, "cpu"), want)
    cache.clear()


def test_save_pretrained_round_trips(tmp_path):
    """A laden MoE model saves back in the per-expert form transformers
    writes, and that loads to the same logits."""
    cls, d = _saved(tmp_path, "mixtral")
    want = _logits(_plain(cls, d, "cpu"), "cpu")
    m = laden.from_pretrained(cls, d, device="cpu", ram_budget=0)
    out = str(tmp_path / "again")
    m.save_pretrained(out)
    laden.release(m)
    assert _stored_per_expert(out)
    assert torch.equal(_logits(_plain(cls, out, "cpu"), "cpu"), want)


def test_missing_expert_is_a_mismatch(tmp_path):
    """A checkpoint with an expert too few names the tensor whose pieces
    do not add up, before anything is allocated."""
    from safetensors.torch import load_file, save_file
    cls, d = _saved(tmp_path, "qwen3_moe")
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    for k in [k for k in sd if ".layers.1.mlp.experts.7." in k]:
        del sd[k]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(laden.MismatchError,
                       match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        laden.from_pretrained(cls, d, device="cpu")


def test_a_conversion_laden_cannot_apply_is_refused():
    """Pieces that are not laid end to end (a concatenation along an inner
    dimension, a transpose) are refused naming the operation."""
    from transformers.core_model_loading import (Concatenate,
                                                 MergeModulelist, Transpose,
                                                 WeightConverter)

    from laden import _hfnames

    class Model:  # only its class name is used in the message
        pass

    for ops in ([MergeModulelist(dim=0), Concatenate(dim=2)],
                [Transpose(1, 2)]):
        conv = WeightConverter(source_patterns=["experts.*.w1.weight"],
                               target_patterns="experts.w", operations=ops)
        pats = {conv.source_patterns[0]: ["experts.0.w1.weight",
                                          "experts.1.w1.weight"]}
        with pytest.raises(laden.InvalidArgumentError,
                           match=type(ops[-1]).__name__):
            _hfnames._pieces(Model(), "layers.0.experts.w", conv, pats)


def test_key_map_pieces_from_the_user(tmp_path):
    """The key map's (name, k) form is public: any model whose tensor is
    several checkpoint tensors end to end loads through stream_load."""
    w = torch.randn(6, 4)
    laden.save_file({"a": w[:2].clone(), "b": w[2:].clone()},
                    str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False))
    laden.stream_load(m, str(tmp_path / "w.safetensors"), device="cpu",
                      key_map={"a": ("0.weight", 0), "b": ("0.weight", 1)})
    assert torch.equal(m[0].weight, w)
    laden.release(m)
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False))
    with pytest.raises(laden.MismatchError, match="numbered alike"):
        laden.stream_load(m, str(tmp_path / "w.safetensors"), device="cpu",
                          key_map={"a": ("0.weight", 0),
                                   "b": ("0.weight", 0)})


def _router_picks(m):
    """Hooks counting the distinct experts each router call picks."""
    picked = []

    def hook(mod, args, out):
        picked.append(int(torch.unique(out[-1]).numel()))
    return picked, [mm.register_forward_hook(hook)
                    for n, mm in m.named_modules() if n.endswith("mlp.gate")]


def _qwen_moe(where, experts: int):
    """A tiny top-2 Qwen3-MoE with `experts` experts saved at `where`:
    (class, config, directory, bytes of one expert's rows in float32)."""
    cls = T.Qwen3MoeForCausalLM
    cfg = T.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                           num_experts=experts, num_experts_per_tok=2,
                           decoder_sparse_step=1, head_dim=16, **COMMON)
    torch.manual_seed(0)
    cls(cfg).save_pretrained(str(where))
    return cls, cfg, str(where), 3 * cfg.hidden_size * \
        cfg.moe_intermediate_size * 4


def _prompt_then_decode(m, after_prompt, tokens: int = 4):
    """Greedy: the prompt, after_prompt(), then `tokens` tokens one at a
    time through the KV cache; those tokens."""
    with torch.no_grad():
        out = m(_ids(), use_cache=True)
        after_prompt()
        toks = []
        for _ in range(tokens):
            tok = out.logits[:, -1:].argmax(-1)
            out = m(tok, past_key_values=out.past_key_values,
                    use_cache=True)
            toks.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(toks, 1)


def test_only_routed_experts_are_read(tmp_path):
    """Disk tier on the CPU, two slots for more blocks: each decode step
    reads at most the rows of the experts the routers picked and the rest
    of the streamed layers, far less than whole layers; the same tokens
    either way."""
    cls, cfg, d, row = _qwen_moe(tmp_path / "many", 32)
    per = {}
    for rows in (True, False):
        m = laden.from_pretrained(cls, d, device="cpu", ram_budget=0,
                                  expert_rows=rows, lookahead=1)
        st = m._laden_stream
        experts = [b for b in st.blocks if b.experts]
        assert (len(experts) == cfg.num_hidden_layers) == rows
        rest = sum(b.nbytes for b in st.blocks if not b.experts)
        picked, hooks = _router_picks(m)
        before = []
        toks = _prompt_then_decode(
            m, lambda: (picked.clear(), before.append(st.stats())))
        read = st.stats().read_bytes - before[0].read_bytes
        for h in hooks:
            h.remove()
        per[rows] = (read, toks)
        if rows:
            routed = sum(picked) * row
            assert read <= routed + 4 * rest, (read, routed, rest)
            c = st.handle.stats()  # each router's picks, entered once
            assert c["expert_rows"] >= sum(picked) > 0
            assert 0 < c["expert_rows_moved"] <= c["expert_rows"]
        laden.release(m)
    assert torch.equal(per[True][1], per[False][1])
    assert per[True][0] * 2 < per[False][0], per


def test_expert_cache_keeps_experts_between_tokens(tmp_path):
    """Disk tier on the CPU with an expert cache that holds every expert:
    after the prompt, a decode step reads no expert row again (each
    routed expert comes from the cache), the tokens are those without
    the cache, and a bad size is refused naming the argument."""
    cls, cfg, d, row = _qwen_moe(tmp_path / "cached", 8)
    experts = cfg.num_experts * cfg.num_hidden_layers
    with pytest.raises(laden.InvalidArgumentError, match="expert_cache"):
        laden.from_pretrained(cls, d, device="cpu", expert_cache="lots")
    got = {}
    for size in (0, experts * row):
        m = laden.from_pretrained(cls, d, device="cpu", ram_budget=0,
                                  lookahead=1, expert_cache=size)
        h = m._laden_stream.handle
        assert h.stats()["expert_cache_bytes"] == size
        seen = []  # after the prompt, which routes to most experts
        got[size] = _prompt_then_decode(m, lambda: seen.append(h.stats()))
        first, c = seen[0], h.stats()
        moved = c["expert_rows_moved"] - first["expert_rows_moved"]
        cached = c["expert_rows_cached"] - first["expert_rows_cached"]
        if size:  # only experts the prompt did not pick cross
            assert cached > 0 and cached >= moved, (cached, moved)
            assert c["expert_rows_moved"] <= experts
        else:
            assert cached == 0 and moved > 0
        laden.release(m)
    assert torch.equal(got[0], got[experts * row])


def test_expert_rows_refuse_training(tmp_path):
    """Training through streamed expert rows is not done yet: refused at
    install_offload, naming the block and the way out (the weights frozen:
    the disk tier's own rule refuses trainable ones first)."""
    cls, d = _saved(tmp_path, "mixtral")
    with laden.hf.empty_weights():
        m2 = cls(_config("mixtral")[1])
    m2.requires_grad_(False)
    laden.stream_load(m2, os.path.join(d, "model.safetensors"),
                      offload_prefixes=laden.find_blocks(m2), device="cpu",
                      ram_budget=0)
    with pytest.raises(laden.InvalidArgumentError, match="expert_rows=False"):
        laden.install_offload(m2, train=True)
    laden.release(m2)
    laden.stream_load(m2, os.path.join(d, "model.safetensors"),
                      offload_prefixes=laden.find_blocks(m2), device="cpu",
                      ram_budget=0, expert_rows=False)
    laden.install_offload(m2, train=True)  # whole layers: as before
    laden.release(m2)


def test_plan_then_load(tmp_path):
    """laden.plan lists each layer's experts as a block of its own, tiered
    apart from its layer, and stream_load(plan=...) follows it exactly."""
    cls, d = _saved(tmp_path, "qwen3_moe")
    path = os.path.join(d, "model.safetensors")
    want = _logits(_plain(cls, d, "cpu"), "cpu")
    with laden.hf.empty_weights():
        m = cls(_config("qwen3_moe")[1])
    p = laden.plan(m, path, device="cpu", ram_budget="150kB")
    names = [b.name for b in p.blocks]
    assert "model.layers.0.mlp.experts." in names
    laden.stream_load(m, path, plan=p)
    laden.install_offload(m)
    got = {b.name: b.tier for b in m._laden_stream.blocks}
    assert got == {b.name: int(b.tier) for b in p.blocks}
    assert torch.equal(_logits(m, "cpu"), want)
    laden.release(m)


def test_pieces_of_two_dtypes_are_a_mismatch(tmp_path):
    """One expert's piece stored in another dtype than the rest: the fused
    tensor cannot be one dtype; the error names it before anything is
    allocated."""
    from safetensors.torch import load_file, save_file
    cls, d = _saved(tmp_path, "qwen3_moe")
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    k = "model.layers.2.mlp.experts.3.up_proj.weight"
    sd[k] = sd[k].to(torch.bfloat16)
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(laden.MismatchError,
                       match=r"layers\.2\.mlp\.experts\.gate_up_proj.*"
                             r"dtypes BF16, F32"):
        laden.from_pretrained(cls, d, device="cpu")


def test_fused_parameters_larger_than_any_stored_tensor_build(
        tmp_path, monkeypatch):
    """A fused experts parameter holds every expert's stored tensor: the
    build's allocation guard allows one tensor up to the checkpoint's
    total (before, 2x its largest: a Qwen3-MoE with 128 experts was
    refused as 'the config does not describe this checkpoint')."""
    monkeypatch.setattr(laden.hf, "_ALLOC_SLACK", 0)
    cls, d = _saved(tmp_path, "qwen3_moe")
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        largest = max(math.prod(f.get_slice(k).get_shape())
                      for k in f.keys())
    assert 8 * 2 * 32 * 64 > 2 * largest  # the fused gate_up_proj
    want = _logits(_plain(cls, d, "cpu"), "cpu")
    m = laden.from_pretrained(cls, d, device="cpu", ram_budget=0)
    assert torch.equal(_logits(m, "cpu"), want)
    laden.release(m)
    # A config that does ask for too much is still refused.
    cfg = _config("qwen3_moe")[1]
    cfg.num_experts = 10 ** 5
    cfg.save_pretrained(d)
    with pytest.raises(laden.FormatError, match="config does not describe"):
        laden.from_pretrained(cls, d, device="cpu")


def test_an_experts_call_without_indices_is_refused():
    """An experts module called without its indices cannot say which
    rows to move: StateError naming it, nothing entered."""
    from laden import _moe

    h = torch.zeros(3, 4)
    with pytest.raises(laden.StateError, match="experts.*indices"):
        _moe.routed((h,), {"weights": torch.ones(3, 2)}, 8, "block 5")
    idx = torch.tensor([[7, 8], [1, 7]])  # 8: a padding slot, dropped
    got = _moe.routed((h, idx), {}, 8, "block 5")  # as C takes them
    assert got.dtype == torch.int32 and got.tolist() == [7, 1, 7]
    neg = torch.tensor([[-1, 3]], dtype=torch.int32)
    assert _moe.routed((h, neg), {}, 8, "block 5").tolist() == [3]
