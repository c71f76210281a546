"""Training through streamed blocks (install_offload(train=True)):
gradients of every trainable parameter and of the input equal the plain
model's; AdamW steps over handle.parameters() give the plain model's
weights (the next forward streams the updated host copies); dropout is
recomputed with the forward's random state; what cannot train is refused
by name.  Streamed blocks on the CPU device are the disk tier (frozen);
on CUDA the RAM tier streams too, and its parameters train through the
gradient sink (device memory stays slots + activations)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import laden
from models import PREFIXES, on_meta, reference

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def ids(n=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g)


@pytest.fixture
def ckpt(tmp_path):
    ref = reference()
    path = str(tmp_path / "tiny.safetensors")
    laden.save_file(ref.state_dict(), path)
    return ref, path


def freeze_blocks(m):
    for n, p in m.named_parameters():
        if n.startswith(("blocks.", "stages.")):
            p.requires_grad_(False)


def loss(m, device, seed=1):
    return m(ids(seed=seed).to(device)).float().pow(2).mean()


def assert_grads_equal(named, ref, atol):
    named = dict(named)
    want = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert set(named) == set(want)
    for n, p in named.items():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad.cpu(), want[n].grad.cpu(),
                                   atol=atol, rtol=1e-4, msg=n)


TIERS = {"disk": dict(ram_budget=0), "mixed": dict(ram_budget="40kB")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", list(TIERS))
def test_frozen_streamed_blocks_pass_gradients(ckpt, device, tiers):
    """The common case (adapters, a prompt, the input): streamed weights
    frozen, gradients flow through the blocks to what trains."""
    ref, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      **TIERS[tiers])
    freeze_blocks(m)
    h = laden.install_offload(m, train=True, lookahead=1)
    r = copy.deepcopy(ref).to(device)
    freeze_blocks(r)
    for _ in range(2):  # the second pass adds to the first
        loss(m, device).backward()
        loss(r, device).backward()
    assert_grads_equal(h.named_parameters(), r, 1e-6)
    st = h.stats()
    # Forward and recomputation each enter every streamed block; the
    # reverse pass misses only where it turns.
    assert st["enters"] > 0 and st["misses"] <= 2 * 2 + 2
    with torch.no_grad():  # no recomputation, the same output
        torch.testing.assert_close(m(ids().to(device)), r(ids().to(device)))
    h.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_steps_match_the_plain_model(ckpt, device):
    """Every weight trains (on CUDA the streamed ones through their host
    copies and the gradient sink): three AdamW steps, each over two
    micro-batches, give the plain model's weights."""
    ref, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      resident_prefixes=["blocks.1."])
    h = laden.install_offload(m, train=True, lookahead=1)
    r = copy.deepcopy(ref).to(device)
    names = [n for n, _ in h.named_parameters()]
    assert names == [n for n, _ in r.named_parameters()]
    if device == "cuda":  # streamed weights step on the host
        hp = dict(h.named_parameters())
        assert hp["blocks.0.up.weight"].device.type == "cpu"
        assert hp["blocks.1.up.weight"].device.type == "cuda"
    opt = torch.optim.AdamW(h.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(r.parameters(), lr=1e-2)
    for step in range(3):
        for mm, o in ((m, opt), (r, ropt)):
            o.zero_grad()
            for mb in range(2):
                loss(mm, device, seed=10 * step + mb).backward()
        assert_grads_equal(h.named_parameters(), r, 1e-5)
        if device == "cuda":
            # zero_grad() let the .grad go; the next backward wrote into
            # the same page-locked buffer (the copy goes straight there).
            g = hp["blocks.0.up.weight"].grad
            assert g.is_pinned()
            if step == 0:
                first = g.data_ptr()
            assert g.data_ptr() == first
            del g  # a .grad kept across zero_grad() is not written into
        opt.step()
        ropt.step()
    with torch.no_grad():
        torch.testing.assert_close(m(ids().to(device)), r(ids().to(device)),
                                   atol=1e-5, rtol=1e-4)
    h.remove()
    # Removed: the weights the optimizer wrote are the model's.
    for (n, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(),
                                   atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_that_need_no_gradient_are_not_recomputed(ckpt, device):
    """Only the head trains: no block's input or weight needs a gradient,
    so backward enters no block again."""
    ref, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      ram_budget=0)
    for n, p in m.named_parameters():
        p.requires_grad_(n.startswith("norm."))
    h = laden.install_offload(m, train=True)
    out = loss(m, device)
    enters = h.stats()["enters"]
    out.backward()
    assert h.stats()["enters"] == enters
    r = copy.deepcopy(ref).to(device)
    for n, p in r.named_parameters():
        p.requires_grad_(n.startswith("norm."))
    loss(r, device).backward()
    assert_grads_equal(h.named_parameters(), r, 1e-6)
    h.remove()


def test_a_key_value_cache_is_refused_in_training(tmp_path):
    """A transformers cache passed to a block would be added to twice (the
    forward, then the recomputation): refused, naming use_cache."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    torch.manual_seed(0)
    ref = DropNet()
    path = str(tmp_path / "drop.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cpu",
                      ram_budget=0)
    for p in m.blocks.parameters():
        p.requires_grad_(False)
    h = laden.install_offload(m, train=True)
    x = torch.randn(2, 32, requires_grad=True)
    with pytest.raises(laden.InvalidArgumentError,
                       match=r"'blocks\.0\.'.*DynamicCache.*use_cache=False"):
        m.blocks[0](x, cache=cache_utils.DynamicCache())
    with torch.no_grad():  # run once: allowed
        m.blocks[0](x, scale=1.0)
    h.remove()


class DropBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, scale=1.0):
        return x + self.drop(F.gelu(self.lin(x))) * scale


class DropNet(nn.Module):
    def __init__(self, d=32, n=5):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(DropBlock(d) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            x = b(x, scale=0.5 + 0.1 * i)  # a keyword argument
        return x


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_recomputed_with_the_forwards_random_state(tmp_path,
                                                           device):
    torch.manual_seed(0)
    ref = DropNet().train()
    path = str(tmp_path / "drop.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet().train()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=device,
                      ram_budget=0)
    for n, p in m.named_parameters():
        p.requires_grad_(not n.startswith("blocks."))
    r = copy.deepcopy(ref).to(device)
    for n, p in r.named_parameters():
        p.requires_grad_(not n.startswith("blocks."))
    h = laden.install_offload(m, train=True)
    x = torch.randn(4, 32, device=device)
    torch.manual_seed(5)
    y = m(x)
    y.pow(2).sum().backward()
    torch.manual_seed(5)
    ry = r(x)
    ry.pow(2).sum().backward()
    torch.testing.assert_close(y, ry)
    assert_grads_equal(h.named_parameters(), r, 1e-6)
    h.remove()


def test_what_cannot_train_is_refused_by_name(ckpt):
    _, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                      ram_budget=0)
    with pytest.raises(laden.InvalidArgumentError,
                       match=r"'blocks\.0\.norm\.weight'.*disk tier"):
        laden.install_offload(m, train=True)
    # Nothing was left installed: a plain install works.
    h = laden.install_offload(m)
    with pytest.raises(laden.StateError, match="train=True"):
        h.named_parameters()
    h.remove()
    with pytest.raises(laden.InvalidArgumentError, match="grad_dtype"):
        laden.install_offload(m, grad_dtype=torch.float32)
    with pytest.raises(laden.InvalidArgumentError, match="train must be"):
        laden.install_offload(m, train="yes")
    freeze_blocks(m)
    with pytest.raises(laden.InvalidArgumentError, match="grad_dtype must"):
        laden.install_offload(m, train=True, grad_dtype=torch.int8)
    # A graph built before remove() cannot run its backward after it.
    h = laden.install_offload(m, train=True)
    pending = loss(m, "cpu")
    h.remove()
    with pytest.raises(laden.StateError,
                       match=r"streamed block 'stages\.1\.2\.'.*removed"):
        # (the last block: backward runs last to first)
        pending.backward()
    # Without train=True backward still refuses (tests/test_hardening.py).
    h = laden.install_offload(m)
    for p in m.parameters():
        p.requires_grad_(True)
    with pytest.raises(laden.StateError, match="backward through"):
        loss(m, "cpu").backward()
    h.remove()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_device_memory_stays_slots_and_activations(tmp_path):
    """Gradients of streamed weights leave the device block by block:
    torch's peak during backward stays far below the weights' bytes."""
    torch.manual_seed(0)
    d = 512
    ref = DropNet(d=d, n=12).eval()
    path = str(tmp_path / "big.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=d, n=12).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=2,
                              grad_dtype=torch.float32)
    streamed = sum(p.numel() * 4 for n, p in h.named_parameters()
                   if n.startswith("blocks."))
    x = torch.randn(8, d, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m(x).pow(2).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    block = streamed // 12
    assert peak < 3 * block + (1 << 20), (peak, block)
    r = copy.deepcopy(ref).cuda()
    xr = x.detach().clone().requires_grad_(True)
    r(xr).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    assert_grads_equal(h.named_parameters(), r, 1e-5)
    h.remove()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_float32_gradients_of_bfloat16_weights(tmp_path):
    """grad_dtype=torch.float32 on a bfloat16 model: the host copies'
    .grad are float32 (converted on the device before the copy), equal to
    the plain bfloat16 model's gradients within bfloat16's rounding."""
    torch.manual_seed(0)
    ref = DropNet(d=64, n=4).eval().to(torch.bfloat16)
    path = str(tmp_path / "bf16.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=64, n=4).eval().to(torch.bfloat16)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    if not hasattr(torch.Tensor, "grad_dtype"):
        with pytest.raises(laden.InvalidArgumentError, match="grad_dtype"):
            laden.install_offload(m, train=True, grad_dtype=torch.float32)
        return
    h = laden.install_offload(m, train=True, lookahead=1,
                              grad_dtype=torch.float32)
    r = copy.deepcopy(ref).cuda()
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # fresh, then added on the host
        m(x).float().pow(2).sum().backward()
        r(x).float().pow(2).sum().backward()
    hp = dict(h.named_parameters())
    assert hp["blocks.0.lin.weight"].grad.dtype == torch.float32
    for n, q in r.named_parameters():
        torch.testing.assert_close(hp[n].grad.float().cpu(),
                                   q.grad.float().cpu(), atol=2e-2,
                                   rtol=2e-2, msg=n)
    h.remove()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_streamed_float64_parameters_are_refused(tmp_path):
    ref = DropNet(d=16, n=2).double()
    path = str(tmp_path / "f64.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=16, n=2).double()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    with pytest.raises(laden.InvalidArgumentError,
                       match=r"'blocks\.0\.lin\.weight'.*float64"):
        laden.install_offload(m, train=True)
    laden.install_offload(m).remove()  # nothing was left installed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_peft_lora_over_a_streamed_frozen_base(ckpt, device, tier):
    """peft's get_peft_model after stream_load: the LoRA factors peft put
    on meta (disk tier) are made on the device and initialized by peft,
    those it put on the CPU (RAM tier's host copies) moved to the device;
    three AdamW steps of the adapters equal peft on the plain model
    started from the same factors."""
    peft = pytest.importorskip("peft")
    ref, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, device=device,
                      **({"ram_budget": 0} if tier == "disk" else {}))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"],
                          init_lora_weights="gaussian")
    pm = peft.get_peft_model(m, cfg)
    h = laden.install_offload(pm, train=True, lookahead=1)
    lora = {n: p for n, p in h.named_parameters()}
    assert lora and all("lora_" in n for n in lora)
    a = lora["blocks.0.up.lora_A.default.weight"]
    assert a.device.type == device and a.std() > 0  # made, "gaussian"
    assert all(p.device.type == device for p in lora.values())
    assert not lora["blocks.0.up.lora_B.default.weight"].any()
    r = peft.get_peft_model(copy.deepcopy(ref).to(device), cfg)
    rp = dict(r.base_model.model.named_parameters())
    with torch.no_grad():
        for n, p in lora.items():
            rp[n].copy_(p)
    opt = torch.optim.AdamW(h.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW([p for p in r.parameters() if p.requires_grad],
                             lr=1e-2)
    for step in range(3):
        for mm, o in ((pm, opt), (r, ropt)):
            o.zero_grad()
            loss(mm, device, seed=step).backward()
            o.step()
    for n, p in lora.items():
        torch.testing.assert_close(p, rp[n], atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(pm(ids().to(device)),
                                   r(ids().to(device)), atol=1e-5, rtol=1e-4)
    h.remove()


def test_new_parameters_on_meta_in_streamed_blocks_are_refused(ckpt):
    """A parameter added to a streamed block after stream_load and left on
    meta (no values) is named, not run."""
    _, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, ram_budget=0)
    m.blocks[2].extra = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(laden.InvalidArgumentError,
                       match="'blocks.2.extra'.*meta"):
        laden.install_offload(m)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_step_in_backward_matches_adamw_on_the_plain_model(tmp_path):
    """handle.step_in_backward(AdamW): streamed weights step on the device
    inside backward (state up from the host, weights and state home);
    opt.step() after backward steps the rest.  Three steps, the learning
    rate changed between two of them, equal the plain model's AdamW: the
    weights, the state, the output; no gradient reaches the host copies."""
    torch.manual_seed(0)
    ref = DropNet(d=64, n=5).eval()
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=64, n=5).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=1)
    opt = torch.optim.AdamW(h.parameters(), lr=1e-2, weight_decay=0.1)
    h.step_in_backward(opt)
    r = copy.deepcopy(ref).cuda()
    ropt = torch.optim.AdamW(r.parameters(), lr=1e-2, weight_decay=0.1)
    hp = dict(h.named_parameters())
    for step in range(3):
        if step == 2:
            for o in (opt, ropt):
                o.param_groups[0]["lr"] = 3e-3
        x = torch.randn(6, 64, device="cuda", generator=torch.Generator(
            "cuda").manual_seed(step))
        for mm, o in ((m, opt), (r, ropt)):
            o.zero_grad()
            mm(x).pow(2).mean().backward()
            o.step()
        assert hp["blocks.0.lin.weight"].grad is None
        assert hp["inp.weight"].grad is not None  # resident: ordinary
    for n, q in r.named_parameters():
        torch.testing.assert_close(hp[n].detach().cpu(), q.detach().cpu(),
                                   atol=1e-5, rtol=1e-4, msg=n)
    st, rst = opt.state[hp["blocks.3.lin.weight"]], \
        ropt.state[dict(r.named_parameters())["blocks.3.lin.weight"]]
    assert st["exp_avg"].is_pinned() and st["exp_avg"].device.type == "cpu"
    torch.testing.assert_close(st["exp_avg_sq"].cuda(), rst["exp_avg_sq"],
                               atol=1e-7, rtol=1e-4)
    assert float(st["step"]) == 3
    with torch.no_grad():
        x = torch.randn(6, 64, device="cuda")
        torch.testing.assert_close(m(x), r(x), atol=1e-5, rtol=1e-4)
    h.step_in_backward(None)  # off: gradients go to the host again
    m(x).pow(2).mean().backward()
    assert hp["blocks.0.lin.weight"].grad is not None
    h.remove()


def test_step_in_backward_refusals(ckpt):
    ref, path = ckpt
    m = on_meta()
    laden.stream_load(m, path, offload_prefixes=PREFIXES, ram_budget=0)
    freeze_blocks(m)
    h = laden.install_offload(m)
    with pytest.raises(laden.StateError, match="train=True"):
        h.step_in_backward(torch.optim.SGD([torch.zeros(1,
                                            requires_grad=True)], lr=1))
    h.remove()
    h = laden.install_offload(m, train=True)
    with pytest.raises(laden.InvalidArgumentError, match="none of the host"):
        h.step_in_backward(torch.optim.SGD(h.parameters(), lr=1))
    h.remove()


def test_gradient_hooks_run_after_the_parameter_was_swapped():
    """laden swaps a parameter's contents as it binds it (slot, home): a
    post-accumulate hook registered after such swaps still runs (torch
    alone would register it with a tensor the parameter no longer
    holds)."""
    from laden.training import post_accumulate_hook

    p = nn.Parameter(torch.ones(3))
    fired = []
    h = post_accumulate_hook(p, lambda t: fired.append(1))
    (p * 2).sum().backward()
    h.remove()
    for v in (3.0, 4.0):
        torch.utils.swap_tensors(p, nn.Parameter(torch.full((3,), v)))
    post_accumulate_hook(p, lambda t: fired.append(2))
    p.grad = None
    (p * 2).sum().backward()
    assert fired == [1, 2]


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_training_again_after_remove(tmp_path):
    """remove() then install_offload(train=True) again (another
    lookahead): gradients still reach the host copies, and
    step_in_backward still steps the weights."""
    torch.manual_seed(0)
    ref = DropNet(d=64, n=4).eval()
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=64, n=4).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    x = torch.randn(4, 64, device="cuda")
    r = copy.deepcopy(ref).cuda()
    r(x).pow(2).sum().backward()
    rg = {n: q.grad for n, q in r.named_parameters()}
    for look in (1, 3):
        h = laden.install_offload(m, train=True, lookahead=look)
        hp = dict(h.named_parameters())
        for q in hp.values():
            q.grad = None
        m(x).pow(2).sum().backward()
        for n, q in hp.items():
            torch.testing.assert_close(q.grad.cuda(), rg[n], atol=1e-5,
                                       rtol=1e-4, msg=f"{look} {n}")
        h.remove()
    h = laden.install_offload(m, train=True, lookahead=2)
    opt = torch.optim.SGD(h.parameters(), lr=0.1)
    h.step_in_backward(opt)
    hp = dict(h.named_parameters())
    before = hp["blocks.1.lin.weight"].detach().clone()
    m(x).pow(2).sum().backward()
    torch.testing.assert_close(hp["blocks.1.lin.weight"].detach(),
                               before - 0.1 * rg["blocks.1.lin.weight"].cpu(),
                               atol=1e-5, rtol=1e-4)
    h.remove()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_a_kept_grad_is_not_overwritten(tmp_path):
    """The .grad buffers are reused from step to step only when nothing
    else holds them: a gradient the user kept across zero_grad() stays as
    it was."""
    torch.manual_seed(0)
    ref = DropNet(d=32, n=3).eval()
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=32, n=3).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=1)
    hp = dict(h.named_parameters())["blocks.1.lin.weight"]
    m(torch.randn(4, 32, device="cuda")).pow(2).sum().backward()
    kept = hp.grad
    snapshot = kept.clone()
    hp.grad = None
    m(torch.randn(4, 32, device="cuda") * 3).pow(2).sum().backward()
    assert hp.grad is not kept
    assert not torch.equal(hp.grad, snapshot)
    torch.testing.assert_close(kept, snapshot, atol=0, rtol=0)
    h.remove()


class TwiceNet(nn.Module):
    """Block 0 runs twice in each forward."""

    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(DropBlock(d) for _ in range(3))

    def forward(self, x):
        x = self.blocks[0](x)
        for b in self.blocks:
            x = b(x)
        return x


class Int8State(torch.optim.Optimizer):
    """SGD that keeps an int8 copy per weight as state (as 8-bit
    optimizers do)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                self.state[p]["q"] = torch.zeros_like(p, dtype=torch.int8)
                p.add_(p.grad, alpha=-g["lr"])


class Needy(torch.optim.SGD):
    """An optimizer whose constructor takes what its groups do not hold."""

    def __init__(self, params, lr, extra):
        super().__init__(params, lr=lr)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_add_up_over_micro_batches(tmp_path, dtype):
    """Three micro-batches through a model whose block 0 runs twice per
    forward: later micro-batches are added on the device into the
    page-locked .grad, the second gradient of one backward on the host
    after the first's copy; the sums are the plain model's."""
    torch.manual_seed(0)
    ref = TwiceNet().eval().to(dtype)
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = TwiceNet().eval().to(dtype)
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=1)
    r = copy.deepcopy(ref).cuda()
    for mb in range(3):
        x = torch.randn(4, 32, device="cuda", dtype=dtype,
                        generator=torch.Generator("cuda").manual_seed(mb))
        m(x).float().pow(2).sum().backward()
        r(x).float().pow(2).sum().backward()
    if dtype == torch.float32:
        assert_grads_equal(h.named_parameters(), r, 1e-5)
    else:  # bf16 sums rounded in another order: within bf16's precision
        want = dict(r.named_parameters())
        for n, p in h.named_parameters():
            scale = want[n].grad.float().abs().max().item() + 1e-6
            torch.testing.assert_close(p.grad.float().cpu() / scale,
                                       want[n].grad.float().cpu() / scale,
                                       atol=3e-2, rtol=0, msg=n)
    h.remove()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the RAM tier streams "
                    "only there")
def test_step_in_backward_refuses_what_it_cannot_do(tmp_path):
    """A weight with two gradients in one backward, and optimizer state
    that is not one float per weight, are refused by name; the refused
    step leaves the model's output as it was."""
    torch.manual_seed(0)
    ref = TwiceNet().eval()
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = TwiceNet().eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=1)
    h.step_in_backward(torch.optim.SGD(h.parameters(), lr=0.1))
    x = torch.randn(4, 32, device="cuda")
    with pytest.raises(laden.InvalidArgumentError, match="second gradient"):
        m(x).pow(2).sum().backward()
    h.remove()

    torch.manual_seed(0)
    ref = DropNet(d=32, n=3).eval()
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=32, n=3).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device="cuda")
    h = laden.install_offload(m, train=True, lookahead=1)
    with torch.no_grad():
        before = m(x)
    h.step_in_backward(Int8State(h.parameters()))
    with pytest.raises(laden.InvalidArgumentError, match="int8"):
        m(x).pow(2).sum().backward()
    h.step_in_backward(Needy(h.parameters(), lr=0.1, extra=1))
    with pytest.raises(laden.InvalidArgumentError,
                       match="cannot make a Needy for one parameter"):
        m(x).pow(2).sum().backward()
    h.step_in_backward(None)
    with torch.no_grad():
        torch.testing.assert_close(m(x), before, atol=0, rtol=0)
    h.remove()


def test_grad_buffers_reused_only_when_nothing_else_holds_them():
    """The trainer's .grad buffers (reused from step to step) are taken
    again only while neither the tensor nor its memory is held elsewhere:
    not as a .grad, a kept reference, or a .detach() view."""
    from laden.training import _Trainer

    tr = _Trainer.__new__(_Trainer)
    tr.bufs, tr.cuda = {}, False
    b = tr._new_buffer(1, (4,), torch.float32)
    del b
    assert tr._reusable(1) is not None
    p = nn.Parameter(torch.zeros(4))
    p.grad = tr._reusable(1)
    assert tr._reusable(1) is None
    p.grad = None
    assert tr._reusable(1) is not None
    kept = tr._reusable(1)
    assert tr._reusable(1) is None
    del kept
    view = tr.bufs[1][0].detach()
    assert tr._reusable(1) is None
    del view
    assert tr._reusable(1) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_step_accumulates_and_clips_like_torch(tmp_path, device):
    """handle.optimizer_step(AdamW, max_norm=...) after two micro-batches
    equals torch's AdamW after clip_grad_norm_ on the plain model, over
    three steps (the learning rate changed before the last): the norm
    returned, the weights, the state (page-locked on the host), the
    output.  On CUDA the streamed weights step on the device block by
    block; on the CPU they run in place and the optimizer steps them.
    Refused: a max_norm that is not a positive number, the optimizer
    step_in_backward steps, a removed handle."""
    torch.manual_seed(0)
    ref = DropNet(d=64, n=5).eval()
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.device("meta"):
        m = DropNet(d=64, n=5).eval()
    laden.stream_load(m, path, offload_prefixes=["blocks."], device=device)
    h = laden.install_offload(m, train=True, lookahead=1)
    opt = torch.optim.AdamW(h.parameters(), lr=1e-2, weight_decay=0.1)
    r = copy.deepcopy(ref).to(device)
    ropt = torch.optim.AdamW(r.parameters(), lr=1e-2, weight_decay=0.1)
    hp = dict(h.named_parameters())
    for step in range(3):
        if step == 2:
            for o in (opt, ropt):
                o.param_groups[0]["lr"] = 3e-3
        for mb in range(2):
            g = torch.Generator(device).manual_seed(10 * step + mb)
            x = torch.randn(6, 64, device=device, generator=g)
            for mm in (m, r):
                mm(x).pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        total = h.optimizer_step(opt, max_norm=0.05)
        if device == "cuda":
            # Device memory: weights, gradients and the two fp32 states of
            # the block stepping and of the next one coming up (8 block
            # weights' worth), the optimizer's temporaries and frees the
            # streams have not reached yet -- 12.5 measured on the H200 --
            # not the model's 20 (five blocks' weights, gradients, states).
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            block = max(sum(p.numel() * p.element_size()
                            for p in b.parameters()) for b in m.blocks)
            assert peak <= 14 * block, (peak, block)
        rtotal = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.05)
        ropt.step()
        torch.testing.assert_close(total.cpu(), rtotal.cpu(), atol=1e-6,
                                   rtol=1e-5)
        assert float(rtotal) > 0.05  # the clipping did something
        for o in (opt, ropt):
            o.zero_grad()
    for n, q in r.named_parameters():
        torch.testing.assert_close(hp[n].detach().cpu(), q.detach().cpu(),
                                   atol=1e-5, rtol=1e-4, msg=n)
    name = "blocks.3.lin.weight"
    st, rst = opt.state[hp[name]], ropt.state[dict(r.named_parameters())[name]]
    assert st["exp_avg"].device.type == "cpu"
    if device == "cuda":
        assert st["exp_avg"].is_pinned()
    torch.testing.assert_close(st["exp_avg_sq"].cpu(),
                               rst["exp_avg_sq"].cpu(), atol=1e-7, rtol=1e-4)
    assert float(st["step"]) == 3
    with torch.no_grad():
        x = torch.randn(6, 64, device=device)
        torch.testing.assert_close(m(x), r(x), atol=1e-5, rtol=1e-4)
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(laden.InvalidArgumentError, match="max_norm"):
            h.optimizer_step(opt, max_norm=bad)
    if device == "cuda":
        h.step_in_backward(opt)
        with pytest.raises(laden.StateError, match="step_in_backward"):
            h.optimizer_step(opt)
        h.step_in_backward(None)
    h.remove()
    with pytest.raises(laden.StateError, match="optimizer_step"):
        h.optimizer_step(opt)


def test_optimizer_step_device_path_on_the_cpu(monkeypatch):
    """optimizer_step's device path (weights, gradients and state fetched
    through the C sink, a one-parameter optimizer per weight, weights and
    state sent home, the slots refilled), driven on the CPU with the real
    sink for a trainer of two blocks: three steps of AdamW with clipping,
    several groups, a weight without a gradient and one outside the
    blocks, equal torch's AdamW after clip_grad_norm_; the slots are
    refilled once a step, also when a copy home fails."""
    import ctypes

    from laden import _lib, training

    refills = []

    class Lib:  # the real C library, but refill on a schedule stubbed
        def __getattr__(self, name):
            if name == "laden_sched_refill":
                return lambda h: refills.append(h) or 0
            return getattr(_lib.lib, name)
    monkeypatch.setattr(training, "lib", Lib())
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (6, 8), (6,), (5, 5)]
    weights = [nn.Parameter(torch.randn(s)) for s in shapes]
    other = nn.Parameter(torch.randn(3))  # not streamed
    ref = [nn.Parameter(w.detach().clone()) for w in weights + [other]]

    class T:  # stand-ins for the described tensors
        def __init__(self, name):
            self.names = [name]
    ts = [T(f"w{i}") for i in range(len(weights))]
    sink = ctypes.c_void_p()
    assert _lib.lib.laden_grads_create(
        _lib.DEVICE_CPU, _lib.lib.laden_grads_staging_bytes(1 << 20),
        ctypes.byref(sink)) == 0
    tr = training._Trainer.__new__(training._Trainer)
    tr.__dict__.update(
        device=torch.device("cpu"), cuda=False, sink=sink.value,
        copy_stream=None, _up=None, keep=[], sent=set(), armed=False,
        fused=None, stepped=False,
        host={id(t): w for t, w in zip(ts, weights)},
        by_block={0: weights[:2], 1: weights[2:]},
        state=type("S", (), {"tensors": ts,
                             "live": lambda self, what: type(
                                 "O", (), {"h": 7})()})())
    groups = lambda ps: [{"params": ps[:3] + ps[5:], "lr": 1e-2},  # noqa
                         {"params": ps[3:5], "lr": 3e-2,
                          "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups(weights + [other]), weight_decay=0.1)
    ropt = torch.optim.AdamW(groups(ref), weight_decay=0.1)
    try:
        for step in range(3):
            for mine, theirs in ((weights + [other], opt), (ref, ropt)):
                g = torch.Generator().manual_seed(step)
                for i, p in enumerate(mine):
                    p.grad = None if i == 4 and step == 1 else \
                        torch.randn(p.shape, generator=g)
            total = training.optimizer_step(tr, opt, 0.5)
            rtotal = torch.nn.utils.clip_grad_norm_(ref, 0.5)
            ropt.step()
            torch.testing.assert_close(total, rtotal)
            assert float(rtotal) > 0.5
            assert len(refills) == step + 1
            for o in (opt, ropt):
                o.zero_grad()
        for w, r in zip(weights + [other], ref):
            torch.testing.assert_close(w.detach(), r.detach(), atol=1e-6,
                                       rtol=1e-5)
        for w, r in zip(weights, ref):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt.state[w][k],
                                           ropt.state[r][k])
        tr.armed = True  # inside a backward: refused, nothing stepped
        with pytest.raises(laden.StateError, match="inside a backward"):
            training.optimizer_step(tr, opt, None)
        tr.armed = False
        assert len(refills) == 3
        # A copy home that fails: the error, and the slots refilled.
        for w in weights:
            w.grad = torch.ones_like(w)

        def bad_flush():
            raise laden.LadenError("copy home failed", 0, "E_DEVICE")
        tr.flush = bad_flush
        with pytest.raises(laden.LadenError, match="copy home"):
            training.optimizer_step(tr, opt, None)
        assert len(refills) == 4
    finally:
        _lib.lib.laden_grads_destroy(sink)
