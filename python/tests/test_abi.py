"""Every ctypes mirror of a C struct in laden._lib has the layout the C
compiler gave the struct: size, field names in order, offsets and sizes.

The mirrors are found by introspection, so a new one cannot be left out:
it fails here until it is named in C_NAMES and described by the library
(src/core/abi.c)."""

import ctypes
import itertools

import pytest

from laden import _lib

# Python mirror -> C struct tag.
C_NAMES = {
    "StTensor": "laden_st_tensor",
    "DevInfo": "laden_dev_info",
    "IoConfig": "laden_io_config",
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
        f"in C_NAMES (test_abi.py); add it there and to src/core/abi.c")
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
