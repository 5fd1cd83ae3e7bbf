"""The one quantized-format resolver: what `bits` and `group_size` mean for a model, for every quantized storage
(the dense and paged quantized caches, the evicting caches' slots, offloaded quantized layers).

`bits` names a KIVI format (8, 4, 2 or "fp8": uniform codes with a scale per group), a rotated one ("k4v2":
4-bit keys and 2-bit values, Lloyd-Max codes after a rotation, one norm per vector; see
`kernels/rotated_format.py`), or any format registered by name (`kernels.kv_format.register_format`; docs/formats.md).
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError
from .kernels.kv_format import KVFormat, registered_format, registered_formats
from .kernels.quant_format import BIT_WIDTHS, DEFAULT_GROUP, QuantFormat
from .kernels.rotated_format import ROTATED_BITS, RotatedFormat
from .model_spec import ModelSpec

_ROTATED = re.compile(r"k(\d)v(\d)")
_WIDTHS = "8, 4, 2 or 'fp8' (int8/int4/int2/fp8), or a rotated format 'k<key bits>v<value bits>' such as 'k4v2'"


def parse_bits(bits) -> int | str:
    """8, 4, 2, "fp8", a rotated name "k<key bits>v<value bits>" (each of 1, 2, 3, 4, 8) or a registered format's
    name (as registered, lower case); also accepts "int8"/"int4"/"int2" and "8"/"4"/"2"."""
    given = bits
    if isinstance(bits, str):
        if registered_format(text := bits.strip().lower()) is not None:
            return text
        text = text.removeprefix("int")
        if (rotated := _ROTATED.fullmatch(text)) is not None:
            key_bits, value_bits = (int(b) for b in rotated.groups())
            if key_bits in ROTATED_BITS and value_bits in ROTATED_BITS:
                return text
            raise ConfigError(f"bits {given!r}: a rotated format takes key and value bits in {ROTATED_BITS}")
        bits = int(text) if text.isdigit() else text
    if isinstance(bits, bool) or bits not in BIT_WIDTHS:
        named = f", or a registered format ({', '.join(registered_formats())})" if registered_formats() else ""
        raise ConfigError(f"bits must be {_WIDTHS}{named}, got {given!r}")
    return bits


def rotated_bits(bits, key_bits: int | None, value_bits: int | None):
    """`bits` as given, or the rotated name of `key_bits`/`value_bits` (one given: both take it)."""
    if key_bits is None and value_bits is None:
        return bits
    if bits is not None:
        raise ConfigError(f"give bits ({bits!r}) or key_bits/value_bits ({key_bits!r}/{value_bits!r}), not both")
    key_bits = value_bits if key_bits is None else key_bits
    value_bits = key_bits if value_bits is None else value_bits
    for side, b in (("key_bits", key_bits), ("value_bits", value_bits)):
        if isinstance(b, bool) or b not in ROTATED_BITS:
            raise ConfigError(f"{side} must be one of {ROTATED_BITS}, got {b!r}")
    return f"k{key_bits}v{value_bits}"


def is_rotated(bits: int | str) -> bool:
    """Whether `bits` names a rotated format (`k<key bits>v<value bits>`), which has no groups."""
    bits = parse_bits(bits)
    return isinstance(bits, str) and _ROTATED.fullmatch(bits) is not None


def any_rotated(*bits: int | str | None) -> bool:
    """Whether any of a cache's formats (None: full precision) is rotated: such a cache codes keys at the model's key
    scale, where it has one (`fitted.key_scale_for`)."""
    return any(b is not None and is_rotated(b) for b in bits)


def resolve_format(
    spec: ModelSpec, bits: int | str | None, group_size: int | None, seed: int = 0
) -> KVFormat | None:
    """The format of `bits`/`group_size` for every layer of a model (None when `bits` is None), checked against
    every head_dim; a KIVI format's default group is `DEFAULT_GROUP`'s, reduced to divide every head_dim. `seed`: a
    rotated format's rotation seed (layer i rotates with seed + i). A registered format is made by its maker, from
    `group_size` (None: its default) and the head dims."""
    if bits is None:
        if group_size is not None:
            raise ConfigError(f"group_size={group_size!r} needs bits (8, 4, 2 or 'fp8'): full precision has no groups")
        return None
    bits = parse_bits(bits)
    head_dims = sorted({layer.head_dim for layer in spec.layers if layer.holds_kv})
    if (make := registered_format(bits) if isinstance(bits, str) else None) is not None:
        fmt = make(group_size, tuple(head_dims))
        if not isinstance(fmt, KVFormat):
            raise ConfigError(f"format {bits!r}: its maker returned {type(fmt).__name__}, not a KVFormat")
    elif is_rotated(bits):
        if group_size is not None:
            raise ConfigError(f"rotated format {bits} has no groups (one norm per vector), got group_size={group_size}")
        key_bits, value_bits = (int(b) for b in _ROTATED.fullmatch(bits).groups())
        fmt = RotatedFormat(key_bits, value_bits, seed)
    else:
        if group_size is None:
            group_size = math.gcd(DEFAULT_GROUP[bits], *head_dims)
        fmt = QuantFormat(bits, group_size)
    for head_dim in head_dims:
        fmt.check_head_dim(head_dim)
    return fmt


def layer_state(fmt: KVFormat, index: int, key_scale=None, **centre):
    """Layer `index`'s state of `fmt` (`KVFormat.make_state`), with its key scale where `fmt` is rotated and
    `key_scale` (a `key_scale.KeyScale`, or None) names the layer; `centre`: a turning centre's `turns` and `origin`."""
    scale = None if key_scale is None or not isinstance(fmt, RotatedFormat) else key_scale.of(index)
    return fmt.make_state(**centre, **({} if scale is None else {"key_scale": scale}))
