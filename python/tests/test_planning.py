"""Plans: deterministic, explained, editable, JSON round trip; stream_load
follows them; stage frees everything; storage dtypes within bounds."""

import gc
import os
import subprocess
import sys

import pytest
import torch

import laden
from laden import planning
from models import PREFIXES, on_meta, reference

READINGS = dict(vram_free=8 << 30, vram_total=16 << 30, ram_free=32 << 30,
                ram_total=64 << 30)
BW = dict(h2d=50e9, disk=2e9)


def fixed():
    """Twelve blocks of 1.0-1.25 GiB."""
    names = [f"blocks.{i}." for i in range(12)]
    sizes = [(1 << 30) + (i % 3) * (128 << 20) for i in range(12)]
    return names, sizes


def test_plan_is_deterministic_and_explained():
    names, sizes = fixed()
    p1 = planning.compute(names, sizes, 512 << 20, device="cpu",
                          readings=READINGS, bandwidths=BW, ram_budget="6GB")
    p2 = planning.compute(names, sizes, 512 << 20, device="cpu",
                          readings=READINGS, bandwidths=BW, ram_budget="6GB")
    assert p1 == p2
    tiers = [b.tier for b in p1.blocks]
    assert laden.Tier.DISK in tiers and laden.Tier.RAM in tiers
    text = str(p1)
    assert "blocks.11." in text and "disk: no RAM left" in text
    assert "rounded down to 256 MiB" in text and "predicted" in text
    assert p1.predicted_ms > 0


def test_budget_too_small_says_what_would_fit():
    """On the CPU the rest of the model and the slots are host memory: free
    RAM that cannot hold them is an error naming both.  A RAM budget bounds
    the RAM tier alone (as on CUDA): 1 GB puts every block on disk."""
    names, sizes = fixed()
    small = dict(READINGS, ram_free=8 << 30)  # 4 GiB kept free: 4 GiB left
    with pytest.raises(laden.BudgetError) as e:
        planning.compute(names, sizes, 512 << 20, device="cpu",
                         readings=small, bandwidths=BW)
    assert "cannot hold the resident part (the rest of the model and the " \
        "blocks asked resident: 537 MB)" in str(e.value)
    assert "3 slots (4.03 GB)" in str(e.value)
    p = planning.compute(names, sizes, 512 << 20, device="cpu",
                         readings=READINGS, bandwidths=BW, ram_budget="1GB")
    assert all(b.tier == laden.Tier.DISK for b in p.blocks)


def test_assign_manual_and_json(tmp_path):
    names, sizes = fixed()
    p = planning.compute(names, sizes, 512 << 20, device="cpu",
                         readings=READINGS, bandwidths=BW, ram_budget="8GB")
    p.assign(laden.Tier.DISK, indices=[0, 1])
    assert p.blocks[0].tier == laden.Tier.DISK and "assigned" in p.blocks[0].why
    with pytest.raises(laden.InvalidArgumentError, match="no block 40"):
        p.assign(laden.Tier.RAM, indices=[40])
    q = laden.Plan.from_json(p.to_json())
    assert q == p
    with pytest.raises(laden.InvalidArgumentError):
        laden.Plan.from_json("{}")
    with pytest.raises(laden.InvalidArgumentError):
        laden.Plan.from_json("not json")
    m = laden.Plan.manual(resident=["blocks.0."], streamed=["blocks.1."],
                          disk=["stages."])
    assert [b.tier for b in m.blocks] == [laden.Tier.GPU, laden.Tier.RAM,
                                          laden.Tier.DISK]
    with pytest.raises(laden.InvalidArgumentError, match="twice"):
        laden.Plan.manual(resident=["a."], disk=["a."])


def save(tmp_path):
    ref = reference()
    path = str(tmp_path / "tiny.safetensors")
    laden.save_file(ref.state_dict(), path)
    return ref, path


def ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))


def test_plan_on_a_model_and_stream_load_follows_it(tmp_path):
    ref, path = save(tmp_path)
    m = on_meta()
    assert planning.find_blocks(m) == ["blocks.", "stages.0.", "stages.1."]
    p = laden.plan(m, path, device="cpu", ram_budget="200kB")
    assert [b.name for b in p.blocks][:2] == ["blocks.0.", "blocks.1."]
    p.assign(laden.Tier.DISK, indices=[0])
    p.assign(laden.Tier.RAM, indices=[3])
    rep = laden.stream_load(m, path, plan=p)
    got = {name: tier for name, _, tier in rep.blocks}
    assert got["blocks.0."] == "disk" and got["blocks.3."] == "ram"
    for b in p.blocks:
        assert got[b.name] == {laden.Tier.GPU: "resident",
                               laden.Tier.RAM: "ram",
                               laden.Tier.DISK: "disk"}[b.tier]
    h = laden.install_offload(m)
    with torch.no_grad():
        assert torch.equal(m(ids()), ref(ids()))
    laden.release(m, h)


def test_manual_plan_with_unknown_block(tmp_path):
    _, path = save(tmp_path)
    p = laden.Plan.manual(resident=["blocks.0."], streamed=["nope."])
    with pytest.raises(laden.InvalidArgumentError) as e:
        laden.stream_load(on_meta(), path, plan=p)
    assert "nope." in str(e.value) and "blocks." in str(e.value)
    with pytest.raises(laden.InvalidArgumentError, match="not both"):
        laden.stream_load(on_meta(), path, plan=p, ram_budget=0)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_stage_frees_on_exit_and_on_exception(tmp_path):
    ref = reference(d=256, hidden=(1024,) * 6, nested=(2, 2))
    path = str(tmp_path / "big.safetensors")
    laden.save_file(ref.state_dict(), path)

    def build():
        return on_meta(d=256, hidden=(1024,) * 6, nested=(2, 2))

    x = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        want = ref(x)
    for _ in range(2):
        with laden.stage(build, path, device="cpu", ram_budget="8MB") as (m, p):
            with torch.no_grad():
                assert torch.equal(m(x), want)
    gc.collect()
    before = rss()
    for _ in range(10):
        with laden.stage(build, path, device="cpu", ram_budget="8MB") as (m, p):
            with torch.no_grad():
                m(x)
        assert m.blocks[0].up.weight.device.type == "meta"
        with pytest.raises(RuntimeError, match="boom"):
            with laden.stage(build, path, device="cpu") as (m, p):
                raise RuntimeError("boom")
        assert m.blocks[0].up.weight.device.type == "meta"
        assert not hasattr(m, "_laden_stream")
    gc.collect()
    assert rss() - before < 8 << 20
    assert laden.measure_activation_vram(lambda: None) >= 0


def test_storage_dtype_bf16_within_bounds(tmp_path):
    ref, path = save(tmp_path)
    with torch.no_grad():
        want = ref(ids())
    m = on_meta()
    p = laden.plan(m, path, device="cpu", storage_dtype="bf16")
    laden.stream_load(m, path, plan=p)
    h = laden.install_offload(m)
    assert m.blocks[0].up.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = m(ids()).float()
    err = (got - want).norm() / want.norm()
    assert err < 2e-2, err  # bf16 weights and activations: ~1e-2
    assert err > 0
    laden.release(m, h)
    with pytest.raises(laden.InvalidArgumentError, match="fp8"):
        laden.plan(on_meta(), path, device="cpu", storage_dtype="int4")


def test_cli_plan(tmp_path):
    ref, path = save(tmp_path)
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "laden", "plan", path,
                        "--device", "cpu", "--ram", "400kB", "--json",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # From names alone, a block is the first numbered path: stages.N.
    assert "blocks.0." in r.stdout and "stages.1." in r.stdout
    p = laden.Plan.from_json(out.read_text())
    assert len(p.blocks) == 8
    # The sizes are libladen's, as it lays the blocks out: what laden.plan
    # gives for the model (blocks.N. here are whole blocks in both).
    q = laden.plan(on_meta(), path, device="cpu", ram_budget="400kB")
    by_name = {b.name: b.bytes for b in q.blocks}
    for b in p.blocks:
        if b.name in by_name:
            assert b.bytes == by_name[b.name], b.name


def test_storage_bf16_expanded_to_compute_fp32(tmp_path):
    """Stored in bf16 (half the bytes), run in float32: exactly the model
    whose block weights were rounded to bf16."""
    ref, path = save(tmp_path)
    import copy
    r = copy.deepcopy(ref)
    with torch.no_grad():
        for name, t in list(r.state_dict().items()):
            if name.startswith(("blocks.", "stages.")) and \
                    t.dtype.is_floating_point:
                t.copy_(t.to(torch.bfloat16).float())
        want = r(ids())
    m = on_meta()
    rep = laden.stream_load(m, path, offload_prefixes=PREFIXES, device="cpu",
                            storage_dtype="bf16", compute_dtype="fp32")
    assert rep.tier_bytes["ram"] + rep.tier_bytes["disk"] < 0.55 * sum(
        v.numel() * 4 for k, v in ref.state_dict().items()
        if k.startswith(("blocks.", "stages.")))
    h = laden.install_offload(m)
    assert m.blocks[0].up.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(m(ids()), want)
    laden.release(m, h)
    # Converted blocks cannot stream from disk (read as stored): with no
    # RAM tier the planner says so, naming the block.
    with pytest.raises(laden.BudgetError,
                       match="block 'blocks.0.' .* is converted on load"):
        laden.stream_load(on_meta(), path, offload_prefixes=PREFIXES,
                          device="cpu", storage_dtype="bf16",
                          compute_dtype="fp32", ram_budget=0)
    # Asked for the disk tier by name: refused as the block is described.
    with pytest.raises(laden.InvalidArgumentError, match="disk"):
        laden.stream_load(on_meta(), path, offload_prefixes=PREFIXES,
                          disk_prefixes=["blocks.1."], device="cpu",
                          storage_dtype="bf16", compute_dtype="fp32")


def test_cpu_plan_shows_only_what_applies_and_was_measured():
    """On the CPU the "device" is host memory: no GPU tier, no VRAM
    reading, no host-to-device rate (nothing is copied)."""
    names, sizes = fixed()
    p = planning.compute(names, sizes, 512 << 20, device="cpu",
                         readings=READINGS, bandwidths=BW, ram_budget="6GB")
    text = str(p)
    for word in ("GPU", "VRAM", "50.00 GB/s", "0.00 GB/s"):
        assert word not in text, (word, text)
    assert "always in host memory" in text and "disk read 2.00 GB/s" in text
    assert "predicted disk read time per forward" in text
    assert not any(k.startswith("vram") for k in p.readings)
    assert "h2d" not in p.bandwidths and "vram_avail" not in p.budgets
    assert p.budgets["ram_limit"] == 6 * 10**9
    assert "the RAM budget given" in text
    # The disk rate unknown: no time is predicted, nothing shown as measured.
    q = planning.compute(names, sizes, 512 << 20, device="cpu",
                         readings=READINGS, bandwidths=dict(h2d=0, disk=0),
                         ram_budget="6GB")
    text = str(q)
    assert "GB/s" not in text and "not measured: disk read" in text
    assert "predicted disk read time" not in text
    assert "the disk read rate was not measured" in text


def test_gpu_plan_does_not_show_unmeasured_rates():
    p = laden.Plan(blocks=[planning.PlanBlock("blocks.0.", 1 << 20,
                                              laden.Tier.RAM, "RAM")],
                   device="cuda:0", bandwidths=dict(h2d=0.0, disk=1.5e9),
                   readings=dict(vram_free=1 << 30, ram_free=2 << 30,
                                 ram_total=4 << 30))
    text = str(p)
    assert "0.00 GB/s" not in text and "disk read 1.50 GB/s" in text
    assert "not measured: host-to-device" in text
    assert "VRAM 1.07 GB" in text and "GPU" in text
