#!/usr/bin/env python3
"""Writes the seeds of fuzz/corpus/index/: small *.safetensors.index.json
documents, valid and malformed, for the index fuzz target (fuzz_index.c).
The files are committed; rerun after adding a seed.  libFuzzer adds its own
inputs (named by their SHA-1) next to these."""
import json
import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "index")


def index(weight_map, metadata=None, **extra):
    doc = {"metadata": metadata if metadata is not None else {"total_size": 30}}
    doc.update(extra)
    doc["weight_map"] = weight_map
    return json.dumps(doc).encode()


HF = {f"model.layers.{i}.{w}.weight": f"model-0000{1 + i // 2}-of-00003.safetensors"
      for i in range(5) for w in ("q_proj", "k_proj")}
HF["lm_head.weight"] = "model-00003-of-00003.safetensors"

SEEDS = [
    # valid
    ("hf_typical", index(HF, {"total_size": 1234567890})),
    ("hf_pretty", json.dumps({"metadata": {"total_size": 4}, "weight_map": HF},
                             indent=2).encode()),
    ("single", index({"w": "m.safetensors"})),
    ("subdir_shards", index({"a": "sub/dir/s1.safetensors",
                             "b": "sub/s2.safetensors", "c": "./s3.safetensors"})),
    ("unicode_names", index({"h\u00e9": "s.safetensors", "\u65e5": "s.safetensors",
                             "\U0001f600": "t.safetensors"}, )),
    ("escapes", b'{"weight_map": {"a\\"b\\\\c\\/d\\n": "s\\u0031.safetensors",'
                b' "\\ud83d\\ude00": "s1.safetensors"}}'),
    ("raw_utf8", '{"weight_map": {"\u00e9\u65e5": "\u00e9.safetensors"}}'.encode()),
    ("rich_metadata", index({"a": "s"}, {"total_size": 1, "x": [1, -2.5e-3, True,
                            False, None, {"y": [[], {}]}], "s": "str"})),
    ("map_first", b'{"weight_map": {"a": "s1", "b": "s2"}, "metadata": {}}'),
    ("no_metadata", b'{"weight_map":{"a":"s1"}}'),
    ("extra_keys", index({"a": "s"}, {}, format="pt", other={"weight_map": 1})),
    ("interleaved_shards", index({f"t{i}": f"s{(i * 7) % 5}" for i in range(25)})),
    ("twenty_shards", index({f"t{i}": f"shard-{i % 20:05d}.safetensors"
                             for i in range(60)})),
    ("whitespace", b' \t\r\n{ "weight_map" :\n{ "a" : "s" } }\n '),
    ("nesting_64", b'{"m": ' + b"[" * 63 + b"]" * 63 +
     b', "weight_map": {"a": "s"}}'),
    ("big_numbers", b'{"m": [18446744073709551615, 1e999999, -0, 0.0e+0],'
                    b' "weight_map": {"a": "s"}}'),
    # malformed
    ("empty", b""),
    ("empty_object", b"{}"),
    ("array", b"[]"),
    ("null", b"null"),
    ("map_array", b'{"weight_map": [["a", "s"]]}'),
    ("map_string", b'{"weight_map": "s"}'),
    ("map_empty", b'{"weight_map": {}}'),
    ("value_number", b'{"weight_map": {"a": 1}}'),
    ("value_null", b'{"weight_map": {"a": null}}'),
    ("value_object", b'{"weight_map": {"a": {"f": "s"}}}'),
    ("duplicate_name", b'{"weight_map": {"a": "s1", "a": "s2"}}'),
    ("duplicate_map", b'{"weight_map": {"a": "s"}, "weight_map": {"b": "s"}}'),
    ("name_with_nul", b'{"weight_map": {"a\\u0000b": "s"}}'),
    ("shard_with_nul", b'{"weight_map": {"a": "s\\u0000.safetensors"}}'),
    ("shard_traversal", b'{"weight_map": {"a": "../etc/passwd"}}'),
    ("shard_traversal_inner", b'{"weight_map": {"a": "x/../../s"}}'),
    ("shard_absolute", b'{"weight_map": {"a": "/etc/passwd"}}'),
    ("shard_double_slash", b'{"weight_map": {"a": "x//s"}}'),
    ("shard_trailing_slash", b'{"weight_map": {"a": "x/"}}'),
    ("shard_empty", b'{"weight_map": {"a": ""}}'),
    ("key_with_nul", b'{"weight_map\\u0000": {"a": "s"}}'),
    ("trailing_garbage", b'{"weight_map": {"a": "s"}} x'),
    ("trailing_comma", b'{"weight_map": {"a": "s",}}'),
    ("truncated", b'{"weight_map": {"a": "s"'),
    ("unterminated_string", b'{"weight_map": {"a": "s'),
    ("bad_escape", b'{"weight_map": {"a\\q": "s"}}'),
    ("lone_surrogate", b'{"weight_map": {"\\udc00": "s"}}'),
    ("invalid_utf8", b'{"weight_map": {"a\xff": "s"}}'),
    ("overlong_utf8", b'{"weight_map": {"\xc0\xaf": "s"}}'),
    ("control_char", b'{"weight_map": {"a\x01": "s"}}'),
    ("deep_nesting", b'{"m": ' + b"[" * 100 + b"]" * 100 +
     b', "weight_map": {"a": "s"}}'),
    ("leading_zero", b'{"m": 01, "weight_map": {"a": "s"}}'),
    ("bom", b'\xef\xbb\xbf{"weight_map": {"a": "s"}}'),
    ("missing_colon", b'{"weight_map" {"a": "s"}}'),
    ("nul_byte", b'{"weight_map": {"a": "s"}}\x00'),
]


def main():
    os.makedirs(HERE, exist_ok=True)
    names = set()
    for name, data in SEEDS:
        assert name not in names, name
        names.add(name)
        with open(os.path.join(HERE, name + ".json"), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
