#!/usr/bin/env python3
"""Writes tests/data/bad/: one small file per malformed-header defect, and
EXPECTED, which names the status each must produce.  The files are committed;
rerun this after adding a case.  Each case is (name, status, file bytes)."""
import json
import os
import struct
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad")


def st(header, data=b""):
    """A file whose header is the given text (str or bytes) verbatim."""
    if isinstance(header, str):
        header = header.encode()
    return struct.pack("<Q", len(header)) + header + data


def js(obj, data=b""):
    return st(json.dumps(obj), data)


def tensor(dtype="F32", shape=(1,), off=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(off)}


CASES = [
    ("too_short", "E_HEADER", b"\x01\x02\x03"),
    ("header_len_zero", "E_HEADER", struct.pack("<Q", 0) + b"{}"),
    ("header_len_past_end", "E_HEADER", struct.pack("<Q", 1000) + b"{}"),
    ("header_len_huge", "E_LIMIT", struct.pack("<Q", 1 << 63) + b"{}"),
    ("not_an_object", "E_JSON", st("[1, 2]")),
    ("bad_json_syntax", "E_JSON", st('{"a": {"dtype": "F32",}}')),
    ("truncated_json", "E_JSON", st('{"a": {"dtype": "F3')),
    ("trailing_garbage", "E_JSON", st("{} xyz")),
    ("unknown_dtype", "E_DTYPE", js({"a": tensor(dtype="F128")}, b"\0" * 4)),
    ("dtype_not_string", "E_SCHEMA",
     st('{"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4)),
    ("missing_shape", "E_SCHEMA",
     js({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4)),
    ("missing_offsets", "E_SCHEMA",
     js({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)),
    ("shape_negative", "E_SCHEMA", js({"a": tensor(shape=(-1,))}, b"\0" * 4)),
    ("shape_fraction", "E_SCHEMA",
     st('{"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("offsets_three", "E_SCHEMA",
     js({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}},
        b"\0" * 4)),
    ("offsets_one", "E_SCHEMA",
     js({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"\0" * 4)),
    ("shape_mismatch", "E_SHAPE", js({"a": tensor(shape=(2,))}, b"\0" * 4)),
    ("shape_overflow", "E_SHAPE",
     js({"a": tensor(shape=(1 << 32, 1 << 32, 16))}, b"\0" * 4)),
    ("subbyte_partial", "E_SHAPE",
     js({"a": tensor(dtype="F4", shape=(3,), off=(0, 2))}, b"\0" * 2)),
    ("offsets_reversed", "E_RANGE",
     js({"a": tensor(off=(8, 4))}, b"\0" * 8)),
    ("gap", "E_RANGE",
     js({"a": tensor(off=(0, 4)), "b": tensor(off=(8, 12))}, b"\0" * 12)),
    ("overlap", "E_RANGE",
     js({"a": tensor(shape=(2,), off=(0, 8)),
         "b": tensor(shape=(2,), off=(4, 12))}, b"\0" * 12)),
    ("uncovered_tail", "E_RANGE", js({"a": tensor()}, b"\0" * 8)),
    ("beyond_file", "E_TRUNCATED",
     js({"a": tensor(shape=(100,), off=(0, 400))}, b"\0" * 4)),
    ("duplicate_name", "E_NAME",
     st('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
        ' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
        b"\0" * 8)),
    ("name_with_nul", "E_NAME",
     st('{"a\\u0000b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("name_invalid_utf8", "E_JSON",
     st(b'{"a\xff": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("name_overlong_utf8", "E_JSON",
     st(b'{"\xc0\xaf": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("lone_surrogate", "E_JSON",
     st('{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("metadata_not_string", "E_SCHEMA", js({"__metadata__": {"k": 1}})),
    ("metadata_not_object", "E_SCHEMA", js({"__metadata__": ["k"]})),
    ("metadata_twice", "E_SCHEMA",
     st('{"__metadata__": {}, "__metadata__": {}}')),
    ("deep_nesting", "E_LIMIT",
     st('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": '
        + "[" * 100 + "]" * 100 + "}}", b"\0" * 4)),
    ("rank_too_high", "E_LIMIT", js({"a": tensor(shape=(1,) * 65)}, b"\0" * 4)),
    ("integer_overflow", "E_LIMIT",
     st('{"a": {"dtype": "F32", "shape": [1], '
        '"data_offsets": [0, 99999999999999999999999]}}', b"\0" * 4)),
    ("tensor_not_object", "E_SCHEMA", st('{"a": 5}')),
    ("duplicate_field", "E_SCHEMA",
     st('{"a": {"dtype": "F32", "dtype": "F16", "shape": [1], '
        '"data_offsets": [0, 4]}}', b"\0" * 4)),
    ("control_char", "E_JSON",
     st(b'{"a\x01": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("bad_escape", "E_JSON",
     st('{"a\\q": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("leading_zero", "E_JSON",
     st('{"a": {"dtype": "F32", "shape": [01], "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    ("empty_entry", "E_SCHEMA", st('{"a": {}}')),
    ("shape_not_array", "E_SCHEMA",
     st('{"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}',
        b"\0" * 4)),
    # Found by clang's UBSan (a zero offset added to a NULL table):
    ("empty_header_with_data", "E_RANGE", st("{}", b"\0\0")),
    ("scalar_size_mismatch", "E_SHAPE",
     st('{"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 8]}}',
        b"\0" * 8)),
]


def main():
    os.makedirs(HERE, exist_ok=True)
    names = set()
    lines = []
    for name, status, data in CASES:
        assert name not in names, name
        names.add(name)
        with open(os.path.join(HERE, name + ".safetensors"), "wb") as f:
            f.write(data)
        lines.append(f"{name}.safetensors {status}\n")
    with open(os.path.join(HERE, "EXPECTED"), "w") as f:
        f.write("# file status: what laden_st_open must return for each file\n")
        f.writelines(lines)
    print(f"wrote {len(CASES)} cases to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
