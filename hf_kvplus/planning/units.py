"""Memory sizes: parsing "80GB" / "24GiB" and printing byte counts.

Decimal units are powers of 1000 (kB/KB, MB, GB, TB; the suffix B is optional: "80G" = "80GB"), binary
units powers of 1024 (KiB, MiB, GiB, TiB): "24GB" is 24 x 10^9 bytes, "24GiB" 24 x 2^30 = 25,769,803,776.
Units are case-insensitive. Sizes are printed in decimal units (4,294,967,296 bytes is "4.29 GB").
"""

from __future__ import annotations

import re

from ..errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(memory: str | int) -> int:
    """Bytes in `memory`: an int (bytes) or a string such as "80GB" (80 x 10^9) or "24GiB" (24 x 2^30)."""
    if isinstance(memory, bool):
        raise ConfigError(f"a memory size must be bytes or a string like '24GB', got {memory!r}")
    if isinstance(memory, int):
        if memory < 0:
            raise ConfigError(f"a memory size cannot be negative, got {memory} bytes")
        return memory
    match = _PATTERN.match(str(memory))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read memory size {memory!r}: write a number and a unit, decimal (kB, MB, GB, TB: powers "
            "of 1000) or binary (KiB, MiB, GiB, TiB: powers of 1024), e.g. '80GB' or '24GiB'"
        )
    return round(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """`n` bytes in decimal units with two decimals: 4294967296 -> '4.29 GB'."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """A count with thousands separators, one decimal when it is not whole: '131,072', '37,377.5'."""
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"
