#!/usr/bin/env python3
"""Writes the GGUF fuzz corpus (fuzz/corpus/gguf/) with the gguf package's
own writer and quantizers: tiny files in several ggml types, with scalar,
string and array metadata, and their truncations.

    pip install gguf numpy && python fuzz/make_gguf_corpus.py [DIR]
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else \
    os.path.join(HERE, "corpus", "gguf")


def write(name, types, alignment=None):
    path = os.path.join(OUT, name)
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(len(types))
    w.add_context_length(64)
    w.add_tokenizer_model("llama")
    w.add_token_list(["a", "bc", "<s>"])
    w.add_token_scores([0.0, -1.0, 0.5])
    rng = np.random.default_rng(0)
    for i, t in enumerate(types):
        x = rng.standard_normal((2, 256)).astype(np.float32)
        if t in (Q.F32, Q.F16, Q.BF16):
            data = x.astype(np.float16) if t == Q.F16 else x
            if t == Q.BF16:
                data = gguf.quants.quantize(x, t)
        else:
            try:
                data = gguf.quants.quantize(x, t)
            except NotImplementedError:  # K-quants: valid-sized bytes
                blk, size = gguf.GGML_QUANT_SIZES[t]
                data = rng.integers(0, 256, (2, 256 // blk * size),
                                    dtype=np.uint8)
        w.add_tensor(f"blk.{i}.attn_q.weight", data, raw_dtype=t
                     if t not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    os.makedirs(OUT, exist_ok=True)
    files = [write("f32_f16.gguf", [Q.F32, Q.F16]),
             write("q8_q4.gguf", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]),
             write("k.gguf", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K]),
             write("bf16_align64.gguf", [Q.BF16, Q.Q8_0], alignment=64)]
    for p in files:  # cut inside the header and inside the data
        b = open(p, "rb").read()
        for n in (3, 20, len(b) // 3, len(b) - 1):
            with open(f"{p}.cut{n}", "wb") as f:
                f.write(b[:n])


if __name__ == "__main__":
    main()
