"""Tensor-parallel models (DTensor parameters after parallelize_module on
the meta-built model) loaded by stream_load: each rank reads only its
shard -- rows of a ColwiseParallel weight as one range, columns of a
RowwiseParallel one as a range per row -- streams it, and the outputs
equal the unsharded model's.  Ranks are processes with gloo on the CPU.
Adapters on sharded weights merge each rank's slice of the update.
(Shards of unequal size: torch's ColwiseParallel outputs assume equal
ones; the C tests read parts at any offset.)"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import laden

HERE = os.path.dirname(os.path.abspath(__file__))

pytest.importorskip("torch.distributed.tensor.parallel")

CHILD = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    import laden
    from test_shared import Net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel,
                                                   RowwiseParallel,
                                                   parallelize_module)

    rank, world = int(sys.argv[1]), int(sys.argv[2])
    path, mode = sys.argv[4], sys.argv[5]
    dev = torch.device("cuda", rank) if mode == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            init_method="file://" + sys.argv[3],
                            rank=rank, world_size=world)
    mesh = init_device_mesh(dev.type, (world,))
    torch.manual_seed(0)
    ref = Net(d=48, h=64, n=4).eval()
    with torch.device("meta"):
        m = Net(d=48, h=64 if mode != "mismatch" else 96, n=4).eval()
    plan = {{}}
    for i in range(4):
        plan[f"blocks.{{i}}.up"] = ColwiseParallel()
        plan[f"blocks.{{i}}.down"] = RowwiseParallel()
    parallelize_module(m, mesh, plan)
    local = sum(p._local_tensor.numel() * p.element_size()
                if hasattr(p, "_local_tensor") else
                p.numel() * p.element_size()
                for p in m.state_dict().values())
    out = {{"rank": rank}}
    try:
        rep = laden.stream_load(m, path, offload_prefixes=["blocks."],
                                device=dev, shared=mode == "shared")
    except laden.MismatchError as e:
        out["error"] = str(e)
    else:
        h = laden.install_offload(m)
        x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y = m(x.to(dev)).cpu()
            want = ref(x)
        # LoRA on a ColwiseParallel weight (rows split: B's rows) and a
        # RowwiseParallel one (columns split: A's columns); every rank
        # merges its slice, and the outputs equal the whole model's with
        # the whole update merged.
        g = torch.Generator().manual_seed(2)
        sd = {{"blocks.0.up.lora_A.weight": torch.randn(2, 48, generator=g),
               "blocks.0.up.lora_B.weight": torch.randn(64, 2, generator=g),
               "blocks.1.down.lora_A.weight": torch.randn(3, 64, generator=g),
               "blocks.1.down.lora_B.weight": torch.randn(48, 3, generator=g),
               "blocks.2.up.delta.weight": torch.randn(64, 48, generator=g)}}
        spec = laden.AdapterSpec("l", lambda: dict(sd))
        import copy
        ref2 = copy.deepcopy(ref)
        with torch.no_grad():
            ref2.blocks[0].up.weight += sd["blocks.0.up.lora_B.weight"] @ \
                sd["blocks.0.up.lora_A.weight"] * 0.5
            ref2.blocks[1].down.weight += \
                sd["blocks.1.down.lora_B.weight"] @ \
                sd["blocks.1.down.lora_A.weight"] * 0.5
            ref2.blocks[2].up.weight += sd["blocks.2.up.delta.weight"] * 0.5
            want2 = ref2(x)
        try:
            h.set_adapters([spec], [0.5])
        except laden.LadenError as e:
            out["adapters"] = str(e)
        else:
            with torch.no_grad():
                out["adapter_diff"] = (m(x.to(dev)).cpu() - want2).abs() \
                    .max().item()
            try:
                h.set_adapters([spec], [0.5], mode="routed")
            except laden.LadenError as e:
                out["routed"] = str(e)
            h.set_adapters([])  # the exact weights back
            with torch.no_grad():
                out["restored"] = torch.equal(m(x.to(dev)).cpu(), y)
        w = m.blocks[1].down.weight
        out.update(read=rep.read_bytes, local=local,
                   diff=(y - want).abs().max().item(),
                   kind=type(w).__name__, placements=str(w.placements),
                   local_shape=list(w.to_local().shape),
                   ram=rep.tier_bytes["ram"],
                   enters=h.stats()["enters"],
                   shared=rep.shared.how if rep.shared else None)
        laden.release(m)
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


def run_ranks(tmp_path, path, mode, world=2):
    script = tmp_path / "tp_child.py"
    script.write_text(CHILD.format(here=HERE))
    init = tmp_path / f"pg-{mode}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [HERE] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    procs = [subprocess.Popen([sys.executable, str(script), str(r),
                               str(world), str(init), path, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(world)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, e[-3000:]
        line = [ln for ln in o.splitlines() if ln.startswith("RESULT ")][-1]
        outs.append(json.loads(line[7:]))
    return outs


@pytest.fixture
def checkpoint(tmp_path):
    sys.path.insert(0, HERE)
    from test_shared import Net
    torch.manual_seed(0)
    ref = Net(d=48, h=64, n=4).eval()
    path = str(tmp_path / "tp.safetensors")
    laden.save_file(ref.state_dict(), path)
    return path, sum(t.numel() * t.element_size()
                     for t in ref.state_dict().values())


def test_each_rank_reads_and_streams_its_shard(tmp_path, checkpoint):
    path, whole = checkpoint
    outs = run_ranks(tmp_path, path, "plain")
    shapes = []
    for o in outs:
        assert o["diff"] < 1e-5, o
        assert o["kind"] == "DTensor" and "Shard(dim=1)" in o["placements"]
        assert o["ram"] > 0  # the blocks: laden's RAM tier (on the CPU
        # it runs in place; on a GPU it streams)
        # Only the shard was read: this rank's bytes, not the tensors'.
        assert o["read"] == o["local"] < whole
        # each rank merged its slice of the LoRA and delta updates
        assert "adapters" not in o, o.get("adapters")
        assert o["adapter_diff"] < 1e-4, o
        assert "mode='merge'" in o["routed"]  # refused, never wrong
        assert o["restored"]
        shapes.append(o["local_shape"])
    # 64 columns over 2 ranks.
    assert [s[1] for s in shapes] == [32, 32]


def test_four_ranks(tmp_path, checkpoint):
    """Four ranks: a quarter of each sharded weight each, outputs and the
    merged adapters' outputs equal to the whole model's."""
    path, whole = checkpoint
    outs = run_ranks(tmp_path, path, "plain", world=4)
    for o in outs:
        assert o["diff"] < 1e-5 and o["adapter_diff"] < 1e-4, o
        assert o["read"] == o["local"] < whole
    assert [o["local_shape"][1] for o in outs] == [16] * 4


def test_shards_share_nothing_but_load_shared(tmp_path, checkpoint,
                                             monkeypatch):
    """shared=True with shards: each rank's layout differs, so each has a
    copy of its own (its shard), made by itself."""
    import tempfile
    d = tempfile.mkdtemp(prefix="laden-test-",
                         dir="/dev/shm" if os.path.isdir("/dev/shm")
                         else None)
    monkeypatch.setenv("LADEN_SHM_DIR", d)
    path, _ = checkpoint
    outs = run_ranks(tmp_path, path, "shared")
    for o in outs:
        assert o["diff"] < 1e-5 and o["shared"] == "made"
    assert os.listdir(d) == []
    os.rmdir(d)


def test_global_shape_mismatch_is_refused(tmp_path, checkpoint):
    path, _ = checkpoint
    outs = run_ranks(tmp_path, path, "mismatch")
    for o in outs:
        assert "shapes differ" in o["error"]
        assert "[64, 48]" in o["error"] and "[96, 48]" in o["error"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_stream_their_shards(tmp_path, checkpoint):
    path, whole = checkpoint
    outs = run_ranks(tmp_path, path, "cuda")
    for o in outs:
        assert o["diff"] < 1e-4, o
        assert o["read"] == o["local"] < whole
        assert o["enters"] > 0  # streamed from pinned RAM on each GPU


def test_placements_laden_cannot_read_are_refused():
    """A Partial (or _StridedShard) placement: the checkpoint's whole
    tensor is not what the rank holds; refused by name before anything is
    read."""
    from laden._describe import _dist_of

    class Partial:
        def is_shard(self):
            return False

        def is_replicate(self):
            return False

    class V:
        placements = (Partial(),)
        shape = (4, 4)

    with pytest.raises(laden.InvalidArgumentError, match="Partial"):
        _dist_of(V(), "w")
