#!/usr/bin/env python3
"""Writes the seeds of fuzz/corpus/lossless/ for fuzz_lossless.c: blobs
laden_lossless_encode made (BF16 and F16, empty to a few sub-chunks, one
value to every pattern), some with a byte changed, and inputs whose first
byte is odd (their values are also encoded and decoded).  The encoder is
the library's, through ctypes: pass the path of a built libladen.so
(default build/libladen.so).  The files are committed; rerun after
changing the format or adding a seed."""
import ctypes
import os
import random
import struct
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                    "lossless")
BF16, F16 = 5, 4  # laden_dtype


def dtype_code(lib, name):
    for code in range(64):
        s = lib.laden_dtype_name(code)
        if s is not None and s.decode() == name:
            return code
    raise SystemExit(f"no dtype {name}")


def encode(lib, dt, values):
    n = len(values)
    bound = ctypes.c_uint64()
    assert lib.laden_lossless_bound(dt, ctypes.c_uint64(n),
                                    ctypes.byref(bound)) == 0
    src = struct.pack(f"<{n}H", *values)
    dst = ctypes.create_string_buffer(max(bound.value, 1))
    got = ctypes.c_uint64()
    assert lib.laden_lossless_encode(dt, src, ctypes.c_uint64(n), dst, bound,
                                     ctypes.byref(got)) == 0
    return dst.raw[:got.value]


def weights(rng, n, bf):
    out = []
    for _ in range(n):
        e = 0
        while rng.random() < 0.5 and e < 20:
            e += 1
        m = rng.getrandbits(16)
        s = rng.getrandbits(1)
        out.append(s << 15 | (121 - e) << 7 | (m & 0x7f) if bf else
                   s << 15 | (13 - e % 13) << 10 | (m & 0x3ff))
    return out


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "build/libladen.so"
    lib = ctypes.CDLL(path)
    lib.laden_dtype_name.restype = ctypes.c_char_p
    bf, f16 = dtype_code(lib, "BF16"), dtype_code(lib, "F16")
    rng = random.Random(7)
    os.makedirs(HERE, exist_ok=True)
    seeds = {}
    for dt, name in ((bf, "bf16"), (f16, "f16")):
        for n in (0, 1, 100, 1500):
            seeds[f"{name}_weights_{n}"] = encode(
                lib, dt, weights(rng, n, dt == bf))
        seeds[f"{name}_one_value"] = encode(lib, dt, [0x3f80] * 300)
        seeds[f"{name}_random"] = encode(
            lib, dt, [rng.getrandbits(16) for _ in range(700)])
    good = seeds["bf16_weights_1500"]
    for at in (4, 6, 20, 40, 300, len(good) // 2, len(good) - 20):
        b = bytearray(good)
        b[at] ^= 0x10
        seeds[f"bf16_changed_at_{at}"] = bytes(b)
    seeds["bf16_cut"] = good[:-9]
    for k in range(4):  # values to encode: odd first byte
        seeds[f"values_{k}"] = bytes([1 | (k & 1) << 1]) + bytes(
            rng.getrandbits(8) for _ in range(1 + 97 * k))
    for name, data in seeds.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
    print(f"{len(seeds)} seeds in {HERE}")


if __name__ == "__main__":
    main()
