import json
import os
import threading

import pytest
import torch

import laden
from conftest import same


def write(path, tensors, metadata=None):
    laden.save_file(tensors, path, metadata)
    return str(path)


def test_table_matches_what_was_written(tmp_path, make_tensors):
    t = make_tensors()
    p = write(tmp_path / "m.safetensors", t, {"format": "pt", "k": "v"})
    with laden.open(p) as ck:
        assert ck.names() == list(t)
        assert len(ck) == len(t) and "mask" in ck and "nope" not in ck
        assert ck.metadata == {"format": "pt", "k": "v"}
        assert ck.total_bytes == sum(x.numel() * x.element_size()
                                     for x in t.values())
        for name, x in t.items():
            info = ck.info(name)
            assert info.shape == tuple(x.shape)
            assert info.torch_dtype == x.dtype
            assert info.nbytes == x.numel() * x.element_size()
            assert info.file == p


def test_tensor_is_the_callers_and_correct(tmp_path, make_tensors):
    t = make_tensors()
    p = write(tmp_path / "m.safetensors", t)
    ck = laden.open(p)
    views = {n: ck.tensor(n) for n in t}
    for n, x in t.items():
        assert same(views[n], x), n
    a = ck.tensor("embed.weight")
    b = ck.tensor("embed.weight")
    assert a.data_ptr() != b.data_ptr()  # read, not a view of the file
    ck.close()
    # Tensors outlive the checkpoint; writing to them leaves the file alone.
    assert same(views["embed.weight"], t["embed.weight"])
    views["embed.weight"].add_(1.0)
    with laden.open(p) as ck2:
        assert same(ck2.tensor("embed.weight"), t["embed.weight"])


def test_tensor_survives_the_file_being_truncated(tmp_path):
    """A tensor from laden.open(p).tensor(name) is not a view of the file's
    pages, which would raise SIGBUS (killing the process) once the file is
    truncated below them."""
    x = torch.randn(1 << 18)
    p = write(tmp_path / "t.safetensors", {"x": x, "y": torch.randn(8)})
    with laden.open(p) as ck:
        got = ck.tensor("x")
        os.truncate(p, 64)
        assert torch.equal(got, x)  # touched after the truncation
        with pytest.raises(laden.FormatError, match="t.safetensors"):
            ck.tensor("y")


def test_read_into(tmp_path, make_tensors):
    t = make_tensors()
    p = write(tmp_path / "m.safetensors", t)
    with laden.open(p) as ck:
        for n, x in t.items():
            out = torch.full_like(x, 1) if x.numel() else torch.empty_like(x)
            assert ck.read_into(n, out) is out
            assert same(out, x), n
        raw = torch.zeros(ck.info("embed.weight").nbytes, dtype=torch.uint8)
        ck.read_into("embed.weight", raw)
        assert same(raw.view(torch.float32).reshape(7, 5), t["embed.weight"])
        if torch.cuda.is_available():
            pinned = torch.empty(7, 5).pin_memory()
            ck.read_into("embed.weight", pinned)
            assert same(pinned, t["embed.weight"])


def test_read_into_rejects_bad_outputs(tmp_path, make_tensors):
    t = make_tensors()
    p = write(tmp_path / "m.safetensors", t)
    with laden.open(p) as ck:
        bad = [
            (torch.empty(7, 5, dtype=torch.float64), "float64"),
            (torch.empty(5, 7), "(5, 7)"),
            (torch.empty(5, 7).t(), "contiguous"),
            (torch.empty(3, dtype=torch.uint8), "bytes"),
            ("not a tensor", "torch.Tensor"),
        ]
        for out, word in bad:
            with pytest.raises(laden.InvalidArgumentError) as e:
                ck.read_into("embed.weight", out)
            assert word in str(e.value) and "embed.weight" in str(e.value)
        with pytest.raises(laden.TensorNotFoundError) as e:
            ck.read_into("nope", torch.empty(1))
        assert "nope" in str(e.value)
        assert isinstance(e.value, KeyError)


def test_every_corpus_file_raises_a_typed_error(data_dir):
    bad = os.path.join(data_dir, "bad")
    n = 0
    with open(os.path.join(bad, "EXPECTED")) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            name, status = line.split()
            path = os.path.join(bad, name)
            with pytest.raises(laden.FormatError) as e:
                laden.open(path)
            assert e.value.status == status, name
            assert name in str(e.value)
            assert isinstance(e.value, ValueError)
            n += 1
    assert n >= 20


def test_missing_file_and_closed_checkpoint(tmp_path, make_tensors):
    with pytest.raises(laden.CheckpointNotFoundError) as e:
        laden.open(tmp_path / "absent.safetensors")
    assert isinstance(e.value, FileNotFoundError)
    assert "absent.safetensors" in str(e.value)
    p = write(tmp_path / "m.safetensors", make_tensors())
    ck = laden.open(p)
    ck.close()
    ck.close()  # twice is fine
    with pytest.raises(laden.InvalidArgumentError, match="closed"):
        ck.tensor("mask")


def test_sharded_checkpoint(tmp_path, make_tensors):
    t = make_tensors()
    names = list(t)
    half = len(names) // 2
    write(tmp_path / "m-1.safetensors", {n: t[n] for n in names[:half]})
    write(tmp_path / "m-2.safetensors", {n: t[n] for n in names[half:]})
    index = {"metadata": {"total_size": 1},
             "weight_map": {n: "m-1.safetensors" if i < half
                            else "m-2.safetensors"
                            for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in (tmp_path / "model.safetensors.index.json", tmp_path):
        with laden.open(path) as ck:
            assert sorted(ck.names()) == sorted(names)
            assert len(ck.files) == 2
            for n, x in t.items():
                assert same(ck.tensor(n), x)
                out = torch.empty_like(x)
                assert same(ck.read_into(n, out), x)


def test_truncated_while_open_is_an_error_not_garbage(tmp_path):
    x = torch.randn(1 << 20)
    p = write(tmp_path / "big.safetensors", {"a": torch.randn(16), "x": x})
    with laden.open(p) as ck:
        os.truncate(p, 4096)
        with pytest.raises(laden.FormatError) as e:
            ck.read_into("x", torch.empty_like(x))
        assert e.value.status in ("E_TRUNCATED", "E_CHANGED")
        assert "big.safetensors" in str(e.value)
        # Not the file that was opened: its other tensors are refused too.
        with pytest.raises(laden.FormatError, match="changed"):
            ck.read_into("a", torch.empty(16))


def test_concurrent_reads(tmp_path):
    g = torch.Generator().manual_seed(1)
    t = {f"blocks.{i}.w": torch.randn(256, 1024, generator=g)
         for i in range(16)}
    p = write(tmp_path / "m.safetensors", t)
    errors = []
    with laden.open(p) as ck:
        def work(names):
            try:
                for n in names:
                    out = torch.empty_like(t[n])
                    ck.read_into(n, out)
                    assert torch.equal(out, t[n])
            except Exception as exc:  # surfaced below
                errors.append(exc)
        names = list(t)
        threads = [threading.Thread(target=work, args=(names[i::4],))
                   for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors


def test_no_descriptor_or_mapping_leak(tmp_path, make_tensors):
    p = write(tmp_path / "m.safetensors", make_tensors())

    def count_fds():
        return len(os.listdir("/proc/self/fd"))

    def count_maps():
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if "m.safetensors" in line)

    def cycle():
        ck = laden.open(p)
        v = ck.tensor("embed.weight")
        ck.read_into("mask", torch.empty(5, dtype=torch.bool))
        del ck  # forgotten, not closed: the finalizer closes it
        return float(v.sum())

    cycle()
    fds = count_fds()
    for _ in range(200):
        cycle()
    import gc
    gc.collect()
    assert count_fds() <= fds
    assert count_maps() == 0


def test_errors_cover_every_status():
    from laden import _lib
    from laden.errors import BY_STATUS
    code = -1
    while _lib.lib.laden_status_name(code).decode() != "UNKNOWN":
        assert _lib.lib.laden_status_name(code).decode() in BY_STATUS
        code -= 1
    assert code < -20


def test_units():
    from laden._units import fmt_bytes, parse_size
    assert parse_size("9GB") == 9 * 10**9
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123
    for bad in ("9 parsecs", "-1GB", "", True, -5):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert fmt_bytes(9.7e9) == "9.7 GB"


def test_read_into_many(tmp_path, make_tensors):
    t = make_tensors()
    p = write(tmp_path / "m.safetensors", t)
    with laden.open(p) as ck:
        outs = {n: torch.empty_like(x) for n, x in t.items()}
        ck.read_into_many(outs.items())
        for n, x in t.items():
            assert same(outs[n], x), n
        # A bad output anywhere: nothing is read.
        fresh = {n: torch.zeros_like(x) for n, x in t.items()}
        items = list(fresh.items()) + [("embed.weight", torch.empty(1))]
        with pytest.raises(laden.InvalidArgumentError):
            ck.read_into_many(items)
        assert float(fresh["embed.weight"].abs().sum()) == 0.0


def test_read_into_many_progress_and_logging(tmp_path, caplog):
    pytest.importorskip("tqdm")
    x = torch.randn(1000)
    p = write(tmp_path / "m.safetensors", {"x": x})
    import logging
    with caplog.at_level(logging.DEBUG, logger="laden"):
        with laden.open(p) as ck:
            out = torch.empty_like(x)
            ck.read_into_many([("x", out)], progress=True)
            assert torch.equal(out, x)
    assert any("opened" in r.message for r in caplog.records)
    assert any("read 1 tensors" in r.message for r in caplog.records)


def _move_ctime(path, was):
    import time
    for _ in range(400):
        os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
        if os.stat(path).st_ctime_ns != was.st_ctime_ns:
            return
        time.sleep(0.005)
    raise AssertionError("the status change time never moved")


def test_rewritten_with_mtime_put_back_is_an_error(tmp_path):
    """Rewritten in place with the same size and its modification time put
    back: a tensor read again is refused naming the file; after a chmod
    alone the same reads return the same values."""
    g = torch.Generator().manual_seed(3)
    t = {"a": torch.randn(1 << 16, generator=g),
         "b": torch.randn(1 << 16, generator=g)}
    p = write(tmp_path / "m.safetensors", t)
    q = write(tmp_path / "n.safetensors", {k: v + 1 for k, v in t.items()})
    with laden.open(p) as ck:
        assert same(ck.tensor("a"), t["a"])
        was = os.stat(p)
        os.chmod(p, 0o444)
        _move_ctime(p, was)
        assert same(ck.tensor("a"), t["a"])
        assert same(ck.tensor("b"), t["b"])
        was = os.stat(p)
        with open(p, "r+b") as f:
            f.write(open(q, "rb").read())
        _move_ctime(p, was)
        with pytest.raises(laden.FormatError) as e:
            ck.tensor("a")
        assert e.value.status == "E_CHANGED" and "m.safetensors" in str(e.value)
        with pytest.raises(laden.FormatError, match="changed"):
            ck.tensor("b")
