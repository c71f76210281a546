"""Byte sizes: parsing "9GB" / "500MiB" and printing them."""

from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value: Union[int, float, str]) -> int:
    """Bytes from an int or a string such as "9GB", "1.5 GiB", "500MB".
    GB is 10^9, GiB and G are 2^30.  ValueError names a bad value."""
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size {value!r} is negative")
        return int(value)
    m = re.fullmatch(r"\s*(-?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*",
                     str(value))
    if not m or m.group(3).lower() not in _UNITS:
        raise ValueError(
            f"size {value!r} is not understood; write bytes or a number "
            "with a unit such as '9GB', '500MB' or '4GiB'")
    if m.group(1):
        raise ValueError(f"size {value!r} is negative")
    n = int(float(m.group(2)) * _UNITS[m.group(3).lower()])
    if n >= 2**64:  # no byte count in libladen can hold it
        raise ValueError(f"size {value!r} is too large")
    return n


def fmt_bytes(n: float) -> str:
    """Decimal units, three significant digits: 9.70 GB, 512 MB, 12 B."""
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"
