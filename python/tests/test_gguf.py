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


# ---- hostile files (issue 33 item 8) -----------------------------------

def _raw_gguf(path, names=(b"blk.0.w",), kvs=((b"general.architecture",
                                                 b"llama"),)):
    """A GGUF file written byte by byte (names, keys and string values as
    given, not necessarily UTF-8): F32 tensors of one element."""
    import struct

    def s(b):
        return struct.pack("<Q", len(b)) + b

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(names), len(kvs)))
    for k, v in kvs:
        out += s(k) + struct.pack("<I", 8) + s(v)
    for i, n in enumerate(names):
        out += s(n) + struct.pack("<IQIQ", 1, 1, 0, 32 * i)
    out += b"\0" * (-len(out) % 32) + b"\0" * (32 * len(names))
    path.write_bytes(bytes(out))
    return path


@pytest.mark.parametrize("where", ["name", "key", "value"])
def test_strings_not_utf8_are_format_errors(tmp_path, where):
    """A tensor name, metadata key or string value that is not UTF-8: a
    FormatError naming the file and which string (was: a bare
    UnicodeDecodeError from GgufFile, laden.open, laden inspect)."""
    import laden
    from laden import cli

    bad = b"bl\xc3(k"
    p = _raw_gguf(
        tmp_path / "bad.gguf",
        names=(b"blk.0.w", bad) if where == "name" else (b"blk.0.w",),
        kvs=((b"general.architecture", b"llama"),
             (bad, b"x") if where == "key" else (b"general.name",
             bad if where == "value" else b"x")))
    says = {"name": "tensor 1's name is not valid UTF-8",
            "key": "metadata key 1 is not valid UTF-8",
            "value": "the string of metadata 'general.name' (entry 1) is "
                     "not valid UTF-8"}[where]
    for opener in (laden.gguf.GgufFile, laden.open):
        with pytest.raises(laden.FormatError) as e:
            opener(p)
        assert str(p) in str(e.value) and says in str(e.value)
        assert "byte 2 of it" in str(e.value)
    assert cli.main(["inspect", str(p)]) == 2


def _llama_gguf(path, **over):
    """A GGUF file with the metadata a Llama config is built from, each
    as (value, GGUFValueType) unless over-ridden (None: left out)."""
    import numpy as np

    T = gguf.GGUFValueType
    meta = {"llama.block_count": (2, T.UINT32),
            "llama.attention.head_count": (4, T.UINT32),
            "llama.attention.head_count_kv": (2, T.UINT32),
            "llama.embedding_length": (256, T.UINT32),
            "llama.feed_forward_length": (512, T.UINT32),
            "llama.context_length": (64, T.UINT32),
            "llama.rope.freq_base": (10000.0, T.FLOAT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32),
            "llama.vocab_size": (256, T.UINT32)}
    meta.update({k.replace("__", "."): v for k, v in over.items()})
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in meta.items():
        if v is None:
            continue
        if v[1] == T.ARRAY:
            w.add_array(k, v[0])
        else:
            w.add_key_value(k, v[0], v[1])
    for i in range(2):
        for n in ("attn_q", "attn_k", "ffn_up"):
            w.add_tensor(f"blk.{i}.{n}.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_T = gguf.GGUFValueType
_HOSTILE = {  # key (dots as __) -> value, and what the error says
    "head_count_0": ("llama__attention__head_count", (0, _T.UINT32),
                     "integer from 1"),          # was ZeroDivisionError
    "kv_0": ("llama__attention__head_count_kv", (0, _T.UINT32),
             "integer from 1"),                  # ZeroDivisionError
    "kv_not_dividing": ("llama__attention__head_count_kv", (3, _T.UINT32),
                        "does not divide"),
    "heads_over_width": ("llama__attention__head_count", (512, _T.UINT32),
                         "more heads than"),
    "heads_text": ("llama__attention__head_count", ("4", _T.STRING),
                   "integer from 1"),            # TypeError
    "heads_float": ("llama__attention__head_count", (4.0, _T.FLOAT32),
                    "integer from 1"),
    "heads_bool": ("llama__attention__head_count", (True, _T.BOOL),
                   "integer from 1"),
    "heads_array": ("llama__attention__head_count", ([4, 4], _T.ARRAY),
                    "integer from 1"),
    "width_0": ("llama__embedding_length", (0, _T.UINT32),
                "integer from 1"),               # ZeroDivisionError
    "ffn_negative": ("llama__feed_forward_length", (-5, _T.INT32),
                     "integer from 1"),          # RuntimeError
    "rope_dim_0": ("llama__rope__dimension_count", (0, _T.UINT32),
                   "integer from 1"),            # ZeroDivisionError
    "blocks_billion": ("llama__block_count", (10 ** 9, _T.UINT32),
                       "integer from 1 to 6"),   # a billion layers
    "base_text": ("llama__rope__freq_base", ("a", _T.STRING),
                  "finite float above 0"),       # TypeError
    "base_nan": ("llama__rope__freq_base", (float("nan"), _T.FLOAT32),
                 "finite float above 0"),
    "eps_negative": ("llama__attention__layer_norm_rms_epsilon",
                     (-1.0, _T.FLOAT64), "finite float above 0"),
    "arch_empty": ("general__architecture", ("", _T.STRING),
                   "the architecture's name"),
    "name_number": ("general__name", (5, _T.UINT32), "a name is a string"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_hostile_config_metadata_named(tmp_path, case):
    """Metadata a config is built from, of the wrong type or out of range:
    FormatError naming the key and the file, from check_config (and so
    from from_pretrained, before transformers builds anything)."""
    import laden

    key, value, says = _HOSTILE[case]
    p = _llama_gguf(tmp_path / f"{case}.gguf", **{key: value})
    with pytest.raises(laden.FormatError) as e:
        laden.gguf.check_config(p)
    assert f"'{key.replace('__', '.')}'" in str(e.value)
    assert str(p) in str(e.value) and says in str(e.value)


def test_check_config_takes_a_good_file(tmp_path):
    import laden

    p = _llama_gguf(tmp_path / "ok.gguf", llama__rope__dimension_count=(
        64, gguf.GGUFValueType.UINT32))
    g = laden.gguf.check_config(p)
    assert g.metadata["llama.attention.head_count"] == 4
    # Absent fields are transformers' defaults, not errors.
    laden.gguf.check_config(_llama_gguf(tmp_path / "few.gguf",
                                        llama__vocab_size=None,
                                        llama__rope__freq_base=None))


def test_from_pretrained_refuses_hostile_metadata(tmp_path):
    """from_pretrained on a .gguf whose head count is 0 (transformers:
    ZeroDivisionError) or whose block count is a billion: FormatError
    naming the key and the file."""
    transformers = pytest.importorskip("transformers")
    import laden

    for key, value, _ in (_HOSTILE["head_count_0"],
                          _HOSTILE["blocks_billion"]):
        p = _llama_gguf(tmp_path / "m.gguf", **{key: value})
        with pytest.raises(laden.FormatError) as e:
            laden.from_pretrained(transformers.LlamaForCausalLM, p,
                                  device="cpu")
        assert key.replace("__", ".") in str(e.value)
        assert "m.gguf" in str(e.value)


@pytest.mark.parametrize("v", ["0", "-4", "4.5", "nan", "inf", "1e3", "",
                               "true", "array[u32] x 2", "²", 0, True, 2.0,
                               None])
def test_rope_heads_checks_the_head_count(v):
    """rope_heads (stream_load of a Llama GGUF file) on head counts that
    are not integers from 1 up: FormatError naming the key and the file
    (was TypeError, OverflowError for inf, or 2.0 taken as 2)."""
    import laden

    md = {"general.architecture": "llama"}
    if v is not None:
        md["llama.attention.head_count"] = v
    with pytest.raises(laden.FormatError) as e:
        laden.gguf.rope_heads(md, "/x/m.gguf")
    assert "llama.attention.head_count" in str(e.value)
    assert "/x/m.gguf" in str(e.value)
    md = {"general.architecture": "llama",
          "llama.attention.head_count": "4",
          "llama.attention.head_count_kv": "3"}
    with pytest.raises(laden.FormatError, match="does not divide"):
        laden.gguf.rope_heads(md, "/x/m.gguf")
    md["llama.attention.head_count_kv"] = "2"
    assert laden.gguf.rope_heads(md) == {"attn_q": 4, "attn_k": 2}
