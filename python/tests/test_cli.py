import os
import re
import subprocess
import sys

import pytest
import torch

import laden


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "laden", *args],
                          capture_output=True, text=True, timeout=300,
                          env=env)


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
    # Both ways measured, and the one cold reads will take named.
    assert "disk read, O_DIRECT" in r.stdout
    assert "disk read, buffered" in r.stdout
    assert "cold reads here use" in r.stdout
    assert os.listdir(tmp_path) == []  # the probe file is removed


def test_probe_names_an_override(tmp_path):
    env = dict(os.environ, LADEN_IO_DIRECT="off")
    r = run("probe", "--dir", str(tmp_path), "--size", "8MiB",
            "--disk-size", "32MiB", "--repeats", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert "LADEN_IO_DIRECT=off is set" in r.stdout


def test_version():
    r = run("--version")
    assert r.returncode == 0 and laden.__version__ in r.stdout


def test_sample_into_missing_directory(tmp_path):
    r = run("sample", str(tmp_path / "nodir" / "s.safetensors"))
    assert r.returncode == 2
    assert "nodir" in r.stderr and "does not exist" in r.stderr
    assert ".tmp" not in r.stderr


# ---- every bad argument: one line on stderr, status 2 ------------------------

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A small checkpoint, a directory, a FIFO, a BERT directory whose
    config.json is a FIFO, and names that do not exist."""
    d = tmp_path_factory.mktemp("bad_args")
    ck = d / "ck.safetensors"
    t = {f"blocks.{i}.w": torch.ones(64, 64) for i in range(4)}
    t["embed.weight"] = torch.ones(8, 64)
    laden.save_file(t, ck)
    (d / "empty").mkdir()
    os.mkfifo(d / "fifo")
    (d / "bert").mkdir()
    os.mkfifo(d / "bert" / "config.json")
    return {"ck": str(ck), "dir": str(d / "empty"), "fifo": str(d / "fifo"),
            "bert_fifo": str(d / "bert"), "absent": str(d / "absent"),
            "nodir": str(d / "nodir" / "x")}


# (arguments, a text the error line must contain: what it names).  {ck},
# {dir}, {fifo}, ... are the paths of the fixture above.
BAD = [
    ([], "give a command"),
    (["bogus"], "bogus"),
    (["--bogus"], "--bogus"),
    # inspect
    (["inspect"], "path"),
    (["inspect", "{absent}"], "{absent}"),
    (["inspect", "{dir}"], "{dir}"),
    (["inspect", "{fifo}"], "{fifo}"),
    (["inspect", "{ck}", "--limit", "-1"], "--limit -1"),
    (["inspect", "{ck}", "--limit", "x"], "--limit"),
    # probe: checked before anything is measured
    (["probe", "--size", "0"], "--size 0"),
    (["probe", "--size", "abc"], "--size 'abc'"),
    (["probe", "--size", "-1"], "--size -1"),
    (["probe", "--size", "12 parsecs"], "--size"),
    (["probe", "--size", "1000TB"], "--size"),
    (["probe", "--disk-size", "0"], "--disk-size 0"),
    (["probe", "--disk-size", "1MiB"], "--disk-size 1MiB"),
    (["probe", "--disk-size", "1000TB"], "--disk-size"),
    (["probe", "--repeats", "0"], "--repeats 0"),
    (["probe", "--repeats", "-3"], "--repeats -3"),
    (["probe", "--repeats", "many"], "--repeats"),
    (["probe", "--device", "-1"], "--device -1"),
    (["probe", "--device", "99"], "--device 99"),
    (["probe", "--device", "cuda"], "--device"),
    (["probe", "--dir", "{absent}"], "--dir {absent}"),
    (["probe", "--dir", "{ck}"], "--dir {ck}"),
    (["probe", "--dir", "{fifo}"], "--dir {fifo}"),
    # plan
    (["plan"], "path"),
    (["plan", "{absent}"], "{absent}"),
    (["plan", "{dir}"], "{dir}"),
    (["plan", "{fifo}"], "{fifo}"),
    (["plan", "{ck}", "--vram", "abc"], "--vram 'abc'"),
    (["plan", "{ck}", "--vram", "0"], "--vram 0"),
    (["plan", "{ck}", "--vram", "-1"], "--vram -1"),
    (["plan", "{ck}", "--ram", "0"], "--ram 0"),
    (["plan", "{ck}", "--ram", "lots"], "--ram 'lots'"),
    (["plan", "{ck}", "--headroom", "-1"], "--headroom -1"),
    (["plan", "{ck}", "--headroom", "abc"], "--headroom 'abc'"),
    (["plan", "{ck}", "--lookahead", "-1"], "--lookahead -1"),
    (["plan", "{ck}", "--lookahead", "0"], "--lookahead 0"),
    (["plan", "{ck}", "--lookahead", "64"], "--lookahead 64"),
    (["plan", "{ck}", "--resident-blocks", "-1"], "--resident-blocks -1"),
    (["plan", "{ck}", "--resident-blocks", "two"], "--resident-blocks"),
    (["plan", "{ck}", "--device", "foo"], "--device foo"),
    (["plan", "{ck}", "--device", "mps"], "--device mps"),
    (["plan", "{ck}", "--device", "cuda:99"], "--device cuda:99"),
    (["plan", "{ck}", "--device", "cpu", "--vram", "8GB"], "--vram"),
    (["plan", "{ck}", "--device", "cpu", "--headroom", "1GB"], "--headroom"),
    (["plan", "{ck}", "--device", "cpu", "--resident-blocks", "2"],
     "--resident-blocks 2"),
    (["plan", "{ck}", "--json", "{dir}"], "--json {dir}"),
    (["plan", "{ck}", "--json", "{fifo}"], "--json {fifo}"),
    (["plan", "{ck}", "--json", "{nodir}"], "--json {nodir}"),
    # demo: none of these gets to load a model
    (["demo", "--device", "foo"], "--device foo"),
    (["demo", "--device", "mps"], "--device mps"),
    (["demo", "--device", "cuda:99"], "--device cuda:99"),
    (["demo", "--repeats", "0"], "--repeats 0"),
    (["demo", "--repeats", "-1"], "--repeats -1"),
    (["demo", "--budget", "0"], "--budget 0"),
    (["demo", "--budget", "abc"], "--budget 'abc'"),
    (["demo", "{absent}"], "{absent}"),
    (["demo", "{ck}"], "{ck}"),
    (["demo", "{fifo}"], "{fifo}"),
    (["demo", "{bert_fifo}", "--device", "cpu"], "config.json"),
    # sample
    (["sample"], "path"),
    (["sample", "{dir}"], "{dir}"),
    (["sample", "{fifo}"], "{fifo}"),
    (["sample", "{nodir}"], "does not exist"),
    (["sample", "{absent}", "--size", "0"], "--size 0"),
    (["sample", "{absent}", "--size", "abc"], "--size 'abc'"),
    (["sample", "{absent}", "--hidden", "0"], "--hidden 0"),
    (["sample", "{absent}", "--hidden", "-5"], "--hidden -5"),
    (["sample", "{absent}", "--size", "1MB", "--hidden", "4096"], "--size"),
]
# Without CUDA (skipped where it is present): CUDA asked for, and options
# about VRAM given to a plan that is for the CPU.
NO_CUDA = [
    (["plan", "{ck}", "--device", "cuda"], "--device cuda: no CUDA device"),
    (["plan", "{ck}", "--device", "cuda:0"], "--device cuda:0"),
    (["plan", "{ck}", "--vram", "8GB"], "--vram"),
    (["plan", "{ck}", "--resident-blocks", "1"], "--resident-blocks 1"),
    (["demo", "--device", "cuda"], "--device cuda: no CUDA device"),
    (["demo", "--device", "cuda:1"], "--device cuda:1"),
    (["probe", "--device", "0"], "--device 0: no CUDA device"),
]


def _one_bad(args, names, paths):
    args = [a.format(**paths) for a in args]
    names = names.format(**paths)
    r = run_quick(*args)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, (args, r.stderr)
    assert lines[0].startswith("laden") and ": error: " in lines[0], lines
    assert names in lines[0], (names, lines[0])
    assert not re.search(r"\bladen_[a-z_]+:", lines[0]), lines[0]  # no C name
    assert not os.path.exists(paths["absent"])  # nothing was written


def run_quick(*args):
    # 120 s: a FIFO read or written by mistake would hang, then fail here
    return subprocess.run([sys.executable, "-m", "laden", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,names", BAD,
                         ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_argument(args, names, paths):
    _one_bad(args, names, paths)


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("args,names", NO_CUDA,
                         ids=[" ".join(a) for a, _ in NO_CUDA])
def test_bad_argument_without_cuda(args, names, paths):
    _one_bad(args, names, paths)


def _plan_says_cpu(out):
    assert "laden plan for" in out and " on cpu" in out
    for word in ("GPU", "VRAM", "host-to-device 0.00", "0.00 GB/s"):
        assert word not in out, (word, out)
    assert "blocks.3." in out
    assert "always in host memory" in out


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_plan_without_cuda_plans_for_the_cpu(paths, tmp_path):
    out = tmp_path / "p.json"
    r = run_quick("plan", paths["ck"], "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    first = r.stdout.splitlines()[0]
    assert first.startswith("device: cpu (no CUDA device: "), first
    _plan_says_cpu(r.stdout)
    p = laden.Plan.from_json(out.read_text())
    assert p.device == "cpu"
    assert not any(k.startswith("vram") for k in p.readings), p.readings
    assert "h2d" not in p.bandwidths and "vram_avail" not in p.budgets


def test_plan_on_the_cpu_when_asked(paths):
    r = run_quick("plan", paths["ck"], "--device", "cpu", "--ram", "1MB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == \
        "device: cpu (asked for with --device)"
    _plan_says_cpu(r.stdout)


def test_plan_on_the_cpu_with_a_tiny_ram_budget_streams_from_disk(paths):
    """--ram bounds the RAM tier, on the CPU as on CUDA: with 1 kB no block
    fits, so every block is read from disk (the rest and the slots are
    host memory outside that budget)."""
    r = run_quick("plan", paths["ck"], "--device", "cpu", "--ram", "1kB")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if "blocks." in line]
    assert rows and all("disk: no RAM left" in line for line in rows), \
        r.stdout
    assert "the RAM budget given" in r.stdout


def test_no_command_is_one_line():
    r = run_quick()
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    r = run_quick("plan", "-h")  # help still works, on stdout
    assert r.returncode == 0 and "--lookahead" in r.stdout


@pytest.mark.parametrize("exc", [RecursionError("maximum recursion depth"),
                                 OverflowError("int too large"),
                                 MemoryError()])
def test_python_errors_from_input_are_one_line(monkeypatch, capsys, exc):
    """What hostile input makes Python itself raise (nesting, huge
    numbers, sizes) is one line and status 2, as laden's errors are."""
    from laden import cli

    def boom(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    assert cli.main(["inspect", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laden inspect: error: ") and \
        len(err.strip().splitlines()) == 1, err


def test_package_says_it_is_typed():
    """py.typed (PEP 561) is in the package folder, which the wheel ships
    whole (pyproject.toml's wheel.packages), and git does not ignore it."""
    import laden

    here = os.path.dirname(laden.__file__)
    assert os.path.isfile(os.path.join(here, "py.typed"))
    root = os.path.dirname(os.path.dirname(here))
    if os.path.isdir(os.path.join(root, ".git")) or \
            os.path.isfile(os.path.join(root, ".git")):
        r = subprocess.run(["git", "-C", root, "check-ignore", "-q",
                            os.path.join(here, "py.typed")])
        assert r.returncode == 1  # not ignored
