"""The seam between laden._lib and libladen, checked against C:

- every ctypes mirror of a C struct has the layout the C compiler gave the
  struct: size, field names in order, offsets and sizes.  The mirrors are
  found by introspection, so a new one cannot be left out: it fails here
  until it is named in C_NAMES and described by the library
  (src/api/abi.c);
- every mirror's field types, and every function laden._lib declares
  (which must exist in include/laden*.h), are the headers': return and
  argument types (count, width, signedness, pointers);
- every constant laden._lib exports is the value the library's table gives
  (its headers' macros and enums);
- a library of another ABI version is refused at import."""

import ctypes
import itertools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from laden import _lib

# Python mirror -> C struct tag.
C_NAMES = {
    "StTensor": "laden_st_tensor",
    "DevInfo": "laden_dev_info",
    "IoConfig": "laden_io_config",
    "IoWays": "laden_io_ways",
    "PinnedPoolStats": "laden_pinned_pool_stats",
    "SchedConfig": "laden_sched_config",
    "SchedStats": "laden_sched_stats",
    "VramInfo": "laden_vram_info",
    "VbarInfo": "laden_vbar_info",
    "ElasticStats": "laden_elastic_stats",
    "CacheEvict": "laden_cache_evict",
    "CacheHostEvict": "laden_cache_host_evict",
    "CacheInfo": "laden_cache_info",
    "CacheStats": "laden_cache_stats",
    "CacheActivation": "laden_cache_activation",
    "PlanInput": "laden_plan_input",
    "PlanResult": "laden_plan_result",
    "PlanReadings": "laden_plan_readings",
    "PlanLoadOptions": "laden_plan_load_options",
    "HostStats": "laden_host_stats",
    "GgufTensor": "laden_gguf_tensor",
    "GgufKv": "laden_gguf_kv",
    "TraceResult": "laden_trace_result",
    "ShmEntry": "laden_shm_entry",
    "LosslessInfo": "laden_lossless_info",
    "LosslessCacheStats": "laden_lossless_cache_stats",
    "LosslessCacheEntry": "laden_lossless_cache_entry",
}


def mirrors():
    """The ctypes structures _lib defines (not those it imports)."""
    return {name: obj for name, obj in vars(_lib).items()
            if isinstance(obj, type)
            and issubclass(obj, (ctypes.Structure, ctypes.Union))
            and obj.__module__ == _lib.__name__}


def c_structs():
    names = []
    for i in itertools.count():
        name = _lib.lib.laden_abi_struct_name(i)
        if name is None:
            return names
        names.append(name.decode())


def c_layout(c_name):
    """(size, [(field, offset, size), ...]) as C compiled it."""
    size = ctypes.c_uint64()
    nfields = ctypes.c_uint32()
    _lib.check(_lib.lib.laden_abi_struct(c_name.encode(), ctypes.byref(size),
                                         ctypes.byref(nfields)))
    fields = []
    for i in range(nfields.value):
        name = ctypes.c_char_p()
        off = ctypes.c_uint64()
        fsize = ctypes.c_uint64()
        _lib.check(_lib.lib.laden_abi_field(
            c_name.encode(), i, ctypes.byref(name), ctypes.byref(off),
            ctypes.byref(fsize)))
        fields.append((name.value.decode(), off.value, fsize.value))
    return size.value, fields


def py_layout(cls):
    fields = []
    for f in cls._fields_:
        desc = getattr(cls, f[0])
        fields.append((f[0], desc.offset, desc.size))
    return ctypes.sizeof(cls), fields


def side_by_side(py_name, c_name, py, c):
    rows = [f"{py_name} (Python) vs {c_name} (C):",
            f"  size: {py[0]} vs {c[0]}" + ("" if py[0] == c[0] else "  <--"),
            f"  {'Python field':<28}{'offset':>7}{'size':>6}    "
            f"{'C field':<28}{'offset':>7}{'size':>6}"]
    for p, q in itertools.zip_longest(py[1], c[1]):
        left = f"{p[0]:<28}{p[1]:>7}{p[2]:>6}" if p else " " * 41
        right = f"{q[0]:<28}{q[1]:>7}{q[2]:>6}" if q else " " * 41
        rows.append(f"  {left}    {right}" + ("" if p == q else "  <--"))
    return "\n".join(rows)


def test_every_mirror_is_named_and_described():
    found = set(mirrors())
    assert found - set(C_NAMES) == set(), (
        f"ctypes structures in laden._lib with no C counterpart in C_NAMES: "
        f"{sorted(found - set(C_NAMES))}")
    assert set(C_NAMES) - found == set(), (
        f"C_NAMES lists mirrors laden._lib no longer defines: "
        f"{sorted(set(C_NAMES) - found)}")
    described = set(c_structs())
    assert set(C_NAMES.values()) == described, (
        f"mirrored but not described by C: "
        f"{sorted(set(C_NAMES.values()) - described)}; described by C but "
        f"not mirrored: {sorted(described - set(C_NAMES.values()))}")


@pytest.mark.parametrize("py_name", sorted(mirrors()))
def test_layout_matches_c(py_name):
    c_name = C_NAMES.get(py_name)
    assert c_name is not None, (
        f"laden._lib.{py_name} is a ctypes structure with no C counterpart "
        f"in C_NAMES (test_abi.py); add it there and to src/api/abi.c")
    py = py_layout(getattr(_lib, py_name))
    c = c_layout(c_name)
    assert py == c, side_by_side(py_name, c_name, py, c)


def test_unknown_struct_is_refused():
    size = ctypes.c_uint64(7)
    n = ctypes.c_uint32(7)
    status = _lib.lib.laden_abi_struct(b"laden_nope", ctypes.byref(size),
                                       ctypes.byref(n))
    assert _lib.lib.laden_status_name(status) == b"E_NOTFOUND"
    assert (size.value, n.value) == (0, 0)
    assert "laden_nope" in _lib.last_error()


def test_side_by_side_marks_the_difference():
    # The failure message must show both layouts and where they part.
    class Drifted(ctypes.Structure):
        _fields_ = [("threads", ctypes.c_uint32),
                    ("chunk_bytes", ctypes.c_uint32),
                    ("direct", ctypes.c_int)]
    text = side_by_side("Drifted", "laden_io_config", py_layout(Drifted),
                        c_layout("laden_io_config"))
    assert "size: 12 vs 24  <--" in text
    lines = text.splitlines()
    assert "threads" in lines[3] and not lines[3].endswith("<--")
    assert lines[4].endswith("<--") and "chunk_bytes" in lines[4]


# ---- signatures: every _SIGNATURES entry against include/laden/*.h ---------

INCLUDE = Path(__file__).resolve().parents[2] / "include"

# C's integer types, by name: (bits, signed).  Widths of the platform's own
# types come from ctypes, which has the C compiler's.
_C_INTS = {
    "int8_t": (8, True), "uint8_t": (8, False),
    "int16_t": (16, True), "uint16_t": (16, False),
    "int32_t": (32, True), "uint32_t": (32, False),
    "int64_t": (64, True), "uint64_t": (64, False),
    "char": (8, True), "signed char": (8, True), "unsigned char": (8, False),
    "short": (8 * ctypes.sizeof(ctypes.c_short), True),
    "unsigned short": (8 * ctypes.sizeof(ctypes.c_ushort), False),
    "int": (8 * ctypes.sizeof(ctypes.c_int), True),
    "unsigned": (8 * ctypes.sizeof(ctypes.c_uint), False),
    "unsigned int": (8 * ctypes.sizeof(ctypes.c_uint), False),
    "long": (8 * ctypes.sizeof(ctypes.c_long), True),
    "unsigned long": (8 * ctypes.sizeof(ctypes.c_ulong), False),
    "long long": (64, True), "unsigned long long": (64, False),
    "size_t": (8 * ctypes.sizeof(ctypes.c_size_t), False),
    "ssize_t": (8 * ctypes.sizeof(ctypes.c_ssize_t), True),
    "uintptr_t": (8 * ctypes.sizeof(ctypes.c_void_p), False),
    "intptr_t": (8 * ctypes.sizeof(ctypes.c_void_p), True),
    "ptrdiff_t": (8 * ctypes.sizeof(ctypes.c_void_p), True),
    "_Bool": (8, False), "bool": (8, False),
}
_C_FLOATS = {"float": 32, "double": 64}
_QUALIFIERS = {"const", "volatile", "restrict", "struct", "enum",
               "LADEN_API"}

# A type, described so that C's and ctypes' spellings compare equal when
# they pass the same bits: ("void",), ("int", bits, signed), ("float",
# bits), ("char",) (what a char pointer points to), ("opaque",) (void or a
# struct no mirror describes), ("struct", tag), ("ptr", to), ("fn", ret,
# (args...)).


class Headers:
    """The prototypes and types of the public headers, read with regular
    expressions: the headers are regular (one declaration per statement,
    no macros in types)."""

    def __init__(self, texts):
        text = "\n".join(re.sub(r"/\*.*?\*/|//[^\n]*", " ", t, flags=re.S)
                         for t in texts)
        self.enums = set()
        self.aliases = {}    # typedef name -> the C type it names
        self.structs = {}    # typedef name or tag -> tag, for defined ones
        self.fns = {}        # function-pointer typedef -> ("fn", ...)
        for tag, name in re.findall(
                r"typedef\s+enum\s+(\w+)\s*\{.*?\}\s*(\w+)\s*;", text, re.S):
            self.enums.update((tag, name))
        for tag, name in re.findall(
                r"typedef\s+struct\s+(\w+)\s*\{.*?\}\s*(\w+)\s*;", text,
                re.S):
            self.structs[tag] = self.structs[name] = tag
        for tag in re.findall(r"(?<!typedef )\bstruct\s+(\w+)\s*\{", text):
            self.structs.setdefault(tag, tag)
        self.bodies = dict(re.findall(r"\bstruct\s+(\w+)\s*\{(.*?)\}",
                                      text, re.S))
        self.numbers = {n: int(v, 0) for n, v in re.findall(
            r"#define\s+(\w+)\s+\(?(\d+|0x[0-9a-fA-F]+)u?\)?\s*$", text,
            re.M)}
        for old, name in re.findall(r"typedef\s+(\w+)\s+(\w+)\s*;", text):
            self.aliases[name] = old
        fn_typedefs = re.findall(
            r"typedef\s+([\w\s\*]+?)\s*\(\s*\*\s*(\w+)\s*\)\s*\((.*?)\)\s*;",
            text, re.S)
        self.protos = {}
        for ret, name, args in re.findall(
                r"LADEN_API\s+([\w\s\*]+?)\s*\b(laden_\w+)\s*\((.*?)\)\s*;",
                text, re.S):
            self.protos[name] = (ret, args)
        for ret, name, args in fn_typedefs:
            self.fns[name] = ("fn", self.type_of(ret), self.args_of(args))

    def type_of(self, text):
        """The description of one C type (a parameter's name, if any,
        dropped)."""
        text = text.strip()
        arrays = len(re.findall(r"\[[^\]]*\]", text))
        text = re.sub(r"\[[^\]]*\]", " ", text)
        tokens = re.findall(r"\w+|\*", text)
        stars = tokens.count("*") + arrays
        words = [t for t in tokens if t not in _QUALIFIERS and t != "*"]
        # The last word is the parameter's name unless it is all there is
        # or part of the type's own name.
        if len(words) > 1 and words[-1] not in _C_INTS \
                and words[-1] not in ("int", "long", "short", "char"):
            words = words[:-1]
        base = " ".join(words)
        if base in ("signed", "signed int", "long int"):
            base = {"signed": "int", "signed int": "int",
                    "long int": "long"}[base]
        desc = self.base_of(base, pointed=stars > 0)
        for _ in range(stars):
            desc = ("ptr", desc)
        return desc

    def base_of(self, base, pointed):
        if base == "void":
            return ("opaque",) if pointed else ("void",)
        if base == "char" and pointed:
            return ("char",)
        if base in _C_INTS:
            return ("int",) + _C_INTS[base]
        if base in _C_FLOATS:
            return ("float", _C_FLOATS[base])
        if base in self.enums:
            return ("int", 8 * ctypes.sizeof(ctypes.c_int), True)
        if base in self.fns:
            return self.fns[base]
        if base in self.structs:
            return ("struct", self.structs[base])
        if base in self.aliases:
            return self.base_of(self.aliases[base], pointed)
        if pointed and base.startswith("laden_"):
            return ("opaque",)  # declared, never defined: a handle
        raise ValueError(f"a C type this parser does not know: {base!r}")

    def fields(self, tag):
        """[(name, description)] of struct `tag`'s fields, in order; an
        array field is ("array", length, element)."""
        out = []
        for decl in self.bodies[tag].split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            # "uint64_t a, b": the type is the first declarator's words
            # but its name.
            first, *rest = decl.split(",")
            m = re.match(r"(.*?)(\**\s*\w+(?:\s*\[[^\]]*\])*)$", first)
            base = m[1]
            for d in [m[2], *rest]:
                dims = re.findall(r"\[([^\]]*)\]", d)
                name = re.search(r"\w+", d)[0]
                desc = self.type_of(base + " " + re.sub(r"\[.*", "", d))
                for n in reversed(dims):
                    n = n.strip()
                    desc = ("array", self.numbers.get(n) or int(n, 0), desc)
                out.append((name, desc))
        return out

    def args_of(self, text):
        text = text.strip()
        if text in ("", "void"):
            return ()
        return tuple(self.type_of(a) for a in text.split(","))

    def signature(self, name):
        """(return type, (argument types...)) of function `name`."""
        ret, args = self.protos[name]
        return self.type_of(ret), self.args_of(args)


def read_headers():
    return Headers([p.read_text() for p in
                    [INCLUDE / "laden.h", *sorted(INCLUDE.glob("laden/*.h"))]])


_STRUCT_TAGS = {getattr(_lib, py): c for py, c in C_NAMES.items()}


def py_type(t):
    """The description of a ctypes type, as Headers.type_of describes C's."""
    if t is None:
        return ("void",)
    if t is ctypes.c_char_p:
        return ("ptr", ("char",))
    if t is ctypes.c_void_p:
        return ("ptr", ("opaque",))
    if t in _STRUCT_TAGS:
        return ("struct", _STRUCT_TAGS[t])
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return ("ptr", py_type(t._type_))
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return ("array", t._length_, py_type(t._type_))
    if isinstance(t, type) and issubclass(t, ctypes._CFuncPtr):
        return ("fn", py_type(t._restype_),
                tuple(py_type(a) for a in t._argtypes_))
    code = getattr(t, "_type_", None)
    if code in ("f", "d", "g"):
        return ("float", 8 * ctypes.sizeof(t))
    if code == "c":
        return ("int", 8, True)
    if code == "?":
        return ("int", 8, False)
    if isinstance(code, str) and code in "bBhHiIlLqQ":
        return ("int", 8 * ctypes.sizeof(t), code.islower())
    raise ValueError(f"a ctypes type this test does not know: {t!r}")


def spell(desc):
    """A description, spelt for people."""
    kind = desc[0]
    if kind == "int":
        return f"{'' if desc[2] else 'u'}int{desc[1]}"
    if kind == "float":
        return f"float{desc[1]}"
    if kind == "ptr":
        return spell(desc[1]) + " *"
    if kind == "struct":
        return f"struct {desc[1]}"
    if kind == "array":
        return f"{spell(desc[2])}[{desc[1]}]"
    if kind == "fn":
        return f"{spell(desc[1])} (*)({', '.join(map(spell, desc[2]))})"
    return {"void": "void", "char": "char", "opaque": "void"}[kind]


# Arguments laden._lib declares as c_void_p where C has a typed pointer,
# on purpose: (function, argument number from 1) -> why.
ADDRESSES = {
    ("laden_gguf_dequantize", 4):
        "float *dst: callers pass a numpy or torch buffer's address",
}


def mismatches(signatures, headers, addresses=ADDRESSES):
    """One line per entry of `signatures` (the shape of _lib._SIGNATURES)
    that the headers do not declare as it says."""
    out = []
    for name, (res, args) in signatures.items():
        if name not in headers.protos:
            out.append(f"{name}: declared in laden._lib, not in "
                       f"include/laden*.h")
            continue
        c_ret, c_args = headers.signature(name)
        try:
            p_ret = py_type(res)
            p_args = tuple(py_type(a) for a in args)
        except ValueError as e:
            out.append(f"{name}: {e}")
            continue
        if p_ret != c_ret:
            out.append(f"{name}: returns {spell(c_ret)} in C, "
                       f"{spell(p_ret)} in laden._lib")
        if len(p_args) != len(c_args):
            out.append(f"{name}: takes {len(c_args)} arguments in C, "
                       f"{len(p_args)} in laden._lib")
            continue
        for i, (p, c) in enumerate(zip(p_args, c_args)):
            if (name, i + 1) in addresses and p == ("ptr", ("opaque",)) \
                    and c[0] == "ptr" and c[1][0] in ("int", "float"):
                continue
            if p != c:
                out.append(f"{name}: argument {i + 1} is {spell(c)} in C, "
                           f"{spell(p)} in laden._lib")
    return out


def test_every_declared_signature_matches_the_headers():
    bad = mismatches(_lib._SIGNATURES, read_headers())
    assert bad == [], "\n".join(bad)


def test_every_address_exemption_is_used():
    # An exemption whose argument is no longer a typed pointer is stale.
    h = read_headers()
    for (name, n), why in ADDRESSES.items():
        assert why
        arg = h.signature(name)[1][n - 1]
        assert arg[0] == "ptr" and arg[1][0] in ("int", "float"), (name, n)
        assert _lib._SIGNATURES[name][1][n - 1] is ctypes.c_void_p
    assert mismatches(_lib._SIGNATURES, h, addresses={}) == [
        "laden_gguf_dequantize: argument 4 is float32 * in C, void * in "
        "laden._lib"]


def test_the_headers_are_read_whole():
    # The parser sees every exported function: a declaration it skipped
    # would be one the signature test cannot check.
    h = read_headers()
    text = "\n".join(p.read_text() for p in
                     [INCLUDE / "laden.h", *INCLUDE.glob("laden/*.h")])
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    assert len(h.protos) == text.count("LADEN_API ") - 1  # the #define
    for name in h.protos:
        h.signature(name)  # every type in every prototype is understood
    assert h.signature("laden_abi_const_at") == (
        ("int", 32, True),
        (("int", 32, False), ("ptr", ("ptr", ("char",))),
         ("ptr", ("int", 64, True)), ("ptr", ("int", 32, True))))
    assert h.signature("laden_sched_set_progress")[1][1] == (
        "fn", ("int", 32, True),
        (("ptr", ("opaque",)), ("int", 64, False), ("int", 64, False)))
    assert h.signature("laden_plan_compute")[1][0] == (
        "ptr", ("struct", "laden_plan_input"))


def test_a_wrong_entry_is_found():
    h = read_headers()
    sigs = dict(_lib._SIGNATURES)
    P = ctypes.POINTER
    wrong = {
        # width
        "laden_st_file_size": (ctypes.c_uint32, [ctypes.c_void_p,
                                                 ctypes.c_size_t]),
        # signedness
        "laden_dev_mem_alloc": (_lib.status_t, [ctypes.c_int32,
                                                ctypes.c_int64,
                                                P(ctypes.c_uint64)]),
        # pointer-ness
        "laden_vram_set_budget": (_lib.status_t, [ctypes.c_void_p,
                                                  P(ctypes.c_uint64)]),
        # count
        "laden_host_free": (_lib.status_t, [ctypes.c_void_p]),
        # the wrong struct
        "laden_vram_info": (_lib.status_t, [ctypes.c_void_p,
                                            P(_lib.VbarInfo)]),
        # return type
        "laden_sched_destroy": (_lib.status_t, [ctypes.c_void_p]),
        # no such function
        "laden_no_such_call": (None, []),
    }
    sigs.update(wrong)
    bad = mismatches(sigs, h)
    for name in wrong:
        assert any(line.startswith(name + ":") for line in bad), (name, bad)
    assert len(bad) == len(wrong), bad
    assert ("laden_st_file_size: returns uint64 in C, uint32 in laden._lib"
            in bad)
    assert ("laden_dev_mem_alloc: argument 2 is uint64 in C, int64 in "
            "laden._lib" in bad)
    assert ("laden_host_free: takes 2 arguments in C, 1 in laden._lib"
            in bad)
    assert ("laden_vram_info: argument 2 is struct laden_vram_info * in C, "
            "struct laden_vbar_info * in laden._lib" in bad)


def field_mismatches(cls, c_name, headers):
    """One line per field of mirror `cls` whose type is not its C field's
    (the layout test above checks names, offsets and sizes: a uint64_t
    mirrored as a double passes that one, not this)."""
    c_fields = headers.fields(c_name)
    out = []
    if [f[0] for f in cls._fields_] != [n for n, _ in c_fields]:
        out.append(f"{cls.__name__}: fields {[f[0] for f in cls._fields_]} "
                   f"in laden._lib, {[n for n, _ in c_fields]} in C")
        return out
    for (name, t), (_, c) in zip(cls._fields_, c_fields):
        p = py_type(t)
        if p != c:
            out.append(f"{cls.__name__}.{name} is {spell(c)} in C, "
                       f"{spell(p)} in laden._lib")
    return out


@pytest.mark.parametrize("py_name", sorted(C_NAMES))
def test_field_types_match_the_headers(py_name):
    bad = field_mismatches(getattr(_lib, py_name), C_NAMES[py_name],
                           read_headers())
    assert bad == [], "\n".join(bad)


def test_a_wrong_field_type_is_found():
    h = read_headers()

    class VbarInfo(ctypes.Structure):  # priority as a double: same size
        _fields_ = [(n, t if n != "priority" else ctypes.c_double)
                    for n, t in _lib.VbarInfo._fields_]

    class DevInfo(ctypes.Structure):  # a shorter name, signed total
        _fields_ = [(n, {"name": ctypes.c_char * 64,
                         "total_bytes": ctypes.c_int64}.get(n, t))
                    for n, t in _lib.DevInfo._fields_]

    assert field_mismatches(VbarInfo, "laden_vbar_info", h) == [
        "VbarInfo.priority is uint64 in C, float64 in laden._lib"]
    assert field_mismatches(DevInfo, "laden_dev_info", h) == [
        "DevInfo.name is int8[128] in C, int8[64] in laden._lib",
        "DevInfo.total_bytes is uint64 in C, int64 in laden._lib"]


# ---- constants: laden._lib's are the library's table -----------------------

def c_table():
    """{C name: value} from laden_abi_const_at, read here independently of
    laden._lib's reading."""
    out = {}
    for i in range(_lib.lib.laden_abi_const_count()):
        name = ctypes.c_char_p()
        value = ctypes.c_int64()
        unsigned = ctypes.c_int32()
        _lib.check(_lib.lib.laden_abi_const_at(
            i, ctypes.byref(name), ctypes.byref(value),
            ctypes.byref(unsigned)))
        v = value.value
        if unsigned.value and v < 0:
            v += 1 << 64
        out[name.value.decode()] = v
    return out


def exported_constants():
    """The module-level integers of laden._lib in capitals (ABI_VERSION,
    the binding's own, aside)."""
    return {n: v for n, v in vars(_lib).items()
            if n.isupper() and isinstance(v, int) and n != "ABI_VERSION"}


def test_every_constant_is_the_table_s():
    table = c_table()
    exported = exported_constants()
    assert exported, "laden._lib defines no constants"
    for name, value in exported.items():
        assert "LADEN_" + name in table, (
            f"laden._lib.{name} is not in the library's table "
            f"(src/api/abi.c)")
        assert value == table["LADEN_" + name], name
        # and by name, as C looks it up
        v = ctypes.c_int64()
        u = ctypes.c_int32()
        _lib.check(_lib.lib.laden_abi_const(("LADEN_" + name).encode(),
                                            ctypes.byref(v), ctypes.byref(u)))
        assert value == (v.value % (1 << 64) if u.value else v.value), name
    assert {"LADEN_" + n for n in exported} == set(table)
    assert _lib.CONSTANTS == exported


def test_constants_keep_their_values():
    # What the package used to copy by hand, and now reads from C.
    from laden import graphs, planning, sharing, training
    assert (_lib.TIER_AUTO, _lib.TIER_GPU, _lib.TIER_RAM, _lib.TIER_DISK,
            _lib.TIER_VRAM) == (-1, 0, 1, 2, 3)
    assert (_lib.LOOKAHEAD_DEFAULT, _lib.LOOKAHEAD_MAX) == (2, 63)
    assert _lib.DEVICE_CPU == -1 and _lib.SCHED_CACHE == 1
    assert (_lib.CACHE_AUTO, _lib.CACHE_RESIDENT,
            _lib.CACHE_STREAMING) == (0, 1, 2)
    assert (_lib.COPY_H2D_PINNED, _lib.COPY_H2D_PAGEABLE,
            _lib.COPY_D2H_PINNED) == (0, 1, 2)
    assert planning.AUTO == _lib.PLAN_AUTO == 2**64 - 1
    assert [b for b in range(32) if _lib.lib.laden_plan_warning_text(
        1 << b)] == [0, 1, 2]  # the three PLAN_WARN_* bits, texts in C
    assert (_lib.PLAN_WARN_DISK | _lib.PLAN_WARN_NO_RESERVE |
            _lib.PLAN_WARN_MAX_VRAM_ABOVE_FREE) == 7
    assert graphs.STANDALONE == _lib.CAPTURE_STANDALONE == 1
    assert sharing.FELL_BACK == _lib.SHARE_FELL_BACK == 3
    assert sharing.STATES == {0: None, 1: "made", 2: "attached"}
    assert (training.GRADS_ADD, training.GRADS_PINNED) == (1, 2)


def test_every_constant_the_package_names_is_defined():
    # Names come from the table at run time: one the package uses that the
    # table lacks would fail only on the path that uses it.
    pkg = Path(_lib.__file__).parent
    used = set()
    for path in pkg.glob("*.py"):
        text = path.read_text()
        used.update(re.findall(r"\b_lib\.([A-Z][A-Z0-9_]+)\b", text))
        for names in re.findall(r"from \._lib import \(?([^)\n]+)", text):
            used.update(n.split(" as ")[0].strip() for n in names.split(",")
                        if n.strip()[:1].isupper())
    assert {"TIER_GPU", "PLAN_AUTO", "LOOKAHEAD_DEFAULT",
            "CAPTURE_STANDALONE", "GRADS_ADD"} <= used
    missing = sorted(n for n in used if not hasattr(_lib, n))
    assert missing == [], f"laden uses laden._lib.{missing}, undefined"


# ---- the ABI version, checked at import -------------------------------------

def test_abi_version_is_the_header_s():
    text = (INCLUDE / "laden" / "abi.h").read_text()
    header = int(re.search(r"#define LADEN_ABI_VERSION (\d+)u?", text)[1])
    assert _lib.ABI_VERSION == header
    assert _lib.lib.laden_abi_version() == header


class _FakeLib:
    def __init__(self, version):
        if version is not None:
            self.laden_abi_version = lambda: version


def test_another_version_is_refused():
    with pytest.raises(ImportError) as e:
        _lib._check_version(_FakeLib(_lib.ABI_VERSION + 1), "/x/libladen.so",
                            "")
    msg = str(e.value)
    assert f"ABI version {_lib.ABI_VERSION + 1}" in msg
    assert f"written for ABI version {_lib.ABI_VERSION}" in msg
    assert "/x/libladen.so" in msg
    with pytest.raises(ImportError, match="no laden_abi_version"):
        _lib._check_version(_FakeLib(None), "/x/libladen.so", "")
    _lib._check_version(_FakeLib(_lib.ABI_VERSION), "/x/libladen.so", "")


def _stand_in(tmp_path, body):
    """A shared library built from C `body`, standing in for libladen."""
    cc = next((c for c in ("cc", "gcc", "clang")
               if subprocess.run(["sh", "-c", f"command -v {c}"],
                                 capture_output=True).returncode == 0), None)
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / "standin.c"
    src.write_text(body)
    out = tmp_path / "libstandin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)],
                   check=True)
    return out


def _import_with(library):
    env = dict(os.environ, LADEN_LIBRARY=str(library))
    return subprocess.run([sys.executable, "-c", "import laden"], env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("version", [0, 999])
def test_a_library_of_another_version_fails_at_import(tmp_path, version):
    lib = _stand_in(tmp_path, textwrap.dedent(f"""\
        unsigned laden_abi_version(void) {{ return {version}u; }}
        """))
    r = _import_with(lib)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), r.stderr
    assert f"ABI version {version}," in last
    assert f"written for ABI version {_lib.ABI_VERSION}" in last
    assert f"{lib} (LADEN_LIBRARY)" in last


def test_a_library_without_a_version_fails_at_import(tmp_path):
    lib = _stand_in(tmp_path, "int laden_version_major(void) { return 0; }\n")
    r = _import_with(lib)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0
    assert last.startswith("ImportError: "), r.stderr
    assert "no laden_abi_version" in last and str(lib) in last
