import os
import subprocess
import sys

import torch

import laden


def run(*args):
    return subprocess.run([sys.executable, "-m", "laden", *args],
                          capture_output=True, text=True, timeout=300)


def test_sample_then_inspect(tmp_path):
    p = str(tmp_path / "s.safetensors")
    r = run("sample", p, "--size", "4MB", "--hidden", "128")
    assert r.returncode == 0, r.stderr
    r = run("inspect", p)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "blocks.0.attn.qkv.weight" in out and "BF16" in out
    assert "blocks.N (0.." in out  # block groups
    assert "100.0%" in out         # totals by dtype


def test_inspect_groups_layers(tmp_path):
    t = {f"model.layers.{i}.self_attn.q_proj.weight": torch.ones(4, 4)
         for i in range(3)}
    t["model.embed_tokens.weight"] = torch.ones(8, 4)
    p = str(tmp_path / "l.safetensors")
    laden.save_file(t, p)
    r = run("inspect", p)
    assert r.returncode == 0, r.stderr
    assert "model.layers.N (0..2)" in r.stdout


def test_bad_input_is_one_line_and_status_2(tmp_path, data_dir):
    for args in (["inspect", os.path.join(data_dir, "bad", "overlap.safetensors")],
                 ["inspect", str(tmp_path / "absent.safetensors")],
                 ["probe", "--size", "12 parsecs"]):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, r.stderr
        assert "Traceback" not in r.stderr
        assert "error" in lines[0]
    r = run("inspect")
    assert r.returncode == 2


def test_probe_runs(tmp_path):
    r = run("probe", "--dir", str(tmp_path), "--size", "8MiB",
            "--disk-size", "32MiB", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    assert "disk read" in r.stdout and "host memcpy" in r.stdout
    assert "GB/s" in r.stdout
    assert os.listdir(tmp_path) == []  # the probe file is removed


def test_version():
    r = run("--version")
    assert r.returncode == 0 and laden.__version__ in r.stdout


def test_sample_into_missing_directory(tmp_path):
    r = run("sample", str(tmp_path / "nodir" / "s.safetensors"))
    assert r.returncode == 2
    assert "nodir" in r.stderr and "does not exist" in r.stderr
    assert ".tmp" not in r.stderr
