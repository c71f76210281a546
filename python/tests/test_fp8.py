"""fp8 storage: weights quantized by laden stay within stated error bounds;
checkpoints already in fp8 (scales per tensor, per row, per 128 x 128 tile,
or none) give exactly the output of their dequantized form."""

import pytest
import torch

import laden
from laden.streaming import expand_fp8
from models import PREFIXES, on_meta, reference

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"),
                                reason="torch without float8")
BIG = dict(d=256, hidden=(1024, 512, 1024), nested=(1, 1))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ids():
    return torch.randint(0, 97, (2, 9),
                         generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("device", DEVICES)
def test_storage_fp8_within_bounds(tmp_path, device):
    ref = reference(**BIG)
    path = str(tmp_path / "m.safetensors")
    laden.save_file(ref.state_dict(), path)
    with torch.no_grad():
        want = ref(ids())
    m = on_meta(**BIG)
    p = laden.plan(m, path, device=device, storage_dtype="fp8",
                   ram_budget="64MB" if device == "cpu" else None)
    full = laden.plan(on_meta(**BIG), path, device=device,
                      ram_budget="64MB" if device == "cpu" else None)
    # the large 2-D weights take a byte and a scale per row instead of 4
    assert sum(b.bytes for b in p.blocks) < 0.35 * sum(
        b.bytes for b in full.blocks)
    laden.stream_load(m, path, plan=p)
    h = laden.install_offload(m)
    assert m.blocks[0].up.weight.dtype == torch.float32  # expanded for compute
    with torch.no_grad():
        got = m(ids().to(device)).cpu()
        again = m(ids().to(device)).cpu()
    assert torch.equal(got, again)  # deterministic
    err = ((got - want).norm() / want.norm()).item()
    # e4m3 keeps 3 mantissa bits: about 3 % per weight; stated bound 10 %.
    assert 0 < err < 0.10, err
    laden.release(m, h)


def quantize(w, kind):
    """fp8 weights and the scale tensor a checkpoint would carry."""
    if kind == "row":
        s = w.abs().amax(1).clamp(min=1e-12) / 448
        return (w / s[:, None]).to(torch.float8_e4m3fn), s
    if kind == "tensor":
        s = w.abs().max().clamp(min=1e-12) / 448
        return (w / s).to(torch.float8_e4m3fn), s.reshape(())
    if kind == "block":
        r, c = w.shape
        R, C = -(-r // 128), -(-c // 128)
        s = torch.ones(R, C)
        for i in range(R):
            for j in range(C):
                t = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                s[i, j] = t.abs().max().clamp(min=1e-12) / 448
        full = s.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
        return (w / full).to(torch.float8_e4m3fn), s
    return w.clamp(-448, 448).to(torch.float8_e4m3fn), None


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_checkpoint_equals_its_dequantized_form(tmp_path, device):
    ref = reference(**BIG)
    sd = dict(ref.state_dict())
    fp8, deq = {}, dict(sd)
    kinds = ["row", "tensor", "block", None]
    n = 0
    for name, w in sd.items():
        if name.startswith(("blocks.", "stages.")) and w.dim() == 2:
            kind = kinds[n % 4]
            n += 1
            q, s = quantize(w, kind)
            fp8[name] = q
            scale_name = name + ("_scale_inv" if kind == "block" else "_scale")
            if s is not None:
                fp8[scale_name] = s
            out = torch.empty_like(w)
            expand_fp8(out, q, s, kind)  # the dequantized form
            deq[name] = out
        else:
            fp8[name] = w
    assert n >= 8
    p8 = str(tmp_path / "fp8.safetensors")
    pd = str(tmp_path / "deq.safetensors")
    laden.save_file(fp8, p8)
    laden.save_file(deq, pd)
    dq = reference(**BIG)
    dq.load_state_dict({k: v for k, v in deq.items()})
    dq.to(device)
    with torch.no_grad():
        want = dq(ids().to(device))
    for tiers in (dict(), dict(ram_budget=0)):  # RAM, then disk
        m = on_meta(**BIG)
        laden.stream_load(m, p8, offload_prefixes=PREFIXES, device=device,
                          **tiers)
        h = laden.install_offload(m)
        with torch.no_grad():
            got = m(ids().to(device))
        assert torch.equal(got, want), tiers
        laden.release(m, h)


def test_fp8_scale_of_the_wrong_shape(tmp_path):
    ref = reference()
    sd = dict(ref.state_dict())
    sd["blocks.0.up.weight"] = sd["blocks.0.up.weight"].to(torch.float8_e4m3fn)
    sd["blocks.0.up.weight_scale"] = torch.ones(5)
    p = str(tmp_path / "bad.safetensors")
    laden.save_file(sd, p)
    with pytest.raises(laden.MismatchError, match="weight_scale"):
        laden.stream_load(on_meta(), p, offload_prefixes=PREFIXES,
                          device="cpu")
