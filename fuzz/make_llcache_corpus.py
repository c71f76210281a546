#!/usr/bin/env python3
"""Writes the seeds of fuzz/corpus/llcache/ for fuzz_llcache.c: lossless
cache files that laden_lossless_cache_write made of small checkpoints
(BF16 and F16, a tensor that codes, one kept raw, several in one file),
and copies of them with a byte of the header, the index or a blob
changed.  The writer is the library's, through ctypes: pass the path of a
built libladen.so (default build/libladen.so).  The files are committed;
rerun after changing the format."""
import ctypes
import glob
import json
import os
import random
import shutil
import struct
import sys
import tempfile

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                    "llcache")


def weights(rng, n, f16=False):
    """Weight-like 16-bit values: a few exponents, random mantissas."""
    out = []
    for _ in range(n):
        e = max(1, min(30 if f16 else 254,
                       int(rng.gauss(13 if f16 else 120, 1.5))))
        if f16:
            out.append(rng.getrandbits(1) << 15 | e << 10 |
                       rng.getrandbits(10))
        else:
            out.append(rng.getrandbits(1) << 15 | e << 7 |
                       rng.getrandbits(7))
    return struct.pack(f"<{n}H", *out)


def write_st(path, tensors):
    header, data = {}, b""
    for name, dtype, blob in tensors:
        header[name] = {"dtype": dtype,
                        "shape": [len(blob) // (4 if dtype == "F32" else 2)],
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def main():
    lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1
                      else "build/libladen.so")
    rng = random.Random(37)
    os.makedirs(HERE, exist_ok=True)
    cases = {
        "one_bf16": [("w", "BF16", weights(rng, 5000))],
        "f16_and_raw": [("h", "F16", weights(rng, 3000, True)),
                        ("noise", "BF16", rng.randbytes(2 * 3000))],
        "several": [(f"t{k}", "BF16", weights(rng, 700 + 300 * k))
                    for k in range(4)] + [("f", "F32", rng.randbytes(64))],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, tensors in cases.items():
            src = os.path.join(tmp, name + ".safetensors")
            write_st(src, tensors)
            out = os.path.join(tmp, "cache-" + name)
            s = lib.laden_lossless_cache_write(src.encode(), out.encode(),
                                               None, None, None)
            if s != 0:
                lib.laden_last_error.restype = ctypes.c_char_p
                raise SystemExit(f"{name}: laden_lossless_cache_write {s}: "
                                 f"{lib.laden_last_error().decode()}")
            (made,) = glob.glob(os.path.join(out, "*.ldlc"))
            shutil.copy(made, os.path.join(HERE, name + ".ldlc"))
            b = bytearray(open(made, "rb").read())
            index_off = struct.unpack_from("<Q", b, 16)[0]
            for tag, at in (("head", 13), ("index", index_off + 3),
                            ("blob", 4096 + 1), ("codes", 4096 + 400)):
                if at < len(b):
                    c = bytearray(b)
                    c[at] ^= 0x41
                    with open(os.path.join(HERE, f"{name}.{tag}"), "wb") as f:
                        f.write(c)
            with open(os.path.join(HERE, name + ".cut"), "wb") as f:
                f.write(b[: len(b) // 2])


if __name__ == "__main__":
    main()
