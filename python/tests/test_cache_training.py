"""Training in the cache (ModelSpec(trainable=True)): AdamW over
cache.parameters(key) gives the plain model's weights while other models'
uses take its device memory between steps, whole on the device or
streamed; LoRA on a frozen cached base equals peft on the plain model;
a trainable model's host copy is never dropped for the RAM budget; what
cannot be done is refused by name."""

import copy

import pytest
import torch

import laden
from laden import ModelCache, ModelSpec
from models import on_meta, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCKS = ("blocks", "stages.0", "stages.1")


def ids(n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, n), generator=g)


def loss(m, device, seed):
    return m(ids(seed=seed).to(device)).float().pow(2).mean()


def spec(seed, **kw):
    kw.setdefault("block_paths", BLOCKS)
    return ModelSpec(f"model{seed}", lambda: reference(seed), **kw)


def size_of(seed):
    cache = ModelCache()
    with cache.use(spec(seed), device="cpu"):
        pass
    return cache.info(f"model{seed}").size_bytes


def other_use(cache, device):
    """Another model's use, which takes the device memory it needs."""
    with cache.use(spec(1), device=device) as m, torch.no_grad():
        m(ids().to(device))


# budget (in model sizes) -> how the trainable model runs
BUDGETS = {"resident": 1.2, "streaming": 0.6}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_adamw_in_the_cache_matches_the_plain_model(device, budget):
    """Three AdamW steps of two micro-batches each, another model used
    between steps (taking the trainable one's device memory), and a
    fourth step taken inside a use before its next forward: the weights
    and outputs equal torch's AdamW on the plain model."""
    size = size_of(0)
    cache = ModelCache(vram_budget=int(size * BUDGETS[budget]))
    sp = spec(0, trainable=True)
    r = copy.deepcopy(reference(0)).to(device)
    ropt = torch.optim.AdamW(r.parameters(), lr=1e-2, weight_decay=0.1)
    with cache.use(sp, device=device):
        opt = torch.optim.AdamW(cache.parameters(sp.key), lr=1e-2,
                                weight_decay=0.1)
    names = [n for n, _ in cache.named_parameters(sp.key)]
    assert names == [n for n, _ in r.named_parameters()]
    assert all(p.device.type == "cpu" for p in cache.parameters(sp.key))
    for step in range(3):
        with cache.use(sp, device=device) as m:
            assert cache.info(sp.key).mode == (
                "resident" if budget == "resident" else "streaming")
            opt.zero_grad()
            for mb in range(2):
                loss(m, device, 10 * step + mb).backward()
        ropt.zero_grad()
        for mb in range(2):
            loss(r, device, 10 * step + mb).backward()
        want = dict(r.named_parameters())
        for n, p in cache.named_parameters(sp.key):
            torch.testing.assert_close(p.grad, want[n].grad.cpu(),
                                       atol=1e-5, rtol=1e-4, msg=n)
        opt.step()
        ropt.step()
        before = cache.info(sp.key).vram_bytes
        other_use(cache, device)
        assert cache.info(sp.key).vram_bytes < before  # it gave way
    with cache.use(sp, device=device) as m:
        opt.zero_grad()
        loss(m, device, 99).backward()
        opt.step()  # inside the use: the next forward sees it
        ropt.zero_grad()
        loss(r, device, 99).backward()
        ropt.step()
        with torch.no_grad():
            torch.testing.assert_close(m(ids().to(device)),
                                       r(ids().to(device)),
                                       atol=1e-5, rtol=1e-4)
    for (n, p), (_, q) in zip(cache.named_parameters(sp.key),
                              r.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach().cpu(), atol=1e-5,
                                   rtol=1e-4, msg=n)
    with cache.use(sp, device=device) as m:  # the doors see the updates
        sd = m.state_dict()
    torch.testing.assert_close(sd["blocks.0.up.weight"].cpu(),
                               r.blocks[0].up.weight.detach().cpu(),
                               atol=1e-5, rtol=1e-4)
    del sd  # views of its memory: the cache would not free it
    with pytest.raises(laden.StateError, match=r"model0.*unregister"):
        cache.clear()  # it holds stepped weights only its host copy has
    cache.unregister(sp.key)
    cache.clear()


def lora_model(base):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"],
                          init_lora_weights="gaussian")
    torch.manual_seed(5)  # the same factors every time
    return peft.get_peft_model(base, cfg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("built", ["cpu", "meta"])
def test_lora_on_a_cached_frozen_base_matches_peft(device, built, tmp_path):
    """peft's LoRA on a base frozen by get_peft_model, built by the
    factory (on the CPU, or on meta over the base's checkpoint: its names
    map onto peft's and the factors are made by peft's own init) and
    streamed (the budget holds less than the model): three AdamW steps
    with another model used between them equal peft on the plain model
    started from the same factors; only the factors are the
    optimizer's."""
    pytest.importorskip("peft")
    size = size_of(0)
    cache = ModelCache(vram_budget=int(size * 0.75))
    paths = tuple(f"base_model.model.{p}" for p in BLOCKS)
    if built == "cpu":
        sp = ModelSpec("lora", lambda: lora_model(reference(0)),
                       block_paths=paths, trainable=True)
    else:
        path = str(tmp_path / "base.safetensors")
        laden.save_file(reference(0).state_dict(), path)
        sp = ModelSpec("lora", lambda: lora_model(on_meta()), checkpoint=path,
                       block_paths=paths, trainable=True)
    r = lora_model(copy.deepcopy(reference(0))).to(device)
    ropt = torch.optim.AdamW([p for p in r.parameters() if p.requires_grad],
                             lr=1e-2)
    with cache.use(sp, device=device):
        lora = dict(cache.named_parameters(sp.key))
        opt = torch.optim.AdamW(lora.values(), lr=1e-2)
    assert lora and all("lora_" in n for n in lora)
    assert len(lora) == len([p for p in r.parameters() if p.requires_grad])
    a = lora["base_model.model.blocks.0.up.lora_A.default.weight"]
    assert a.std() > 0  # "gaussian", made
    assert not lora["base_model.model.blocks.0.up.lora_B.default.weight"].any()
    rp = dict(r.named_parameters())
    with torch.no_grad():
        for n, p in lora.items():
            rp[n].copy_(p)
    for step in range(3):
        with cache.use(sp, device=device) as m:
            assert cache.info(sp.key).mode == "streaming"
            opt.zero_grad()
            loss(m, device, step).backward()
        opt.step()
        ropt.zero_grad()
        loss(r, device, step).backward()
        ropt.step()
        other_use(cache, device)
    for n, p in lora.items():
        torch.testing.assert_close(p.detach(), rp[n].detach().cpu(),
                                   atol=1e-5, rtol=1e-4, msg=n)
    with cache.use(sp, device=device) as m, torch.no_grad():
        torch.testing.assert_close(m(ids().to(device)), r(ids().to(device)),
                                   atol=1e-5, rtol=1e-4)
    cache.unregister(sp.key)


def test_the_ram_budget_never_drops_a_trainable_model():
    """Under a RAM budget for one model, using another drops the idle
    frozen one (rebuilt later) but never the trainable one, whose host
    copy holds the only copy of its stepped weights."""
    size = size_of(0)
    cache = ModelCache(ram_budget=int(size * 2.5))
    sp = spec(0, trainable=True)
    with cache.use(sp, device="cpu") as m:
        opt = torch.optim.SGD(cache.parameters(sp.key), lr=0.1)
        loss(m, "cpu", 1).backward()
    opt.step()
    stepped = {n: p.detach().clone()
               for n, p in cache.named_parameters(sp.key)}
    for seed in (1, 2, 3):  # each needs the room of an idle model
        with cache.use(spec(seed), device="cpu") as m, torch.no_grad():
            m(ids())
    assert cache.stats()["drops"] >= 1  # frozen models gave way
    assert sp.key in cache._rt  # never the trainable one
    with cache.use(sp, device="cpu") as m:
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.detach(), stepped[n], msg=n)
    cache.unregister(sp.key)


def test_what_cannot_train_in_the_cache_is_refused():
    with pytest.raises(laden.InvalidArgumentError, match="trainable.*shared"):
        spec(0, trainable=True, shared=True)
    with pytest.raises(laden.InvalidArgumentError, match="True or False"):
        spec(0, trainable="yes")
    cache = ModelCache()
    sp = cache.register(spec(0, trainable=True))
    with pytest.raises(laden.StateError, match="not built yet"):
        cache.parameters(sp.key)
    with pytest.raises(laden.StateError, match="registered with another"):
        cache.register(spec(0))  # the same key, not trainable
    with cache.use(spec(1), device="cpu"):
        pass
    with pytest.raises(laden.InvalidArgumentError, match="not trainable"):
        cache.parameters("model1")
    with cache.use(sp, device="cpu") as m:
        out = loss(m, "cpu", 1)
    with pytest.raises(laden.StateError, match="outside cache.use"):
        out.backward()  # its blocks would run again without the model
    delta = laden.AdapterSpec("d", lambda: {"blocks.1.up.delta.weight":
                                            torch.zeros(64, 32)})
    with pytest.raises(laden.InvalidArgumentError, match="routed"):
        with cache.use(sp, device="cpu", adapters=[delta]):
            pass
    # Nothing stepped yet: clear() may let it go.
    cache.clear()
    assert sp.key not in cache._rt


def test_parameters_in_a_dtype_gradients_cannot_take_are_named():
    """A trainable float64 parameter: refused at the build, naming it;
    frozen, the same model builds and runs."""
    def f64(train):
        m = reference(0)
        m.blocks[2].up.to(torch.float64).requires_grad_(train)
        return m

    cache = ModelCache()
    with pytest.raises(laden.InvalidArgumentError,
                       match=r"'blocks\.2\.up\.weight'.*float64"):
        with cache.use(ModelSpec("f", lambda: f64(True), block_paths=BLOCKS,
                                 trainable=True), device="cpu"):
            pass
    assert "f" not in cache._rt
    with cache.use(ModelSpec("g", lambda: f64(False), block_paths=BLOCKS,
                             trainable=True), device="cpu"):
        assert "blocks.2.up.weight" not in dict(cache.named_parameters("g"))
    cache.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trainable_model_does_not_move_to_another_device():
    """Built on the CPU, used on CUDA: it would be rebuilt from its factory
    and lose what its optimizer stepped; refused, the model as it was."""
    cache = ModelCache()
    sp = spec(0, trainable=True)
    with cache.use(sp, device="cpu"):
        pass
    with pytest.raises(laden.StateError, match="trainable.*unregister"):
        with cache.use(sp, device="cuda"):
            pass
    assert str(cache.info(sp.key).device) == "cpu"
    cache.unregister(sp.key)


def test_frozen_parts_stay_out_of_the_optimizer():
    """Only what the factory left requires_grad trains; a model with
    nothing to train builds and runs as before."""
    def frozen_head():
        m = reference(0)
        for n, p in m.named_parameters():
            p.requires_grad_(n.startswith("blocks.0."))
        return m

    cache = ModelCache()
    sp = ModelSpec("f", frozen_head, block_paths=BLOCKS, trainable=True)
    with cache.use(sp, device="cpu") as m:
        names = [n for n, _ in cache.named_parameters("f")]
        assert names and all(n.startswith("blocks.0.") for n in names)
        loss(m, "cpu", 1).backward()
    assert all(p.grad is not None for p in cache.parameters("f"))
    none = ModelSpec("n", lambda: reference(0).requires_grad_(False),
                     block_paths=BLOCKS, trainable=True)
    with cache.use(none, device="cpu") as m, torch.no_grad():
        assert torch.equal(m(ids()), reference(0)(ids()))
    assert list(cache.parameters("n")) == []
    cache.clear()
