"""laden's GGUF reader (C) against the gguf package's own reader, on files
the gguf package writes in several ggml types: the same tensors, types,
shapes, offsets and metadata keys."""

import ctypes
import os
import subprocess
import sys

import pytest

from laden import _lib
from laden._lib import check, lib

gguf = pytest.importorskip("gguf")


def read(path):
    h = ctypes.c_void_p()
    check(lib.laden_gguf_open(path.encode(), ctypes.byref(h)))
    try:
        t = _lib.GgufTensor()
        tensors = {}
        for i in range(lib.laden_gguf_count(h)):
            check(lib.laden_gguf_tensor_at(h, i, ctypes.byref(t)))
            tensors[t.name.decode()] = (
                lib.laden_gguf_type_name(t.type).decode(),
                tuple(t.dims[d] for d in range(t.ndim)), t.offset_bytes,
                t.size_bytes)
        kv = _lib.GgufKv()
        keys = set()
        for i in range(lib.laden_gguf_metadata_count(h)):
            check(lib.laden_gguf_metadata_at(h, i, ctypes.byref(kv)))
            keys.add(kv.key.decode())
        return tensors, keys, lib.laden_gguf_alignment(h)
    finally:
        lib.laden_gguf_close(h)


def test_same_table_as_the_gguf_package(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "fuzz",
                          "make_gguf_corpus.py")
    out = tmp_path / "corpus"
    subprocess.run([sys.executable, script, str(out)], check=True)
    files = sorted(p for p in os.listdir(out) if p.endswith(".gguf"))
    assert len(files) == 4
    for name in files:
        path = str(out / name)
        tensors, keys, align = read(path)
        r = gguf.GGUFReader(path)
        assert keys == {f.name for f in r.fields.values()
                        if not f.name.startswith("GGUF.")}
        assert align == r.alignment
        assert len(tensors) == len(r.tensors)
        for t in r.tensors:
            typ, dims, off, size = tensors[t.name]
            assert typ == t.tensor_type.name
            assert dims == tuple(int(d) for d in t.shape)
            assert off == t.data_offset
            assert size == t.n_bytes
        end = max(off + size for _, _, off, size in tensors.values())
        for cut in os.listdir(out):  # cut before a tensor ends: refused
            if cut.startswith(name + ".cut") and \
                    int(cut.rsplit("cut", 1)[1]) < end:
                h = ctypes.c_void_p()
                assert lib.laden_gguf_open(str(out / cut).encode(),
                                           ctypes.byref(h)) != 0


def test_cli_inspect_gguf(tmp_path, capsys):
    from laden import cli

    out = tmp_path / "c"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "fuzz",
                          "make_gguf_corpus.py")
    subprocess.run([sys.executable, script, str(out)], check=True)
    assert cli.main(["inspect", str(out / "k.gguf")]) == 0
    text = capsys.readouterr().out
    assert "GGUF version 3" in text and "Q4_K" in text and "[2, 256]" in text
    assert cli.main(["inspect", str(out / "k.gguf.cut20")]) == 2
    err = capsys.readouterr().err
    assert "k.gguf.cut20" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1",
                                  "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                                  "Q5_K", "Q6_K"])
def test_dequantize_bit_for_bit_with_the_reference(name):
    """laden's CPU expansion (C) equals gguf.quants.dequantize bit for bit:
    on values the gguf package quantized, and on random bytes (every bit
    pattern of the scales, NaN and infinity included: NaN where it has
    NaN)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGML_QUANT_SIZES, quants

    t = Q[name]
    blk, size = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 256)) * 3).astype(np.float32)
    cases = []
    try:
        cases.append(quants.quantize(x, t))
    except NotImplementedError:  # the package quantizes no K-quants
        pass
    cases.append(rng.integers(0, 256, (8, 256 // blk * size), dtype=np.uint8))
    for q in cases:
        q = np.ascontiguousarray(q)
        if q.dtype != np.uint8:
            q = q.view(np.uint8)
        want = quants.dequantize(q, t).astype(np.float32).reshape(-1)
        got = np.empty(want.size, dtype=np.float32)
        check(lib.laden_gguf_dequantize(
            t.value, q.ctypes.data, q.nbytes, got.ctypes.data, got.size))
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32),
                              want[~nan].view(np.uint32))
    with pytest.raises(Exception):
        check(lib.laden_gguf_dequantize(t.value, q.ctypes.data, q.nbytes - 1,
                                        got.ctypes.data, got.size))


def _tiny_gguf(path, name="blk.0.ffn_up.weight", arch="llama", extra=()):
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    for k, v in extra:
        w.add_key_value(k, v, gguf.GGUFValueType.UINT32
                        if isinstance(v, int) else gguf.GGUFValueType.FLOAT32)
    w.add_tensor(name, np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_names_and_keys_that_are_not_utf8_are_named(tmp_path):
    """A tensor name or a metadata key that is not UTF-8 was a bare
    UnicodeDecodeError in Python; C now refuses the file naming the field,
    its offset and the byte."""
    import laden
    from laden.gguf import GgufFile

    for what, marker in (("name", b"blk.0.ffn_up.weight"),
                         ("key", b"general.architecture")):
        p = str(tmp_path / f"bad-{what}.gguf")
        _tiny_gguf(p)
        data = bytearray(open(p, "rb").read())
        at = data.index(marker)
        data[at + 3] = 0xff  # not a UTF-8 byte anywhere
        open(p, "wb").write(bytes(data))
        for read_it in (laden.open, GgufFile):
            with pytest.raises(laden.FormatError,
                               match="(tensor name|metadata key) at header "
                               "offset .* not valid UTF-8 .*0xff"):
                read_it(p)
        r = subprocess.run([sys.executable, "-m", "laden", "inspect", p],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "not valid UTF-8" in r.stderr and \
            "Traceback" not in r.stderr


@pytest.mark.parametrize("value", [0, -3, float("inf"), float("nan"), 2.5,
                                   1 << 40, "eight", None])
def test_hostile_head_counts_are_named(value):
    """Llama head counts from GGUF metadata: anything but a plausible
    positive count is a FormatError naming the key (inf was an
    OverflowError, 0 a ZeroDivisionError further on)."""
    import laden
    from laden.gguf import rope_heads

    md = {"general.architecture": "llama",
          "llama.attention.head_count": value}
    with pytest.raises(laden.FormatError, match="llama.attention.head_count"):
        rope_heads(md)
    assert rope_heads({"general.architecture": "llama",
                       "llama.attention.head_count": 8}) == \
        {"attn_q": 8, "attn_k": 8}
